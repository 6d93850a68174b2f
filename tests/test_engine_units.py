"""Small engine and launch pieces, each on its own: a rank's stop flag (a real process and
real signals), TrainState from a checkpoint, a stage's stamp, and the halt options `ddpflow
launch` passes its ranks. Fast: no training."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import tiny_config
from ddpflow.config import from_dict
from ddpflow.core.errors import UserError
from ddpflow.engine.state import StageFiles, TrainState
from ddpflow.launch.halting import rank_args

FLAG = """
import os, signal
from ddpflow.engine import stopflag
print(stopflag.received())
stopflag.install()
print(stopflag.received())
os.kill(os.getpid(), signal.{first})
os.kill(os.getpid(), signal.{second})
print(stopflag.received())
"""


@pytest.mark.parametrize("first, second", [("SIGUSR1", "SIGTERM"), ("SIGTERM", "SIGUSR1")])
def test_a_stop_signal_only_sets_the_flag_and_the_first_one_is_kept(first, second):
    """SIGTERM and SIGUSR1 would end the process; installed, they only set the flag, and the
    first one received is the one reported."""
    out = subprocess.run([sys.executable, "-c", FLAG.format(first=first, second=second)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "None", first]


def test_train_state_takes_the_checkpoints_fields_and_defaults_the_rest():
    s = TrainState.from_checkpoint({"step": 7, "epoch": 2, "best": {"value": 0.5},
                                    "model": "tensors are not state", "world": 4})
    assert (s.step, s.epoch, s.best, s.world) == (7, 2, {"value": 0.5}, 4)
    assert (s.step_in_epoch, s.elapsed_s, s.runs, s.stop, s.accum) == (0, 0.0, 0, {}, 0)
    a, b = TrainState(), TrainState()
    a.best["x"] = 1
    assert b.best == {}  # no state shared between two of them


def test_a_stage_stamps_its_identity_and_keeps_checkpoints_under_its_folder(tmp_path):
    f = StageFiles(stage="s1", out=tmp_path / "stages" / "s1", config={"a": 1},
                   config_hash="c", stage_hash="h", record={"r": 2}, resume_key="k",
                   monitor="val_acc", mode="max")
    assert f.ckpt_dir == tmp_path / "stages" / "s1" / "checkpoints"
    assert f.stamp() == {"stage": "s1", "config": {"a": 1}, "config_hash": "c",
                         "stage_hash": "h", "resume_key": "k", "record": {"r": 2}}


def _stage(tmp_path: Path, **st):
    cfg = tiny_config(tmp_path)
    cfg["stages"] = [{**cfg["stages"][0], **st}]
    return from_dict(cfg).stages[0]


def test_halt_options_reach_the_ranks_as_given(tmp_path):
    st = _stage(tmp_path, epochs=3)
    assert rank_args(st, None, None) == []
    assert rank_args(st, 5, None) == ["--halt-after-steps=5"]
    assert rank_args(st, None, 1) == ["--halt-after-epochs=1"]
    assert rank_args(st, None, 2) == ["--halt-after-epochs=2"]
    assert rank_args(st, 4, 2) == ["--halt-after-steps=4", "--halt-after-epochs=2"]


@pytest.mark.parametrize("epochs, halt, words", [
    (3, 3, "trains 3 epoch(s); give 1..2 (or leave the option out"),  # its end: no pause
    (3, 0, "trains 3 epoch(s); give 1..2"),
    (1, 1, "trains 1 epoch(s); give 1..0"),
])
def test_a_halt_the_stage_cannot_make_is_one_message(tmp_path, epochs, halt, words):
    st = _stage(tmp_path, epochs=epochs, name="warm")
    with pytest.raises(UserError) as e:
        rank_args(st, None, halt)
    assert str(e.value).startswith(f"--halt-after-epochs {halt}: stage 'warm' {words}"), e.value


def test_a_stage_measured_in_steps_has_no_epoch_halt(tmp_path):
    st = _stage(tmp_path, name="warm", max_steps=12)
    with pytest.raises(UserError) as e:
        rank_args(st, None, 1)
    assert str(e.value) == ("--halt-after-epochs 1: stage 'warm' is measured in steps "
                            "(max_steps 12); use --halt-after-steps")


# ------------------------------------------------------------------ core/errors.py

def test_sigterm_inside_stop_raises_is_an_exception_and_the_old_handler_returns():
    import os
    import signal

    from ddpflow.core.errors import Stopped, stop_raises

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Stopped) as e:
        with stop_raises():
            os.kill(os.getpid(), signal.SIGTERM)
            pytest.fail("SIGTERM did not raise")
    assert e.value.signum == signal.SIGTERM and e.value.args == (signal.SIGTERM,)
    assert signal.getsignal(signal.SIGTERM) is before


def test_an_op_without_a_deterministic_kernel_is_named_and_other_errors_are_not():
    from ddpflow.core.errors import nondeterministic

    e = RuntimeError("upsample_bilinear2d_backward_out_cuda does not have a deterministic "
                     "implementation, but you set 'torch.use_deterministic_algorithms(True)'")
    user = nondeterministic(e, "resnet18")
    assert str(user) == ("deterministic: true, but model resnet18 runs "
                         "upsample_bilinear2d_backward_out_cuda, which has no deterministic "
                         "kernel on this device; set deterministic: false (results then vary "
                         "slightly from run to run), or replace the layer that calls it")
    assert isinstance(user, UserError)
    wrapped = RuntimeError("in the first step: index_add_cuda_ does not have a deterministic "
                           "implementation, but you set it")
    assert "runs index_add_cuda_, which" in str(nondeterministic(wrapped, "m"))
    assert nondeterministic(RuntimeError("CUDA out of memory"), "m") is None
    assert nondeterministic(ValueError(str(e)), "m") is None


# ------------------------------------------------------------------ launch/agent.py

def test_the_warm_agent_runs_torchrun_with_the_args_and_env_it_is_sent(tmp_path):
    """The launcher's pipe: nothing sent, it exits at once; a job, it runs torchrun with
    exactly that environment (the agent's own is replaced) and those arguments."""
    import json
    import os

    script = tmp_path / "rank.py"
    script.write_text("import os, sys\nopen(sys.argv[1], 'w').write(os.environ.get('PROBE', '-')"
                      " + ' ' + os.environ.get('LEAK', 'gone') + ' ' + os.environ['RANK'])\n")

    def agent(job: bytes) -> subprocess.CompletedProcess:
        r, w = os.pipe()
        env = {**os.environ, "LEAK": "kept"}
        p = subprocess.Popen([sys.executable, "-m", "ddpflow.launch.agent", str(r)],
                             pass_fds=(r,), env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        os.close(r)
        os.write(w, job)
        os.close(w)
        out, err = p.communicate(timeout=300)
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)

    assert agent(b"").returncode == 0
    assert not (tmp_path / "out").exists()
    env = {k: v for k, v in os.environ.items() if k != "LEAK"}
    job = {"env": {**env, "PROBE": "sent"},
           "args": ["--nproc-per-node=1", "--standalone", str(script), str(tmp_path / "out")]}
    done = agent(json.dumps(job).encode())
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out").read_text() == "sent gone 0"


@pytest.mark.parametrize("value, limit, text", [
    ("a" * 8, 10, "'aaaaaaaa'"),  # its repr is 10 characters: whole
    ("a" * 9, 10, "'aaaa ..."),  # 11: cut to 10, the cut said
    (list(range(100)), 20, "[0, 1, 2, 3, 4, ..."),
])
def test_a_value_in_a_message_is_its_repr_capped(value, limit, text):
    from ddpflow.core.errors import short

    assert short(value, limit) == text and len(text) <= limit


# ------------------------------------------------------------------ engine/earlystop.py

def _rule(monitor="val_acc", mode="max", patience=None, target=None):
    from ddpflow.engine.earlystop import StopRule

    return StopRule(monitor, mode, patience, target, "stages.0", "classification")


def _at(step, epoch=1):
    return {"step": step, "epoch": epoch, "train_time_s": 12.34567, "wall_time_s": 20.0049}


def _validate(rule, values, key="val_acc"):
    """check() after each of `values`, as the trainer keeps its record; the records."""
    from ddpflow.engine.earlystop import check

    st, out = {}, []
    for i, v in enumerate(values):
        st = check(rule, st, {"val_loss": 1.0, key: v}, _at(10 * (i + 1), i + 1))
        out.append(st)
    return out


def test_patience_counts_validations_without_a_new_best():
    recs = _validate(_rule(patience=2), [0.5, 0.6, 0.6, 0.55])
    assert [r["bad_validations"] for r in recs] == [0, 0, 1, 2]
    assert [("stopped" in r) for r in recs] == [False, False, False, True]
    assert recs[-1]["stopped"] == {
        "reason": "val_acc did not improve on 0.6 for 2 validation(s) (patience 2)",
        "step": 40, "epoch": 4}
    recs = _validate(_rule("val_loss", "min", patience=1), [0.9, 0.8, 0.8], "val_loss")
    assert [("stopped" in r) for r in recs] == [False, False, True]


def test_a_target_is_reached_once_with_its_time_and_stops_the_stage():
    recs = _validate(_rule(target=0.6), [0.5, 0.6, 0.7])
    assert "target" not in recs[0] and recs[1]["target"] == {
        "monitor": "val_acc", "target": 0.6, "value": 0.6, "step": 20, "epoch": 2,
        "train_time_s": 12.346, "wall_time_s": 20.005}
    assert recs[1]["stopped"] == {"reason": "val_acc 0.6 reached the target 0.6",
                                  "step": 20, "epoch": 2}
    assert recs[2]["target"]["step"] == 20  # the first time stays
    recs = _validate(_rule("val_loss", "min", target=0.5), [0.6, 0.5], "val_loss")
    assert "stopped" not in recs[0] and "stopped" in recs[1]


def test_without_a_rule_the_record_is_kept_as_it_is():
    from ddpflow.engine.earlystop import check, stop_rule, summary

    assert check(None, {"best": 1}, {}, _at(1)) == {"best": 1}

    class Stop:
        monitor, patience, target = None, None, None

    assert stop_rule(Stop(), "stages.0", None, "t", "val_acc", "max") is None
    assert summary({}) == {"early_stop": None, "target": None, "time_to_target_s": None}
    rec = _validate(_rule(target=0.1), [0.5])[0]
    assert summary(rec) == {"early_stop": rec["stopped"], "target": rec["target"],
                            "time_to_target_s": 20.005}
    Stop.patience = 2  # the stop's monitor left out: best.pt's
    assert stop_rule(Stop(), "stages.0", None, "classification", "val_acc", "max") == _rule(
        patience=2)


def test_the_stop_monitor_may_be_another_metric_with_its_own_mode():
    from ddpflow.engine.earlystop import stop_rule

    class Stop:
        monitor, patience, target = "val_loss", 3, None

    from ddpflow.seams.tasks import Classification

    task = Classification()
    rule = stop_rule(Stop(), "stages.1", task, "classification", "val_acc", "max")
    assert (rule.monitor, rule.mode, rule.patience, rule.where) == (
        "val_loss", "min", 3, "stages.1")
    Stop.monitor = "val_acc"
    assert stop_rule(Stop(), "stages.1", task, "classification", "val_acc", "max").mode == "max"


@pytest.mark.parametrize("metrics, words", [
    ({"val_loss": 1.0}, "stages.0.stop.monitor val_acc is not a validation metric of task "
                        "classification; it reports val_loss"),
    ({"val_acc": [0.5, 0.6]}, "stages.0.stop.monitor val_acc is one value per class"),
])
def test_a_stop_monitor_the_task_cannot_judge_is_one_message(metrics, words):
    from ddpflow.engine.earlystop import check

    with pytest.raises(UserError) as e:
        check(_rule(patience=1), {}, metrics, _at(1))
    assert str(e.value).startswith(words), e.value


def test_after_validation_counts_earlier_runs_and_says_why_it_stops():
    import time

    from ddpflow.engine.earlystop import after_validation

    s = TrainState(step=30, epoch=2, elapsed_s=100.0, wall_s={"train": 50.0, "startup": 5.0})
    said = []
    t0, w0 = time.perf_counter(), time.time()
    stop = after_validation(_rule(target=0.5), s, {"val_acc": 0.9}, t0, w0, said.append)
    t1, w1 = time.perf_counter(), time.time()
    assert stop["target"]["epoch"] == 3 and stop["target"]["step"] == 30
    # this process's seconds since t0 (and w0) on top of the earlier runs'
    assert 100.0 <= stop["target"]["train_time_s"] <= 100.0 + (t1 - t0) + 0.001
    assert 55.0 <= stop["target"]["wall_time_s"] <= 55.0 + (w1 - w0) + 0.001
    assert said == ["stopping early at step 30: val_acc 0.9 reached the target 0.5"]
    said.clear()
    after_validation(_rule(target=0.95), s, {"val_acc": 0.9}, time.perf_counter(),
                     time.time(), said.append)
    assert said == []


# ------------------------------------------------------------------ engine/ema.py

def _bn_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))


def test_the_ema_is_torchs_averaged_model_arithmetic():
    """Against torch's own AveragedModel with get_ema_multi_avg_fn (buffers averaged too):
    the first update copies, each later one moves by 1 - decay; integer buffers copied."""
    import torch
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    from ddpflow.engine.ema import Ema

    model = _bn_model()
    ours = Ema(model, 0.9, every_steps=2)
    ref = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    for step in range(1, 9):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
            model[1].running_mean.add_(1.0)
            model[1].num_batches_tracked.add_(1)
        ours.update(model, step)
        if step % 2 == 0:
            ref.update_parameters(model)
    assert ours.updates() == 4
    mine, theirs = ours.weights(), ref.module.state_dict()
    assert mine.keys() == theirs.keys()
    for k in mine:
        if mine[k].is_floating_point():
            torch.testing.assert_close(mine[k], theirs[k], rtol=1e-6, atol=1e-6)
    # integer buffers (BatchNorm's count) are copied; torch's AveragedModel averages them
    assert mine["1.num_batches_tracked"].item() == 8
    assert not torch.equal(mine["0.weight"], model.state_dict()["0.weight"])


def test_an_ema_resumes_from_its_weights_and_count():
    import torch

    from ddpflow.engine.ema import Ema

    model = _bn_model()
    a = Ema(model, 0.5, every_steps=1)
    a.update_now(model)
    with torch.no_grad():
        model[0].weight.add_(2.0)
    b = Ema(model, 0.5, every_steps=1)
    b.load(a.weights(), a.updates())
    a.update_now(model)
    b.update_now(model)  # a second update: lerp, not a copy
    assert b.updates() == 2
    torch.testing.assert_close(b.weights()["0.weight"], a.weights()["0.weight"])
    assert not torch.equal(b.weights()["0.weight"], model[0].weight)


@pytest.mark.parametrize("decay", [-0.1, 1.5])
def test_an_ema_decay_outside_0_1_is_refused(decay):
    from ddpflow.engine.ema import Ema

    with pytest.raises(ValueError) as e:
        Ema(_bn_model(), decay, 1)
    assert str(e.value) == f"EMA decay {decay} is outside [0, 1]"
    for edge in (0.0, 1.0):  # both ends are decays: follow the model, or never move
        ema = Ema(_bn_model(), edge, 1)
        assert not any(p.requires_grad for p in ema.module.parameters())


def test_a_stage_without_ema_has_none(tmp_path):
    from ddpflow.engine.ema import Ema, open_ema

    assert open_ema(_stage(tmp_path), _bn_model()) is None
    ema = open_ema(_stage(tmp_path, ema={"decay": 0.99, "every_steps": 3}), _bn_model())
    assert isinstance(ema, Ema) and (ema.decay, ema.every) == (0.99, 3)


# ------------------------------------------------------------------ engine/stopcontrol.py


def _one():
    import torch

    from ddpflow.engine.distributed import Dist

    return Dist(0, 0, 1, torch.device("cpu"), None)


def test_the_stop_poll_asks_about_every_stop_check_s_of_training():
    from ddpflow.engine.stopcontrol import StopPoll

    p = StopPoll(60.0, start_step=100)
    assert not p.due(100) and p.due(101)  # the first step measures the step time
    p.seen(101, 0.5)  # 120 steps a minute
    assert not p.due(220) and p.due(221)
    p.seen(221, 100.0)  # slower than a minute a step: still every step, the next one
    assert not p.due(221) and p.due(222)
    p.seen(222, 0.0)  # no time at all: far ahead, no division by zero
    assert not p.due(10**6)


def test_a_stop_signal_is_seen_at_the_poll_and_at_a_log_line(monkeypatch):
    import time

    from ddpflow.engine import stopcontrol, stopflag
    from ddpflow.engine.intervals import Interval

    monkeypatch.setattr(stopflag, "_received", [])

    class Clock:  # the logger's interval in progress: its start and steps so far
        t0, steps = time.perf_counter(), 3

    c = stopcontrol.StopControl(60.0, None)
    c.begin(10, None)
    assert c.after_step(_one(), 11, Clock, None) is None  # polled: nothing received
    assert not c.poll.due(12)  # the next poll is a minute of steps away
    stopflag._received.append("SIGUSR1")  # what the handler does
    assert c.after_step(_one(), 12, Clock, None) is None  # not due: not asked yet
    logged = Interval([], 0.5, stop_asked=True, slowest_step_s=0.01)
    assert c.after_step(_one(), 13, Clock, logged) == stopcontrol.PREEMPTED
    c.begin(13, None)
    assert c.after_step(_one(), 14, Clock, None) == stopcontrol.PREEMPTED  # due at once


def test_a_log_line_plans_the_next_poll_from_its_step_time(monkeypatch):
    from ddpflow.engine import stopcontrol, stopflag
    from ddpflow.engine.intervals import Interval

    monkeypatch.setattr(stopflag, "_received", [])
    c = stopcontrol.StopControl(60.0, None)
    c.begin(0, None)
    c.after_step(_one(), 1, None, Interval([], 0.5, stop_asked=False, slowest_step_s=0.5))
    assert not c.poll.due(120) and c.poll.due(121)


def test_halts_after_steps_and_epochs(monkeypatch):
    from ddpflow.engine import stopcontrol, stopflag
    from ddpflow.engine.intervals import Interval

    monkeypatch.setattr(stopflag, "_received", [])
    quiet = Interval([], 0.5, stop_asked=False, slowest_step_s=0.01)
    c = stopcontrol.StopControl(60.0, halt_after=20, halt_after_epochs=2)
    c.begin(0, None)
    assert c.after_step(_one(), 19, None, quiet) is None
    assert c.after_step(_one(), 20, None, quiet) == stopcontrol.HALTED
    assert c.after_step(_one(), 21, None, quiet) == stopcontrol.HALTED
    assert [c.halts_after_epoch(e) for e in (1, 2, 3)] == [False, True, False]
    assert stopcontrol.StopControl(60.0, None).halts_after_epoch(1) is False


def test_early_stopping_is_decided_after_a_validation_and_kept_in_the_state():
    import time

    from ddpflow.engine.stopcontrol import StopControl

    c = StopControl(60.0, None)
    c.begin(0, _rule(patience=1))
    s = TrainState(step=10)
    assert c.after_validation(s, {"val_acc": 0.5}, time.perf_counter(), time.time(),
                              print) is False
    assert c.after_validation(s, {"val_acc": 0.4}, time.perf_counter(), time.time(),
                              print) is True
    assert s.stop["stopped"]["step"] == 10 and StopControl.stopped(s)
    assert not StopControl.stopped(TrainState())


POLL = """
import json, sys, time
import torch, torch.distributed as td
from ddpflow.engine import stopflag
from ddpflow.engine.distributed import Dist
from ddpflow.engine.stopcontrol import StopPoll

td.init_process_group("gloo")
rank = td.get_rank()
dist = Dist(rank, rank, 2, torch.device("cpu"), "gloo")
if rank == 1:
    stopflag._received.append("SIGUSR1")  # only rank 1 was sent the signal
# rank 0: 1 step in 5 s so far; rank 1: 2 steps in 8 s (4 s a step)
t0, steps = (time.perf_counter() - 5.0, 1) if rank == 0 else (time.perf_counter() - 8.0, 2)
p = StopPoll(600.0, 0)
asked = p.poll(dist, 1, t0, steps)
open(f"{sys.argv[1]}/rank{rank}.json", "w").write(json.dumps([asked, p.next]))
td.destroy_process_group()
"""


def test_a_signal_to_one_rank_stops_both_and_the_slowest_rank_sets_the_next_poll(tmp_path):
    """Two real ranks (gloo): the poll's collective tells both that one was signalled, and
    both plan the next poll from the slowest rank's step time (600 s / 5 s a step: about
    120 steps on), so they meet at the same step again."""
    import json

    (tmp_path / "poll.py").write_text(POLL)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node=2", str(tmp_path / "poll.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0[0] is True and r1[0] is True
    assert r0[1] == r1[1] and 100 <= r0[1] - 1 <= 120, (r0, r1)


# ------------------------------------------------------------------ engine/stragglers.py

def test_a_straggler_by_compute_among_ranks_that_wait_for_data_alike():
    from ddpflow.engine.stragglers import find

    # every rank waits 0.5 s for data; rank 2 computes 0.3 s longer: its own step is longer
    found = find([0.5, 0.5, 0.5], [0.1, 0.1, 0.4], 1.0, ["a", "b"])
    assert [(s["rank"], s["cause"], s["host"]) for s in found] == [(2, "compute", None)]


def test_the_straggler_summary_names_the_host_of_its_last_interval():
    from ddpflow.engine.stragglers import summary

    one = {"rank": 1, "excess_s": 0.2, "above": 0.5, "cause": "data wait"}
    records = [{"kind": "train", "stragglers": [{**one, "host": "n1"}]},
               {"kind": "train", "stragglers": [{**one, "host": "n2", "cause": "compute"}]},
               {"kind": "train", "stragglers": [{**one, "host": "n3"}]}]
    s, = summary(records)
    assert (s["host"], s["intervals"], s["of"], s["cause"]) == ("n3", 3, 3, "data wait")


class _Event:
    """A CUDA event's timing, standing in for one (no GPU here)."""

    def __init__(self, ms: float):
        self.ms = ms

    def elapsed_time(self, end) -> float:
        return end.ms - self.ms


def test_gpu_compute_time_is_the_events_milliseconds_in_seconds():
    import torch

    from ddpflow.engine.stragglers import ComputeClock

    c = ComputeClock(torch.device("cpu"))
    c.seconds = 0.25  # host-timed part
    c.spans = [(_Event(0.0), _Event(500.0)), (_Event(1000.0), _Event(1250.0))]
    assert c.take() == 1.0 and (c.seconds, c.spans) == (0.0, [])
