"""The per-stage recipe options that act on whole training batches on the device, after
normalisation: random erasing, mixup and cutmix (`stages[].random_erasing`, `mixup_alpha`,
`cutmix_alpha`), and progressive resizing (`stages[].progressive_resize`).

Each is one batched tensor operation (no per-sample Python) drawn from the step's generator
(seeded by seed, epoch, step and rank, see loaders.step_generator), so both loaders give the
same batches and a resume needs no saved RNG. Mixup and cutmix return soft targets (a
probability per class), which the classification task's cross-entropy takes as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Recipe:
    random_erasing: float = 0.0  # probability per image of one erased box
    mixup_alpha: float = 0.0  # Beta(alpha, alpha) for the mixing weight; 0 = off
    cutmix_alpha: float = 0.0
    num_classes: int | None = None  # for the soft targets

    @property
    def active(self) -> bool:
        return bool(self.random_erasing or self.mixup_alpha or self.cutmix_alpha)


def random_erase(x: torch.Tensor, p: float, g: torch.Generator) -> torch.Tensor:
    """torchvision's RandomErasing (area 2-33 % of the image, aspect 0.3-3.3, value 0 =
    the dataset mean after normalisation) for a whole NCHW batch: one box per chosen image,
    one masked fill. A box that would not fit is clipped to the image (torchvision draws
    again up to 10 times instead)."""
    b, _, h, w = x.shape
    dev = x.device
    u = torch.rand(6, b, device=dev, generator=g)
    area = h * w * (0.02 + 0.31 * u[0])
    ratio = torch.exp(math.log(0.3) + (math.log(3.3) - math.log(0.3)) * u[1])
    eh = (area * ratio).sqrt().round().clamp(1, h)
    ew = (area / ratio).sqrt().round().clamp(1, w)
    y0 = (u[2] * (h - eh + 1)).floor()
    x0 = (u[3] * (w - ew + 1)).floor()
    on = (u[4] < p).view(b, 1, 1)
    rows = torch.arange(h, device=dev).view(1, h, 1)
    cols = torch.arange(w, device=dev).view(1, 1, w)
    inside = ((rows >= y0.view(b, 1, 1)) & (rows < (y0 + eh).view(b, 1, 1))
              & (cols >= x0.view(b, 1, 1)) & (cols < (x0 + ew).view(b, 1, 1)))
    return x.masked_fill((on & inside).unsqueeze(1), 0.0)


def _lam(alpha: float, seed: tuple) -> float:
    """The batch's mixing weight, from Beta(alpha, alpha), seeded by the batch's position."""
    return float(np.random.default_rng(seed).beta(alpha, alpha))


def mix(x: torch.Tensor, y: torch.Tensor, r: Recipe, seed: tuple):
    """Mixup or cutmix of the batch with itself reversed (timm's pairing); with both on,
    each batch takes one of them with equal chance. Returns (inputs, soft targets)."""
    rng = np.random.default_rng(seed)
    use_cutmix = r.cutmix_alpha > 0 and (r.mixup_alpha == 0 or rng.random() < 0.5)
    lam = _lam(r.cutmix_alpha if use_cutmix else r.mixup_alpha, (*seed, 1))
    other = x.flip(0)
    if use_cutmix:  # paste a box of area (1 - lam) from the partner; lam = what is left
        b, _, h, w = x.shape
        cut = math.sqrt(1.0 - lam)
        ch, cw = int(round(h * cut)), int(round(w * cut))
        cy, cx = int(rng.integers(0, h)), int(rng.integers(0, w))
        y0, y1 = max(cy - ch // 2, 0), min(cy + (ch - ch // 2), h)
        x0, x1 = max(cx - cw // 2, 0), min(cx + (cw - cw // 2), w)
        x = x.clone()
        x[:, :, y0:y1, x0:x1] = other[:, :, y0:y1, x0:x1]
        lam = 1.0 - (y1 - y0) * (x1 - x0) / (h * w)
    else:  # lam * x + (1 - lam) * partner, in one pass over the partner's copy
        x = other.lerp_(x, lam)
    onehot = F.one_hot(y, r.num_classes).to(x.dtype if x.is_floating_point() else torch.float)
    return x, onehot * lam + onehot.flip(0) * (1.0 - lam)


def apply(x: torch.Tensor, y: torch.Tensor, r: Recipe, g: torch.Generator, seed: tuple):
    """The stage's batch-level options, in torchvision's reference order: erase, then mix."""
    if r.random_erasing:
        x = random_erase(x, r.random_erasing, g)
    if r.mixup_alpha or r.cutmix_alpha:
        x, y = mix(x, y, r, seed)
    return x, y


def progressive_sizes(p: dict, epochs: int):
    """FFCV-style progressive resizing: the training size of epoch e grows linearly from
    `start_size` (first epoch) to `end_size` (last epoch); returns epoch -> size."""
    start, end = p["start_size"], p["end_size"]

    def size_at(epoch: int) -> int:
        frac = min(epoch, epochs - 1) / max(epochs - 1, 1)
        return int(round(start + (end - start) * frac))

    return size_at


def resize(x: torch.Tensor, size: int) -> torch.Tensor:
    """A batch resampled to size x size (bilinear, antialiased when shrinking)."""
    if x.shape[-1] == size and x.shape[-2] == size:
        return x
    return F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False,
                         antialias=size < max(x.shape[-2:]))
