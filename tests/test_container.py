"""A real Docker engine: build the project's Dockerfile on a local base, train inside it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, ddpflow, tiny_config, write_config
from test_workflow import AFTER, planned, snakemake, write

pytestmark = pytest.mark.slow
BASE = os.environ.get("DDPFLOW_TEST_BASE", "ddpflow-test-base:bookworm-torch2.13-nvml")


@pytest.fixture(scope="module", autouse=True)
def docker_engine():
    ok = subprocess.run(["docker", "image", "inspect", BASE], capture_output=True)
    assert ok.returncode == 0, (f"no Docker engine with the test base image {BASE}: "
                                f"run `bash tests/setup/docker.sh` (make test does)")


def docker_config(tmp_path, **extra):
    return tiny_config(tmp_path, container={"engine": "docker", "image": "ddpflow:pytest",
                                            "base_image": BASE}, **extra)


def test_build_and_train_one_stage_in_the_container(tmp_path):
    p = write_config(tmp_path, docker_config(tmp_path, stages=[
        {"name": "s1", "max_steps": 6, "batch_size": 32}]))
    out = tmp_path / "image.json"
    ddpflow("image", "--config", p, "--context", REPO, "--out", out, check=True)
    rec = json.loads(out.read_text())
    assert rec["engine"] == "docker" and rec["image_id"].startswith("sha256:")
    assert rec["labels"]["org.opencontainers.image.title"] == "ddpflow"
    assert rec["labels"]["org.opencontainers.image.revision"] == rec["revision"]
    assert rec["engine_version"] and rec["build_time_s"] >= 0
    user = subprocess.run(["docker", "image", "inspect", "-f", "{{.Config.User}}",
                           rec["image_id"]], capture_output=True, text=True, check=True)
    assert user.stdout.strip() == "1000"  # non-root by default
    (tmp_path / "results/t").mkdir(parents=True)
    (tmp_path / "results/t/image.json").write_text(out.read_text())
    ddpflow("prepare", "--config", p, check=True)
    # as a sweep trial: the launcher outside takes a slot of one core and the container
    # gets only that core
    proc = ddpflow("launch", "--config", p, "--stage", "s1", "--set",
                   f"hardware.slots.pool={tmp_path / 'pool'}", check=True)
    assert "runs in the docker image" in proc.stderr and "2 rank(s) on cpu" in proc.stderr
    s = json.loads((tmp_path / "results/t/stages/s1/summary.json").read_text())
    assert s["container"] == f"docker:{rec['image_id']}"
    slot = json.loads((tmp_path / "results/t/stages/s1/slot.json").read_text())
    assert s["environment"]["cpu_affinity"] == slot["cores"] and len(slot["cores"]) == 1
    assert s["world_size"] == 2 and s["steps"] == 6
    # files written in the container belong to the calling user
    assert (tmp_path / "results/t/stages/s1/final.pt").stat().st_uid == os.getuid()

    # preemption reaches the ranks inside the container: SIGTERM to the launcher on the
    # host, the ranks checkpoint at a log boundary and the launcher exits 75
    log = tmp_path / "preempted.log"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "ddpflow", "launch", "--config", str(p), "--stage", "s1",
         "--set", "stages.0.max_steps=100000"], cwd=REPO, stderr=open(log, "w"))
    try:
        t0 = time.time()
        while "100000 steps" not in log.read_text():  # the ranks inside have started
            assert time.time() - t0 < 300 and launcher.poll() is None, log.read_text()
            time.sleep(0.2)
        time.sleep(2)
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    err = log.read_text()
    ckdir = tmp_path / "results/t/stages/s1/checkpoints"
    assert launcher.returncode == 75, err[-3000:]
    step = int(err.split("SIGTERM received: checkpoint at step ")[1].split()[0])
    assert (ckdir / f"ckpt-{step:09d}.pt").is_file()


def test_workflow_with_docker_engine(tmp_path):
    """Through Snakemake, in a copy of the project: then the Dockerfile alone is edited,
    which reruns exactly the image and the stages (not the data)."""
    tree = tmp_path / "tree"
    tree.mkdir()
    for part in ("Snakefile", "workflow", "config", "src", "Dockerfile", ".dockerignore",
                 "pyproject.toml", "README.md"):
        src = REPO / part
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, tree / part)
    wd = tmp_path / "wd"
    wd.mkdir()
    cfg = {"run": "dk", "log_every_steps": 4,
           "data": {"train_size": 256, "val_size": 64, "image_size": 16},
           "hardware": {"nproc_per_node": 2, "threads_per_rank": 1},
           "container": {"engine": "docker", "image": "ddpflow:pytest", "base_image": BASE},
           "stages": [{"name": "a", "max_steps": 4, "batch_size": 32}]}
    write(wd, cfg)
    sf = tree / "Snakefile"
    proc = snakemake(wd, snakefile=sf)
    assert proc.returncode == 0, proc.stderr[-3000:]
    image = json.loads((wd / "results/dk/image.json").read_text())
    s = json.loads((wd / "results/dk/stages/a/summary.json").read_text())
    assert s["container"] == f"docker:{image['image_id']}"
    assert "Nothing to be done" in snakemake(wd, "-n", snakefile=sf).stdout
    with open(tree / "Dockerfile", "a") as f:
        f.write("\n# a change to the image only\n")
    assert planned(snakemake(wd, "-n", snakefile=sf)) == {"image": 1, "train": 1, **AFTER,
                                                          "collect": 1, "all": 1}


@pytest.mark.parametrize("engine, env, needle", [
    ("docker", {"DOCKER_HOST": "unix:///nonexistent/docker.sock"}, "does not answer"),
    ("podman", {"DOCKER_HOST": "unix:///nonexistent/podman.sock"}, "podman"),
])
def test_missing_engine_is_one_clear_error(tmp_path, engine, env, needle):
    cfg = tiny_config(tmp_path, container={"engine": engine})
    proc = ddpflow("image", "--config", write_config(tmp_path, cfg), "--out",
                   tmp_path / "image.json", env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"container.engine is '{engine}'" in proc.stderr and needle in proc.stderr
    assert "container.engine: none" in proc.stderr
    assert not (tmp_path / "image.json").exists()


def test_the_host_environment_record_is_quick_and_names_the_torch_build(tmp_path):
    """engine none: the `image` rule only records the host environment; it is on every run's
    critical path, so it must not import torch (1.5 s) to read its version."""
    cfg = write_config(tmp_path, {**tiny_config(tmp_path), "container": {"engine": "none"}})
    out = tmp_path / "image.json"
    probe = ("import sys; from ddpflow.cli import main; "
             f"rc = main(['image', '--config', {str(cfg)!r}, '--out', {str(out)!r}]); "
             "print(rc, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.stdout.splitlines()[-1].split() == ["0", "False"], proc.stderr
    import torch

    record = json.loads(out.read_text())
    assert record["engine"] == "none" and record["torch"] == torch.__version__
