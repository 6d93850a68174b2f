"""2 gloo ranks vs 1 rank on the same global batch, one CPU thread per rank.

    python bench/ddp_scaling.py [--steps 60] [--repeats 2] [--model smallcnn]

Both runs go through the real `ddpflow launch` (torchrun) on the same prepared data;
the runs alternate (1, 2, 1, 2, ...) so drifting machine load hits both. Throughput is
each stage's mean samples/s without its first log interval. Prints the speed-up.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from common import launch_stage


def run(tmp: Path, name: str, ranks: int, global_batch: int, args) -> float:
    cfg = {
        "run": "bench", "results_dir": str(tmp / "results"), "log_every_steps": 10,
        "data": {"source": "synthetic", "train_size": 8192, "val_size": 256,
                 "image_size": args.image_size, "loader": "device"},
        "model": {"name": args.model},
        "hardware": {"nproc_per_node": ranks, "threads_per_rank": 1, "device": "cpu"},
        "checkpoint": {"every_steps": 0, "resume": "never"},
        "stages": [{"name": name, "max_steps": args.steps, "batch_size": global_batch // ranks,
                    "lr": 0.05, "precision": args.precision}],
    }
    return launch_stage(tmp, name, cfg)["mean_samples_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=256)
    ap.add_argument("--model", default="smallcnn")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--precision", default="fp32")
    args = ap.parse_args()
    one, two = [], []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for i in range(args.repeats):
            one.append(run(tmp, f"one{i}", 1, args.global_batch, args))
            two.append(run(tmp, f"two{i}", 2, args.global_batch, args))
            print(f"repeat {i}: 1 rank {one[-1]:.0f} samples/s, 2 ranks {two[-1]:.0f} samples/s")
    a, b = statistics.median(one), statistics.median(two)
    print(f"model {args.model}, {args.image_size}px, global batch {args.global_batch}, "
          f"{args.precision}, {args.steps} steps, 1 thread per rank")
    print(f"1 rank: {a:.0f} samples/s   2 ranks: {b:.0f} samples/s   speed-up: {b / a:.2f}x")


if __name__ == "__main__":
    main()
