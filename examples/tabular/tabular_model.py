"""A user's own model for the tabular data: an MLP with one output."""

from torch import nn


def build(in_features: int = 8, hidden: int = 64) -> nn.Module:
    return nn.Sequential(nn.Linear(in_features, hidden), nn.SiLU(),
                         nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 1))
