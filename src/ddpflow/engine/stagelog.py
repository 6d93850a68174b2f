"""What a training stage writes besides checkpoints and its log lines (intervals.py):
best.pt, final.pt, failed.json and summary.json (last, only for a finished stage). Each
function takes what it writes as arguments (state.py's StageFiles, StageSetup and
TrainState, and the live figures), never the Trainer."""

from __future__ import annotations

import os
import time

from ddpflow.engine import checkpoint, earlystop, stragglers
from ddpflow.engine.runtime import environment
from ddpflow.engine.state import StageEnd, StageFiles, StageSetup, TrainState
from ddpflow.results.metrics import efficiency_means, read_records
from ddpflow.results.summary import write_summary
from ddpflow.results.wallclock import summary_block


def stage_summary(files: StageFiles, setup: StageSetup, state: TrainState, wall: dict,
                  end: StageEnd, final_sha: str | None) -> dict:
    """summary.json of a finished stage: results, efficiency means, what it ran on, and the
    record of what it was made from (wall: wallclock.summary_block of all its runs; end: how
    this process ended, its figures)."""
    train_time_s = time.perf_counter() - end.train_t0  # as summary.json is written
    records, problems = read_records(files.out / "metrics.jsonl")
    last_val = [r for r in records if r["kind"] == "val"][-1]
    final = {k: v for k, v in last_val.items() if k.startswith("val_")}
    best = state.best.get("metrics", {})
    summary = {
        "stage": files.stage, "finished": True, "steps": state.step, "epochs": state.epoch,
        "task": files.config["task"]["name"], "monitor": files.monitor,
        "monitor_mode": files.mode,
        "final_metrics": final, "best_metrics": best, "best_value": state.best.get("value"),
        "final_val_acc": final.get("val_acc"), "final_val_loss": final.get("val_loss"),
        "best_val_acc": best.get("val_acc"), "best_val_loss": best.get("val_loss"),
        "best_step": state.best.get("step"),
        # the test split, on the weights handed on, after selection: {} = no test split
        "test_metrics": end.test_metrics, **end.test_metrics,
        **earlystop.summary(state.stop),  # early_stop (why, or None), target and time_to_target_s
        "weights": "ema" if setup.ema else "raw",  # what final.pt/best.pt's "model" holds
        "final_train_loss": [r for r in records if r["kind"] == "train"][-1]["loss"],
        # from the command to the result, all runs of the stage (the launcher adds its end)
        "wall_time_s": wall["total_s"], "wall": wall,
        "train_time_s": train_time_s,  # the loop's part
        **efficiency_means(records),
        "steady_state_excludes": "start-up, each run's first log interval, validation, "
                                 "checkpoint stalls, steps after an epoch's last log line, "
                                 "teardown (wall_samples_per_s includes everything)",
        "wall_samples_per_s": wall["samples_per_s"],
        "flops_per_sample": (end.flops_per_micro / setup.batch_size if end.flops_per_micro
                             else None),
        "peak_flops_per_gpu": setup.peak, "gpus_per_rank": len(setup.devices),
        "world_size": setup.world, "device": setup.device.type, "backend": setup.backend,
        "precision": setup.precision, "strategy": setup.strategy, "wrapper": setup.wrapper,
        "sharding": setup.sharding, "checkpointed_blocks": setup.checkpointed,
        # MiB per rank by kind (memory.py), rank order; the report shows the largest
        "memory_per_rank": end.memory or [],
        "batch_size_per_rank": setup.batch_size, "grad_accum_steps": setup.accum,
        "channels_last": setup.channels_last, "layout_reason": setup.layout_reason,
        "compile": setup.compile, "tuned": setup.tuned,
        "compiled_graphs": compiled_graphs() if setup.compile else None,  # > 0: it did compile
        "global_batch": setup.global_batch, "lr_effective": setup.lr,
        "skipped_steps": end.skipped,
        "loader": setup.loader, "loader_reason": setup.loader_reason,
        "init": setup.init,
        "container": os.environ.get("DDPFLOW_IN_CONTAINER"),
        "params": setup.params, "trainable_params": setup.trainable_params,
        "metrics_problems": problems,
        "rank_weight_sha256": end.weight_hashes, "rank_hosts": end.rank_hosts,
        # the ranks that held every step back, their host, how often and why (stragglers.py)
        "stragglers": stragglers.summary(records),
        "environment": environment(setup.device),
        "weights_in_sync": len(set(end.weight_hashes)) == 1,
        "config": files.config, "config_hash": files.config_hash,
        "stage_hash": files.stage_hash, "record": files.record,
        "final_sha256": final_sha,
    }
    write_summary(files.out / "summary.json", summary)
    return summary


def wall_block(clock, state: TrainState, global_batch: int) -> dict:
    """The wall split of every run of the stage so far (summary.json "wall")."""
    clock.lap("teardown")
    return summary_block(clock, state.wall_s, state.runs + 1, state.step * global_batch)


def compiled_graphs() -> int:
    """How many graphs torch.compile built in this process (Dynamo's own counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def write_failure(files: StageFiles, reason: str, step: int) -> None:
    """failed.json: why the stage stopped (a NaN/inf loss) and what it was made from."""
    write_summary(files.out / "failed.json", {"stage": files.stage, "reason": reason,
                                              "step": step, "record": files.record})


def handed_on(model: dict, ema: dict | None) -> dict:
    """"model" is what the stage hands on (the EMA's weights when stages[].ema is on, then
    the trained ones as "model_raw"); "weights" says which."""
    if ema is None:
        return {"model": model, "weights": "raw"}
    return {"model": ema, "weights": "ema", "model_raw": model}


def write_final(files: StageFiles, model: dict, ema: dict | None, step: int) -> str:
    """final.pt (the weights, config and record); returns its SHA-256."""
    return checkpoint.save_file(files.out / "final.pt", {
        **handed_on(model, ema), "config": files.config, "step": step, "record": files.record})


def write_best(files: StageFiles, model: dict, best: dict, ema: dict | None = None) -> None:
    """best.pt: the weights (`model`, a state dict; `ema`, the average's) of the best
    validation result so far by task.monitor (`best`: TrainState.best when copied)."""
    checkpoint.save_file(files.out / "best.pt", {
        **handed_on(model, ema), "config": files.config, "step": best["step"],
        "monitor": files.monitor, "value": best["value"], "record": files.record})


def write_results(files: StageFiles, setup: StageSetup, state: TrainState, end: StageEnd, clock,
                  log, checkpointer, trackers, say) -> None:
    """Rank 0 at the stage's end: failed.json, or final.pt and summary.json (only for a
    finished stage), after the last background save (`checkpointer`); the metrics log closed, the
    trackers told how it ended."""
    if end.test_metrics:
        log.write({"kind": "test", "step": state.step, "epoch": state.epoch,
                   "weights": "ema" if setup.ema else "raw", **end.test_metrics})
    log.close()
    finished = not end.diverged and not end.halted
    final_sha = write_final(files, end.model, end.ema, state.step) if finished else None
    clock.lap("teardown")  # final.pt is written while the last checkpoint is
    checkpointer.wait()  # the last save is complete before the stage ends or stops
    clock.lap("checkpoint")
    if end.diverged:
        write_failure(files, end.diverged, state.step)
        say(f"stopped: {end.diverged}")
    elif finished:
        wall = wall_block(clock, state, setup.global_batch)
        summary = stage_summary(files, setup, state, wall, end, final_sha)
        if trackers:
            trackers.stage_end(files.config, summary["final_metrics"],
                               [files.out / "summary.json", files.out / "metrics.jsonl"])
        say(f"done: {files.out / 'summary.json'}")
    if trackers:  # event files complete, MLflow run ended when the stage ends
        trackers.close("FAILED" if end.diverged else "KILLED" if end.halted else "FINISHED")
