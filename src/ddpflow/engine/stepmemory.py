"""How much memory one training step needs, and the search for the largest batch that fits
(`ddpflow tune`'s first phase; tune.py runs it)."""

from __future__ import annotations

import torch
from torch import nn

from ddpflow.engine.sharding import SavedBytes


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
    saved = SavedBytes()  # what autograd keeps, each storage once, weights left out
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


def input_bytes(b: int, stored_shape, channels: int, size: int) -> int:
    """What the device loader's input pipeline holds for a batch of b besides the step: the
    gathered uint8 rows, their float copy and its augmented (cropped, flipped) copy."""
    h, w, c = stored_shape
    return b * (h * w * c + 2 * 4 * channels * size * size)


def memory_budget(d, cap_mb: list[float] | None) -> int:
    """This rank's memory: its --memory-cap-mb (on a GPU the allocator enforces it too, so
    the search meets real OOMs), else the device's free memory now."""
    if cap_mb:
        cap = int(cap_mb[min(d.rank, len(cap_mb) - 1)] * 2**20)
        if d.device.type == "cuda":
            total = torch.cuda.get_device_properties(d.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), d.device)
        return cap
    if d.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(d.device)
        return int(free)
    from ddpflow.data.loaders import _available_host_memory

    return _available_host_memory()
