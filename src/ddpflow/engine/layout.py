"""`channels_last: auto`: the memory layout a stage trains in.

NHWC ("channels_last") is the layout that cuDNN's tensor-core convolutions and oneDNN's CPU
convolutions prefer; a model without 2-D convolutions gains nothing from it. The gain varies
with the layers and the device (timm's ResNet-50 AMP training on a GPU: 1.47x; 3-40% on this
project's CPUs, and some layers are slower), and a model may not run in it at all (a
`.view` on a feature map that channels_last makes non-contiguous raises). So on every
device, GPU or CPU, a probe of this very model decides: forward + backward of a batch of
the stage's own size in each layout, the best of three each (the GPU synchronised before
each clock reading). A model whose channels_last pass raises trains in NCHW, and the reason
names the error. Every rank takes rank 0's answer: DDP's gradient buckets need one layout
on all ranks.

A timing can come out either way when the two are close, and the layout changes the
arithmetic's order. So channels_last must win by 5% (NCHW, PyTorch's default, otherwise),
and a probe's answer is kept (per model, precision, input shape, threads, host and device)
in <run>/layout.json, which every later process of the run takes it from (a resume, the
next stage, a re-run), and in the user's cache (~/.cache/ddpflow/layout.json, or under
$XDG_CACHE_HOME), which later runs on this machine take it from: the same config trains the
same way on the same machine. Delete that file to probe again. Deterministic mode times
nothing: a model with 2-D convolutions trains in channels_last when one pass of it runs in
that layout (NCHW when it raises).
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
from ddpflow.engine.settings import mixed_precision
from ddpflow.seams.models import forward


def has_conv2d(model: nn.Module) -> bool:
    return any(isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)) for m in model.modules())


def _step_seconds(model: nn.Module, x: torch.Tensor, autocast, reps: int = 3) -> float | None:
    """Best of `reps` forward + backward passes (after one warm-up), or None when the
    model's output is not a tensor (nothing simple to backpropagate). On a GPU the clock
    is read after a synchronize: kernels run asynchronously."""
    best = float("inf")
    for i in range(reps + 1):
        _sync(x.device)
        t0 = time.perf_counter()
        with autocast:
            out = forward(model, x)
        if not isinstance(out, torch.Tensor):
            return None
        out.float().sum().backward()
        model.zero_grad(set_to_none=True)
        _sync(x.device)
        if i or not reps:  # reps 0: the one pass (deterministic mode: does it run?)
            best = min(best, time.perf_counter() - t0)
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def probe(model: nn.Module, shape: tuple[int, ...], autocast, device: torch.device,
          reps: int = 3) -> dict | None:
    """{"nchw_s", "channels_last_s", "channels_last_error", "batch"} of the plain model on a
    random batch of `shape` (seconds per step in each layout; channels_last_s None and the
    error's first line when the model raises in channels_last), or None when its output is
    not a tensor. The model is left as it was (layout, statistics, random stream, grads)."""
    out = {"batch": shape[0], "channels_last_error": None}
    with untouched(model):  # the batch's draw too: a probe leaves the random stream as it was
        x = torch.randn(shape, device=device)
        out["nchw_s"] = _step_seconds(model, x, autocast, reps)
        model.to(memory_format=torch.channels_last)
        try:
            out["channels_last_s"] = _step_seconds(
                model, x.contiguous(memory_format=torch.channels_last), autocast, reps)
        except RuntimeError as e:  # e.g. `.view` on a feature map that is not contiguous
            out["channels_last_s"] = None
            out["channels_last_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        finally:
            model.to(memory_format=torch.contiguous_format)
            model.zero_grad(set_to_none=True)
    if out["nchw_s"] is None or (out["channels_last_s"] is None
                                 and not out["channels_last_error"]):
        return None
    return out


def decide(setting, model: nn.Module, dist: distributed.Dist, shape: tuple[int, ...], autocast,
           deterministic: bool, cache: Path, key: dict) -> tuple[bool, str]:
    """(channels_last on, why) for the stage's setting: true, false or auto. The same path
    on every device: no device type turns channels_last on without running the model."""
    if setting != "auto":
        return bool(setting), f"channels_last: {str(bool(setting)).lower()} in the config"
    if not has_conv2d(model):
        return False, "auto: the model has no 2-D convolution"
    name = json.dumps({**key, "shape": list(shape), "threads": torch.get_num_threads(),
                       "host": socket.gethostname(), "device": device_name(dist.device),
                       "timed": not deterministic}, sort_keys=True)
    # rank 0 alone looks, probes and writes; every rank then takes its answer (one
    # collective on every rank, whatever another node's caches hold)
    kept = _rank0_answer(name, (cache, user_cache()), model, shape, autocast, dist.device,
                         0 if deterministic else 3) if dist.is_master else None
    kept = distributed.broadcast_object(dist, kept)
    where = (f"on this CPU at batch {shape[0]}" if dist.device.type != "cuda" else
             f"on this GPU ({device_name(dist.device)}) at batch {shape[0]}")
    if not kept:
        return False, "auto: the model's output is not a tensor, so no probe; NCHW"
    if kept.get("channels_last_error"):
        return False, (f"auto: the model fails in channels_last (a probe {where}: "
                       f"{kept['channels_last_error']}); NCHW")
    if deterministic:  # one pass ran in channels_last; nothing timed
        return True, "auto: 2-D convolutions (deterministic mode: no timing probe)"
    ratio = kept["nchw_s"] / max(kept["channels_last_s"], 1e-12)
    return ratio >= MARGIN, (f"auto: a probe {where}, channels_last at {ratio:.2f}x the "
                             f"speed of NCHW (kept in layout.json)")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def _rank0_answer(name: str, caches: tuple[Path, Path], model, shape, autocast, device,
                  reps: int = 3):
    """The kept probe for `name` (the run folder's first, then the user's), or a new probe;
    written to whichever cache lacked it."""
    found = [_read(c).get(name) for c in caches]
    kept = next((k for k in found if k is not None), None)
    if kept is None:
        kept = probe(model, shape, autocast, device, reps)
    for c, had in zip(caches, found):
        if had is None:
            _write(c, name, kept)
    return kept


def for_stage(setting, cfg, model: nn.Module, dist, batch_size: int, in_ch: int | None,
              precision: str) -> tuple[bool, str]:
    """decide() for a training stage's plain `model` (setting: the stage's channels_last,
    true/false/"auto"): (on, why). The caller's data pipeline follows the answer. The probe
    runs at `batch_size`, this rank's batch: what the stage's steps will run."""
    size = cfg.data.image_size
    if setting == "auto" and not in_ch:
        return False, "auto: the inputs are not images"
    return decide(setting, model, dist, (batch_size, in_ch, size, size),
                  mixed_precision(precision, dist.device)[1], cfg.deterministic,
                  cfg.run_dir / "layout.json",
                  {"model": cfg.model.name, "kwargs": cfg.model.kwargs, "precision": precision})


def channels_last_inputs(model: nn.Module) -> None:
    """The model (trained in channels_last) takes its 4-D input in channels_last: a device
    crop that resamples (data.crops.center_crop) hands back a new NCHW tensor, and the first
    convolution would convert it at every step. A no-op for an input already in it."""
    model.register_forward_pre_hook(_to_channels_last)


def _to_channels_last(_module, args):
    if args and isinstance(args[0], torch.Tensor) and args[0].dim() == 4:
        return (args[0].contiguous(memory_format=torch.channels_last), *args[1:])
    return None


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
_KEPT = {"type": "object", "required": ["nchw_s", "channels_last_s"],
         "properties": {"nchw_s": _SECONDS, "batch": {"type": "integer", "minimum": 1},
                        "channels_last_s": {"anyOf": [_SECONDS, {"type": "null"}]},
                        "channels_last_error": {"type": ["string", "null"]}}}
# layout.json: a cache of measurements (missing or damaged: measured again and rewritten)
LAYOUT_SCHEMA = {"type": "object", "additionalProperties": {
    "anyOf": [{"type": "null"}, _KEPT]}}


def _read(path: Path) -> dict:
    return reading.read_json_or_none(path, LAYOUT_SCHEMA, "layout cache") or {}
