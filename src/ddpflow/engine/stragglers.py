"""Stragglers: one rank whose own work per step holds every other rank back.

DDP's ranks meet at every step's gradient all-reduce, so their step times are equal: a slow
rank shows in its *own* time per step, the part that does not wait for the others. That is
its data wait (host time blocked on the next batch) plus its compute, measured as the
forward and loss of its micro-batches (no collective runs there under DDP: buffers are not
broadcast per forward). A rank whose own time is above the median of the others' by more
than STRAGGLER_ABOVE of what the others need per step is named, with its host and where its
time went (data wait or compute). Under FSDP or sync_bn a forward holds collectives, so its
"compute" includes their waits.

The measures come to rank 0 with the log line's one collective (intervals.py); the first
interval of each run (start-up, compilation) is left out.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter

STRAGGLER_ABOVE = 0.15  # a rank's step this much longer than the others need is named


class ComputeClock:
    """This rank's compute seconds (forward and loss) in the log interval: host time on a
    CPU; CUDA events on a GPU, read at the log line after its sync point."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.seconds, self.spans, self.t = 0.0, [], None

    def start(self) -> None:
        if self.cuda:
            import torch

            self.t = torch.cuda.Event(enable_timing=True)
            self.t.record()
        else:
            self.t = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            import torch

            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.spans.append((self.t, end))
        else:
            self.seconds += time.perf_counter() - self.t

    def take(self) -> float:
        """The interval's compute seconds (after a sync point), and a new interval."""
        total = self.seconds + sum(a.elapsed_time(b) for a, b in self.spans) / 1000
        self.reset()
        return total

    def reset(self) -> None:
        self.seconds, self.spans = 0.0, []


def find(wait_s: list[float], compute_s: list[float], step_s: float,
         hosts: list[str]) -> list[dict]:
    """The stragglers of one log interval. wait_s, compute_s: each rank's data wait and
    compute seconds per step; step_s: the job's seconds per step."""
    own = [w + c for w, c in zip(wait_s, compute_s)]
    found = []
    for rank in range(len(own) if len(own) > 1 else 0):
        excess = own[rank] - _others(own, rank)
        need = max(step_s - excess, 1e-9)  # the others' step without the wait for this rank
        if excess > STRAGGLER_ABOVE * need:
            in_data = (wait_s[rank] - _others(wait_s, rank)
                       >= compute_s[rank] - _others(compute_s, rank))
            found.append({"rank": rank, "host": hosts[rank] if rank < len(hosts) else None,
                          "excess_s": excess, "above": excess / need,
                          "cause": "data wait" if in_data else "compute"})
    return found


def _others(xs: list[float], rank: int) -> float:
    """The median of every rank's value but `rank`'s."""
    return statistics.median(xs[:rank] + xs[rank + 1:])


def text(found: list[dict]) -> str:
    """The console's words for one interval's stragglers."""
    return "; ".join(
        f"rank {s['rank']} (host {s['host']}) holds every step back by {s['excess_s']:.3g} s "
        f"(+{s['above']:.0%} over what the other ranks need), in {s['cause']}" for s in found)


def summary(records: list[dict]) -> list[dict]:
    """summary.json's `stragglers`: each rank named in some log interval (warm-up ones left
    out), in how many of them, by how much on average and mostly why."""
    train = [r for r in records if r.get("kind") == "train" and not r.get("warmup")]
    named: dict[int, list[dict]] = {}
    for rec in train:
        for s in rec.get("stragglers") or []:
            named.setdefault(s["rank"], []).append(s)
    return [{"rank": rank, "host": xs[-1]["host"], "intervals": len(xs), "of": len(train),
             "mean_above": statistics.fmean(x["above"] for x in xs),
             "cause": Counter(x["cause"] for x in xs).most_common(1)[0][0]}
            for rank, xs in sorted(named.items())]
