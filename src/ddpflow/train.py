"""Train one stage with DistributedDataParallel + automatic mixed precision.

Every rank of the node runs this, started by torchrun (`ddpflow launch` builds the line):

    torchrun --nnodes=1 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29500 \
        --max-restarts=2 -m ddpflow train --resolved results/<run>/stages/<stage>/config.json \
        --stage <stage>

On CPU the same line with --nproc_per_node=2 trains 2 gloo ranks. Rank 0 alone writes
files and shows the progress bar. Reading order: setup, data, model, optimizer and
precision, resume, the loop, the end of the stage.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from . import checkpoint, distributed, stopflag
from .config import Config, config_hash
from .data import prepared
from .data.loaders import Normalize, TrainBatches, choose_loader, val_batches
from .efficiency import FlopCount, GpuSampler, peak_flops
from .errors import UserError
from .metrics import MetricsLog, efficiency_means, read_records
from .models import build_model, input_channels, param_count, unwrap
from .provenance import init_source, make_record
from .runtime import (
    StopPoll,
    build_optimizer,
    environment,
    lr_factor,
    peak_memory_mib,
    pick_precision,
    schedule,
    trace_file,
    weights_sha256,
)
from .summary import write_summary
from .tune import load_choice, tune_path


def train_stage(cfg: Config, stage_name: str, halt_after_steps: int | None = None) -> int:
    """Run (or resume) one stage. Returns 0 when it finished or stopped at a checkpoint."""
    st = cfg.stage(stage_name)
    out = cfg.stage_dir(st.name)
    ckpt_dir = out / "checkpoints"

    # ---------------------------------------------------------------- setup
    d = distributed.setup(cfg.hardware, process_group=st.strategy == "ddp")
    distributed.seed_everything(cfg.seed, d.rank, cfg.deterministic)
    # "auto" settings come from tune.json where `ddpflow tune` has measured this node
    tuned, mismatch = load_choice(cfg, st)
    batch_size = st.batch_size
    if batch_size == "auto":
        if tuned is None:
            raise UserError(f"stages.{cfg.stage_index(st.name)}.batch_size is auto but "
                            + (mismatch or f"there is no {tune_path(cfg)}; run `ddpflow tune` "
                               f"first"))
        batch_size = tuned["batch_size"]
    channels_last, compile_model = st.channels_last, st.compile
    if st.precision == "auto" and tuned:
        precision, channels_last = tuned["precision"], tuned["channels_last"]
        compile_model = compile_model or tuned["compile"]
    else:
        precision = pick_precision(st.precision, d.device)
    if d.device.type == "cuda" and precision == "fp32":
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 tensor cores for fp32 matmuls/convs
        torch.backends.cudnn.allow_tf32 = True
    stopflag.install()  # (again: `ddpflow train` installs it before its imports)

    def say(msg: str) -> None:
        if d.is_master:
            tqdm.write(f"[{st.name}] {msg}", file=sys.stderr)

    if mismatch:
        say(f"not using tune.json: {mismatch}")

    # ---------------------------------------------------------------- data
    meta, arrays = prepared.load(cfg.data_dir)
    (train_x, train_y), (val_x, val_y) = arrays["train"], arrays["val"]
    nbytes = sum(a.nbytes for pair in arrays.values() for a in pair)
    workers, prefetch = cfg.data.num_workers, cfg.data.prefetch_factor
    if cfg.data.loader == "auto" and tuned:
        loader_kind, workers, prefetch = (tuned["loader"], tuned["num_workers"],
                                          tuned["prefetch_factor"])
        loader_reason = f"measured fastest by ddpflow tune ({tune_path(cfg)})"
    else:
        loader_kind, loader_reason = choose_loader(cfg.data.loader, nbytes, d.device,
                                                   cfg.data.device_memory_fraction)
    say(f"loader: {loader_kind} ({loader_reason})")
    in_ch = input_channels(cfg.model.name, meta["image_shape"][2])
    normalize = Normalize(meta["mean"], meta["std"], d.device, in_ch, channels_last)
    batches = TrainBatches(
        loader_kind, train_x, train_y, batch_size, d.device, d.world, d.rank, cfg.seed,
        cfg.data.augment, normalize, workers, cfg.data.pin_memory,
        cfg.data.persistent_workers, prefetch, trace=trace_file(d.rank))
    accum = st.grad_accum_steps
    steps_per_epoch = len(batches) // accum  # optimizer steps; a trailing partial group is dropped
    if steps_per_epoch == 0:
        raise UserError(f"stages.{cfg.stage_index(st.name)}.batch_size {batch_size} x "
                        f"{d.world} ranks x {accum} accumulation exceeds the "
                        f"{len(train_y)} training samples; lower the batch size")
    total_steps = st.max_steps or st.epochs * steps_per_epoch
    global_batch = batch_size * d.world * accum

    # ---------------------------------------------------------------- model
    model = build_model(cfg.model.name, meta["num_classes"], in_ch)
    src = init_source(cfg, st.name)
    if src is not None:
        setting = f"stages.{cfg.stage_index(st.name)}.init_from {src}"
        if not src.is_file():
            raise UserError(f"{setting} does not exist; run the earlier stage first or fix "
                            f"the path")
        weights = checkpoint.load_weights(src, setting)
        checkpoint.check_fits(model, weights, setting)
        model.load_state_dict(weights)
        say(f"initialised from {src}")
    model.to(d.device)
    if channels_last:
        model.to(memory_format=torch.channels_last)
    if d.backend and cfg.model.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if st.strategy == "dp":  # baseline only: one process driving every visible GPU
        model = nn.DataParallel(model)  # without GPUs it calls the module as it is
    else:
        model = distributed.wrap_ddp(model, d)  # DDP when more than one rank trains
    train_model = torch.compile(model) if compile_model else model

    # ---------------------------------------------------------------- optimizer, precision
    lr = st.lr * lr_factor(st.lr_scaling, global_batch, st.lr_reference_batch)
    opt = build_optimizer(model, st, lr, d.device)  # fused kernel where the device has one
    warmup = round(st.warmup_epochs * steps_per_epoch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(st.schedule, warmup, total_steps))
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(d.device.type, enabled=precision == "fp16")
    criterion = nn.CrossEntropyLoss(label_smoothing=st.label_smoothing)
    autocast = torch.autocast(d.device.type, dtype=amp_dtype, enabled=amp_dtype is not None)

    # ---------------------------------------------------------------- resume
    step, epoch, start_in_epoch, elapsed = 0, 0, 0, 0.0
    diverged = None  # the reason, once a NaN/inf loss has been seen on any rank
    best = {"val_acc": -1.0, "val_loss": None, "step": None, "epoch": None}
    loss_carry, loss_count = 0.0, 0  # a resumed log interval's partial loss sum
    skipped_carry = 0
    # what this stage's results are made from; checkpoints of other inputs are not resumed
    record = make_record(cfg, st.name, meta["fingerprint"],
                         checkpoint.sha256_of(src) if src is not None else None)
    resume_key = config_hash(record)
    found = (checkpoint.latest_valid(ckpt_dir, resume_key,
                                     warn=print if d.is_master else lambda *a, **k: None)
             if cfg.checkpoint.resume == "auto" else None)
    if found:
        path, state = found
        unwrap(model).load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        step, epoch, start_in_epoch = state["step"], state["epoch"], state["step_in_epoch"]
        elapsed, best = state["elapsed_s"], state["best"]
        loss_carry, loss_count = state["loss_sum"], state["loss_count"]
        skipped_carry = state.get("skipped_steps", 0)
        if len(state["rng"]) == d.world:
            distributed.set_rng_state(state["rng"][d.rank], d.device)
        say(f"resumed from {path.name}: step {step}, epoch {epoch}")
    distributed.gather_objects(d, None)  # barrier: every rank has read its checkpoint
    if d.is_master:
        (out / "failed.json").unlink(missing_ok=True)
        checkpoint.remove_partial(ckpt_dir)  # temp files of a write that was killed
        if not found:
            checkpoint.set_aside(ckpt_dir)  # never mix a fresh run's checkpoints with stale ones
    log = MetricsLog(out / "metrics.jsonl", keep_until_step=step) if d.is_master else None

    def divergence(bad_steps: list[int], loss_value: float | str = "NaN/inf") -> str:
        return (f"loss became {loss_value} at step {min(bad_steps)} (epoch {epoch}); lower "
                f"stages.{cfg.stage_index(st.name)}.lr, add grad_clip or use bf16/fp32")

    def save_checkpoint() -> bool:
        """Checkpoint unless some rank's loss went bad since the last one (then False)."""
        nonlocal diverged
        # a collective (every rank's RNG state, first bad step) and I/O on rank 0: a sync point
        gathered = distributed.gather_objects(
            d, (distributed.rng_state(d.device), int(first_bad.item())))
        rngs = [g[0] for g in gathered]
        bad_steps = [g[1] for g in gathered if g[1] >= 0]
        if bad_steps:  # never save weights that a NaN/inf loss has already touched
            diverged = divergence(bad_steps)
            return False
        if d.is_master:
            state = {
                "model": unwrap(model).state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "scaler": scaler.state_dict(),
                "step": step, "epoch": epoch, "step_in_epoch": in_epoch * accum,
                "elapsed_s": elapsed + time.perf_counter() - t_start, "best": best,
                "loss_sum": float(loss_sum.item()), "loss_count": loss_count,
                "skipped_steps": int(skipped.item()),
                "rng": rngs, "stage": st.name, "config": cfg.to_dict(),
                "config_hash": cfg.hash, "stage_hash": cfg.stage_hash(st.name),
                "resume_key": resume_key, "record": record,
            }
            checkpoint.save(ckpt_dir, step, state, cfg.checkpoint.keep_last)
        return True

    # ---------------------------------------------------------------- the loop
    say(f"{cfg.model.name} ({param_count(model) / 1e6:.2f} M params) on {d.world} x "
        f"{d.device.type}, {precision}, global batch {global_batch} "
        f"({batch_size}/rank x {d.world} x {accum} accum), lr {lr:g}, {total_steps} steps")
    bar = tqdm(total=total_steps, initial=step, desc=st.name, unit="step", file=sys.stderr,
               disable=not d.is_master or None, dynamic_ncols=True, mininterval=1.0)
    t_start = time.perf_counter()
    # summed on the device in float64 (no sync per step); restored exactly on resume
    loss_sum = torch.tensor(loss_carry, dtype=torch.float64, device=d.device)
    step_dev = torch.tensor(step + 1, device=d.device)  # the step being computed, on device
    first_bad = torch.tensor(-1, device=d.device)  # first step with a NaN/inf loss
    skipped = torch.tensor(skipped_carry, device=d.device)  # fp16 steps the scaler skipped
    first_interval = True
    in_epoch = start_in_epoch // accum
    flops_per_micro = None  # FLOPs of one micro-batch, forward + backward, counted once
    peak = peak_flops(d.device, precision)  # per GPU, or None (CPU, unknown GPU)
    gpu = GpuSampler(d.device) if d.is_master else None
    halted = False
    stop_poll = StopPoll(cfg.stop_check_s, step)
    # an epoch whose steps are done but not yet validated (stopped at its last step) is
    # validated on resume: in_epoch > 0 until the epoch's validation has run
    while (step < total_steps or in_epoch > 0) and not halted:
        train_model.train()
        t_interval, wait, n_interval = time.perf_counter(), 0.0, 0
        it = batches.epoch(epoch, start_in_epoch)
        start_in_epoch = 0
        while in_epoch < steps_per_epoch and step < total_steps:
            for micro in range(accum):
                t0 = time.perf_counter()
                x, y = next(it)
                wait += time.perf_counter() - t0  # host time blocked waiting for the batch
                # all-reduce gradients only on the last micro-batch of an accumulation group
                last = micro == accum - 1 or not hasattr(model, "no_sync")
                counter = FlopCount() if flops_per_micro is None else nullcontext()
                with counter, nullcontext() if last else model.no_sync():
                    with autocast:
                        loss = criterion(train_model(x), y) / accum
                    scaler.scale(loss).backward()
                if flops_per_micro is None:
                    flops_per_micro = counter.total
                loss_sum += loss.detach()
                # remember the first step whose loss is not finite (device ops, no sync)
                first_bad = torch.where((first_bad < 0) & ~torch.isfinite(loss.detach()),
                                        step_dev, first_bad)
            if st.grad_clip:
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), st.grad_clip)
            scale_before = scaler._scale.clone() if scaler.is_enabled() else None
            scaler.step(opt)  # skips the step when fp16 gradients overflowed
            scaler.update()
            if scale_before is not None:  # a skipped step lowered the scale: count it
                skipped += (scaler._scale < scale_before).squeeze()
            opt.zero_grad(set_to_none=True)
            sched.step()
            step += 1
            step_dev += 1
            in_epoch += 1
            n_interval += 1
            loss_count += 1
            bar.update(1)

            stop_now = False
            if step % cfg.log_every_steps == 0 or step == total_steps:
                # sync point: loss to host, per-rank timings gathered
                now = time.perf_counter()
                dt = now - t_interval
                loss_value = float(loss_sum.item()) / loss_count
                # one collective: timings, this rank's first bad step, its stop flag
                per_rank = distributed.all_gather_floats(
                    d, [dt / n_interval, wait / dt, float(first_bad.item()),
                        1.0 if stopflag.received() else 0.0])
                bad_steps = [int(r[2]) for r in per_rank if r[2] >= 0]
                if bad_steps:  # every rank sees it and stops; the last checkpoint stays
                    diverged = divergence(bad_steps, loss_value)
                    halted = True
                    break
                if d.is_master:
                    per_sample = batch_size * accum * n_interval
                    # all ranks do the same work: rank 0's FLOPs x world = the job's FLOPs
                    flops_s = flops_per_micro * accum * n_interval * d.world / dt
                    util, gpu_mem = gpu.interval()
                    log.write({
                        "kind": "train", "step": step, "epoch": epoch, "loss": loss_value,
                        "lr": sched.get_last_lr()[0],
                        "samples_per_s": per_sample * d.world / dt,
                        "samples_per_s_per_rank": [per_sample / (t * n_interval)
                                                   for t, *_ in per_rank],
                        "compute_samples_per_s": per_sample * d.world / max(dt - wait, 1e-9),
                        "tflops": flops_s / 1e12,
                        "mfu": flops_s / (peak * d.world) if peak else None,
                        "gpu_util": util, "gpu_mem_mib": gpu_mem,
                        "step_time_s": dt / n_interval,
                        "step_time_s_per_rank": [r[0] for r in per_rank],
                        "data_wait_fraction": wait / dt,
                        "peak_mem_mib": peak_memory_mib(d.device),
                        "grad_scale": scaler.get_scale() if scaler.is_enabled() else None,
                        "skipped_steps": int(skipped.item()),
                        "warmup": first_interval, "time_s": elapsed + now - t_start})
                    bar.set_postfix(loss=f"{loss_value:.3f}", refresh=False)
                loss_sum.zero_()
                loss_count = 0
                first_interval = False
                t_interval, wait, n_interval = time.perf_counter(), 0.0, 0
                stop_poll.seen(step, max(r[0] for r in per_rank))
                stop_now = any(r[3] > 0 for r in per_rank)
            elif stop_poll.due(step):
                # a small collective every ~stop_check_s seconds between log boundaries (a
                # sync point): has any rank been asked to stop?
                per_rank = distributed.all_gather_floats(
                    d, [(time.perf_counter() - t_interval) / n_interval,
                        1.0 if stopflag.received() else 0.0])
                stop_poll.seen(step, max(r[0] for r in per_rank))
                stop_now = any(r[1] > 0 for r in per_rank)
            if stop_now:  # preemption: every rank stops at the same step
                say(f"{stopflag.received() or 'signal'} received: checkpoint at step {step}")
                save_checkpoint()
                halted = True
                break
            if halt_after_steps is not None and step >= halt_after_steps:
                save_checkpoint()
                say(f"halted after step {step} as asked; the checkpoint resumes it")
                halted = True
                break
            if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0:
                if not save_checkpoint():
                    halted = True
                    break
        if halted:
            break

        # ------------------------------------------------------------ end of epoch: validate
        net = unwrap(train_model).eval()  # plain module: ranks may see different batch counts
        distributed.broadcast_buffers(d, net)  # validate every rank with rank 0's BN statistics
        totals = torch.zeros(3, dtype=torch.float64, device=d.device)  # loss sum, correct, count
        with torch.no_grad(), autocast:
            for x, y in val_batches(val_x, val_y, 2 * batch_size, d.device, d.world,
                                    d.rank, normalize):
                logits = net(x).float()
                totals += torch.stack([F.cross_entropy(logits, y, reduction="sum").double(),
                                       (logits.argmax(1) == y).sum().double(),
                                       torch.tensor(float(len(y)), device=d.device).double()])
        val_loss, correct, count = distributed.all_sum(d, totals).tolist()  # sync point
        val_acc, val_loss = correct / max(count, 1), val_loss / max(count, 1)
        if val_acc > best["val_acc"]:
            best = {"val_acc": val_acc, "val_loss": val_loss, "step": step, "epoch": epoch}
            if d.is_master:
                checkpoint.save_file(out / "best.pt", {"model": unwrap(model).state_dict(),
                                                       "config": cfg.to_dict(), "step": step,
                                                       "record": record})
        if d.is_master:
            log.write({"kind": "val", "step": step, "epoch": epoch, "val_loss": val_loss,
                       "val_acc": val_acc, "time_s": elapsed + time.perf_counter() - t_start})
            say(f"epoch {epoch}: val_acc {val_acc:.4f}, val_loss {val_loss:.4f}")
        epoch += 1
        in_epoch = 0
        if not save_checkpoint():
            break
    bar.close()
    if gpu:
        gpu.close()
    # every rank's weights, hashed and gathered: DDP must have kept them identical
    weight_hashes = distributed.gather_objects(d, weights_sha256(unwrap(model)))

    # ---------------------------------------------------------------- end of the stage
    if d.is_master:
        log.close()
        if diverged:
            write_summary(out / "failed.json", {"stage": st.name, "reason": diverged,
                                                "step": step, "record": record})
            say(f"stopped: {diverged}")
        elif not halted:
            final_sha = checkpoint.save_file(out / "final.pt", {
                "model": unwrap(model).state_dict(), "config": cfg.to_dict(), "step": step,
                "record": record})
            records, problems = read_records(out / "metrics.jsonl")
            last_val = [r for r in records if r["kind"] == "val"][-1]
            write_summary(out / "summary.json", {
                "stage": st.name, "finished": True, "steps": step, "epochs": epoch,
                "final_val_acc": last_val["val_acc"], "final_val_loss": last_val["val_loss"],
                "best_val_acc": best["val_acc"], "best_val_loss": best["val_loss"],
                "best_step": best["step"],
                "final_train_loss": [r for r in records if r["kind"] == "train"][-1]["loss"],
                "wall_time_s": elapsed + time.perf_counter() - t_start,
                **efficiency_means(records),
                "flops_per_sample": (flops_per_micro / batch_size
                                     if flops_per_micro else None),
                "peak_flops_per_gpu": peak,
                "world_size": d.world, "device": d.device.type, "backend": d.backend,
                "precision": precision, "strategy": st.strategy,
                "wrapper": type(model).__name__ if model is not unwrap(model) else None,
                "batch_size_per_rank": batch_size, "grad_accum_steps": accum,
                "channels_last": channels_last, "compile": compile_model, "tuned": tuned,
                "global_batch": global_batch, "lr_effective": lr,
                "skipped_steps": int(skipped.item()),
                "loader": loader_kind, "loader_reason": loader_reason,
                "container": os.environ.get("DDPFLOW_IN_CONTAINER"),
                "params": param_count(unwrap(model)), "metrics_problems": problems,
                "rank_weight_sha256": weight_hashes, "environment": environment(d.device),
                "weights_in_sync": len(set(weight_hashes)) == 1,
                "config": cfg.to_dict(), "config_hash": cfg.hash,
                "stage_hash": cfg.stage_hash(st.name), "record": record,
                "final_sha256": final_sha,
            })
            say(f"done: {out / 'summary.json'}")
    distributed.teardown(d)
    return 0


def main(cfg: Config, stage: str, halt_after_steps: int | None = None) -> int:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return train_stage(cfg, stage, halt_after_steps)
