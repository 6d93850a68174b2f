"""`channels_last: auto`: the memory layout a stage trains in.

NHWC ("channels_last") is the layout that cuDNN's tensor-core convolutions and oneDNN's CPU
convolutions prefer; a model without 2-D convolutions gains nothing from it. On a GPU a
model with 2-D convolutions gets it (timm's published ResNet-50 AMP training: 1.47x). On a
CPU the gain varies with the layers (3-40% in this project's runs, and some layers are
slower), so a quick probe of this very model decides: forward + backward of a small batch in
each layout, the best of three each. Every rank takes rank 0's answer: DDP's gradient
buckets need one layout on all ranks.

A timing can come out either way when the two are close, and the layout changes the
arithmetic's order. So channels_last must win by 5% (NCHW, PyTorch's default, otherwise),
and a probe's answer is kept (per model, precision, input shape, threads and host) in
<run>/layout.json, which every later process of the run takes it from (a resume, the next
stage, a re-run), and in the user's cache (~/.cache/ddpflow/layout.json, or under
$XDG_CACHE_HOME), which later runs on this machine take it from: the same config trains the
same way on the same machine. Delete that file to probe again. Deterministic mode never
probes: a model with 2-D convolutions trains in channels_last on every device.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import torch
from torch import nn

from ddpflow.core import reading
from ddpflow.core.writing import write_json_atomic
from ddpflow.engine import distributed
from ddpflow.engine.efficiency import untouched
from ddpflow.engine.runtime import mixed_precision
from ddpflow.seams.models import forward


def has_conv2d(model: nn.Module) -> bool:
    return any(isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)) for m in model.modules())


def _step_seconds(model: nn.Module, x: torch.Tensor, autocast, reps: int = 3) -> float | None:
    """Best of `reps` forward + backward passes (after one warm-up), or None when the
    model's output is not a tensor (nothing simple to backpropagate)."""
    best = float("inf")
    for i in range(reps + 1):
        t0 = time.perf_counter()
        with autocast:
            out = forward(model, x)
        if not isinstance(out, torch.Tensor):
            return None
        out.float().sum().backward()
        model.zero_grad(set_to_none=True)
        if i:
            best = min(best, time.perf_counter() - t0)
    return best


def probe(model: nn.Module, shape: tuple[int, ...], autocast,
          device: torch.device) -> tuple[float, float] | None:
    """(seconds per step in NCHW, in channels_last) of the plain model on a random batch;
    the model is left as it was (layout, statistics, random stream, gradients)."""
    x = torch.randn(shape, device=device)
    with untouched(model):
        nchw = _step_seconds(model, x, autocast)
        model.to(memory_format=torch.channels_last)
        nhwc = _step_seconds(model, x.contiguous(memory_format=torch.channels_last), autocast)
        model.to(memory_format=torch.contiguous_format)
    return None if nchw is None or nhwc is None else (nchw, nhwc)


def decide(setting, model: nn.Module, d: distributed.Dist, shape: tuple[int, ...], autocast,
           deterministic: bool, cache: Path, key: dict) -> tuple[bool, str]:
    """(channels_last on, why) for the stage's setting: true, false or auto."""
    if setting != "auto":
        return bool(setting), f"channels_last: {str(bool(setting)).lower()} in the config"
    if not has_conv2d(model):
        return False, "auto: the model has no 2-D convolution"
    if d.device.type == "cuda":
        return True, "auto: 2-D convolutions on a GPU"
    if deterministic:
        return True, "auto: 2-D convolutions (deterministic mode: no timing probe)"
    name = json.dumps({**key, "shape": list(shape), "threads": torch.get_num_threads(),
                       "host": socket.gethostname()}, sort_keys=True)
    # rank 0 alone looks, probes and writes; every rank then takes its answer (one
    # collective on every rank, whatever another node's caches hold)
    kept = _rank0_answer(name, (cache, user_cache()), model, shape, autocast,
                         d.device) if d.is_master else None
    kept = distributed.broadcast_object(d, kept)
    if not kept:
        return False, "auto: the model's output is not a tensor, so no probe; NCHW"
    ratio = kept["nchw_s"] / kept["channels_last_s"]
    return ratio >= MARGIN, (f"auto: a probe on this CPU, channels_last at {ratio:.2f}x the "
                             f"speed of NCHW (kept in layout.json)")


def _rank0_answer(name: str, caches: tuple[Path, Path], model, shape, autocast, device):
    """The kept probe for `name` (the run folder's first, then the user's), or a new probe;
    written to whichever cache lacked it."""
    found = [_read(c).get(name) for c in caches]
    kept = next((k for k in found if k is not None), None)
    if kept is None:
        times = probe(model, shape, autocast, device)
        kept = times and {"nchw_s": times[0], "channels_last_s": times[1]}
    for c, had in zip(caches, found):
        if had is None:
            _write(c, name, kept)
    return kept


def for_stage(setting, cfg, model: nn.Module, d, batch_size: int, in_ch: int | None,
              precision: str) -> tuple[bool, str]:
    """decide() for a training stage's plain `model` (setting: the stage's channels_last,
    true/false/"auto"): (on, why). The caller's data pipeline follows the answer."""
    size = cfg.data.image_size
    if setting == "auto" and not in_ch:
        return False, "auto: the inputs are not images"
    return decide(setting, model, d, (min(batch_size, 16), in_ch, size, size),
                  mixed_precision(precision, d.device)[1], cfg.deterministic,
                  cfg.run_dir / "layout.json",
                  {"model": cfg.model.name, "kwargs": cfg.model.kwargs, "precision": precision})


MARGIN = 1.05  # channels_last must be this much faster than NCHW to be chosen


def user_cache() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "ddpflow" / "layout.json"


def _write(path: Path, name: str, kept) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {**_read(path), name: kept})
    except OSError:  # a read-only home: the run folder's copy still holds
        pass


_SECONDS = {"type": "number", "minimum": 0}
# layout.json: a cache of measurements (missing or damaged: measured again and rewritten)
LAYOUT_SCHEMA = {"type": "object", "additionalProperties": {
    "anyOf": [{"type": "null"}, {"type": "object", "required": ["nchw_s", "channels_last_s"],
                                 "properties": {"nchw_s": _SECONDS,
                                                "channels_last_s": _SECONDS}}]}}


def _read(path: Path) -> dict:
    return reading.read_json_or_none(path, LAYOUT_SCHEMA, "layout cache") or {}
