"""A user's dataset factory and model for bench/user_dataset.py: the prepared arrays of
another run read one item at a time, as a user's own map-style Dataset would."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from ddpflow.seams.models import SmallCNN


class Arrays(Dataset):
    def __init__(self, folder: str, split: str):
        self.images = np.load(f"{folder}/{split}_images.npy", mmap_mode="r")
        self.labels = np.load(f"{folder}/{split}_labels.npy", mmap_mode="r")

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        x = torch.from_numpy(np.ascontiguousarray(self.images[i])).permute(2, 0, 1)
        return x, int(self.labels[i])


def make(split: str, folder: str) -> Dataset:
    return Arrays(folder, split)


class Scaled(nn.Module):
    """uint8 images to floats in [-1, 1], then the built-in smallcnn."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.net = SmallCNN(num_classes)

    def forward(self, x):
        return self.net(x.float().div_(127.5).sub_(1.0))


def model(num_classes: int = 10) -> nn.Module:
    return Scaled(num_classes)
