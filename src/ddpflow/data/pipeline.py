"""One rank's training and validation batches, whichever source the config names.

    prepared arrays   (built-in sources, and a user dataset with data.materialize): the
                      device loader or DataLoader workers over the memory-mapped uint8
                      arrays, augmentation and normalisation on the device (loaders.py)
    a user dataset    (data.source: python): DataLoader over the factory's Dataset
                      (factory.py); the dataset does its own transforms

Both yield `(inputs, targets)` batches already on the training device, in the same
resumable `EpochSampler` order.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from . import factory, prepared
from .loaders import Normalize, TrainBatches, choose_loader, val_batches
from .mixing import Recipe


@dataclass
class Pipeline:
    train: Any  # .epoch(epoch, start_step) -> batches; len() = batches per epoch of a rank
    val: Callable[[int], Any]  # (batch size) -> this rank's validation batches
    kind: str  # device | dataloader
    reason: str  # why this loader
    num_classes: int | None
    in_channels: int | None  # channels of the data (None: not images)
    train_samples: int


def close_workers(batches) -> None:
    """Stop the DataLoader worker processes of `batches` now, not at interpreter exit (a rank
    leaves with os._exit, see cli.entry)."""
    it = getattr(getattr(batches, "loader", None), "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()


def open_pipeline(cfg, d, meta: dict, batch_size: int, tuned: dict | None,
                  model_channels: Callable[[int], int], channels_last: bool,
                  trace=None, recipe: Recipe | None = None) -> Pipeline:
    """`model_channels(data_channels)`: the channels the model wants (torchvision: 3);
    `recipe`: the stage's batch-level options (erasing, mixup, cutmix)."""
    if meta.get("kind") == "python":
        return _user_dataset(cfg, d, meta, batch_size, trace)
    _, arrays = prepared.load(cfg.data_dir)
    (train_x, train_y), (val_x, val_y) = arrays["train"], arrays["val"]
    nbytes = sum(a.nbytes for pair in arrays.values() for a in pair)
    workers, prefetch = cfg.data.num_workers, cfg.data.prefetch_factor
    if cfg.data.loader == "auto" and tuned:
        kind, workers, prefetch = tuned["loader"], tuned["num_workers"], tuned["prefetch_factor"]
        reason = "measured fastest by ddpflow tune"
    else:
        kind, reason = choose_loader(cfg.data.loader, nbytes, d.device,
                                     cfg.data.device_memory_fraction)
    channels = meta["image_shape"][2]
    normalize = Normalize(meta["mean"], meta["std"], d.device, model_channels(channels),
                          channels_last)
    train = TrainBatches(kind, train_x, train_y, batch_size, d.device, d.world, d.rank,
                         cfg.seed, cfg.data.augment, normalize, workers, cfg.data.pin_memory,
                         cfg.data.persistent_workers, prefetch, trace=trace,
                         recipe=recipe and replace(recipe, num_classes=meta["num_classes"]))

    val = val_batches(val_x, val_y, d.device, d.world, d.rank, normalize,
                      resident=kind == "device")

    return Pipeline(train, val, kind, reason, meta["num_classes"], channels, len(train_y))


def _user_dataset(cfg, d, meta, batch_size, trace) -> Pipeline:
    train_ds, val_ds = factory.dataset(cfg, "train"), factory.dataset(cfg, "val")
    info = factory.describe(train_ds, factory.check_item(train_ds, "train"))
    factory.check_item(val_ds, "val")
    train = factory.FactoryBatches(train_ds, batch_size, d.device, d.world, d.rank, cfg.seed,
                                   cfg.data, trace)

    def val(val_batch: int):
        return factory.val_batches(val_ds, val_batch, d.device, d.world, d.rank, cfg.data)

    return Pipeline(train, val, "dataloader", f"data.source python ({cfg.data.factory})",
                    info["num_classes"] or meta.get("num_classes"), info["in_channels"],
                    len(train_ds))
