"""Stages on several nodes of a Slurm allocation: the node list, one srun that starts a
torchrun on each node behind a roll call (rollcall.py), and what to say when a node is missing.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from ddpflow.config import Config
from ddpflow.core.errors import UserError
from ddpflow.launch import rollcall


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def srun_command(cfg: Config, n: int, resolved: Path, restarts: str, train: list) -> list:
    """One srun step with one torchrun per node (n ranks each), meeting at a c10d rendezvous
    on the first node of the allocation (where this launcher runs). Each node first answers
    a roll call, so a node that cannot join is named instead of waited for."""
    nodes, hw = cfg.hardware.nodes, cfg.hardware
    hosts = slurm_hosts()
    if len(hosts) < nodes:
        raise UserError(f"hardware.nodes is {nodes} but the Slurm allocation has "
                        f"{len(hosts)} node(s); submit with --nodes={nodes} "
                        f"(slurm resource nodes) or lower hardware.nodes")
    job = os.environ.get("SLURM_JOB_ID", "ddpflow")
    port = hw.rdzv_port or free_port()
    cmd = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1",
           *step_resources(cfg), "--kill-on-bad-exit=1", sys.executable, "-m",
           "ddpflow.launch.rollcall", str(roll_call_dir(resolved)), hosts[0], str(port),
           str(hw.timeout_s), "--",
           sys.executable, "-m", "torch.distributed.run",
           f"--nnodes={nodes}", f"--nproc-per-node={n}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint={hosts[0]}:{port}", f"--rdzv-id={job}",
           f"--rdzv-conf=join_timeout={hw.timeout_s}", restarts, *train]
    return cmd


def step_resources(cfg: Config) -> list[str]:
    """The srun step's CPUs (and GPUs) on each node, asked for explicitly: since Slurm 22.05
    srun no longer takes --cpus-per-task from the batch job, so a node's torchrun and all its
    ranks could end up on one core. What the job holds on each node (scontrol), else what
    the config's slurm: section asks for."""
    held = _job_per_node(_job_fields(os.environ.get("SLURM_JOB_ID")))
    if held is None:
        s, nodes = cfg.slurm, cfg.hardware.nodes
        gpus = (s.gpus if s.gres else -(-s.gpus // nodes)) if s.gpus else 0
        held = ((s.cpus_per_gpu or 1) * gpus if gpus else s.cpus), gpus
    cpus, gpus = held
    return [f"--cpus-per-task={max(1, cpus)}", *([f"--gres=gpu:{gpus}"] if gpus else [])]


def _job_per_node(fields: dict[str, str]) -> tuple[int, int] | None:
    """(CPUs, GPUs) a running job holds on each of its nodes, from its TRES (cpu=4,node=2,
    gres/gpu=4 -> 2 CPUs and 2 GPUs a node); None when that is not known."""
    tres = dict(kv.split("=", 1) for kv in fields.get("TRES", "").split(",") if "=" in kv)
    try:
        nodes, cpus = int(tres["node"]), int(tres["cpu"])
        gpus = int(tres.get("gres/gpu", "0"))
    except (KeyError, ValueError):
        return None
    return (cpus // nodes, gpus // nodes) if nodes > 0 else None


def roll_call_dir(resolved: Path) -> Path:
    """Where the nodes of a several-node stage (or tuning) answer the roll call."""
    return Path(resolved).parent / "nodes"


def missing_nodes_text(cfg: Config, folder: Path) -> str | None:
    """After a failed several-node run: which nodes never joined its rendezvous, or None."""
    if cfg.hardware.nodes == 1:
        return None
    try:
        hosts = slurm_hosts()[: cfg.hardware.nodes]
    except UserError:
        return None
    gone = rollcall.missing(roll_call_dir(folder / "config.json"), hosts)
    if not gone:
        return None
    return (f"{len(gone)} of {len(hosts)} node(s) never joined the rendezvous on {hosts[0]} "
            f"within hardware.timeout_s ({cfg.hardware.timeout_s} s): {', '.join(gone)}; "
            f"check that node (sinfo -N, its slurmd log) and that it can reach {hosts[0]} "
            f"on the rendezvous port (set hardware.rdzv_port to one the firewall allows)")


def slurm_hosts() -> list[str]:
    """Host names of the current Slurm allocation, first = rendezvous host."""
    nodelist = (os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
                or _job_nodelist(os.environ.get("SLURM_JOB_ID")))
    if not nodelist:
        raise UserError("hardware.nodes > 1 runs inside a Slurm allocation of that many "
                        "nodes (no SLURM_JOB_NODELIST here); use --profile profiles/slurm "
                        "or sbatch --nodes=N, see docs/slurm.md")
    try:
        r = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                           text=True, check=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        raise UserError(f"cannot expand the Slurm node list '{nodelist}' with scontrol ({e})"
                        ) from None
    hosts = r.stdout.split()
    # scontrol exits 0 on a list it cannot read, saying so on stderr only, and expands an
    # unclosed range ('n[1-2') to a bracket ('n]'): no host name holds one
    if not hosts or any("[" in h or "]" in h for h in hosts):
        why = r.stderr.strip().splitlines()[-1:] or [f"it expands to {' '.join(hosts)!r}"]
        raise UserError(f"cannot expand the Slurm node list '{nodelist}' with scontrol "
                        f"({why[0]})")
    return hosts


def _job_nodelist(job: str | None) -> str | None:
    """The node list of a job, asked of Slurm: Snakemake's Slurm job step keeps only
    SLURM_JOB_ID of the allocation's variables in the environment it runs a rule in."""
    nodelist = _job_fields(job).get("NodeList")
    return nodelist if nodelist and nodelist != "(null)" else None


def _job_fields(job: str | None) -> dict[str, str]:
    """`scontrol show job -o <job>` as name -> value; empty when there is no such job."""
    if not job:
        return {}
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True,
                             text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


def check_slurm_gpus(cfg: Config) -> None:
    """In a Slurm job that asked for GPUs, the GPUs this launcher sees must be the GPUs the
    stage asked for: fewer means the job was split into one task per GPU (an executor
    plugin adding --ntasks-per-gpu) or a --set-resources override; training on them would
    quietly run a different job than the config says."""
    from ddpflow.launch.slots import gpu_ids

    want = cfg.slurm.gpus
    if not os.environ.get("SLURM_JOB_ID") or want == 0 or cfg.hardware.nodes > 1:
        return
    seen = gpu_ids()
    if len(seen) != want:
        raise UserError(f"this Slurm job sees {len(seen)} GPU(s) (CUDA_VISIBLE_DEVICES="
                        f"{os.environ.get('CUDA_VISIBLE_DEVICES', '')!r}, job "
                        f"{os.environ['SLURM_JOB_ID']}) but slurm.gpus asks for {want}; "
                        f"request the GPUs as one task (snakemake-executor-plugin-slurm >= "
                        f"2.7.1, resource tasks_per_gpu=0, as the workflow does) or set "
                        f"slurm.gpus to what the job gets")
