"""What a training job asks of Slurm where the config leaves it open, from what the partition's
nodes offer (sinfo): slurm.cpus_per_gpu and slurm.mem_mb null = a GPU's share of the
smallest node of the partition, capped at CAP_CPUS_PER_GPU cores and CAP_MEM_PER_GPU MiB per
GPU. A value the user gives wins, unless no node of a named partition (slurm.partition, or
the profile's, which the workflow puts there) has that much: then one message naming the
key, the node's figure and what to set, before any job is submitted. Without a named
partition (a local run on a machine that has sinfo) nothing is refused.
Without Slurm here (no sinfo: a local run) the fallbacks stand in; nothing asks for them then.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

from ddpflow.config import Config, from_dict
from ddpflow.core.errors import UserError

CAP_CPUS_PER_GPU = 8  # cores per GPU at most (data loading, the Python loop)
CAP_MEM_PER_GPU = 64000  # MiB of host memory per GPU at most
FALLBACK_CPUS_PER_GPU = 4  # without sinfo
FALLBACK_MEM_PER_GPU = 16000
MIN_MEM = 256  # the schema's minimum of slurm.mem_mb
_GPU = re.compile(r"(?:^|,)gpu(?::[^:,(]+)?:(\d+)")


@dataclass(frozen=True)
class Node:
    name: str
    cpus: int
    mem_mb: int  # RealMemory, MiB
    gpus: int  # GPUs of its gres


def gres_gpus(gres: str) -> int:
    """GPUs in an sinfo %G field: gpu:2, gpu:a100:4(S:0-1), gpu:a:2,gpu:b:2 -> 2, 4, 4."""
    return sum(int(n) for n in _GPU.findall(gres.strip()))


def parse_sinfo(text: str) -> tuple[dict[str, list[Node]], str | None]:
    """`sinfo -h -N -o %P|%N|%c|%m|%G` -> the nodes of each partition, and the default one."""
    parts: dict[str, list[Node]] = {}
    default = None
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 5:
            continue
        part, name, cpus, mem, gres = fields
        if part.endswith("*"):
            part = default = part[:-1]
        try:
            node = Node(name, int(cpus.rstrip("+")), int(mem.rstrip("+")), gres_gpus(gres))
        except ValueError:
            continue
        parts.setdefault(part, []).append(node)
    return parts, default


def sinfo() -> tuple[dict[str, list[Node]], str | None] | None:
    """The cluster's partitions as sinfo lists them, or None without a reachable Slurm."""
    try:
        r = subprocess.run(["sinfo", "-h", "-N", "-o", "%P|%N|%c|%m|%G"],
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    if r.returncode:
        return None
    parts, default = parse_sinfo(r.stdout)
    return (parts, default) if parts else None


def per_node_gpus(d: dict) -> int:
    """GPUs a training job asks of each node, for a resolved config dict: slurm.gres is per
    node, slurm.gpus (sent as --gpus) the job's total; a sweep's jobs are its trials, each
    with sweep.gpus_per_trial."""
    s, nodes = d["slurm"], d["hardware"]["nodes"]
    gpus = s["gpus"]
    if gpus and any(d["sweep"].get(k) for k in ("grid", "variants", "random")):
        gpus = d["sweep"]["gpus_per_trial"]
    if s["gres"] or not gpus:
        return gpus
    return -(-gpus // nodes)


def resolve(d: dict, found: tuple[dict[str, list[Node]], str | None] | None | str = "ask"
            ) -> dict:
    """d's slurm: section with cpus_per_gpu and mem_mb filled in (null = a GPU's share of a
    node of the partition); a request larger than every node of the partition is refused.
    found: sinfo's answer ("ask": ask it; None: no Slurm here)."""
    s = dict(d["slurm"])
    per_node = per_node_gpus(d)
    found = sinfo() if found == "ask" else found
    nodes = _partition_nodes(s["partition"], found)
    if not nodes:
        cpus_gpu, mem_gpu = FALLBACK_CPUS_PER_GPU, FALLBACK_MEM_PER_GPU
        cpu_share = FALLBACK_MEM_PER_GPU // FALLBACK_CPUS_PER_GPU
    else:
        if s["partition"]:  # named (by the config, or the workflow from the profile)
            _check_fits(s, per_node, nodes, s["partition"], _gpu_key(d))
        cpus_gpu = min(n.cpus // max(n.gpus, per_node, 1) for n in nodes)
        mem_gpu = min(n.mem_mb // max(n.gpus, per_node, 1) for n in nodes)
        cpu_share = min(n.mem_mb // max(n.cpus, 1) for n in nodes)
    if s["cpus_per_gpu"] is None:
        s["cpus_per_gpu"] = max(1, min(CAP_CPUS_PER_GPU, cpus_gpu))
    if s["mem_mb"] is None:
        if per_node:
            s["mem_mb"] = max(MIN_MEM, min(CAP_MEM_PER_GPU, mem_gpu) * per_node)
        else:  # a CPU-only job: its cores' share of the node's memory
            s["mem_mb"] = max(MIN_MEM, min(CAP_MEM_PER_GPU, cpu_share * s["cpus"]))
    return s


def resolved(cfg: Config) -> Config:
    """The config with its slurm: sizes filled in (what the workflow's jobs then read)."""
    d = cfg.to_dict()
    return from_dict({**d, "slurm": resolve(d)})


def _partition_nodes(partition: str | None, found) -> list[Node]:
    """The nodes of slurm.partition (several, with commas: all of them), else of the
    cluster's default partition; none when sinfo is absent or does not list it."""
    if not found:
        return []
    parts, default = found
    names = partition.split(",") if partition else [default] if default else []
    return [n for p in names for n in parts.get(p, [])]


def _gpu_key(d: dict) -> str:
    """The setting that sets a job's GPUs per node (per_node_gpus), for a message."""
    if d["slurm"]["gpus"] and any(d["sweep"].get(k) for k in ("grid", "variants", "random")):
        return "sweep.gpus_per_trial"
    if d["slurm"]["gres"]:
        return "slurm.gres"
    return "slurm.gpus"


def _check_fits(s: dict, per_node: int, nodes: list[Node], part: str,
                gpu_key: str = "slurm.gpus") -> None:
    """One message for a value no node of the partition has room for (sbatch would refuse
    it: 'Requested node configuration is not available'). GPUs only where sinfo lists some
    (a partition without GPUs is Slurm's to judge)."""
    gpu_node = max(nodes, key=lambda n: n.gpus)
    if per_node and 0 < gpu_node.gpus < per_node:
        raise UserError(f"invalid config: {gpu_key} asks for {per_node} GPU(s) per node but "
                        f"the largest node of partition {part} has {gpu_node.gpus} "
                        f"({gpu_node.name}); ask for at most {gpu_node.gpus} GPU(s) a node")
    big = max(nodes, key=lambda n: (n.mem_mb, n.cpus))
    if s["mem_mb"] is not None and s["mem_mb"] > max(n.mem_mb for n in nodes):
        raise UserError(f"invalid config: slurm.mem_mb is {s['mem_mb']} MiB but the largest "
                        f"node of partition {part} has {big.mem_mb} MiB ({big.name}); set "
                        f"slurm.mem_mb to at most {big.mem_mb}, or null for a GPU's share of "
                        f"a node")
    most = max(n.cpus for n in nodes)
    if per_node and s["cpus_per_gpu"] is not None and s["cpus_per_gpu"] * per_node > most:
        raise UserError(f"invalid config: slurm.cpus_per_gpu {s['cpus_per_gpu']} x "
                        f"{per_node} GPU(s) per node is {s['cpus_per_gpu'] * per_node} cores "
                        f"but the largest node of partition {part} has {most}; set "
                        f"slurm.cpus_per_gpu to at most {max(1, most // per_node)}, or null "
                        f"for a GPU's share of a node")
    if not per_node and s["cpus"] > most:
        raise UserError(f"invalid config: slurm.cpus is {s['cpus']} but the largest node of "
                        f"partition {part} has {most} cores; set slurm.cpus to at most {most}")
