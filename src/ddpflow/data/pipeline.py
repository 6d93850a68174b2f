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

import numpy as np

from ddpflow.core.errors import UserError
from ddpflow.data import factory, prepared
from ddpflow.data.crops import eval_sizes
from ddpflow.data.loaders import Normalize, TrainBatches, choose_loader, val_batches
from ddpflow.data.mixing import Recipe
from ddpflow.data.sampling import Spec, dataset_labels, spec_of
from ddpflow.seams import sampleweights


@dataclass
class Pipeline:
    train: Any  # .epoch(epoch, start_step) -> batches; len() = batches per epoch of a rank
    val: Callable[[int], Any]  # (batch size) -> this rank's validation batches
    test: Callable[[int], Any] | None  # the same for the test split; None: no test split
    kind: str  # device | dataloader
    reason: str  # why this loader
    num_classes: int | None
    in_channels: int | None  # channels of the data (None: not images)
    train_samples: int
    normalize: Normalize | None = None  # the prepared data's normaliser (None: user dataset)

    def use_channels_last(self, on: bool) -> None:
        """Inputs in the layout the model was given (channels_last: auto decides late)."""
        if self.normalize is not None:
            self.normalize.channels_last = on


def close_workers(batches) -> None:
    """Stop the DataLoader worker processes of `batches` now, not at interpreter exit (a rank
    leaves with os._exit, see cli.entry)."""
    it = getattr(getattr(batches, "loader", None), "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()


def open_pipeline(cfg, dist, meta: dict, batch_size: int, tuned: dict | None,
                  model_channels: Callable[[int], int], channels_last: bool,
                  trace=None, recipe: Recipe | None = None,
                  budget: tuple[int, str] | None = None, accum: int = 1) -> Pipeline:
    """`model_channels(data_channels)`: the channels the model wants (torchvision: 3);
    `recipe`: the stage's batch-level options (erasing, mixup, cutmix); `budget`: (bytes,
    why) the data may take under data.loader auto, the same on every rank (the caller's);
    `accum`: micro-batches per optimizer step (the sampler's slots, loaders.EpochSampler)."""
    if meta.get("kind") == "python":
        return _user_dataset(cfg, dist, meta, batch_size, trace, accum)
    _, arrays = prepared.load(cfg.data_dir)
    train_x, train_y = arrays["train"]
    # what the device loader keeps resident: train and val (test is read once, streamed)
    nbytes = sum(a.nbytes for split in ("train", "val") for a in arrays[split])
    workers, prefetch = cfg.data.num_workers, cfg.data.prefetch_factor
    if cfg.data.loader == "auto" and tuned:
        kind, workers, prefetch = tuned["loader"], tuned["num_workers"], tuned["prefetch_factor"]
        reason = "measured fastest by ddpflow tune"
    else:
        kind, reason = choose_loader(cfg.data.loader, nbytes, dist.device,
                                     cfg.data.device_memory_fraction,
                                     *(budget or (None, "")))
    channels = meta["image_shape"][2]
    normalize = Normalize(meta["mean"], meta["std"], dist.device, model_channels(channels),
                          channels_last)
    train = TrainBatches(kind, train_x, train_y, batch_size, dist.device, dist.world, dist.rank,
                         cfg.seed, cfg.data.augment, normalize, workers, cfg.data.pin_memory,
                         cfg.data.persistent_workers, prefetch, trace=trace,
                         recipe=recipe and replace(recipe, num_classes=meta["num_classes"]),
                         image_size=cfg.data.image_size,
                         max_bad=cfg.data.max_bad_fraction, accum=accum,
                         sampling=sampling(cfg, train_y, len(train_y), meta["num_classes"]),
                         interpolation=cfg.data.interpolation)
    # validation and test: unaugmented, the evaluation's centre crop (held on the device by
    # the device loader; the test split only once, at the stage's end)
    held = {split: val_batches(*arrays[split], dist.device, dist.world, dist.rank, normalize,
                               resident=kind == "device" and split == "val", split=split,
                               max_bad=cfg.data.max_bad_fraction, crop=eval_sizes(cfg.data))
            for split in ("val", "test")}
    test = held["test"] if len(arrays["test"][1]) else None
    return Pipeline(train, held["val"], test, kind, reason, meta["num_classes"], channels,
                    len(train_y), normalize)


def _user_dataset(cfg, dist, meta, batch_size, trace, accum: int) -> Pipeline:
    train_ds, val_ds = factory.dataset(cfg, "train"), factory.dataset(cfg, "val")
    info = factory.describe(train_ds, factory.check_item(train_ds, "train", cfg))
    factory.check_item(val_ds, "val", cfg, info["in_channels"])
    labels = dataset_labels(train_ds, f"data.factory {cfg.data.factory}")
    if labels is None and cfg.data.sampling == "balanced":
        raise UserError(f"data.sampling balanced draws each class equally often, and the "
                        f"data.factory {cfg.data.factory} dataset does not say its samples' "
                        f"classes; give it `targets` (a class index per sample, as "
                        f"torchvision's datasets have), or set data.materialize: true")
    classify = cfg.task.name == "classification"  # targets are class indices: checked
    train = factory.FactoryBatches(train_ds, batch_size, dist.device, dist.world, dist.rank,
                                   cfg.seed,
                                   cfg.data, trace, accum, sampling(
                                       cfg, labels, len(train_ds), info["num_classes"]
                                       or meta.get("num_classes")), labels, classify)

    def held_out(split: str):
        def batches(val_batch: int):
            ds = val_ds if split == "val" else factory.dataset(cfg, "test")  # at the end only
            return factory.val_batches(ds, val_batch, dist.device, dist.world, dist.rank, cfg.data,
                                       split, classify)
        return batches

    test = held_out("test") if meta["counts"].get("test", {}).get("total") else None
    return Pipeline(train, held_out("val"), test, "dataloader",
                    f"data.source python ({cfg.data.factory})",
                    info["num_classes"] or meta.get("num_classes"), info["in_channels"],
                    len(train_ds))


def sampling(cfg, labels, n: int, num_classes: int | None) -> Spec:
    """The stage's sampling (data.sampling...), the weights called and checked here, the
    same on every rank (seams/sampleweights.py)."""
    weights = None
    if cfg.data.sampling == "weights":
        plain = None if labels is None else np.asarray(labels, dtype=np.int64)
        weights = sampleweights.sample_weights(cfg, plain, n)
        sampleweights.agree(weights, cfg.data.sample_weights)
    return spec_of(cfg.data, weights, num_classes)


def check_sampling(cfg, meta: dict) -> None:
    """data.sampling over prepared data, before any rank starts: the weights callable's
    result and every class's samples, one message here rather than one per rank."""
    if meta.get("kind") == "python" or cfg.data.sampling == "uniform":
        return
    _, arrays = prepared.load(cfg.data_dir)
    labels = np.asarray(arrays["train"][1])
    sampling(cfg, labels, len(labels), meta["num_classes"]).draws(labels)
