"""The sweep's scheduler loop (sweeps/scheduler.py) where tests/test_sweep_run_unit.py leaves
it: a failed trial pruned at once, the message naming the run and its folder when another
scheduler holds the sweep's lock, an earlier run's done.json removed before a sweep that then
fails, each decision recorded in state.json before its job starts (a stop then resumes that
job) and the state rewritten on a run with nothing left to do, `sweep.parallel` jobs at a
time with every decision starting one and every ended job taken in once, the metric the
rungs rank by from a user's task built for the last stage from its code folder, TPE's draws
(each retry a new seed from the sweep's seed, 20 tries before it stops drawing), and a job's
result in its trial's record (stops in a row pruned after three). The trials run by a runner
that leaves a trainer's files (no training); a sweep that would run on fails its test. Fast.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import tiny_config
from ddpflow.config import from_dict
from ddpflow.core import locks
from ddpflow.core.errors import UserError
from ddpflow.sweeps import schedstate, trialrun

STAGE = [{"name": "s1", "epochs": 3, "batch_size": 32, "lr": 0.1}]
VALUES = {0.1: [0.5, 0.6, 0.7], 0.2: [0.6, 0.8, 0.9], 0.3: [0.1, 0.2, 0.3]}


class Trainer:
    """A runner whose `launch` of a trial leaves what the trainer would: a validated epoch
    per epoch in metrics.jsonl up to its rung (values by lr, VALUES), and at the stage's end
    its summary; `fail`: lrs whose launch fails; `during`: called with the trial's config
    and its target as the launch starts. A sweep that launches more than 30 jobs (a few
    trials here) fails its test instead of running on."""

    where = "the test"

    def __init__(self, fail=(), during=None):
        self.fail, self.during = fail, during
        self.launches = 0

    def preflight(self, cfg, log):
        pass

    def stop(self):
        pass

    def run(self, cfg, words, log, gpus=True):
        words = [str(w) for w in words]
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("")
        if words[0] != "launch":
            return 0
        self.launches += 1
        assert self.launches <= 30, "the scheduler keeps sending trials that cannot go on"
        trial = trialrun.trial_config(Path(words[2]), "t")
        stage = trial.stages[-1]
        halt = int(words[-1]) if "--halt-after-epochs" in words else stage.epochs
        if self.during:
            self.during(trial, halt)
        if stage.lr in self.fail:
            log.write_text(f"ddpflow: error: lr {stage.lr} broke\n")
            return 1
        folder = trial.stage_dir(stage.name)
        folder.mkdir(parents=True, exist_ok=True)
        lines = [{"kind": "val", "epoch": e, "val_acc": v}
                 for e, v in enumerate(VALUES.get(stage.lr, [0.5] * 3)[:halt])]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        if halt == stage.epochs:
            from ddpflow.core.checksum import sha256_of
            from ddpflow.results import provenance
            from ddpflow.results.summary import write_summary

            (folder / "final.pt").write_bytes(b"weights")
            write_summary(folder / "summary.json", {
                "finished": True, "steps": 4, "wall_time_s": 1.0, "world_size": 2,
                "record": provenance.expected_record(trial, stage.name),
                "final_sha256": sha256_of(folder / "final.pt")})
        return 0


@pytest.fixture
def watched(monkeypatch):
    """The scheduler's decisions (asha.next_job's answers) and the jobs it waits on: a loop
    that decides without starting the job, or waits again on a job whose end it took in,
    fails its test instead of spinning."""
    from ddpflow.sweeps import asha, scheduler

    seen = {"waited": [], "decided": [], "ended": set()}
    real_wait, real_next = scheduler.wait, asha.next_job

    def wait(fs, **kw):
        seen["waited"].append(len(fs))
        assert not seen["ended"] & set(fs), "a job whose end was taken in is waited for again"
        done, rest = real_wait(fs, **kw)
        seen["ended"].update(done)
        return done, rest

    def next_job(*args):
        seen["decided"].append(real_next(*args))
        assert len(seen["decided"]) <= 40, "the scheduler decides without starting the job"
        return seen["decided"][-1]

    monkeypatch.setattr(scheduler, "wait", wait)
    monkeypatch.setattr(asha, "next_job", next_job)
    return seen


def _sweep(tmp_path, lrs=(0.1, 0.2, 0.3), **sweep):
    grid = {} if "random" in sweep else {"grid": {"stages.0.lr": list(lrs)}}
    return from_dict(tiny_config(tmp_path, stages=STAGE, hardware={"device": "cpu"}, sweep={
        **grid, "scheduler": "asha", "parallel": 1, "asha": {"min_epochs": 1, "eta": 3},
        **sweep}))


def _scheduler(cfg, runner):
    from ddpflow.sweeps import plan as planning
    from ddpflow.sweeps.scheduler import Scheduler

    s = Scheduler(cfg, planning.plan(cfg), cfg.run_dir / "logs" / "trials", "node")
    s.runner = s.job.runner = runner
    return s


# ------------------------------------------------------------------ the sweep's lock and marks

def test_a_trial_whose_job_fails_is_pruned_at_once_and_fails_the_sweep(tmp_path, capsys,
                                                                       watched):
    cfg = _sweep(tmp_path, lrs=(0.1,))
    runner = Trainer(fail=(0.1,))
    assert _scheduler(cfg, runner).run() == 1
    assert runner.launches == 1  # not tried again while the scheduler goes on
    (t,) = schedstate.trials_of(schedstate.read_state(cfg))
    assert (t.pruned, t.kind, t.tries) == ("stage s1: ddpflow: error: lr 0.1 broke", "failed", 0)


def test_a_sweep_whose_scheduler_runs_elsewhere_is_refused_naming_the_run(tmp_path):
    from ddpflow.sweeps import scheduler

    cfg = _sweep(tmp_path)
    where = schedstate.folder(cfg)
    with locks.exclusive(where / ".lock", "another scheduler"):
        holder = (where / ".lock").read_text().strip()
        with pytest.raises(UserError) as e:
            scheduler.schedule(cfg, None)
    assert str(e.value) == (
        f"the sweep scheduler of run 't' ({where}) is being written by another ddpflow process "
        f"({holder}); wait for it to finish or stop it, then run again")
    assert not (cfg.run_dir / "sweep" / "plan.json").exists()  # nothing written


def test_an_earlier_done_mark_is_removed_before_a_sweep_that_fails(tmp_path, capsys):
    cfg = _sweep(tmp_path)
    assert _scheduler(cfg, Trainer()).run() == 0
    done = schedstate.folder(cfg) / "done.json"
    assert done.is_file()
    cfg = _sweep(tmp_path, lrs=(0.1, 0.2, 0.3, 0.4))  # one more trial, whose job fails
    assert _scheduler(cfg, Trainer(fail=(0.4,))).run() == 1
    assert not done.exists()  # the workflow must not take the sweep as done


def test_each_decision_is_in_the_state_before_its_job_starts(tmp_path, capsys):
    """A scheduler stopped while a job runs resumes that job: its target is recorded first."""
    seen = []

    def during(trial, target):
        state = schedstate.trials_of(schedstate.read_state(cfg))
        lr = trial.stages[0].lr
        seen.append((lr, target, [t.target for t in state if t.overrides["stages.0.lr"] == lr]))

    cfg = _sweep(tmp_path)
    assert _scheduler(cfg, Trainer(during=during)).run() == 0
    assert seen == [(0.2, 1, [1]), (0.1, 1, [1]), (0.3, 1, [1]), (0.2, 3, [3])]


def test_a_rerun_with_nothing_left_to_run_records_the_sweep_as_it_is_now(tmp_path, capsys):
    cfg = _sweep(tmp_path)
    assert _scheduler(cfg, Trainer()).run() == 0
    cfg = _sweep(tmp_path, lrs=(0.2,))  # the grid shrunk to its finished trial
    runner = Trainer()
    s = _scheduler(cfg, runner)
    assert s.run() == 0 and runner.launches == 0
    state = schedstate.trials_of(schedstate.read_state(cfg))
    assert [(t.id, t.number, t.epochs) for t in state] == [(s.trials[0].id, 0, 3)]


@pytest.mark.parametrize("parallel", [1, 2])
def test_parallel_jobs_at_a_time_and_each_decision_starts_one(tmp_path, capsys, watched,
                                                              parallel):
    cfg = _sweep(tmp_path, lrs=(0.1, 0.2, 0.3, 0.4), parallel=parallel)
    runner = Trainer()
    assert _scheduler(cfg, runner).run() == 0
    assert max(watched["waited"]) == parallel
    assert len([d for d in watched["decided"] if d is not None]) == runner.launches


# ------------------------------------------------------------------ the metric of the rungs

TASK = '''
class Smoothed:
    """A task whose validation metric depends on its stage's label smoothing."""

    maximize = ("acc", "smooth_acc")

    def __init__(self, label_smoothing=0.0):
        self.monitor = "val_smooth_acc" if label_smoothing else "val_loss"

    def loss(self, outputs, batch):
        return 0.0

    def metrics(self, outputs, batch):
        return {}


def make(label_smoothing=0.0):
    return Smoothed(label_smoothing)
'''


def test_the_rungs_rank_by_the_last_stages_task_from_the_users_code(tmp_path, monkeypatch):
    from ddpflow.sweeps.scheduler import _monitor

    code = tmp_path / "code"
    code.mkdir()
    (code / "sweep_ranked_task.py").write_text(TASK)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the code folder is put first: undone
    monkeypatch.delitem(sys.modules, "sweep_ranked_task", raising=False)
    stages = [{"name": "s1", "epochs": 1, "batch_size": 32, "lr": 0.1},
              {"name": "s2", "epochs": 3, "batch_size": 32, "lr": 0.1,
               "label_smoothing": 0.1, "init_from": "previous"}]
    cfg = from_dict(tiny_config(tmp_path, stages=stages, model={"code_dir": str(code)},
                                task={"name": "sweep_ranked_task:make"}))
    try:
        assert _monitor(cfg) == ("val_smooth_acc", "max")  # s2's task, as its ranks build it
    finally:
        sys.modules.pop("sweep_ranked_task", None)


# ------------------------------------------------------------------ TPE's draws

@pytest.mark.parametrize("seed", [None, 5])
def test_tpe_retries_a_repeated_point_with_new_seeds_then_gives_up(tmp_path, monkeypatch,
                                                                   capsys, seed):
    """Draw n's k-th try has seed (sweep.random.seed, else 0) + 7919 k: the same sweep draws
    the same trials on every rerun, and a repeat is tried again with another seed 20 times
    before the scheduler stops drawing (it never spins on a space it has drawn whole)."""
    pytest.importorskip("optuna")
    from ddpflow.sweeps import tpe

    asked = []
    real = tpe.draw

    def draw(space, seed, number, samples, history, rungs, mode):
        asked.append((seed, number, samples, len(history), rungs, mode))
        assert len(asked) <= 60, "the scheduler keeps drawing a space it has drawn whole"
        return real(space, seed, number, samples, history, rungs, mode)

    monkeypatch.setattr(tpe, "draw", draw)
    space = {"stages.0.lr": {"choice": [0.1, 0.2]}}
    cfg = _sweep(tmp_path, search="tpe", scheduler="none", random={
        "samples": 3, "space": space, **({} if seed is None else {"seed": seed})})
    s = _scheduler(cfg, Trainer())
    assert s.run() == 0
    first = seed or 0
    assert asked[0] == (first, 0, 3, 0, [3], "max")
    retries = [a for a in asked if a[1] == 1]
    assert retries == [(first + 7919 * k, 1, 3, 1, [3], "max") for k in range(len(retries))]
    assert asked[1 + len(retries):] == [(first + 7919 * k, 2, 3, 2, [3], "max")
                                        for k in range(20)]
    assert sorted(t.overrides["stages.0.lr"] for t in s.trials) == [0.1, 0.2]
    assert ("ddpflow: sweep 't': TPE drew only points it had drawn before after 2 trial(s); "
            "no more") in capsys.readouterr().err.splitlines()


# ------------------------------------------------------------------ a job's result

def test_a_trial_stopped_before_its_rung_is_resumed_and_pruned_after_three_in_a_row():
    from ddpflow.sweeps.asha import TrialState
    from ddpflow.sweeps.scheduler import record

    t = TrialState("a", {}, None, 0, target=3)
    stopped = trialrun.Outcome(key="k", values={1: 0.5}, epochs=1, stopped=True)
    assert record(t, stopped, False) == "stopped" and (t.tries, t.pruned) == (0, None)
    assert (t.key, t.values, t.epochs) == ("k", {1: 0.5}, 1)  # it moved on: not a try
    assert record(t, trialrun.Outcome(stopped=True), False) == "stopped" and t.tries == 1
    assert record(t, trialrun.Outcome(stopped=True), True) == "stopped" and t.tries == 1
    # a job that fails while the scheduler stops it was stopped, not broken
    failed = trialrun.Outcome(pruned="stage s1: killed", kind="failed")
    assert record(t, failed, True) == "stopped" and (t.tries, t.pruned) == (1, None)
    assert record(t, trialrun.Outcome(stopped=True), False) == "stopped" and t.tries == 2
    reached = trialrun.Outcome(values={1: 0.5, 2: 0.6, 3: 0.7}, epochs=3)
    assert record(t, reached, False) == "reached" and t.tries == 0  # in a row: counted again
    t.target = 5
    for tries in (1, 2):
        assert record(t, trialrun.Outcome(stopped=True), False) == "stopped"
        assert t.tries == tries
    assert record(t, trialrun.Outcome(stopped=True), False) == "pruned"
    assert (t.pruned, t.kind) == ("stopped 3 times before epoch 5", "failed")


def test_tpe_draws_exactly_its_samples(tmp_path, capsys):
    pytest.importorskip("optuna")
    space = {"stages.0.lr": {"log_uniform": [0.001, 0.5]}}  # a draw never repeats
    cfg = _sweep(tmp_path, search="tpe", scheduler="none",
                 random={"samples": 2, "space": space, "seed": 3})
    runner = Trainer()
    assert _scheduler(cfg, runner).run() == 0
    drawn = schedstate.trials_of(schedstate.read_state(cfg))
    assert [t.number for t in drawn] == [0, 1] and runner.launches == 2
