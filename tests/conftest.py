"""Shared helpers: tiny configs and the real `ddpflow` command in a subprocess."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]

TINY = {
    "run": "t",
    "seed": 0,
    "log_every_steps": 4,
    # difficulty 0: the easy synthetic set, learnt in an epoch (the default is the hard one)
    "data": {"source": "synthetic", "train_size": 1024, "val_size": 256, "test_size": 256,
             "image_size": 16, "difficulty": 0},
    "hardware": {"nproc_per_node": 2, "threads_per_rank": 1},
    "checkpoint": {"every_steps": 8, "keep_last": 3},
    "stages": [{"name": "s1", "epochs": 2, "batch_size": 32, "lr": 0.05}],
}


# what `auto` would pick depends on the machine (bf16 on a CPU with fast bf16, a timed
# layout probe): a test pins them unless it tests `auto` (and then sets "auto" itself)
PINNED = {"precision": "fp32", "channels_last": False}


def tiny_config(tmp_path: Path, **top) -> dict:
    cfg = copy.deepcopy(TINY)
    cfg["results_dir"] = str(tmp_path / "results")
    for k, v in copy.deepcopy(top).items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            cfg[k].update(v)
        else:
            cfg[k] = v
    for st in cfg["stages"]:
        if isinstance(st, dict):
            for k, v in PINNED.items():
                st.setdefault(k, v)
    if isinstance(cfg.get("data"), dict) and cfg["data"].get("source", "synthetic") == "synthetic":
        # `auto` decides from the free memory of the machine the test runs on
        cfg["data"].setdefault("loader", "device")
    return cfg


def write_config(tmp_path: Path, cfg: dict, name: str = "config.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return p


def ddpflow(*args, cwd=None, env=None, check=False, timeout=600) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "ddpflow", *map(str, args)], cwd=cwd or REPO,
                          env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"ddpflow {' '.join(map(str, args))} failed ({proc.returncode}):\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture
def run_ddpflow():
    return ddpflow


# `make test` runs a test file per process (pytest-xdist --dist loadfile, in this order with
# --no-loadscope-reorder): the longest files go first, so the suite does not end with one
# long file running alone (estimated seconds on 2 cores, alone, in the comments)
LONGEST_FIRST = ("test_workflow.py",  # ~480
                 "test_slurm.py",  # ~420
                 "test_faults.py",  # ~300
                 "test_trust.py", "test_mlflow.py", "test_engine.py", "test_evaluate.py",
                 "test_container.py", "test_sweep.py", "test_tune.py",
                 "test_fsdp.py",  # 100-170 each
                 "test_sweep_asha.py", "test_hang.py", "test_sampling_runs.py",
                 "test_asha.py")  # this round's: real sweeps, hangs that wait for a timeout


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within a file
