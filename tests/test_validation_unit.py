"""engine/validation.py, edge by edge: the metrics a validation reports (exact sums over the
split, a metric without a loss, host numbers and device tensors, per-class vectors, NaN and
None where nothing was counted, the task's summary), the retry at half the batch after a
GPU OOM and the OOM that is left to the user, the EMA's and the trained weights' metrics,
the best-so-far record, the one line of text and the message for a NaN metric. On two gloo
ranks: a rank without batches, rank 0's BatchNorm statistics on every rank, one rank's OOM
restarting all of them, FSDP's lockstep (a forward is a collective) and a rank without a
sample. Fast: CPU tensors and tiny models, no training.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import tiny_config
from ddpflow.core.errors import UserError
from ddpflow.engine.distributed import Dist
from ddpflow.engine.ema import Ema
from ddpflow.engine.state import TrainState
from ddpflow.engine.validation import MetricSums, Validator, best_after, check_finite, metrics_text
from ddpflow.seams.tasks import Classification
from fixtures import gloo_ranks

CPU = torch.device("cpu")


def _one() -> Dist:
    return Dist(0, 0, 1, CPU, None)


def _data(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _split(x, y):
    """A split as the engine hands it over: batches of the size asked for."""
    return lambda b: [(x[i:i + b], y[i:i + b]) for i in range(0, len(y), b)]


def _net(seed=1):
    torch.manual_seed(seed)
    return nn.Linear(6, 3)


def _expected(net, x, y) -> dict:
    """The classification metrics of net over (x, y), straight from torch."""
    with torch.no_grad():
        logits = net.eval()(x)
    hit = logits.argmax(1) == y
    top5 = (logits.topk(3, 1).indices == y[:, None]).any(1)
    recall = [hit[y == c].double().sum().item() / (y == c).sum().item()
              if (y == c).any() else None for c in range(3)]
    known = [r for r in recall if r is not None]
    return {"val_acc": hit.double().mean().item(),
            "val_balanced_acc": sum(known) / len(known),
            "val_loss": F.cross_entropy(logits, y, reduction="sum").item() / len(y),
            "val_recall": recall, "val_top5": top5.double().mean().item()}


def _close(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k] == (pytest.approx(v, rel=1e-6) if not isinstance(v, list) else
                          [pytest.approx(e, rel=1e-6) if e is not None else None for e in v]), k


def _silent(text):
    raise AssertionError(f"nothing to say without an OOM, it said {text!r}")


# ------------------------------------------------------------------ best so far

def test_best_after_records_the_improved_metric_with_where_it_was_reached():
    metrics = {"val_acc": 0.75, "val_loss": 0.5}
    state = TrainState(step=40, epoch=3, best={"value": 0.5})
    assert best_after(metrics, state, "val_acc", "max", "classification") == {
        "monitor": "val_acc", "mode": "max", "value": 0.75, "step": 40, "epoch": 3,
        "metrics": metrics}
    assert best_after(metrics, TrainState(best={"value": 0.75}), "val_acc", "max", "c") is None
    assert best_after(metrics, TrainState(best={"value": 0.4}), "val_loss", "min", "c") is None
    assert best_after(metrics, TrainState(), "val_loss", "min", "c")["value"] == 0.5


# ------------------------------------------------------------------ one rank

def test_the_validation_batch_starts_at_four_times_the_training_batch_lockstep_at_it():
    v = Validator(_one(), Classification(), "classification", contextlib.nullcontext(), 8,
                  _silent)
    assert (v.batch, v.train_batch, v.lockstep) == (32, 8, False)
    v = Validator(_one(), Classification(), "classification", contextlib.nullcontext(), 8,
                  _silent, lockstep=True)
    assert (v.batch, v.train_batch, v.lockstep) == (8, 8, True)


@pytest.mark.parametrize("lockstep", [False, True])
def test_the_metrics_are_the_splits_whatever_the_batches(lockstep):
    x, y = _data()
    net = _net()
    asked = []

    def split(b):
        asked.append(b)
        return _split(x, y)(b)

    v = Validator(_one(), Classification(), "classification", contextlib.nullcontext(), 3,
                  _silent, lockstep=lockstep)
    _close(v.metrics(net, split), _expected(net, x, y))
    assert asked == [3 if lockstep else 12]


class _Oom(nn.Module):
    """A model whose batches above `fits` samples run out of GPU memory."""

    def __init__(self, fits):
        super().__init__()
        self.fits, self.lin = fits, _net()

    def forward(self, x):
        if len(x) > self.fits:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.lin(x)


def _sayer(said):
    def say(text):
        said.append(text)
        if len(said) > 3:  # the batch would shrink for ever
            raise AssertionError(f"validation retried without end: {said}")
    return say


def test_an_oom_retries_at_half_the_batch_down_to_the_training_batch():
    x, y = _data()
    net, said = _Oom(8), []
    v = Validator(_one(), Classification(), "classification", contextlib.nullcontext(), 8,
                  _sayer(said))
    _close(v.metrics(net, _split(x, y)), _expected(net.lin, x, y))
    assert said == ["validation ran out of GPU memory; again at 16 per rank",
                    "validation ran out of GPU memory; again at 8 per rank"]
    assert v.batch == 8  # for good: the next validation starts there
    said.clear()
    _close(v.metrics(net, _split(x, y)), _expected(net.lin, x, y))
    assert said == []


def test_an_oom_at_the_training_batch_is_raised():
    x, y = _data()
    said = []
    v = Validator(_one(), Classification(), "classification", contextlib.nullcontext(), 8,
                  _sayer(said))
    with pytest.raises(torch.cuda.OutOfMemoryError, match="Tried to allocate 2.00 GiB"):
        v.metrics(_Oom(4), _split(x, y))
    assert said == ["validation ran out of GPU memory; again at 16 per rank",
                    "validation ran out of GPU memory; again at 8 per rank"]


class _Unscored(Classification):
    """A task whose f1 counts no sample of any batch."""

    def metrics(self, outputs, batch):
        return {**super().metrics(outputs, batch), "f1": (torch.zeros(()), torch.zeros(()))}


def test_a_validation_with_a_metric_that_counted_nothing_names_it():
    x, y = _data()
    v = Validator(_one(), _Unscored(), "mine:unscored", contextlib.nullcontext(), 8, _silent)
    with pytest.raises(UserError, match=r"^task.name mine:unscored: the metric val_f1 is nan, "
                                        r"and the weights are finite \(not a divergence\): no "
                                        r"sample was counted for it"):
        v.metrics(_net(), _split(x, y))


def _ema_of(net):
    ema = Ema(net, 0.5, 1)
    ema.update_now(net)
    with torch.no_grad():
        ema.module.weight.mul_(-1.0)  # other weights: other metrics
    return ema


def test_with_ema_the_stage_hands_on_the_emas_metrics_and_the_trained_ones_as_raw():
    x, y = _data()
    net = _net()
    ema = _ema_of(net)
    v = Validator(_one(), Classification(), "classification", contextlib.nullcontext(), 8,
                  _silent)
    trained, averaged = _expected(net, x, y), _expected(ema.module, x, y)
    assert trained["val_acc"] != averaged["val_acc"]
    _close(v.stage_metrics(net.train(), None, _split(x, y)), trained)
    assert not net.training
    got = v.stage_metrics(net.train(), ema, _split(x, y))
    _close(got, {**averaged, **{f"val_raw_{k[4:]}": w for k, w in trained.items()}})
    _close(v.test_metrics(net, ema, _split(x, y)),
           {f"test_{k[4:]}": w for k, w in averaged.items()})
    _close(v.test_metrics(net, None, _split(x, y)),
           {f"test_{k[4:]}": w for k, w in trained.items()})


# ------------------------------------------------------------------ the sums

class _Hits:
    """A task whose metrics are host numbers and hold no loss: the loss is weighted by the
    count of the first metric (3 of each batch's 4 samples count here)."""

    summarize = None  # not a function: nothing is added

    def loss(self, outputs, batch):
        return outputs.float().mean()

    def metrics(self, outputs, batch):
        return {"hits": (2, 3), "err": (outputs.float().sum(0), 4), "none": (0.0, 0),
                "miss": (0, 3)}


class _Plain(_Hits):
    def metrics(self, outputs, batch):
        return {}


def test_sums_weigh_the_loss_by_the_first_metrics_count_and_keep_host_numbers():
    sums = MetricSums(_Hits(), "mine:hits", CPU)
    a, b = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[5.0, -6.0], [0.5, 0.25]])
    for out in (a, b):
        sums.add(out, (None, torch.zeros(4)))
    got = sums.reduce(_one())
    assert list(got) == ["val_err", "val_hits", "val_loss", "val_miss", "val_none"]
    assert got["val_err"] == [(1 + 3 + 5 + 0.5) / 8, (2 + 4 - 6 + 0.25) / 8]
    assert got["val_hits"] == 4 / 6 and got["val_miss"] == 0.0  # counted, none missed
    assert got["val_loss"] == pytest.approx((a.mean().item() * 3 + b.mean().item() * 3) / 6)
    assert math.isnan(got["val_none"])
    assert sums.totals == {"val_hits": (4.0, 6.0), "val_loss": (pytest.approx(
        (a.mean().item() + b.mean().item()) * 3), 6.0), "val_miss": (0.0, 6.0),
        "val_none": (0.0, 0.0)}


def test_sums_weigh_the_loss_by_the_batch_without_other_metrics():
    sums = MetricSums(_Plain(), "mine:plain", CPU)
    sums.add(torch.tensor([2.0, 4.0]), (None, torch.zeros(3)))
    sums.add(torch.tensor([1.0]), (None, torch.zeros(1)))
    assert sums.reduce(_one()) == {"val_loss": (3.0 * 3 + 1.0) / 4}
    assert sums.totals == {"val_loss": (10.0, 4.0)}


def test_a_vector_metric_is_a_list_with_none_where_nothing_was_counted():
    sums = MetricSums(Classification(), "classification", CPU)
    logits = torch.tensor([[9.0, 0, 0, 0], [0, 9.0, 0, 0], [0, 9.0, 0, 0]])
    sums.add(logits, (None, torch.tensor([0, 1, 0])))
    got = sums.reduce(_one())
    assert got["val_recall"] == [0.5, 1.0, None, None]
    assert got["val_balanced_acc"] == 0.75 and got["val_acc"] == 2 / 3
    assert set(sums.totals) == {"val_acc", "val_loss", "val_top5"}


# ------------------------------------------------------------------ text and NaN

def test_metrics_text_is_one_line_with_a_vectors_lowest_and_highest_class():
    assert metrics_text({"val_acc": 0.91234, "val_recall": [0.9, None, 0.25, 0.5],
                         "val_x": [None, None]}) == (
        "val_acc 0.9123, val_recall min 0.2500 max 0.9000 of 4 classes, val_x -")
    assert metrics_text({}) == ""


def test_the_first_nan_metric_is_named_with_what_it_added_up():
    net = nn.Linear(2, 2)
    totals = {"val_a": (1.0, 2.0), "val_bb": (float("inf"), 3.0), "val_cc": (0.0, 0.0)}
    values = {"val_a": 0.5, "val_bb": float("inf"), "val_cc": float("nan"), "val_r": [None]}
    with pytest.raises(UserError) as e:
        check_finite(values, totals, "mine:t", net, _one())
    assert str(e.value) == (
        "task.name mine:t: the metric val_bb is inf, and the weights are finite (not a "
        "divergence): what metrics(outputs, batch) adds up for bb holds NaN/inf (sum inf over "
        "a count of 3); fix the task's metrics, or the held-out items they score")
    del totals["val_bb"]
    with pytest.raises(UserError) as e:
        check_finite(values, totals, "mine:t", net, _one())
    assert str(e.value) == (
        "task.name mine:t: the metric val_cc is nan, and the weights are finite (not a "
        "divergence): no sample was counted for it over the whole split (its count is 0): "
        "metrics(outputs, batch) returns a count of 0 for cc on every batch; fix the task's "
        "metrics, or the held-out items they score")
    check_finite({"val_a": 0.5}, {"val_a": (1.0, 2.0)}, "mine:t", net, _one())
    with torch.no_grad():
        net.bias[1] = float("nan")  # one tensor of several: the divergence check's
    check_finite(values, totals, "mine:t", net, _one())


# ------------------------------------------------------------------ two ranks

_RANKS = """
import contextlib
import torch.nn.functional as F
from torch import nn
from ddpflow.core.errors import UserError
from ddpflow.engine.ema import Ema
from ddpflow.engine.validation import Validator
from ddpflow.seams.tasks import Classification

g = torch.Generator().manual_seed(0)
x, y = torch.randn(40, 6, generator=g), torch.randint(0, 3, (40,), generator=g)
out = {}


def split(xs, ys):
    return lambda b: [(xs[i:i + b], ys[i:i + b]) for i in range(0, len(ys), b)]


def expected(net):
    with torch.no_grad():
        logits = net.eval()(x)
    hit = logits.argmax(1) == y
    recall = [hit[y == c].double().sum().item() / (y == c).sum().item() for c in range(3)]
    return {"val_acc": hit.double().mean().item(), "val_balanced_acc": sum(recall) / 3,
            "val_loss": F.cross_entropy(logits, y, reduction="sum").item() / 40,
            "val_recall": recall, "val_top5": 1.0}


def validator(train_batch, said=None, lockstep=False):
    return Validator(d, Classification(), "classification", contextlib.nullcontext(),
                     train_batch, (said if said is not None else []).append, lockstep)


torch.manual_seed(1)
lin = nn.Linear(6, 3)
# rank 1 has no batch: its sums have no names, rank 0's decide
mine = split(x, y) if d.rank == 0 else split(x[:0], y[:0])
out["uneven"] = [validator(8).metrics(lin, mine), expected(lin)]

# one rank out of memory: every rank starts again at half the batch
class Oom(nn.Module):
    def forward(self, xs):
        if d.rank == 1 and len(xs) > 4:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return lin(xs)

said = []
v = validator(4, said)
half = split(x[:20], y[:20]) if d.rank == 0 else split(x[20:], y[20:])
out["oom"] = [v.metrics(Oom(), half), expected(lin), said, v.batch]

# FSDP: a forward is a collective; rank 0 has 3 batches, rank 1 two (and runs its last
# again, uncounted, to join the third)
class Gathers(nn.Module):
    def forward(self, xs):
        torch.distributed.all_reduce(torch.ones(2))
        return lin(xs)

mine = split(x[:12], y[:12]) if d.rank == 0 else split(x[12:20], y[12:20])
v = validator(4, lockstep=True)
got = v.metrics(Gathers(), mine)
with torch.no_grad():
    logits = lin(x[:20])
hit = logits.argmax(1) == y[:20]
out["lockstep"] = [got, {"val_acc": hit.double().mean().item(),
                         "val_loss": F.cross_entropy(logits, y[:20], reduction="sum").item()
                         / 20}]

# BatchNorm statistics: every rank validates with rank 0's, and keeps them
torch.manual_seed(2)
bn = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
ema = Ema(bn, 0.5, 1)
ema.update_now(bn)


def own_stats(*nets):
    for net in nets:
        with torch.no_grad():
            net[1].running_mean.fill_(0.5 * d.rank - 0.25)
            net[1].running_var.fill_(1.0 + d.rank)


def stats(net):
    return [net[1].running_mean.tolist(), net[1].running_var.tolist()]


own_stats(bn)
v = validator(4)
out["stage"] = [v.stage_metrics(bn, None, half), stats(bn)]
own_stats(bn, ema.module)
got = v.stage_metrics(bn, ema, half)
out["stage_ema"] = [got, stats(bn), stats(ema.module)]
own_stats(bn, ema.module)
out["test_ema"] = [v.test_metrics(bn, ema, half), stats(ema.module)]
own_stats(bn)
out["test"] = [v.test_metrics(bn, None, half), stats(bn)]
own_stats(bn)
out["own"] = expected(bn)  # this rank's own statistics, on the whole split
with torch.no_grad():  # rank 0's
    bn[1].running_mean.fill_(-0.25)
    bn[1].running_var.fill_(1.0)
out["bn"] = expected(bn)
print(json.dumps(out), flush=True)
"""


def _same(got: dict, want: dict) -> None:
    for k, w in want.items():
        assert got[k] == (pytest.approx(w, rel=1e-6) if not isinstance(w, list) else
                          [pytest.approx(e, rel=1e-6) for e in w]), k


def test_ranks_sum_their_metrics_restart_together_and_take_rank_0s_statistics(
        tmp_path, monkeypatch):
    # every collective's kind, shape and dtype compared across ranks: a rank that skips
    # one fails at once instead of pairing it with another
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    cfg = tiny_config(tmp_path, hardware={"nproc_per_node": 2, "threads_per_rank": 1,
                                          "timeout_s": 60})
    (r0, _), (r1, _) = gloo_ranks(tmp_path, _RANKS, 2, cfg)
    for out in (r0, r1):
        got, want = out["uneven"]
        assert sorted(got) == sorted(want)
        _same(got, want)
        got, want, said, batch = out["oom"]
        _same(got, want)
        assert said == ["validation ran out of GPU memory; again at 8 per rank",
                        "validation ran out of GPU memory; again at 4 per rank"]
        assert batch == 4
        got, want = out["lockstep"]
        _same(got, want)
    rank0 = [[-0.25] * 4, [1.0] * 4]
    raw = {k: w for k, w in r0["bn"].items() if k != "val_top5"}
    for out in (r0, r1):
        got, kept = out["stage"]
        _same(got, raw)
        assert kept == rank0
        got, kept, kept_ema = out["stage_ema"]
        assert kept == kept_ema == rank0
        _same(got, {f"val_raw_{k[4:]}": w for k, w in raw.items()})
        got, kept_ema = out["test_ema"]
        assert kept_ema == rank0 and sorted(got) == sorted(f"test_{k[4:]}" for k in r0["bn"])
        got, kept = out["test"]
        _same(got, {f"test_{k[4:]}": w for k, w in raw.items()})
        assert kept == rank0
    assert r1["own"] != r1["bn"]  # rank 1's own statistics would score otherwise


_EMPTY = """
import contextlib
from torch import nn
from ddpflow.core.errors import UserError
from ddpflow.engine.validation import Validator
from ddpflow.seams.tasks import Classification

v = Validator(d, Classification(), "classification", contextlib.nullcontext(), 4, print,
              lockstep=True)
xs, ys = torch.zeros(3 if d.rank == 0 else 0, 6), torch.zeros(3 if d.rank == 0 else 0).long()
try:
    v.metrics(nn.Linear(6, 3), lambda b: [(xs[i:i + b], ys[i:i + b])
                                          for i in range(0, len(ys), b)])
    said = "no error"
except UserError as e:
    said = str(e)
except Exception as e:  # the other rank left the group
    said = type(e).__name__
print(json.dumps(said), flush=True)
os._exit(0)
"""


def test_lockstep_names_a_rank_without_a_validation_sample(tmp_path):
    cfg = tiny_config(tmp_path, hardware={"nproc_per_node": 2, "threads_per_rank": 1,
                                          "timeout_s": 60})
    (_, _), (r1, _) = gloo_ranks(tmp_path, _EMPTY, 2, cfg)
    assert r1 == ("rank 1 has no validation sample: the split has fewer samples than the 2 "
                  "ranks; make it larger")
