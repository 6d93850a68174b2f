"""Sweeps: trials expanded and checked before anything runs, the slot allocator with real
processes (SIGKILL included), and one real Snakemake sweep on this CPU machine serving
the run, the no-op rerun, a shared-key change, an added grid value and failing trials."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import ddpflow, tiny_config, write_config
from ddpflow.launch.slots import POLL_S
from test_workflow import planned, snakemake, write

SWEEP_BASE = {
    "run": "sw",
    "log_every_steps": 4,
    "data": {"train_size": 256, "val_size": 64, "image_size": 16},
    "hardware": {"device": "cpu"},
    "stages": [{"name": "a", "epochs": 1, "batch_size": 32, "lr": 0.1}],
}


def _plan(tmp_path, sweep: dict, env=None, **top):
    cfg = tiny_config(tmp_path, sweep=sweep, hardware={"device": "cpu"}, **top)
    return ddpflow("sweep", "plan", "--config", write_config(tmp_path, cfg), env=env)


def _ids(tmp_path) -> list[str]:
    plan = json.loads((tmp_path / "results/t/sweep/plan.json").read_text())
    return [t["id"] for t in plan["trials"]]


# --------------------------------------------------------------------------- planning
def test_trials_have_stable_readable_ids_and_share_prepared_data(tmp_path):
    proc = _plan(tmp_path, {"grid": {"stages.0.lr": [0.05, 0.1], "stages.0.batch_size": [16, 32]},
                            "variants": [{"name": "wide", "set": {"model.kwargs": {"width": 32}}},
                                         {"name": "base"}]})
    assert proc.returncode == 0, proc.stderr
    first = _ids(tmp_path)
    assert len(first) == 8 and len(set(first)) == 8
    assert "wide_lr-0.05_batch_size-16-" in first[0]
    plan = json.loads((tmp_path / "results/t/sweep/plan.json").read_text())
    assert len({t["prepared_dir"] for t in plan["trials"]}) == 1  # data settings all equal
    t0 = json.loads(Path(plan["trials"][0]["config"]).read_text())
    assert t0["model"]["kwargs"] == {"width": 32} and t0["stages"][0]["lr"] == 0.05
    assert t0["results_dir"].endswith("results/t/trials") and t0["run"] == first[0]
    assert t0["hardware"]["slots"]["pool"].endswith("results/t/sweep/slots")
    assert "sweep" not in t0
    # one more grid value: the old trials keep their ids
    proc = _plan(tmp_path, {"grid": {"stages.0.lr": [0.05, 0.1, 0.2],
                                     "stages.0.batch_size": [16, 32]},
                            "variants": [{"name": "wide", "set": {"model.kwargs": {"width": 32}}},
                                         {"name": "base"}]})
    assert proc.returncode == 0 and set(first) < set(_ids(tmp_path)) and len(_ids(tmp_path)) == 12
    # a swept seed changes the data split: one prepared dataset per seed
    assert _plan(tmp_path, {"grid": {"seed": [0, 1]}}).returncode == 0
    plan = json.loads((tmp_path / "results/t/sweep/plan.json").read_text())
    assert len({t["prepared_dir"] for t in plan["trials"]}) == 2


def test_random_search_is_reproducible(tmp_path):
    space = {"stages.0.lr": {"log_uniform": [1e-3, 1.0]}, "stages.0.momentum":
             {"uniform": [0.8, 0.99]}, "stages.0.batch_size": {"choice": [16, 32]}}
    runs = []
    for _ in range(2):
        proc = _plan(tmp_path, {"random": {"samples": 5, "seed": 7, "space": space}})
        assert proc.returncode == 0, proc.stderr
        plan = json.loads((tmp_path / "results/t/sweep/plan.json").read_text())
        runs.append([t["overrides"] for t in plan["trials"]])
    assert runs[0] == runs[1] and len(runs[0]) == 5
    assert all(1e-3 <= o["stages.0.lr"] <= 1.0 and o["stages.0.batch_size"] in (16, 32)
               for o in runs[0])
    assert len({o["stages.0.lr"] for o in runs[0]}) == 5


@pytest.mark.parametrize("sweep, env, needles", [
    ({"grid": {"stages.0.lr": []}}, {}, ["sweep.grid", "stages.0.lr"]),
    ({"grid": {"stages.0.lrate": [0.1]}}, {}, ["sweep.grid key 'stages.0.lrate'", "lrate"]),
    ({"grid": {"stages.0.lr": [0.1, "fast"]}}, {}, ["sweep trial lr-fast", "stages.0.lr"]),
    ({"variants": [{"name": "a"}, {"name": "a"}]}, {}, ["variants names must be unique", "a"]),
    ({"grid": {"stages.0.lr": [0.1]}, "gpus_per_trial": 3}, {"CUDA_VISIBLE_DEVICES": "0,1"},
     ["gpus_per_trial is 3", "2 GPU(s)"]),
    ({"grid": {"stages.0.lr": [0.1]}, "threads_per_trial": 64}, {}, ["threads_per_trial is 64"]),
    ({"random": {"samples": 2, "space": {"stages.0.lr": {"log_uniform": [0, 1]}}}}, {},
     ["log_uniform bounds must be > 0"]),
    ({"grid": {"seed": list(range(30)), "stages.0.lr": [0.1, 0.2]}, "max_trials": 50}, {},
     ["60 trials, more than sweep.max_trials 50"]),
    ({"grid": {"results_dir": ["a", "b"]}}, {}, ["results_dir", "cannot be swept"]),
])
def test_a_bad_sweep_stops_before_anything_is_written(tmp_path, sweep, env, needles):
    cfg = tiny_config(tmp_path, sweep=sweep)
    if "gpus_per_trial" in sweep:
        cfg["hardware"] = {"device": "auto"}
    proc = ddpflow("sweep", "plan", "--config", write_config(tmp_path, cfg), env=env)
    assert proc.returncode != 0
    for needle in needles:
        assert needle in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "results").exists()


# --------------------------------------------------------------------------- slots
HOLDER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from ddpflow.launch.slots import acquire, layout, narrow_to
    gpus = sys.argv[2].split(",") if sys.argv[2] else []
    slots = layout("auto", 2, int(sys.argv[3]), gpus=gpus, cores=[0, 1])
    slot, fd = acquire(Path(sys.argv[1]), slots, "test")
    narrow_to(slot)
    print(slot.index, os.environ.get("CUDA_VISIBLE_DEVICES"), flush=True)
    time.sleep(600)
""")


def _holder(pool: Path, gpus: str = "", threads: int = 2) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", HOLDER, str(pool), gpus, str(threads)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_slots_are_distinct_and_a_killed_holder_frees_its_slot(tmp_path):
    pool = tmp_path / "slots"
    # four GPUs, two per slot: two holders get disjoint GPU pairs
    t0 = time.monotonic()
    a, b = _holder(pool, "0,1,2,3"), _holder(pool, "0,1,2,3")
    try:
        held = {p: p.stdout.readline().split() for p in (a, b)}
        start = time.monotonic() - t0  # a holder's start with a free slot, on this machine now
        assert sorted(held.values()) == [["0", "0,1"], ["1", "2,3"]]
        # a third waits while both are held, and takes the slot of a SIGKILLed holder
        c = _holder(pool, "0,1,2,3")
        time.sleep(1.5)
        assert c.poll() is None and "waiting" in _peek_stderr(c)
        b.send_signal(signal.SIGKILL)  # c takes exactly the slot b held
        t0 = time.monotonic()
        line = c.stdout.readline().split()
        # at its next look (POLL_S), not later than a holder took to start with a free slot
        assert line == held[b] and time.monotonic() - t0 < start + 2 * POLL_S
        c.kill()
    finally:
        for p in (a, b):
            p.kill()
    # CPU only: one slot of two cores
    d = _holder(pool / "cpu", "", threads=2)
    try:
        assert d.stdout.readline().split() == ["0", "None"]
    finally:
        d.kill()


def _peek_stderr(proc: subprocess.Popen) -> str:
    os.set_blocking(proc.stderr.fileno(), False)
    return proc.stderr.read() or ""


# --------------------------------------------------------------------------- workflow
@pytest.mark.slow
def test_sweep_through_the_workflow(tmp_path):
    grid = {"stages.0.lr": [0.05, 0.2], "stages.0.batch_size": [16, 32]}
    write(tmp_path, {**SWEEP_BASE, "sweep": {"grid": grid}})
    proc = snakemake(tmp_path, activated=False)  # .venv/bin/snakemake, venv not activated
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    res = tmp_path / "results/sw"
    board = json.loads((res / "sweep/leaderboard.json").read_text())
    rows = board["trials"]
    assert len(rows) == 4 and all(r["status"] == "finished" for r in rows)
    assert sum(r["best"] for r in rows) == 1 and rows[0]["best"]
    assert (tmp_path / board["best"]["weights"]).is_file()  # relative to the workflow folder
    best_values = [r["best_value"] for r in rows]
    assert best_values == sorted(best_values, reverse=True)  # val_acc: higher is better
    csv_lines = (res / "sweep/leaderboard.csv").read_text().splitlines()
    assert len(csv_lines) == 5 and csv_lines[0].split(",")[1] == "trial"
    html = (res / "sweep/report.html").read_text()
    assert html.count('">report</a>') == 4 and "metric_vs" not in html.split("<h2>Plots")[0]
    assert (res / "sweep/metric_vs_stages_0_lr.png").is_file()
    # data prepared once, by one job, for all four trials
    assert len(list((res / "sweep/data").glob("*/meta.json"))) == 1
    assert len(list((res / "logs/sweep").glob("prepare_data_*.log"))) == 1
    assert not (res / "data").exists()
    # at most two at once (2 cores, 1 per trial), never two on one slot at the same time
    holds = [json.loads(p.read_text()) for p in res.glob("trials/*/stages/a/slot.json")]
    assert len(holds) == 4 and all(h["released_at"] for h in holds)
    for i, h in enumerate(holds):
        overlapping = [g for g in holds[i + 1:] if g["acquired_at"] < h["released_at"]
                       and h["acquired_at"] < g["released_at"]]
        assert all(g["slot"] != h["slot"] and g["cores"] != h["cores"] for g in overlapping)
    assert max(sum(g["acquired_at"] <= h["acquired_at"] < g["released_at"] for g in holds)
               for h in holds) <= 2

    # nothing changed: nothing to do; a key every trial shares: every trial again
    again = snakemake(tmp_path)
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr
    write(tmp_path, {**SWEEP_BASE, "log_every_steps": 2,
                     "stages": [{**SWEEP_BASE["stages"][0], "epochs": 2}],
                     "sweep": {"grid": grid}})
    assert planned(snakemake(tmp_path, "-n")).get("sweep_train") == 4
    # tuning in a sweep: each trial tunes for itself, in its slot, before its stages
    write(tmp_path, {**SWEEP_BASE, "tune": {"enabled": True},
                     "stages": [{**SWEEP_BASE["stages"][0], "batch_size": "auto"}],
                     "sweep": {"grid": {"stages.0.lr": [0.05, 0.2]}}})
    jobs = planned(snakemake(tmp_path, "-n"))
    assert jobs.get("sweep_tune") == 2 and jobs.get("sweep_train") == 2

    # one more value for each key: only the five new trials run; three cannot (a batch
    # larger than the training split) and are rows with their reason; the others finish
    grid = {"stages.0.lr": [0.05, 0.2, 0.4], "stages.0.batch_size": [16, 32, 100000]}
    write(tmp_path, {**SWEEP_BASE, "sweep": {"grid": grid}})
    assert planned(snakemake(tmp_path, "-n")).get("sweep_train") == 5
    proc = snakemake(tmp_path)
    assert proc.returncode != 0
    rows = json.loads((res / "sweep/leaderboard.json").read_text())["trials"]
    assert len(rows) == 9
    failed = [r for r in rows if r["status"] != "finished"]
    assert len(failed) == 3 and all(r["param:stages.0.batch_size"] == 100000 for r in failed)
    assert all("batch_size 100000" in r["reason"] for r in failed), failed[0]["reason"]
    assert sum(r["status"] == "finished" for r in rows) == 6
    assert all(r["rank"] > 6 and not r["best"] for r in failed)
