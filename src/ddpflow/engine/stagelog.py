"""What a training stage writes besides checkpoints: the `train` lines of metrics.jsonl
(one per log interval) and summary.json (last, only for a finished stage). Both read the
`Trainer` (train.py) they describe."""

from __future__ import annotations

import os
import time

from ddpflow.engine import checkpoint, earlystop
from ddpflow.engine.runtime import environment, peak_memory_mib
from ddpflow.results.metrics import efficiency_means, read_records
from ddpflow.results.summary import write_summary
from ddpflow.results.wallclock import summary_block
from ddpflow.seams.models import param_count, unwrap


def interval_record(t, per_rank: list, dt: float, wait: float, n: int, loss: float,
                    now: float) -> dict:
    """One log interval of n optimizer steps over dt seconds (wait: blocked on data)."""
    s, d = t.state, t.d
    per_sample = t.batch_size * t.accum * n
    # all ranks do the same work: rank 0's FLOPs x world = the job's FLOPs
    flops_s = t.flops_per_micro * t.accum * n * d.world / dt
    util, gpu_mem = t.gpu.interval()
    return {
        "kind": "train", "step": s.step, "epoch": s.epoch, "loss": loss,
        "lr": t.sched.get_last_lr()[0],
        "samples_per_s": per_sample * d.world / dt,
        "samples_per_s_per_rank": [per_sample / (r[0] * n) for r in per_rank],
        "compute_samples_per_s": per_sample * d.world / max(dt - wait, 1e-9),
        "tflops": flops_s / 1e12,
        "mfu": flops_s / (t.peak * d.world * len(t.devices)) if t.peak else None,
        "gpu_util": util, "gpu_mem_mib": gpu_mem,
        "step_time_s": dt / n, "step_time_s_per_rank": [r[0] for r in per_rank],
        "data_wait_fraction": wait / dt, "peak_mem_mib": max(peak_memory_mib(v) for v in t.devices),
        "grad_scale": t.scaler.get_scale() if t.scaler.is_enabled() else None,
        "skipped_steps": int(t.skipped.item()),
        "warmup": t.first_interval, "time_s": s.elapsed_s + now - t.t_start}


def stage_summary(t) -> dict:
    """summary.json of a finished stage: results, efficiency means, what it ran on, and the
    record of what it was made from."""
    s, d, cfg = t.state, t.d, t.cfg
    t.clock.lap("teardown")
    wall = summary_block(t.clock, s.wall_s, s.runs + 1, s.step * t.global_batch)
    records, problems = read_records(t.out / "metrics.jsonl")
    last_val = [r for r in records if r["kind"] == "val"][-1]
    final = {k: v for k, v in last_val.items() if k.startswith("val_")}
    best = s.best.get("metrics", {})
    summary = {
        "stage": t.st.name, "finished": True, "steps": s.step, "epochs": s.epoch,
        "task": cfg.task.name, "monitor": t.monitor, "monitor_mode": t.mode,
        "final_metrics": final, "best_metrics": best, "best_value": s.best.get("value"),
        "final_val_acc": final.get("val_acc"), "final_val_loss": final.get("val_loss"),
        "best_val_acc": best.get("val_acc"), "best_val_loss": best.get("val_loss"),
        "best_step": s.best.get("step"),
        # the test split, on the weights handed on, after selection: {} = no test split
        "test_metrics": t.test_metrics, **t.test_metrics,
        **earlystop.summary(t),  # early_stop (why, or None), target and time_to_target_s
        "weights": "ema" if t.ema else "raw",  # what final.pt/best.pt's "model" holds
        "final_train_loss": [r for r in records if r["kind"] == "train"][-1]["loss"],
        # from the command to the result, all runs of the stage (the launcher adds its end)
        "wall_time_s": wall["total_s"], "wall": wall,
        "train_time_s": s.elapsed_s + time.perf_counter() - t.t_start,  # the loop's part
        **efficiency_means(records),
        "steady_state_excludes": "start-up, each run's first log interval, validation, "
                                 "checkpoint stalls, steps after an epoch's last log line, "
                                 "teardown (wall_samples_per_s includes everything)",
        "wall_samples_per_s": wall["samples_per_s"],
        "flops_per_sample": (t.flops_per_micro / t.batch_size if t.flops_per_micro else None),
        "peak_flops_per_gpu": t.peak, "gpus_per_rank": len(t.devices),
        "world_size": d.world, "device": d.device.type, "backend": d.backend,
        "precision": t.precision, "strategy": t.st.strategy,
        "wrapper": type(t.model).__name__ if t.model is not unwrap(t.model) else None,
        "batch_size_per_rank": t.batch_size, "grad_accum_steps": t.accum,
        "channels_last": t.channels_last, "layout_reason": t.layout_reason,
        "compile": t.compile, "tuned": t.tuned,
        "compiled_graphs": compiled_graphs() if t.compile else None,  # > 0: it did compile
        "global_batch": t.global_batch, "lr_effective": t.lr,
        "skipped_steps": int(t.skipped.item()),
        "loader": t.data.kind, "loader_reason": t.data.reason,
        "init": t.init_report,
        "container": os.environ.get("DDPFLOW_IN_CONTAINER"),
        "params": param_count(unwrap(t.model)),
        "trainable_params": sum(p.numel() for p in unwrap(t.model).parameters()
                                if p.requires_grad),
        "metrics_problems": problems,
        "rank_weight_sha256": t.weight_hashes, "rank_hosts": t.rank_hosts,
        "environment": environment(d.device),
        "weights_in_sync": len(set(t.weight_hashes)) == 1,
        "config": cfg.to_dict(), "config_hash": cfg.hash,
        "stage_hash": cfg.stage_hash(t.st.name), "record": t.record,
        "final_sha256": t.final_sha,
    }
    write_summary(t.out / "summary.json", summary)
    return summary


def compiled_graphs() -> int:
    """How many graphs torch.compile built in this process (Dynamo's own counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def write_failure(t) -> None:
    """failed.json: why the stage stopped (a NaN/inf loss) and what it was made from."""
    write_summary(t.out / "failed.json", {"stage": t.st.name, "reason": t.diverged,
                                          "step": t.state.step, "record": t.record})


def handed_on(model: dict, ema: dict | None) -> dict:
    """"model" is what the stage hands on (the EMA's weights when stages[].ema is on, then
    the trained ones as "model_raw"); "weights" says which."""
    if ema is None:
        return {"model": model, "weights": "raw"}
    return {"model": ema, "weights": "ema", "model_raw": model}


def write_final(t) -> str:
    """final.pt (the weights, config and record); returns its SHA-256."""
    return checkpoint.save_file(t.out / "final.pt", {
        **handed_on(unwrap(t.model).state_dict(), t.ema.weights() if t.ema else None),
        "config": t.cfg.to_dict(), "step": t.state.step, "record": t.record})


def write_best(t, model: dict, best: dict, ema: dict | None = None) -> None:
    """best.pt: the weights (`model`, a state dict; `ema`, the average's) of the best
    validation result so far by task.monitor (`best`: TrainState.best when copied)."""
    checkpoint.save_file(t.out / "best.pt", {
        **handed_on(model, ema), "config": t.cfg.to_dict(), "step": best["step"],
        "monitor": t.monitor, "value": best["value"], "record": t.record})


def write_results(t) -> None:
    """Rank 0 at the stage's end: failed.json, or final.pt and summary.json (only for a
    finished stage), after the last background save; the trackers get the end."""
    if t.test_metrics:
        t.log.write({"kind": "test", "step": t.state.step, "epoch": t.state.epoch,
                     "weights": "ema" if t.ema else "raw", **t.test_metrics})
    t.log.close()
    if not t.diverged and not t.halted:
        t.final_sha = write_final(t)  # while the last checkpoint is being written
    t.clock.lap("teardown")
    t.saver.wait()  # the last save is complete before the stage ends or stops
    t.clock.lap("checkpoint")
    if t.diverged:
        write_failure(t)
        t.say(f"stopped: {t.diverged}")
    elif not t.halted:
        summary = stage_summary(t)
        if t.trackers:
            t.trackers.stage_end(t.cfg.to_dict(), summary["final_metrics"],
                                 [t.out / "summary.json", t.out / "metrics.jsonl"])
        t.say(f"done: {t.out / 'summary.json'}")
    if t.trackers:  # event files complete, MLflow run ended when the stage ends
        t.trackers.close("FAILED" if t.diverged else "KILLED" if t.halted else "FINISHED")
