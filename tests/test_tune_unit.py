"""engine/tune.py and engine/tunebudget.py piece by piece, in this process on a CPU: the
Pace's progress lines, its budget and stop-signal checks and its climb by throughput; the
precision rule (fp16 only when clearly faster than bf16); the Probe's layout, memory trials
and device upload; the batch search's lines; the budget's cut of a candidate's timed steps.
A one-rank gloo group (no torchrun) where a collective is the point. Fast: no training run,
a tiny model, a clock the test moves.
"""

from __future__ import annotations

import dataclasses
import signal
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import tiny_config
from ddpflow.config import from_dict
from ddpflow.engine import distributed, stopflag, tune, tunebudget
from ddpflow.seams.models import build_model

CPU = torch.device("cpu")


class Clock:
    """monotonic seconds the test sets (tune's and tunebudget's clock)."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(tune, "time", SimpleNamespace(monotonic=c))
    monkeypatch.setattr(tunebudget, "clock", c)
    return c


@pytest.fixture
def stop_signal():
    """The rank's stop flag, set by its real handler; cleared afterwards."""
    yield lambda: stopflag._on_signal(signal.SIGTERM, None)
    stopflag._received.clear()


@pytest.fixture
def group():
    """A one-rank gloo process group (as `setup(..., "always")` makes for FSDP outside
    torchrun)."""
    cfg = from_dict(tiny_config(Path("/nonexistent")))
    d = distributed.setup(cfg.hardware, "always")
    yield d
    distributed.teardown(d)


def one_rank(master=True):
    return distributed.Dist(0 if master else 1, 0, 1, CPU, None)


# ------------------------------------------------------------------ the Pace

def test_a_pace_starts_empty_at_its_clock(clock):
    d = one_rank()
    p = tune.Pace(d, 8.0, True)
    assert (p.dist, p.budget_s, p.climb, p.t0) == (d, 8.0, True, 1000.0)
    assert (p.best_rate, p.skipped, p.checks) == ({}, [], 0)


def test_progress_lines_come_from_rank_0_alone_with_the_seconds_since_the_start(clock,
                                                                               capsys):
    tune.Pace(one_rank(master=False), 8.0, False).say("batch 8: hidden")
    p = tune.Pace(one_rank(), 8.0, False)
    clock.now += 12.34
    p.say("batch 8: shown")
    err = capsys.readouterr().err
    assert err == "[tune   12.3 s] batch 8: shown\n"


def test_the_budget_admits_candidates_until_it_is_spent(clock, capsys):
    p = tune.Pace(one_rank(), 10.0, False)
    clock.now += 9.99
    assert p.check("batch 8") is True and p.checks == 1
    clock.now += 0.01  # at the budget's end: spent
    assert p.check("batch 16") is False and p.checks == 2
    p.skip("batch 16")
    assert p.skipped == ["batch 16"]
    assert capsys.readouterr().err.endswith("] batch 16: skipped (tune.budget_s 10 s spent)\n")


def test_a_stop_signal_raises_with_the_signal_and_where_each_rank_stood(clock, stop_signal):
    p = tune.Pace(one_rank(), 10.0, False)
    assert p.check("batch 8")
    stop_signal()
    with pytest.raises(tune.TuneStopped) as e:
        p.check("batch 16")
    assert (e.value.signal, e.value.at, str(e.value)) == ("SIGTERM", [[2, "batch 16"]],
                                                          "SIGTERM")


def test_ranks_agree_through_the_process_group(group, clock, stop_signal):
    p = tune.Pace(group, 10.0, False)
    assert group.backend == "gloo"
    assert p._agreed(True) is True and p._agreed(False) is False
    assert p.check("batch 8") is True
    clock.now += 10.0
    assert p.check("batch 16") is False
    stop_signal()
    with pytest.raises(tune.TuneStopped) as e:
        p.check("batch 32")
    assert (e.value.signal, e.value.at) == ("SIGTERM", [[3, "batch 32"]])


def test_the_climb_stops_when_a_doubled_batch_is_not_5_percent_faster(clock, capsys):
    p = tune.Pace(one_rank(), 100.0, True)
    assert p.keeps_climbing(8, 0.5) is True  # 16 samples/s
    assert p.best_rate == {8: 16.0} and p.checks == 1
    # exactly GAIN x batch 8's rate: still climbing
    assert p.keeps_climbing(16, 16 / (tune.GAIN * 16.0)) is True
    assert p.best_rate[16] == 16 / (16 / (tune.GAIN * 16.0))
    assert capsys.readouterr().err == ""
    assert p.keeps_climbing(32, 32 / (p.best_rate[16] * 1.04)) is False
    assert p.checks == 2  # no check once the climb ends
    assert capsys.readouterr().err.endswith(
        "] batch 32: 17 samples/s, not 1.05x batch 16's 17: larger batches are not "
        "searched\n")


def test_an_odd_batch_is_compared_with_the_batch_at_half_of_it_rounded_down(clock, capsys):
    p = tune.Pace(one_rank(), 100.0, True)
    assert p.keeps_climbing(3, 1.0)  # 3 samples/s
    assert p.keeps_climbing(7, 7 / 3.0) is False  # 3 samples/s again, not faster
    assert "not 1.05x batch 3's 3:" in capsys.readouterr().err


def test_without_a_step_time_or_a_throughput_climb_the_search_goes_on(clock, capsys):
    p = tune.Pace(one_rank(), 100.0, True)
    assert p.keeps_climbing(8, None) is True and p.best_rate == {}
    q = tune.Pace(one_rank(), 100.0, False)  # a memory cap: OOM ends the climb
    assert q.keeps_climbing(8, 1.0) and q.keeps_climbing(16, 10.0) is True
    assert q.best_rate == {} and q.checks == 2
    clock.now += 100.0  # the budget spent: no more doubling
    assert q.keeps_climbing(32, 1.0) is False and q.checks == 3
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------ precision

def row(precision, rate, cl=False):
    return {"precision": precision, "channels_last": cl, "samples_per_s": rate}


def test_the_fastest_precision_wins_but_fp16_only_by_more_than_its_margin():
    assert tune.pick_precision_row([row("fp32", 90), row("bf16", 100)]) == row("bf16", 100)
    assert tune.pick_precision_row([row("fp32", 120), row("bf16", 100)]) == row("fp32", 120)
    # fp16 exactly FP16_MARGIN x bf16: bf16, the safer format
    edge = tune.FP16_MARGIN * 100
    assert tune.pick_precision_row([row("bf16", 100), row("fp16", edge)]) == row("bf16", 100)
    assert tune.pick_precision_row([row("bf16", 100), row("fp16", edge + 1)]) == row(
        "fp16", edge + 1)
    # the rival is bf16's fastest row: 112 is not 10% over 105
    rows = [row("bf16", 100), row("bf16", 105, True), row("fp16", 112), row("fp32", 50)]
    assert tune.pick_precision_row(rows) == row("bf16", 105, True)
    # no bf16 measured: fp16 wins as the fastest
    assert tune.pick_precision_row([row("fp32", 100), row("fp16", 101)]) == row("fp16", 101)


# ------------------------------------------------------------------ the Probe

@pytest.fixture
def probe(tmp_path, clock):
    """A one-rank Probe on 64 random 16x16 images, a SmallCNN, no budget limit."""
    cfg = from_dict(tiny_config(tmp_path, tune={"steps": 1, "start_batch": 4, "max_batch": 64},
                                stages=[{"name": "s1", "max_steps": 6, "batch_size": "auto",
                                         "channels_last": "auto"}]))
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (64, 16, 16, 3), dtype=np.uint8)
    labels = rng.integers(0, 4, 64).astype(np.int64)
    meta = {"num_classes": 4, "mean": [0.5] * 3, "std": [0.25] * 3, "image_shape": [16, 16, 3]}
    d = one_rank()
    base = build_model(cfg.model, 4, 3)
    pace = tune.Pace(d, 600.0, False)
    pace.lines = []
    pace.say = pace.lines.append
    return tune.Probe(cfg, cfg.stage("s1"), d, meta, images, labels, 3, base, 10**12, 0, pace)


def test_the_probe_layout_follows_the_stage_and_a_cpu_trains_nchw_on_auto(probe):
    assert probe.layout is False  # auto on a CPU
    probe.stage = dataclasses.replace(probe.stage, channels_last=True)
    assert probe.layout is True
    probe.stage = dataclasses.replace(probe.stage, strategy="fsdp")
    assert probe.layout is False  # FSDP2 shards contiguous parameters only


def test_a_step_fits_everywhere_only_where_its_memory_was_measured(probe):
    need = probe.step_bytes(8, "fp32", False)
    assert isinstance(need, int) and need > 0 and probe.last_step_s > 0
    assert probe.fits_everywhere(need) is True and probe.fits_everywhere(0) is True
    probe.budget = need - 1
    assert probe.step_bytes(8, "fp32", False) is None
    assert probe.fits_everywhere(None) is False


def test_the_training_split_goes_to_the_device_once(probe):
    images, labels = probe.device_data()
    assert probe.uploads == 1 and images.shape[0] == 64
    assert torch.equal(labels.cpu(), torch.from_numpy(probe.labels))
    again = probe.device_data()
    assert again[0] is images and again[1] is labels and probe.uploads == 1


def test_a_measured_candidate_has_its_throughput_and_its_line(probe):
    r = tune._measured(probe, "batch 8", 8, "dataloader", 0, 2, "fp32", False, False)
    assert r["samples_per_s"] > 0 and 0 <= r["data_wait_fraction"] <= 1
    assert probe.pace.lines[-1] == (f"batch 8: {r['samples_per_s']:.0f} samples/s, data wait "
                                    f"{r['data_wait_fraction']:.0%}")


def test_the_batch_search_finds_the_largest_batch_within_the_budget(probe):
    need = {b: probe.step_bytes(b, "fp32", False) for b in (4, 8, 16, 32, 64)}
    probe.budget = (need[16] + need[32]) // 2  # 16 fits, 32 does not
    s = tune.search_batch(probe, "fp32")
    assert s["agreed"] == s["own_max"] and 16 <= s["agreed"] < 32
    assert s["trials"][:3] == [(4, True), (8, True), (16, True)]
    assert s["trials"][3] == (32, False)
    assert s["own"] == s["trials"]
    assert s["memory"][32] is None and s["memory"][16] == need[16]
    lines = probe.pace.lines
    assert lines[0] == (f"batch 4: a step needs {need[4] / 2**20:.0f} MiB of "
                        f"{probe.budget / 2**20:.0f} MiB: fits on every rank")
    assert lines[3] == (f"batch 32: a step needs too much of {probe.budget / 2**20:.0f} MiB: "
                        f"does not fit")


def test_the_batch_search_never_exceeds_a_ranks_share_of_the_data(probe):
    probe.dist = distributed.Dist(0, 0, 2, CPU, None)  # as if 2 ranks shared the samples
    probe.labels = probe.labels[:63]  # 31 each, the odd one left out
    s = tune.search_batch(probe, "fp32")
    assert s["agreed"] == 31 and s["trials"] == [(4, True), (8, True), (16, True), (31, True)]
    probe.labels = probe.labels[:2]  # one sample each: a batch of 1
    assert tune.search_batch(probe, "fp32")["trials"] == [(1, True)]


def test_a_split_smaller_than_the_ranks_or_a_batch_of_1_too_big_is_refused(probe):
    from ddpflow.core.errors import UserError

    probe.labels = probe.labels[:1]
    probe.dist = distributed.Dist(0, 0, 2, CPU, None)
    with pytest.raises(UserError) as e:
        tune.search_batch(probe, "fp32")
    assert str(e.value) == ("the training split (1 samples) is smaller than the 2 rank(s) "
                            "that would share it")
    probe.labels, probe.dist, probe.budget = np.arange(4), one_rank(), 1
    with pytest.raises(UserError) as e:
        tune.search_batch(probe, "fp32")
    assert str(e.value) == ("not even a batch of 1 fits in device memory; choose a smaller "
                            "model or image size")


# ------------------------------------------------------------------ the budget's steps

def test_a_candidate_of_no_measurable_warm_up_keeps_all_its_timed_steps(clock):
    p = tune.Pace(one_rank(), 8.0, False)
    p.say = lambda msg: None
    tunebudget.admits(p, "batch 8")
    clock.now += 7.9  # nearly spent, but the warm-up step took no time on this clock
    assert list(tunebudget.step_indices(p, 4, CPU)) == [0, 1, 2, 3, 4, 5]
    assert p.skipped == []


def test_the_cut_is_said_with_the_time_left_and_names_the_candidate(clock):
    p = tune.Pace(one_rank(), 8.0, False)
    p.lines = []
    p.say = p.lines.append
    it = tunebudget.step_indices(p, 10, CPU)  # no candidate admitted: "candidate"
    assert [next(it), next(it)] == [0, 1]
    clock.now += 3.0  # a 3 s warm-up step, 5 s left: one timed step
    assert list(it) == [2]
    assert p.skipped == ["candidate (cut to 1 of 10 timed steps)"]
    assert p.lines == ["candidate: cut to 1 of 10 timed steps (3.00 s each, 5.0 s of "
                       "tune.budget_s 8 s left)"]
    it = tunebudget.step_indices(p, 10, CPU)
    next(it), next(it)
    clock.now += 6.0  # past the budget: still one step, and no negative time left
    assert list(it) == [2]
    assert p.lines[-1] == ("candidate: cut to 1 of 10 timed steps (6.00 s each, 0.0 s of "
                           "tune.budget_s 8 s left)")


def test_the_budget_state_lives_on_the_pace(clock):
    p = tune.Pace(one_rank(), 8.0, False)
    s = tunebudget._state(p)
    assert tunebudget._state(p) is s and p.candidates is s
    assert (s.what, s.started, s.last_s) == (None, None, 0.0)


def test_the_warm_up_clock_reads_after_the_devices_work(clock):
    clock.now = 5.0
    assert tunebudget._now(CPU) == 5.0


PACE_SCRIPT = r"""
import json, signal, sys
from ddpflow.config import from_dict
from ddpflow.engine import distributed, stopflag, tune

d = distributed.setup(from_dict(json.loads(sys.argv[1])).hardware)
pace = tune.Pace(d, 600.0, False)
out = {"one_says_stop": pace._agreed(d.rank == 0), "both_go_on": pace._agreed(True)}
if d.rank == 1:
    stopflag._on_signal(signal.SIGTERM, None)  # the signal reached rank 1 alone
try:
    pace.check("batch 8")
except tune.TuneStopped as e:
    out["stopped"] = [e.signal, e.at]
distributed.teardown(d)
print(json.dumps(out))
"""


def test_two_ranks_go_on_only_together_and_stop_together_on_one_ranks_signal(tmp_path):
    """Two ranks as torchrun starts them: a decision is the minimum of every rank's, and a
    stop signal to rank 1 alone stops both before the same candidate, named on rank 0."""
    import json
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = json.dumps(tiny_config(tmp_path))
    procs = [subprocess.Popen(
        [sys.executable, "-c", PACE_SCRIPT, cfg], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                        "DDPFLOW_THREADS": "1"}) for r in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1]) == {
            "one_says_stop": False, "both_go_on": True,
            "stopped": ["SIGTERM", [[1, "batch 8"], [1, "batch 8"]]]}
