"""Crops of stored images, batched on the training device.

Images are stored at `data.store_size` (a square, >= image_size), so training can look at
a different part of each image every epoch (FFCV-style "store big, crop on the fly"):

    random_resized_crop   training: per sample a random box (a share `scale` of the area,
                          width/height in `ratio`, torchvision's 10 tries then the centre)
                          and a mirror, resampled to the size as torchvision's
                          resize(antialias=True) resamples the cropped box: per sample
                          a row and a column weight matrix (its antialiased bilinear
                          filter), the whole batch in two batched matmuls
    center_crop           validation, test, evaluate and predict: resize to
                          image_size / 0.875, keep the centre image_size (the standard
                          evaluation crop); nothing when the stored size is the image size.
                          data.eval_resize_size and eval_crop_size set the two sides
                          (`EvalCrop`, torchvision's --val-resize-size / --val-crop-size)

Every resampling filters with data.interpolation: bilinear (a triangle), or bicubic (PIL's
and PyTorch's antialiased cubic, a = -0.5), widened by the scale when shrinking.

Progressive resizing passes the epoch's size to either crop: one resampling, straight to
that size (not a crop at image_size resized again).

Both act on normalised float NCHW batches (the affine normalisation commutes with the
bilinear resampling inside the image).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

EVAL_CROP_FRACTION = 0.875  # the centre crop keeps 87.5% of the side (224 of 256)
TRIES = 10  # boxes drawn per sample before falling back to the centre (as torchvision)
CUBIC_A = -0.5  # the cubic filter of antialiased bicubic resampling (PyTorch, PIL)


def eval_resize(image_size: int) -> int:
    """The side the evaluation crop resizes to before it keeps the centre image_size."""
    return int(round(image_size / EVAL_CROP_FRACTION))


def _resample(x: torch.Tensor, size: int, mode: str) -> torch.Tensor:
    return F.interpolate(x, size=(size, size), mode=mode, antialias=True, align_corners=False)


def center_crop(x: torch.Tensor, image_size: int, out: int | None = None,
                resize: int | None = None, mode: str = "bilinear") -> torch.Tensor:
    """[b, c, s, s] -> [b, c, out, out] (out: image_size unless progressive resizing trains
    smaller): resize to `resize` (None: out / 0.875; antialiased), then the centre; where
    no margin is stored (s == image_size, resize None) the whole image, resized to out;
    unchanged when s == out == image_size. One resampling either way."""
    s = x.shape[-1]
    out = out or image_size
    if s == image_size and resize is None:
        return x if out == s else _resample(x, out, mode)
    r = resize or eval_resize(out)
    if s != r:
        x = _resample(x, r, mode)
    o = (r - out) // 2
    return x[..., o:o + out, o:o + out]


@dataclass(frozen=True)
class EvalCrop:
    """The evaluation's crop: resize to `resize` (None: crop / 0.875, or nothing where the
    stored image is the crop), keep the centre `crop`, with the `mode` filter."""

    crop: int
    resize: int | None = None
    mode: str = "bilinear"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return center_crop(x, self.crop, resize=self.resize, mode=self.mode)

    def describe(self) -> str:
        side = self.resize or eval_resize(self.crop)
        when = "" if self.resize else f" unless already {self.crop}"
        return f"resize to {side} ({self.mode}, antialiased){when}, centre crop {self.crop}"


def eval_sizes(data) -> EvalCrop:
    """The evaluation crop of a config's data section (eval_crop_size null: image_size)."""
    return EvalCrop(data.eval_crop_size or data.image_size, data.eval_resize_size,
                    data.interpolation)


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


def _cubic(t: torch.Tensor) -> torch.Tensor:
    """The cubic convolution filter (a = CUBIC_A) at distances |t| (0 from 2 on)."""
    t, a = t.abs(), CUBIC_A
    near = ((a + 2) * t - (a + 3)) * t * t + 1
    far = ((a * t - 5 * a) * t + 8 * a) * t - 4 * a
    return torch.where(t < 1, near, torch.where(t < 2, far, torch.zeros_like(t)))


def _axis_weights(start, length, size: int, extent: int, mode: str = "bilinear"):
    """[b, size, extent]: per sample, the weights that resample pixels start..start+length
    of an axis (of extent pixels) to size pixels as PyTorch's antialiased resize
    (torchvision's resize(antialias=True)) resamples that span cut out: a triangle filter
    (bilinear) or a cubic one (bicubic), widened by the scale when shrinking, normalised
    over the span's pixels."""
    b, dev = start.shape[0], start.device
    length = length.view(b, 1, 1).float()
    scale = length / size  # input pixels per output pixel
    support = scale.clamp(min=1.0)  # the filter's widening, in input pixels
    centre = scale * (torch.arange(size, device=dev).view(1, size, 1) + 0.5)
    k = torch.arange(extent, device=dev).view(1, 1, extent) - start.view(b, 1, 1)
    t = (k + 0.5 - centre) / support
    w = _cubic(t) if mode == "bicubic" else (1 - t.abs()).clamp(min=0)
    w = w * ((k >= 0) & (k < length))
    return w / w.sum(-1, keepdim=True)


def crop_resize(x: torch.Tensor, boxes: torch.Tensor, size: int,
                mirror: torch.Tensor | None = None, mode: str = "bilinear") -> torch.Tensor:
    """[b, c, h, w] float, boxes [b, 4] (left, top, width, height) -> [b, c, size, size]:
    each sample's box resampled to size (antialiased when shrinking, as torchvision), then
    mirrored where `mirror` ([b] bool). Separable: rows then columns, as batched matmuls."""
    b, _, h, w = x.shape
    left, top, bw, bh = boxes.unbind(1)
    rows = _axis_weights(top, bh, size, h, mode).to(x.dtype)  # [b, size, h]
    cols = _axis_weights(left, bw, size, w, mode).to(x.dtype)  # [b, size, w]
    if mirror is not None:
        cols = torch.where(mirror.view(b, 1, 1), cols.flip(1), cols)
    out = torch.matmul(torch.matmul(rows.unsqueeze(1), x), cols.unsqueeze(1).transpose(-1, -2))
    if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        out = out.contiguous(memory_format=torch.channels_last)  # the layout it was given
    return out


def random_resized_crop(x: torch.Tensor, size: int, scale, ratio, flip: bool,
                        g: torch.Generator, mode: str = "bilinear") -> torch.Tensor:
    """[b, c, h, w] float -> [b, c, size, size]: one random box per sample resampled to size
    (crop_resize: antialiased, one resampling), mirrored with probability 0.5 when `flip`."""
    b, _, h, w = x.shape
    boxes = _boxes(b, h, w, scale, ratio, g, x.device)
    mirror = torch.rand(b, device=x.device, generator=g) < 0.5 if flip else None
    return crop_resize(x, boxes, size, mirror, mode)
