"""What one rank's training holds in memory, by kind, for summary.json and the report:
parameters, gradients and optimizer state (this rank's bytes: a shard of each under FSDP,
the whole under DDP), activations (what autograd kept for the backward of one micro-batch,
counted as it was saved; with activation checkpointing also what it would have kept
without), and the peak (the GPU allocator's, or the process's resident set on a CPU).
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

from ddpflow.engine import sharding
from ddpflow.engine.runtime import peak_memory_mib

MIB = 2**20


def rss_mib() -> float:
    """This process's resident set now, MiB (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB
    except (OSError, ValueError, IndexError):
        return 0.0


# the interpreter, torch and its libraries, before any model or data: what a CPU rank's peak
# (its resident set) holds besides training
START_RSS_MIB = rss_mib()


def local_bytes(t: torch.Tensor) -> int:
    """This rank's bytes of a tensor (a DTensor's local shard)."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


def state_bytes(opt) -> int:
    return sum(local_bytes(v) for st in opt.state.values() for v in st.values()
               if torch.is_tensor(v) and v.dim() > 0)


@contextmanager
def activation_meter(checkpointed: list):
    """Counts one micro-batch's activations while active: yields a dict that holds, on exit,
    "activations" (bytes kept for the backward: saved tensors, each storage once, plus the
    inputs of checkpointed blocks) and, with checkpointed blocks, "without_checkpointing"."""
    out: dict = {}
    saved = sharding.SavedBytes()
    inputs, remove = sharding.block_inputs_bytes(checkpointed)
    sharding.Measure.on, sharding.Measure.saved_bytes = bool(checkpointed), 0
    try:
        with saved:
            yield out
    finally:
        sharding.Measure.on = False
        remove()
    out["activations"] = saved.bytes + inputs[0]
    if checkpointed:  # what the blocks would have kept, instead of their inputs
        out["without_checkpointing"] = saved.bytes + sharding.Measure.saved_bytes


def memory_record(model, opt, measured: dict | None, device) -> dict:
    """This rank's memory in MiB (None where not measured: a run of one step)."""
    params = list(model.parameters())
    measured = measured or {}

    def mib(v):
        return None if v is None else round(v / MIB, 2)
    return {"params_mib": mib(sum(map(local_bytes, params))),
            "grads_mib": mib(sum(local_bytes(p) for p in params if p.requires_grad)),
            "optimizer_mib": mib(state_bytes(opt)),
            "activations_mib": mib(measured.get("activations")),
            "activations_without_checkpointing_mib": mib(measured.get(
                "without_checkpointing")),
            "peak_mib": round(peak_memory_mib(device), 1),
            # a CPU's peak is the process's: what it held before the model and data came
            "process_start_mib": round(START_RSS_MIB, 1) if device.type == "cpu" else None}
