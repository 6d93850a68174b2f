"""Automatic augmentation policies (data.augment.policy), torchvision.transforms.v2's own:

    trivialaugment   TrivialAugmentWide: one operation of 14 per image, a random strength
    randaugment      RandAugment(num_ops, magnitude): num_ops operations at one strength
    augmix           AugMix(severity): a mixture of augmentation chains with the original

A policy acts per sample (each image its own operations), on the stored uint8 image before
the crop and flip (its geometric operations see the stored square, a little larger than
the crop; torchvision's recipes run it after the crop). Where it runs:

    loader dataloader   in the DataLoader workers, beside the reading (parallel to the step
                        and to each other: bench/augment.py --policies measures its cost)
    loader device       on the device, one sample after another before the batched crop

Each sample's operations come from a seed of its place in the epoch (EpochSampler.keys):
the CPU generator is seeded with it inside a fork of the RNG state, so the policy draws the
same whichever loader, rank or resumed run applies it, and nothing else's random stream
moves.
"""

from __future__ import annotations

from typing import Callable

import torch

NAMES = ("trivialaugment", "randaugment", "augmix")
DEFAULT_MAGNITUDE = {"randaugment": 9, "augmix": 3}
MAGNITUDE_RANGE = {"randaugment": (0, 30), "augmix": (1, 10)}  # torchvision's bounds
DEFAULT_NUM_OPS = 2


def build(aug) -> Callable | None:
    """The policy of `aug` (data.augment) as a torchvision transform of a C x H x W uint8
    tensor, or None."""
    name = getattr(aug, "policy", None)
    if name is None:
        return None
    from torchvision.transforms import v2  # only when a policy is on: seconds of import

    magnitude = aug.magnitude if aug.magnitude is not None else DEFAULT_MAGNITUDE.get(name)
    if name == "trivialaugment":
        return v2.TrivialAugmentWide()
    if name == "randaugment":
        return v2.RandAugment(num_ops=aug.num_ops or DEFAULT_NUM_OPS, magnitude=magnitude)
    return v2.AugMix(severity=magnitude)


def apply(policy: Callable, x: torch.Tensor, keys: list[int]) -> torch.Tensor:
    """uint8 N x H x W x C images, each through `policy` with the CPU generator seeded by
    its key (the device's generator kept as it was: AugMix draws its weights there)."""
    if not len(keys):
        return x
    out = torch.empty_like(x)
    devices = [x.device] if x.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        for i, key in enumerate(keys):
            torch.manual_seed(key)
            out[i] = policy(x[i].permute(2, 0, 1)).permute(1, 2, 0)
    return out
