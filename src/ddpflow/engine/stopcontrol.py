"""The stop control of a stage: when training ends before its last step, and why.

    preempted    a stop signal (SIGTERM, SIGUSR1: Slurm's warning before the time limit)
                 reached some rank: the ranks learn it together, at a log line or, between
                 log lines, at a small collective about every `stop_check_s` seconds
                 (StopPoll), and every rank stops at the same step after a checkpoint
    halted       `--halt-after-steps N`: checkpoint and stop after step N; `--halt-after-epochs
                 N`: validate, checkpoint and stop at the end of epoch N (a sweep's rung);
                 both resumable
    early stop   after a validation, `stages[].stop` (patience, target): earlystop.py's rule,
                 kept in TrainState.stop so that a resumed stage continues the count
The signal handlers only set a flag (stopflag.py); this reads it where the ranks agree.
"""

from __future__ import annotations

import time

from ddpflow.engine import distributed, earlystop, stopflag

PREEMPTED, HALTED = "preempted", "halted"


class StopPoll:
    """When the ranks next ask each other whether a stop signal arrived: about every
    `every_s` seconds of training (besides each log line), so a signal is answered within
    about a minute whatever log_every_steps is, without a collective per step. The interval
    comes from step times all ranks gathered, so every rank computes the same next step and
    joins the same collective."""

    def __init__(self, every_s: float, start_step: int):
        self.every_s = every_s
        self.next = start_step + 1  # the first step: a first measurement of the step time

    def due(self, step: int) -> bool:
        return step >= self.next

    def seen(self, step: int, step_time_s: float) -> None:
        self.next = step + max(1, int(self.every_s / max(step_time_s, 1e-9)))

    def poll(self, dist, step: int, t0: float, steps: int) -> bool:
        """When due, a small collective (a sync point): has any rank been asked to stop?
        t0, steps: the log interval in progress (its start, its steps so far)."""
        if not self.due(step):
            return False
        per_rank = distributed.all_gather_floats(
            dist, [(time.perf_counter() - t0) / max(steps, 1),
                1.0 if stopflag.received() else 0.0])
        self.seen(step, max(r[0] for r in per_rank))
        return any(r[1] > 0 for r in per_rank)


class StopControl:
    def __init__(self, stop_check_s: float, halt_after: int | None,
                 halt_after_epochs: int | None = None):
        self.stop_check_s = stop_check_s  # seconds between polls between log lines
        self.halt_after = halt_after  # optimizer steps (--halt-after-steps), or None
        self.halt_after_epochs = halt_after_epochs  # epochs (--halt-after-epochs), or None
        self.poll, self.rule = StopPoll(stop_check_s, 0), None

    def begin(self, start_step: int, rule: earlystop.StopRule | None) -> None:
        """Once resume has decided where training starts, and the task what it monitors."""
        self.poll = StopPoll(self.stop_check_s, start_step)
        self.rule = rule  # stages[].stop, or None

    def after_step(self, dist, step: int, interval, logged) -> str | None:
        """After optimizer step `step`: PREEMPTED, HALTED or None. `logged`: what the ranks
        said at this step's log line (intervals.Interval), or None between log lines (then
        the poll's collective, when due; interval: the logger, for its clock)."""
        if logged is not None:
            asked = logged.stop_asked
            self.poll.seen(step, logged.slowest_step_s)
        else:
            asked = self.poll.poll(dist, step, interval.t0, interval.steps)
        if asked:  # preemption: every rank stops at the same step
            return PREEMPTED
        if self.halt_after is not None and step >= self.halt_after:
            return HALTED
        return None

    def halts_after_epoch(self, epoch: int) -> bool:
        """Whether the stage pauses once epoch `epoch` (counted from 1) is done: validated,
        then checkpointed (launch/halting.py refuses a halt at the stage's own end)."""
        return epoch == self.halt_after_epochs

    def after_validation(self, state, metrics: dict, t_start: float, wall_t0: float, say) -> bool:
        """Early stopping's record in TrainState.stop after a validation (the same decision
        on every rank: all see the same metrics); whether the stage stops here."""
        state.stop = earlystop.after_validation(self.rule, state, metrics, t_start, wall_t0, say)
        return self.stopped(state)

    @staticmethod
    def stopped(state) -> bool:
        """Early stopping has decided (also in a checkpoint's TrainState)."""
        return "stopped" in state.stop
