"""GPU only: DistributedDataParallel vs DataParallel, and 1 vs N ranks, on this node's GPUs.

    python bench/ddp_vs_dp.py [--model resnet50] [--image-size 160] [--batch 128] [--steps 60]

Every run goes through `ddpflow launch` on the same prepared synthetic data; the global
batch is the same for all (batch x GPUs). Prints samples/s and the ratios:
DDP(N) / DP(N), DDP(N) / DDP(1) and the per-GPU scaling efficiency.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from common import launch_stage


def run(tmp: Path, name: str, ranks: int, strategy: str, global_batch: int, args) -> float:
    gpus = torch.cuda.device_count()
    cfg = {"run": "bench", "results_dir": str(tmp / "results"), "log_every_steps": 10,
           "data": {"train_size": 16384, "val_size": 512, "image_size": args.image_size,
                    "loader": "device"},
           "model": {"name": args.model},
           "hardware": {"device": "cuda", "nproc_per_node": ranks if strategy == "ddp" else 1,
                        "devices": list(range(ranks if ranks <= gpus else gpus))},
           "checkpoint": {"every_steps": 0, "resume": "never"},
           "stages": [{"name": name, "max_steps": args.steps, "strategy": strategy,
                       "batch_size": global_batch // (ranks if strategy == "ddp" else 1),
                       "precision": "bf16", "channels_last": True, "lr": 0.1}]}
    return launch_stage(tmp, name, cfg)["mean_samples_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--image-size", type=int, default=160)
    ap.add_argument("--batch", type=int, default=128, help="per GPU")
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    n = torch.cuda.device_count()
    if n == 0:
        sys.exit("bench/ddp_vs_dp.py needs at least one CUDA GPU")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        one = run(tmp, "ddp1", 1, "ddp", args.batch, args)
        ddp = run(tmp, "ddpN", n, "ddp", args.batch * n, args)
        dp = run(tmp, "dpN", n, "dp", args.batch * n, args)
    print(f"{args.model} {args.image_size}px bf16 channels_last, {args.batch}/GPU, {n} GPU(s)")
    print(f"  DDP 1 GPU {one:.0f}  DDP {n} GPUs {ddp:.0f}  DP {n} GPUs {dp:.0f} samples/s")
    print(f"  DDP/DP {ddp / dp:.2f}x   DDP {n}/1 {ddp / one:.2f}x   "
          f"scaling efficiency {ddp / (one * n):.1%}")


if __name__ == "__main__":
    main()
