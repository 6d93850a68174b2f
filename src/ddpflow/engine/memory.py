"""Memory: what a rank holds, and what one training step needs.

    what a rank holds   memory_record: parameters, gradients and optimizer state (this rank's
                        bytes: a shard of each under FSDP, the whole under DDP), activations
                        (activation_meter: what autograd kept for the backward of one
                        micro-batch, counted as it was saved; with activation checkpointing
                        also what it would have kept without), the peak (the GPU allocator's,
                        or the process's resident set on a CPU): summary.json and the report
    what a step needs   step_memory and trial_bytes: one step of a batch on the plain model
                        (an OOM there breaks no DDP collective), with its input pipeline and
                        what the wrapper adds (model_extra); find_max_batch, the search for
                        the largest batch that fits (`ddpflow tune`'s first phase), within
                        memory_budget
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

import torch
from torch import nn

from ddpflow.data.crops import center_crop
from ddpflow.data.loaders import Normalize
from ddpflow.engine import sharding
from ddpflow.engine.runtime import peak_memory_mib
from ddpflow.engine.settings import AMP_DTYPE

# ---------------------------------------------------------------- what a rank holds
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
    "activations" (bytes kept for the backward: saved tensors and the inputs of checkpointed
    blocks, each storage once) and, with checkpointed blocks, "without_checkpointing"."""
    out: dict = {}
    saved = sharding.SavedBytes()
    inputs, remove = sharding.block_inputs(checkpointed)
    sharding.Measure.on, sharding.Measure.kept = bool(checkpointed), {}
    try:
        with saved:
            yield out
    finally:
        sharding.Measure.on = False
        remove()
    # each storage once: a block's input or output that the rest of the model keeps too
    # is the same memory
    out["activations"] = sum({**inputs, **saved.kept}.values())
    if checkpointed:  # what the blocks would have kept, instead of their inputs
        out["without_checkpointing"] = sum({**sharding.Measure.kept, **saved.kept}.values())
    sharding.Measure.kept = {}


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



# ---------------------------------------------------------------- what a step needs
class SimulatedOOM(RuntimeError):
    """A step that would not fit under `--memory-cap-mb` (a cap injected for tests/sharing)."""


def find_max_batch(fits, start: int, limit: int,
                   climb=None) -> tuple[int, list[tuple[int, bool]]]:
    """Largest b in [1, limit] with fits(b), assuming fits is monotone. Doubling from start,
    then bisection between the last fit and the first miss; `climb(b)` False after a fit
    ends the doubling there (throughput stopped improving, or time is up). Returns
    (b, trials)."""
    trials: list[tuple[int, bool]] = []

    def check(b):
        ok = fits(b)
        trials.append((b, ok))
        return ok

    lo, hi = 0, None  # lo fits (0 = nothing yet), hi does not
    b = max(1, min(start, limit))
    while hi is None:
        if check(b):
            lo = b
            if b >= limit or (climb is not None and not climb(b)):
                return b, trials
            b = min(2 * b, limit)
        else:
            hi = b
            if lo == 0 and b > 1:  # even the start did not fit: bisect below it
                lo_try = 1
                if not check(lo_try):
                    return 0, trials
                lo = lo_try
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if check(mid):
            lo = mid
        else:
            hi = mid
    return lo, trials


def is_oom(e: BaseException) -> bool:
    """An allocation failure: torch's OOM, or cuDNN's/cuBLAS's own (a RuntimeError)."""
    return isinstance(e, (torch.cuda.OutOfMemoryError, SimulatedOOM)) or (
        isinstance(e, RuntimeError) and any(k in str(e) for k in (
            "out of memory", "CUDNN_STATUS_ALLOC_FAILED", "CUBLAS_STATUS_ALLOC_FAILED")))


def step_memory(model, x, y, amp_dtype, device) -> int:
    """Peak bytes of one training step: the input batch, forward + backward, and the
    weights' gradients and optimizer state. On a GPU the allocator's reserved peak (what
    fragmentation really takes), not the allocated one."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    batch = x.numel() * x.element_size() + y.numel() * y.element_size()
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_reserved(device)
    saved = sharding.SavedBytes()  # what autograd keeps, each storage once, weights left out
    with saved, torch.autocast(device.type, dtype=amp_dtype,
                                                   enabled=amp_dtype is not None):
        loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    if device.type == "cuda":  # x and y were allocated before base: counted apart
        peak = torch.cuda.max_memory_reserved(device) - base + batch + params * 2
    else:  # CPU: what autograd kept for backward, the batch, weights + grads + momentum
        peak = saved.bytes + batch + params * 3
    model.zero_grad(set_to_none=True)
    return int(peak)



def trial_bytes(p, b: int, precision: str, channels_last: bool) -> int | None:
    """What one step of batch b needs on tune's plain model (`p`: tune.Probe) at this
    precision and layout, its input pipeline and what the wrapper adds included; None where
    it does not fit in the rank's budget."""
    dist = p.dist
    idx = torch.randint(0, len(p.labels), (b,)).numpy()
    try:
        norm = Normalize(p.meta["mean"], p.meta["std"], dist.device, p.in_ch, channels_last)
        # the training crop's size: memory is measured at what the model sees
        x = center_crop(norm(torch.from_numpy(p.images[idx]).to(dist.device)),
                        p.cfg.data.image_size)
        y = torch.from_numpy(p.labels[idx]).to(dist.device)
        model = p.base.to(memory_format=torch.channels_last if channels_last
                          else torch.contiguous_format)
        t0 = time.perf_counter()
        need = (step_memory(model, x, y, AMP_DTYPE[precision], dist.device) + p.extra
                + input_bytes(b, p.meta["image_shape"], p.in_ch, p.cfg.data.image_size))
        p.last_step_s = time.perf_counter() - t0
        if need > p.budget:
            raise SimulatedOOM(f"{need} > {p.budget} bytes")
        return need
    except Exception as e:  # noqa: BLE001 - only allocation failures are answers
        if not is_oom(e):
            raise
        return None
    finally:
        if dist.device.type == "cuda":
            torch.cuda.empty_cache()


def input_bytes(b: int, stored_shape, channels: int, size: int) -> int:
    """What the device loader's input pipeline holds for a batch of b besides the step: the
    gathered uint8 rows, their float copy and its augmented (cropped, flipped) copy."""
    h, w, c = stored_shape
    return b * (h * w * c + 2 * 4 * channels * size * size)


def memory_budget(dist, cap_mb: list[float] | None) -> int:
    """This rank's memory: its --memory-cap-mb (on a GPU the allocator enforces it too, so
    the search meets real OOMs), else the device's free memory now."""
    if cap_mb:
        cap = int(cap_mb[min(dist.rank, len(cap_mb) - 1)] * 2**20)
        if dist.device.type == "cuda":
            total = torch.cuda.get_device_properties(dist.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), dist.device)
        return cap
    if dist.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dist.device)
        return int(free)
    from ddpflow.data.loaders import _available_host_memory

    return _available_host_memory()



def model_extra(base, blocks: list, dist, strategy: str) -> int:
    """Bytes a rank's step needs beyond the plain model's (weights, gradients, one optimizer
    state: what step_memory counts). DDP keeps a second copy of the gradients in
    its buckets; FSDP keeps 1/world of the three, and gathers a block's weights (and its
    gradients before they are reduce-scattered) at a time."""
    def size(m) -> int:
        return sum(q.numel() * q.element_size() for q in m.parameters())
    if strategy == "fsdp":
        biggest = max(map(size, blocks)) if blocks else size(base)
        return int(-3 * size(base) * (1 - 1 / dist.world) + 2 * biggest)
    return size(base) if dist.backend else 0

