"""engine/train.py's Trainer run for real in this process, on one CPU rank: a tiny mlp on a
tiny synthetic set, a few steps. What a user sees of the loop: the lines it says, the
metrics it writes (steps, epochs, validations, the test, the logged loss), the checkpoints,
best.pt and where a resumed stage starts (it ends as a straight one), the stops
(--halt-after-steps and --halt-after-epochs, a stop signal, early stopping, a loss or inputs
gone NaN), the summary's wall split (with a clock that reads one tick later each time: each
phase holds its laps), what a stage closes as it ends (its loader workers, profiler,
heartbeat, process group), and the errors a rank turns into a message or a hang report.
The user's model and data that fail on purpose are modules written to tmp_path
(test_trainer_unit_*); two gloo ranks are forked from this process. Fast: each stage trains
for well under a second.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import signal
import socket
import threading
import time
import traceback
from types import SimpleNamespace

import pytest
import torch

from conftest import tiny_config
from ddpflow.config import from_dict
from ddpflow.core.errors import UserError
from ddpflow.data.prepare import prepare
from ddpflow.engine import checkpoint, intervals, stopflag, train
from ddpflow.engine.runtime import weights_sha256
from ddpflow.results import wallclock

TICK = 1.000123  # seconds between two readings of the wall clock (see _Ticks)


class _Ticks:
    """The wall clock's `time`: each reading one TICK after the last, so that a phase's
    seconds count its laps. A stage of these tests reads it about a hundred times: one that
    reads it thousands of times never ends (each step and validation reads it)."""

    def __init__(self):
        self.now, self.readings = 1000.0, 0

    def time(self) -> float:
        self.readings += 1
        if self.readings > 3000:
            raise AssertionError("the stage read the clock 3000 times: its loop never ends")
        self.now += TICK
        return self.now


@pytest.fixture(autouse=True)
def _one_rank(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(stopflag, "_received", [])  # a stop signal is this test's own
    monkeypatch.setattr(wallclock, "time", _Ticks())


def _config(tmp_path, stage=None, **top):
    """64 training samples of 16 x 16, batches of 16: 4 steps an epoch."""
    st = {"name": "s1", "max_steps": 6, "batch_size": 16, "lr": 0.05, **(stage or {})}
    cfg = tiny_config(tmp_path, **{
        "log_every_steps": 2, "model": {"name": "mlp"}, "hardware": {"nproc_per_node": 1},
        "data": {"train_size": 64, "val_size": 32, "test_size": 32},
        "checkpoint": {"every_steps": 3, "keep_last": 5}, "stages": [st], **top})
    return from_dict(cfg)


def _run(cfg, capsys, halt_steps=None, halt_epochs=None) -> list[str]:
    """The stage in this process (prepared first); what it said on stderr."""
    prepare(cfg)
    capsys.readouterr()
    assert train.train_stage(cfg, "s1", halt_steps, halt_epochs) == 0
    return [x for x in capsys.readouterr().err.splitlines() if "loader: " not in x]


def _out(cfg):
    return cfg.stage_dir("s1")


def _records(cfg, kind=None) -> list[dict]:
    recs = [json.loads(x) for x in (_out(cfg) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if kind is None or r["kind"] == kind]


def _at(cfg, kind) -> list[tuple[int, int]]:
    return [(r["step"], r["epoch"]) for r in _records(cfg, kind)]


def _summary(cfg) -> dict:
    return json.loads((_out(cfg) / "summary.json").read_text())


def _ckpts(cfg) -> list[str]:
    return sorted(p.name for p in (_out(cfg) / "checkpoints").glob("*.pt"))


def _final(cfg) -> dict:
    return checkpoint.load(_out(cfg) / "final.pt")["model"]


# ------------------------------------------------------------------ a stage to its end

def test_a_stage_trains_validates_each_epoch_and_ends_with_the_test_and_final(tmp_path, capsys,
                                                                              monkeypatch):
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    cfg = _config(tmp_path)
    t0 = time.perf_counter()
    said = _run(cfg, capsys)
    took = time.perf_counter() - t0
    assert said[0] == ("[s1] mlp (13 k params) on 1 x cpu, fp32, global batch 16 (16/rank x 1 "
                       "x 1 accum), lr 0.05, 6 steps")
    assert [x.split(":")[0] for x in said[1:]] == [
        "[s1] step 2/6 (epoch 0)", "[s1] step 4/6 (epoch 0)", "[s1] epoch 0",
        "[s1] step 6/6 (epoch 1)", "[s1] epoch 1", "[s1] test", "[s1] done"]
    assert said[3].startswith("[s1] epoch 0: val_acc ") and said[6].startswith(
        "[s1] test: test_acc ")
    # steps 1-4 are epoch 0, 5-6 epoch 1; each epoch validated, the last at the last step
    assert _at(cfg, "train") == [(2, 0), (4, 0), (6, 1)]
    assert _at(cfg, "val") == [(4, 0), (6, 1)]
    assert _at(cfg, "test") == [(6, 2)]
    times = [r["time_s"] for r in _records(cfg) if r["kind"] != "test"]
    assert times == sorted(times) and times[0] > 0  # one time axis for train and val
    # every 3 steps and at each epoch's end; final.pt of the last step
    assert _ckpts(cfg) == ["ckpt-000000003.pt", "ckpt-000000004.pt", "ckpt-000000006.pt"]
    assert checkpoint.load(_out(cfg) / "final.pt")["step"] == 6
    s = _summary(cfg)
    assert (s["steps"], s["epochs"], s["finished"], s["world_size"]) == (6, 2, True, 1)
    assert s["test_acc"] == _records(cfg, "test")[0]["test_acc"]
    # the rank's hash of the weights it ended with, its host and its memory
    assert s["rank_weight_sha256"] == [weights_sha256(_final(cfg))]
    assert s["rank_hosts"] == [socket.gethostname()]
    assert [sorted(m) for m in s["memory_per_rank"]] == [[
        "activations_mib", "activations_without_checkpointing_mib", "grads_mib",
        "optimizer_mib", "params_mib", "peak_mib", "process_start_mib"]]
    assert 0 < s["train_time_s"] < took
    assert os.environ["PYTHONUNBUFFERED"] == "1"  # each rank's lines as they come
    # the stage's thread and its stack file are closed with it; its last beat is step 6
    assert "ddpflow-heartbeat" not in [t.name for t in threading.enumerate()]
    beat = json.loads((_out(cfg) / "ranks" / "0" / "rank-0.json").read_text())
    assert beat["step"] == 6


def test_every_second_of_the_stage_goes_to_its_phase(tmp_path, capsys, monkeypatch):
    # the log intervals read the same clock
    monkeypatch.setattr(intervals, "time", SimpleNamespace(perf_counter=wallclock.time.time))
    cfg = _config(tmp_path, log_every_steps=3)
    _run(cfg, capsys)
    # an epoch starts a new log interval: step 6's holds steps 5 and 6 only (step 4, after
    # epoch 0's last log line, and the validation are in none), 5 readings: a train and a
    # data wait lap each, and its end
    assert [r["step"] for r in _records(cfg, "train")] == [3, 6]
    last = _records(cfg, "train")[-1]
    assert last["step_time_s"] == pytest.approx(5 * TICK / 2)
    assert last["data_wait_s_per_rank"] == [pytest.approx(TICK)]
    wall = _summary(cfg)["wall"]
    split = wall["split_s"]
    # a lap per reading of the clock: each of the 6 batches waited for is one data wait;
    # each validation one; each save (3 + final.pt's) its own; the log lines' readings
    # (2 epoch starts, 2 lines of 2) are training's
    assert {k: round(v / TICK, 6) for k, v in split.items() if k != "startup"} == {
        "train": 20, "data_wait": 6, "validation": 2, "checkpoint": 5, "teardown": 2}
    assert split["startup"] > 0 and wall["runs"] == 1
    marks = wall["startup_marks_s"]
    order = ["rank_imports", "process_group", "data", "model", "resume", "first_step"]
    assert sorted(marks, key=marks.get) == ["rank_process", *order]
    assert [round((marks[k] - marks["rank_imports"]) / TICK) for k in order] == [0, 1, 2, 3, 4, 10]
    # the rank's process started a reading before the clock did (to 0.1 ms; /proc's
    # uptime may move by its 10 ms between the two readings)
    started = marks["rank_process"]
    assert started == round(started, 4) != round(started, 3)
    assert started == pytest.approx(TICK, abs=0.011)


def test_a_stage_ends_its_loader_workers_and_its_profiler_with_it(tmp_path, capsys):
    cfg = _config(tmp_path, data={"train_size": 64, "val_size": 32, "test_size": 32,
                                  "loader": "dataloader", "num_workers": 1},
                  profile={"stage": "s1", "wait": 1, "warmup": 1, "active": 10})
    _run(cfg, capsys)
    # its persistent DataLoader worker is stopped by the stage (a rank leaves by os._exit)
    assert multiprocessing.active_children() == []
    # the profiler's active steps outlast the stage's 5 after its warm-up: the trace is
    # written as the stage ends it
    assert (_out(cfg) / "profile" / "trace-rank0.json").is_file()
    assert (_out(cfg) / "profile" / "top_ops-rank0.txt").is_file()


# ------------------------------------------------------------------ stopped and resumed

def test_a_stage_halted_mid_epoch_resumes_there_and_ends_as_a_straight_one(tmp_path, capsys):
    stage = {"batch_size": 8, "grad_accum_steps": 2}  # 2 micro-batches of 8 a step
    straight = _config(tmp_path / "a", stage)
    _run(straight, capsys)
    cfg = _config(tmp_path / "b", stage)
    t0 = time.perf_counter()
    said = _run(cfg, capsys, halt_steps=1)
    assert said[-1] == "[s1] halted after step 1 as asked; the checkpoint resumes it"
    said = _run(cfg, capsys, halt_steps=3)  # resumed mid-epoch, halted mid-epoch again
    took = time.perf_counter() - t0
    assert said[0] == "[s1] resumed from ckpt-000000001.pt: step 1, epoch 0"
    assert said[-1] == "[s1] halted after step 3 as asked; the checkpoint resumes it"
    assert _ckpts(cfg) == ["ckpt-000000001.pt", "ckpt-000000003.pt"]
    assert not (_out(cfg) / "final.pt").exists() and not (_out(cfg) / "summary.json").exists()
    state = checkpoint.load(_out(cfg) / "checkpoints" / "ckpt-000000003.pt")
    # 3 steps of 2 micro-batches into epoch 0, trained for part of the two runs' time
    assert (state["step"], state["epoch"], state["step_in_epoch"]) == (3, 0, 6)
    assert _records(cfg, "train")[-1]["time_s"] <= state["elapsed_s"] <= took
    said = _run(cfg, capsys)
    assert said[0] == "[s1] resumed from ckpt-000000003.pt: step 3, epoch 0"
    assert _at(cfg, "train") == _at(straight, "train") == [(2, 0), (4, 0), (6, 1)]
    assert _at(cfg, "val") == [(4, 0), (6, 1)]
    assert [r["loss"] for r in _records(cfg, "train")] == [
        r["loss"] for r in _records(straight, "train")]
    a, b = _final(straight), _final(cfg)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _summary(cfg)["wall"]["runs"] == 3 and _summary(cfg)["steps"] == 6
    # one time axis across the runs: the resumed run's times go on from the checkpoint's
    after = [r["time_s"] for r in _records(cfg, "train") if r["step"] > 3]
    assert state["elapsed_s"] <= after[0] <= after[-1] <= _summary(cfg)["train_time_s"]


def test_a_stage_halted_at_its_last_step_validates_and_tests_on_resume(tmp_path, capsys):
    cfg = _config(tmp_path, {"max_steps": 5})  # epoch 1 is step 5 alone
    said = _run(cfg, capsys, halt_steps=5)
    assert _at(cfg, "val") == [(4, 0)] and _ckpts(cfg)[-1] == "ckpt-000000005.pt"
    assert _at(cfg, "test") == [] and not [x for x in said if x.startswith("[s1] test")]
    said = _run(cfg, capsys)  # the last epoch's step is done: its validation is not
    assert said[0] == "[s1] resumed from ckpt-000000005.pt: step 5, epoch 1"
    assert [x.split(":")[0] for x in said[2:]] == ["[s1] epoch 1", "[s1] test", "[s1] done"]
    assert _at(cfg, "val") == [(4, 0), (5, 1)] and _at(cfg, "test") == [(5, 2)]
    assert _at(cfg, "train") == [(2, 0), (4, 0), (5, 1)]
    assert _summary(cfg)["epochs"] == 2


def test_halt_after_epochs_pauses_after_the_epochs_validation_and_checkpoint(tmp_path, capsys):
    # smallcnn (BatchNorm: training and eval differ); validated every 2 epochs: epoch 0's
    # validation is the pause's
    stage, small = {"validate_every_epochs": 2}, {"name": "smallcnn", "kwargs": {"width": 4}}
    straight = _config(tmp_path / "a", stage, model=small)
    _run(straight, capsys)
    cfg = _config(tmp_path / "b", stage, model=small,
                  checkpoint={"every_steps": 100, "every_epochs": 5})
    said = _run(cfg, capsys, halt_epochs=1)
    assert said[-1].startswith("[s1] epoch 0: val_acc ")
    assert _at(cfg, "val") == [(4, 0)] and _ckpts(cfg) == ["ckpt-000000004.pt"]
    state = checkpoint.load(_out(cfg) / "checkpoints" / "ckpt-000000004.pt")
    assert (state["step"], state["epoch"], state["step_in_epoch"]) == (4, 1, 0)
    assert not (_out(cfg) / "summary.json").exists()
    assert checkpoint.load(_out(cfg) / "best.pt")["step"] == 4  # saved with the pause's
    said = _run(cfg, capsys)
    assert said[0] == "[s1] resumed from ckpt-000000004.pt: step 4, epoch 1"
    assert _at(cfg, "val") == [(4, 0), (6, 1)] and _at(cfg, "train") == [(2, 0), (4, 0), (6, 1)]
    # epoch 1 trains in training mode after epoch 0's validation as after the resume
    a, b = _final(straight), _final(cfg)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_stop_signal_checkpoints_at_the_step_every_rank_stops_at(tmp_path, capsys):
    old = {s: signal.getsignal(s) for s in stopflag.PREEMPT_SIGNALS}
    try:
        stopflag.install()
        os.kill(os.getpid(), signal.SIGUSR1)  # before the first step: never lost
        cfg = _config(tmp_path, log_every_steps=4)
        said = _run(cfg, capsys)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    assert said[-1] == "[s1] SIGUSR1 received: checkpoint at step 1"
    assert _ckpts(cfg) == ["ckpt-000000001.pt"] and not (_out(cfg) / "summary.json").exists()


def test_early_stopping_ends_the_stage_after_the_validation_that_decides(tmp_path, capsys):
    cfg = _config(tmp_path, stage={"stop": {"monitor": "val_acc", "target": 0.0}})
    _run(cfg, capsys)
    assert _at(cfg, "val") == [(4, 0)] and _at(cfg, "test") == [(4, 1)]
    assert _summary(cfg)["steps"] == 4 and _summary(cfg)["finished"] is True


def test_validation_every_n_epochs_and_always_at_the_last(tmp_path, capsys):
    cfg = _config(tmp_path, stage={"max_steps": 12, "validate_every_epochs": 2})
    _run(cfg, capsys)
    assert _at(cfg, "val") == [(8, 1), (12, 2)]
    cfg = _config(tmp_path / "b", stage={"max_steps": 16, "validate_every_epochs": 3})
    _run(cfg, capsys)
    assert _at(cfg, "val") == [(12, 2), (16, 3)]


def test_the_ema_is_updated_at_its_steps_and_is_what_final_pt_hands_on(tmp_path, capsys):
    cfg = _config(tmp_path, stage={"ema": {"decay": 0.5, "every_steps": 6}})
    _run(cfg, capsys)
    final = checkpoint.load(_out(cfg) / "final.pt")
    # one update, at step 6: the average starts as the weights themselves
    assert final["weights"] == "ema"
    assert all(torch.equal(final["model"][k], final["model_raw"][k]) for k in final["model"])


def test_progressive_resizing_says_each_epochs_size_and_counts_its_flops_again(tmp_path,
                                                                              capsys):
    resized = {"max_steps": None, "epochs": 2,
               "progressive_resize": {"start_size": 8, "end_size": 16}}
    small = {"model": {"name": "smallcnn", "kwargs": {"width": 4}},
             "data": {"train_size": 32, "val_size": 16, "test_size": 16}}  # 2 steps an epoch
    cfg = _config(tmp_path, resized, **small)
    said = _run(cfg, capsys)
    assert [x for x in said if "training images" in x] == [
        "[s1] epoch 0: training images at 8 px", "[s1] epoch 1: training images at 16 px"]
    whole = _config(tmp_path / "b", {"max_steps": 2}, **small)
    _run(whole, capsys)
    # the last epoch's FLOPs are those of its 16 px images, as a stage at 16 px throughout
    assert _summary(cfg)["flops_per_sample"] == _summary(whole)["flops_per_sample"]


# ------------------------------------------------------------------ a loss gone NaN

def test_a_loss_gone_nan_at_a_log_line_stops_the_stage_with_failed_json(tmp_path, capsys):
    cfg = _config(tmp_path, {"lr": 1e30}, log_every_steps=1, checkpoint={"every_steps": 100})
    said = _run(cfg, capsys)
    why = "loss became nan at step 2 (epoch 0); lower stages.0.lr, add grad_clip or use bf16/fp32"
    assert said[-1] == f"[s1] stopped: {why}"
    assert json.loads((_out(cfg) / "failed.json").read_text())["reason"] == why
    assert _at(cfg, "train") == [(1, 0)] and not (_out(cfg) / "checkpoints").exists()
    assert _at(cfg, "test") == []
    assert not (_out(cfg) / "final.pt").exists() and not (_out(cfg) / "summary.json").exists()


def test_a_checkpoint_is_never_saved_once_the_loss_went_nan(tmp_path, capsys):
    cfg = _config(tmp_path, {"lr": 1e30}, log_every_steps=100, checkpoint={"every_steps": 1})
    said = _run(cfg, capsys)
    why = ("loss became NaN/inf at step 2 (epoch 0); lower stages.0.lr, add grad_clip or use "
           "bf16/fp32")
    assert said[-1] == f"[s1] stopped: {why}"
    assert json.loads((_out(cfg) / "failed.json").read_text())["reason"] == why
    assert _ckpts(cfg) == ["ckpt-000000001.pt"]  # step 1's, the last before the NaN
    assert not (_out(cfg) / "final.pt").exists() and not (_out(cfg) / "summary.json").exists()


# ------------------------------------------------------------------ errors in a rank

NET = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, num_classes, fail="", nan_from=0, zero=False):
        super().__init__()
        self.fail, self.nan_from, self.calls = fail, nan_from, 0
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, num_classes))
        if zero:  # every class equally likely: a loss of ln(num_classes) per sample
            nn.init.zeros_(self.head[1].weight)
            nn.init.zeros_(self.head[1].bias)

    def forward(self, x):
        out = self.head(x)
        if self.training and torch.is_grad_enabled():
            self.calls += 1
            if self.fail and self.calls == 2:
                raise RuntimeError(self.fail)
            if self.nan_from and self.calls >= self.nan_from:
                return out * float("nan")
        return out
'''


def _net(tmp_path, **kwargs) -> dict:
    """model: the user's Net (above), which fails or turns its outputs NaN as asked."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "test_trainer_unit_net.py").write_text(NET)
    return {"name": "test_trainer_unit_net:Net", "code_dir": str(code), "kwargs": kwargs}


def test_a_nan_loss_found_by_the_epochs_checkpoint_ends_the_stage_there(tmp_path, capsys):
    # no log line before step 6: the checkpoint at epoch 0's end (step 4) finds the NaN
    cfg = _config(tmp_path, model=_net(tmp_path, nan_from=4), log_every_steps=100,
                  checkpoint={"every_steps": 100, "every_epochs": 1})
    said = _run(cfg, capsys)
    assert said[-1] == ("[s1] stopped: loss became NaN/inf at step 4 (epoch 1); lower "
                        "stages.0.lr, add grad_clip or use bf16/fp32")
    assert not (_out(cfg) / "checkpoints").exists()


DATA = '''
import torch

READS, NAN = 12 + 16, float("nan")


class Items(torch.utils.data.Dataset):
    """Images that turn NaN once READS of them were read (a source that breaks mid-run):
    the contract's probes read 12 (first, middle and last of train and val, at prepare and
    at the stage's start), step 1 the next 16."""

    num_classes, reads = 10, 0

    def __len__(self):
        return 64

    def __getitem__(self, i):
        Items.reads += 1
        x = torch.zeros(3, 16, 16) if Items.reads <= READS else torch.full((3, 16, 16), NAN)
        return x, i % 10


def make(split):
    return Items() if split != "test" else None
'''


def test_the_logged_loss_is_the_mean_of_the_steps_losses(tmp_path, capsys):
    cfg = _config(tmp_path, model=_net(tmp_path, zero=True), log_every_steps=1)
    _run(cfg, capsys)
    # step 1 runs on the zero weights: ln(10) for each of its samples
    assert _records(cfg, "train")[0]["loss"] == pytest.approx(math.log(10))


def test_nan_inputs_name_the_data_not_the_learning_rate(tmp_path, capsys):
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "test_trainer_unit_data.py").write_text(DATA)
    cfg = _config(tmp_path, log_every_steps=1, data={
        "source": "python", "factory": "test_trainer_unit_data:make",
        "code_dir": str(tmp_path / "code"), "num_workers": 0})
    said = _run(cfg, capsys)
    assert said[-1] == (
        "[s1] stopped: the inputs of step 2 (epoch 0) hold NaN/inf, so the loss became nan at "
        "step 2: the data (data.factory test_trainer_unit_data:make) is broken, not the "
        "learning rate; fix or drop those samples (or their transforms)")


def _failing(tmp_path, capsys, error: str):
    cfg = _config(tmp_path, model=_net(tmp_path, fail=error))
    prepare(cfg)
    capsys.readouterr()
    return cfg


def test_best_pt_is_saved_at_the_epochs_end_and_stays_when_the_loss_goes_nan(tmp_path,
                                                                              capsys):
    # no checkpoint due: best.pt of epoch 0 is saved alone; step 5's loss is NaN
    cfg = _config(tmp_path, model=_net(tmp_path, nan_from=5), log_every_steps=1,
                  checkpoint={"every_steps": 100, "every_epochs": 100})
    said = _run(cfg, capsys)
    assert said[-1] == ("[s1] stopped: loss became nan at step 5 (epoch 1); lower "
                        "stages.0.lr, add grad_clip or use bf16/fp32")
    assert checkpoint.load(_out(cfg) / "best.pt")["step"] == 4
    assert not (_out(cfg) / "checkpoints").exists()


def test_an_op_without_a_deterministic_kernel_is_one_message_naming_it(tmp_path, capsys):
    cfg = _failing(tmp_path, capsys, "scatter_add_cpu_ does not have a deterministic "
                                     "implementation, but you set 'torch.use_deterministic...")
    with pytest.raises(UserError) as e:
        train.train_stage(cfg, "s1")
    assert str(e.value) == (
        "deterministic: true, but model test_trainer_unit_net:Net runs scatter_add_cpu_, which "
        "has no deterministic kernel on this device; set deterministic: false (results then "
        "vary slightly from run to run), or replace the layer that calls it")
    assert "ddpflow-heartbeat" not in [t.name for t in threading.enumerate()]
    assert not list(_out(cfg).rglob("hang-*.json"))


def test_a_broken_collective_is_reported_before_the_error_leaves_the_rank(tmp_path, capsys):
    cfg = _failing(tmp_path, capsys, "[gloo] Connection closed by peer [10.0.0.2]:1234")
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        train.train_stage(cfg, "s1")
    report = json.loads((_out(cfg) / "ranks" / "0" / "hang-0.json").read_text())
    assert (report["rank"], report["world"], report["found_by"]) == (0, 1, "no watch group")
    assert "Connection closed by peer" in report["error"]
    assert "ddpflow-heartbeat" not in [t.name for t in threading.enumerate()]


def test_any_other_error_leaves_the_rank_as_it_is_without_a_hang_report(tmp_path, capsys):
    cfg = _failing(tmp_path, capsys, "the user's model broke")
    with pytest.raises(RuntimeError, match="^the user's model broke$"):
        train.train_stage(cfg, "s1")
    assert not list(_out(cfg).rglob("hang-*.json"))
    assert "ddpflow-heartbeat" not in [t.name for t in threading.enumerate()]


# ------------------------------------------------------------------ two ranks

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_accumulating_gradients_end_with_the_same_weights(tmp_path, capsys):
    """Two gloo ranks forked from this process (torch already imported: no torchrun's
    start-up): each all-reduces its gradients on its last micro-batch only, and both end
    with the same weights (summary.json's hashes of every rank's) and their process group
    destroyed."""
    cfg = _config(tmp_path, {"batch_size": 8, "grad_accum_steps": 2, "max_steps": 2,
                             "lr": 0.5}, log_every_steps=100)
    prepare(cfg)
    port, pids = _free_port(), []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:  # a rank: its exit status is train_stage's
            code = 1
            try:
                os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                code = train.train_stage(cfg, "s1")
                if torch.distributed.is_initialized():
                    code = 3  # the process group outlived the stage
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        pids.append(pid)
    assert [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids] == [0, 0]
    s = _summary(cfg)
    assert (s["world_size"], s["global_batch"], s["grad_accum_steps"]) == (2, 32, 2)
    assert len(set(s["rank_weight_sha256"])) == 1 and s["weights_in_sync"] is True
