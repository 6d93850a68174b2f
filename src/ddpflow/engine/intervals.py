"""The interval logger of a stage: when a log line is due, what it holds, and the console.

Every `log_every_steps` optimizer steps (and at the stage's last step) the ranks meet once:
the interval's loss comes to the host (a sync point) and one collective carries each rank's
step time, data wait, compute, first bad step and stop flag. Rank 0 writes the `train` line
of metrics.jsonl (and the trackers get it), moves the progress bar or, without a terminal,
prints the line, and names the stragglers (stragglers.py). The logger owns the interval's
clock (start, data wait, compute, steps), the warm-up flag (a run's first interval is left
out of the means), the GPU sampler, the profiler's steps (a trace of a few steps,
tracking/profiling.py) and the rank's heartbeat (heartbeat.py: its last step, for the
report on a stuck rank).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from tqdm import tqdm

from ddpflow.engine import distributed, stopflag
from ddpflow.engine.efficiency import GpuSampler
from ddpflow.engine.runtime import peak_memory_mib
from ddpflow.engine.state import StageSetup, TrainState
from ddpflow.engine.stragglers import ComputeClock, find, text


@dataclass(frozen=True)
class Interval:
    """What the ranks told each other at a log line."""

    bad_steps: list  # (first bad loss step, first bad input step) of each rank that had one
    loss: float  # the interval's mean loss (for the divergence message)
    stop_asked: bool  # some rank received a stop signal
    slowest_step_s: float  # the slowest rank's seconds per step


class IntervalLogger:
    def __init__(self, setup: StageSetup, every: int, start_step: int, name: str, log,
                 is_master: bool, profiler=None, hosts: list | None = None, beat=None):
        self.setup, self.every, self.total, self.name = setup, every, setup.total_steps, name
        self.log = log  # results/metrics.MetricsLog on rank 0, None elsewhere
        self.profiler = profiler  # tracking/profiling.py: a trace of a few steps, or None
        self.hosts = hosts or []  # each rank's host, rank order
        self.beat = beat  # heartbeat.Heartbeat of this rank, or None
        self.compute = ComputeClock(setup.devices[0])  # forward and loss, this rank
        self.named: set[int] = set()  # the stragglers of the last interval
        self.told: set[int] = set()  # those the console was told of
        self.bar = tqdm(total=self.total, initial=start_step, desc=name, unit="step",
                        file=sys.stderr, disable=not is_master or None, dynamic_ncols=True,
                        mininterval=1.0)
        self.gpu = GpuSampler(list(setup.devices)) if is_master else None
        self.warmup = True  # this process's first interval: start-up costs, not counted
        self.restart()

    def restart(self) -> None:
        """A new interval starts now (after a log line, and at each epoch's start)."""
        self.t0, self.wait, self.steps = time.perf_counter(), 0.0, 0
        self.compute.reset()

    def waited(self, seconds: float) -> None:
        self.wait += seconds  # host time blocked on the next batch

    def stepped(self, step: int) -> None:
        """Optimizer step `step` is complete."""
        self.steps += 1
        if self.beat:
            self.beat.beat(step)
        self.bar.update(1)
        if self.profiler:
            self.profiler.step()

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.total

    def write(self, state: TrainState, counters, dist, sched, scaler, flops_per_micro,
              train_t0: float) -> Interval:
        """The log line (every rank: a sync point and one collective); train_t0: the
        perf_counter() at which the stage's training time (earlier runs' too) began."""
        # sync point first: .item() waits for the interval's queued kernels, and only then is
        # the clock read (read before, samples/s and MFU would count unfinished work)
        loss = float(counters.loss_sum.item()) / state.loss_count
        first_bad, bad_input = counters.bad_steps()
        now = time.perf_counter()
        dt = now - self.t0
        per_rank = distributed.all_gather_floats(dist, [
            dt / self.steps, self.wait / dt, first_bad,
            1.0 if stopflag.received() else 0.0, bad_input, self.compute.take() / self.steps])
        if self.beat:
            self.beat.beat(state.step, now=True)
        bad = [(int(r[2]), int(r[4])) for r in per_rank if r[2] >= 0]
        if not bad and self.log is not None:
            rec = self.log.write(self.record(
                state, per_rank, dt, loss=loss, lr=sched.get_last_lr()[0],
                flops_per_micro=flops_per_micro, skipped=int(counters.skipped.item()),
                grad_scale=scaler.get_scale() if scaler.is_enabled() else None,
                time_s=now - train_t0))
            self.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            if self.bar.disable:  # no terminal (a log file, a Snakemake job): a line instead
                tqdm.write(f"[{self.name}] {progress_line(rec, self.total)}",
                           file=sys.stderr)
            self.tell_stragglers(rec)
        if not bad:
            counters.loss_sum.zero_()
            state.loss_count = 0
            self.warmup = False
            self.restart()
        return Interval(bad, loss, any(r[3] > 0 for r in per_rank),
                        max(r[0] for r in per_rank))

    def record(self, state: TrainState, per_rank: list, dt: float, *, loss: float, lr: float,
               flops_per_micro: float, grad_scale: float | None, skipped: int,
               time_s: float) -> dict:
        """One log interval of `self.steps` optimizer steps over dt seconds; per_rank: each
        rank's (step time, ...)."""
        setup, n, wait = self.setup, self.steps, self.wait
        world, devices = setup.world, setup.devices
        per_sample = setup.batch_size * setup.accum * n
        # all ranks do the same work: rank 0's FLOPs x world = the job's FLOPs
        flops_s = flops_per_micro * setup.accum * n * world / dt
        gpu = self.gpu.interval() if self.gpu else (None, None)
        return {
            "kind": "train", "step": state.step, "epoch": state.epoch, "loss": loss, "lr": lr,
            "samples_per_s": per_sample * world / dt,
            "samples_per_s_per_rank": [per_sample / (r[0] * n) for r in per_rank],
            "compute_samples_per_s": per_sample * world / max(dt - wait, 1e-9),
            "tflops": flops_s / 1e12,
            "mfu": flops_s / (setup.peak * world * len(devices)) if setup.peak else None,
            "gpu_util": gpu[0], "gpu_mem_mib": gpu[1],
            "step_time_s": dt / n, "step_time_s_per_rank": [r[0] for r in per_rank],
            "data_wait_fraction": wait / dt,
            "peak_mem_mib": max(peak_memory_mib(v) for v in devices),
            "grad_scale": grad_scale, "skipped_steps": skipped, "warmup": self.warmup,
            "data_wait_s_per_rank": [r[1] * r[0] for r in per_rank],
            "compute_s_per_rank": [r[5] for r in per_rank],
            # the first interval of a run (start-up, compilation) names none
            "stragglers": [] if self.warmup else find(
                [r[1] * r[0] for r in per_rank], [r[5] for r in per_rank],
                max(r[0] for r in per_rank), self.hosts),
            "time_s": time_s}

    def tell_stragglers(self, rec: dict) -> None:
        """A console line when a rank is named in two log intervals in a row (each
        interval's stragglers are in its record): a blip, such as a tracker's import on
        rank 0, is not worth a line."""
        named = {s["rank"] for s in rec["stragglers"]}
        steady = named & self.named
        if steady and steady != self.told:
            tqdm.write(f"[{self.name}] step {rec['step']}: straggler: " + text(
                [s for s in rec["stragglers"] if s["rank"] in steady]), file=sys.stderr)
        self.named, self.told = named, steady

    def close(self) -> None:
        if self.profiler:
            self.profiler.close()
        self.bar.close()
        if self.gpu:
            self.gpu.close()


def progress_line(rec: dict, total_steps: int) -> str:
    """The console's line for one log interval where no progress bar is drawn (a log file,
    a Snakemake job): step of total, loss, throughput, data wait."""
    return (f"step {rec['step']}/{total_steps} (epoch {rec['epoch']}): loss {rec['loss']:.4f}, "
            f"lr {rec['lr']:.3g}, {rec['samples_per_s']:.0f} samples/s, "
            f"data wait {rec['data_wait_fraction']:.0%}")
