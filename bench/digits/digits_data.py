"""sklearn's handwritten digits (1797 images of 8 x 8 pixels, 10 classes, shipped inside
scikit-learn: no download) as a user's dataset factory, for bench/sweep_asha.py.

    data: {source: python, factory: digits_data:make, code_dir: bench/digits}

One fixed split of the 1797 images (seed 0, whatever the run's seed): 1257 train, 270 val,
270 test. Items are (1 x 8 x 8 float image in [0, 1], class index).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

SPLITS = {"train": (0, 1257), "val": (1257, 1527), "test": (1527, 1797)}


class Digits(Dataset):
    def __init__(self, split: str):
        from sklearn.datasets import load_digits

        d = load_digits()
        order = np.random.RandomState(0).permutation(len(d.target))
        lo, hi = SPLITS[split]
        pick = order[lo:hi]
        self.x = torch.from_numpy(d.images[pick].astype(np.float32) / 16.0).unsqueeze(1)
        self.y = torch.from_numpy(d.target[pick].astype(np.int64))

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def make(split: str) -> Dataset:
    return Digits(split)
