"""Long-tailed real images trained with data.sampling uniform and balanced, side by side.

    pip install scikit-learn      # the images: sklearn's digits (1,797 scans of handwriting)
    python bench/imbalanced.py [--ratio 100] [--epochs 30] [--seeds 0 1 2]

The digits, 8 x 8 grey scans of ten classes (about 180 each), are cut per class into a
balanced test split (30 a class), a balanced val split (15 a class) and the training rest,
which is made long-tailed: class k keeps n_max x ratio^(-k/9) of its images (100:1 between
the largest and the smallest class by default; the classes' order is shuffled by the
seed). Each seed trains the same smallcnn for the same epochs through the real `ddpflow
prepare` (data.source python, materialize) and `ddpflow launch`, once with data.sampling
uniform and once balanced; printed: the test split's balanced accuracy (the mean of the
per-class recall: on a balanced split, its accuracy) of each, the mean over seeds, their
ratio, and the rarest classes' recall.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml

HERE = Path(__file__).resolve().parent
TEST_PER_CLASS, VAL_PER_CLASS = 30, 15


class Digits:
    """The split of sklearn's digits (16 x 16: each pixel doubled, 0..16 scaled to 0..255)
    as a map-style dataset of (1 x 16 x 16 uint8 tensor, class)."""

    classes = [str(k) for k in range(10)]

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        import torch

        return torch.from_numpy(self.x[i][None]), int(self.y[i])


def splits(ratio: float, seed: int) -> dict:
    """{split: (images, labels)}: balanced test and val splits, a long-tailed train split."""
    from sklearn.datasets import load_digits

    d = load_digits()
    images = (np.kron(d.images, np.ones((2, 2))) * (255 / 16)).round().astype(np.uint8)
    rng = np.random.default_rng(seed)
    order = rng.permutation(10)  # which digit is the head, which the tail
    out = {"train": [], "val": [], "test": []}
    for rank, k in enumerate(order):
        idx = rng.permutation(np.flatnonzero(d.target == k))
        test, val, rest = np.split(idx, [TEST_PER_CLASS, TEST_PER_CLASS + VAL_PER_CLASS])
        keep = max(1, int(round(len(rest) * ratio ** (-rank / 9))))
        for split, part in (("test", test), ("val", val), ("train", rest[:keep])):
            out[split].append(part)
    return {s: (images[np.concatenate(p)], d.target[np.concatenate(p)]) for s, p in out.items()}


def make(split: str, ratio: float = 100.0, seed: int = 0) -> Digits:
    """The dataset factory (data.factory imbalanced:make, data.kwargs ratio and seed)."""
    return Digits(*splits(ratio, seed)[split])


def train(tmp: Path, mode: str, ratio: float, seed: int, epochs: int) -> dict:
    """One run through the real CLI; its stage summary."""
    cfg = {"run": f"{mode}-{seed}", "results_dir": str(tmp / "results"), "seed": seed,
           "deterministic": True,
           "data": {"source": "python", "factory": "imbalanced:make", "code_dir": str(HERE),
                    "kwargs": {"ratio": ratio, "seed": seed}, "materialize": True,
                    "image_size": 16, "sampling": mode,
                    "loader": "device", "augment": {"crop_padding": 2, "flip": False}},
           "hardware": {"nproc_per_node": 1, "threads_per_rank": 1},
           "checkpoint": {"every_steps": 0, "every_epochs": 0},
           "stages": [{"name": "fit", "epochs": epochs, "batch_size": 16, "lr": 0.05,
                       "precision": "fp32", "channels_last": False, "warmup_epochs": 1}]}
    path = tmp / f"{mode}-{seed}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    for cmd in (["prepare"], ["launch", "--stage", "fit"]):
        subprocess.run([sys.executable, "-m", "ddpflow", *cmd, "--config", str(path)],
                       check=True, capture_output=True, text=True)
    return json.loads((tmp / "results" / cfg["run"] / "stages/fit/summary.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ratio", type=float, default=100.0, help="largest : smallest class")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = ap.parse_args()
    counts = np.bincount(splits(args.ratio, args.seeds[0])["train"][1], minlength=10)
    print(f"sklearn digits, 16 px, long-tailed {args.ratio:g}:1 (training images per class, "
          f"largest first: {sorted(counts.tolist(), reverse=True)}), balanced test split of "
          f"{TEST_PER_CLASS} a class; smallcnn, {args.epochs} epochs, 1 rank, fp32")
    got = {"uniform": [], "balanced": []}
    tails = {"uniform": [], "balanced": []}
    with tempfile.TemporaryDirectory() as d:
        for seed in args.seeds:
            for mode in got:
                s = train(Path(d), mode, args.ratio, seed, args.epochs)
                got[mode].append(s["test_balanced_acc"])
                order = np.random.default_rng(seed).permutation(10)
                tails[mode].append(np.mean([s["test_recall"][k] for k in order[-3:]]))
                print(f"  seed {seed} {mode:9s} test balanced acc {got[mode][-1]:.4f}, "
                      f"recall of the 3 rarest classes {tails[mode][-1]:.4f}", flush=True)
    u, b = np.mean(got["uniform"]), np.mean(got["balanced"])
    print(f"mean of {len(args.seeds)} seeds: uniform {u:.4f}, balanced {b:.4f}, "
          f"balanced / uniform {b / u:.3f}; 3 rarest classes' recall: uniform "
          f"{np.mean(tails['uniform']):.4f}, balanced {np.mean(tails['balanced']):.4f}")


if __name__ == "__main__":
    main()
