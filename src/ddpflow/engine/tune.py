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
     The device loader's dataset is uploaded once per tune and shared by every candidate;
     the allocator's cache is released between candidates (tunephases.py).
  3. precision and layout: fp32 (TF32 on, as training runs it), bf16, fp16 (with its
     GradScaler); channels_last; torch.compile if asked. fp16 beats bf16 only when more
     than 10% faster (tunephases.FP16_MARGIN). A candidate whose step does not fit
     at the chosen batch (fp32 needs about twice bf16's activations) is recorded as such and
     never run under DDP: an OOM inside DDP would kill the rank.
The choices are greedy, one after the other, and rank 0's choice of each phase is broadcast,
so every rank measures the next phase with the same settings and records the same answer.
Every measurement and the choice go into <run>/tune.json; stages with batch_size: auto,
precision: auto and data.loader: auto use it.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from ddpflow.config import Config, StageCfg
from ddpflow.core import reading
from ddpflow.core.errors import UserError
from ddpflow.core.writing import write_json_atomic
from ddpflow.data import prepared
from ddpflow.data.loaders import choose_loader
from ddpflow.data.prepare import settings_fingerprint
from ddpflow.engine import distributed, sharding
from ddpflow.engine.build import model_blocks
from ddpflow.engine.runtime import pick_precision
from ddpflow.engine.stepmemory import (
    memory_budget,
)
from ddpflow.engine.tunepace import Pace, TuneStopped
from ddpflow.engine.tunephases import Probe, all_min, choose, search_batch
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
            "activation_checkpointing": (list(st.activation_checkpointing) if isinstance(
                st.activation_checkpointing, tuple) else st.activation_checkpointing),
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
        # (strategy fsdp: tune measures it uncompiled, see tunephases.measure)
        out.compile = out.compile or (tuned["compile"] and st.strategy != "fsdp")
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


def model_extra(base, blocks: list, d, strategy: str) -> int:
    """Bytes a rank's step needs beyond the plain model's (weights, gradients, one optimizer
    state: what stepmemory.step_memory counts). DDP keeps a second copy of the gradients in
    its buckets; FSDP keeps 1/world of the three, and gathers a block's weights (and its
    gradients before they are reduce-scattered) at a time."""
    def size(m) -> int:
        return sum(q.numel() * q.element_size() for q in m.parameters())
    if strategy == "fsdp":
        biggest = max(map(size, blocks)) if blocks else size(base)
        return int(-3 * size(base) * (1 - 1 / d.world) + 2 * biggest)
    return size(base) if d.backend else 0


def run(cfg: Config, stage_name: str, cap_mb: list[float] | None = None) -> dict | None:
    """One rank's tuning; the result (also in tune.json), or None when stopped."""
    st: StageCfg = cfg.stage(stage_name)
    tc = cfg.tune
    d = distributed.setup(cfg.hardware, "always" if st.strategy == "fsdp" else True)
    distributed.seed_everything(cfg.seed, d.rank, deterministic=False)
    if d.device.type == "cuda":  # fp32 is measured as training runs it: TF32 tensor cores
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    meta, arrays = prepared.load(cfg.data_dir)
    images, labels = arrays["train"]
    in_ch = input_channels(cfg.model.name, meta["image_shape"][2])
    precision = pick_precision("auto" if st.precision == "auto" else st.precision, d.device)
    base = build_model(cfg.model, meta["num_classes"], in_ch, probe(cfg, meta)).to(d.device)
    checkpointed, blocks = model_blocks(cfg, st, base)
    sharding.checkpoint_blocks(checkpointed)  # the memory trials keep what training keeps
    free = memory_budget(d, cap_mb)
    # the device loader only where training would allow it; then the dataset (train and
    # val, as it keeps them) is on the device, and the steps get what is left
    nbytes = sum(a.nbytes for split in ("train", "val") for a in arrays[split])
    kind, loader_reason = choose_loader(cfg.data.loader, nbytes, d.device,
                                        cfg.data.device_memory_fraction, free=free)
    device_ok = bool(all_min(d, int(kind == "device")))
    budget = int((free - (nbytes if device_ok else 0)) * (1 - tc.memory_margin))
    ddp_extra = model_extra(base, blocks, d, st.strategy)
    # on a CPU without a cap nothing runs out of memory: throughput ends the climb instead
    pace = Pace(d, tc.budget_s, climb_by_throughput=d.device.type == "cpu" and not cap_mb)
    p = Probe(cfg, st, d, meta, images, labels, in_ch, base, budget, ddp_extra, pace)

    try:
        search = search_batch(p, precision)
        agreed = search["agreed"]
        choice, batch_rows, loader_rows, prec_rows = choose(p, agreed, precision, device_ok)
        p.resident = None  # the uploaded dataset is not needed any more
    except TuneStopped as e:  # every rank at the same candidate: nothing is written
        pace.say(f"{e} received: stopping; tune.json is not written")
        distributed.teardown(d)
        return None
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
                          "reason": loader_reason, "uploads": p.uploads},
        "batch_search": {"per_rank": gathered, "agreed_max_batch": agreed,
                         "candidates": batch_rows},
        "loader": loader_rows, "precision": prec_rows, "choice": choice,
        "skipped": pace.skipped, "seconds": round(time.monotonic() - pace.t0, 1),
        "config_hash": cfg.hash, "settings": tune_settings(cfg, st),
    }
    # rank 0's measurements in the file, so that every rank records the same answer
    result = distributed.broadcast_object(d, result)
    if d.is_master:
        write_json_atomic(tune_path(cfg), result)
    distributed.teardown(d)
    return result


