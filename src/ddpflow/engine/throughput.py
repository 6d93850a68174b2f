"""The throughput of one training configuration, measured as the trainer runs it: the model
built and wrapped as training wraps it (checkpointed blocks, DDP or FSDP, compiled if asked),
the stage's own optimizer, schedule, GradScaler and task, the input pipeline with these
loader settings, and the trainer's own `micro_step` and `update` (step.py). `ddpflow tune`
compares candidates with it (tune.py); a candidate's model, optimizer and batches are
released before the next (`release`).
"""

from __future__ import annotations

import gc
import time

import torch

from ddpflow.data.loaders import Normalize, TrainBatches, forever
from ddpflow.engine import distributed, sharding, tunebudget
from ddpflow.engine.build import model_blocks, optimizer_parts
from ddpflow.engine.state import TrainState
from ddpflow.engine.step import StepCounters, micro_step, update
from ddpflow.seams.models import build_model
from ddpflow.seams.tasks import build_task

WARMUP_STEPS = 2  # steps before the clock starts (allocations, the first kernels)


def measure(p, batch: int, loader: str, workers: int, prefetch, precision: str,
            channels_last: bool, compile_: bool) -> dict:
    """samples/s of real training steps with these settings, and the share of time spent
    waiting for data (every rank; `p`: tune.Probe, the measurement's shared parts)."""
    cfg, stage, dist, meta = p.cfg, p.stage, p.dist, p.meta
    model = build_model(cfg.model, meta["num_classes"], p.in_ch).to(dist.device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = wrap_as_trained(model, cfg, stage, dist, precision)
    run_model = torch.compile(model) if compile_ and stage.strategy != "fsdp" else model
    steps = cfg.tune.steps + WARMUP_STEPS
    _lr, opt, sched, scaler, autocast = optimizer_parts(model, stage, batch * dist.world, steps,
                                                        steps, precision, dist.device)
    task = build_task(cfg, stage, meta["num_classes"])
    norm = Normalize(meta["mean"], meta["std"], dist.device, p.in_ch, channels_last)
    tb = TrainBatches(loader, p.images, p.labels, batch, dist.device, dist.world, dist.rank,
                      cfg.seed, cfg.data.augment, norm, workers, cfg.data.pin_memory, workers > 0,
                      prefetch, image_size=cfg.data.image_size,
                      resident=p.device_data() if loader == "device" else None)
    batches, counters = forever(tb.epoch), StepCounters(TrainState(), dist.device)
    wait, n = 0.0, 0
    for i in tunebudget.step_indices(p.pace, cfg.tune.steps, dist.device):  # cut to the budget
        if i == WARMUP_STEPS:
            if dist.device.type == "cuda":
                torch.cuda.synchronize(dist.device)
            t0, wait, n = time.perf_counter(), 0.0, 0
        tw = time.perf_counter()
        b = next(batches)
        wait += time.perf_counter() - tw
        loss = micro_step(run_model, b, task, autocast, scaler, 1)
        counters.add_loss(loss)
        update(model, opt, sched, scaler, stage.grad_clip, counters)
        n += len(b[1])
    if dist.device.type == "cuda":
        torch.cuda.synchronize(dist.device)  # sync point: the timed steps have really run
    dt = time.perf_counter() - t0
    return {"samples_per_s": n / dt * dist.world, "data_wait_fraction": wait / dt}


def wrap_as_trained(model, cfg, stage, dist, precision: str):
    """The model as the trainer runs it: its checkpointed blocks, then FSDP or DDP."""
    checkpointed, blocks = model_blocks(cfg, stage, model)
    sharding.checkpoint_blocks(checkpointed)
    if stage.strategy == "fsdp":
        sharding.shard(model, blocks, precision, stage.reshard_after_forward)
        return model
    return distributed.wrap_ddp(model, dist)


def release(device: torch.device) -> None:
    """After a candidate: its model, optimizer and batches are garbage (DDP's reducer holds
    cycles): collected, and the allocator's cached blocks go back, so the next candidate
    (another precision or layout, other block sizes) starts from the same free memory. On a
    CPU there is no cache to release."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
