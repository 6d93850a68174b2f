"""The sweep scheduler with real trials (torchrun, 2 gloo ranks each, the slot pool): ASHA
with TPE's draws, a second sweep on the same results refused, SIGTERM during a promotion,
the rerun that resumes it exactly (final weights equal to the trial trained straight
through) and the rerun that trains nothing; then trials that fail, go NaN or miss their
metric, pruned and named while the sweep goes on, through the real workflow."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, ddpflow, tiny_config, write_config
from test_workflow import snakemake, write

pytestmark = pytest.mark.slow

STAGE = {"name": "a", "epochs": 2, "batch_size": 32, "lr": 0.1}
BASE = {"seed": 0, "deterministic": True, "log_every_steps": 4,
        "data": {"train_size": 256, "val_size": 64, "test_size": 64},
        "hardware": {"device": "cpu", "nproc_per_node": 2, "threads_per_rank": 1},
        "checkpoint": {"every_steps": 0, "every_epochs": 0, "keep_last": 3},
        "stages": [STAGE]}
TPE_ASHA = {"search": "tpe", "scheduler": "asha", "asha": {"eta": 2, "min_epochs": 1},
            "random": {"samples": 2, "seed": 3, "space": {
                "stages.0.lr": {"log_uniform": [0.02, 0.3]}}}}


def _schedule(config: Path, background: bool = False):
    cmd = [sys.executable, "-m", "ddpflow", "sweep", "schedule", "--config", str(config)]
    if background:
        return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)


def _state(run: Path) -> dict | None:
    try:
        return json.loads((run / "sweep/schedule/state.json").read_text())
    except (OSError, ValueError):
        return None


def _weights(path: Path) -> dict:
    saved = torch.load(path, map_location="cpu", weights_only=True)
    return {k: v for k, v in saved["model"].items()}


def test_asha_pauses_resumes_exactly_and_survives_sigterm_in_a_promotion(tmp_path):
    cfg = tiny_config(tmp_path, **BASE, sweep=TPE_ASHA)
    config = write_config(tmp_path, cfg)
    run = tmp_path / "results/t"
    first = _schedule(config, background=True)
    try:
        while _state(run) is None and first.poll() is None:
            time.sleep(0.1)
        plan_before = (run / "sweep/plan.json").read_text()
        # a second sweep on the same results: one message naming the holder, nothing written
        second = _schedule(config)
        assert second.returncode == 2, second.stderr
        assert "the sweep scheduler of run 't'" in second.stderr
        assert "is being written by another ddpflow process (pid" in second.stderr
        assert "Traceback" not in second.stderr
        assert (run / "sweep/plan.json").read_text() == plan_before
        # SIGTERM right after a promotion is decided (recorded) and before it trains
        promoted = None
        while promoted is None and first.poll() is None:
            s = _state(run) or {"trials": []}
            promoted = next((t for t in s["trials"] if t["target"] > t["epochs"] >= 1), None)
            time.sleep(0.05)
        assert promoted, first.communicate()[1][-3000:]
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=300)
    finally:
        first.kill()
    assert first.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "stopped by SIGTERM" in err and "Traceback" not in err
    s = _state(run)
    t = next(t for t in s["trials"] if t["id"] == promoted["id"])
    assert (t["epochs"], t["target"]) == (1, 2), t  # on its way: the next run resumes it
    assert not (run / "sweep/schedule/done.json").exists()

    # the next run resumes the promotion from the rung's checkpoint (and draws no new trial)
    again = _schedule(config)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{promoted['id']}: resume -> epoch 2" in again.stderr
    log = (run / f"logs/trials/{promoted['id']}/train_a.log").read_text()
    assert "resumed from" in log
    s = _state(run)
    ids = sorted(t["id"] for t in s["trials"])
    assert len(ids) == 2 and (run / "sweep/schedule/done.json").is_file()
    finished = [t for t in s["trials"] if t["epochs"] == 2]
    assert finished and all(t["epochs"] in (1, 2) for t in s["trials"])

    # paused at epoch 1 and resumed == the same trial trained straight through, bit for bit
    trial = run / "trials" / finished[0]["id"]
    straight = json.loads((trial / "trial_config.json").read_text())
    straight["results_dir"] = str(tmp_path / "straight")
    straight["hardware"]["slots"]["pool"] = None
    (tmp_path / "straight.json").write_text(json.dumps(straight))
    ddpflow("launch", "--config", tmp_path / "straight.json", "--stage", "a", check=True)
    ours = _weights(trial / "stages/a/final.pt")
    ref = _weights(tmp_path / "straight" / finished[0]["id"] / "stages/a/final.pt")
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ours)

    # a rerun of a finished sweep trains nothing and draws nothing: the same trials
    third = _schedule(config)
    assert third.returncode == 0, third.stderr[-3000:]
    assert " -> epoch " not in third.stderr, third.stderr
    assert sorted(t["id"] for t in _state(run)["trials"]) == ids

    # the leaderboard: each trial's rung and status, epochs spent against the full grid
    board = ddpflow("sweep", "collect", "--config", config)
    assert board.returncode == 0, board.stderr
    lb = json.loads((run / "sweep/leaderboard.json").read_text())
    rows = {r["trial"]: r for r in lb["trials"]}
    spent = sum(t["epochs"] for t in s["trials"])
    assert lb["schedule"]["spent_epochs"] == spent and lb["schedule"]["full_epochs"] == 4
    assert lb["schedule"]["rungs"] == [1, 2]
    for t in s["trials"]:
        r = rows[t["id"]]
        assert r["resource_epochs"] == t["epochs"] and r["rung"] == t["epochs"]
        assert r["status"] == ("finished" if t["epochs"] == 2 else "paused")
    assert rows[finished[0]["id"]]["rank"] == 1 or len(finished) == 2
    assert f"{spent} of 4 trial-epochs of stage a" in board.stdout
    assert "metric_vs_epochs.png" in lb["figures"]
    header = (run / "sweep/leaderboard.csv").read_text().splitlines()[0].split(",")
    assert header[-3:] == ["rung", "rung_value", "resource_epochs"]


TASK = '''
import torch.nn.functional as F


class Scored:
    """Accuracy as val_score; mode nan: a NaN score; drop: no score at all."""

    monitor = "val_score"
    maximize = frozenset({"score", "acc"})

    def __init__(self, mode="ok"):
        self.mode = mode

    def loss(self, outputs, batch):
        return F.cross_entropy(outputs, batch[1])

    def metrics(self, outputs, batch):
        right = (outputs.argmax(1) == batch[1]).sum().float()
        out = {"acc": (right, len(batch[1]))}
        if self.mode != "drop":
            out["score"] = (right * (float("nan") if self.mode == "nan" else 1.0),
                            len(batch[1]))
        return out
'''


def test_failing_nan_and_metricless_trials_are_pruned_and_named(tmp_path):
    """One row per class of a trial that cannot go on; the sweep finishes the good one and
    the workflow's leaderboard names every other with its reason."""
    (tmp_path / "code").mkdir()
    (tmp_path / "code/scored.py").write_text(TASK)
    variants = [{"name": "ok"},
                {"name": "nan", "set": {"task.kwargs.mode": "nan"}},  # NaN metric
                {"name": "drop", "set": {"task.kwargs.mode": "drop"}},  # monitor missing
                {"name": "big", "set": {"stages.0.batch_size": 100000}}]  # a failing trial
    cfg = {**BASE, "run": "hs", "task": {"name": "scored:Scored", "mode": "max"},
           "model": {"name": "smallcnn", "code_dir": str(tmp_path / "code")},
           "stages": [{**STAGE, "precision": "fp32", "channels_last": False}],
           "sweep": {"variants": variants, "scheduler": "asha",
                     "asha": {"eta": 2, "min_epochs": 1}}}
    cfg["data"] = {**cfg["data"], "image_size": 16, "difficulty": 0}
    write(tmp_path, cfg)
    proc = snakemake(tmp_path)
    assert proc.returncode != 0  # pruned trials fail the workflow, as failed trials do
    log = (tmp_path / "results/hs/logs/sweep/schedule.log").read_text()
    assert "3 trial(s) pruned" in log and "the others went on" in log, log[-3000:]
    rows = {r["trial"].split("-")[0].split("_")[0]: r for r in json.loads(
        (tmp_path / "results/hs/sweep/leaderboard.json").read_text())["trials"]}
    assert rows["ok"]["status"] == "finished" and rows["ok"]["best"], rows["ok"]
    assert rows["nan"]["status"] == "pruned"
    # a NaN metric of finite weights is the task's mistake, named by validation itself
    # (engine/validation.check_finite); the trial is pruned with that message
    assert "the metric val_score is nan, and the weights are finite" in rows["nan"]["reason"]
    assert rows["drop"]["status"] == "pruned"
    assert "task.monitor val_score is not a validation metric" in rows["drop"]["reason"]
    assert rows["big"]["status"] == "pruned" and "batch_size 100000" in rows["big"]["reason"]
    assert not (tmp_path / "results/hs/sweep/schedule/done.json").exists()
    assert os.path.getsize(tmp_path / "results/hs/sweep/schedule/state.json") > 0
