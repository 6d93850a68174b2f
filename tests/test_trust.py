"""Results you can trust: nothing stale, mixed or half-made passes as done (real processes).

One rank per stage where the point is not DDP, so that each launch costs a few seconds."""

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
from ddpflow.core import locks

pytestmark = pytest.mark.slow

TWO = [{"name": "a", "max_steps": 6, "batch_size": 32, "lr": 0.05},
       {"name": "b", "max_steps": 2, "batch_size": 32, "lr": 0.01, "init_from": "previous"}]


def setup(tmp_path: Path, stages=TWO, **extra) -> Path:
    settings = {"stages": stages, "hardware": {"nproc_per_node": 1, "threads_per_rank": 1},
                "data": {"train_size": 256, "val_size": 64, "image_size": 16},
                "checkpoint": {"every_steps": 2, "keep_last": 3}, **extra}
    p = write_config(tmp_path, tiny_config(tmp_path, **settings))
    ddpflow("prepare", "--config", p, check=True)
    return p


def stage(tmp_path: Path, name: str) -> Path:
    return tmp_path / "results/t/stages" / name


def files(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()
            if p.is_file() and p.name != ".lock"}


def test_stale_results_are_never_trusted(tmp_path):
    p = setup(tmp_path)
    ddpflow("launch", "--config", p, "--stage", "a", check=True)
    ddpflow("launch", "--config", p, "--stage", "b", check=True)
    done = files(stage(tmp_path, "a"))
    # the same settings again: nothing to do, nothing rewritten
    proc = ddpflow("launch", "--config", p, "--stage", "a", check=True)
    assert "already finished with these settings" in proc.stderr
    assert files(stage(tmp_path, "a")) == done
    # stage a's lr edited: b must not start from a's old weights
    lr = ["--set", "stages.0.lr=0.02"]
    proc = ddpflow("launch", "--config", p, "--stage", "b", *lr)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "whose result is stale: made with another config" in proc.stderr
    # collect calls both out of date, not finished
    ddpflow("collect", "--config", p, *lr, check=True)
    rows = json.loads((tmp_path / "results/t/summary/summary.json").read_text())["stages"]
    assert [r["finished"] for r in rows] == [False, False]
    assert all("stale: made with another config" in r["note"] for r in rows)
    assert "STALE" in (tmp_path / "results/t/summary/headline.txt").read_text()
    # relaunched with the new lr and stopped early: a stop, never the old "finished"
    proc = ddpflow("launch", "--config", p, "--stage", "a", *lr, "--halt-after-steps", "3")
    assert proc.returncode == 75 and "finished" not in proc.stderr, proc.stderr
    assert "skipping checkpoint" in proc.stderr and "written with another config" in proc.stderr
    assert "moved to" in proc.stderr and (stage(tmp_path, "a") / "checkpoints.old").is_dir()
    # data settings edited without preparing again: refused, naming the setting
    proc = ddpflow("launch", "--config", p, "--stage", "a", "--set", "data.val_size=32")
    assert proc.returncode == 2 and "data.val_size: 64 -> 32" in proc.stderr
    assert "ddpflow prepare" in proc.stderr


def test_checkpoints_of_other_starting_weights_are_set_aside(tmp_path):
    from ddpflow.seams.models import build_model

    weights = tmp_path / "w.pt"
    torch.manual_seed(1)
    torch.save(build_model("smallcnn", 10, 3).state_dict(), weights)
    one = [{**TWO[0], "init_from": str(weights)}]
    p = setup(tmp_path, one)
    proc = ddpflow("launch", "--config", p, "--stage", "a", "--halt-after-steps", "4")
    assert proc.returncode == 75 and "initialised from" in proc.stderr
    torch.manual_seed(2)
    torch.save(build_model("smallcnn", 10, 3).state_dict(), weights)  # other weights
    proc = ddpflow("launch", "--config", p, "--stage", "a", check=True)
    assert "skipping checkpoint ckpt-000000004.pt: written with another config, code or " \
           "starting weights" in proc.stderr
    assert "resumed from" not in proc.stderr
    old = stage(tmp_path, "a") / "checkpoints.old"
    assert sorted(q.name for q in old.glob("ckpt-*.pt")) == [
        "ckpt-000000002.pt", "ckpt-000000004.pt"]


def test_other_code_makes_a_result_stale(tmp_path, monkeypatch):
    from ddpflow import config
    from ddpflow.config import load_config
    from ddpflow.engine.checkpoint import latest_valid
    from ddpflow.results import provenance

    p = setup(tmp_path, [TWO[0]])
    ddpflow("launch", "--config", p, "--stage", "a", "--halt-after-steps", "2")
    ddpflow("launch", "--config", p, "--stage", "a", check=True)
    cfg = load_config(p)
    assert provenance.stage_result(cfg, "a")[1] is None
    monkeypatch.setattr(provenance, "code_fingerprint", lambda: "edited-code")
    assert provenance.stage_result(cfg, "a")[1] == "stale: made by other ddpflow code"
    key = config.config_hash(provenance.expected_record(cfg, "a"))
    warned = []
    assert latest_valid(stage(tmp_path, "a") / "checkpoints", key,
                        warn=lambda *a, **k: warned.append(a[0])) is None
    assert warned and all("another config, code or starting weights" in w for w in warned)


def test_one_writer_per_prepared_folder_and_per_stage(tmp_path):
    p = setup(tmp_path, [{**TWO[0], "max_steps": 400}])
    data = tmp_path / "results/t/data"
    with locks.exclusive(data.with_name("data.lock"), "test"):  # this test process holds it
        proc = ddpflow("prepare", "--config", p, "--force")
    assert proc.returncode == 2 and f"pid {os.getpid()} on host" in proc.stderr
    first = subprocess.Popen([sys.executable, "-m", "ddpflow", "launch", "--config", str(p),
                              "--stage", "a"], cwd=REPO, stderr=subprocess.PIPE, text=True)
    lock = stage(tmp_path, "a") / ".lock"
    t0 = time.time()
    while not (lock.is_file() and lock.read_text()) and time.time() - t0 < 60:
        time.sleep(0.05)
    second = ddpflow("launch", "--config", p, "--stage", "a")
    assert second.returncode == 2 and "Traceback" not in second.stderr
    assert f"is being written by another ddpflow process (pid {first.pid} on host" \
           in second.stderr
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-2000:]
    s = json.loads((stage(tmp_path, "a") / "summary.json").read_text())
    lines = (stage(tmp_path, "a") / "metrics.jsonl").read_text().splitlines()
    assert s["steps"] == 400 and json.loads(lines[-1])["step"] == 400  # one writer's files


def test_a_stop_at_the_last_step_still_validates(tmp_path):
    # 8 steps per epoch; 10 steps end mid-epoch 1: halt exactly there, then rerun
    p = setup(tmp_path, [{**TWO[0], "max_steps": 10}])
    proc = ddpflow("launch", "--config", p, "--stage", "a", "--halt-after-steps", "10")
    assert proc.returncode == 75
    ddpflow("launch", "--config", p, "--stage", "a", check=True)
    s = json.loads((stage(tmp_path, "a") / "summary.json").read_text())
    recs = [json.loads(x) for x in (stage(tmp_path, "a") / "metrics.jsonl").read_text()
            .splitlines()]
    val = [r for r in recs if r["kind"] == "val"]
    assert [r["step"] for r in val] == [8, 10] and s["epochs"] == 2
    assert s["final_val_acc"] == val[-1]["val_acc"]


def test_user_mistakes_before_and_inside_ranks(tmp_path, monkeypatch, capfd):
    from ddpflow.config import load_config
    from ddpflow.core.errors import UserError
    from ddpflow.launch import launcher as launch
    from ddpflow.seams.models import build_model

    p = setup(tmp_path, [TWO[0]])
    ddpflow("launch", "--config", p, "--stage", "a", check=True)
    done = files(stage(tmp_path, "a"))
    junk = tmp_path / "junk.pt"
    junk.write_text("not weights")
    other = tmp_path / "other.pt"
    torch.save(build_model("smallcnn", 5, 3).state_dict(), other)
    for path, needle in ((junk, "cannot be loaded as weights"),
                         (other, "'head.weight' is (5, 128) there, (10, 128) in the model")):
        proc = ddpflow("launch", "--config", p, "--stage", "a", "--set",
                       f"stages.0.init_from={path}")
        assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr
        assert "torch.distributed.run" in proc.stderr  # the plan only: no rank started
    assert files(stage(tmp_path, "a")) == done  # the finished stage is untouched
    # the same mistake when only a rank can see it (preflight skipped): one message, the
    # ranks are not restarted and nothing points at checkpoints
    monkeypatch.setattr(launch, "preflight", lambda *a, **k: None)
    cfg = load_config(p, [f"stages.0.init_from={junk}", "hardware.nproc_per_node=2",
                          "run=inside"])
    ddpflow("prepare", "--config", p, "--set", "run=inside", check=True)
    with pytest.raises(UserError, match="cannot be loaded as weights"):
        launch.launch(cfg, "a")
    err = capfd.readouterr().err
    assert err.count("] loader:") == 1, err[-2000:]  # rank 0 started once: no restart
    assert "Timed out" not in err  # the group was stopped, no rank left in a collective
    assert not (cfg.stage_dir("a") / "checkpoints").exists()


@pytest.fixture
def start():
    """start(config, log): the launcher in its own session, its stderr in a file the test
    reads meanwhile; whatever is left of it (ranks included) is killed after the test."""
    import psutil

    procs = []

    def run(config: Path, log: Path) -> subprocess.Popen:
        procs.append(subprocess.Popen([sys.executable, "-m", "ddpflow", "launch", "--config",
                                       str(config), "--stage", "a"], cwd=REPO,
                                      stderr=open(log, "w"), start_new_session=True))
        return procs[-1]

    yield run
    for proc in procs:
        if proc.poll() is None:
            for p in [*psutil.Process(proc.pid).children(recursive=True),
                      psutil.Process(proc.pid)]:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass


def wait_for_text(log: Path, text: str, timeout: float = 120) -> None:
    t0 = time.time()
    while text not in log.read_text():
        assert time.time() - t0 < timeout, f"{text!r} never appeared: {log.read_text()}"
        time.sleep(0.05)


def test_usr1_to_the_launcher_stops_between_log_lines(tmp_path, start, monkeypatch):
    """kill -USR1 <launcher>: every rank hears it, and with log lines 10,000 steps apart the
    time-based check (stop_check_s) still stops the stage at a checkpoint within seconds."""
    stages = [{"name": "a", "max_steps": 100000, "batch_size": 16, "lr": 0.01}]
    p = setup(tmp_path, stages, log_every_steps=10000, stop_check_s=1,
              hardware={"nproc_per_node": 2, "threads_per_rank": 1},
              checkpoint={"every_steps": 0, "keep_last": 3})
    log, trace = tmp_path / "launch.log", tmp_path / "trace"
    trace.mkdir()
    monkeypatch.setenv("DDPFLOW_SAMPLE_TRACE", str(trace))  # a line per step and rank

    def steps() -> int:
        return len((trace / "rank0.txt").read_text().splitlines())
    proc = start(p, log)
    wait_for_text(log, " steps\n")  # the line printed as the loop starts
    before = steps()
    time.sleep(2)
    at_signal = steps()  # the steps of 2 s at this run's pace, however busy the machine
    os.kill(proc.pid, signal.SIGUSR1)  # the launcher alone, not its group
    proc.wait(timeout=120)  # (only a hang guard)
    err = log.read_text()
    assert proc.returncode == 75, err[-2000:]
    step = int(err.split("SIGUSR1 received: checkpoint at step ")[1].split()[0])
    assert 0 < step < 10000  # not a log boundary: the time-based check stopped it
    # within about stop_check_s (1 s) of training: not stop_check_s's default 15 s
    assert step - at_signal <= 2 * (at_signal - before) + 2, (before, at_signal, step)
    assert (stage(tmp_path, "a") / f"checkpoints/ckpt-{step:09d}.pt").is_file()


def test_ctrl_c_during_start_up_says_what_happened(tmp_path, start):
    p = setup(tmp_path, [TWO[0]])
    log = tmp_path / "launch.log"
    proc = start(p, log)
    import psutil

    t0 = time.time()  # until torchrun has started its rank (which is importing torch)
    def cmdline(c) -> list[str]:
        try:
            return c.cmdline()
        except psutil.NoSuchProcess:  # a short-lived child ended while we looked
            return []

    def rank_running():
        return any("train" in cmdline(c) and "torch.distributed.run" not in cmdline(c)
                   for c in psutil.Process(proc.pid).children(recursive=True))

    while not rank_running():
        assert time.time() - t0 < 60 and proc.poll() is None, log.read_text()
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    proc.wait(timeout=120)
    err = log.read_text()
    assert proc.returncode == 75 and "KeyboardInterrupt" not in err, err[-2000:]
    if (stage(tmp_path, "a") / "checkpoints").is_dir():  # the ranks were far enough
        assert "stopped at a checkpoint" in err and "SIGTERM received" in err
    else:
        assert "before its first checkpoint: nothing to resume" in err
        assert "resume from" not in err


def test_tune_ends_on_a_small_set_and_is_not_reused_for_other_settings(tmp_path):
    # 64 samples and the default max_batch (4096): candidates stop at a rank's share
    stages = [{"name": "a", "max_steps": 2, "batch_size": "auto"}]
    p = setup(tmp_path, stages, data={"train_size": 64, "val_size": 32, "image_size": 8},
              tune={"steps": 1})
    proc = ddpflow("tune", "--config", p, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    t = json.loads((tmp_path / "results/t/tune.json").read_text())
    assert 1 <= t["batch_search"]["agreed_max_batch"] <= 64
    ddpflow("launch", "--config", p, "--stage", "a", check=True)
    proc = ddpflow("launch", "--config", p, "--stage", "a", "--set", "model.name=mlp")
    assert proc.returncode == 2 and "measured for other settings (model.name)" in proc.stderr


def test_preflight_refuses_a_batch_larger_than_the_data_and_too_small_images(tmp_path):
    from ddpflow.config import load_config
    from ddpflow.core.errors import UserError
    from ddpflow.launch.launcher import preflight

    p = setup(tmp_path, [TWO[0]])
    with pytest.raises(UserError, match=r"batch_size 1000 x 2 rank\(s\) x 1 accumulation = "
                                        r"2000 samples per step, but the training split has 256"):
        preflight(load_config(p, ["stages.0.batch_size=1000"]), "a", world=2)
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    p = setup(tiny, [TWO[0]], data={"train_size": 64, "val_size": 16, "image_size": 2})
    with pytest.raises(UserError, match="data.image_size 2 is too small for model.name "
                                        "'smallcnn'"):
        preflight(load_config(p), "a")
