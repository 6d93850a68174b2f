"""`ddpflow tune`: measure this node, then choose batch size, input pipeline and precision.

Runs on every rank under torchrun, like training (`ddpflow tune` builds the line):
  1. batch size: the largest per-GPU batch whose training step fits in device memory with
     `tune.memory_margin` to spare (doubling, then bisection; an out-of-memory error is a
     "does not fit"). The budget is the free memory less what the device loader would hold
     (the dataset, when it is allowed at all); a step's need counts its input batch and the
     allocator's reserved peak. Trial steps run on the plain model, so no DDP collective is
     ever left half-done by an OOM; the ranks then agree on the smallest maximum. Among the
     powers of two up to that maximum (and the maximum), the batch with the best measured
     throughput of real DDP steps wins: not simply the largest.
  2. input pipeline: the device loader (only where `choose_loader` lets the dataset onto the
     device) vs DataLoader settings (workers, prefetch, pinning), by measured throughput.
  3. precision and layout: fp32 (TF32 on, as training runs it), bf16, fp16 (with its
     GradScaler); channels_last; torch.compile if asked. A candidate whose step does not fit
     at the chosen batch (fp32 needs about twice bf16's activations) is recorded as such and
     never run under DDP: an OOM inside DDP would kill the rank.
The choices are greedy, one after the other, and rank 0's choice of each phase is broadcast,
so every rank measures the next phase with the same settings and records the same answer.
Every measurement and the choice go into <run>/tune.json; stages with batch_size: auto,
precision: auto and data.loader: auto use it.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ddpflow.config import Config, StageCfg
from ddpflow.core import reading
from ddpflow.core.errors import UserError
from ddpflow.core.writing import write_json_atomic
from ddpflow.data import prepared
from ddpflow.data.crops import center_crop
from ddpflow.data.loaders import Normalize, TrainBatches, choose_loader, forever
from ddpflow.data.prepare import settings_fingerprint
from ddpflow.engine import distributed
from ddpflow.engine.runtime import build_optimizer, pick_precision
from ddpflow.engine.stepmemory import (
    SimulatedOOM,
    find_max_batch,
    input_bytes,
    is_oom,
    memory_budget,
    step_memory,
)
from ddpflow.seams.contract import probe
from ddpflow.seams.models import build_model, input_channels


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


# tune.json as its readers use it (core/reading.py validates it before any field is used)
TUNE_SCHEMA = {
    "type": "object", "required": ["choice"],
    "properties": {
        "settings": {"type": ["object", "null"]},
        "choice": {"type": "object",
                   "required": ["batch_size", "loader", "num_workers", "prefetch_factor",
                                "precision", "channels_last", "compile"],
                   "properties": {
                       "batch_size": {"type": "integer", "minimum": 1},
                       "loader": {"enum": ["device", "dataloader"]},
                       "num_workers": {"type": "integer", "minimum": 0, "maximum": 1024},
                       "prefetch_factor": {"type": ["integer", "null"], "minimum": 1},
                       "precision": {"enum": ["bf16", "fp16", "fp32"]},
                       "channels_last": {"type": "boolean"},
                       "compile": {"type": "boolean"}}}}}


def load_choice(cfg: Config, st: StageCfg) -> tuple[dict | None, str | None]:
    """(tune.json's choice, None) when it was measured for this stage's settings;
    (None, why not) when it exists but was measured for others or is damaged (the reason
    names the file and field: the caller refuses when it needs the file, else warns);
    (None, None) without one."""
    try:
        t = reading.read_json_if_present(tune_path(cfg), TUNE_SCHEMA, "ddpflow tune's result",
                                         "run `ddpflow tune` again")
    except UserError as e:
        return None, str(e)
    if t is None:
        return None, None
    choice = t["choice"]
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
    channels_last: bool | str  # "auto": decided once the model is built (layout.py)
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
        if st.channels_last == "auto" and tuned:  # measured for this stage's settings
            out.channels_last = tuned["channels_last"]
    if device.type == "cuda" and out.precision == "fp32":
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 tensor cores for fp32
        torch.backends.cudnn.allow_tf32 = True
    if mismatch:
        say(f"not using tune.json: {mismatch}")
    return out


def _all_min(d, value: int) -> int:
    if not d.backend:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def _throughput(model, batches, steps, amp_dtype, device, opt) -> tuple[float, float]:
    """(samples/s, data-wait share) over `steps` DDP training steps after 2 warm-up steps;
    fp16 with its GradScaler, as training runs it."""
    it = batches
    crit = nn.CrossEntropyLoss()
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
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
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        n += len(y)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # sync point: the timed steps have really run
    dt = time.perf_counter() - t0
    return n / dt, wait / dt


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


@dataclasses.dataclass
class _Probe:
    """What every measurement of one `ddpflow tune` rank shares."""
    cfg: Config
    st: StageCfg
    d: distributed.Dist
    meta: dict
    images: object  # the prepared training split (memmap)
    labels: object
    in_ch: int
    base: nn.Module  # the plain model of the memory trials
    budget: int  # bytes one training step may take on this rank
    extra: int  # bytes per step besides the plain model's (DDP's gradient buckets)

    @property
    def layout(self) -> bool:
        """channels_last for the batch and loader phases (auto: as a GPU would train)."""
        cl = self.st.channels_last
        return cl if isinstance(cl, bool) else self.d.device.type == "cuda"

    def step_bytes(self, b: int, precision: str, channels_last: bool) -> int | None:
        """What one step of batch b needs on the plain model at this precision and layout
        (its input pipeline included), or None where it does not fit in the budget."""
        d = self.d
        idx = torch.randint(0, len(self.labels), (b,)).numpy()
        try:
            norm = Normalize(self.meta["mean"], self.meta["std"], d.device, self.in_ch,
                             channels_last)
            # the training crop's size: memory is measured at what the model sees
            x = center_crop(norm(torch.from_numpy(self.images[idx]).to(d.device)),
                            self.cfg.data.image_size)
            y = torch.from_numpy(self.labels[idx]).to(d.device)
            model = self.base.to(memory_format=torch.channels_last if channels_last
                                 else torch.contiguous_format)
            need = (step_memory(model, x, y, DTYPES[precision], d.device) + self.extra
                    + input_bytes(b, self.meta["image_shape"], self.in_ch,
                                  self.cfg.data.image_size))
            if need > self.budget:
                raise SimulatedOOM(f"{need} > {self.budget} bytes")
            return need
        except Exception as e:  # noqa: BLE001 - only allocation failures are answers
            if not is_oom(e):
                raise
            return None
        finally:
            if d.device.type == "cuda":
                torch.cuda.empty_cache()

    def fits_everywhere(self, need: int | None) -> bool:
        return bool(_all_min(self.d, int(need is not None)))  # every rank must fit

    def measure(self, batch, loader, workers, prefetch, prec, channels_last, compile_):
        """Throughput of real DDP training steps with these settings (every rank)."""
        cfg, d, meta = self.cfg, self.d, self.meta
        model = build_model(cfg.model, meta["num_classes"], self.in_ch).to(d.device)
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
        model = distributed.wrap_ddp(model, d)  # as the trainer wraps it
        run_model = torch.compile(model) if compile_ else model
        opt = build_optimizer(model, self.st, 1e-3, d.device)  # the trainer's optimizer
        norm = Normalize(meta["mean"], meta["std"], d.device, self.in_ch, channels_last)
        tb = TrainBatches(loader, self.images, self.labels, batch, d.device, d.world, d.rank,
                          cfg.seed, cfg.data.augment, norm, workers, cfg.data.pin_memory,
                          workers > 0, prefetch, image_size=cfg.data.image_size)
        sps, wait = _throughput(run_model, forever(tb.epoch), cfg.tune.steps, DTYPES[prec],
                                d.device, opt)
        return {"samples_per_s": sps * d.world, "data_wait_fraction": wait}


def _search_batch(p: _Probe, precision: str) -> dict:
    """Phase 1: the largest batch every rank fits, then the fastest candidate up to it."""
    memory: dict[int, int | None] = {}  # this rank's measured bytes per batch (None = OOM)
    own: list[tuple[int, bool]] = []  # this rank's own verdicts, before the ranks agree

    def fits(b: int) -> bool:
        memory[b] = p.step_bytes(b, precision, p.layout)
        own.append((b, memory[b] is not None))
        return p.fits_everywhere(memory[b])

    d, tc = p.d, p.cfg.tune
    # never a batch larger than a rank's share of the data: such an epoch has no batches
    limit = min(tc.max_batch, len(p.labels) // d.world)
    if limit < 1:
        raise UserError(f"the training split ({len(p.labels)} samples) is smaller than the "
                        f"{d.world} rank(s) that would share it")
    own_max, trials = find_max_batch(fits, min(tc.start_batch, limit), limit)
    agreed = _all_min(d, own_max)
    if agreed < 1:
        raise UserError("not even a batch of 1 fits in device memory; choose a smaller "
                        "model or image size")
    return {"agreed": agreed, "own_max": own_max, "trials": trials, "own": own,
            "memory": memory}


def run(cfg: Config, stage_name: str, cap_mb: list[float] | None = None) -> dict:
    st: StageCfg = cfg.stage(stage_name)
    tc = cfg.tune
    d = distributed.setup(cfg.hardware)
    distributed.seed_everything(cfg.seed, d.rank, deterministic=False)
    if d.device.type == "cuda":  # fp32 is measured as training runs it: TF32 tensor cores
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    meta, arrays = prepared.load(cfg.data_dir)
    images, labels = arrays["train"]
    in_ch = input_channels(cfg.model.name, meta["image_shape"][2])
    precision = pick_precision("auto" if st.precision == "auto" else st.precision, d.device)
    base = build_model(cfg.model, meta["num_classes"], in_ch, probe(cfg, meta)).to(d.device)
    free = memory_budget(d, cap_mb)
    # the device loader only where training would allow it; then the dataset (train and
    # val, as it keeps them) is on the device, and the steps get what is left
    nbytes = sum(a.nbytes for split in ("train", "val") for a in arrays[split])
    kind, loader_reason = choose_loader(cfg.data.loader, nbytes, d.device,
                                        cfg.data.device_memory_fraction, free=free)
    device_ok = bool(_all_min(d, int(kind == "device")))
    budget = int((free - (nbytes if device_ok else 0)) * (1 - tc.memory_margin))
    # DDP keeps a second copy of the gradients in its buckets
    ddp_extra = sum(q.numel() * q.element_size() for q in base.parameters()) if d.backend else 0
    p = _Probe(cfg, st, d, meta, images, labels, in_ch, base, budget, ddp_extra)

    search = _search_batch(p, precision)
    agreed = search["agreed"]
    candidates = sorted({b for b in (2 ** k for k in range(20)) if agreed // 8 <= b <= agreed}
                        | {agreed})
    default_loader = "device" if device_ok else "dataloader"
    batch_rows = [{"batch_size": b, **p.measure(b, default_loader, cfg.data.num_workers,
                                                cfg.data.prefetch_factor, precision,
                                                p.layout, False)} for b in candidates]
    # rank 0's choice for every rank: each measured its own throughput
    batch = distributed.broadcast_object(
        d, max(batch_rows, key=lambda r: r["samples_per_s"])["batch_size"])

    cores = max(1, len(os.sched_getaffinity(0)) // d.world)
    loader_opts = ([("device", 0, 2)] if device_ok else []) + [
        ("dataloader", w, f) for w in sorted({0, 2, cores}) for f in ((2, 4) if w else (2,))]
    loader_rows = [{"loader": k, "num_workers": w, "prefetch_factor": f,
                    **p.measure(batch, k, w, f, precision, p.layout, False)}
                   for k, w, f in loader_opts]
    best_loader = distributed.broadcast_object(
        d, max(loader_rows, key=lambda r: r["samples_per_s"]))
    prec_rows = _precisions(p, batch, best_loader)
    best_prec = distributed.broadcast_object(
        d, max((r for r in prec_rows if r["fits"]), key=lambda r: r["samples_per_s"]))
    choice = {"batch_size": batch, "loader": best_loader["loader"],
              "num_workers": best_loader["num_workers"],
              "prefetch_factor": best_loader["prefetch_factor"],
              "precision": best_prec["precision"], "channels_last": best_prec["channels_last"],
              "compile": best_prec["compile"]}
    gathered = distributed.gather_objects(d, {"rank": d.rank, "max_batch": search["own_max"],
                                              "trials": search["trials"],
                                              "own_trials": search["own"],
                                              "memory_bytes": search["memory"],
                                              "budget_bytes": budget, "free_bytes": free})
    result = {
        "stage": st.name, "world_size": d.world, "device": d.device.type,
        "device_name": torch.cuda.get_device_name(d.device) if d.device.type == "cuda"
        else "cpu", "memory_margin": tc.memory_margin, "memory_cap_mb": cap_mb,
        "device_loader": {"allowed": device_ok, "dataset_bytes": nbytes,
                          "reason": loader_reason},
        "batch_search": {"per_rank": gathered, "agreed_max_batch": agreed,
                         "candidates": batch_rows},
        "loader": loader_rows, "precision": prec_rows, "choice": choice,
        "config_hash": cfg.hash, "settings": tune_settings(cfg, st),
    }
    # rank 0's measurements in the file, so that every rank records the same answer
    result = distributed.broadcast_object(d, result)
    if d.is_master:
        write_json_atomic(tune_path(cfg), result)
    distributed.teardown(d)
    return result


def _precisions(p: _Probe, batch: int, loader: dict) -> list[dict]:
    """Phase 3: each precision x layout (x compile) at the chosen batch; its memory is
    checked on the plain model first, and one that does not fit on every rank is recorded
    and never run under DDP (an OOM there kills the rank, and torchrun restarts it into
    the same OOM)."""
    precisions = ["fp32", "bf16", "fp16"]
    if p.d.device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        precisions.remove("bf16")
    rows = []
    for prec in precisions:
        for cl in (False, True):
            need = p.step_bytes(batch, prec, cl)
            fits = p.fits_everywhere(need)
            for comp in ((False, True) if p.cfg.tune.compile else (False,)):
                row = {"precision": prec, "channels_last": cl, "compile": comp, "fits": fits,
                       "memory_bytes": need}
                if fits:
                    row.update(p.measure(batch, loader["loader"], loader["num_workers"],
                                         loader["prefetch_factor"], prec, cl, comp))
                rows.append(row)
    return rows
