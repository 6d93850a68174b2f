"""A user's own dataset factory: tabular regression, nothing like an image.

ddpflow calls `make(split, **data.kwargs)` once per rank and split ("train", "val", "test"); it
returns a map-style Dataset whose items are (features, target) tensors.
"""

import torch
from torch.utils.data import Dataset


class Waves(Dataset):
    """y = sum_j a_j sin(b_j x_j) + noise, features uniform in [-2, 2]."""

    def __init__(self, n: int, features: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        coef = torch.Generator().manual_seed(1234)  # the same function for every split
        a = torch.rand(features, generator=coef) + 0.5
        b = torch.rand(features, generator=coef) + 0.5
        self.x = torch.rand(n, features, generator=g) * 4 - 2
        self.y = (a * torch.sin(b * self.x)).sum(1, keepdim=True)
        self.y += 0.05 * torch.randn(n, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def make(split: str, train_size: int = 4096, val_size: int = 1024, features: int = 8,
         seed: int = 0) -> Dataset:
    if split == "train":
        return Waves(train_size, features, seed)
    # val and test: other draws of the same function (test is read once per stage end)
    return Waves(val_size, features, seed + (1 if split == "val" else 2))
