"""The Snakemake workflow for real: runs, reruns, partial reruns, validation, Slurm dry-run."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent

TINY = {
    "run": "wf",
    "log_every_steps": 4,
    "data": {"train_size": 512, "val_size": 128, "image_size": 16},
    "hardware": {"nproc_per_node": 2, "threads_per_rank": 1},
    "stages": [
        {"name": "a", "epochs": 1, "batch_size": 32, "lr": 0.1},
        {"name": "b", "epochs": 1, "batch_size": 32, "lr": 0.02, "init_from": "previous"},
    ],
}


def snakemake(workdir: Path, *args, snakefile: Path = REPO / "Snakefile", config="tiny.yaml"):
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    cmd = [str(BIN / "snakemake"), "-s", str(snakefile), "-d", str(workdir), "--configfile",
           str(workdir / config), "--cores", "2", *args]
    return subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=900)


def write(workdir: Path, cfg: dict, name="tiny.yaml") -> None:
    (workdir / name).write_text(yaml.safe_dump(cfg, sort_keys=False))


def planned(proc) -> dict[str, int]:
    """Job counts from a dry run's 'Job stats' table."""
    out = proc.stdout + proc.stderr
    table = out.split("Job stats:")[-1] if "Job stats:" in out else ""
    return {m[0]: int(m[1]) for m in re.findall(r"^(\w+)\s+(\d+)$", table, re.M)
            if m[0] != "total"}


@pytest.fixture
def wf(tmp_path):
    write(tmp_path, TINY)
    return tmp_path


def test_full_run_rerun_and_partial_rerun(wf):
    proc = snakemake(wf)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = wf / "results/wf"
    assert "val_acc" in proc.stdout + proc.stderr  # the headline printed at the end
    for st in ("a", "b"):
        s = json.loads((res / f"stages/{st}/summary.json").read_text())
        assert s["world_size"] == 2 and s["finished"]
    assert (wf / "logs/wf/train_a.log").read_text().count("torch.distributed.run") == 1
    assert json.loads((res / "image.json").read_text())["engine"] == "none"
    summary = json.loads((res / "summary/summary.json").read_text())
    assert [r["stage"] for r in summary["stages"]] == ["a", "b"]

    # a second run has nothing to do
    again = snakemake(wf)
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr

    # a later stage's lr: that stage (and collect) only
    stamp = {p: p.stat().st_mtime_ns for p in (res / "data/meta.json", res / "stages/a/final.pt",
                                               res / "stages/b/final.pt")}
    changed = json.loads(json.dumps(TINY))
    changed["stages"][1]["lr"] = 0.05
    write(wf, changed)
    assert planned(snakemake(wf, "-n")) == {"train": 1, "collect": 1, "all": 1}
    proc = snakemake(wf)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (res / "data/meta.json").stat().st_mtime_ns == stamp[res / "data/meta.json"]
    assert (res / "stages/a/final.pt").stat().st_mtime_ns == stamp[res / "stages/a/final.pt"]
    assert (res / "stages/b/final.pt").stat().st_mtime_ns != stamp[res / "stages/b/final.pt"]
    s = json.loads((res / "stages/b/summary.json").read_text())
    assert s["config"]["stages"][1]["lr"] == 0.05

    # an earlier stage's lr reruns it and everything after it, not the data
    changed["stages"][0]["lr"] = 0.2
    write(wf, changed)
    assert planned(snakemake(wf, "-n")) == {"train": 2, "collect": 1, "all": 1}
    # a data setting reruns the preparation and every stage
    changed["data"]["val_size"] = 100
    write(wf, changed)
    assert planned(snakemake(wf, "-n")) == {"prepare_data": 1, "train": 2, "collect": 1,
                                            "all": 1}


def test_code_and_dockerfile_changes_rerun_what_they_affect(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    for part in ("Snakefile", "workflow", "config", "src", "Dockerfile", "pyproject.toml"):
        src = REPO / part
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, tree / part)
    wf = tmp_path / "wd"
    wf.mkdir()
    write(wf, TINY)
    sf = tree / "Snakefile"
    assert snakemake(wf, snakefile=sf).returncode == 0
    assert "Nothing to be done" in (snakemake(wf, "-n", snakefile=sf).stdout)
    with open(tree / "src/ddpflow/train.py", "a") as f:
        f.write("\n# a change to the trainer\n")
    assert planned(snakemake(wf, "-n", snakefile=sf)) == {"train": 2, "collect": 1, "all": 1}
    with open(tree / "src/ddpflow/data/prepare.py", "a") as f:
        f.write("\n# a change to data preparation\n")
    assert planned(snakemake(wf, "-n", snakefile=sf)) == {
        "prepare_data": 1, "train": 2, "collect": 1, "all": 1}
    # with a container engine, the Dockerfile feeds the image, which feeds every stage
    docker = {**TINY, "container": {"engine": "docker"}}
    write(wf, docker, "docker.yaml")
    assert planned(snakemake(wf, "-n", snakefile=sf, config="docker.yaml")) == {
        "image": 1, "prepare_data": 1, "train": 2, "collect": 1, "all": 1}


def test_tune_rule_runs_before_the_stages_that_use_it(tmp_path):
    cfg = json.loads(json.dumps(TINY))
    cfg["tune"] = {"enabled": True, "steps": 2, "start_batch": 8, "max_batch": 64}
    cfg["stages"][0].update(batch_size="auto", precision="auto")
    write(tmp_path, cfg)
    assert planned(snakemake(tmp_path, "-n")) == {"image": 1, "prepare_data": 1, "tune": 1,
                                                  "train": 2, "collect": 1, "all": 1}
    proc = snakemake(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = tmp_path / "results/wf"
    choice = json.loads((res / "tune.json").read_text())["choice"]
    a = json.loads((res / "stages/a/summary.json").read_text())
    assert a["batch_size_per_rank"] == choice["batch_size"] <= 64
    assert a["precision"] == choice["precision"] and a["tuned"] == choice
    b = json.loads((res / "stages/b/summary.json").read_text())
    assert b["batch_size_per_rank"] == 32  # a fixed batch stays as written
    assert "Nothing to be done" in snakemake(tmp_path, "-n").stdout
    # a tune setting re-measures and reruns the stages after it, not the data
    cfg["tune"]["max_batch"] = 32
    write(tmp_path, cfg)
    assert planned(snakemake(tmp_path, "-n")) == {"tune": 1, "train": 2, "collect": 1,
                                                  "all": 1}


def test_invalid_config_stops_before_any_job(tmp_path):
    bad = json.loads(json.dumps(TINY))
    bad["stages"][0]["epochs"] = -1
    bad["data"]["colour"] = "red"
    write(tmp_path, bad)
    proc = snakemake(tmp_path)
    assert proc.returncode != 0
    err = proc.stdout + proc.stderr
    assert "colour" in err and "Error validating config" in err
    assert not (tmp_path / "results").exists() and not (tmp_path / "logs").exists()


def test_slurm_profile_dry_run_resolves_gpu_resources(wf):
    cfg = {**TINY, "slurm": {"gpus": 2, "cpus_per_gpu": 6, "mem_mb": 32000, "runtime_min": 90,
                             "account": "proj1", "signal_before_end_s": 120}}
    write(wf, cfg)
    proc = snakemake(wf, "-n", "--profile", str(REPO / "profiles/slurm"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    train = [b for b in out.split("rule train:")[1:]]
    assert len(train) == 2
    for block in train:
        res = block.split("resources:")[1].splitlines()[0]
        for want in ("gpu=2", "cpus_per_gpu=6", "mem_mb=32000", "runtime=90",
                     "slurm_account=proj1", "slurm_partition=debug", "--signal=USR1@120"):
            assert want in res, (want, res)
        assert "ddpflow launch" in block and block.count("ddpflow launch") == 1
