"""The torchrun command line and environment of one stage (launch/launcher.plan), read
without starting it: what each rank is told (its module, resolved config, stage and extra
arguments), how many ranks meet where, how often torchrun restarts them, and NCCL's flight
recorder switched on where the ranks run on GPUs (its dump beside the stage's rank files).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from conftest import tiny_config
from ddpflow.config import from_dict
from ddpflow.launch import hangreport, launcher, slurmnodes

FLIGHT = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE",
          "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_NCCL_DUMP_ON_TIMEOUT")


@pytest.fixture(autouse=True)
def _no_flight_settings(monkeypatch):
    for name in FLIGHT:
        monkeypatch.delenv(name, raising=False)


def _cfg(tmp_path, **hardware):
    return from_dict(tiny_config(tmp_path, hardware={"device": "cpu", "max_restarts": 3,
                                                     **hardware}))


def test_one_node_meets_at_a_local_c10d_rendezvous_and_tells_each_rank_its_stage(tmp_path):
    cfg = _cfg(tmp_path, nproc_per_node=2)
    resolved = tmp_path / "results" / "t" / "stages" / "s1" / "config.json"
    cmd, env = launcher.plan(cfg, "s1", resolved, ["--halt-after-steps=3"])
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nnodes=1" in cmd and "--nproc-per-node=2" in cmd
    assert "--rdzv-backend=c10d" in cmd and "--max-restarts=3" in cmd
    endpoint = next(a for a in cmd if a.startswith("--rdzv-endpoint="))
    host, port = endpoint.split("=", 1)[1].rsplit(":", 1)
    assert host == "127.0.0.1" and 0 < int(port) < 65536
    assert f"--rdzv-id=s1-{os.getpid()}" in cmd
    # what every rank runs, in this order, after torchrun's own options
    assert cmd[-8:] == ["--module", "ddpflow", "train", "--resolved", str(resolved),
                        "--stage", "s1", "--halt-after-steps=3"]
    assert not set(FLIGHT) & set(env)  # CPU ranks: gloo, no NCCL flight recorder
    tune_cmd, _ = launcher.plan(cfg, "s1", resolved, command="tune")
    assert tune_cmd[-6:-3] == ["ddpflow", "tune", "--resolved"]


def test_the_rank_count_comes_from_the_stage_unless_the_caller_has_it(tmp_path):
    cfg = _cfg(tmp_path, nproc_per_node=2)
    resolved = tmp_path / "config.json"
    cmd, _ = launcher.plan(cfg, "s1", resolved)
    assert "--nproc-per-node=2" in cmd
    cmd, env = launcher.plan(cfg, "s1", resolved, ranks=(3, "cpu", {"OMP_NUM_THREADS": "5"}))
    assert "--nproc-per-node=3" in cmd and env["OMP_NUM_THREADS"] == "5"


def test_gpu_ranks_get_the_flight_recorder_with_its_dump_beside_the_rank_files(tmp_path):
    cfg = _cfg(tmp_path)
    resolved = tmp_path / "stage" / "config.json"
    _, env = launcher.plan(cfg, "s1", resolved, ranks=(2, "cuda", {"KEEP": "1"}))
    assert env["KEEP"] == "1"
    assert env[hangreport.buffer_variable(torch.__version__)] == str(hangreport.FLIGHT_ENTRIES)
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(
        tmp_path / "stage" / "ranks" / hangreport.FLIGHT_PREFIX)


def test_several_nodes_run_one_srun_step_with_a_torchrun_per_node(tmp_path, monkeypatch):
    monkeypatch.setattr(slurmnodes, "slurm_hosts", lambda: ["node-a", "node-b"])
    cfg = _cfg(tmp_path, nodes=2, nproc_per_node=2)
    resolved = tmp_path / "config.json"
    cmd, _ = launcher.plan(cfg, "s1", resolved)
    assert cmd[0] == "srun" and "--nodes=2" in cmd and "--nnodes=2" in cmd
    assert "--max-restarts=3" in cmd and cmd[-7:] == [
        "--module", "ddpflow", "train", "--resolved", str(resolved), "--stage", "s1"]
