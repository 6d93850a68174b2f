"""What ends `ddpflow tune` besides an out-of-memory error, and what it shows meanwhile.

On a CPU nothing runs out of memory, so a search that only stops at an OOM climbs toward
`tune.max_batch` (4096: over 20 minutes on two cores). Three things end it instead:
  - the time budget (`tune.budget_s`): candidates left then are skipped and recorded as
    such, and the best one measured so far is chosen;
  - throughput that stops improving as the batch doubles (where memory is not the limit:
    a CPU without --memory-cap-mb): a batch that is not 5% faster per sample than half of it
    ends the climb;
  - a stop signal (SIGTERM, Ctrl-C relayed by the launcher): `TuneStopped`, nothing written.
Every decision is agreed across the ranks (each rank's "go on", the minimum of all), so all
ranks run the same candidates and their collectives stay in step. Rank 0 prints one line per
candidate: what was tried, its figure, and what was decided.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from ddpflow.engine import stopflag

GAIN = 1.05  # a doubled batch must be this much faster per sample to keep climbing


class TuneStopped(Exception):
    """A stop signal reached the ranks while they measured: nothing is written."""


class Pace:
    def __init__(self, d, budget_s: float, climb_by_throughput: bool):
        self.d, self.budget_s, self.climb = d, budget_s, climb_by_throughput
        self.t0 = time.monotonic()
        self.best_rate: dict[int, float] = {}  # batch -> samples/s of its memory trial
        self.skipped: list[str] = []

    def say(self, msg: str) -> None:
        if self.d.is_master:
            print(f"[tune {time.monotonic() - self.t0:6.1f} s] {msg}", file=sys.stderr,
                  flush=True)

    def _agreed(self, go_on: bool) -> bool:
        """Whether every rank goes on (one small collective: a sync point)."""
        if not self.d.backend:
            return go_on
        t = torch.tensor([int(go_on)], dtype=torch.int64, device=self.d.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def check(self) -> bool:
        """Before a candidate: raises TuneStopped on a stop signal (any rank's); False once
        the budget is spent (the candidate is skipped)."""
        if not self._agreed(stopflag.received() is None):
            raise TuneStopped(stopflag.received() or "a stop signal")
        return self._agreed(time.monotonic() - self.t0 < self.budget_s)

    def skip(self, what: str) -> None:
        self.skipped.append(what)
        self.say(f"{what}: skipped (tune.budget_s {self.budget_s:g} s spent)")

    def keeps_climbing(self, batch: int, step_s: float | None) -> bool:
        """After a batch fits in memory: whether the search doubles it again (agreed)."""
        go_on = True
        if self.climb and step_s:
            rate = batch / step_s
            self.best_rate[batch] = rate
            before = self.best_rate.get(batch // 2)
            if before is not None and rate < GAIN * before:
                go_on = False
                self.say(f"batch {batch}: {rate:.0f} samples/s, not {GAIN:.2f}x batch "
                         f"{batch // 2}'s {before:.0f}: larger batches are not searched")
        return self._agreed(go_on) and self.check()
