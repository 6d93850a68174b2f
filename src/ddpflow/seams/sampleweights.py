"""The sampling weights seam: `data.sampling: weights` draws sample i with probability
w_i / sum(w), w from the user's `data.sample_weights: package.module:callable`, called once
per process as callable(labels) with the training split's labels (a 1-D int64 numpy array
in the split's order; None for a data.source python dataset without `targets`).

What it returns keeps the seam contract's rule for weights (seams/contract.py's words, one
message naming the callable, what it returned and what was expected): one finite number
>= 0 per training sample, some of them > 0. The launcher probes it before any rank starts;
each rank calls it again and the ranks compare what they got (a callable that draws at
random would give each rank other draws).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from ddpflow.core.errors import UserError
from ddpflow.seams.contract import describe
from ddpflow.seams.userimport import add_code_dirs, call, load_callable

SETTING = "data.sample_weights"


def check_weights(w, n: int, name: str) -> np.ndarray:
    """A weights callable's result as float64 [n]: one finite weight >= 0 per training
    sample, some > 0 (a draw needs something to draw); scaled to a largest weight of 1 (the
    same draws, and no sum that overflows)."""
    a = w.detach().cpu().numpy() if isinstance(w, torch.Tensor) else w
    a = np.asarray(a) if isinstance(a, (list, tuple, np.ndarray)) else None
    if a is None or a.ndim != 1 or a.dtype.kind not in "biuf" or len(a) != n:
        raise UserError(f"{name} returned {describe(w)}; expected {n} weights, one per "
                        f"training sample: a list, numpy array or tensor of numbers")
    a = a.astype(np.float64)
    bad = np.flatnonzero(~np.isfinite(a) | (a < 0))
    if len(bad) or not (a > 0).any():
        why = f"weight {bad[0]} = {a[bad[0]]}" if len(bad) else f"all {n} weights 0"
        raise UserError(f"{name} returned {why}; expected one finite weight >= 0 per "
                        f"training sample, some of them > 0")
    return a / a.max()


def sample_weights(cfg, labels, n: int) -> np.ndarray:
    """data.sample_weights(labels), checked: one weight per each of the n training samples."""
    add_code_dirs(cfg)
    spec = cfg.data.sample_weights
    fn = load_callable(spec, SETTING)
    return check_weights(call(fn, SETTING, args=(labels,)), n, f"{SETTING} {spec}")


def agree(weights: np.ndarray, spec: str) -> None:
    """Every rank computed the same weights (a collective where there is a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    mine = hashlib.sha256(np.ascontiguousarray(weights).tobytes()).hexdigest()
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if len(set(every)) > 1:
        other = next(r for r, h in enumerate(every) if h != every[0])
        raise UserError(f"{SETTING} {spec} returned other weights on rank {other} than on "
                        f"rank 0; it must give the same weights every time it is called "
                        f"(seed what it draws at random)")
