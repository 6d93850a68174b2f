"""Training and validation batches from a prepared dataset, on the training device.

Both loaders draw each rank's share of an epoch from the same `EpochSampler`
(one permutation per epoch cut into slots of a batch, plus a start offset for exact
resume, on any number of ranks), and both run augmentation and normalisation as batched
tensor ops on the device, seeded per (seed, epoch, step, slot): a sample is augmented
alike whichever rank trains it. So for the same seed they yield the same batches:
    device      the whole uint8 dataset lives in device memory; a batch is an index_select
    dataloader  torch DataLoader workers read the memory-mapped arrays; pinned, non-blocking copy
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from ddpflow.config.types import AugmentCfg
from ddpflow.core.errors import UserError
from ddpflow.core.seeds import seed_sequence
from ddpflow.data import policies
from ddpflow.data.crops import EvalCrop, center_crop, random_resized_crop
from ddpflow.data.mixing import Recipe
from ddpflow.data.mixing import apply as apply_recipe
from ddpflow.data.prefetch import Ahead
from ddpflow.data.resident import read_kept, read_rows, resident_split, upload
from ddpflow.data.sampling import EpochSampler, Spec
from ddpflow.data.shards import JpegImages, decode_cuda


def step_generator(device: torch.device, seed: int, epoch: int, step: int, rank: int):
    """A generator seeded by position alone: augmentation needs no saved RNG to resume.
    The seed hashes the whole tuple (core/seeds.py), so no two positions share a stream
    however many ranks, steps or epochs there are."""
    g = torch.Generator(device=device)
    g.manual_seed(seed_sequence(seed, epoch, step, rank))
    return g


def augment(x: torch.Tensor, aug: AugmentCfg, g: torch.Generator) -> torch.Tensor:
    """Random crop with zero padding (+ translate) and horizontal flip of uint8 NHWC images.

    Both are one gather: each output pixel's flat source index is computed from the
    sample's shift and flip, so the batch is read once (no per-sample Python, no where()).
    """
    b, h, w, c = x.shape
    pad = aug.crop_padding + aug.translate
    if pad == 0 and not aug.flip:
        return x
    if pad > 0:
        x = F.pad(x, (0, 0, pad, pad, pad, pad))
    hp, wp = h + 2 * pad, w + 2 * pad
    dev = x.device
    dy = torch.randint(0, 2 * pad + 1, (b, 1, 1), device=dev, generator=g)
    dx = torch.randint(0, 2 * pad + 1, (b, 1, 1), device=dev, generator=g)
    cols = torch.arange(w, device=dev).view(1, 1, w).expand(b, 1, w)
    if aug.flip:
        flip = torch.rand(b, 1, 1, device=dev, generator=g) < 0.5
        cols = torch.where(flip, w - 1 - cols, cols)
    rows = torch.arange(h, device=dev).view(1, h, 1)
    base = torch.arange(b, device=dev).view(b, 1, 1) * (hp * wp)
    src = base + (dy + rows) * wp + dx + cols  # [b, h, w] flat pixel index into x
    return x.reshape(b * hp * wp, c).index_select(0, src.reshape(-1)).view(b, h, w, c)


class Normalize:
    """uint8 NHWC -> float NCHW, (x/255 - mean) / std, optionally 3 channels and channels_last."""

    def __init__(self, mean, std, device, want_channels: int, channels_last: bool):
        scale = 1.0 / (torch.tensor(std, device=device) * 255.0)
        self.scale = scale.view(1, -1, 1, 1)
        self.shift = (-torch.tensor(mean, device=device) * 255.0 * scale).view(1, -1, 1, 1)
        self.want_channels = want_channels
        self.channels_last = channels_last

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 3, 1, 2)  # NHWC storage viewed as NCHW: already channels_last
        if not self.channels_last:
            x = x.contiguous()  # the layout change on 1-byte pixels, before widening to float
        x = x.float().mul_(self.scale).add_(self.shift)  # (x - mean)/std, in place
        if x.shape[1] != self.want_channels:
            x = x.expand(-1, self.want_channels, -1, -1).contiguous(
                memory_format=torch.channels_last if self.channels_last
                else torch.contiguous_format)
        return x


class BadSamples:
    """Unreadable samples met while reading a split: each reported once; more than
    `fraction` of the split is a UserError naming the first (data.max_bad_fraction)."""

    def __init__(self, split: str, total: int, fraction: float, rank: int):
        self.split, self.total, self.fraction, self.rank = split, total, fraction, rank
        self.seen: dict[int, str] = {}

    def note(self, bad) -> None:
        for i, why in bad:
            if i not in self.seen:
                self.seen[i] = why
                print(f"ddpflow: rank {self.rank}: skipped unreadable {why}", file=sys.stderr)
        if bad and len(self.seen) > self.fraction * self.total:
            first = next(iter(self.seen.values()))
            raise UserError(f"{len(self.seen)} unreadable samples of the {self.split} split's "
                            f"{self.total}, more than data.max_bad_fraction="
                            f"{self.fraction}; first: {first}; the prepared data is damaged: "
                            f"run `ddpflow prepare --force` (the workflow re-prepares by itself)")


class _Memmap(Dataset):
    """Indexable view of the prepared arrays; fetches (and decodes) a whole batch per call.
    Given (index, key) pairs (EpochSampler.keyed), each image goes through `policy` seeded
    by its key, here in the worker (data/policies.py)."""

    def __init__(self, images, labels, encoded: bool = False, policy=None):
        self.images, self.labels, self.encoded, self.policy = images, labels, encoded, policy

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.__getitems__([i])

    def __getitems__(self, items):
        keys = None
        if items and isinstance(items[0], tuple):
            idx, keys = [i for i, _ in items], [k for _, k in items]
        else:
            idx = items
        if self.encoded:  # the JPEG bytes only: the GPU decodes the batch (shards.decode_cuda)
            return self._encoded(idx, keys)
        images, labels, kept, bad = read_kept(self.images, self.labels, idx)
        x = torch.from_numpy(images)
        if keys is not None:
            x = policies.apply(self.policy, x, [keys[p] for p in kept])
        return (x, torch.from_numpy(labels).long(),
                torch.as_tensor(np.asarray(idx, dtype=np.int64)[kept]), bad)

    def _encoded(self, idx, keys):
        idx = [int(i) for i in idx]
        found, bad = self.images.read(idx)  # in file order; damaged entries reported
        kept = [idx[p] for p in sorted(found)]
        bufs = [np.array(found[p]) for p in sorted(found)]
        batch = (bufs, torch.from_numpy(self.labels[kept]).long(), torch.as_tensor(kept), bad)
        # the policy after nvJPEG's decode, on the device (keys of the kept ones)
        return batch if keys is None else (*batch, [keys[p] for p in sorted(found)])


def _decode_on_device(batch, images: JpegImages, device, policy=None):
    """Workers' encoded batch -> (uint8 NHWC on device, labels, idx, bad) via nvJPEG; with
    the policy's keys (a 5th item), each decoded image through the policy."""
    bufs, y, idx, bad = batch[:4]
    x, kept, failed = decode_cuda(bufs, device)
    bad = bad + [(int(idx[p]), f"{images.where(int(idx[p]))}: {why}") for p, why in failed]
    if x is None:
        x = torch.zeros((0, *images.shape[1:]), dtype=torch.uint8, device=device)
    elif len(batch) > 4:
        x = policies.apply(policy, x, [batch[4][p] for p in kept])
    return x, y[kept], idx[kept], bad


def _as_is(batch):
    return batch


class TrainBatches:
    """Yields (inputs float NCHW, labels) for one epoch of this rank, from `start_step` on."""

    def __init__(self, kind, images, labels, batch_size, device, world, rank, seed, aug,
                 normalize, num_workers=0, pin_memory=False, persistent_workers=False,
                 prefetch_factor=2, trace=None, recipe: Recipe | None = None,
                 image_size: int | None = None, max_bad: float = 0.0, resident=None,
                 accum: int = 1, sampling: Spec | None = None, interpolation: str = "bilinear"):
        self.trace = trace  # optional text file: "epoch step idx..." per batch (an audit)
        self.interpolation = interpolation  # of the crop's resampling (data.interpolation)
        self.policy = policies.build(aug)  # data.augment.policy, per sample (policies.py)
        self.image_size = image_size or images.shape[1]  # what training sees (<= stored)
        self.recipe = recipe if recipe is not None and recipe.active else None
        self.size_at = None  # epoch -> training size (progressive resizing), set by the trainer
        self.kind, self.batch_size, self.device = kind, batch_size, device
        self.rank, self.seed, self.aug, self.normalize = rank, seed, aug, normalize
        self.bad = BadSamples("train", len(labels), max_bad, rank)
        # JPEG shards on a GPU: workers read the bytes, nvJPEG decodes the batch
        self.gpu_decode = (kind == "dataloader" and isinstance(images, JpegImages)
                           and device.type == "cuda")
        self.source = images
        if kind == "device":
            # the whole split is copied (decoded: once per node) to the device once; steps
            # only index it. `resident`: the (images, labels) of an earlier upload, reused
            self.images, self.labels = resident or resident_split(images, labels, device,
                                                                  self.bad)
        kept = self.labels if kind == "device" else labels  # the device's: readable ones
        sampling = sampling or Spec()
        self.sampler = EpochSampler(len(kept), world, rank, seed, batch_size, accum,
                                    sampling.draws(kept), sampling.repeats)
        self.steps_per_epoch = self.sampler.num_samples // batch_size
        if kind != "device":
            workers = dict(persistent_workers=persistent_workers,
                           prefetch_factor=prefetch_factor) if num_workers > 0 else {}
            self.sampler.keyed = self.policy is not None  # each draw's seed to the workers
            self.loader = DataLoader(
                _Memmap(images, labels, self.gpu_decode, self.policy), batch_size=batch_size,
                sampler=self.sampler, num_workers=num_workers,
                pin_memory=pin_memory and device.type == "cuda", drop_last=True,
                collate_fn=_as_is, **workers)

    def __len__(self):
        return self.steps_per_epoch

    def epoch(self, epoch: int, start_step: int = 0):
        self.sampler.set_epoch(epoch, start_step * self.batch_size)
        if self.kind == "device":
            triples = self._resident_batches(start_step)
        else:
            # GPU JPEG decode: one or two batches ahead in a thread (a side stream on a GPU),
            # not in series with the step; a batch the workers decoded needs no thread
            triples = Ahead(self.loader, self._on_device, self.device,
                            2 if self.gpu_decode else 0)
        size = self.size_at(epoch) if self.size_at else None
        for step, (x, y, idx) in enumerate(triples, start=start_step):
            if self.trace:
                self.trace.write(f"{epoch} {step} {' '.join(map(str, idx.tolist()))}\n")
            # keyed by the slot, not the rank: the same draws on any number of ranks
            step_slot = self.sampler.slot(step)
            g = step_generator(self.device, self.seed, epoch, *step_slot)
            x = self.transform(x, g, size)  # progressive resizing: this epoch's size
            if self.recipe:  # random erasing, mixup/cutmix of this stage (mixing.py)
                x, y = apply_recipe(x, y, self.recipe, g, (self.seed, epoch, *step_slot))
            yield x, y

    def _resident_batches(self, start_step: int):
        """(images, labels, idx) of each batch of the device loader, through the policy."""
        order, place = self.sampler.mine()
        order = order.to(self.device)
        b = self.batch_size
        for i in range(self.steps_per_epoch - start_step):
            idx = order[i * b:(i + 1) * b]
            x = self.images[idx]
            if self.policy is not None:  # per sample, each seeded by its place in the epoch
                x = policies.apply(self.policy, x, self.sampler.keys(place[i * b:(i + 1) * b]))
            yield x, self.labels[idx], idx

    def _on_device(self, batch):
        """A workers' batch on the training device; unreadable samples reported and left out."""
        if self.gpu_decode:
            x, y, idx, bad = _decode_on_device(batch, self.source, self.device, self.policy)
        else:
            x, y, idx, bad = batch
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        self.bad.note(bad)
        return x, y, idx

    def transform(self, x: torch.Tensor, g: torch.Generator,
                  size: int | None = None) -> torch.Tensor:
        """uint8 NHWC stored images -> normalised float NCHW at `size` (progressive
        resizing's size of the epoch; image_size without): a random resized crop and mirror,
        or pad-and-crop and mirror then the evaluation's centre crop. Either resamples once,
        to the size itself (antialiased when shrinking)."""
        rrc = self.aug.random_resized_crop
        if rrc:
            return random_resized_crop(self.normalize(x), size or self.image_size,
                                       rrc["scale"], rrc["ratio"], self.aug.flip, g,
                                       self.interpolation)
        return center_crop(self.normalize(augment(x, self.aug, g)), self.image_size, size,
                           mode=self.interpolation)


def forever(make_epoch):
    """Batches of epoch 0, 1, 2, ... without end: make_epoch(e) yields one epoch.
    An epoch without a single batch is an error, not an endless loop."""
    epoch = 0
    while True:
        n = 0
        for batch in make_epoch(epoch):
            n += 1
            yield batch
        if n == 0:
            raise UserError("an epoch has no batch: the batch is larger than a rank's share "
                            "of the training data; lower the batch size")
        epoch += 1


def val_batches(images, labels, device, world, rank, normalize, resident=False,
                image_size: int | None = None, split: str = "val", max_bad: float = 0.0,
                crop: EvalCrop | None = None):
    """(batch size) -> this rank's strided share of a validation (or test) split, in order,
    with the evaluation's centre crop (`crop`; None: to image_size). resident (the device
    loader): the share is copied to the device at the first validation and stays there.
    Streamed: a thread reads (decodes) the next batch, into pinned memory on a GPU, while
    this one runs."""
    crop = crop or EvalCrop(image_size or images.shape[1])
    idx = np.arange(rank, len(labels), world)
    bad = BadSamples(split, len(labels), max_bad, rank)
    kept = {}
    pin = device.type == "cuda"

    def read(part):
        x, y, _, lost = read_rows(images, labels, part)
        return host_batch(x, pin), host_batch(np.asarray(y, dtype=np.int64), pin), lost

    def batches(batch_size: int):
        if resident and not kept:
            kept["x"], kept["y"] = upload(images, labels, idx, device, bad)
        if resident:
            for i in range(0, len(kept["y"]), batch_size):
                yield crop(normalize(kept["x"][i:i + batch_size])), kept["y"][i:i + batch_size]
            return
        parts = (idx[i:i + batch_size] for i in range(0, len(idx), batch_size))
        for x, y, lost in read_ahead(read, parts):
            bad.note(lost)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            yield crop(normalize(x)), y
    return batches


def host_batch(a: np.ndarray, pin: bool) -> torch.Tensor:
    """A host array as a tensor, page-locked when `pin` (a GPU's copy of it then runs
    asynchronously: from pageable memory a non_blocking copy is a blocking one)."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.pin_memory() if pin else t


def read_ahead(read, parts):
    """read(part) for each of parts, in order, one part ahead in a thread: reading and
    decoding the next batch overlaps the work on this one (stopping waits for that read)."""
    parts = iter(parts)
    first = next(parts, None)
    if first is None:
        return
    with ThreadPoolExecutor(1, thread_name_prefix="ddpflow-read") as pool:
        pending = pool.submit(read, first)
        for part in parts:
            following = pool.submit(read, part)  # runs once `pending` is read
            yield pending.result()
            pending = following
        yield pending.result()


def choose_loader(setting: str, nbytes: int, device: torch.device, fraction: float,
                  free: int | None = None, note: str = ""):
    """(kind, reason): `device` when the dataset fits in `fraction` of free device memory
    (`free` bytes where given: `ddpflow tune --memory-cap-mb`, or what training agreed
    across ranks less the model, said by `note`)."""
    if setting != "auto":
        return setting, f"data.loader is set to '{setting}'"
    if free is None:
        free = free_memory(device)
    fits = nbytes <= fraction * free
    verdict = "fits" if fits else "does not fit"
    room = f"{free / 2**30:.1f} GiB" if free >= 2**30 else f"{free / 2**20:.0f} MiB"
    reason = (f"dataset {nbytes / 2**20:.0f} MiB {verdict} in {fraction:g} of {room} free "
              f"{device.type} memory{note}")
    return ("device" if fits else "dataloader"), reason


def free_memory(device: torch.device) -> int:
    """This process's free bytes of `device` memory (host memory for the CPU)."""
    return (torch.cuda.mem_get_info(device)[0] if device.type == "cuda"
            else _available_host_memory())


def _available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 2**30
