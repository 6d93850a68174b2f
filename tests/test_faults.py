"""Real faults on real processes: each run must end with the weights of an uninterrupted
run (deterministic mode, CPU) and lose no completed step beyond the checkpoint interval."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from conftest import REPO, ddpflow, tiny_config, write_config

pytestmark = pytest.mark.slow

EVERY = 10  # checkpoint interval (optimizer steps)
STAGE = {"name": "s1", "max_steps": 150, "batch_size": 32, "lr": 0.05, "warmup_epochs": 0.2}


def setup_run(folder: Path, stage=STAGE, **extra) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    settings = {"deterministic": True, "log_every_steps": 5, "stages": [stage],
                "data": {"train_size": 2048, "image_size": 32},
                "checkpoint": {"every_steps": EVERY, "keep_last": 3}, **extra}
    cfg = tiny_config(folder, **settings)
    p = write_config(folder, cfg)
    ddpflow("prepare", "--config", p, check=True)
    return p


def final_weights(folder: Path, stage="s1") -> dict:
    return torch.load(folder / f"results/t/stages/{stage}/final.pt", weights_only=True)["model"]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def ckpt_steps(folder: Path) -> list[int]:
    d = folder / "results/t/stages/s1/checkpoints"
    return sorted(int(p.name[5:14]) for p in d.glob("ckpt-*.pt")) if d.is_dir() else []


def start(config: Path, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ddpflow", "launch", "--config", str(config),
                             "--stage", "s1", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for(cond, timeout=120.0, every=0.02):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if cond():
            return True
        time.sleep(every)
    raise AssertionError("condition not reached in time")


def ranks(proc: subprocess.Popen) -> list[psutil.Process]:
    kids = psutil.Process(proc.pid).children(recursive=True)
    return [p for p in kids if "train" in p.cmdline() and "--resolved" in p.cmdline()]


def kill_tree(proc: subprocess.Popen, sig=signal.SIGKILL) -> None:
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in tree:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("baseline")
    p = setup_run(folder)
    ddpflow("launch", "--config", p, "--stage", "s1", check=True)
    return final_weights(folder)


def test_sigkill_of_one_rank_restarts_the_group(tmp_path, baseline):
    p = setup_run(tmp_path)
    proc = start(p)
    wait_for(lambda: ckpt_steps(tmp_path) and ckpt_steps(tmp_path)[-1] >= 3 * EVERY)
    before = ckpt_steps(tmp_path)[-1]
    victim = ranks(proc)[-1]
    victim.kill()
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    resumed = [int(line.split("ckpt-")[1][:9]) for line in err.splitlines()
               if "resumed from ckpt-" in line]
    assert resumed and resumed[0] >= before, (resumed, before)  # nothing lost beyond EVERY
    assert_same_weights(final_weights(tmp_path), baseline)


def test_sigterm_to_the_job_then_rerun(tmp_path, baseline):
    p = setup_run(tmp_path)
    proc = start(p)
    wait_for(lambda: ckpt_steps(tmp_path) and ckpt_steps(tmp_path)[-1] >= 3 * EVERY)
    before = ckpt_steps(tmp_path)[-1]
    os.killpg(proc.pid, signal.SIGTERM)  # what Ctrl-C, `kill` or a scheduler does to the job
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    assert "run the same command again" in err
    assert not (tmp_path / "results/t/stages/s1/final.pt").exists()
    stopped_at = ckpt_steps(tmp_path)[-1]
    # the ranks themselves wrote a new checkpoint, after the signal, at a log boundary
    assert f"SIGTERM received: checkpoint at step {stopped_at}" in err
    assert before < stopped_at < STAGE["max_steps"] and stopped_at % 5 == 0
    proc = ddpflow("launch", "--config", p, "--stage", "s1", check=True)
    assert f"resumed from ckpt-{stopped_at:09d}.pt" in proc.stderr
    assert_same_weights(final_weights(tmp_path), baseline)
    assert ckpt_steps(tmp_path) == [130, 140, 150]  # checkpoint.keep_last: 3


def test_corrupted_newest_checkpoint_is_skipped(tmp_path, baseline):
    p = setup_run(tmp_path)
    proc = ddpflow("launch", "--config", p, "--stage", "s1", "--halt-after-steps", "25")
    assert proc.returncode == 75
    assert ckpt_steps(tmp_path) == [10, 20, 25]
    newest = tmp_path / "results/t/stages/s1/checkpoints/ckpt-000000025.pt"
    blob = bytearray(newest.read_bytes())
    blob[len(blob) // 2] ^= 0xFF  # one flipped byte
    newest.write_bytes(bytes(blob))
    proc = ddpflow("launch", "--config", p, "--stage", "s1", check=True)
    assert "skipping checkpoint ckpt-000000025.pt: checksum mismatch" in proc.stderr
    assert "resumed from ckpt-000000020.pt" in proc.stderr
    assert_same_weights(final_weights(tmp_path), baseline)


def stop_ranks_mid_write(proc: subprocess.Popen, ckdir: Path) -> bool:
    """SIGSTOP the ranks while a checkpoint's temporary file exists. Stopping first and then
    looking again closes the race in which the write finishes between the test seeing the
    file and the kill landing; when it does finish first, let the ranks go on and catch the
    next checkpoint."""
    victims = ranks(proc)
    partial = ".ckpt-?????????.pt.tmp*"  # the checkpoint itself, not its .sha256 sidecar
    while proc.poll() is None:
        wait_for(lambda: any(ckdir.glob(partial)) or proc.poll() is not None, every=0.001)
        for v in victims:
            v.suspend()
        if any(ckdir.glob(partial)):
            return True
        for v in victims:
            v.resume()
    return False


def test_sigkill_while_a_checkpoint_is_written(tmp_path):
    """The background writer (checkpoint.background, on by default) is killed mid-write:
    the previous checkpoint resumes the run to the uninterrupted run's weights."""
    # resnet18's checkpoint (weights + momentum, ~90 MB) takes long enough to catch mid-write
    stage = {"name": "s1", "max_steps": 20, "batch_size": 8, "lr": 0.01}
    extra = {"model": {"name": "resnet18"}, "checkpoint": {"every_steps": 2, "keep_last": 3}}
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref = setup_run(ref_dir, stage, **extra)
    ddpflow("launch", "--config", ref, "--stage", "s1", check=True)
    p = setup_run(run_dir, stage, **extra)
    ckdir = run_dir / "results/t/stages/s1/checkpoints"
    proc = start(p)
    wait_for(lambda: ckpt_steps(run_dir) and ckpt_steps(run_dir)[-1] >= 4, every=0.01)
    caught = stop_ranks_mid_write(proc, ckdir)
    kill_tree(proc)  # the launcher, torchrun and both (stopped) ranks, mid-write
    proc.wait(timeout=60)
    assert caught, "no checkpoint write was caught before the run ended"
    assert list(ckdir.glob(".ckpt-*.tmp*")), "the kill should have left a partial write"
    good = ckpt_steps(run_dir)[-1]
    proc = ddpflow("launch", "--config", p, "--stage", "s1", check=True)
    assert "removing unfinished checkpoint write" in proc.stderr
    assert f"resumed from ckpt-{good:09d}.pt" in proc.stderr
    assert not list(ckdir.glob(".ckpt-*.tmp*"))
    assert_same_weights(final_weights(run_dir), final_weights(ref_dir))


def test_sigterm_while_a_checkpoint_write_is_in_flight(tmp_path):
    """SIGTERM reaches the job while the background writer is mid-write (the ranks are
    held stopped at that moment, the signal waits for them): the stage still stops at a new
    checkpoint, exit 75, and every checkpoint left, the interrupted one included, is
    complete and verifies."""
    stage = {"name": "s1", "max_steps": 40, "batch_size": 8, "lr": 0.01}
    extra = {"model": {"name": "resnet18"}, "checkpoint": {"every_steps": 2, "keep_last": 20}}
    p = setup_run(tmp_path, stage, **extra)
    ckdir = tmp_path / "results/t/stages/s1/checkpoints"
    proc = start(p)
    wait_for(lambda: ckpt_steps(tmp_path) and ckpt_steps(tmp_path)[-1] >= 2, every=0.01)
    assert stop_ranks_mid_write(proc, ckdir), "no checkpoint write was caught"
    in_flight = int(next(ckdir.glob(".ckpt-?????????.pt.tmp*")).name[6:15])
    os.killpg(proc.pid, signal.SIGTERM)  # the launcher relays it to the (stopped) ranks
    time.sleep(0.5)
    for v in ranks(proc):
        v.resume()
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-3000:]
    stopped_at = int(err.split("SIGTERM received: checkpoint at step ")[1].split()[0])
    assert in_flight < stopped_at < stage["max_steps"]
    assert in_flight in ckpt_steps(tmp_path) and ckpt_steps(tmp_path)[-1] == stopped_at
    assert not list(ckdir.glob(".ckpt-*.tmp*"))
    from ddpflow.engine import checkpoint

    assert all(checkpoint.verify(path) is None
               for _, path in checkpoint.list_checkpoints(ckdir))


def test_hung_rank_fails_within_the_timeout(tmp_path):
    p = setup_run(tmp_path, hardware={"nproc_per_node": 2, "threads_per_rank": 1,
                                      "timeout_s": 10, "max_restarts": 0})
    proc = start(p)
    wait_for(lambda: ckpt_steps(tmp_path) and ckpt_steps(tmp_path)[-1] >= EVERY)
    victim = ranks(proc)[-1]
    victim.suspend()  # a rank stuck: the other one waits in its next collective
    try:
        out, err = proc.communicate(timeout=300)  # (only a hang guard)
    finally:
        kill_tree(proc) if proc.poll() is None else None
        try:
            victim.kill()
        except psutil.NoSuchProcess:
            pass
    assert proc.returncode not in (0, 75), err[-2000:]
    # the collective's own timeout ended it, hardware.timeout_s (not gloo's 30 min): gloo
    # names the time it waited
    assert "Timed out waiting 10000ms" in err, err[-3000:]
    assert "failed" in err and ckpt_steps(tmp_path)  # checkpoints are kept


def test_nan_loss_stops_with_the_step_and_keeps_checkpoints(tmp_path):
    # an absurd lr: the first update scales the BatchNorm weights to ~1e28, the next forward
    # overflows to inf and the loss is NaN at step 2
    stage = {"name": "s1", "max_steps": 150, "batch_size": 32, "lr": 1e30, "momentum": 0.0,
             "weight_decay": 0.0}
    p = setup_run(tmp_path, stage, checkpoint={"every_steps": 1, "keep_last": 3})
    proc = ddpflow("launch", "--config", p, "--stage", "s1")
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "loss became" in proc.stderr and "at step" in proc.stderr
    assert "Traceback" not in proc.stderr
    failed = json.loads((tmp_path / "results/t/stages/s1/failed.json").read_text())
    bad = int(failed["reason"].split("at step ")[1].split()[0])
    good = ckpt_steps(tmp_path)
    assert good and max(good) < bad, (good, bad)
    state = torch.load(tmp_path / f"results/t/stages/s1/checkpoints/ckpt-{max(good):09d}.pt",
                       weights_only=True)
    assert all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point())
    assert not (tmp_path / "results/t/stages/s1/final.pt").exists()


def test_multi_node_launch_line_and_two_agents_on_one_machine(tmp_path, monkeypatch):
    """hardware.nodes: 2 plans `srun ... torchrun --rdzv-backend=c10d` per node. Here the
    per-node torchrun runs twice on this machine, as srun would start it on two nodes."""
    from ddpflow.config import load_config
    from ddpflow.core.writing import write_json_atomic
    from ddpflow.launch.launcher import plan

    p = setup_run(tmp_path, {"name": "s1", "max_steps": 10, "batch_size": 32},
                  hardware={"nodes": 2, "nproc_per_node": 1, "threads_per_rank": 1})
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    proc = ddpflow("launch", "--config", p, "--stage", "s1", "--dry-run",
                   env={"SLURM_JOB_NODELIST": "", "SLURM_NODELIST": ""})
    assert proc.returncode == 2 and "Slurm allocation" in proc.stderr
    monkeypatch.setenv("SLURM_JOB_NODELIST", "localhost,localhost")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    cfg = load_config(p)
    resolved = cfg.stage_dir("s1") / "config.json"
    cmd, env = plan(cfg, "s1", resolved)
    assert cmd[:4] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1"]
    # the step asks for its CPUs itself (srun no longer inherits --cpus-per-task)
    k = cmd.index("--kill-on-bad-exit=1")
    assert cmd[4].startswith("--cpus-per-task=") and k in (5, 6)  # (+ --gres=gpu:N)
    assert "--nnodes=2" in cmd and "--rdzv-backend=c10d" in cmd and "--rdzv-id=4242" in cmd
    assert any(a.startswith("--rdzv-endpoint=localhost:") for a in cmd)
    assert "--rdzv-conf=join_timeout=600" in cmd  # hardware.timeout_s: a node's time to join
    assert cmd[k + 2:k + 4] == ["-m", "ddpflow.launch.rollcall"]  # a roll call first
    resolved.parent.mkdir(parents=True)
    write_json_atomic(resolved, cfg.to_dict())
    per_node = cmd[cmd.index(sys.executable):]
    agents = [subprocess.Popen(per_node, cwd=REPO, env={**os.environ, **env},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]
    outs = [a.communicate(timeout=300)[0] for a in agents]
    assert all(a.returncode == 0 for a in agents), outs
    assert (resolved.parent / "nodes" / socket.gethostname()).is_file()  # the roll call
    s = json.loads((tmp_path / "results/t/stages/s1/summary.json").read_text())
    assert s["world_size"] == 2 and s["weights_in_sync"] and s["steps"] == 10


def test_a_killed_torchrun_leaves_no_rank_training(tmp_path):
    """torchrun SIGKILLed (the OOM killer, a stray kill): its ranks live in sessions of their
    own, so they would train on, orphaned, and write into the stage folder after the
    launcher released its lock. The launcher stops them and says the stage failed; the
    checkpoints stay for a rerun."""
    p = setup_run(tmp_path)
    proc = start(p)
    wait_for(lambda: ckpt_steps(tmp_path) and ckpt_steps(tmp_path)[-1] >= EVERY)
    workers = ranks(proc)
    torchrun = psutil.Process(proc.pid).children()  # the launcher's one child
    assert len(torchrun) == 1 and len(workers) == 2
    torchrun[0].kill()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode not in (0, 75), err[-3000:]
    assert "stage 's1' failed" in err and "a rerun resumes" in err, err[-3000:]
    left = []
    for r in workers:
        try:
            left += [r.pid] if r.status() != psutil.STATUS_ZOMBIE else []
        except psutil.NoSuchProcess:
            pass
    assert not left
    assert ckpt_steps(tmp_path) and not (tmp_path / "results/t/stages/s1/final.pt").exists()
