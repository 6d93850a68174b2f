"""The data seam: `data.source: python` trains on the user's own map-style Dataset.

`data.factory: package.module:callable` is called once per rank and split,
`factory(split, **data.kwargs)` with split "train", "val" or "test", and returns a
`torch.utils.data.Dataset` (None for "test": no test split) whose items are
`(input, target)`; each of the two is a tensor (or a number), or a tuple / dict of them.
Batches come from torch's DataLoader
(workers, pinned memory, persistent workers, prefetch from data.*) over the same
`EpochSampler` as the prepared data: slots of one permutation with a start offset, so a
resumed epoch skips exactly the batches already trained. The model is called as
model(input), model(*input) for a tuple, model(**input) for a dict.

Items keep the seam contract (seams/contract.py), probed on the first, a middle and the
last item of each split (every item with data.materialize): finite, of one shape, a 3-D
input a C x H x W image, a class index as the target of the built-in classification task.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import DataLoader, Subset

from ddpflow.core.errors import UserError
from ddpflow.data import stream
from ddpflow.data.sampling import EpochSampler, Spec
from ddpflow.seams import contract
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


def num_classes_of(ds) -> int | None:
    """The class count a dataset declares (`num_classes`, or `classes`), or None."""
    classes = getattr(ds, "classes", None)
    return getattr(ds, "num_classes", None) or (len(classes) if classes else None)


def check_item(ds, split: str, cfg, in_channels: int | None = None):
    """The first, a middle and the last item, checked against the seam contract
    (contract.check_items: (input, target) pairs of finite tensors of one shape, C x H x W
    images, class indices for the built-in classification task). Returns the first."""
    setting = "data.materialize" if cfg.data.materialize else "data.factory"
    return contract.check_items(ds, f"{setting} {cfg.data.factory}", split, in_channels,
                                num_classes_of(ds), classify=cfg.task.name == "classification",
                                materialize=cfg.data.materialize)


def describe(ds, item) -> dict:
    """What the rest of ddpflow needs to know of a user dataset (recorded in meta.json)."""
    x = item[0]
    shape = list(x.shape) if isinstance(x, torch.Tensor) else None
    return {"input_shape": shape, "num_classes": num_classes_of(ds),
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

    def __init__(self, ds, batch_size, device, world, rank, seed, data_cfg, trace=None,
                 accum: int = 1, sampling: Spec | None = None, labels=None,
                 classify: bool = False):
        self.batch_size, self.device, self.trace = batch_size, device, trace
        # every batch checked against the seam contract (stream.py): the dataset's name and
        # class count, and whether its targets are class indices (the classification task)
        self.check = (f"data.factory {data_cfg.factory}", "train", num_classes_of(ds), classify)
        sampling = sampling or Spec()  # data.sampling over the dataset's `targets`
        self.sampler = EpochSampler(len(ds), world, rank, seed, batch_size, accum,
                                    sampling.draws(labels, len(ds)), sampling.repeats)
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
        order = list(self.sampler)  # the dataset index of each sample the loader reads
        name, split, classes, classify = self.check
        batches = stream.checked(self.loader, self.loader.dataset, order, self.batch_size,
                                 name, split, classes, classify)
        for step, batch in enumerate(batches, start=start_step):
            if self.trace:
                self.trace.write(f"{epoch} {step}\n")
            yield to_device(batch, self.device)


def val_batches(ds, batch_size, device, world, rank, data_cfg, split: str = "val",
                classify: bool = False):
    """This rank's strided share of a held-out split, in order, each batch checked as a
    training batch is (stream.py)."""
    indices = range(rank, len(ds), world)
    loader = DataLoader(Subset(ds, indices), batch_size=batch_size,
                        num_workers=min(data_cfg.num_workers, 2),
                        pin_memory=data_cfg.pin_memory and device.type == "cuda")
    for batch in stream.checked(loader, ds, indices, batch_size,
                                f"data.factory {data_cfg.factory}", split, num_classes_of(ds),
                                classify):
        yield to_device(batch, device)


def materialize(ds, split: str, cfg) -> tuple[np.ndarray, np.ndarray]:
    """A dataset of fixed-size images (C,H,W uint8, or float in [0, 1]) and integer labels
    as the prepared uint8 NHWC arrays (data.materialize: the device loader then applies).
    Every item is read, so every item is checked (contract.check_item)."""
    name, n = f"data.materialize {cfg.data.factory}", num_classes_of(ds)
    first = contract.check_items(ds, name, split, None, n, materialize=True)
    c, h, w = first[0].shape
    images = np.empty((len(ds), h, w, c), dtype=np.uint8)
    labels = np.empty(len(ds), dtype=np.int64)
    for i in range(len(ds)):
        item = contract.read_item(ds, i, name, split)
        contract.check_item(item, i, name, split, c, n, materialize=True)
        x, y = torch.as_tensor(item[0]), item[1]
        if tuple(x.shape) != (c, h, w):
            raise UserError(f"{name}: item {i} of '{split}' has shape {tuple(x.shape)}, item "
                            f"0 has {(c, h, w)}; images must be one size")
        if x.dtype != torch.uint8:
            x = (x.float() * 255).round().to(torch.uint8)
        images[i] = x.permute(1, 2, 0).numpy()
        labels[i] = int(y)
    return images, labels
