"""`ddpflow tune`: measure this node, then choose batch size, input pipeline and precision.

Runs on every rank under torchrun, like training (`ddpflow tune` builds the line):
  1. batch size: the largest per-GPU batch whose training step fits in device memory with
     `tune.memory_margin` to spare (doubling, then bisection; an out-of-memory error is a
     "does not fit"; memory.py measures a step on the plain model, so no DDP collective is
     ever left half-done by an OOM); the ranks agree on the smallest maximum. Among the
     powers of two up to it (and it), the batch with the best measured throughput of real
     training steps wins (throughput.py: the trainer's own model wrapping, optimizer and
     step), not simply the largest.
  2. input pipeline: the device loader (where `choose_loader` lets the dataset onto the
     device; uploaded once and shared by every candidate) vs DataLoader settings (workers,
     prefetch, pinning), by measured throughput.
  3. precision and layout: fp32 (TF32 on, as training runs it), bf16, fp16 (with its
     GradScaler); channels_last; torch.compile if asked. fp16 beats bf16 only when more than
     10% faster (FP16_MARGIN). A candidate whose step does not fit at the chosen batch is
     recorded as such and never run under DDP: an OOM inside DDP would kill the rank.
The choices are greedy, one after the other; rank 0's choice of each phase is broadcast, so
every rank measures the next phase with the same settings and records the same answer.
`Pace` ends the search early: on a CPU nothing runs out of memory, so a search that only
stops at an OOM would climb toward `tune.max_batch` (over 20 minutes on two cores). The time
budget (`tune.budget_s`: candidates left are skipped, recorded, and the best measured so far
wins), throughput that stops improving as the batch doubles (a CPU without --memory-cap-mb)
and a stop signal (to the launcher or to one rank alone: `TuneStopped` on every rank before
the same candidate, nothing written but rank 0's <run>/tune/stopped.json for the launcher)
end it; every such decision is agreed across the ranks, so their collectives stay in step.
Every measurement and the choice go into <run>/tune.json; stages with batch_size: auto,
precision: auto and data.loader: auto use it (settings.py).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import torch
import torch.distributed as torch_dist
from torch import nn

from ddpflow.config import Config
from ddpflow.config.types import StageCfg
from ddpflow.core.errors import UserError
from ddpflow.core.writing import write_json_atomic
from ddpflow.data import prepared
from ddpflow.data.loaders import BadSamples, choose_loader
from ddpflow.data.resident import resident_split
from ddpflow.engine import (
    distributed,
    memory,
    settings,
    sharding,
    stopflag,
    throughput,
    tunebudget,
)
from ddpflow.engine.build import model_blocks
from ddpflow.seams.contract import probe
from ddpflow.seams.models import build_model, input_channels

STOPPED = "stopped.json"  # in <run>/tune: the ranks stopped on a signal (TuneStopped)

GAIN = 1.05  # a doubled batch must be this much faster per sample to keep climbing


class TuneStopped(Exception):
    """A stop signal reached the ranks while they measured: nothing is written. `signal`:
    the first any rank received; `at`: per rank, (checks made, the candidate it was about
    to run): the same on every rank."""

    def __init__(self, signal: str, at: list):
        super().__init__(signal)
        self.signal, self.at = signal, at


class Pace:
    def __init__(self, dist, budget_s: float, climb_by_throughput: bool):
        self.dist, self.budget_s, self.climb = dist, budget_s, climb_by_throughput
        self.t0 = time.monotonic()
        self.best_rate: dict[int, float] = {}  # batch -> samples/s of its memory trial
        self.skipped: list[str] = []
        self.checks = 0  # candidates this rank checked in with (check)

    def say(self, msg: str) -> None:
        if self.dist.is_master:
            print(f"[tune {time.monotonic() - self.t0:6.1f} s] {msg}", file=sys.stderr,
                  flush=True)

    def _agreed(self, go_on: bool) -> bool:
        """Whether every rank goes on (one small collective: a sync point)."""
        if not self.dist.backend:
            return go_on
        t = torch.tensor([int(go_on)], dtype=torch.int64, device=self.dist.device)
        torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MIN)
        return bool(t.item())

    def check(self, what: str = "the batch search's next batch") -> bool:
        """Before a candidate (`what`): raises TuneStopped on a stop signal (any rank's, told
        to every rank); False once the budget is spent (the candidate is skipped)."""
        self.checks += 1
        if not self._agreed(stopflag.received() is None):
            said = distributed.gather_objects(self.dist, (stopflag.received(), self.checks, what))
            raise TuneStopped(next((s for s, _, _ in said if s), "a stop signal"),
                              [[n, w] for _, n, w in said])
        return self._agreed(time.monotonic() - self.t0 < self.budget_s)

    def skip(self, what: str) -> None:
        self.skipped.append(what)
        self.say(f"{what}: skipped (tune.budget_s {self.budget_s:g} s spent)")

    def keeps_climbing(self, batch: int, step_s: float | None) -> bool:
        """After a batch fits in memory: whether the search doubles it again (agreed)."""
        go_on = True
        if self.climb and step_s:
            rate = batch / step_s
            self.best_rate[batch] = rate
            before = self.best_rate.get(batch // 2)
            if before is not None and rate < GAIN * before:
                go_on = False
                self.say(f"batch {batch}: {rate:.0f} samples/s, not {GAIN:.2f}x batch "
                         f"{batch // 2}'s {before:.0f}: larger batches are not searched")
        return self._agreed(go_on) and self.check()


# fp16 is chosen over bf16 only when more than 10% faster: it needs a GradScaler and its
# narrow range skips steps on overflow, while a few timed steps differ by several percent
# from run to run (noise is no reason to take the riskier format)
FP16_MARGIN = 1.10


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
    stage: StageCfg
    dist: distributed.Dist
    meta: dict
    images: object  # the prepared training split (memmap)
    labels: object
    in_ch: int
    base: nn.Module  # the plain model of the memory trials
    budget: int  # bytes one training step may take on this rank
    extra: int  # bytes per step besides the plain model's (DDP's gradient buckets)
    pace: Pace  # the time budget, stop signals, the progress lines
    last_step_s: float | None = None  # seconds of the last memory trial's step
    resident: tuple | None = None  # the device loader's (images, labels), uploaded once
    uploads: int = 0  # how often the training split went to the device (once at most)

    @property
    def layout(self) -> bool:
        """channels_last for the batch and loader phases (auto: as a GPU would train)."""
        cl = self.stage.channels_last
        if self.stage.strategy == "fsdp":  # FSDP2 shards contiguous parameters only
            return False
        return cl if isinstance(cl, bool) else self.dist.device.type == "cuda"

    def step_bytes(self, b: int, precision: str, channels_last: bool) -> int | None:
        """Memory of one step of batch b on the plain model (memory.trial_bytes), or None
        where it does not fit."""
        return memory.trial_bytes(self, b, precision, channels_last)

    def fits_everywhere(self, need: int | None) -> bool:
        return bool(distributed.all_min(self.dist, int(need is not None)))  # every rank must fit

    def device_data(self) -> tuple:
        """The training split on the device, uploaded (decoded once per node) at the first
        candidate that wants it; every later one indexes the same tensors."""
        if self.resident is None:
            bad = BadSamples("train", len(self.labels), self.cfg.data.max_bad_fraction,
                             self.dist.rank)
            self.resident = resident_split(self.images, self.labels, self.dist.device, bad)
            self.uploads += 1
        return self.resident

    def measure(self, *candidate) -> dict:
        """Throughput of real training steps with these settings (throughput.measure)."""
        return throughput.measure(self, *candidate)


def search_batch(p: Probe, precision: str) -> dict:
    """Phase 1: the largest batch every rank fits, then the fastest candidate up to it."""
    needs: dict[int, int | None] = {}  # this rank's measured bytes per batch (None = OOM)
    own: list[tuple[int, bool]] = []  # this rank's own verdicts, before the ranks agree

    def fits(b: int) -> bool:
        needs[b] = p.step_bytes(b, precision, p.layout)
        own.append((b, needs[b] is not None))
        ok = p.fits_everywhere(needs[b])
        need = f"{needs[b] / 2**20:.0f} MiB" if needs[b] is not None else "too much"
        p.pace.say(f"batch {b}: a step needs {need} of {p.budget / 2**20:.0f} MiB: "
                   + ("fits on every rank" if ok else "does not fit"))
        return ok

    dist, tc = p.dist, p.cfg.tune
    # never a batch larger than a rank's share of the data: such an epoch has no batches
    limit = min(tc.max_batch, len(p.labels) // dist.world)
    if limit < 1:
        raise UserError(f"the training split ({len(p.labels)} samples) is smaller than the "
                        f"{dist.world} rank(s) that would share it")
    own_max, trials = memory.find_max_batch(
        fits, min(tc.start_batch, limit), limit,
        climb=lambda b: p.pace.keeps_climbing(b, p.last_step_s))
    agreed = distributed.all_min(dist, own_max)
    if agreed < 1:
        raise UserError("not even a batch of 1 fits in device memory; choose a smaller "
                        "model or image size")
    return {"agreed": agreed, "own_max": own_max, "trials": trials, "own": own,
            "memory": needs}


def _measured(p: Probe, what: str, *args) -> dict | None:
    """One throughput measurement with a progress line, or None when the budget is spent."""
    if not tunebudget.admits(p.pace, what):  # (budget spent, or it would end past it)
        return None
    try:
        row = p.measure(*args)
    finally:
        throughput.release(p.dist.device)  # its model, optimizer, batches, cached blocks
    p.pace.say(f"{what}: {row['samples_per_s']:.0f} samples/s, data wait "
               f"{row['data_wait_fraction']:.0%}")
    return row


def choose(p: Probe, agreed: int, precision: str, device_ok: bool) -> tuple:
    """Phases 1b-3: the fastest batch up to the agreed maximum, then loader, then precision
    and layout; each choice rank 0's (broadcast). What the budget left unmeasured is
    skipped: then the largest fitting batch, the default loader and the stage's precision."""
    cfg, dist = p.cfg, p.dist
    candidates = sorted({b for b in (2 ** k for k in range(agreed.bit_length()))
                         if agreed // 8 <= b <= agreed}
                        | {agreed})
    default = ("device" if device_ok else "dataloader", cfg.data.num_workers,
               cfg.data.prefetch_factor)
    batch_rows = [{"batch_size": b, **row} for b in candidates if (row := _measured(
        p, f"batch {b}", b, *default, precision, p.layout, False))]
    # rank 0's choice for every rank: each measured its own throughput
    batch = distributed.broadcast_object(dist, max(
        batch_rows, key=lambda r: r["samples_per_s"])["batch_size"] if batch_rows else agreed)
    cores = max(1, len(os.sched_getaffinity(0)) // dist.world)
    loader_opts = ([("device", 0, 2)] if device_ok else []) + [
        ("dataloader", w, f) for w in sorted({0, 2, cores}) for f in ((2, 4) if w else (2,))]
    loader_rows = [{"loader": k, "num_workers": w, "prefetch_factor": f, **row}
                   for k, w, f in loader_opts if (row := _measured(
                       p, f"batch {batch}, {k} loader, {w} workers, prefetch {f}", batch, k, w,
                       f, precision, p.layout, False))]
    best_loader = distributed.broadcast_object(dist, max(
        loader_rows, key=lambda r: r["samples_per_s"]) if loader_rows else dict(
        zip(("loader", "num_workers", "prefetch_factor"), default)))
    prec_rows = _precisions(p, batch, best_loader)
    measured = [r for r in prec_rows if r["fits"] and "samples_per_s" in r]
    best_prec = distributed.broadcast_object(dist, pick_precision_row(measured) if measured else {
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
    fsdp = p.stage.strategy == "fsdp"
    precisions = ["fp32", "bf16"] + ([] if fsdp else ["fp16"])
    if p.dist.device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
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


def run(cfg: Config, stage_name: str, cap_mb: list[float] | None = None) -> dict | None:
    """One rank's tuning; the result (also in tune.json), or None when stopped."""
    stage: StageCfg = cfg.stage(stage_name)
    tc = cfg.tune
    dist = distributed.setup(cfg.hardware, "always" if stage.strategy == "fsdp" else True)
    distributed.seed_everything(cfg.seed, dist.rank, deterministic=False)
    settings.set_backend_flags(dist.device, "fp32")  # fp32 is measured as training runs it
    meta, arrays = prepared.load(cfg.data_dir)
    images, labels = arrays["train"]
    in_ch = input_channels(cfg.model.name, meta["image_shape"][2])
    precision = settings.pick_precision(stage.precision, dist.device)
    base = build_model(cfg.model, meta["num_classes"], in_ch, probe(cfg, meta)).to(dist.device)
    checkpointed, blocks = model_blocks(cfg, stage, base)
    sharding.checkpoint_blocks(checkpointed)  # the memory trials keep what training keeps
    free = memory.memory_budget(dist, cap_mb)
    # the device loader only where training would allow it; then the dataset (train and
    # val, as it keeps them) is on the device, and the steps get what is left
    nbytes = sum(a.nbytes for split in ("train", "val") for a in arrays[split])
    kind, loader_reason = choose_loader(cfg.data.loader, nbytes, dist.device,
                                        cfg.data.device_memory_fraction, free=free)
    device_ok = bool(distributed.all_min(dist, int(kind == "device")))
    budget = int((free - (nbytes if device_ok else 0)) * (1 - tc.memory_margin))
    ddp_extra = memory.model_extra(base, blocks, dist, stage.strategy)
    # on a CPU without a cap nothing runs out of memory: throughput ends the climb instead
    pace = Pace(dist, tc.budget_s, climb_by_throughput=dist.device.type == "cpu" and not cap_mb)
    p = Probe(cfg, stage, dist, meta, images, labels, in_ch, base, budget, ddp_extra, pace)

    try:
        search = search_batch(p, precision)
        agreed = search["agreed"]
        choice, batch_rows, loader_rows, prec_rows = choose(p, agreed, precision, device_ok)
        p.resident = None  # the uploaded dataset is not needed any more
    except TuneStopped as e:  # every rank at the same candidate: nothing is written
        pace.say(f"{e.signal} received: stopping before {e.at[0][1]}; tune.json is not "
                 f"written")
        if dist.is_master:  # for the launcher, also when a rank alone was signalled
            write_json_atomic(cfg.run_dir / "tune" / STOPPED, {"signal": e.signal,
                                                                "at_per_rank": e.at})
        distributed.teardown(dist)
        return None
    gathered = distributed.gather_objects(dist, {"rank": dist.rank, "max_batch": search["own_max"],
                                              "trials": search["trials"],
                                              "own_trials": search["own"],
                                              "memory_bytes": search["memory"],
                                              "budget_bytes": budget, "free_bytes": free})
    result = {
        "stage": stage.name, "world_size": dist.world, "device": dist.device.type,
        "device_name": torch.cuda.get_device_name(dist.device) if dist.device.type == "cuda"
        else "cpu", "memory_margin": tc.memory_margin, "memory_cap_mb": cap_mb,
        "device_loader": {"allowed": device_ok, "dataset_bytes": nbytes,
                          "reason": loader_reason, "uploads": p.uploads},
        "batch_search": {"per_rank": gathered, "agreed_max_batch": agreed,
                         "candidates": batch_rows},
        "loader": loader_rows, "precision": prec_rows, "choice": choice,
        "skipped": pace.skipped, "seconds": round(time.monotonic() - pace.t0, 1),
        "config_hash": cfg.hash, "settings": settings.tune_settings(cfg, stage),
    }
    # rank 0's measurements in the file, so that every rank records the same answer
    result = distributed.broadcast_object(dist, result)
    if dist.is_master:
        write_json_atomic(settings.tune_path(cfg), result)
    distributed.teardown(dist)
    return result

