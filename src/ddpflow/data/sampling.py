"""Which samples an epoch trains on, and which rank trains each: a function of (seed, epoch)
alone, so a resumed epoch, on any number of ranks, draws exactly what it would have drawn.

`Draws` makes an epoch's sequence of sample indices (data.sampling):

    uniform    a permutation of the split (seeded by seed + epoch, as DistributedSampler
               draws it); with data.sampling_replacement, n independent uniform draws
    balanced   each class equally likely per draw. With replacement: n draws, each a class
               (uniformly) then one of its samples (uniformly). Without: no sample twice, so
               every class gives the smallest class's count m, a fresh random subset of each
               larger class every epoch: C x m draws, shuffled (random under-sampling)
    weights    sample i with probability w_i / sum(w) per draw (data.sample_weights). With
               replacement: n draws (inverse CDF of the weights). Without: every sample of
               weight > 0 once, heavier ones likelier earlier (torch's
               WeightedRandomSampler(replacement=False), Efraimidis-Spirakis keys)

`EpochSampler` cuts the sequence into optimizer steps and slots (below); with repeated
augmentation (data.repeated_augment k) each step's first G/k draws fill the step k times
over, each copy in another slot. Every rank computes the whole sequence (a few ms for a
million samples) and keeps its own slots: no rank trains another's draw.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from ddpflow.core.errors import UserError
from ddpflow.core.seeds import seed_sequence

MODES = ("uniform", "balanced", "weights")
_TAG = {"uniform": 1, "balanced": 2, "weights": 3}  # each mode its own random stream


class Draws:
    """An epoch's sample indices for `mode` over n samples: `labels` (class per sample) for
    balanced, `weights` (one per sample, checked: contract.check_weights) for weights."""

    def __init__(self, n: int, mode: str = "uniform", replacement: bool = False,
                 labels=None, weights=None):
        self.n, self.mode, self.replacement = n, mode, replacement
        if mode == "balanced":
            y = torch.tensor(np.asarray(labels, dtype=np.int64)).reshape(-1)  # a copy: memmaps
            self.by_class = torch.argsort(y, stable=True)  # sample indices, class by class
            self.counts = torch.bincount(y)
            self.present = torch.nonzero(self.counts).reshape(-1)  # classes with samples
            self.starts = torch.cumsum(self.counts, 0) - self.counts
            self.labels = y
            smallest = int(self.counts[self.present].min())
            self.length = len(self.present) * smallest if not replacement else n
        elif mode == "weights":
            self.weights = torch.as_tensor(np.asarray(weights, dtype=np.float64))
            self.length = n if replacement else int((self.weights > 0).sum())
        else:
            self.length = n

    def __call__(self, seed: int, epoch: int) -> torch.Tensor:
        """The epoch's `length` sample indices (int64)."""
        g = torch.Generator()
        if self.mode == "uniform" and not self.replacement:
            g.manual_seed(seed + epoch)  # the order ddpflow always drew: results unchanged
            return torch.randperm(self.n, generator=g)
        g.manual_seed(seed_sequence(seed, epoch, _TAG[self.mode]))
        if self.mode == "uniform":
            return torch.randint(0, self.n, (self.n,), generator=g)
        if self.mode == "balanced":
            return self._balanced(g)
        return self._weighted(g)

    def _balanced(self, g: torch.Generator) -> torch.Tensor:
        if self.replacement:  # a class, then one of its samples: exact, any size
            cls = self.present[torch.randint(0, len(self.present), (self.n,), generator=g)]
            u = torch.rand(self.n, generator=g, dtype=torch.float64)
            count = self.counts[cls]
            member = torch.minimum((u * count).long(), count - 1)  # u < 1, rounding aside
            return self.by_class[self.starts[cls] + member]
        order = torch.randperm(self.n, generator=g)  # random within each class, then grouped
        order = order[torch.argsort(self.labels[order], stable=True)]
        rank_in_class = torch.arange(self.n) - self.starts[self.labels[order]]
        chosen = order[rank_in_class < self.length // len(self.present)]
        return chosen[torch.randperm(len(chosen), generator=g)]

    def _weighted(self, g: torch.Generator) -> torch.Tensor:
        u = torch.rand(self.n, generator=g, dtype=torch.float64)
        if self.replacement:
            cdf = torch.cumsum(self.weights, 0)
            return torch.searchsorted(cdf, u * cdf[-1], right=True).clamp_(max=self.n - 1)
        # Efraimidis-Spirakis: key log(u) / w, largest first; weight 0 never drawn
        keys = torch.where(self.weights > 0, torch.log1p(-u) / self.weights, -torch.inf)
        return torch.argsort(keys, descending=True, stable=True)[:self.length]


def class_counts(labels, num_classes: int | None) -> np.ndarray:
    """Training samples per class (num_classes of them, where known)."""
    y = np.asarray(labels, dtype=np.int64).reshape(-1)
    return np.bincount(y, minlength=num_classes or 0)


def check_balanced(labels, num_classes: int | None, where: str) -> None:
    """Every class has a training sample: `balanced` draws each class equally often."""
    counts = class_counts(labels, num_classes)
    empty = np.flatnonzero(counts == 0)
    if len(empty):
        raise UserError(f"data.sampling balanced: class {int(empty[0])} has no sample in "
                        f"{where} ({len(empty)} of the {len(counts)} classes have none), so "
                        f"it cannot be drawn as often as the others; give every class a "
                        f"training sample, or use data.sampling uniform (or weights)")


@dataclass(frozen=True)
class Spec:
    """How a stage draws its epochs (data.sampling, sampling_replacement, repeated_augment),
    with the checked weights of `weights` sampling and the class count of `balanced`."""

    mode: str = "uniform"
    replacement: bool = False
    repeats: int = 1
    weights: Any = None  # float64 [n] (seams/sampleweights.py), for mode weights
    num_classes: int | None = None

    def draws(self, labels, n: int | None = None) -> Draws | None:
        """The Draws over `labels` (the training split as the loader holds it; None: n
        samples of unknown classes), or None for the permutation of uniform sampling."""
        if self.mode == "uniform" and not self.replacement:
            return None
        if isinstance(labels, torch.Tensor):
            labels = labels.cpu().numpy()
        n = len(labels) if labels is not None else n
        if self.mode == "balanced":
            check_balanced(labels, self.num_classes, "the training split")
        if self.mode == "weights" and len(self.weights) != n:  # a sample left out unreadable
            raise UserError(f"data.sample_weights gave {len(self.weights)} weights, but {n} "
                            f"of the training samples are readable; prepare the data again "
                            f"(`ddpflow prepare --force`) or use data.loader dataloader")
        return Draws(n, self.mode, self.replacement, labels=labels, weights=self.weights)


def spec_of(data, weights=None, num_classes: int | None = None) -> Spec:
    """The Spec of a config's data section (sampling_replacement null: false for uniform,
    true for balanced and weights)."""
    replacement = (data.sampling != "uniform" if data.sampling_replacement is None
                   else data.sampling_replacement)
    return Spec(data.sampling, replacement, data.repeated_augment, weights, num_classes)


def dataset_labels(ds, where: str):
    """A user dataset's class per sample, from its `targets` (torchvision's name), checked;
    None where it has none."""
    targets = getattr(ds, "targets", None)
    if targets is None:
        return None
    y = np.asarray(targets.cpu() if isinstance(targets, torch.Tensor) else targets)
    if y.ndim != 1 or len(y) != len(ds) or y.dtype.kind not in "iu" or (y < 0).any():
        raise UserError(f"{where}: the dataset's `targets` is {y.dtype} of shape {y.shape}; "
                        f"data.sampling needs one class index >= 0 per sample ({len(ds)})")
    return y.astype(np.int64)


class EpochSampler(Sampler):
    """This rank's samples of an epoch, in the order of its micro-batches, from an offset.

    An epoch is one sequence of draws (`Draws`; without one a permutation of the split,
    seeded by seed + epoch), cut into optimizer steps of the global batch
    G = batch x world x accum, and each step into world x accum slots of `batch`
    consecutive samples: rank r's micro-batch m of a step is slot m x world + r. A slot
    holds the same samples whatever the number of ranks, so a run resumed on other ranks
    (accumulation adapted to keep G) trains every step on the same samples, every
    micro-batch on the same slot (BatchNorm sees the same batch). The draws beyond the last
    whole step sit this epoch out (others each epoch).

    `repeats` k > 1 (repeated augmentation): each step holds its ceil(G / k) first draws k
    times over (copy j of draw i at position j x ceil(G/k) + i of the step), so the copies
    sit in k different slots wherever there are k slots a step; the epoch keeps its steps.
    `keyed`: yield (index, key) pairs, key a seed of the draw's place in the epoch (a
    per-sample augmentation in DataLoader workers draws from it)."""

    def __init__(self, n: int, world: int, rank: int, seed: int, batch: int = 1,
                 accum: int = 1, draws: Draws | None = None, repeats: int = 1):
        self.n, self.world, self.rank, self.seed = n, world, rank, seed
        self.batch, self.accum, self.repeats = batch, accum, repeats
        self.draws = draws
        length = draws.length if draws is not None else n
        self.steps = length // (batch * world * accum)  # whole optimizer steps per epoch
        self.num_samples = self.steps * accum * batch  # this rank's, per epoch
        self.epoch, self.start, self.keyed = 0, 0, False

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def slot(self, micro: int) -> tuple[int, int]:
        """(optimizer step, slot) of this rank's micro-batch `micro` of the epoch."""
        step, m = divmod(micro, self.accum)
        return step, m * self.world + self.rank

    def order(self) -> torch.Tensor:
        """The epoch's whole sequence, steps x G draws (every rank computes the same)."""
        if self.draws is None:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g)
        else:
            order = self.draws(self.seed, self.epoch)
        total = self.batch * self.world * self.accum
        if self.repeats > 1:
            unique = -(-total // self.repeats)  # draws per step, each k times
            order = order[:self.steps * unique].view(self.steps, unique)
            order = order.repeat(1, self.repeats)[:, :total]
        return order.reshape(-1)[:self.steps * total]

    def mine(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sample indices, places in the epoch's sequence) of this rank, from the offset."""
        shape = (self.steps, self.accum, self.world, self.batch)
        idx = self.order().view(shape)[:, :, self.rank].reshape(-1)[self.start:]
        place = torch.arange(self.steps * self.accum * self.world * self.batch).view(shape)
        place = place[:, :, self.rank].reshape(-1)[self.start:]
        return idx, place

    def keys(self, places) -> list[int]:
        """A seed per draw from (seed, epoch) hashed once plus its place in the epoch's
        sequence: the same draw gets the same seed on any number of ranks."""
        base = seed_sequence(self.seed, self.epoch, 0)
        return [(base + int(p)) & (2**63 - 1) for p in places]

    def __iter__(self):
        idx, place = self.mine()
        if self.keyed:
            return iter(zip(idx.tolist(), self.keys(place)))
        return iter(idx.tolist())

    def __len__(self):
        return self.num_samples - self.start
