"""`ddpflow sweep schedule`: one job that runs a sweep's trials with `sweep.scheduler: asha`
(successive halving, asha.py) and/or `sweep.search: tpe` (Optuna, tpe.py).

Snakemake's DAG is fixed before any job runs, and ASHA decides which trial trains next from
results as they arrive (and may promote a paused trial long after it paused), so one job
decides: the workflow's `sweep_schedule` rule runs this command, which hands each trial's
next rung to the slot pool of this node or to `sbatch` (runner.py), `sweep.parallel` at a
time. A Snakemake `checkpoint` per rung would re-plan the DAG after every rung but still wait
for a rung's last trial before promoting any: that is synchronous halving, with idle slots.

Every decision is written to sweep/schedule/state.json before its job starts, and every
result when it ends (schedstate.py); a paused trial is a checkpoint at its rung's end, and a
promoted one resumes from it with the learning-rate schedule of the last rung (the stage's
own epochs), so its final weights are those of the same trial trained straight through. A
scheduler stopped anywhere (SIGTERM, a lost node) stops its trials at a checkpoint and
continues on the next run; one sweep at a time holds sweep/schedule/.lock.
"""

from __future__ import annotations

import sys
import threading
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

from ddpflow.config import Config
from ddpflow.config.sweepchecks import schedule_rungs
from ddpflow.core import locks
from ddpflow.core.errors import UserError, stop_raises
from ddpflow.sweeps import asha, schedstate
from ddpflow.sweeps.asha import TrialState
from ddpflow.sweeps.runner import parallel, runner_for

MAX_TRIES = 3  # stops before a rung in a row (preempted, time limit) before a trial is pruned


def schedule(cfg: Config, logs: str | None, via: str = "node") -> int:
    """Plan (check every trial, write nothing on a mistake), take the sweep's lock, run."""
    from ddpflow.sweeps import plan as planning

    if not cfg.sweep.scheduled:
        raise UserError("this sweep has no scheduler: set sweep.scheduler: asha or "
                        "sweep.search: tpe (without them the workflow runs every trial as "
                        "its own job: snakemake --configfile ...)")
    planned = planning.plan(cfg)
    where = schedstate.folder(cfg)
    with locks.exclusive(where / ".lock", f"the sweep scheduler of run '{cfg.run}' ({where})"):
        planning.write_plan(cfg, planned)
        logs = Path(logs) if logs else cfg.run_dir / "logs" / "trials"
        return Scheduler(cfg, planned, logs, via).run()


class Scheduler:
    def __init__(self, cfg: Config, planned: list, logs: Path, via: str):
        from ddpflow.sweeps.trialrun import TrialJob

        self.cfg, self.d = cfg, cfg.to_dict()
        self.rungs, self.eta = schedule_rungs(self.d), cfg.sweep.asha.eta
        self.runner, self.workers = runner_for(via), parallel(cfg, via)
        self.paths: dict[str, Path] = {}
        self.trials = self._known(planned)
        self.monitor, self.mode = _monitor(cfg)
        self.job = TrialJob(self.runner, cfg.run_dir, logs, self.monitor, {}, threading.Lock())
        self.stopping = False
        self.say(f"{len(self.trials)} trial(s), rungs at epoch(s) "
                 f"{', '.join(map(str, self.rungs))} of stage {cfg.stages[-1].name}, "
                 f"eta {self.eta}, {self.workers} at a time on {self.runner.where}; "
                 f"ranked by {self.monitor} ({self.mode})")

    def say(self, text: str) -> None:
        print(f"ddpflow: sweep '{self.cfg.run}': {text}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ the trials
    def _known(self, planned: list) -> list[TrialState]:
        """The plan's trials (grid, random) or the recorded draws (tpe), with what the state
        recorded of each, as long as it was made with the trial's settings as they are now."""
        from ddpflow.sweeps import plan as planning

        recorded = {t.id: t for t in schedstate.trials_of(schedstate.read_state(self.cfg))}
        if self.cfg.sweep.search == "tpe":
            space = set(self.cfg.sweep.random["space"])
            planned = [(planning.Trial(t.id, t.overrides, None), None)
                       for t in sorted(recorded.values(), key=lambda t: t.number)
                       if set(t.overrides) == space]
        else:  # a grid's trials start in random order (asha.start_order), drawn ones as drawn
            rank = {i: n for n, i in enumerate(asha.start_order([t.id for t, _ in planned]))}
            planned = sorted(planned, key=lambda p: rank[p[0].id])
        trials = []
        for i, (trial, t) in enumerate(planned):
            t = t or planning.resolve(self.cfg, self.d, trial)
            self.paths[trial.id] = planning.write_trial_config(self.cfg, trial, t)
            old = recorded.get(trial.id)
            keep = old is not None and old.overrides == trial.overrides
            state = old if keep else TrialState(trial.id, trial.overrides, trial.variant, i)
            state.number = i
            trials.append(self._checked(state))
        return trials

    def _checked(self, t: TrialState) -> TrialState:
        """Its record reset when its settings, code or data changed since (the trainer sets
        its checkpoints aside for the same reason); a failed trial is tried again."""
        from ddpflow.sweeps.trialrun import resume_key, trial_config

        if t.key is not None and resume_key(trial_config(self.paths[t.id], t.id)) != t.key:
            return TrialState(t.id, t.overrides, t.variant, t.number)
        if t.kind == "failed":
            t.pruned = t.kind = None
            t.tries = 0
        return t

    def _draw(self) -> TrialState | None:
        """TPE's next trial (a new point of the space), or None when it only repeats."""
        from ddpflow.sweeps import plan as planning
        from ddpflow.sweeps import tpe

        r = self.cfg.sweep.random
        seen = {planning._same(t.overrides) for t in self.trials}
        number = len(self.trials)
        for attempt in range(20):
            point = tpe.draw(r["space"], r.get("seed", 0) + attempt * 7919, number,
                             r["samples"], self.trials, self.rungs, self.mode)
            if planning._same(point) not in seen:
                trial = planning.Trial(planning.trial_id(point, None, point), point, None)
                t = planning.resolve(self.cfg, self.d, trial)
                self.paths[trial.id] = planning.write_trial_config(self.cfg, trial, t)
                state = TrialState(trial.id, point, None, number)
                self.trials.append(state)
                return state
        self.say(f"TPE drew only points it had drawn before after {number} trial(s); no more")
        return None

    def save(self) -> None:
        schedstate.write_state(self.cfg, self.trials, self.monitor, self.mode, self.rungs)

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        (schedstate.folder(self.cfg) / "done.json").unlink(missing_ok=True)
        if self.trials:  # a request Slurm refuses stops the sweep before any job
            from ddpflow.sweeps.trialrun import trial_config

            t = self.trials[0]
            self.runner.preflight(trial_config(self.paths[t.id], t.id),
                                  self.job.logs / "preflight")
        self.save()
        running: dict = {}
        pool = ThreadPoolExecutor(self.workers)
        try:
            with stop_raises():
                self._loop(pool, running)
        except BaseException:  # SIGTERM, Ctrl-C, a mistake: every trial stops at a checkpoint
            self.stopping = True
            self.runner.stop()
            for f in list(running):
                if f.exception() is None:  # (waits for it; a second mistake is not told)
                    self._ended(running.pop(f), f)
            self.save()
            raise
        finally:
            pool.shutdown(wait=True)
        return self.finish()

    def _loop(self, pool, running: dict) -> None:
        can_draw = self.cfg.sweep.search == "tpe"
        while True:
            while len(running) < self.workers:
                can_draw = can_draw and len(self.trials) < self.cfg.sweep.random["samples"]
                busy = {t.id for t in running.values()}
                job = asha.next_job(self.trials, self.rungs, self.eta, self.mode, busy,
                                    can_draw)
                if job is None:
                    break
                t = self._draw() if job.new else next(x for x in self.trials
                                                      if x.id == job.trial)
                if t is None:
                    can_draw = False
                    continue
                t.target = job.target
                self.save()  # the decision first: a stop after it resumes this job
                self.say(f"{t.id}: {job.why} -> epoch {job.target}")
                running[pool.submit(self.job.run, t.id, self.paths[t.id], job.target)] = t
            if not running:
                return
            done, _ = wait(list(running), timeout=1.0, return_when=FIRST_COMPLETED)
            for f in done:
                self._ended(running.pop(f), f)
                self.save()

    def _ended(self, t: TrialState, future) -> None:
        """A job's result into the trial's record (a job that raised: its mistake, once)."""
        news = record(t, future.result(), self.stopping)
        if news == "pruned":
            self.say(f"{t.id}: pruned: {t.pruned}")
        elif news == "reached":
            self.say(f"{t.id}: epoch {t.target}: {self.monitor} {t.values[t.target]:.4f} "
                     f"({asha.status(t, self.rungs)})")

    def finish(self) -> int:
        """The tally; done.json (the workflow's mark) only when no trial was pruned."""
        from ddpflow.core.writing import write_json_atomic

        status = [asha.status(t, self.rungs) for t in self.trials]
        counts = {s: status.count(s) for s in dict.fromkeys(status)}
        spent = sum(t.epochs for t in self.trials)
        full = len(self.trials) * self.rungs[-1]
        self.say(", ".join(f"{n} {s}" for s, n in counts.items()) + f"; {spent} of {full} "
                 f"trial-epochs of stage {self.cfg.stages[-1].name} "
                 f"({spent / max(full, 1):.2f} of running every trial to its end)")
        pruned = [t for t in self.trials if t.pruned]
        if pruned:
            shown = "; ".join(f"{t.id}: {t.pruned}" for t in pruned[:5])
            print(f"ddpflow: error: sweep '{self.cfg.run}': {len(pruned)} trial(s) pruned "
                  f"({shown}); the others went on; `ddpflow sweep collect` lists them all",
                  file=sys.stderr)
            return 1
        write_json_atomic(schedstate.folder(self.cfg) / "done.json",
                          {"run": self.cfg.run, "trials": len(self.trials), **counts})
        return 0


def record(t: TrialState, out, stopping: bool) -> str:
    """An Outcome (trialrun.py) into the trial's record: its values and epochs as its
    metrics.jsonl has them now, and then "pruned", "stopped" (a signal or time limit before
    its target: resumed next, pruned after MAX_TRIES in a row without a new epoch unless the
    scheduler itself was stopping it) or "reached" (its target rung, paused or finished)."""
    before = t.epochs
    if out.key is not None:
        t.key = out.key
    if out.epochs is not None:
        t.values, t.epochs = out.values, out.epochs
    if out.pruned and not (stopping and out.kind == "failed"):  # (stopped: not a failure)
        t.pruned, t.kind = out.pruned, out.kind
        return "pruned"
    if out.stopped or out.pruned:
        # a time limit that ends every job of a long rung still moves it on: not a try
        t.tries = 0 if t.epochs > before else t.tries + (0 if stopping else 1)
        if t.tries >= MAX_TRIES:
            t.pruned, t.kind = f"stopped {t.tries} times before epoch {t.target}", "failed"
            return "pruned"
        return "stopped"
    t.tries = 0
    return "reached"


def _monitor(cfg: Config) -> tuple[str, str]:
    """The validation metric the rungs rank by, and min | max: task.monitor and task.mode,
    else the task's own (built through the task seam, as a rank builds it; the same for every
    trial: config/sweepchecks.py refuses a swept task.name, monitor or mode)."""
    t = cfg.task
    if t.monitor and t.mode != "auto":
        return t.monitor, t.mode
    from ddpflow.seams.tasks import build_task, monitor
    from ddpflow.seams.userimport import add_code_dirs

    add_code_dirs(cfg)
    return monitor(cfg, build_task(cfg, cfg.stages[-1], None))
