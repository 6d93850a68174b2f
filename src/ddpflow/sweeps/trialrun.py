"""One job of the sweep's scheduler: bring one trial to a number of epochs of its last stage.

What the workflow's rules do for a trial without a scheduler, in order, each step skipped
when its result is there: its prepared data (shared by trials with equal data settings, one
preparation at a time), its image record, its tuning, its earlier stages to their end, then
the last stage with `ddpflow launch --halt-after-epochs <rung>` (validated, checkpointed,
stopped: a paused trial), or to its end at the last rung. The result is read from the
trial's own files, never from the launcher's words: the monitored value of every validated
epoch in the stage's metrics.jsonl (which the trainer keeps in step with its checkpoints).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ddpflow.config import Config, from_dict
from ddpflow.config.types import config_hash
from ddpflow.core import reading
from ddpflow.launch.launcher import EXIT_DIVERGED, EXIT_STOPPED
from ddpflow.results.metrics import read_records
from ddpflow.results.provenance import expected_record, stage_result
from ddpflow.sweeps.leaderboard import reason_from_log


@dataclass
class Outcome:
    key: str | None = None  # the resume key the values were made under
    values: dict = field(default_factory=dict)  # epoch -> value (None: NaN), from metrics.jsonl
    epochs: int | None = None  # epochs trained to a checkpoint now (None: no news)
    pruned: str | None = None
    kind: str | None = None  # failed | diverged | nan
    stopped: bool = False  # stopped before its target (a signal, a time limit)


def trial_config(path: Path, trial: str) -> Config:
    return from_dict(reading.read_json(path, {"type": "object"}, f"trial {trial}'s config",
                                       "run `ddpflow sweep plan --config ...` again"))


def resume_key(cfg: Config) -> str:
    """The last stage's resume key as the trainer makes it (engine/resume.py stage_files):
    what it was made of (config, code, data, starting weights), ranks left out."""
    last = cfg.stages[-1].name
    return config_hash({**expected_record(cfg, last),
                        "stage_hash": cfg.stage_hash(last, placement=False)})


class TrialJob:
    """Runs the steps of one trial with a runner (runner.py); `locks` keeps one preparation
    per prepared folder at a time across the scheduler's workers."""

    def __init__(self, runner, sweep_dir: Path, logs: Path, monitor: str, locks: dict,
                 locks_lock):
        self.runner, self.sweep_dir, self.logs, self.monitor = runner, sweep_dir, logs, monitor
        self.locks, self.locks_lock = locks, locks_lock
        self.prepared: set[str] = set()  # folders `ddpflow prepare` ran for in this run

    def run(self, tid: str, path: Path, target: int) -> Outcome:
        cfg = trial_config(path, tid)
        logs = self.logs / tid
        failed = self._prepare(cfg, path, logs) or self._before_last(cfg, path, logs)
        if failed:
            return failed
        last = cfg.stages[-1]
        key = resume_key(cfg)
        words = ["launch", "--config", path, "--stage", last.name]
        if target < last.epochs:
            words += ["--halt-after-epochs", target]
        log = logs / f"train_{last.name}.log"
        rc = self.runner.run(cfg, words, log)
        return self.outcome(cfg, key, target, rc, log)

    def _prepare(self, cfg: Config, path: Path, logs: Path) -> Outcome | None:
        """The trial's data, image record and tuning. `ddpflow prepare` once per prepared
        folder and scheduler run, one at a time (it does nothing when the folder is up to
        date with the data settings and the factory's code)."""
        with self.locks_lock:
            lock = self.locks.setdefault(str(cfg.data_dir), threading.Lock())
        with lock:
            if str(cfg.data_dir) not in self.prepared:
                log = logs / "prepare.log"
                if self.runner.run(cfg, ["prepare", "--config", path], log, gpus=False):
                    return failure(f"preparing its data: {reason_from_log(log)}")
                self.prepared.add(str(cfg.data_dir))
        image = self.sweep_dir / "image.json"  # the sweep's own, copied as the workflow does
        if image.is_file() and not (cfg.run_dir / "image.json").is_file():
            from ddpflow.core.writing import write_bytes_atomic

            write_bytes_atomic(cfg.run_dir / "image.json", image.read_bytes())
        if cfg.tune.enabled and not (cfg.run_dir / "tune.json").is_file():
            log = logs / "tune.log"
            if self.runner.run(cfg, ["tune", "--config", path], log):
                return failure(f"tuning: {reason_from_log(log)}")
        return None

    def _before_last(self, cfg: Config, path: Path, logs: Path) -> Outcome | None:
        """Every stage before the last, to its end (those finished with these settings are
        skipped here, without starting a launcher)."""
        for stage in cfg.stages[:-1]:
            if _finished(cfg, stage.name):
                continue
            log = logs / f"train_{stage.name}.log"
            rc = self.runner.run(cfg, ["launch", "--config", path, "--stage", stage.name], log)
            if rc:
                kind = "diverged" if rc == EXIT_DIVERGED else "failed"
                return failure(f"stage {stage.name}: {reason_from_log(log)}", kind)
        return None

    def outcome(self, cfg: Config, key: str, target: int, rc: int, log: Path) -> Outcome:
        """The values the trial's metrics.jsonl holds now, and what became of the job: at its
        rung (paused) or its end (finished), pruned (failed, diverged, NaN), or stopped on the
        way (a signal, a time limit: resumed next)."""
        last = cfg.stages[-1]
        metrics = cfg.stage_dir(last.name) / "metrics.jsonl"
        records = read_records(metrics)[0] if metrics.is_file() else []
        vals = [r for r in records if r.get("kind") == "val" and isinstance(r.get("epoch"), int)]
        missing = [r for r in vals if self.monitor not in r]
        if missing:
            names = sorted(k for k in missing[0] if k.startswith("val_"))
            return failure(f"task.monitor {self.monitor} is not among its validation metrics "
                           f"({', '.join(names) or 'none'}); set task.monitor to one of them")
        values = {r["epoch"] + 1: _number(r[self.monitor]) for r in vals}
        out = Outcome(key=key, values=values, epochs=max(values, default=0))
        bad = sorted(e for e, v in values.items() if v is None)
        if bad:
            out.pruned, out.kind = f"{self.monitor} is NaN at epoch {bad[0]}", "nan"
        elif rc == EXIT_DIVERGED:
            failed = reading.read_json_or_none(cfg.stage_dir(last.name) / "failed.json",
                                               {"type": "object"}, "stage record") or {}
            out.pruned = f"diverged: {failed.get('reason') or 'a NaN/inf loss'}"
            out.kind = "diverged"
        elif target in values and (target < last.epochs or _finished(cfg, last.name)):
            pass  # paused at its rung, or finished
        elif rc in (0, EXIT_STOPPED) or rc > 128 or rc < 0:  # a signal
            out.stopped = True
        else:
            out.pruned, out.kind = f"stage {last.name}: {reason_from_log(log)}", "failed"
        return out


def _finished(cfg: Config, stage: str) -> bool:
    summary, stale = stage_result(cfg, stage)
    return summary is not None and stale is None


def _number(v) -> float | None:
    """A logged value as a finite float, or None (NaN, inf, not a number)."""
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def failure(reason: str, kind: str = "failed") -> Outcome:
    return Outcome(pruned=reason, kind=kind)
