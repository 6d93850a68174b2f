"""`tune.budget_s` bounds each candidate too, not only the gaps between them.

The budget was checked before a candidate started, so a candidate begun a second before the
end ran all its steps: `tune.budget_s: 8` ended at 12-24 s. Now, with every decision agreed
across the ranks (their collectives stay in step):
  - `admits`, before a throughput candidate: one that would end past the budget, judged by
    how long the one before it took, is not started (skipped, and said);
  - `step_indices`, the loop of its steps: after the two warm-up steps, the timed steps are
    cut to as many as fit before the budget's end at the last warm-up step's pace (at least
    one, so that the candidate has a figure), and the cut is said.
Cut and skipped candidates are listed in tune.json's `skipped`. The clock is the Pace's
(`Pace.t0`, monotonic seconds); `clock` is replaceable for tests.
"""

from __future__ import annotations

import time

import torch

from ddpflow.engine.distributed import all_min

clock = time.monotonic  # seconds; the same clock as tune.Pace.t0


class _Candidates:
    """What the budget knows of the candidates so far (kept on the Pace)."""

    def __init__(self):
        self.what: str | None = None  # the candidate being measured
        self.started: float | None = None  # when it was admitted (clock)
        self.last_s = 0.0  # how long the previous candidate took, admission to admission


def _state(pace) -> _Candidates:
    state = getattr(pace, "candidates", None)
    if state is None:
        state = pace.candidates = _Candidates()
    return state


def admits(pace, what: str) -> bool:
    """Before a candidate (every rank): False, with a line, when the budget is spent or the
    candidate would end past it (it takes about as long as the one before); raises
    TuneStopped on a stop signal (Pace.check)."""
    state, now = _state(pace), clock()
    if state.started is not None:
        state.last_s = now - state.started
    # a skipped candidate took no time: the next one is judged by the last that ran
    state.what, state.started = what, None
    if not pace.check(what):  # the budget is spent (agreed); a stop signal raises
        pace.skip(what)
        return False
    end = pace.t0 + pace.budget_s
    fits = pace._agreed(now + state.last_s <= end)
    if not fits:
        pace.skipped.append(what)
        pace.say(f"{what}: skipped (it would end past tune.budget_s {pace.budget_s:g} s: the "
                 f"one before took {state.last_s:.1f} s, {max(0.0, end - now):.1f} s are left)")
    else:
        state.started = now
    return fits


def step_indices(pace, steps: int, device: torch.device):
    """0 .. steps + 1 for a candidate's loop (2 warm-up steps, then `steps` timed ones), the
    timed ones cut to what fits before the budget's end at the warm-up's pace (agreed; at
    least 1). pace None: all of them."""
    if pace is None:
        yield from range(steps + 2)
        return
    yield 0
    t1 = _now(device)
    yield 1
    step_s = _now(device) - t1  # the second warm-up step: compiled, allocated, steady
    left = pace.t0 + pace.budget_s - clock()
    fit = steps if step_s <= 0 else int(min(steps, max(1.0, left // step_s)))
    n = all_min(pace.dist, fit)
    if n < steps:
        what = _state(pace).what or "candidate"
        pace.skipped.append(f"{what} (cut to {n} of {steps} timed steps)")
        pace.say(f"{what}: cut to {n} of {steps} timed steps ({step_s:.2f} s each, "
                 f"{max(0.0, left):.1f} s of tune.budget_s {pace.budget_s:g} s left)")
    yield from range(2, n + 2)


def _now(device: torch.device) -> float:
    """The clock once the device's queued work is done (a sync point on a GPU: the warm-up
    steps only)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return clock()
