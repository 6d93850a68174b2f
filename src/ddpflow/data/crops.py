"""Crops of stored images, batched on the training device.

Images are stored at `data.store_size` (a square, >= image_size), so training can look at
a different part of each image every epoch (FFCV-style "store big, crop on the fly"):

    random_resized_crop   training: per sample a random box (a share `scale` of the area,
                          width/height in `ratio`, torchvision's 10 tries then the centre)
                          and a mirror, resampled to image_size by one bilinear grid_sample
                          over the whole batch (an affine map per sample; 2.3x faster than
                          roi_align on a 2-core CPU)
    center_crop           validation, test, evaluate and predict: resize to
                          image_size / 0.875, keep the centre image_size (the standard
                          evaluation crop); nothing when the stored size is the image size

Both act on normalised float NCHW batches (the affine normalisation commutes with the
bilinear resampling inside the image).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

EVAL_CROP_FRACTION = 0.875  # the centre crop keeps 87.5% of the side (224 of 256)
TRIES = 10  # boxes drawn per sample before falling back to the centre (as torchvision)


def eval_resize(image_size: int) -> int:
    """The side the evaluation crop resizes to before it keeps the centre image_size."""
    return int(round(image_size / EVAL_CROP_FRACTION))


def center_crop(x: torch.Tensor, image_size: int) -> torch.Tensor:
    """[b, c, s, s] -> [b, c, image_size, image_size]: resize to image_size / 0.875 (bilinear,
    antialiased), then the centre; unchanged when s == image_size."""
    s = x.shape[-1]
    if s == image_size:
        return x
    r = eval_resize(image_size)
    if s != r:
        x = F.interpolate(x, size=(r, r), mode="bilinear", antialias=True, align_corners=False)
    o = (r - image_size) // 2
    return x[..., o:o + image_size, o:o + image_size]


def _boxes(b: int, h: int, w: int, scale, ratio, g: torch.Generator, device):
    """[b, 4] integer boxes (left, top, width, height): torchvision's RandomResizedCrop rule,
    drawn for the whole batch at once (TRIES candidates per sample, the first that fits)."""
    area = torch.empty(b, TRIES, device=device).uniform_(scale[0], scale[1], generator=g)
    logr = torch.empty(b, TRIES, device=device).uniform_(math.log(ratio[0]),
                                                         math.log(ratio[1]), generator=g)
    target = area * (h * w)
    cw = torch.sqrt(target * torch.exp(logr)).round()
    ch = torch.sqrt(target / torch.exp(logr)).round()
    fits = (cw >= 1) & (ch >= 1) & (cw <= w) & (ch <= h)
    first = fits.to(torch.uint8).argmax(1, keepdim=True)  # the first try that fits
    cw, ch = cw.gather(1, first).squeeze(1), ch.gather(1, first).squeeze(1)
    # none fits: the whole image, cut to the nearest allowed ratio (torchvision's fallback)
    r = w / h
    fw, fh = ((w, round(w / ratio[0])) if r < ratio[0] else
              (round(h * ratio[1]), h) if r > ratio[1] else (w, h))
    ok = fits.any(1)
    cw = torch.where(ok, cw, torch.full_like(cw, fw))
    ch = torch.where(ok, ch, torch.full_like(ch, fh))
    u = torch.rand(b, 2, device=device, generator=g)
    top = torch.where(ok, (u[:, 0] * (h - ch + 1)).floor(), torch.full_like(ch, (h - fh) // 2))
    left = torch.where(ok, (u[:, 1] * (w - cw + 1)).floor(), torch.full_like(cw, (w - fw) // 2))
    return torch.stack([left, top, cw, ch], 1)


def random_resized_crop(x: torch.Tensor, size: int, scale, ratio, flip: bool,
                        g: torch.Generator) -> torch.Tensor:
    """[b, c, h, w] float -> [b, c, size, size]: one random box per sample resampled to size,
    mirrored with probability 0.5 when `flip`; the box and the mirror are one affine map per
    sample, applied to the whole batch by one bilinear grid_sample."""
    b, _, h, w = x.shape
    left, top, bw, bh = _boxes(b, h, w, scale, ratio, g, x.device).unbind(1)
    mirror = torch.ones(b, device=x.device)
    if flip:
        mirror = torch.where(torch.rand(b, device=x.device, generator=g) < 0.5, -1.0, 1.0)
    # output pixel (-1..1, edges) -> input: the box's centre plus half its extent, in the
    # input's -1..1 coordinates (align_corners=False: pixel i spans [i, i + 1])
    theta = torch.zeros(b, 2, 3, device=x.device, dtype=x.dtype)
    theta[:, 0, 0] = bw / w * mirror
    theta[:, 0, 2] = (left + bw / 2) / w * 2 - 1
    theta[:, 1, 1] = bh / h
    theta[:, 1, 2] = (top + bh / 2) / h * 2 - 1
    grid = F.affine_grid(theta, [b, x.shape[1], size, size], align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)
