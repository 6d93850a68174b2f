"""`profile:` a torch.profiler trace of a few steps of one stage, on demand.

With `profile.stage` set, the named stage records `wait` steps of nothing, `warmup` steps of
warm-up and `active` steps of CPU (and CUDA) activity with shapes and memory, on rank 0 (or
every rank with `all_ranks`). The trace is a Chrome/Perfetto JSON file
(`<stage>/profile/trace-rank<r>.json`: open it in ui.perfetto.dev or chrome://tracing); the
ten most expensive ops go to the stage log and to `top_ops-rank<r>.txt` beside it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from ddpflow.config import Config
from ddpflow.core.writing import write_text_atomic


class StepProfiler:
    def __init__(self, folder: Path, rank: int, cuda: bool, wait: int, warmup: int,
                 active: int):
        from torch.profiler import ProfilerActivity, profile, schedule

        self.folder, self.rank, self.cuda, self.done = folder, rank, cuda, False
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.prof = profile(activities=activities, record_shapes=True, profile_memory=True,
                            schedule=schedule(wait=wait, warmup=warmup, active=active,
                                              repeat=1),
                            on_trace_ready=self._ready)
        self.prof.start()

    def _ready(self, prof) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"trace-rank{self.rank}.json"
        prof.export_chrome_trace(str(trace))
        key = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=10)
        write_text_atomic(self.folder / f"top_ops-rank{self.rank}.txt", table + "\n")
        print(f"ddpflow: rank {self.rank}: profiler trace {trace}\n{table}", file=sys.stderr)
        self.done = True

    def step(self) -> None:
        self.prof.step()

    def close(self) -> None:
        self.prof.stop()
        if not self.done:
            print(f"ddpflow: warning: rank {self.rank}: the stage ended before the profiler's "
                  f"wait + warmup + active steps; no trace was written", file=sys.stderr)


def open_profiler(cfg: Config, stage: str, rank: int, device: torch.device,
                  folder: Path) -> StepProfiler | None:
    p = cfg.profile
    if p.stage != stage or (rank != 0 and not p.all_ranks):
        return None
    return StepProfiler(folder / "profile", rank, device.type == "cuda", p.wait, p.warmup,
                        p.active)
