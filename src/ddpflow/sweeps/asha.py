"""Asynchronous successive halving (ASHA, Li et al. 2020): which trial trains next, and to
which rung. Pure: it reads the trials' records and returns a decision; scheduler.py runs it.

A rung is a number of epochs of the last stage (config/sweepchecks.py). A trial that
completed rung k and is among the top floor(n_k / eta) of the n_k trials that completed it
is promoted to rung k+1 as soon as a worker is free; the others stay paused (a checkpoint
at the rung's end) and are promoted later if the rung's ranking changes as more trials
complete it. Promotions come before new trials (higher rungs first); a trial sent to a rung
and stopped on the way (a signal, a lost node) is resumed before anything else.

A finite sweep can end with no trial at the last rung (n_k < eta at a high rung): then, once
every trial has started and none is running, the best paused trial of the highest rung is
promoted, so a sweep always finishes at least one trial (Ray Tune's ASHA promotes the first
trial of every rung for the same reason).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field


@dataclass
class TrialState:
    """One trial as the scheduler keeps it (sweep/schedule/state.json)."""

    id: str
    overrides: dict
    variant: str | None
    number: int  # order of creation: the plan's order, or TPE's draw
    key: str | None = None  # the resume key its values were made under (None: not started)
    values: dict = field(default_factory=dict)  # epoch -> monitored value (None: NaN)
    epochs: int = 0  # epochs of the last stage trained to a checkpoint (its rung when paused)
    target: int = 0  # epochs it was last sent to (> epochs: on its way, or stopped on it)
    pruned: str | None = None  # why it stopped for good (failed, diverged, NaN), or None
    kind: str | None = None  # failed | diverged | nan: a rerun retries only `failed`
    tries: int = 0  # times it stopped before its target in a row (preempted, lost node)

    def value_at(self, epoch: int):
        return self.values.get(epoch) if self.epochs >= epoch else None

    def reached(self, epoch: int) -> bool:
        return self.epochs >= epoch and epoch in self.values


@dataclass(frozen=True)
class Job:
    trial: str  # id; "" with new=True: a trial not made yet (TPE draws it)
    target: int  # epochs of the last stage to train to
    why: str  # resume | promote | start | finish (the end-game promotion)
    new: bool = False


def _order(trials: list[TrialState], epoch: int, mode: str) -> list[TrialState]:
    """Trials that completed the rung at `epoch`, best first (NaN last, ties by creation)."""
    done = [t for t in trials if t.reached(epoch)]

    def key(t):
        v = t.values[epoch]
        bad = v is None or not math.isfinite(v)
        return (bad, 0.0 if bad else (-v if mode == "max" else v), t.number)

    return sorted(done, key=key)


def promotable(trials: list[TrialState], rungs: list[int], eta: int, mode: str,
               busy: set[str]) -> Job | None:
    """The best trial in the top 1/eta of the highest rung it can leave, or None."""
    for k in range(len(rungs) - 2, -1, -1):
        r = rungs[k]
        ranked = _order(trials, r, mode)
        for t in ranked[: len(ranked) // eta]:
            v = t.values[r]
            if (v is not None and math.isfinite(v) and t.pruned is None and t.id not in busy
                    and t.epochs == r and t.target <= r):
                return Job(t.id, rungs[k + 1], "promote")
    return None


def next_job(trials: list[TrialState], rungs: list[int], eta: int, mode: str,
             busy: set[str], can_draw: bool) -> Job | None:
    """What a free worker does next: resume a stopped promotion, promote, start a trial
    (the plan's next, or a new draw when `can_draw`), or the end-game promotion; None: wait
    for a running trial (or, with nothing running, the sweep is done)."""
    for t in sorted(trials, key=lambda t: t.number):
        if t.id not in busy and t.pruned is None and t.target > t.epochs:
            return Job(t.id, t.target, "resume")
    job = promotable(trials, rungs, eta, mode, busy)
    if job:
        return job
    for t in sorted(trials, key=lambda t: t.number):
        if t.pruned is None and t.target == 0:  # (a started trial has a target)
            return Job(t.id, rungs[0], "start")
    if can_draw:
        return Job("", rungs[0], "start", new=True)
    if busy:
        return None
    return _end_game(trials, rungs, mode)


def _end_game(trials: list[TrialState], rungs: list[int], mode: str) -> Job | None:
    """Nothing runs and nothing is left to start: if no trial reached the last rung, the best
    paused one of the highest rung goes on."""
    if any(t.reached(rungs[-1]) for t in trials):
        return None
    for k in range(len(rungs) - 2, -1, -1):
        for t in _order(trials, rungs[k], mode):
            v = t.values[rungs[k]]
            if (t.pruned is None and t.epochs == rungs[k] and v is not None
                    and math.isfinite(v)):
                return Job(t.id, rungs[k + 1], "finish")
    return None


def start_order(ids: list[str]) -> list[str]:
    """The order a plan's trials start in: by a hash of their ids. ASHA assumes trials come
    in random order; a grid in its declared order often improves trial after trial (a
    rising learning rate), and then every new best is promoted. A hash is the same on every
    run, and a trial added to the grid leaves the others' order alone."""
    return sorted(ids, key=lambda i: hashlib.sha256(i.encode()).hexdigest())


def status(t: TrialState, rungs: list[int], busy: set[str] = frozenset()) -> str:
    """finished | paused | pruned | running | stopped (on its way to a rung) | waiting."""
    if t.pruned is not None:
        return "pruned"
    if t.reached(rungs[-1]):
        return "finished"
    if t.id in busy:
        return "running"
    if t.target > t.epochs:
        return "stopped"
    return "paused" if t.epochs else "waiting"


def rung_of(t: TrialState, rungs: list[int]) -> int | None:
    """The highest rung (epochs) the trial completed, or None."""
    done = [r for r in rungs if t.reached(r)]
    return max(done) if done else None
