"""`ddpflow tune`'s measurements on one rank (tune.py's `run` drives them): the memory of
one step at a batch (the plain model: an OOM there breaks no DDP collective), the search
for the largest batch every rank fits, and the throughput of real DDP steps for each
candidate batch, loader and precision, each choice rank 0's. tunepace.py decides when to
stop and prints a line per candidate. The device loader's dataset is uploaded (decoded) once
per tune and shared by every candidate that uses it; between candidates the caching
allocator's freed blocks are released, so one candidate's leftovers do not shrink the
next one's memory."""

from __future__ import annotations

import dataclasses
import gc
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from ddpflow.config import Config, StageCfg
from ddpflow.core.errors import UserError
from ddpflow.data.crops import center_crop
from ddpflow.data.loaders import BadSamples, Normalize, TrainBatches, forever
from ddpflow.data.resident import resident_split
from ddpflow.engine import distributed, tunebudget
from ddpflow.engine.runtime import build_optimizer
from ddpflow.engine.stepmemory import (
    SimulatedOOM,
    find_max_batch,
    input_bytes,
    is_oom,
    step_memory,
)
from ddpflow.engine.tunepace import Pace
from ddpflow.seams.models import build_model


def all_min(d, value: int) -> int:
    if not d.backend:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def _throughput(model, batches, steps, amp_dtype, device, opt, pace=None) -> tuple[float, float]:
    """(samples/s, data-wait share) over `steps` DDP training steps after 2 warm-up steps;
    fp16 with its GradScaler, as training runs it."""
    it = batches
    crit = nn.CrossEntropyLoss()
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    wait = 0.0
    n = 0
    for i in tunebudget.step_indices(pace, steps, device):  # timed steps cut to the budget
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
# fp16 is chosen over bf16 only when more than 10% faster: it needs a GradScaler and its
# narrow range skips steps on overflow, while a few timed steps differ by several percent
# from run to run (noise is no reason to take the riskier format)
FP16_MARGIN = 1.10


def release(device: torch.device) -> None:
    """After a candidate: its model, optimizer and batches are garbage (DDP's reducer holds
    cycles): collected, and the allocator's cached blocks go back, so the next candidate
    (another precision or layout, other block sizes) starts from the same free memory. On a
    CPU there is no cache to release."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def pick_precision_row(rows: list[dict]) -> dict:
    """The fastest of the measured precision rows, except that fp16 wins over bf16 only by
    more than FP16_MARGIN (then bf16's fastest row instead)."""
    best = max(rows, key=lambda r: r["samples_per_s"])
    bf16 = [r for r in rows if r["precision"] == "bf16"]
    if best["precision"] == "fp16" and bf16:
        rival = max(bf16, key=lambda r: r["samples_per_s"])
        if best["samples_per_s"] <= FP16_MARGIN * rival["samples_per_s"]:
            return rival
    return best


@dataclasses.dataclass
class Probe:
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
    pace: Pace  # the time budget, stop signals, the progress lines (tunepace.py)
    last_step_s: float | None = None  # seconds of the last memory trial's step
    resident: tuple | None = None  # the device loader's (images, labels), uploaded once
    uploads: int = 0  # how often the training split went to the device (once at most)

    @property
    def layout(self) -> bool:
        """channels_last for the batch and loader phases (auto: as a GPU would train)."""
        cl = self.st.channels_last
        if self.st.strategy == "fsdp":  # FSDP2 shards contiguous parameters only
            return False
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
            t0 = time.perf_counter()
            need = (step_memory(model, x, y, DTYPES[precision], d.device) + self.extra
                    + input_bytes(b, self.meta["image_shape"], self.in_ch,
                                  self.cfg.data.image_size))
            self.last_step_s = time.perf_counter() - t0
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
        return bool(all_min(self.d, int(need is not None)))  # every rank must fit

    def device_data(self) -> tuple:
        """The training split on the device, uploaded (decoded once per node) at the first
        candidate that wants it; every later one indexes the same tensors."""
        if self.resident is None:
            bad = BadSamples("train", len(self.labels), self.cfg.data.max_bad_fraction,
                             self.d.rank)
            self.resident = resident_split(self.images, self.labels, self.d.device, bad)
            self.uploads += 1
        return self.resident

    def measure(self, batch, loader, workers, prefetch, prec, channels_last, compile_):
        """Throughput of real DDP training steps with these settings (every rank)."""
        cfg, d, meta = self.cfg, self.d, self.meta
        model = build_model(cfg.model, meta["num_classes"], self.in_ch).to(d.device)
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
        model = wrap_as_trained(model, cfg, self.st, d, prec)
        run_model = (torch.compile(model) if compile_ and self.st.strategy != "fsdp"
                     else model)
        opt = build_optimizer(model, self.st, 1e-3, d.device)  # the trainer's optimizer
        norm = Normalize(meta["mean"], meta["std"], d.device, self.in_ch, channels_last)
        tb = TrainBatches(loader, self.images, self.labels, batch, d.device, d.world, d.rank,
                          cfg.seed, cfg.data.augment, norm, workers, cfg.data.pin_memory,
                          workers > 0, prefetch, image_size=cfg.data.image_size,
                          resident=self.device_data() if loader == "device" else None)
        sps, wait = _throughput(run_model, forever(tb.epoch), cfg.tune.steps, DTYPES[prec],
                                d.device, opt, self.pace)
        return {"samples_per_s": sps * d.world, "data_wait_fraction": wait}


def wrap_as_trained(model, cfg, st, d, precision: str):
    """The model as the trainer runs it: its checkpointed blocks, then FSDP or DDP."""
    from ddpflow.engine import sharding
    from ddpflow.engine.build import model_blocks

    checkpointed, blocks = model_blocks(cfg, st, model)
    sharding.checkpoint_blocks(checkpointed)
    if st.strategy == "fsdp":
        sharding.shard(model, blocks, precision, st.reshard_after_forward)
        return model
    return distributed.wrap_ddp(model, d)


def search_batch(p: Probe, precision: str) -> dict:
    """Phase 1: the largest batch every rank fits, then the fastest candidate up to it."""
    memory: dict[int, int | None] = {}  # this rank's measured bytes per batch (None = OOM)
    own: list[tuple[int, bool]] = []  # this rank's own verdicts, before the ranks agree

    def fits(b: int) -> bool:
        memory[b] = p.step_bytes(b, precision, p.layout)
        own.append((b, memory[b] is not None))
        ok = p.fits_everywhere(memory[b])
        need = f"{memory[b] / 2**20:.0f} MiB" if memory[b] is not None else "too much"
        p.pace.say(f"batch {b}: a step needs {need} of {p.budget / 2**20:.0f} MiB: "
                   + ("fits on every rank" if ok else "does not fit"))
        return ok

    d, tc = p.d, p.cfg.tune
    # never a batch larger than a rank's share of the data: such an epoch has no batches
    limit = min(tc.max_batch, len(p.labels) // d.world)
    if limit < 1:
        raise UserError(f"the training split ({len(p.labels)} samples) is smaller than the "
                        f"{d.world} rank(s) that would share it")
    own_max, trials = find_max_batch(
        fits, min(tc.start_batch, limit), limit,
        climb=lambda b: p.pace.keeps_climbing(b, p.last_step_s))
    agreed = all_min(d, own_max)
    if agreed < 1:
        raise UserError("not even a batch of 1 fits in device memory; choose a smaller "
                        "model or image size")
    return {"agreed": agreed, "own_max": own_max, "trials": trials, "own": own,
            "memory": memory}


def _measured(p: Probe, what: str, *args) -> dict | None:
    """One throughput measurement with a progress line, or None when the budget is spent."""
    if not tunebudget.admits(p.pace, what):  # (budget spent, or it would end past it)
        return None
    try:
        row = p.measure(*args)
    finally:
        release(p.d.device)  # the candidate's model, optimizer, batches and cached blocks
    p.pace.say(f"{what}: {row['samples_per_s']:.0f} samples/s, data wait "
               f"{row['data_wait_fraction']:.0%}")
    return row


def choose(p: Probe, agreed: int, precision: str, device_ok: bool) -> tuple:
    """Phases 1b-3: the fastest batch up to the agreed maximum, then loader, then precision
    and layout; each choice rank 0's (broadcast). What the budget left unmeasured is
    skipped: then the largest fitting batch, the default loader and the stage's precision."""
    cfg, d = p.cfg, p.d
    candidates = sorted({b for b in (2 ** k for k in range(20)) if agreed // 8 <= b <= agreed}
                        | {agreed})
    default = ("device" if device_ok else "dataloader", cfg.data.num_workers,
               cfg.data.prefetch_factor)
    batch_rows = [{"batch_size": b, **row} for b in candidates if (row := _measured(
        p, f"batch {b}", b, *default, precision, p.layout, False))]
    # rank 0's choice for every rank: each measured its own throughput
    batch = distributed.broadcast_object(d, max(
        batch_rows, key=lambda r: r["samples_per_s"])["batch_size"] if batch_rows else agreed)
    cores = max(1, len(os.sched_getaffinity(0)) // d.world)
    loader_opts = ([("device", 0, 2)] if device_ok else []) + [
        ("dataloader", w, f) for w in sorted({0, 2, cores}) for f in ((2, 4) if w else (2,))]
    loader_rows = [{"loader": k, "num_workers": w, "prefetch_factor": f, **row}
                   for k, w, f in loader_opts if (row := _measured(
                       p, f"batch {batch}, {k} loader, {w} workers, prefetch {f}", batch, k, w,
                       f, precision, p.layout, False))]
    best_loader = distributed.broadcast_object(d, max(
        loader_rows, key=lambda r: r["samples_per_s"]) if loader_rows else dict(
        zip(("loader", "num_workers", "prefetch_factor"), default)))
    prec_rows = _precisions(p, batch, best_loader)
    measured = [r for r in prec_rows if r["fits"] and "samples_per_s" in r]
    best_prec = distributed.broadcast_object(d, pick_precision_row(measured) if measured else {
        "precision": precision, "channels_last": p.layout, "compile": False})
    choice = {"batch_size": batch, "loader": best_loader["loader"],
              "num_workers": best_loader["num_workers"],
              "prefetch_factor": best_loader["prefetch_factor"],
              "precision": best_prec["precision"], "channels_last": best_prec["channels_last"],
              "compile": best_prec["compile"]}
    p.pace.say("chose " + ", ".join(f"{k} {v}" for k, v in choice.items())
               + (f" ({len(p.pace.skipped)} candidate(s) skipped: budget)" if p.pace.skipped
                  else ""))
    return choice, batch_rows, loader_rows, prec_rows


def _precisions(p: Probe, batch: int, loader: dict) -> list[dict]:
    """Phase 3: each precision x layout (x compile) at the chosen batch; its memory is
    checked on the plain model first, and one that does not fit on every rank is recorded
    and never run under DDP (an OOM there kills the rank, and torchrun restarts it into
    the same OOM)."""
    # fsdp: no fp16 (stagechecks.py) and no channels_last (FSDP2's parameters are contiguous)
    fsdp = p.st.strategy == "fsdp"
    precisions = ["fp32", "bf16"] + ([] if fsdp else ["fp16"])
    if p.d.device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        precisions.remove("bf16")
    rows = []
    for prec in precisions:
        for cl in (False,) if fsdp else (False, True):
            need = p.step_bytes(batch, prec, cl)
            fits = p.fits_everywhere(need)
            for comp in ((False, True) if p.cfg.tune.compile else (False,)):
                row = {"precision": prec, "channels_last": cl, "compile": comp, "fits": fits,
                       "memory_bytes": need}
                if fits:
                    row.update(_measured(
                        p, f"batch {batch}, {prec}, channels_last {cl}, compile {comp}", batch,
                        loader["loader"], loader["num_workers"], loader["prefetch_factor"], prec,
                        cl, comp) or {"skipped": "tune.budget_s spent"})
                rows.append(row)
    return rows
