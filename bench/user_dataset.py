"""A user's own Dataset (data.source: python) vs the prepared-data DataLoader path, on
the same images, through the real `ddpflow launch`.

    python bench/user_dataset.py [--steps 60] [--repeats 2] [--batch 128] [--workers 1]

Both read the same prepared uint8 arrays (synthetic, 32 px) with DataLoader workers,
without augmentation: the prepared path fetches a whole batch per worker call and
normalises on the device; the user path goes through the generic one: the user's
__getitem__ per item, torch's default collate, the model's own scaling. One rank, one
thread, the runs alternating (prepared, user, prepared, user, ...). Prints the ratio of
the mean samples/s (first log interval left out).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from common import launch_stage

HERE = Path(__file__).resolve().parent


def config(tmp: Path, run: str, name: str, args, data: dict, model: dict) -> dict:
    return {
        "run": run, "results_dir": str(tmp / "results"), "log_every_steps": 10,
        "data": {"num_workers": args.workers, "loader": "dataloader", "persistent_workers": True,
                 "augment": {"crop_padding": 0, "flip": False}, **data},
        "model": model,
        "hardware": {"nproc_per_node": 1, "threads_per_rank": 1, "device": "cpu"},
        "checkpoint": {"every_steps": 0, "resume": "never"},
        "stages": [{"name": name, "max_steps": args.steps, "batch_size": args.batch,
                    "lr": 0.05, "precision": "fp32"}],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()
    prep, user = [], []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        synthetic = {"source": "synthetic", "train_size": 8192, "val_size": 256,
                     "image_size": 32}
        arrays = str(tmp / "results" / "prep" / "data")
        factory = {"source": "python", "factory": "user_factory:make",
                   "kwargs": {"folder": arrays}, "code_dir": str(HERE)}
        user_model = {"name": "user_factory:model", "code_dir": str(HERE)}
        for i in range(args.repeats):
            prep.append(launch_stage(tmp, f"p{i}", config(tmp, "prep", f"p{i}", args,
                                                           synthetic, {"name": "smallcnn"}),
                                     prepare=i == 0)["mean_samples_per_s"])
            user.append(launch_stage(tmp, f"u{i}", config(tmp, "user", f"u{i}", args, factory,
                                                           user_model),
                                     prepare=i == 0)["mean_samples_per_s"])
            print(f"repeat {i}: prepared {prep[-1]:.0f} samples/s, user dataset "
                  f"{user[-1]:.0f} samples/s")
    a, b = statistics.median(prep), statistics.median(user)
    print(f"smallcnn, 32px, batch {args.batch}, {args.workers} worker(s), {args.steps} steps, "
          f"1 rank, 1 thread, fp32")
    print(f"prepared DataLoader: {a:.0f} samples/s   user Dataset: {b:.0f} samples/s   "
          f"ratio: {b / a:.3f}")


if __name__ == "__main__":
    main()
