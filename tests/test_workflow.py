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
    "data": {"train_size": 512, "val_size": 128, "test_size": 128, "image_size": 16},
    "hardware": {"nproc_per_node": 2, "threads_per_rank": 1},
    "stages": [
        {"name": "a", "epochs": 1, "batch_size": 32, "lr": 0.1},
        {"name": "b", "epochs": 1, "batch_size": 32, "lr": 0.02, "init_from": "previous"},
    ],
}


# the jobs after a last stage that ran: evaluation on the test split and the export
AFTER = {"evaluate": 1, "export": 1}


def snakemake(workdir: Path, *args, snakefile: Path = REPO / "Snakefile", config="tiny.yaml",
              activated: bool = True):
    """`activated=False`: .venv/bin/snakemake with the venv's bin/ not on PATH."""
    path = os.environ["PATH"].split(os.pathsep)
    path = [str(BIN), *path] if activated else [p for p in path if Path(p) != BIN]
    env = {**os.environ, "PATH": os.pathsep.join(path)}
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


# a results folder with spaces and shell syntax: every path on a rule's shell line is quoted
ODD_RESULTS = "my results || touch INJECTED #"


def test_full_run_rerun_and_partial_rerun(wf):
    write(wf, {**TINY, "results_dir": ODD_RESULTS})
    proc = snakemake(wf)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not list(wf.rglob("INJECTED")), "a path on a shell line ran as a command"
    res = wf / ODD_RESULTS / "wf"
    assert "val_acc" in proc.stdout + proc.stderr  # the headline printed at the end
    # each job's log is in the run's folder, and the lines a person watches reach the
    # console: the stage's progress (a line per log interval: no terminal, no bar) and its end
    assert re.search(r"^\[a\] step 4/\d+ \(epoch 0\): loss ", proc.stderr, re.M), proc.stderr
    assert "ddpflow: stage 'b' finished" in proc.stderr and "Traceback" not in proc.stderr
    for st in ("a", "b"):
        s = json.loads((res / f"stages/{st}/summary.json").read_text())
        assert s["world_size"] == 2 and s["finished"]
    assert (res / "logs/train_a.log").read_text().count("torch.distributed.run") == 1
    assert json.loads((res / "image.json").read_text())["engine"] == "none"
    summary = json.loads((res / "summary/summary.json").read_text())
    assert [r["stage"] for r in summary["stages"]] == ["a", "b"]

    # a second run has nothing to do
    again = snakemake(wf)
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr
    # nor has one after a change to any key the rerun rule leaves out (config/rerun.py)
    base = {**TINY, "results_dir": ODD_RESULTS}
    table = {key: planned(snakemake(wf, "-n", config=_changed(wf, base, key, value)))
             for key, value in left_out_changes(res).items()}
    assert all(not jobs for jobs in table.values()), table

    # a later stage's lr: that stage (and collect) only
    stamp = {p: p.stat().st_mtime_ns for p in (res / "data/meta.json", res / "stages/a/final.pt",
                                               res / "stages/b/final.pt")}
    changed = json.loads(json.dumps({**TINY, "results_dir": ODD_RESULTS}))
    changed["stages"][1]["lr"] = 0.05
    write(wf, changed)
    assert planned(snakemake(wf, "-n")) == {"train": 1, **AFTER, "collect": 1, "all": 1}
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
    assert planned(snakemake(wf, "-n")) == {"train": 2, **AFTER, "collect": 1, "all": 1}
    # a data setting reruns the preparation and every stage
    changed["data"]["val_size"] = 100
    write(wf, changed)
    assert planned(snakemake(wf, "-n")) == {"prepare_data": 1, "train": 2, **AFTER, "collect": 1,
                                            "all": 1}


# a changed value for a key of each entry of the rule's LEFT_OUT ("where the results live":
# run and results_dir move every output, so Snakemake has none there: not a rerun)
MOVES = ("run", "results_dir")


def left_out_changes(res: Path) -> dict[str, object]:
    from ddpflow.config.rerun import LEFT_OUT

    values = {"log_every_steps": 8, "stop_check_s": 30, "checkpoint.keep_last": 5,
              "sweep.max_trials": 7, "tracking.tensorboard": False, "profile.wait": 3,
              "slurm.runtime_min": 30, "hardware.slots.threads": 2,
              "hardware.rdzv_port": 29999, "data.prepared_dir": str((res / "data").resolve())}
    rows = {key: value for key, value in values.items()
            if any(key == k or key.startswith(k + ".") for k in LEFT_OUT)}
    missing = [k for k in LEFT_OUT if k not in MOVES and not any(
        r == k or r.startswith(k + ".") for r in rows)]
    assert not missing, f"give the rerun test a changed value for {missing}"
    return rows


def _changed(wf: Path, base: dict, key: str, value) -> str:
    cfg = json.loads(json.dumps(base))
    node = cfg
    *parents, last = key.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    write(wf, cfg, "changed.yaml")
    return "changed.yaml"


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
    assert planned(snakemake(wf, "-n", snakefile=sf)) == {"train": 2, **AFTER, "collect": 1,
                                                          "all": 1}
    with open(tree / "src/ddpflow/data/prepare.py", "a") as f:
        f.write("\n# a change to data preparation\n")
    assert planned(snakemake(wf, "-n", snakefile=sf)) == {
        "prepare_data": 1, "train": 2, **AFTER, "collect": 1, "all": 1}
    # with a container engine, the Dockerfile feeds the image, which feeds every stage
    docker = {**TINY, "container": {"engine": "docker"}}
    write(wf, docker, "docker.yaml")
    assert planned(snakemake(wf, "-n", snakefile=sf, config="docker.yaml")) == {
        "image": 1, "prepare_data": 1, "train": 2, **AFTER, "collect": 1, "all": 1}


def test_tune_rule_runs_before_the_stages_that_use_it(tmp_path):
    cfg = json.loads(json.dumps(TINY))
    cfg["tune"] = {"enabled": True, "steps": 2, "start_batch": 8, "max_batch": 64}
    cfg["stages"][0].update(batch_size="auto", precision="auto")
    write(tmp_path, cfg)
    assert planned(snakemake(tmp_path, "-n")) == {"image": 1, "prepare_data": 1, "tune": 1,
                                                  "train": 2, **AFTER, "collect": 1, "all": 1}
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
    assert planned(snakemake(tmp_path, "-n")) == {"tune": 1, "train": 2, **AFTER, "collect": 1,
                                                  "all": 1}


def test_invalid_config_stops_before_any_job(tmp_path):
    bad = json.loads(json.dumps(TINY))
    bad["stages"][0]["epochs"] = -1
    bad["data"]["colour"] = "red"
    write(tmp_path, bad)
    proc = snakemake(tmp_path)
    assert proc.returncode != 0
    err = proc.stdout + proc.stderr
    # ddpflow's own message, naming every problem (not a dump of the schema)
    assert "invalid config" in err and "unknown key data.colour" in err
    assert "stages.0.epochs" in err and "Traceback" not in err
    assert not (tmp_path / "results").exists() and not (tmp_path / "logs").exists()


def test_slurm_profile_dry_run_resolves_gpu_resources(wf):
    cfg = {**TINY, "slurm": {"gpus": 2, "cpus_per_gpu": 1, "mem_mb": 1000, "runtime_min": 90,
                             "account": "proj1", "signal_before_end_s": 120}}
    write(wf, cfg)
    proc = snakemake(wf, "-n", "--profile", str(REPO / "profiles/slurm"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    train = [b for b in out.split("rule train:")[1:]]
    assert len(train) == 2
    for block in train:
        res = block.split("resources:")[1].splitlines()[0]
        for want in ("gpu=2", "cpus_per_gpu=1", "mem_mb=1000", "runtime=90",
                     "slurm_account=proj1", "slurm_partition=debug", "--signal=USR1@120"):
            assert want in res, (want, res)
        assert block.count(" launch --config=") == 1 and "ddpflow --log=" in block
        assert "tasks_per_gpu=0" in res  # one task keeps all the job's GPUs


def test_slurm_gres_and_two_nodes_dry_run(wf):
    """gres instead of gpu=, and a two-node job whose srun step is ddpflow's own (mpi)."""
    cfg = {**TINY, "hardware": {**TINY["hardware"], "nodes": 2},
           "slurm": {"gres": "gpu:a100:2", "cpus_per_gpu": 1}}
    write(wf, cfg)
    proc = snakemake(wf, "-n", "--profile", str(REPO / "profiles/slurm"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    for block in out.split("rule train:")[1:]:
        res = block.split("resources:")[1].splitlines()[0]
        for want in ("gres=gpu:a100:2", "tasks_per_gpu=0", "nodes=2", "tasks=2", "mpi=srun"):
            assert want in res, (want, res)
        assert " gpu=" not in res and "gpu_model" not in res
    used = json.loads((wf / "results/wf/workflow_config.json").read_text())
    assert used["slurm"]["gpus"] == 2  # resolved from the gres count


def test_a_user_config_is_not_merged_with_the_default(tmp_path):
    """Keys a user's --configfile leaves out take the schema's defaults, as in the CLI,
    not config/config.yaml's values (8192 training samples there)."""
    write(tmp_path, {"run": "mine", "stages": [{"name": "a"}]})
    proc = snakemake(tmp_path, "-n")
    assert proc.returncode == 0, proc.stderr[-2000:]
    used = json.loads((tmp_path / "results/mine/workflow_config.json").read_text())
    assert used["data"]["train_size"] is None and used["data"]["val_size"] is None
    from ddpflow.config import from_dict

    defaults = from_dict({"run": "mine", "stages": [{"name": "a"}]}).to_dict()
    # the Slurm sizes left open are filled in from sinfo where there is one (slurmsizes.py)
    assert {k: v for k, v in from_dict(used).to_dict().items() if k != "slurm"} == \
        {k: v for k, v in defaults.items() if k != "slurm"}
    assert isinstance(used["slurm"]["mem_mb"], int) and used["slurm"]["cpus_per_gpu"] >= 1


def test_make_run_trains_the_embedded_default(tmp_path):
    """`make run` as README.md gives it, in a copy of the project's layout: its set-up step
    finds the venv installed, then snakemake --cores all trains config/config.yaml end to
    end."""
    for name in ("Snakefile", "workflow", "config", "src", "pyproject.toml", "Makefile"):
        (tmp_path / name).symlink_to(REPO / name)
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    stale = subprocess.run(["make", "-q", ".venv/.ddpflow-installed"], cwd=tmp_path, env=env)
    if stale.returncode:  # make would reinstall the package from this copy: not in a test
        pytest.fail("the venv is older than pyproject.toml: run `make install` first")
    proc = subprocess.run(["make", "run", "CORES=2"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    head = (tmp_path / "results/default/summary/headline.txt").read_text()
    assert head.splitlines()[0] in out  # the headline is printed at the end
    for stage in ("warmup", "finetune"):
        line = next(x for x in head.splitlines() if x.strip().startswith(stage))
        assert "val_acc" in line and "samples/s" in line and "NOT FINISHED" not in line
    assert (tmp_path / "results/default/summary/report.html").stat().st_size > 10_000


BOOM = """
import torch.nn as nn

class Boom(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.calls = nn.Linear(3 * 16 * 16, 10), 0

    def forward(self, x):
        self.calls += 1
        if self.training and self.calls > 6:
            raise RuntimeError("boom in forward")
        return self.fc(x.flatten(1))

def build(num_classes=10, in_channels=3):
    return Boom()
"""


def test_a_crashed_stage_shows_its_progress_and_cause_on_the_console(tmp_path):
    """Under `snakemake --cores` a job's output goes to its log; the console still shows the
    stage's progress lines and, when a rank crashes, ddpflow's one-line error and the
    exception that caused it (not the traceback, not only Snakemake's error block)."""
    (tmp_path / "code").mkdir()
    (tmp_path / "code/boom.py").write_text(BOOM)
    cfg = {**TINY, "log_every_steps": 2, "model": {"name": "boom:build", "code_dir": "code"},
           "hardware": {**TINY["hardware"], "max_restarts": 0},
           "stages": [{**TINY["stages"][0], "precision": "fp32", "channels_last": False}]}
    write(tmp_path, cfg)
    proc = snakemake(tmp_path)
    assert proc.returncode != 0
    err = proc.stderr
    assert re.search(r"^\[a\] step 2/\d+ \(epoch 0\): loss ", err, re.M), err[-3000:]
    assert "ddpflow: error: stage 'a' failed: torchrun exited with 1" in err, err[-3000:]
    line = next(x for x in err.splitlines() if x.startswith("ddpflow: the last exception"))
    assert "results/wf/logs/train_a.log" in line and "RuntimeError: boom in forward" in line
    assert "Traceback" not in err and "boom in forward" in \
        (tmp_path / "results/wf/logs/train_a.log").read_text()


def test_a_diverged_stage_is_not_retried_into_the_same_nan(tmp_path):
    """The local profile retries failed jobs once: the retry sees failed.json with the same
    inputs and stops at once (exit 3) instead of resuming into the same divergence."""
    cfg = {**TINY, "checkpoint": {"every_steps": 1, "keep_last": 3},
           "stages": [{"name": "a", "max_steps": 50, "batch_size": 32, "lr": 1e30,
                       "momentum": 0.0, "weight_decay": 0.0}]}
    write(tmp_path, cfg)
    proc = snakemake(tmp_path, "--profile", str(REPO / "profiles/local"))
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "Trying to restart job" in out or "attempt 2" in out.lower(), out[-3000:]
    # the profile shows failed jobs' logs: the first attempt diverged, the retry refused
    assert out.count("loss became") >= 2 and "diverged with these settings before" in out
    assert "resumed from" not in out
    failed = json.loads((tmp_path / "results/wf/stages/a/failed.json").read_text())
    assert "at step" in failed["reason"]


def test_an_image_added_to_the_folder_reruns_preparation(tmp_path):
    from fixtures import image_tree

    root = image_tree(tmp_path / "imgs", per_class=6)
    cfg = {**TINY, "data": {"source": "imagefolder", "path": str(root), "image_size": 16,
                            "val_fraction": 0.34},
           "stages": [{"name": "a", "max_steps": 2, "batch_size": 4}]}
    write(tmp_path, cfg)
    proc = snakemake(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Nothing to be done" in snakemake(tmp_path, "-n").stdout
    shutil.copy2(root / "cat/img000.png", root / "cat/img999.png")  # one more image
    assert planned(snakemake(tmp_path, "-n")) == {"prepare_data": 1, "train": 1,
                                                  **AFTER, "collect": 1, "all": 1}


def example(tmp_path: Path, name: str) -> Path:
    """A copy of examples/<name> where the README runs it from (the repository's top)."""
    shutil.copytree(REPO / "examples" / name, tmp_path / "examples" / name,
                    ignore=shutil.ignore_patterns("data", "pretrained.pt", "__pycache__"))
    return tmp_path / "examples" / name / "config.yaml"


def test_examples_run_and_a_model_edit_reruns_only_training(tmp_path):
    """Both user projects of examples/ run through Snakemake as their README says; editing
    the user's model file makes the stages stale and reruns them, not the data."""
    cfg = example(tmp_path, "own_model")
    subprocess.run([sys.executable, str(cfg.parent / "make_assets.py")], check=True,
                   timeout=300)
    proc = snakemake(tmp_path, config="examples/own_model/config.yaml")
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = tmp_path / "results/own_model"
    probe = json.loads((res / "stages/probe/summary.json").read_text())
    assert probe["init"]["reinitialised"] == ["head.weight", "head.bias"]
    final = json.loads((res / "stages/finetune/summary.json").read_text())
    assert final["final_val_acc"] > 0.5  # 3 classes: far above chance
    assert "re-initialised (head.weight, head.bias)" in \
        (tmp_path / "results/own_model/logs/train_probe.log").read_text()

    model_file = cfg.parent / "tinynet.py"
    model_file.write_text(model_file.read_text() + "\n# tuned the blocks\n")
    dry = snakemake(tmp_path, "-n", config="examples/own_model/config.yaml")
    assert planned(dry) == {"train": 2, **AFTER, "collect": 1, "all": 1}, dry.stdout[-2000:]
    stale = subprocess.run([str(BIN / "ddpflow"), "collect", "--config", str(cfg)],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert "STALE" in stale.stdout + stale.stderr and "code of yours" in stale.stdout

    tab = example(tmp_path, "tabular")
    proc = snakemake(tmp_path, config="examples/tabular/config.yaml")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((tmp_path / "results/tabular/stages/fit/summary.json").read_text())
    assert s["monitor"] == "val_mae" and s["task"] == "tabular_task:Huber"
    assert s["final_metrics"]["val_mae"] < 0.6  # a constant guess is ~1.4 off
    assert tab.is_file()
