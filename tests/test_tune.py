"""Tuning: the batch search (real logic, injected memory cap), 2 ranks that agree,
tune.json driving a later stage, and doctor without a GPU."""

from __future__ import annotations

import json
import math
import os
import re

import pytest

from conftest import ddpflow, tiny_config, write_config
from ddpflow.engine.memory import find_max_batch


@pytest.mark.parametrize("cap", [1, 3, 5, 37, 100, 256, 257, 511, 4096])
def test_search_converges_on_the_boundary(cap):
    limit = 512
    best, trials = find_max_batch(lambda b: b <= cap, start=8, limit=limit)
    assert best == min(cap, limit)
    assert len(trials) <= 2 * math.ceil(math.log2(limit)) + 3
    assert all(ok == (b <= cap) for b, ok in trials)


def test_search_when_nothing_fits():
    assert find_max_batch(lambda b: False, start=8, limit=64)[0] == 0


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tune")
    # the user's own model from model.code_dir (not on sys.path): every command that builds a
    # model (here the tuning ranks) finds it the same way
    (tmp / "code").mkdir()
    (tmp / "code" / "mynet.py").write_text(
        "from ddpflow.seams.models import SmallCNN\n\n"
        "def build(num_classes, in_channels):\n"
        "    return SmallCNN(num_classes, in_channels=in_channels)\n")
    # data.loader auto (tiny_config pins device): the stage then takes tune's loader
    cfg = tiny_config(tmp, tune={"steps": 3, "start_batch": 8, "max_batch": 1024},
                      data={"loader": "auto"},
                      model={"name": "mynet:build", "code_dir": str(tmp / "code")},
                      stages=[{"name": "s1", "max_steps": 6, "batch_size": "auto",
                               "precision": "auto", "channels_last": "auto"}])
    p = write_config(tmp, cfg)
    ddpflow("prepare", "--config", p, check=True)
    proc = ddpflow("launch", "--config", p, "--stage", "s1")
    assert proc.returncode == 2 and "batch_size is auto but" in proc.stderr
    assert "ddpflow tune" in proc.stderr
    # two ranks, each with its own (injected) memory: 40 MB and 30 MB
    proc = ddpflow("tune", "--config", p, "--memory-cap-mb", "40,30", check=True)
    assert "tuned ->" in proc.stderr
    return tmp, p, json.loads((tmp / "results/t/tune.json").read_text())


@pytest.mark.slow
def test_two_ranks_agree_on_the_smaller_memory(tuned):
    _, _, t = tuned
    search = t["batch_search"]
    agreed = search["agreed_max_batch"]
    r0, r1 = sorted(search["per_rank"], key=lambda r: r["rank"])
    assert r0["budget_bytes"] > r1["budget_bytes"]
    mem1 = {int(k): v for k, v in r1["memory_bytes"].items()}
    # the agreed batch fits the smaller device, the next one tried above it does not
    assert mem1[agreed] is not None and mem1[agreed] <= r1["budget_bytes"]
    above = [b for b, ok in r1["own_trials"] if b > agreed]
    assert above and all(mem1[b] is None for b in above)
    # rank 0 alone would have taken a batch that rank 1 could not: the minimum won
    assert any(ok0 and not ok1 for (b0, ok0), (b1, ok1) in zip(r0["own_trials"],
                                                            r1["own_trials"]))
    assert r0["trials"] == r1["trials"]  # the same agreed verdicts on both ranks
    # the choice is the fastest measured candidate, not necessarily the largest
    best = max(search["candidates"], key=lambda c: c["samples_per_s"])
    assert t["choice"]["batch_size"] == best["batch_size"] <= agreed
    assert {r["precision"] for r in t["precision"]} >= {"fp32", "bf16"}
    assert any(r["loader"] == "device" for r in t["loader"])
    # a real tune on 2 ranks: the split went to the device once for all its candidates
    assert t["device_loader"]["uploads"] == 1
    assert t["world_size"] == 2


@pytest.mark.slow
def test_tune_json_drives_the_stage(tuned):
    tmp, p, t = tuned
    ddpflow("launch", "--config", p, "--stage", "s1", check=True)
    s = json.loads((tmp / "results/t/stages/s1/summary.json").read_text())
    choice = t["choice"]
    assert s["batch_size_per_rank"] == choice["batch_size"]
    assert s["global_batch"] == 2 * choice["batch_size"]
    assert s["precision"] == choice["precision"] and s["loader"] == choice["loader"]
    assert s["tuned"] == choice and "ddpflow tune" in s["loader_reason"]


def test_doctor_without_a_gpu(tmp_path):
    proc = ddpflow("doctor", "--config", write_config(tmp_path, tiny_config(tmp_path)),
                   env={"CUDA_VISIBLE_DEVICES": ""}, check=True)
    out = proc.stdout
    assert "none visible" in out and "CPU cores" in out and "/dev/shm" in out
    assert "recommendations:" in out and "no GPU" in out


def test_a_capped_rank_never_tries_what_does_not_fit(tmp_path):
    """One rank in this process, a 6 MB cap: the 3 MB dataset may not take the device
    loader (half of the cap is its limit), and a precision whose step does not fit at the
    chosen batch is recorded as not fitting and never measured under DDP."""
    import numpy as np
    import torch

    from ddpflow.config import load_config
    from ddpflow.data import prepared
    from ddpflow.engine import distributed, tune
    from ddpflow.seams.models import build_model

    cfg = tiny_config(tmp_path, data={"train_size": 4096, "val_size": 256, "test_size": 0,
                                      "loader": "auto"},
                      tune={"steps": 1, "start_batch": 16, "max_batch": 128},
                      stages=[{"name": "s1", "max_steps": 6, "batch_size": "auto",
                               "precision": "bf16"}])
    p = write_config(tmp_path, cfg)
    ddpflow("prepare", "--config", p, check=True)
    c = load_config(p)
    t = tune.run(c, "s1", cap_mb=[6])
    assert t["device_loader"]["allowed"] is False and "does not fit" in \
        t["device_loader"]["reason"]
    assert {r["loader"] for r in t["loader"]} == {"dataloader"}
    assert t["choice"]["loader"] == "dataloader" and t["device_loader"]["uploads"] == 0
    budget = t["batch_search"]["per_rank"][0]["budget_bytes"]
    assert budget == int(6 * 2**20 * (1 - c.tune.memory_margin))  # no dataset on the device
    for row in t["precision"]:
        assert row["fits"] == (row["memory_bytes"] is not None)
        assert ("samples_per_s" in row) == row["fits"]
    chosen = t["choice"]
    assert any(r["fits"] and (r["precision"], r["channels_last"]) == (chosen["precision"],
                                                                     chosen["channels_last"])
               for r in t["precision"])

    # the same phase with a budget between bf16's need and fp32's (about 1.6x): fp32 is
    # left out, bf16 measured
    meta, arrays = prepared.load(c.data_dir)
    d = distributed.Dist(0, 0, 1, torch.device("cpu"), None)
    base = build_model(c.model, meta["num_classes"], 3)
    probe = tune.Probe(c, c.stage("s1"), d, meta, *arrays["train"], 3, base, 10**12, 0,
                       tune.Pace(d, budget_s=600, climb_by_throughput=False))
    need = {prec: probe.step_bytes(32, prec, False) for prec in ("fp32", "bf16")}
    assert need["fp32"] > need["bf16"]
    probe.budget = int(np.mean(list(need.values())))
    rows = tune._precisions(probe, 32, {"loader": "dataloader", "num_workers": 0,
                                        "prefetch_factor": 2})
    fits = {(r["precision"], r["channels_last"]): r["fits"] for r in rows}
    assert not fits[("fp32", False)] and not fits[("fp32", True)]
    assert fits[("bf16", False)] and fits[("fp16", True)]
    assert all(("samples_per_s" in r) == r["fits"] for r in rows)


@pytest.mark.slow
def test_tune_shows_each_candidate_ends_within_its_budget_and_stops_when_asked(tmp_path):
    """On a CPU nothing runs out of memory: tune ends by throughput and its time budget
    (not at max_batch), prints a line per candidate, and SIGTERM or Ctrl-C stop it with
    143 or 130, the earlier tune.json kept as it was."""
    import signal
    import subprocess
    import sys

    from conftest import REPO

    cfg = tiny_config(tmp_path, tune={"budget_s": 15, "max_batch": 4096, "start_batch": 8,
                                      "steps": 2},
                      hardware={"nproc_per_node": 1, "threads_per_rank": 2})
    p = write_config(tmp_path, cfg)
    ddpflow("prepare", "--config", p, check=True)
    proc = ddpflow("tune", "--config", p, check=True, timeout=300)
    lines = [(float(m[1]), m[2]) for ln in proc.stderr.splitlines()
             if (m := re.match(r"\[tune +([\d.]+) s\] (.*)", ln))]
    t = json.loads((tmp_path / "results/t/tune.json").read_text())
    tried = [b for r in t["batch_search"]["per_rank"] for b, _ in r["own_trials"]]
    assert max(tried) < 4096  # the climb ended before max_batch: nothing ran out of memory
    assert any("a step needs" in msg for _, msg in lines) and "chose" in lines[-1][1]
    measured = [i for i, (_, msg) in enumerate(lines) if re.search(r"samples/s, data wait", msg)]
    # tune.json's `skipped` lists each candidate skipped (the budget spent, or it would end
    # past it) and each one cut to fewer timed steps, and each has its line
    skipped = [i for i, (_, msg) in enumerate(lines)
               if re.search(r": skipped \(.*s (spent|are left)\)$", msg)]
    cut = [i for i, (_, msg) in enumerate(lines)
           if re.search(r": cut to \d+ of \d+ timed steps", msg)]
    assert len(measured) + len(skipped) >= 5 and len(skipped) + len(cut) == len(t["skipped"])
    # within its budget, however busy the machine: a candidate is checked in after the line
    # before it, so each one that ran began before tune.budget_s (by tune's own clock, that
    # of its lines), and once one was skipped every later one was
    assert all(lines[i - 1][0] < 15 for i in measured), lines
    assert not skipped or max(measured, default=-1) < min(skipped), lines
    assert lines[-1][0] <= t["seconds"]
    before = (tmp_path / "results/t/tune.json").read_bytes()
    for sig, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
        run = subprocess.Popen([sys.executable, "-m", "ddpflow", "tune", "--config", str(p)],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
        for line in run.stderr:  # the first candidate's line: the ranks are measuring
            if line.startswith("[tune"):
                break
        run.send_signal(sig)
        _, err = run.communicate(timeout=120)
        assert run.returncode == code, err
        assert f"tuning stopped by {sig.name}" in err and "Traceback" not in err, err
        assert (tmp_path / "results/t/tune.json").read_bytes() == before


def test_a_candidate_never_starts_once_the_budget_is_spent(monkeypatch):
    """tune.budget_s by a clock the test sets: a candidate checked in before the budget is
    measured, one after it is skipped and recorded, never run."""
    from types import SimpleNamespace

    import torch

    from ddpflow.engine import tune, tunebudget

    now = [100.0]
    monkeypatch.setattr(tune, "time", SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(tunebudget, "clock", lambda: now[0])
    pace = tune.Pace(SimpleNamespace(backend=None, is_master=False), budget_s=10,
                     climb_by_throughput=False)
    ran = []
    p = SimpleNamespace(pace=pace, dist=SimpleNamespace(device=torch.device("cpu")),
                        measure=lambda *a: ran.append(a) or {"samples_per_s": 1.0,
                                                             "data_wait_fraction": 0.0})
    now[0] = 109.9
    assert tune._measured(p, "batch 8", 8) is not None
    now[0] = 110.0
    assert tune._measured(p, "batch 16", 16) is None
    assert ran == [(8,)] and pace.skipped == ["batch 16"]


@pytest.mark.slow
def test_a_stop_signal_to_one_rank_stops_both_at_the_same_candidate(tmp_path):
    """SIGTERM to rank 1 alone (not to the launcher, which relays a signal to every rank):
    the ranks agree (the minimum of each rank's "go on") and both stop before the same
    candidate; rank 0, never signalled itself, says so; the launcher exits 143 as for its
    own SIGTERM, writes no tune.json, and no process of the run is left."""
    import signal
    import subprocess
    import sys

    import psutil

    from conftest import REPO

    cfg = tiny_config(tmp_path, tune={"budget_s": 15, "max_batch": 4096, "start_batch": 8,
                                      "steps": 2})  # 2 ranks
    p = write_config(tmp_path, cfg)
    ddpflow("prepare", "--config", p, check=True)
    resolved = str(tmp_path / "results/t/tune/config.json")  # on every rank's command line
    run = subprocess.Popen([sys.executable, "-m", "ddpflow", "tune", "--config", str(p)],
                           cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)
    head = []
    try:
        for line in run.stderr:  # the first candidate's line: both ranks are measuring
            head.append(line)
            if line.startswith("[tune"):
                break
        ranks = {q.environ().get("RANK"): q for q in psutil.Process(run.pid).children(True)
                 if resolved in q.cmdline()}  # the ranks (and torchrun's agent: no RANK)
        assert {"0", "1"} <= set(ranks), head
        ranks["1"].send_signal(signal.SIGTERM)
        _, err = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            for q in psutil.Process(run.pid).children(True):
                q.kill()
    err = "".join(head) + err
    assert run.returncode == 143, err[-3000:]
    assert "tuning stopped by SIGTERM" in err and "Traceback" not in err, err[-3000:]
    stopped = json.loads((tmp_path / "results/t/tune/stopped.json").read_text())
    (n0, what0), (n1, what1) = stopped["at_per_rank"]
    assert stopped["signal"] == "SIGTERM" and (n0, what0) == (n1, what1), stopped
    assert f"SIGTERM received: stopping before {what0}; tune.json is not written" in err
    assert not (tmp_path / "results/t/tune.json").exists()

    def of_the_run(q: psutil.Process) -> bool:
        try:
            return q.status() != psutil.STATUS_ZOMBIE and (
                str(tmp_path) in " ".join(q.cmdline()) or str(tmp_path) in q.cwd())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return False
    assert not [q.pid for q in psutil.process_iter() if of_the_run(q)]


# --------------------------------------------------------------------------- the budget
class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def pace(monkeypatch):
    """A one-rank Pace of tune.budget_s 8 on a clock the test moves (seconds)."""
    from types import SimpleNamespace

    from ddpflow.engine import tune, tunebudget

    clock = FakeClock()
    monkeypatch.setattr(tunebudget, "clock", clock)
    monkeypatch.setattr(tune, "time", SimpleNamespace(monotonic=clock))
    p = tune.Pace(SimpleNamespace(backend=None, is_master=True), 8.0, False)
    p.lines = []
    monkeypatch.setattr(p, "say", p.lines.append)
    return p, clock


def test_a_candidate_that_would_end_past_the_budget_is_not_started(pace):
    """`tune.budget_s: 8` ended at 12-24 s: the budget was checked between candidates only."""
    from ddpflow.engine.tunebudget import admits

    p, clock = pace
    assert admits(p, "batch 8")  # the first: nothing known of its length, budget left
    clock.now += 3.0  # it took 3 s
    assert admits(p, "batch 16")  # at 3 s: 3 + 3 <= 8
    clock.now += 4.0  # at 7 s: one more of about 4 s would end at 11 s
    assert not admits(p, "batch 32")
    assert p.skipped == ["batch 32"] and p.lines[-1] == (
        "batch 32: skipped (it would end past tune.budget_s 8 s: the one before took 4.0 s, "
        "1.0 s are left)")
    # a skipped candidate took no time: the next is still judged by the 4 s of the last that ran
    assert not admits(p, "batch 32, channels_last") and "took 4.0 s" in p.lines[-1]
    clock.now += 2.0  # spent: skipped as before
    assert admits(p, "batch 64") is False and p.skipped[-1] == "batch 64"
    assert "tune.budget_s 8 s spent" in p.lines[-1]


def test_a_candidate_that_would_end_at_the_budgets_end_is_started(pace):
    from ddpflow.engine.tunebudget import admits

    p, clock = pace
    assert admits(p, "batch 8")
    clock.now += 4.0  # it took 4 s: one more of 4 s ends at 8 s, not past tune.budget_s 8
    assert admits(p, "batch 16") is True and p.skipped == []


@pytest.mark.parametrize("start, step_s, steps, timed", [
    (5.0, 0.5, 10, 5),  # 2.5 s left after the warm-up, at 0.5 s a step: cut to 5 of 10
    (0.0, 0.5, 3, 3),  # all fit: not cut
    (7.9, 2.0, 10, 1),  # none fits: one timed step, for a figure
])
def test_the_timed_steps_of_a_candidate_are_cut_to_the_budget(pace, start, step_s, steps,
                                                              timed):
    from ddpflow.engine import tunebudget

    p, clock = pace
    clock.now = p.t0 + start
    tunebudget.admits(p, "batch 64, fp32")
    it = tunebudget.step_indices(p, steps, __import__("torch").device("cpu"))
    assert [next(it), next(it)] == [0, 1]  # the warm-up steps
    clock.now += step_s  # the second warm-up step's length
    rest = list(it)
    assert rest == list(range(2, timed + 2))
    cut = [s for s in p.skipped if "cut" in s]
    if timed < steps:
        assert cut == [f"batch 64, fp32 (cut to {timed} of {steps} timed steps)"]
        assert p.lines[-1].startswith(f"batch 64, fp32: cut to {timed} of {steps} timed "
                                      f"steps ({step_s:.2f} s each")
    else:
        assert cut == []
    assert list(tunebudget.step_indices(None, steps, None)) == list(range(steps + 2))


@pytest.mark.slow
def test_a_short_budget_cuts_or_skips_candidates_and_says_so(tmp_path):
    """Candidates of 40 timed steps under tune.budget_s 6: each one past the budget is cut
    to what fits (or not started), tune.json lists them, and tune still chooses."""
    cfg = tiny_config(tmp_path, tune={"budget_s": 6, "steps": 40, "start_batch": 64,
                                      "max_batch": 128},
                      hardware={"nproc_per_node": 2, "threads_per_rank": 1})
    p = write_config(tmp_path, cfg)
    ddpflow("prepare", "--config", p, check=True)
    proc = ddpflow("tune", "--config", p, check=True, timeout=600)
    t = json.loads((tmp_path / "results/t/tune.json").read_text())
    said = [ln for ln in proc.stderr.splitlines() if "timed steps" in ln or
            "would end past" in ln or "budget_s 6 s spent" in ln]
    assert said and t["skipped"], proc.stderr[-2000:]
    assert any("(cut to" in s for s in t["skipped"]) or any(
        "would end past" in ln for ln in said), t["skipped"]
    measured = [r["batch_size"] for r in t["batch_search"]["candidates"]]
    assert t["choice"]["batch_size"] in measured + [t["batch_search"]["agreed_max_batch"]]
    assert "chose" in proc.stderr
