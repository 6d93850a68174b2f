"""Share one node between concurrent runs (a sweep's trials): one slot per run.

A pool (`hardware.slots.pool`, a folder) splits this node into equal slots: on a GPU node
each slot is `slots.gpus` GPUs plus an equal share of the CPU cores; on a CPU-only node each
slot is `slots.threads` cores. A launcher takes the first free slot with a non-blocking
`flock` on `<pool>/slot<i>.lock`, before anything else starts, and then narrows itself to
the slot: CUDA_VISIBLE_DEVICES lists the slot's GPUs and the process's CPU affinity its
cores, so torchrun and every rank inherit both. The kernel drops the lock when the launcher
exits, however it exits (SIGKILL included; the torchrun agent follows it through
PR_SET_PDEATHSIG), so a slot is never left taken by a dead run.

Snakemake only counts (`threads:`, `resources: gpu=`); this module picks the ids, so two
runs never share a GPU. Inside a Slurm job the allocation already is the slot: no pool.
Every hold is recorded in `<stage>/slot.json` (slot id, GPUs, cores, times) for the sweep's
leaderboard and for anyone who wants to see which run used which GPU.
"""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ddpflow.core import reading
from ddpflow.core.errors import UserError

POLL_S = 0.2  # seconds between looks for a free slot (a freed slot is taken this fast)


@dataclass(frozen=True)
class Slot:
    index: int
    gpus: tuple[str, ...]  # ids as CUDA_VISIBLE_DEVICES names them (indices or UUIDs)
    cores: tuple[int, ...]  # CPU ids for the affinity mask


def gpu_ids() -> list[str]:
    """This node's GPUs as CUDA_VISIBLE_DEVICES would name them, without importing torch:
    the caller's CUDA_VISIBLE_DEVICES, else NVML, else nvidia-smi, else none."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = []
        for g in visible.split(","):
            g = g.strip()  # "0, 1" names GPU 1, not " 1"
            if not g or g.startswith("-"):
                break  # CUDA stops at the first invalid entry: "0,2,-1,1" shows 0 and 2 only
            ids.append(g)
        return ids
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML library or no driver: ask nvidia-smi, if there is one
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip().isdigit()]


def usable_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def layout(device: str, gpus_per_slot: int, threads_per_slot: int,
           gpus: list[str] | None = None, cores: list[int] | None = None) -> list[Slot]:
    """The node's slots; a UserError when a slot does not fit the node."""
    gpus = gpu_ids() if gpus is None else gpus
    cores = usable_cores() if cores is None else cores
    if device != "cpu" and gpus:
        g = gpus_per_slot
        if g > len(gpus) or len(gpus) % g:
            raise UserError(f"sweep.gpus_per_trial is {g} but this node has {len(gpus)} GPU(s); "
                            f"use a number that divides {len(gpus)} (a GPU left over would "
                            f"idle)")
        n = len(gpus) // g
        per = max(1, len(cores) // n)
        return [Slot(i, tuple(gpus[i * g:(i + 1) * g]),
                     tuple(cores[i * per:(i + 1) * per] or cores)) for i in range(n)]
    t = threads_per_slot
    if t > len(cores):
        raise UserError(f"sweep.threads_per_trial is {t} but this machine has {len(cores)} "
                        f"usable CPU core(s); use at most {len(cores)}")
    return [Slot(i, (), tuple(cores[i * t:(i + 1) * t])) for i in range(len(cores) // t)]


def _take(pool: Path, slots: list[Slot], who: str) -> tuple[Slot, int] | None:
    for slot in slots:
        fd = os.open(pool / f"slot{slot.index}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{who}, pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
        return slot, fd
    return None


def acquire(pool: Path, slots: list[Slot], who: str) -> tuple[Slot, int]:
    """Block until a slot is free; return it and the lock's file descriptor."""
    pool.mkdir(parents=True, exist_ok=True)
    said = False
    while True:
        got = _take(pool, slots, who)
        if got:
            return got
        if not said:
            print(f"ddpflow: {who}: all {len(slots)} slot(s) of {pool} are taken; waiting for "
                  f"one to free up", file=sys.stderr)
            said = True
        time.sleep(POLL_S)


def narrow_to(slot: Slot) -> None:
    """This process (and all it starts) sees only the slot's GPUs and cores."""
    if slot.gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(slot.gpus)
    if slot.cores:
        os.sched_setaffinity(0, slot.cores)


def _record(path: Path, rec: dict) -> None:
    from ddpflow.core.writing import write_json_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, rec)


@contextmanager
def hold(cfg, record: Path, who: str):
    """Hold a slot of cfg's pool for the duration (nothing without a pool or in Slurm)."""
    s = cfg.hardware.slots
    if not s.pool or os.environ.get("SLURM_JOB_ID"):
        yield None
        return
    slots = layout(cfg.hardware.device, s.gpus, s.threads)
    slot, fd = acquire(Path(s.pool), slots, who)
    narrow_to(slot)
    rec = {"slot": slot.index, "slots": len(slots), "gpus": list(slot.gpus),
           "cores": list(slot.cores), "host": socket.gethostname(), "pid": os.getpid(),
           "acquired_at": time.time(), "released_at": None}
    print(f"ddpflow: {who}: slot {slot.index} of {len(slots)} "
          + (f"(GPU {','.join(slot.gpus)})" if slot.gpus else
             f"(CPU cores {','.join(map(str, slot.cores))})"), file=sys.stderr)
    _record(record, rec)
    try:
        yield slot
    finally:
        _record(record, {**rec, "released_at": time.time()})
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


# slot.json: which slot a stage held (the leaderboard's GPU hours; damaged: none recorded)
SLOT_SCHEMA = {"type": "object", "properties": {"gpus": {"type": ["array", "null"]}}}


def read_record(path: Path) -> dict | None:
    return reading.read_json_or_none(path, SLOT_SCHEMA, "slot record")
