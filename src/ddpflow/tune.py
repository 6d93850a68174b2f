"""`ddpflow tune`: measure this node, then choose batch size, input pipeline and precision.

Runs on every rank under torchrun, like training (`ddpflow tune` builds the line):
  1. batch size: the largest per-GPU batch whose training step fits in device memory with
     `tune.memory_margin` to spare (doubling, then bisection; an out-of-memory error is a
     "does not fit"). Trial steps run on the plain model, so no DDP collective is ever left
     half-done by an OOM; the ranks then agree on the smallest maximum (all-reduce MIN).
     Among the powers of two up to that maximum (and the maximum), the batch with the best
     measured throughput of real DDP steps wins: not simply the largest.
  2. input pipeline: the device loader vs DataLoader settings (workers, prefetch, pinning),
     by measured throughput of real steps (the data-wait share is recorded too).
  3. precision and layout: fp32/TF32, bf16, fp16; channels_last; torch.compile if asked.
The choices are greedy, one after the other. Every measurement and the choice go into
<run>/tune.json; stages with batch_size: auto, precision: auto and data.loader: auto use it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from . import distributed
from .config import Config, StageCfg
from .data import prepared
from .data.crops import center_crop
from .data.loaders import Normalize, TrainBatches, forever
from .data.prepare import settings_fingerprint
from .data.prepared import write_json_atomic
from .errors import UserError
from .models import build_model, input_channels
from .runtime import build_optimizer, pick_precision


class SimulatedOOM(RuntimeError):
    """A step that would not fit under `--memory-cap-mb` (a cap injected for tests/sharing)."""


def tune_path(cfg: Config) -> Path:
    return cfg.run_dir / "tune.json"


def tune_settings(cfg: Config, st: StageCfg) -> dict:
    """What a measurement depends on besides the choices it makes: a stage with other
    settings must not take a tune.json measured for these."""
    hw = cfg.hardware
    return {"model.name": cfg.model.name, "data": settings_fingerprint(cfg),
            "data.augment": dataclasses.asdict(cfg.data.augment),
            "hardware": [hw.device, hw.nproc_per_node, hw.devices, hw.threads_per_rank,
                         hw.nodes],
            "optimizer": st.optimizer, "strategy": st.strategy,
            "grad_accum_steps": st.grad_accum_steps}


def load_choice(cfg: Config, st: StageCfg) -> tuple[dict | None, str | None]:
    """(tune.json's choice, None) when it was measured for this stage's settings;
    (None, why not) when it exists but was measured for others; (None, None) without one."""
    try:
        t = json.loads(tune_path(cfg).read_text())
        choice = t["choice"]
    except (OSError, ValueError, KeyError, TypeError):
        return None, None
    want = tune_settings(cfg, st)
    got = t.get("settings") or {}
    differ = [k for k in want if got.get(k) != want[k]]
    if differ:
        return None, (f"{tune_path(cfg)} was measured for other settings "
                      f"({', '.join(differ)}); run `ddpflow tune` again")
    return choice, None


@dataclasses.dataclass
class StageSettings:
    batch_size: int  # per rank
    precision: str  # bf16 | fp16 | fp32
    channels_last: bool
    compile: bool
    tuned: dict | None  # tune.json's choice when it was used


def stage_settings(cfg: Config, st: StageCfg, device, say) -> StageSettings:
    """The stage's batch size, precision and layout: its own, or tune.json's for "auto"."""
    tuned, mismatch = load_choice(cfg, st)
    batch = st.batch_size
    if batch == "auto":
        if tuned is None:
            raise UserError(f"stages.{cfg.stage_index(st.name)}.batch_size is auto but "
                            + (mismatch or f"there is no {tune_path(cfg)}; run `ddpflow tune` "
                               f"first"))
        batch = tuned["batch_size"]
    out = StageSettings(batch, st.precision, st.channels_last, st.compile, tuned)
    if st.precision == "auto" and tuned:
        out.precision, out.channels_last = tuned["precision"], tuned["channels_last"]
        out.compile = out.compile or tuned["compile"]
    else:
        out.precision = pick_precision(st.precision, device)
    if device.type == "cuda" and out.precision == "fp32":
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 tensor cores for fp32
        torch.backends.cudnn.allow_tf32 = True
    if mismatch:
        say(f"not using tune.json: {mismatch}")
    return out


def find_max_batch(fits, start: int, limit: int) -> tuple[int, list[tuple[int, bool]]]:
    """Largest b in [1, limit] with fits(b), assuming fits is monotone. Doubling from start,
    then bisection between the last fit and the first miss. Returns (b, trials)."""
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
            if b >= limit:
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


def _saved_bytes_hooks(counter: list[int]):
    def pack(t):
        counter[0] += t.numel() * t.element_size()
        return t
    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def step_memory(model, x, y, amp_dtype, device) -> int:
    """Peak bytes of one forward + backward (plus weights, gradients, optimizer state)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    saved = [0]
    with _saved_bytes_hooks(saved), torch.autocast(device.type, dtype=amp_dtype,
                                                   enabled=amp_dtype is not None):
        loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - base + params * 3
    else:  # CPU: what autograd kept for backward, the batch, weights + grads + momentum
        peak = saved[0] + x.numel() * x.element_size() + params * 3
    model.zero_grad(set_to_none=True)
    return int(peak)


def _budget(d, cap_mb: list[float] | None) -> int:
    if cap_mb:
        return int(cap_mb[min(d.rank, len(cap_mb) - 1)] * 2**20)
    if d.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(d.device)
        return int(free)
    from .data.loaders import _available_host_memory

    return _available_host_memory()


def _all_min(d, value: int) -> int:
    if not d.backend:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def _throughput(model, batches, steps, amp_dtype, device, opt) -> tuple[float, float]:
    """(samples/s, data-wait share) over `steps` DDP training steps after 2 warm-up steps."""
    it = batches
    crit = nn.CrossEntropyLoss()
    wait = 0.0
    n = 0
    for i in range(steps + 2):
        if i == 2:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0, wait, n = time.perf_counter(), 0.0, 0
        tw = time.perf_counter()
        x, y = next(it)
        wait += time.perf_counter() - tw
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = crit(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        n += len(y)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # sync point: the timed steps have really run
    dt = time.perf_counter() - t0
    return n / dt, wait / dt


def run(cfg: Config, stage_name: str, cap_mb: list[float] | None = None) -> dict:
    st: StageCfg = cfg.stage(stage_name)
    tc = cfg.tune
    d = distributed.setup(cfg.hardware)
    distributed.seed_everything(cfg.seed, d.rank, deterministic=False)
    meta, arrays = prepared.load(cfg.data_dir)
    images, labels = arrays["train"]
    in_ch = input_channels(cfg.model.name, meta["image_shape"][2])

    precision = pick_precision("auto" if st.precision == "auto" else st.precision, d.device)
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}
    base = build_model(cfg.model, meta["num_classes"], in_ch).to(d.device)
    budget = int(_budget(d, cap_mb) * (1 - tc.memory_margin))
    # DDP keeps a second copy of the gradients in its buckets
    ddp_extra = sum(p.numel() * p.element_size() for p in base.parameters()) if d.backend else 0
    memory: dict[int, int | None] = {}  # this rank's measured bytes per batch (None = OOM)
    own: list[tuple[int, bool]] = []  # this rank's own verdicts, before the ranks agree

    def fits(b: int) -> bool:
        idx = torch.randint(0, len(labels), (b,))
        norm = Normalize(meta["mean"], meta["std"], d.device, in_ch, False)
        # the training crop's size: memory is measured at what the model sees
        x = center_crop(norm(torch.from_numpy(images[idx.numpy()]).to(d.device)),
                        cfg.data.image_size)
        y = torch.from_numpy(labels[idx.numpy()]).to(d.device)
        try:
            need = step_memory(base, x, y, dtypes[precision], d.device) + ddp_extra
            if need > budget:
                raise SimulatedOOM(f"{need} > {budget} bytes")
            memory[b] = need
            ok = True
        except (torch.cuda.OutOfMemoryError, SimulatedOOM):
            memory[b] = None
            ok = False
        finally:
            if d.device.type == "cuda":
                torch.cuda.empty_cache()
        own.append((b, ok))
        return bool(_all_min(d, int(ok)))  # every rank must fit

    # never a batch larger than a rank's share of the data: such an epoch has no batches
    limit = min(tc.max_batch, len(labels) // d.world)
    if limit < 1:
        raise UserError(f"the training split ({len(labels)} samples) is smaller than the "
                        f"{d.world} rank(s) that would share it")
    own_max, trials = find_max_batch(fits, min(tc.start_batch, limit), limit)
    agreed = _all_min(d, own_max)
    if agreed < 1:
        raise UserError("not even a batch of 1 fits in device memory; choose a smaller "
                        "model or image size")
    candidates = sorted({b for b in (2 ** k for k in range(20)) if agreed // 8 <= b <= agreed}
                        | {agreed})

    def measure(batch, loader, workers, prefetch, prec, channels_last, compile_):
        model = build_model(cfg.model, meta["num_classes"], in_ch).to(d.device)
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
        model = distributed.wrap_ddp(model, d)  # as the trainer wraps it
        run_model = torch.compile(model) if compile_ else model
        opt = build_optimizer(model, st, 1e-3, d.device)  # the trainer's optimizer
        norm = Normalize(meta["mean"], meta["std"], d.device, in_ch, channels_last)
        tb = TrainBatches(loader, images, labels, batch, d.device, d.world, d.rank, cfg.seed,
                          cfg.data.augment, norm, workers, cfg.data.pin_memory,
                          workers > 0, prefetch, image_size=cfg.data.image_size)
        sps, wait = _throughput(run_model, forever(tb.epoch), tc.steps, dtypes[prec], d.device,
                                opt)
        return {"samples_per_s": sps * d.world, "data_wait_fraction": wait}

    default_loader = cfg.data.loader if cfg.data.loader != "auto" else "device"
    batch_rows = []
    for b in candidates:
        r = measure(b, default_loader, cfg.data.num_workers, cfg.data.prefetch_factor,
                    precision, st.channels_last, False)
        batch_rows.append({"batch_size": b, **r})
    batch = max(batch_rows, key=lambda r: r["samples_per_s"])["batch_size"]

    cores = max(1, len(os.sched_getaffinity(0)) // d.world)
    loader_opts = [("device", 0, 2)] + [("dataloader", w, p) for w in sorted({0, 2, cores})
                                        for p in ((2, 4) if w else (2,))]
    loader_rows = []
    for kind, w, p in loader_opts:
        r = measure(batch, kind, w, p, precision, st.channels_last, False)
        loader_rows.append({"loader": kind, "num_workers": w, "prefetch_factor": p, **r})
    best_loader = max(loader_rows, key=lambda r: r["samples_per_s"])

    precisions = ["fp32", "bf16", "fp16"]
    if d.device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        precisions.remove("bf16")
    prec_rows = []
    for prec in precisions:
        for cl in (False, True):
            for comp in ((False, True) if tc.compile else (False,)):
                r = measure(batch, best_loader["loader"], best_loader["num_workers"],
                            best_loader["prefetch_factor"], prec, cl, comp)
                prec_rows.append({"precision": prec, "channels_last": cl, "compile": comp, **r})
    best_prec = max(prec_rows, key=lambda r: r["samples_per_s"])
    choice = {"batch_size": batch, "loader": best_loader["loader"],
              "num_workers": best_loader["num_workers"],
              "prefetch_factor": best_loader["prefetch_factor"],
              "precision": best_prec["precision"], "channels_last": best_prec["channels_last"],
              "compile": best_prec["compile"]}
    gathered = distributed.gather_objects(d, {"rank": d.rank, "max_batch": own_max,
                                              "trials": trials, "own_trials": own,
                                              "memory_bytes": memory,
                                              "budget_bytes": budget})
    result = {
        "stage": st.name, "world_size": d.world, "device": d.device.type,
        "device_name": torch.cuda.get_device_name(d.device) if d.device.type == "cuda"
        else "cpu", "memory_margin": tc.memory_margin, "memory_cap_mb": cap_mb,
        "batch_search": {"per_rank": gathered, "agreed_max_batch": agreed,
                         "candidates": batch_rows},
        "loader": loader_rows, "precision": prec_rows, "choice": choice,
        "config_hash": cfg.hash, "settings": tune_settings(cfg, st),
    }
    # choose on rank 0's measurements so that every rank uses the same answer
    result = distributed.broadcast_object(d, result)
    if d.is_master:
        write_json_atomic(tune_path(cfg), result)
    distributed.teardown(d)
    return result
