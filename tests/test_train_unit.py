"""The training loop's components, each on its own: what a stage writes at its end (stagelog:
summary.json's figures, final.pt and best.pt with the weights handed on, failed.json), the
pieces of one optimizer step (step: the device counters, a NaN/inf loss or input remembered
at its step, the divergence message, a label beyond the outputs, the update's clip and
skipped fp16 steps). Fast: real tensors and tiny models on the CPU, real files in tmp_path,
no training run.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import signal
import struct
import sys
import termios
import time
from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from ddpflow.config import from_dict
from ddpflow.engine import checkpoint, stagelog
from ddpflow.engine.intervals import IntervalLogger, progress_line
from ddpflow.engine.state import StageEnd, StageFiles, StageSetup, TrainState
from ddpflow.engine.step import (
    StepCounters,
    divergence,
    micro_step,
    nonfinite,
    out_of_bounds,
    update,
)
from ddpflow.results.metrics import MetricsLog
from ddpflow.results.wallclock import WallClock
from fixtures import gloo_ranks

# ------------------------------------------------------------------ stagelog


def _files(tmp_path, monitor="val_acc", mode="max") -> StageFiles:
    cfg = from_dict(tiny_config(tmp_path))
    out = tmp_path / "stages" / "s1"
    out.mkdir(parents=True)
    return StageFiles(stage="s1", out=out, config=cfg.to_dict(), config_hash="c" * 8,
                      stage_hash="h" * 8, record={"made": "of this"}, resume_key="k",
                      monitor=monitor, mode=mode)


def _setup(**kw) -> StageSetup:
    base = dict(batch_size=8, accum=2, world=3, device=torch.device("cpu"), backend="gloo",
                global_batch=48, steps_per_epoch=5, total_steps=10, precision="fp32",
                strategy="ddp", wrapper="DistributedDataParallel", sharding=None,
                checkpointed=0, compile=False, tuned=False, channels_last=False,
                layout_reason="r", loader="device", loader_reason="lr", lr=0.1, init=None,
                params=100, trainable_params=90, devices=(torch.device("cpu"),), peak=None,
                ema=False)
    return StageSetup(**{**base, **kw})


def _end(**kw) -> StageEnd:
    base = dict(diverged=None, halted=False, test_metrics={}, weight_hashes=["a", "a"],
                rank_hosts=["h0", "h1"], train_t0=time.perf_counter(), flops_per_micro=None,
                skipped=0, model={"w": torch.ones(2)}, ema=None, memory=[{"total": 1.0}])
    return StageEnd(**{**base, **kw})


def _metrics(files: StageFiles) -> None:
    log = MetricsLog(files.out / "metrics.jsonl", None)
    for step, loss in ((4, 2.0), (8, 1.5), (10, 1.25)):
        log.write({"kind": "train", "step": step, "loss": loss, "samples_per_s": 10.0 * step,
                   "peak_mem_mib": step})
    for epoch in (1, 2, 3):
        log.write({"kind": "val", "step": 3 * epoch, "epoch": epoch, "val_acc": epoch / 10,
                   "val_loss": 1 / epoch, "other": epoch})
    log.close()


def test_a_finished_stages_summary_holds_its_last_figures_and_what_it_ran(tmp_path):
    files = _files(tmp_path)
    _metrics(files)
    state = TrainState(step=10, epoch=3, best={"value": 0.2, "step": 6, "metrics": {
        "val_acc": 0.2, "val_loss": 0.5}}, stop={"stopped": "patience", "target": {
            "wall_time_s": 7.0}})
    t0 = time.perf_counter() - 100.0
    before = time.perf_counter()
    s = stagelog.stage_summary(files, _setup(), state, {"total_s": 12.0, "samples_per_s": 4.0},
                               _end(train_t0=t0, test_metrics={"test_acc": 0.75}), "sha")
    after = time.perf_counter()
    assert json.loads((files.out / "summary.json").read_text()) == json.loads(json.dumps(s))
    assert (s["stage"], s["finished"], s["steps"], s["epochs"]) == ("s1", True, 10, 3)
    assert s["final_metrics"] == {"val_acc": 0.3, "val_loss": 1 / 3}  # the last validation's
    assert (s["final_val_acc"], s["final_val_loss"]) == (0.3, 1 / 3)
    assert (s["best_metrics"], s["best_value"], s["best_step"]) == (
        {"val_acc": 0.2, "val_loss": 0.5}, 0.2, 6)
    assert (s["best_val_acc"], s["best_val_loss"]) == (0.2, 0.5)
    assert (s["test_metrics"], s["test_acc"]) == ({"test_acc": 0.75}, 0.75)
    assert (s["early_stop"], s["time_to_target_s"]) == ("patience", 7.0)
    assert s["final_train_loss"] == 1.25
    assert before - t0 <= s["train_time_s"] <= after - t0
    assert (s["wall_time_s"], s["wall_samples_per_s"]) == (12.0, 4.0)
    assert s["mean_samples_per_s"] == pytest.approx(220 / 3)
    assert (s["weights"], s["flops_per_sample"], s["compiled_graphs"]) == ("raw", None, None)
    assert (s["world_size"], s["gpus_per_rank"], s["device"]) == (3, 1, "cpu")
    assert s["memory_per_rank"] == [{"total": 1.0}]
    assert (s["weights_in_sync"], s["rank_weight_sha256"]) == (True, ["a", "a"])
    assert (s["final_sha256"], s["stage_hash"], s["record"]) == ("sha", "h" * 8,
                                                                  {"made": "of this"})
    assert s["metrics_problems"] == [] and s["stragglers"] == []


def test_a_summary_of_ema_weights_flops_and_ranks_out_of_sync(tmp_path):
    files = _files(tmp_path)
    _metrics(files)
    s = stagelog.stage_summary(files, _setup(ema=True, batch_size=8), TrainState(step=10),
                               {"total_s": 1.0, "samples_per_s": None},
                               _end(flops_per_micro=80.0, weight_hashes=["a", "b"],
                                    memory=None), None)
    assert (s["weights"], s["flops_per_sample"]) == ("ema", 10.0)
    assert s["weights_in_sync"] is False and s["memory_per_rank"] == []
    assert (s["best_metrics"], s["best_value"], s["best_step"]) == ({}, None, None)
    assert (s["test_metrics"], s["early_stop"]) == ({}, None)
    one = stagelog.stage_summary(files, _setup(), TrainState(step=10),
                                 {"total_s": 1.0, "samples_per_s": None},
                                 _end(weight_hashes=["a"]), None)
    assert one["weights_in_sync"] is True  # a single rank agrees with itself


def test_compiled_graphs_are_dynamos_count_in_this_process(tmp_path):
    before = stagelog.compiled_graphs()
    fn = torch.compile(lambda t: t * 2 + 1, backend="eager")
    assert torch.equal(fn(torch.ones(3)), torch.full((3,), 3.0))
    assert stagelog.compiled_graphs() == before + 1
    files = _files(tmp_path)
    _metrics(files)
    s = stagelog.stage_summary(files, _setup(compile=True), TrainState(step=10),
                               {"total_s": 1.0, "samples_per_s": None}, _end(), None)
    assert s["compiled_graphs"] == before + 1


def test_the_wall_block_counts_every_run_and_sample_and_the_teardown_so_far():
    clock = WallClock(t0=time.time() - 100.0)
    state = TrainState(step=5, runs=2, wall_s={"train": 30.0})
    wall = stagelog.wall_block(clock, state, 16)
    assert (wall["runs"], wall["samples"]) == (3, 80)
    assert wall["split_s"]["train"] == 30.0
    assert wall["split_s"]["teardown"] >= 100.0  # the lap to now is the teardown's
    assert wall["total_s"] == pytest.approx(sum(wall["split_s"].values()))


def test_final_and_best_hand_on_the_ema_weights_and_keep_the_trained_ones(tmp_path):
    files = _files(tmp_path)
    model, ema = {"w": torch.ones(2)}, {"w": torch.zeros(2)}
    assert stagelog.handed_on(model, None) == {"model": model, "weights": "raw"}
    assert stagelog.handed_on(model, ema) == {"model": ema, "weights": "ema", "model_raw": model}
    sha = stagelog.write_final(files, model, ema, 12)
    assert (files.out / "final.pt.sha256").read_text() == f"{sha}  final.pt\n"
    final = checkpoint.load(files.out / "final.pt")
    assert (final["weights"], final["step"], final["record"]) == ("ema", 12, files.record)
    assert final["config"] == files.config
    assert torch.equal(final["model"]["w"], ema["w"])
    assert torch.equal(final["model_raw"]["w"], model["w"])
    stagelog.write_best(files, model, {"step": 6, "value": 0.5})
    best = checkpoint.load(files.out / "best.pt")
    assert (best["weights"], best["step"], best["monitor"], best["value"]) == (
        "raw", 6, "val_acc", 0.5)
    assert (best["record"], best["config"]) == (files.record, files.config)
    assert torch.equal(best["model"]["w"], model["w"]) and "model_raw" not in best


def test_a_failure_names_why_where_and_what_the_stage_was_made_of(tmp_path):
    files = _files(tmp_path)
    stagelog.write_failure(files, "loss became nan at step 3", 3)
    assert json.loads((files.out / "failed.json").read_text()) == {
        "stage": "s1", "reason": "loss became nan at step 3", "step": 3,
        "record": {"made": "of this"}}


class _Waits:
    """A checkpointer whose last save ends when it is waited for."""

    def __init__(self, clock):
        self.clock, self.waited = clock, False

    def wait(self):
        self.clock.last -= 50.0  # the save's 50 s, as the clock sees them
        self.waited = True


class _Trackers:
    def __init__(self):
        self.calls = []

    def stage_end(self, config, metrics, files):
        self.calls.append(("stage_end", metrics, [f.name for f in files]))

    def close(self, status):
        self.calls.append(("close", status))


def _results(tmp_path, trackers, **end):
    files = _files(tmp_path)
    _metrics(files)
    log = MetricsLog(files.out / "metrics.jsonl", 10)
    clock = WallClock(t0=time.time() - 1000.0)
    checkpointer, said = _Waits(clock), []
    state = TrainState(step=10, epoch=3)
    stagelog.write_results(files, _setup(ema=True), state, _end(**end), clock, log,
                           checkpointer, trackers, said.append)
    return files, log, clock, checkpointer, said


def test_a_finished_stage_ends_with_its_test_line_final_pt_and_summary(tmp_path):
    trackers = _Trackers()
    files, log, clock, checkpointer, said = _results(tmp_path, trackers,
                                                      test_metrics={"test_acc": 0.5})
    assert log.f.closed and checkpointer.waited
    last = json.loads((files.out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last == {"kind": "test", "step": 10, "epoch": 3, "weights": "ema", "test_acc": 0.5}
    summary = json.loads((files.out / "summary.json").read_text())
    assert summary["final_sha256"] == (files.out / "final.pt.sha256").read_text().split()[0]
    # final.pt's lap is the teardown's, the wait for the last save its own
    assert clock.split["teardown"] >= 1000.0 and 50.0 <= clock.split["checkpoint"] < 1000.0
    assert summary["wall"]["split_s"]["checkpoint"] == clock.split["checkpoint"]
    assert said == [f"done: {files.out / 'summary.json'}"]
    assert trackers.calls == [("stage_end", summary["final_metrics"],
                               ["summary.json", "metrics.jsonl"]), ("close", "FINISHED")]
    assert not (files.out / "failed.json").exists()


def test_a_diverged_stage_writes_failed_json_and_no_results(tmp_path):
    trackers = _Trackers()
    files, log, clock, checkpointer, said = _results(tmp_path, trackers, diverged="loss nan")
    assert log.f.closed and checkpointer.waited
    assert json.loads((files.out / "failed.json").read_text())["reason"] == "loss nan"
    assert said == ["stopped: loss nan"] and trackers.calls == [("close", "FAILED")]
    assert not (files.out / "final.pt").exists() and not (files.out / "summary.json").exists()
    assert all(json.loads(x)["kind"] != "test"
               for x in (files.out / "metrics.jsonl").read_text().splitlines())


def test_a_halted_stage_writes_nothing_but_waits_for_its_last_save(tmp_path):
    trackers = _Trackers()
    files, log, clock, checkpointer, said = _results(tmp_path, trackers, halted=True)
    assert log.f.closed and checkpointer.waited and said == []
    assert trackers.calls == [("close", "KILLED")]
    assert sorted(p.name for p in files.out.iterdir()) == ["metrics.jsonl"]
    _results(tmp_path / "none", None)  # without trackers: nothing to tell


# ------------------------------------------------------------------ step


def test_counters_start_where_the_state_left_and_remember_nothing_bad():
    c = StepCounters(TrainState(step=4, loss_sum=1.5, skipped_steps=2), torch.device("cpu"))
    assert (c.loss_sum.item(), c.loss_sum.dtype) == (1.5, torch.float64)
    assert (c.step_dev.item(), c.skipped.item()) == (5, 2)  # the step being computed
    assert c.bad_steps() == (-1, -1)


def test_the_first_step_of_a_bad_loss_and_of_bad_inputs_are_kept():
    c = StepCounters(TrainState(step=0), torch.device("cpu"))
    c.add_loss(torch.tensor(0.5, requires_grad=True) * 2, torch.ones(2))
    assert c.loss_sum.item() == 1.0 and c.bad_steps() == (-1, -1)
    c.step_dev += 1
    c.add_loss(torch.tensor(0.25), {"x": torch.tensor([1.0, float("nan")])})
    assert c.loss_sum.item() == 1.25 and c.bad_steps() == (-1, 2)  # the data first
    c.step_dev += 1
    c.add_loss(torch.tensor(float("inf")), [torch.tensor([float("inf")])])
    assert c.bad_steps() == (3, 2)
    c.step_dev += 1
    c.add_loss(torch.tensor(float("nan")), torch.tensor([float("nan")]))
    assert c.bad_steps() == (3, 2)  # the first of each is kept
    c.add_loss(torch.tensor(1.0), torch.tensor([1, 2]))  # no float input: nothing to look at


def test_nonfinite_looks_at_every_float_tensor_and_only_those():
    nan, one = torch.tensor([float("nan")]), torch.ones(3)
    assert nonfinite(torch.tensor([1, 2])) is None and nonfinite("text") is None
    assert nonfinite({"ids": torch.tensor([1]), "mask": [True]}) is None
    assert nonfinite(one).item() is False and nonfinite(nan).item() is True
    assert nonfinite((one, nan)).item() is True and nonfinite([nan, one]).item() is True
    assert nonfinite({"a": one, "b": one * 2}).item() is False
    assert nonfinite({"a": torch.tensor([2]), "b": nan}).item() is True
    assert nonfinite(torch.tensor([complex(float("inf"), 0)])).item() is True
    assert nonfinite((one, torch.tensor([1]), one)).item() is False


def _cfg(tmp_path, **data):
    return from_dict(tiny_config(tmp_path, stages=[
        {"name": "a", "epochs": 1, "batch_size": 8, "lr": 0.1},
        {"name": "b", "epochs": 1, "batch_size": 8, "lr": 0.1}], **data))


def test_a_loss_gone_bad_names_the_stages_lr_or_the_data_that_came_first(tmp_path):
    cfg = _cfg(tmp_path)
    assert divergence(cfg, "b", [(7, -1), (5, 9)], float("nan"), 2) == (
        "loss became nan at step 5 (epoch 2); lower stages.1.lr, add grad_clip or use "
        "bf16/fp32")
    data = ("the data (data.source synthetic) is broken, not the learning rate; fix or drop "
            "those samples (or their transforms)")
    assert divergence(cfg, "a", [(7, 6), (5, 4), (9, 3)], float("inf"), 1) == (
        f"the inputs of step 3 (epoch 1) hold NaN/inf, so the loss became inf at step 5: {data}")
    assert divergence(cfg, "a", [(5, 5)], 1.0, 1).startswith("the inputs of step 5 ")
    assert divergence(cfg, "a", [(5, 0)], 1.0, 1).startswith("the inputs of step 0 ")
    path = tmp_path / "imgs"
    folder = _cfg(tmp_path, data={"source": "imagefolder", "path": str(path)})
    assert f"the data (data.source imagefolder at {path}) is broken" in divergence(
        folder, "a", [(5, 5)], 1.0, 1)
    python = _cfg(tmp_path, data={"source": "python", "factory": "mymod:make"})
    assert "the data (data.factory mymod:make) is broken" in divergence(
        python, "a", [(5, 5)], 1.0, 1)


class _Clock:
    def __init__(self):
        self.calls = []

    def start(self):
        self.calls.append("start")

    def stop(self):
        self.calls.append("stop")


def _net():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 4)


def test_a_micro_step_backpropagates_its_share_of_the_loss(tmp_path):
    from ddpflow.seams.tasks import Classification

    net, task = _net(), Classification()
    batch = (torch.randn(5, 3), torch.tensor([0, 1, 2, 3, 0]))
    full = task.loss(net(batch[0]), batch)
    full.backward()
    grad = net.weight.grad.clone()
    net.zero_grad()
    clock = _Clock()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    loss = micro_step(net, batch, task, contextlib.nullcontext(), scaler, 4, "classification",
                      clock)
    assert loss.item() == pytest.approx(full.item() / 4)
    assert torch.allclose(net.weight.grad, grad / 4)
    assert clock.calls == ["start", "stop"]
    micro_step(net, batch, task, contextlib.nullcontext(), scaler, 4)  # no clock: no times
    assert torch.allclose(net.weight.grad, grad / 2)  # accumulated


class _Sums:
    """A task whose loss is not a scalar."""

    def loss(self, outputs, batch):
        return outputs.sum(1)


def test_a_loss_that_is_not_a_scalar_is_named_once_checked():
    from ddpflow.core.errors import UserError

    net, batch = _net(), (torch.randn(2, 3), None)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    with pytest.raises(UserError) as e:
        micro_step(net, batch, _Sums(), contextlib.nullcontext(), scaler, 1, "mine")
    assert str(e.value) == ("task.name mine: loss(outputs, batch) returned a tensor of shape "
                            "(2,), not a scalar tensor; reduce it (e.g. .mean())")


def test_a_label_beyond_the_outputs_is_one_message_naming_the_label_and_the_width():
    from ddpflow.core.errors import UserError
    from ddpflow.seams.tasks import Classification

    net, scaler = _net(), torch.amp.GradScaler("cpu", enabled=False)
    with pytest.raises(UserError) as e:
        micro_step(net, (torch.randn(2, 3), torch.tensor([1, 9])), Classification(),
                   contextlib.nullcontext(), scaler, 1)
    assert str(e.value) == (
        "a training batch holds label 9, but the model returns 4 outputs per sample (one per "
        "class); fix the label, or give the dataset num_classes (or classes) so that ddpflow "
        "names the item")
    assert e.value.__cause__ is None and e.value.__suppress_context__
    other = IndexError("index 3 is out of bounds")
    assert out_of_bounds(other, torch.ones(2, 4)) is None
    neg = out_of_bounds(IndexError("Target -2 is out of bounds."), torch.ones(2, 4, 2))
    assert str(neg).startswith("a training batch holds label -2, but the model returns fewer "
                               "outputs per sample")
    assert "fewer outputs" in str(out_of_bounds(IndexError("Target 5 is out of bounds."), [1]))


class _Sched:
    def __init__(self):
        self.steps = 0

    def step(self):
        self.steps += 1


def test_an_update_clips_steps_clears_and_advances():
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=1.0)
    (net.weight.sum() * 100).backward()  # every weight's gradient is 100
    before = net.weight.detach().clone()
    counters, sched = StepCounters(TrainState(step=2), torch.device("cpu")), _Sched()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    update(net, opt, sched, scaler, 1.0, counters)
    norm = 100 * net.weight.numel() ** 0.5
    assert torch.allclose(before - net.weight.detach(), torch.full_like(before, 100 / norm))
    assert net.weight.grad is None and sched.steps == 1
    assert (counters.step_dev.item(), counters.skipped.item()) == (4, 0)
    (net.weight.sum() * 100).backward()
    before = net.weight.detach().clone()
    update(net, opt, sched, scaler, None, counters)  # no clip: the whole gradient
    assert torch.allclose(before - net.weight.detach(), torch.full_like(before, 100.0))
    assert counters.step_dev.item() == 5


def test_a_step_the_scaler_skips_is_counted_and_changes_nothing():
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    counters, sched = StepCounters(TrainState(step=0, skipped_steps=1), torch.device("cpu")), \
        _Sched()
    scaler.scale(net.weight.sum() * float("inf")).backward()
    before = net.weight.detach().clone()
    update(net, opt, sched, scaler, 1.0, counters)
    assert torch.equal(net.weight.detach(), before) and counters.skipped.item() == 2
    assert scaler.get_scale() == 512.0
    scaler.scale(net.weight.sum()).backward()
    update(net, opt, sched, scaler, None, counters)
    assert counters.skipped.item() == 2 and not torch.equal(net.weight.detach(), before)


def test_gradients_are_clipped_unscaled_under_fp16s_scaler():
    """The clip applies to the true gradients (norm 4 here, under the clip of 10): the step is
    the whole gradient, not one clipped while multiplied by the scale."""
    net = torch.nn.Linear(4, 1, bias=False)
    opt = torch.optim.SGD(net.parameters(), lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    counters = StepCounters(TrainState(), torch.device("cpu"))
    scaler.scale(net.weight.sum() * 2).backward()  # each gradient 2: norm 4
    before = net.weight.detach().clone()
    update(net, opt, _Sched(), scaler, 10.0, counters)
    assert torch.allclose(before - net.weight.detach(), torch.full_like(before, 2.0))
    assert counters.skipped.item() == 0


# ------------------------------------------------------------------ intervals


class _Calls:
    """A profiler or heartbeat that notes what it is told."""

    def __init__(self):
        self.calls = []

    def step(self):
        self.calls.append("step")

    def close(self):
        self.calls.append("close")

    def beat(self, step, now=False):
        self.calls.append(("beat", step, now))


def _logger(tmp_path, is_master=True, every=4, start=0, **kw):
    log = MetricsLog(tmp_path / "metrics.jsonl", None) if is_master else None
    setup = _setup(total_steps=10, world=1, batch_size=8, accum=2, **kw)
    return IntervalLogger(setup, every, start, "s1", log, is_master, profiler=_Calls(),
                          hosts=["h0", "h1", "h2"], beat=_Calls())


def test_a_log_line_is_due_every_n_steps_and_at_the_last(tmp_path):
    logger = _logger(tmp_path)
    assert [s for s in range(1, 11) if logger.due(s)] == [4, 8, 10]
    assert (logger.bar.total, logger.bar.n) == (10, 0)
    assert _logger(tmp_path / "r", start=6).bar.n == 6  # a resumed run's bar starts there


@contextlib.contextmanager
def _terminal():
    """stderr on a real terminal (a pseudo-terminal), where the progress bar is drawn (in
    the test itself: pytest sets its own stderr again after the fixtures)."""
    master, slave = os.openpty()
    with open(slave, "w") as tty, open(master, "rb", buffering=0) as screen:
        old, sys.stderr = sys.stderr, tty
        os.set_blocking(master, False)
        try:
            yield screen, slave
        finally:
            sys.stderr = old


def _columns(fd: int, n: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, n, 0, 0))


def _drawn(screen) -> str:
    try:
        return screen.read().decode()
    except (BlockingIOError, TypeError):  # (nothing there: None)
        return ""


def test_the_bar_is_drawn_by_rank_0_on_a_terminal_only(tmp_path):
    assert _logger(tmp_path).bar.disable  # (pytest's stderr: not a terminal)
    assert _logger(tmp_path / "1", is_master=False).bar.disable


def test_the_bar_on_a_terminal_is_rank_0s_and_follows_its_width(tmp_path):
    with _terminal() as (screen, tty):
        _columns(tty, 100)
        logger = _logger(tmp_path)
        assert not logger.bar.disable
        assert _logger(tmp_path / "1", is_master=False).bar.disable
        _drawn(screen)
        _columns(tty, 40)  # the window is made narrower
        logger.stepped(1)
        logger.bar.refresh()
        line = _drawn(screen).split("\r")[-1].rstrip()
        assert line.startswith("s1:  10%") and len(line) <= 40, line
        logger.close()


def test_only_rank_0_samples_the_gpus(tmp_path):
    from ddpflow.engine.efficiency import GpuSampler

    assert isinstance(_logger(tmp_path).gpu, GpuSampler)
    assert _logger(tmp_path / "1", is_master=False).gpu is None


def test_each_step_is_counted_beaten_profiled_and_waits_are_summed(tmp_path):
    with _terminal():  # (a bar that is drawn counts its steps)
        logger = _logger(tmp_path, start=2)
    assert (logger.steps, logger.wait, logger.warmup) == (0, 0.0, True)
    logger.waited(0.5)
    logger.waited(0.25)
    logger.stepped(3)
    logger.stepped(4)
    assert (logger.steps, logger.wait, logger.bar.n) == (2, 0.75, 4)
    assert logger.beat.calls == [("beat", 3, False), ("beat", 4, False)]
    assert logger.profiler.calls == ["step", "step"]
    t0 = logger.t0
    logger.restart()
    assert (logger.steps, logger.wait) == (0, 0.0) and logger.t0 >= t0
    logger.close()
    assert logger.profiler.calls[-1] == "close" and logger.bar.disable  # (tqdm: closed)
    bare = IntervalLogger(_setup(), 4, 0, "s1", None, False)
    bare.stepped(1)  # no heartbeat, no profiler
    bare.close()


def test_a_record_is_the_intervals_figures_from_every_rank():
    setup = _setup(world=3, batch_size=8, accum=2, peak=1e12, devices=(
        torch.device("cpu"), torch.device("cpu")))
    logger = IntervalLogger(setup, 4, 0, "s1", None, False, hosts=["h0", "h1", "h2"])
    logger.steps, logger.wait, logger.warmup = 4, 1.0, False
    state = TrainState(step=8, epoch=1)
    # each rank: (step time, wait fraction, first bad, stop, bad input, compute per step)
    per_rank = [[1.0, 0.25, -1, 0, -1, 0.5], [2.0, 0.5, -1, 0, -1, 0.7],
                [1.0, 0.25, -1, 0, -1, 0.5]]
    rec = logger.record(state, per_rank, 8.0, loss=0.5, lr=0.1, flops_per_micro=1e12,
                        grad_scale=None, skipped=1, time_s=30.0)
    n = 8 * 2 * 4  # samples per rank in the interval
    assert (rec["kind"], rec["step"], rec["epoch"], rec["loss"], rec["lr"]) == (
        "train", 8, 1, 0.5, 0.1)
    assert rec["samples_per_s"] == n * 3 / 8.0
    assert rec["samples_per_s_per_rank"] == [n / 4.0, n / 8.0, n / 4.0]
    assert rec["compute_samples_per_s"] == n * 3 / 7.0
    flops_s = 1e12 * 2 * 4 * 3 / 8.0
    assert (rec["tflops"], rec["mfu"]) == (flops_s / 1e12, flops_s / (1e12 * 3 * 2))
    assert (rec["step_time_s"], rec["step_time_s_per_rank"]) == (2.0, [1.0, 2.0, 1.0])
    assert (rec["data_wait_fraction"], rec["data_wait_s_per_rank"]) == (1 / 8, [0.25, 1.0, 0.25])
    assert rec["compute_s_per_rank"] == [0.5, 0.7, 0.5]
    assert rec["peak_mem_mib"] > 0 and rec["gpu_util"] is None
    assert (rec["grad_scale"], rec["skipped_steps"], rec["warmup"], rec["time_s"]) == (
        None, 1, False, 30.0)
    # rank 1: 1.0 s wait + 0.7 s compute per step, the others 0.75 s: 0.95 s over them, of
    # the 2.0 - 0.95 s a step of the slowest rank takes without waiting for it
    assert rec["stragglers"] == [{"rank": 1, "host": "h1", "excess_s": pytest.approx(0.95),
                                  "above": pytest.approx(0.95 / 1.05), "cause": "data wait"}]
    logger.warmup = True  # a run's first interval names none
    assert logger.record(state, per_rank, 8.0, loss=0.5, lr=0.1, flops_per_micro=1e12,
                         grad_scale=None, skipped=1, time_s=30.0)["stragglers"] == []
    logger.wait = 9.0  # more wait than time cannot divide by zero or less
    assert logger.record(state, per_rank, 8.0, loss=0.5, lr=0.1, flops_per_micro=0.0,
                         grad_scale=None, skipped=1, time_s=30.0)[
        "compute_samples_per_s"] == n * 3 / 1e-9
    cpu = IntervalLogger(_setup(), 4, 0, "s1", None, False)
    cpu.steps = 1
    assert cpu.record(state, [[1.0, 0, -1, 0, -1, 0]], 1.0, loss=0.5, lr=0.1,
                      flops_per_micro=1.0, grad_scale=None, skipped=0, time_s=1.0)[
        "mfu"] is None  # no known peak


class _Sampler:
    """A GPU's utilisation and memory, as NVML's sampler gives them (there is no GPU here)."""

    def __init__(self):
        self.closed = False

    def interval(self):
        return 37.5, 2048.0

    def close(self):
        self.closed = True


def test_a_record_holds_the_gpus_figures_and_the_fullest_gpus_peak(monkeypatch):
    """DataParallel drives several GPUs from one process: the record's peak memory is the
    fullest one's (no GPU here: what each would report is given)."""
    from ddpflow.engine import intervals

    gpus = (torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cuda", 2))
    monkeypatch.setattr(intervals, "peak_memory_mib", lambda d: [100.0, 300.0, 200.0][d.index])
    logger = IntervalLogger(_setup(devices=gpus, world=1), 4, 0, "s1", None, False)
    logger.gpu, logger.steps = _Sampler(), 2
    rec = logger.record(TrainState(), [[1.0, 0.0, -1, 0, -1, 0.0]], 2.0, loss=0.5, lr=0.1,
                        flops_per_micro=1.0, grad_scale=4.0, skipped=0, time_s=1.0)
    assert (rec["gpu_util"], rec["gpu_mem_mib"], rec["peak_mem_mib"]) == (37.5, 2048.0, 300.0)
    assert rec["grad_scale"] == 4.0
    logger.close()
    assert logger.gpu.closed


def test_a_straggler_named_twice_in_a_row_is_told_once(tmp_path, capsys):
    logger = _logger(tmp_path)
    one = {"step": 4, "stragglers": [{"rank": 1, "host": "h1", "excess_s": 0.5,
                                      "above": 0.5, "cause": "compute"}]}
    logger.tell_stragglers(one)
    assert capsys.readouterr().err == ""  # a blip
    logger.tell_stragglers({**one, "step": 8})
    assert capsys.readouterr().err == (
        "[s1] step 8: straggler: rank 1 (host h1) holds every step back by 0.5 s (+50% over "
        "what the other ranks need), in compute\n")
    logger.tell_stragglers({**one, "step": 12})
    assert capsys.readouterr().err == ""  # told already
    logger.tell_stragglers({"step": 16, "stragglers": []})
    logger.tell_stragglers({**one, "step": 20})
    logger.tell_stragglers({**one, "step": 24})
    assert "[s1] step 24: straggler: rank 1 " in capsys.readouterr().err  # again, once more


def test_the_progress_line_without_a_terminal():
    assert progress_line({"step": 8, "epoch": 1, "loss": 0.123456, "lr": 0.0012345,
                          "samples_per_s": 1234.5, "data_wait_fraction": 0.256}, 10) == (
        "step 8/10 (epoch 1): loss 0.1235, lr 0.00123, 1234 samples/s, data wait 26%")


def _interval_write(tmp_path, logger, loss_sum, counters_step=9, bad_loss=False):
    """A log line of 4 steps over the last 100 s, 25 s of them waiting for data; the
    compute clock holds what it timed; the first of two parameter groups has lr 0.25."""
    from ddpflow.engine.distributed import Dist

    counters = StepCounters(TrainState(step=counters_step - 1, loss_sum=loss_sum,
                                       skipped_steps=1), torch.device("cpu"))
    if bad_loss:
        counters.add_loss(torch.tensor(float("nan")))
    state = TrainState(step=8, epoch=1, loss_count=4)
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    opt = torch.optim.SGD([{"params": a.parameters(), "lr": 0.5},
                           {"params": b.parameters(), "lr": 0.1}])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    dist = Dist(rank=0, local_rank=0, world=1, device=torch.device("cpu"), backend=None)
    logger.t0 = t0 = time.perf_counter() - 100.0  # the interval began 100 s ago
    logger.steps, logger.wait = 4, 25.0
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    before = time.perf_counter()
    interval = logger.write(state, counters, dist, sched, scaler, 2.0, before - 200.0)
    return interval, counters, state, (t0, before, time.perf_counter())


def test_a_log_line_writes_the_interval_and_starts_the_next(tmp_path, capsys):
    logger = _logger(tmp_path)
    logger.compute.start()
    time.sleep(0.01)
    logger.compute.stop()
    computed = logger.compute.seconds
    interval, counters, state, (t0, before, after) = _interval_write(tmp_path, logger, 6.0)
    assert interval.bad_steps == [] and interval.loss == 1.5 and not interval.stop_asked
    rec = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert (rec["loss"], rec["lr"], rec["skipped_steps"], rec["grad_scale"]) == (
        1.5, 0.25, 1, 8.0)
    # the interval's seconds: from its start to the log line
    assert before - t0 <= 4 * rec["step_time_s"] <= after - t0
    assert interval.slowest_step_s == rec["step_time_s"]
    assert rec["data_wait_fraction"] == pytest.approx(25.0 / (4 * rec["step_time_s"]))
    assert rec["data_wait_s_per_rank"] == [pytest.approx(25.0 / 4)]
    assert rec["compute_s_per_rank"] == [pytest.approx(computed / 4)] and computed > 0
    assert rec["warmup"] is True and 200.0 <= rec["time_s"] <= 200.0 + after - before
    assert capsys.readouterr().err == f"[s1] {progress_line(rec, 10)}\n"
    assert logger.beat.calls == [("beat", 8, True)]
    assert (counters.loss_sum.item(), state.loss_count, logger.warmup) == (0.0, 0, False)
    assert (logger.steps, logger.wait) == (0, 0.0) and logger.t0 >= before
    interval, *_ = _interval_write(tmp_path, logger, 2.0)
    second = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[1])
    assert (second["loss"], second["warmup"]) == (0.5, False)
    assert second["compute_s_per_rank"] == [0.0]  # the clock started again with the interval


def test_a_new_interval_forgets_the_compute_timed_before_it(tmp_path):
    logger = _logger(tmp_path)
    logger.compute.start()
    time.sleep(0.01)
    logger.compute.stop()
    logger.restart()  # an epoch's start: the steps after the last log line are not counted
    _interval_write(tmp_path, logger, 6.0)
    rec = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert rec["compute_s_per_rank"] == [0.0]


def test_a_log_line_on_a_terminal_moves_the_bar_and_shows_the_loss(tmp_path, capsys):
    with _terminal() as (screen, tty):
        logger = _logger(tmp_path)
        _interval_write(tmp_path, logger, 6.0)
        assert logger.bar.postfix == "loss=1.500"
        logger.close()
    assert capsys.readouterr().err == ""  # the bar, not a line


def test_a_log_line_after_a_bad_loss_writes_nothing_and_keeps_the_interval(tmp_path, capsys):
    logger = _logger(tmp_path)
    interval, counters, state, _ = _interval_write(tmp_path, logger, 6.0, bad_loss=True)
    assert interval.bad_steps == [(9, -1)] and math.isnan(interval.loss)
    assert (tmp_path / "metrics.jsonl").read_text() == "" and capsys.readouterr().err == ""
    assert state.loss_count == 4 and logger.warmup and logger.steps == 4


def test_a_log_line_of_another_rank_or_with_a_stop_signal(tmp_path, monkeypatch):
    from ddpflow.engine import stopflag

    logger = _logger(tmp_path, is_master=False)
    interval, counters, state, _ = _interval_write(tmp_path, logger, 6.0)
    assert not interval.stop_asked and not (tmp_path / "metrics.jsonl").exists()
    assert (counters.loss_sum.item(), state.loss_count, logger.warmup) == (0.0, 0, False)
    monkeypatch.setattr(stopflag, "_received", [])
    handlers = {s: signal.getsignal(s) for s in stopflag.PREEMPT_SIGNALS}
    try:
        stopflag.install()
        os.kill(os.getpid(), signal.SIGUSR1)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    interval, *_ = _interval_write(tmp_path, logger, 6.0)
    assert interval.stop_asked


# ------------------------------------------------------------------ on several ranks

def _ranks(tmp_path, body: str, n: int) -> list:
    """`body` on n gloo ranks (tests/fixtures.py gloo_ranks): (JSON, stderr) per rank."""
    return gloo_ranks(tmp_path, body, n, tiny_config(tmp_path))


_LOG_LINES = """
from ddpflow.engine import stopflag
from ddpflow.engine.intervals import IntervalLogger
from ddpflow.engine.state import StageSetup, TrainState
from ddpflow.engine.step import StepCounters
from ddpflow.results.metrics import MetricsLog

setup = StageSetup(8, 1, d.world, d.device, d.backend, 8 * d.world, 5, 10, "fp32", "ddp", None,
                   None, 0, False, False, False, "r", "device", "r", 0.1, None, 10, 10,
                   (d.device,), None, False)
log = MetricsLog(root / "metrics.jsonl", None) if d.rank == 0 else None
logger = IntervalLogger(setup, 4, 0, "s1", log, d.rank == 0, hosts=["h0", "h1"])
net = torch.nn.Linear(2, 2)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
scaler = torch.amp.GradScaler("cpu", enabled=False)
out = []
for line in range(2):
    # rank 1's steps took twice as long, 80 s of its 200 s waiting for data; it received a
    # stop signal at the second log line
    logger.t0 = time.perf_counter() - (200.0 if d.rank == 1 else 100.0)
    logger.steps, logger.wait, logger.warmup = 4, 80.0 if d.rank == 1 else 0.0, False
    if d.rank == 1 and line == 1:
        stopflag._received.append("SIGUSR1")
    state = TrainState(step=4 * (line + 1), loss_count=4)
    counters = StepCounters(TrainState(step=state.step, loss_sum=4.0), d.device)
    i = logger.write(state, counters, d, sched, scaler, 1.0, time.perf_counter())
    out.append([i.stop_asked, i.slowest_step_s, i.bad_steps])
logger.close()
print(json.dumps(out), flush=True)
"""


def test_a_log_line_of_several_ranks_takes_the_slowest_the_stop_and_the_stragglers(tmp_path):
    said = _ranks(tmp_path, _LOG_LINES, 2)
    for out, _ in said:  # every rank learns the same
        assert [stop for stop, _, _ in out] == [False, True]
        assert all(slowest >= 50.0 and bad == [] for _, slowest, bad in out)
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [[s["rank"] for s in r["stragglers"]] for r in recs] == [[1], [1]]
    told = [x for x in said[0][1].splitlines() if "straggler" in x]
    assert len(told) == 1 and told[0].startswith("[s1] step 8: straggler: rank 1 (host h1) "
                                                 "holds every step back by 20 s"), told
    assert all("straggler" not in err for _, err in said[1:])


_BARRIER = """
from ddpflow.engine import hang

hang.BARRIER_S = 2.0
group = hang.watch_group(d)
out = [group is not None, hang.missing_ranks(d, group)]
if d.rank == 0:  # the second time ranks 1 and 2 stay away (until rank 0 is done)
    try:
        out.append(hang.missing_ranks(d, group))
    finally:
        (root / "done").touch()
else:
    deadline = time.monotonic() + 120
    while not (root / "done").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
print(json.dumps(out), flush=True)
"""


def test_the_watch_group_meets_every_rank_and_names_the_one_that_stays_away(tmp_path):
    from types import SimpleNamespace

    from ddpflow.engine import hang

    assert hang.watch_group(SimpleNamespace(backend=None, world=2)) is None
    assert hang.watch_group(SimpleNamespace(backend="gloo", world=1)) is None  # one rank
    (r0, _), (r1, _), (r2, _) = _ranks(tmp_path, _BARRIER, 3)
    assert r0[:2] == r1 == r2 == [True, [[], "monitored_barrier"]]
    assert r0[2] == [[1, 2], "monitored_barrier"]  # every rank that did not arrive


# ------------------------------------------------------------------ hang


_RANK_1 = """
import sys, time
from ddpflow.engine import heartbeat
beat = heartbeat.Heartbeat(sys.argv[1], 1, 2)
print("ready", flush=True)
time.sleep(120)
"""


@contextlib.contextmanager
def _rank_1(folder):
    """A live rank 1 on this host with its heartbeat (and faulthandler's SIGUSR2 handler)
    whose stack has not been written."""
    import subprocess

    child = subprocess.Popen([sys.executable, "-c", _RANK_1, str(folder)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        yield child
    finally:
        child.kill()
        child.wait()


def test_a_process_is_alive_until_it_ends_even_unreaped(tmp_path):
    import subprocess

    from ddpflow.engine import hang

    assert hang.alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 60
    while (Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
           and time.monotonic() < deadline):
        time.sleep(0.05)
    assert not hang.alive(child.pid)  # a zombie: ended, not yet reaped
    child.wait()
    assert not hang.alive(child.pid)  # gone


def test_a_process_named_like_a_state_is_read_by_its_state(tmp_path):
    """/proc/<pid>/stat puts the process's name in parentheses: a name holding ") Z (" is
    not the state that follows it."""
    import subprocess

    from ddpflow.engine import hang

    code = ("import ctypes, time; ctypes.CDLL(None).prctl(15, b'a) Z (b', 0, 0, 0); "
            "print('ready', flush=True); time.sleep(120)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        assert f"({'a) Z (b'})" in Path(f"/proc/{child.pid}/stat").read_text()
        assert hang.alive(child.pid)
    finally:
        child.kill()
        child.wait()


def test_an_errors_first_sentence_is_kept_to_300_characters():
    from ddpflow.engine import hang

    assert hang.error_text(RuntimeError("[/p/pair.cc:5] " + "x" * 400 + ". More.")) == "x" * 300


def test_without_procfs_a_process_is_alive_while_a_signal_can_reach_it(monkeypatch):
    """Where /proc/<pid>/stat cannot be read (no procfs: the fault is injected), signal 0
    tells: this process runs, an ended one does not, another user's (pid 1, to a process
    that is not root) runs though it may not be signalled."""
    import subprocess

    from ddpflow.engine import hang

    def no_procfs(path, *args, **kw):
        raise FileNotFoundError(2, "No such file or directory", path)

    monkeypatch.setattr(hang, "open", no_procfs, raising=False)
    assert hang.alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not hang.alive(child.pid)
    code = ("import os\nfrom ddpflow.engine import hang\n"
            "def no_procfs(path, *a, **k):\n    raise FileNotFoundError(path)\n"
            "hang.open = no_procfs\n"
            "mine = hang.alive(os.getpid())\n"  # (before it is another user)
            "if os.getuid() == 0:\n    os.setgid(65534)\n    os.setuid(65534)\n"
            "print(mine, hang.alive(1))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout == "True True\n", out.stderr


def test_a_stack_is_in_once_its_file_holds_something(tmp_path):
    from ddpflow.engine import hang, heartbeat

    assert not hang.stack_is_in(tmp_path, 3)
    heartbeat.stack_file(tmp_path, 3).write_text("")
    assert not hang.stack_is_in(tmp_path, 3)
    heartbeat.stack_file(tmp_path, 3).write_text("x")
    assert hang.stack_is_in(tmp_path, 3)


def test_the_wait_for_stacks_ends_at_its_time_without_them(tmp_path, monkeypatch):
    """STACK_WAIT_S, then on (no rank of this host to reach here): a stack that would come
    seconds later is not waited for."""
    import threading
    from types import SimpleNamespace

    from ddpflow.engine import hang, heartbeat

    monkeypatch.setattr(hang, "STACK_WAIT_S", 0.1)
    monkeypatch.setattr(hang.shutil, "which", lambda name: None)
    heartbeat.stack_file(tmp_path, 0).write_text("mine")
    late = threading.Timer(5.0, heartbeat.stack_file(tmp_path, 1).write_text, ["late"])
    late.start()
    try:
        beat = SimpleNamespace(folder=tmp_path, world=2, host="here")
        assert hang.fetch_stacks(beat, {1: {"host": "elsewhere", "pid": 1}}) == "faulthandler"
        assert not heartbeat.stack_file(tmp_path, 1).exists()
    finally:
        late.cancel()


def test_a_rank_whose_stack_does_not_come_is_signalled_once(tmp_path, monkeypatch):
    import threading

    from ddpflow.engine import hang, heartbeat

    monkeypatch.setattr(hang, "STACK_WAIT_S", 0.3)
    monkeypatch.setattr(hang.shutil, "which", lambda name: None)  # (no py-spy here either)
    beat = heartbeat.Heartbeat(tmp_path, 0, 2)
    heartbeat.stack_file(tmp_path, 0).write_text("mine")  # (diagnose writes it first)
    try:
        with _rank_1(tmp_path) as child:
            beats = {0: {"host": beat.host, "pid": os.getpid()},
                     1: {"host": beat.host, "pid": child.pid}}
            # an answer long after the wait: the rank is signalled when the wait ends
            late = threading.Timer(10.0, heartbeat.stack_file(tmp_path, 1).write_text,
                                   ["a late answer"])
            late.start()
            try:
                assert hang.fetch_stacks(beat, beats) == "faulthandler"
            finally:
                late.cancel()
            stack = heartbeat.stack_file(tmp_path, 1).read_text()
            assert stack.startswith(f"== stack of rank 1 (host {beat.host}, pid {child.pid}), "
                                    f"by faulthandler (SIGUSR2):\n"), stack
            assert "Thread" in stack and "File " in stack  # faulthandler's dump, every thread
            assert (tmp_path / "reached-1").exists()
            assert heartbeat.stack_file(tmp_path, 0).read_text() == "mine"
            heartbeat.stack_file(tmp_path, 1).write_text("")
            assert hang.fetch_stacks(beat, beats) == "faulthandler"
            assert heartbeat.stack_file(tmp_path, 1).read_text() == ""  # reached already
    finally:
        beat.close()


def test_a_rank_on_another_host_or_ended_is_not_signalled(tmp_path, monkeypatch):
    import threading

    from ddpflow.engine import hang, heartbeat

    monkeypatch.setattr(hang, "STACK_WAIT_S", 0.3)
    beat = heartbeat.Heartbeat(tmp_path, 0, 2)
    heartbeat.stack_file(tmp_path, 0).write_text("mine")
    try:
        with _rank_1(tmp_path) as child:
            late = threading.Timer(10.0, heartbeat.stack_file(tmp_path, 1).write_text,
                                   ["a late answer"])  # (long after the wait)
            late.start()
            try:
                hang.fetch_stacks(beat, {1: {"host": "elsewhere", "pid": child.pid}})
                assert heartbeat.stack_file(tmp_path, 1).read_text() == ""
                child.kill()
                child.wait()
                hang.fetch_stacks(beat, {1: {"host": beat.host, "pid": child.pid}})
                assert heartbeat.stack_file(tmp_path, 1).read_text() == ""
                assert not (tmp_path / "reached-1").exists()
            finally:
                late.cancel()
    finally:
        beat.close()


def test_a_stack_that_comes_while_waiting_is_not_fetched(tmp_path, monkeypatch):
    import threading

    from ddpflow.engine import hang, heartbeat

    monkeypatch.setattr(hang, "STACK_WAIT_S", 60.0)
    beat = heartbeat.Heartbeat(tmp_path, 0, 2)
    heartbeat.stack_file(tmp_path, 0).write_text("mine")
    try:
        with _rank_1(tmp_path) as child:
            late = threading.Timer(0.5, heartbeat.stack_file(tmp_path, 1).write_text,
                                   ["its own answer"])
            late.start()
            hang.fetch_stacks(beat, {1: {"host": beat.host, "pid": child.pid}})
            late.join()
            assert heartbeat.stack_file(tmp_path, 1).read_text() == "its own answer"
            assert not (tmp_path / "reached-1").exists()
    finally:
        beat.close()


def test_py_spy_where_installed_dumps_the_rank_that_does_not_answer(tmp_path, monkeypatch):
    """py-spy (a stand-in here that says how it was called) instead of the signal."""
    import threading

    from ddpflow.engine import hang, heartbeat

    bin_ = tmp_path / "bin"
    bin_.mkdir()
    # a dump that takes a second: within py-spy's time (3 x STACK_WAIT_S)
    (bin_ / "py-spy").write_text("#!/bin/sh\nsleep 1\necho \"py-spy $*\"\n"
                                 "echo \"to stderr\" >&2\n")
    (bin_ / "py-spy").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(hang, "STACK_WAIT_S", 1.0)
    beat = heartbeat.Heartbeat(tmp_path / "f", 0, 2)
    heartbeat.stack_file(tmp_path / "f", 0).write_text("mine")
    try:
        with _rank_1(tmp_path / "f") as child:
            late = threading.Timer(20.0, heartbeat.stack_file(tmp_path / "f", 1).write_text,
                                   ["a late answer"])  # (long after the wait)
            late.start()
            try:
                assert hang.fetch_stacks(beat, {1: {"host": beat.host, "pid": child.pid}}) == \
                    "py-spy"
            finally:
                late.cancel()
            assert heartbeat.stack_file(tmp_path / "f", 1).read_text() == (
                f"== stack of rank 1 (host {beat.host}, pid {child.pid}), by py-spy:\n"
                f"py-spy dump --pid {child.pid}\nto stderr\n")
    finally:
        beat.close()


@pytest.mark.parametrize("script, said", [
    ("#!/bin/sh\nsleep 30\n", "(py-spy gave no stack within 0.6 s)\n"),
    ("not a program\n", "(py-spy could not run: Exec format error)\n")])
def test_a_py_spy_that_hangs_or_cannot_run_is_noted_and_the_report_goes_on(
        tmp_path, monkeypatch, script, said):
    """py-spy is the user's install: one that hangs (a rank in uninterruptible I/O) or is
    not a program costs a line in the stack file, not the diagnosing rank's hang report."""
    from ddpflow.engine import hang, heartbeat

    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "py-spy").write_text(script)
    (bin_ / "py-spy").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(hang, "STACK_WAIT_S", 0.2)
    beat = heartbeat.Heartbeat(tmp_path / "f", 0, 2)
    heartbeat.stack_file(tmp_path / "f", 0).write_text("mine")
    try:
        with _rank_1(tmp_path / "f") as child:
            assert hang.fetch_stacks(beat, {1: {"host": beat.host, "pid": child.pid}}) == \
                "py-spy"
            assert heartbeat.stack_file(tmp_path / "f", 1).read_text() == (
                f"== stack of rank 1 (host {beat.host}, pid {child.pid}), by py-spy:\n{said}")
    finally:
        beat.close()
