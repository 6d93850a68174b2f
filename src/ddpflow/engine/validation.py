"""Validation at the largest batch that fits: it keeps no activations for a backward pass,
so it starts at VAL_BATCH_FACTOR x the training batch per rank; a rank that runs out of GPU
memory says so to the others (one small collective per validation) and all of them start
the validation again at half the batch, down to the training batch (which fits)."""

from __future__ import annotations

import math

import torch

from ddpflow.core.errors import UserError
from ddpflow.engine import distributed
from ddpflow.seams.models import forward
from ddpflow.seams.tasks import improves, metric_pairs

VAL_BATCH_FACTOR = 4


def best_after(metrics: dict, state, monitor: str, mode: str, task_name: str) -> dict | None:
    """TrainState.best after a validation (`s`: TrainState) when the monitored metric
    improved on it, else None."""
    if not improves(metrics, monitor, mode, state.best.get("value"), task_name):
        return None
    return {"monitor": monitor, "mode": mode, "value": metrics[monitor], "step": state.step,
            "epoch": state.epoch, "metrics": metrics}


class Validator:
    """Scores weights with the task over a split, on every rank. Owns the validation batch
    per rank (`batch`), which starts at VAL_BATCH_FACTOR x the training batch and is halved
    for good after a GPU OOM, never below the training batch."""

    def __init__(self, dist, task, task_name: str, autocast, train_batch: int, say,
                 lockstep: bool = False):
        self.dist, self.task, self.task_name, self.autocast = dist, task, task_name, autocast
        self.train_batch, self.batch, self.say = train_batch, VAL_BATCH_FACTOR * train_batch, say
        # FSDP: every forward gathers parameters, a collective all ranks join: they step
        # through a split together, at the training batch (it fits: no retry)
        self.lockstep = lockstep
        if lockstep:
            self.batch = train_batch

    def stage_metrics(self, model, ema, split) -> dict[str, float]:
        """The metrics of the weights the stage hands on, as val_<metric> (the EMA's when
        `ema` is on, then the trained ones' as val_raw_<metric>). `model`: the plain module."""
        net = model.eval()  # plain module: ranks see different counts
        distributed.broadcast_buffers(self.dist, net)  # every rank validates with rank 0's BN stats
        metrics = self.metrics(net, split)
        if ema:
            raw = metrics
            distributed.broadcast_buffers(self.dist, ema.module)  # rank 0's, as saved
            metrics = self.metrics(ema.module.eval(), split)
            metrics.update({f"val_raw_{k[4:]}": v for k, v in raw.items()})
        return metrics

    def test_metrics(self, model, ema, split) -> dict[str, float]:
        """The test split, once, on the weights the stage hands on (the EMA's when on), as
        test_<metric>. Nothing selects on it: it runs after the last validation and save."""
        net = ema.module if ema else model
        distributed.broadcast_buffers(self.dist, net)
        metrics = self.metrics(net.eval(), split)
        return {f"test_{k[4:]}": v for k, v in metrics.items()}

    def metrics(self, net, split) -> dict[str, float]:
        """The task's metrics of `net` over `split` (batches by batch size), summed on each
        rank and all-reduced (sync points)."""
        while True:
            sums = self._sums(net, split)
            # sync point: one rank out of memory means every rank starts again, smaller
            oom = distributed.all_gather_floats(self.dist, [float(sums is None)])
            if not any(r[0] for r in oom):
                values = sums.reduce(self.dist)  # one gather of names, one all-reduce: a sync point
                check_finite(values, sums.totals, self.task_name, net, self.dist)
                return values
            self.batch = max(self.train_batch, self.batch // 2)
            torch.cuda.empty_cache()
            self.say(f"validation ran out of GPU memory; again at {self.batch} per rank")

    def _sums(self, net, split) -> MetricSums | None:
        """This rank's metric sums, or None when its GPU ran out of memory (and the batch can
        still shrink)."""
        sums = MetricSums(self.task, self.task_name, self.dist.device)
        try:
            with torch.no_grad(), self.autocast:
                batches = split(self.batch)
                for batch in self._together(batches, net) if self.lockstep else batches:
                    sums.add(forward(net, batch[0]), batch)
        except torch.cuda.OutOfMemoryError:
            if self.batch <= self.train_batch:
                raise
            return None
        return sums

    def _together(self, batches, net):
        """This rank's batches while any rank has one left (a small collective per batch);
        a rank whose own ran out runs its last one again, uncounted, to join the gathers."""
        last = None
        it = iter(batches)
        while True:
            batch = next(it, None)
            if not distributed.all_min(self.dist, int(batch is not None), "MAX"):
                return
            if batch is not None:
                last = batch
                yield batch
            elif last is not None:
                forward(net, last[0])
            else:
                raise UserError(f"rank {self.dist.rank} has no validation sample: the split has "
                                f"fewer samples than the {self.dist.world} ranks; make it larger")


class MetricSums:
    """A task's validation metrics: (sum, count) per name, added up where each is (device
    tensors on the device, Python numbers on the host: no copy to the device per batch),
    summed across ranks once by `reduce`, reported as {"val_<name>": sum / count}."""

    def __init__(self, task, task_name: str, device):
        self.task, self.task_name, self.device = task, task_name, device
        self.sums: dict[str, list] = {}  # name -> [sum, count], each a tensor or a number
        self.totals: dict[str, tuple] = {}  # val_<name> -> (sum, count) of every rank, reduced

    def add(self, outputs, batch) -> None:
        values = dict(metric_pairs(self.task.metrics(outputs, batch), self.task_name))
        if "loss" not in values:  # the training loss, weighted by the batch size
            n = next(iter(values.values()))[1] if values else len(batch[1])
            values["loss"] = (self.task.loss(outputs, batch).float() * n, n)
        for name, pair in values.items():
            held = self.sums.setdefault(name, [0, 0])
            for i, v in enumerate(pair):
                held[i] = held[i] + (v.double() if isinstance(v, torch.Tensor) else v)

    def reduce(self, dist) -> dict:
        """{"val_<name>": sum / count} over every rank (a vector metric: a list, None where
        its count is 0), and what the task's `summarize` makes of them."""
        # ranks agree on the names (and vector lengths) first: a rank without validation
        # batches has none
        sizes: dict = {}
        for every in distributed.gather_objects(dist, {k: _size(p) for k, p in self.sums.items()}):
            sizes.update(every)
        names = sorted(sizes)
        # the host's numbers and the device's tensors in one [rows, 2] tensor: one all-reduce
        table = torch.zeros(sum(sizes[k] or 1 for k in names), 2, dtype=torch.float64,
                            device=self.device)
        row = 0
        for k in names:
            rows = table[row:row + (sizes[k] or 1)]
            for i, v in enumerate(self.sums.get(k, [0, 0])):
                rows[:, i] += (v.to(self.device).reshape(-1) if isinstance(v, torch.Tensor)
                               else float(v))
            row += sizes[k] or 1
        totals, row, out = distributed.all_sum(dist, table).tolist(), 0, {}
        self.totals = {}  # val_<name> -> (sum, count) of each scalar metric (check_finite)
        for k in names:
            part = totals[row:row + (sizes[k] or 1)]
            row += sizes[k] or 1
            if sizes[k] is None:
                self.totals[f"val_{k}"] = tuple(part[0])
                out[k] = part[0][0] / part[0][1] if part[0][1] else float("nan")
            else:
                out[k] = [t / c if c else None for t, c in part]
        summarize = getattr(self.task, "summarize", None)
        if callable(summarize):  # e.g. balanced accuracy from the per-class recall
            out.update(summarize(dict(out)))
        return {f"val_{k}": v for k, v in out.items()}


def _size(pair) -> int | None:
    """A metric's length: None for a scalar, K for a vector of K entries (one per class)."""
    v = pair[0]
    return v.numel() if isinstance(v, torch.Tensor) and v.ndim > 0 else None


def metrics_text(metrics: dict) -> str:
    """'val_acc 0.9120, val_recall min 0.4100 max 0.9900 of 10 classes': a line's worth."""
    def one(k, v):
        if isinstance(v, list):
            known = [x for x in v if x is not None]
            return (f"{k} min {min(known):.4f} max {max(known):.4f} of {len(v)} classes"
                    if known else f"{k} -")
        return f"{k} {v:.4f}"
    return ", ".join(one(k, v) for k, v in metrics.items())


def check_finite(values: dict, totals: dict, task_name: str, net, dist) -> None:
    """A metric that is NaN or inf while the weights are finite is named (one UserError, the
    same on every rank): a count of 0 over the whole split, or NaN/inf in what the task's
    metrics add up. Weights that are not finite are the divergence check's (step.py)."""
    bad = [k for k in totals if not math.isfinite(values[k])]  # (a scalar the task sums)
    if not bad:
        return
    finite = all(bool(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all())
                 for p in net.parameters())
    if not distributed.all_min(dist, int(finite)):
        return
    k = bad[0]
    total, count = totals[k]
    why = (f"no sample was counted for it over the whole split (its count is 0): "
           f"metrics(outputs, batch) returns a count of 0 for {k[4:]} on every batch"
           if not count else
           f"what metrics(outputs, batch) adds up for {k[4:]} holds NaN/inf (sum {total} "
           f"over a count of {count:g})")
    raise UserError(f"task.name {task_name}: the metric {k} is {values[k]}, and the weights "
                    f"are finite (not a divergence): {why}; fix the task's metrics, or the "
                    f"held-out items they score")
