"""Where a stage's wall time goes, from the `ddpflow launch` command to its result.

Every second of a rank-0 process is given to one phase by `WallClock.lap`: start-up (the
command, torchrun, imports, process group, data, model, until the first training step),
training steps, data wait, validation, checkpoint stalls (only the blocking part of a save)
and teardown (after the last step until the launcher returns). The laps are contiguous,
so the phases add up to the stage's wall time; `tests/test_engine.py` checks that against
a stopwatch around the command. Clocks are `time.time()`: the launcher and the ranks are
different processes and share only the wall clock. A resumed stage adds the split of its
earlier runs up to their last checkpoint (TrainState.wall_s); what a stopped run did after
that checkpoint was redone and is not counted twice.
"""

from __future__ import annotations

import os
import time

LAUNCH_T0 = "DDPFLOW_LAUNCH_T0"  # epoch seconds at which `ddpflow launch` started
PHASES = ("startup", "train", "data_wait", "validation", "checkpoint", "teardown")


def process_start() -> float:
    """Epoch seconds at which this process started (before the interpreter's own start-up),
    from /proc; now where /proc is missing."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def launch_t0() -> float:
    """When the command of this stage started: the launcher's, passed down as
    DDPFLOW_LAUNCH_T0 to the ranks (torchrun's workers) and into a container (whose launcher
    runs with DDPFLOW_IN_CONTAINER); else this process's start. An inherited value anywhere
    else belongs to some other command."""
    passed_down = "TORCHELASTIC_RUN_ID" in os.environ or "DDPFLOW_IN_CONTAINER" in os.environ
    try:
        if passed_down:
            return float(os.environ[LAUNCH_T0])
    except (KeyError, ValueError):
        pass
    return process_start()


class WallClock:
    """Contiguous laps since the launch: `lap(phase)` gives the time since the last lap to
    `phase`; `mark(name)` notes a start-up milestone (seconds since the launch)."""

    def __init__(self, t0: float | None = None):
        self.t0 = launch_t0() if t0 is None else t0
        self.last = self.t0
        self.split = dict.fromkeys(PHASES, 0.0)
        self.marks: dict[str, float] = {}

    def lap(self, phase: str, sync=None) -> float:
        """sync: a torch.device whose queued work is waited for first (a sync point on a
        GPU; nothing on CPU), so that work counts as `phase`."""
        if sync is not None and sync.type == "cuda":
            import torch

            torch.cuda.synchronize(sync)
        now = time.time()
        dt, self.last = now - self.last, now
        self.split[phase] += dt
        return dt

    def mark(self, name: str) -> None:
        self.marks[name] = round(time.time() - self.t0, 4)

    def total(self, earlier: dict | None = None) -> dict:
        """This process's split so far plus `earlier` processes' (from a checkpoint)."""
        earlier = earlier or {}
        return {p: self.split[p] + earlier.get(p, 0.0) for p in PHASES}


def summary_block(clock: WallClock, earlier: dict | None, runs: int, samples: int) -> dict:
    """The `wall` block of summary.json as rank 0 writes it; the launcher completes it
    (`complete`) with the time until its own end."""
    split = clock.total(earlier)
    return complete({"split_s": split, "runs": runs, "samples": samples,
                     "startup_marks_s": clock.marks, "rank_end": clock.last,
                     "rank_teardown_s": split["teardown"]}, end=clock.last)


def complete(wall: dict, end: float | None = None) -> dict:
    """The launcher's part: teardown until `end` (its return), total and throughput. The
    same result however often it runs (inside a container and again outside)."""
    end = time.time() if end is None else end
    split = dict(wall["split_s"])
    split["teardown"] = wall["rank_teardown_s"] + max(0.0, end - wall["rank_end"])
    total = sum(split.values())
    return {**wall, "split_s": split, "total_s": total,
            "samples_per_s": wall["samples"] / total if total > 0 else None}
