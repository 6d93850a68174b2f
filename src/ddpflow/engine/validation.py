"""Validation at the largest batch that fits: it keeps no activations for a backward pass,
so it starts at VAL_BATCH_FACTOR x the training batch per rank; a rank that runs out of GPU
memory says so to the others (one small collective per validation) and all of them start
the validation again at half the batch, down to the training batch (which fits)."""

from __future__ import annotations

import torch

from ddpflow.engine import distributed
from ddpflow.seams.models import forward, unwrap
from ddpflow.seams.tasks import MetricSums

VAL_BATCH_FACTOR = 4


def stage_metrics(t) -> dict[str, float]:
    """Validation of trainer `t`'s weights: the ones the stage hands on as val_<metric> (the
    EMA's when stages[].ema is on, then the trained ones as val_raw_<metric>)."""
    d = t.d
    net = unwrap(t.train_model).eval()  # plain module: ranks see different counts
    distributed.broadcast_buffers(d, net)  # every rank validates with rank 0's BN stats
    metrics = val_metrics(t, net)
    if t.ema:
        raw = metrics
        distributed.broadcast_buffers(d, t.ema.module)  # rank 0's, as saved
        metrics = val_metrics(t, t.ema.module.eval())
        metrics.update({f"val_raw_{k[4:]}": v for k, v in raw.items()})
    return metrics


def test_metrics(t) -> dict[str, float]:
    """The test split, once, on the weights the stage hands on (the EMA's when on), as
    test_<metric>. Nothing selects on it: it runs after the last validation and save."""
    net = t.ema.module if t.ema else unwrap(t.train_model)
    distributed.broadcast_buffers(t.d, net)
    metrics = val_metrics(t, net.eval(), t.data.test)
    return {f"test_{k[4:]}": v for k, v in metrics.items()}


def val_metrics(t, net, split=None) -> dict[str, float]:
    """The task's metrics over the validation split of trainer `t` (or `split`: batches by
    batch size), summed on each rank and all-reduced (sync points); `t.val_batch` (per
    rank) is halved for good after an OOM."""
    d = t.d
    while True:
        sums = _sums(t, net, split or t.data.val)
        # sync point: one rank out of memory means every rank starts again, smaller
        if not any(r[0] for r in distributed.all_gather_floats(d, [float(sums is None)])):
            return sums.reduce(d)  # one gather of names, one all-reduce: a sync point
        t.val_batch = max(t.batch_size, t.val_batch // 2)
        torch.cuda.empty_cache()
        t.say(f"validation ran out of GPU memory; again at {t.val_batch} per rank")


def _sums(t, net, split) -> MetricSums | None:
    """This rank's metric sums, or None when its GPU ran out of memory (and the batch can
    still shrink)."""
    sums = MetricSums(t.task, t.cfg.task.name, t.d.device)
    try:
        with torch.no_grad(), t.autocast:
            for batch in split(t.val_batch):
                sums.add(forward(net, batch[0]), batch)
    except torch.cuda.OutOfMemoryError:
        if t.val_batch <= t.batch_size:
            raise
        return None
    return sums
