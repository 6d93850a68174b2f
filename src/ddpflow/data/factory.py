"""The data seam: `data.source: python` trains on the user's own map-style Dataset.

`data.factory: package.module:callable` is called once per rank and split,
`factory(split, **data.kwargs)` with split "train", "val" or "test", and returns a
`torch.utils.data.Dataset` (None for "test": no test split) whose items are
`(input, target)`; each of the two is a tensor (or a number), or a tuple / dict of them.
Batches come from torch's DataLoader
(workers, pinned memory, persistent workers, prefetch from data.*) over the same
`EpochSampler` as the prepared data: DistributedSampler order with a start offset, so a
resumed epoch skips exactly the batches already trained. The model is called as
model(input), model(*input) for a tuple, model(**input) for a dict.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Subset

from ddpflow.core.errors import UserError
from ddpflow.data.loaders import EpochSampler
from ddpflow.seams.userimport import add_code_dirs, call, load_callable


def dataset(cfg, split: str):
    """factory(split, **data.kwargs), checked to be a non-empty map-style dataset (or None
    for split "test": the dataset has no test split)."""
    add_code_dirs(cfg)
    fn = load_callable(cfg.data.factory, "data.factory")
    ds = call(fn, "data.factory", args=(split,), kwargs=cfg.data.kwargs)
    if ds is None and split == "test":
        return None
    if not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
        raise UserError(f"data.factory {cfg.data.factory} returned {type(ds).__name__} for "
                        f"split '{split}', not a map-style Dataset (__len__ and __getitem__)")
    try:
        n = len(ds)
    except Exception as e:  # noqa: BLE001 - the user's __len__ raised
        raise UserError(f"data.factory: len() of the '{split}' dataset failed "
                        f"({type(e).__name__}: {e})") from None
    if n == 0:
        raise UserError(f"data.factory {cfg.data.factory} returned an empty '{split}' dataset")
    return ds


def _leaves_ok(x: Any) -> str | None:
    """None if x is a tensor/number or a tuple/list/dict of them, else what it is."""
    if isinstance(x, (torch.Tensor, np.ndarray, numbers.Number)):
        return None
    if isinstance(x, (tuple, list)):
        return next((w for w in map(_leaves_ok, x) if w), None) if x else "an empty tuple"
    if isinstance(x, dict):
        return next((w for w in map(_leaves_ok, x.values()) if w), None) if x else "an empty dict"
    image = "Image" in type(x).__name__
    hint = " (add a transform that makes a tensor, e.g. ToTensor)" if image else ""
    return f"{type(x).__name__}{hint}"


def check_item(ds, split: str, setting: str = "data.factory"):
    """The first item, checked: (input, target) of tensors. Returns it."""
    try:
        item = ds[0]
    except Exception as e:  # noqa: BLE001 - the user's __getitem__ raised
        from ddpflow.seams.userimport import cause

        raise UserError(f"{setting}: reading item 0 of the '{split}' dataset failed "
                        f"({cause(e)})") from None
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise UserError(f"{setting}: items of the '{split}' dataset must be (input, target) "
                        f"pairs; item 0 is {type(item).__name__}"
                        + (f" of length {len(item)}" if isinstance(item, (tuple, list)) else ""))
    bad = _leaves_ok(item)
    if bad:
        raise UserError(f"{setting}: item 0 of the '{split}' dataset holds {bad}, not tensors")
    return item


def describe(ds, item) -> dict:
    """What the rest of ddpflow needs to know of a user dataset (recorded in meta.json)."""
    x = item[0]
    shape = list(x.shape) if isinstance(x, torch.Tensor) else None
    classes = getattr(ds, "classes", None)
    num_classes = getattr(ds, "num_classes", None) or (len(classes) if classes else None)
    return {"input_shape": shape, "num_classes": num_classes,
            "in_channels": shape[0] if shape and len(shape) == 3 else None}


def to_device(batch, device: torch.device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


class FactoryBatches:
    """One rank's training batches of a user dataset, epoch by epoch, resumable mid-epoch."""

    def __init__(self, ds, batch_size, device, world, rank, seed, data_cfg, trace=None):
        self.batch_size, self.device, self.trace = batch_size, device, trace
        self.sampler = EpochSampler(len(ds), world, rank, seed)
        workers = data_cfg.num_workers
        extra = dict(persistent_workers=data_cfg.persistent_workers,
                     prefetch_factor=data_cfg.prefetch_factor) if workers > 0 else {}
        self.loader = DataLoader(ds, batch_size=batch_size, sampler=self.sampler,
                                 num_workers=workers, drop_last=True,
                                 pin_memory=data_cfg.pin_memory and device.type == "cuda",
                                 **extra)
        self.steps_per_epoch = self.sampler.num_samples // batch_size

    def __len__(self):
        return self.steps_per_epoch

    def epoch(self, epoch: int, start_step: int = 0):
        self.sampler.set_epoch(epoch, start_step * self.batch_size)
        for step, batch in enumerate(self.loader, start=start_step):
            if self.trace:
                self.trace.write(f"{epoch} {step}\n")
            yield to_device(batch, self.device)


def val_batches(ds, batch_size, device, world, rank, data_cfg):
    """This rank's strided share of the validation split, in order."""
    part = Subset(ds, range(rank, len(ds), world))
    loader = DataLoader(part, batch_size=batch_size, num_workers=min(data_cfg.num_workers, 2),
                        pin_memory=data_cfg.pin_memory and device.type == "cuda")
    for batch in loader:
        yield to_device(batch, device)


def materialize(ds, split: str) -> tuple[np.ndarray, np.ndarray]:
    """A dataset of fixed-size images (C,H,W uint8, or float in [0, 1]) and integer labels
    as the prepared uint8 NHWC arrays (data.materialize: the device loader then applies)."""
    first = check_item(ds, split, "data.materialize")
    x0 = first[0]
    if not (isinstance(x0, torch.Tensor) and x0.ndim == 3):
        raise UserError(f"data.materialize needs image items (C, H, W tensors); item 0 of "
                        f"'{split}' is {type(x0).__name__}"
                        + (f" of shape {tuple(x0.shape)}" if hasattr(x0, "shape") else ""))
    c, h, w = x0.shape
    images = np.empty((len(ds), h, w, c), dtype=np.uint8)
    labels = np.empty(len(ds), dtype=np.int64)
    for i in range(len(ds)):
        x, y = ds[i]
        if tuple(x.shape) != (c, h, w):
            raise UserError(f"data.materialize: item {i} of '{split}' has shape "
                            f"{tuple(x.shape)}, item 0 has {(c, h, w)}; images must be one size")
        if x.dtype != torch.uint8:
            x = (x.float().clamp(0, 1) * 255).round().to(torch.uint8)
        images[i] = x.permute(1, 2, 0).numpy()
        labels[i] = int(y)
    return images, labels
