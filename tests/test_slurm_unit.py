"""Slurm's answers as ddpflow reads them, against the real cluster tests/setup/slurm.sh starts
(partition debug* with node vm and its 2 fake GPUs, partition pair with ddpn1 and ddpn2):
the node list of an allocation, what a job holds on each node, the srun step of a
several-node stage, which nodes never joined, and the sizes a job asks for where the config
leaves them open (launch/slurmnodes.py, launch/slurmsizes.py). Fast: one srun and one held
sbatch job, no training.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import tiny_config
from ddpflow.config import from_dict
from ddpflow.core.errors import UserError
from ddpflow.launch import slurmnodes
from ddpflow.launch.slurmsizes import parse_sinfo, resolve, sinfo

NOWHERE = Path("/nonexistent")  # results_dir of configs only resolved, never run
ALLOC = ("SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_JOB_ID")


@pytest.fixture
def no_job(monkeypatch):
    """A process outside any Slurm allocation (the test may run inside one)."""
    for k in ALLOC:
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def _cfg(tmp_path, **top):
    return from_dict(tiny_config(tmp_path, **top))


# ------------------------------------------------------------------ the allocation's nodes

def test_the_node_list_of_an_allocation_is_expanded_by_scontrol(no_job):
    no_job.setenv("SLURM_NODELIST", "ddpn[1-2]")
    assert slurmnodes.slurm_hosts() == ["ddpn1", "ddpn2"]  # the older variable alone
    no_job.setenv("SLURM_JOB_NODELIST", "vm,ddpn2")
    assert slurmnodes.slurm_hosts() == ["vm", "ddpn2"]  # the job's wins


def test_outside_an_allocation_the_node_list_is_one_message(no_job):
    with pytest.raises(UserError) as e:
        slurmnodes.slurm_hosts()
    assert str(e.value).startswith("hardware.nodes > 1 runs inside a Slurm allocation") \
        and "sbatch --nodes=N" in str(e.value), e.value


@pytest.mark.parametrize("nodelist, path", [("n[a-b]", None), ("ddpn[2-1]", None),
                                           ("ddpn[1-2", None), ("vm,ddpn[1-2", None),
                                           ("ddpn[1-2]", "")])
def test_a_node_list_scontrol_cannot_expand_is_one_message(no_job, nodelist, path):
    """A list scontrol cannot read (it exits 0 and prints nothing), or no scontrol on PATH:
    one message naming the list."""
    no_job.setenv("SLURM_JOB_NODELIST", nodelist)
    if path is not None:
        no_job.setenv("PATH", path)
    with pytest.raises(UserError) as e:
        slurmnodes.slurm_hosts()
    assert str(e.value).startswith(f"cannot expand the Slurm node list '{nodelist}' with "
                                   f"scontrol ("), e.value
    if nodelist.endswith("[1-2"):  # a range left open: scontrol makes 'ddpn]' of it
        assert str(e.value).endswith("ddpn]')"), e.value
    elif path is None:  # scontrol's own words, its last line
        assert str(e.value).endswith(f"(Invalid hostlist: {nodelist})"), e.value


def test_inside_a_job_its_nodes_and_cpus_are_asked_of_slurm(tmp_path):
    """Snakemake's Slurm job step keeps only SLURM_JOB_ID: the node list and what the job
    holds on a node then come from `scontrol show job` (a real srun on node vm)."""
    probe = ("import json, os; from ddpflow.launch import slurmnodes as s; "
             "f = s._job_fields(os.environ['SLURM_JOB_ID']); "
             "print(json.dumps([s.slurm_hosts(), s._job_per_node(f), f.get('JobId')]))")
    out = subprocess.run(["srun", "-p", "debug", "-N1", "-n1", "-c2", "env", "-u",
                          "SLURM_JOB_NODELIST", "-u", "SLURM_NODELIST", sys.executable, "-c",
                          probe], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    hosts, per_node, job = json.loads(out.stdout.splitlines()[-1])
    assert hosts == ["vm"] and per_node == [2, 0] and job.isdigit(), out.stdout


def test_a_pending_job_has_no_node_list_and_an_unknown_job_no_fields():
    job = subprocess.run(["sbatch", "--hold", "--parsable", "-p", "debug", "--wrap", "true"],
                         capture_output=True, text=True, check=True).stdout.strip()
    try:
        fields = slurmnodes._job_fields(job)
        assert fields["JobId"] == job and fields["JobState"] == "PENDING", fields
        assert slurmnodes._job_nodelist(job) is None
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    assert slurmnodes._job_fields("999999999") == {}
    assert slurmnodes._job_fields(None) == {} and slurmnodes._job_nodelist(None) is None


@pytest.mark.parametrize("fields, want", [
    ({"TRES": "cpu=8,mem=2000M,node=2,billing=8,gres/gpu=4"}, (4, 2)),
    ({"TRES": "cpu=6,mem=2000M,node=1,billing=6"}, (6, 0)),  # one node: all of it
    ({"TRES": "cpu=6,node=0"}, None),  # nothing held (yet)
    ({"TRES": "cpu=6,mem=1G"}, None),  # no node count
    ({"TRES": "cpu=x,node=1"}, None),
    ({}, None),
])
def test_what_a_job_holds_on_each_node(fields, want):
    assert slurmnodes._job_per_node(fields) == want


# ------------------------------------------------------------------ the several-node step

def test_the_srun_step_meets_on_the_first_node(tmp_path, no_job):
    no_job.setenv("SLURM_JOB_NODELIST", "ddpn[1-2]")
    no_job.setenv("SLURM_JOB_ID", "4242")
    cfg = _cfg(tmp_path, hardware={"nodes": 2, "nproc_per_node": 3, "rdzv_port": 29531,
                                   "timeout_s": 77})
    cmd = slurmnodes.srun_command(cfg, 3, tmp_path / "run" / "config.json",
                                  "--max-restarts=1", ["-m", "train"])
    call = cmd.index("ddpflow.launch.rollcall")
    assert cmd[call + 1:call + 6] == [str(tmp_path / "run" / "nodes"), "ddpn1", "29531", "77",
                                      "--"], cmd
    run = cmd[cmd.index("torch.distributed.run") + 1:]
    assert run == ["--nnodes=2", "--nproc-per-node=3", "--rdzv-backend=c10d",
                   "--rdzv-endpoint=ddpn1:29531", "--rdzv-id=4242",
                   "--rdzv-conf=join_timeout=77", "--max-restarts=1", "-m", "train"], cmd
    # no hardware.rdzv_port: a port free on this host, the same in both places
    cfg = _cfg(tmp_path, hardware={"nodes": 2, "nproc_per_node": 1})
    cmd = slurmnodes.srun_command(cfg, 1, tmp_path / "config.json", "--max-restarts=0", [])
    port = cmd[cmd.index("ddpflow.launch.rollcall") + 3]
    assert 1024 < int(port) < 65536 and f"--rdzv-endpoint=ddpn1:{port}" in cmd, cmd


def test_a_step_on_more_nodes_than_the_allocation_is_one_message(tmp_path, no_job):
    no_job.setenv("SLURM_JOB_NODELIST", "ddpn[1-2]")
    with pytest.raises(UserError) as e:
        slurmnodes.srun_command(_cfg(tmp_path, hardware={"nodes": 3, "nproc_per_node": 1}),
                                1, tmp_path / "config.json", "--max-restarts=0", [])
    assert str(e.value).startswith("hardware.nodes is 3 but the Slurm allocation has 2 "
                                   "node(s); submit with --nodes=3"), e.value


def test_the_step_asks_a_core_per_gpu_when_cpus_per_gpu_is_open(tmp_path, no_job):
    cfg = _cfg(tmp_path, hardware={"nodes": 2, "nproc_per_node": 2},
               slurm={"gpus": 4, "cpus_per_gpu": None})
    assert slurmnodes.step_resources(cfg) == ["--cpus-per-task=2", "--gres=gpu:2"]


def test_a_free_port_is_one_this_host_can_bind():
    port = slurmnodes.free_port()
    assert 1024 < port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_the_roll_call_folder_is_beside_the_resolved_config(tmp_path):
    assert slurmnodes.roll_call_dir(tmp_path / "s" / "config.json") == tmp_path / "s" / "nodes"


def test_the_nodes_that_never_joined_are_named(tmp_path, no_job):
    two = _cfg(tmp_path, hardware={"nodes": 2, "nproc_per_node": 1, "timeout_s": 45})
    stage = tmp_path / "stage"
    (stage / "nodes").mkdir(parents=True)
    (stage / "nodes" / "ddpn1").write_bytes(b"")
    assert slurmnodes.missing_nodes_text(two, stage) is None  # outside an allocation
    no_job.setenv("SLURM_JOB_NODELIST", "ddpn[1-2]")
    assert slurmnodes.missing_nodes_text(two, stage) == (
        "1 of 2 node(s) never joined the rendezvous on ddpn1 within hardware.timeout_s (45 s):"
        " ddpn2; check that node (sinfo -N, its slurmd log) and that it can reach ddpn1 on the "
        "rendezvous port (set hardware.rdzv_port to one the firewall allows)")
    (stage / "nodes" / "ddpn2").write_bytes(b"")
    assert slurmnodes.missing_nodes_text(two, stage) is None  # all joined
    for p in (stage / "nodes").iterdir():
        p.unlink()
    one = _cfg(tmp_path, hardware={"nodes": 1, "nproc_per_node": 1})
    assert slurmnodes.missing_nodes_text(one, stage) is None  # one node: no roll call


@pytest.mark.parametrize("job, visible, gpus, nodes, refused", [
    ("7", "0", 2, 1, True),  # split into one task per GPU
    ("7", "0,1", 2, 1, False),
    ("7", "0,1,2", 2, 1, True),
    (None, "0", 2, 1, False),  # not a Slurm job
    ("7", "0,1", 1, 1, True),
    ("7", "", 0, 1, False),  # a CPU job
    ("7", "0,1", 0, 1, False),  # a CPU job on a node whose GPUs it can see
    ("7", "0", 4, 2, False),  # several nodes: each node's torchrun sees its own
])
def test_a_slurm_job_that_sees_other_gpus_than_it_asked_is_refused(tmp_path, no_job, job,
                                                                   visible, gpus, nodes,
                                                                   refused):
    cfg = _cfg(tmp_path, slurm={"gpus": gpus},
               hardware={"nodes": nodes, "nproc_per_node": max(1, gpus // nodes)})
    if job:
        no_job.setenv("SLURM_JOB_ID", job)
    no_job.setenv("CUDA_VISIBLE_DEVICES", visible)
    if not refused:
        slurmnodes.check_slurm_gpus(cfg)
        return
    with pytest.raises(UserError) as e:
        slurmnodes.check_slurm_gpus(cfg)
    n = len(visible.split(","))
    assert str(e.value).startswith(f"this Slurm job sees {n} GPU(s) (CUDA_VISIBLE_DEVICES="
                                   f"'{visible}', job 7) but slurm.gpus asks for {gpus}; "), e.value


# ------------------------------------------------------------------ sizes from sinfo

def test_sinfo_of_the_real_cluster(monkeypatch):
    parts, default = sinfo()
    assert default == "debug"
    assert [(n.name, n.gpus) for n in parts["debug"]] == [("vm", 2)]
    assert sorted(n.name for n in parts["pair"]) == ["ddpn1", "ddpn2"]
    assert all(n.cpus > 0 and n.mem_mb > 0 for p in parts.values() for n in p)
    monkeypatch.setenv("PATH", "")
    assert sinfo() is None  # no Slurm here: the fallbacks stand in


def test_sinfo_lines_it_cannot_read_are_left_out():
    parts, default = parse_sinfo("gpu*|g1|16|120000|gpu:4\n"
                                 "gpu|g2|N/A|500000|gpu:4\n"  # a node not responding
                                 "gpu|g3|16\n"
                                 "cpu|c1|8+|64000+|(null)\n")
    assert default == "gpu" and [n.name for n in parts["gpu"]] == ["g1"]
    assert [(n.cpus, n.mem_mb) for n in parts["cpu"]] == [(8, 64000)]


def _one(line: str, **slurm) -> dict:
    """The slurm: section resolved for a partition of one node (its default, unnamed)."""
    found = parse_sinfo(line)
    return resolve(from_dict(tiny_config(NOWHERE,
                                         slurm=slurm)).to_dict(), found)


@pytest.mark.parametrize("line, slurm, want", [
    # shares that do not divide evenly are whole cores and MiB (sbatch takes no fractions)
    ("p*|n|10|30001|gpu:3", {"gpus": 1}, (3, 10000)),
    ("p*|n|12|40000|gpu:1", {"gpus": 1}, (8, 40000)),  # a 1-GPU node: all of it, capped
    ("p*|n|4|64000|gpu:4", {"gpus": 1}, (1, 16000)),  # one core a GPU
    ("p*|n|2|1000|gpu:4", {"gpus": 1}, (1, 256)),  # under a core a GPU: still one; MIN_MEM
    ("p*|n|1|3000|(null)", {"gpus": 0, "cpus": 1}, (None, 3000)),  # a 1-core node's memory
    ("p*|n|0|4000|(null)", {"gpus": 0, "cpus": 1}, (None, 4000)),  # a node listing no cores
    ("p*|n|10|30001|(null)", {"gpus": 0, "cpus": 3}, (None, 9000)),  # 3000 MiB a core
])
def test_sizes_left_open_are_whole_numbers_of_a_node(line, slurm, want):
    s = _one(line, **{"cpus_per_gpu": None, "mem_mb": None, **slurm})
    got = (s["cpus_per_gpu"] if s["gpus"] else None, s["mem_mb"])
    assert got == want and all(type(v) is int for v in got if v is not None), s


def test_without_sinfo_a_cpu_job_gets_whole_mib():
    d = from_dict(tiny_config(NOWHERE,
                              slurm={"gpus": 0, "cpus": 3, "mem_mb": None})).to_dict()
    s = resolve(d, None)
    assert s["mem_mb"] == 12000 and type(s["mem_mb"]) is int, s


SIZES = ("nogpu|n1|32|64000|(null)\n"
         "onegpu|u1|16|64000|gpu:1\n"
         "mixed*|m1|32|256000|gpu:4\n"
         "mixed|m2|64|1000000|gpu:8\n")


def _named(**top) -> dict:
    d = from_dict(tiny_config(NOWHERE, **top)).to_dict()
    return resolve(d, parse_sinfo(SIZES))


def test_gpus_are_judged_only_where_sinfo_lists_some():
    """A partition whose nodes list no GPUs is Slurm's to judge; one whose largest node has
    fewer GPUs than a job asks a node is refused, naming the key that asked."""
    assert _named(slurm={"partition": "nogpu", "gpus": 2})["gpus"] == 2
    with pytest.raises(UserError) as e:
        _named(slurm={"partition": "onegpu", "gpus": 2})
    assert "slurm.gpus asks for 2 GPU(s) per node but the largest node of partition onegpu " \
           "has 1 (u1)" in str(e.value), e.value
    assert _named(slurm={"partition": "onegpu", "gpus": 1})["gpus"] == 1


def test_a_sweeps_gpus_per_trial_is_the_key_named():
    with pytest.raises(UserError) as e:
        _named(slurm={"partition": "mixed", "gpus": 1},
               sweep={"grid": {"seed": [0, 1]}, "gpus_per_trial": 9})
    assert "sweep.gpus_per_trial asks for 9 GPU(s) per node" in str(e.value), e.value
