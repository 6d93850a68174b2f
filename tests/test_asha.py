"""The sweep scheduler's decisions without training anything: the rungs, ASHA's promotions
(as soon as a trial is in the top 1/eta of its rung, later when the ranking changes, never
a NaN), TPE's draws (the same seed and results draw the same trial), the schedule's config
checked class by class (docs/RELIABILITY.md), and `launch --halt-after-epochs` refused where
a stage cannot pause. Runs of real trials are in test_sweep_asha.py."""

from __future__ import annotations

import pytest

from conftest import ddpflow, tiny_config, write_config
from ddpflow.config import from_dict
from ddpflow.config.sweepchecks import rungs
from ddpflow.core.errors import UserError
from ddpflow.sweeps import asha
from ddpflow.sweeps.asha import TrialState


@pytest.mark.parametrize("lo, hi, eta, expected", [
    (1, 9, 3, [1, 3, 9]), (1, 10, 3, [1, 3, 9, 10]), (2, 8, 2, [2, 4, 8]), (1, 2, 3, [1, 2]),
    (3, 4, 2, [3, 4])])
def test_rungs_grow_by_eta_and_end_at_the_stage_end(lo, hi, eta, expected):
    assert rungs(lo, hi, eta) == expected


RUNGS = [1, 3, 9]


def _t(i: int, values: dict, target: int | None = None, **kw) -> TrialState:
    epochs = max(values, default=0)
    return TrialState(f"t{i}", {"x": i}, None, i, "k", dict(values), epochs,
                      epochs if target is None else target, **kw)


def _next(trials, busy=(), can_draw=False, mode="max", eta=3):
    return asha.next_job(trials, RUNGS, eta, mode, set(busy), can_draw)


def test_a_trial_in_the_top_third_is_promoted_as_soon_as_that_is_known():
    # three finished rung 1: the best of them (the top floor(3/3) = 1) goes on at once
    trials = [_t(0, {1: 0.5}), _t(1, {1: 0.9}), _t(2, {1: 0.7})]
    job = _next(trials, can_draw=True)
    assert (job.trial, job.target, job.why) == ("t1", 3, "promote")
    # with two results nobody is in the top third: the free worker starts a new trial
    job = _next(trials[:2], can_draw=True)
    assert job.new and job.target == 1 and job.why == "start"
    # min mode (a loss): the lowest value goes on
    assert _next(trials, mode="min").trial == "t0"


def test_a_paused_trial_is_promoted_later_when_its_rung_grows():
    trials = [_t(i, {1: v}) for i, v in enumerate([0.9, 0.8, 0.1])]
    trials[0].target = 3  # t0 already promoted (on its way to rung 3)
    assert _next(trials, busy={"t0"}) is None  # t1 is 2nd of 3: paused; a worker waits
    trials += [_t(3, {1: 0.2}), _t(4, {1: 0.3}), _t(5, {1: 0.05})]
    # six at rung 1: the top two are t0 (promoted) and t1, which goes on now
    job = _next(trials, busy={"t0"})
    assert (job.trial, job.target) == ("t1", 3)


def test_higher_rungs_first_and_a_stopped_promotion_before_anything():
    trials = [_t(i, {1: 0.1 * i, 3: 0.1 * i}) for i in range(3)]
    trials += [_t(3 + i, {1: 0.5 + i}) for i in range(3)]
    # rung 3 has three trials: its best (t2) goes to rung 9 before rung 1's promotion
    assert (_next(trials).trial, _next(trials).target) == ("t2", 9)
    trials[1].target = 9  # t1 was sent to rung 9 and stopped on the way (a signal)
    job = _next(trials)
    assert (job.trial, job.target, job.why) == ("t1", 9, "resume")
    assert _next(trials, busy={"t1"}).trial == "t2"  # a running trial is not taken twice


def test_nan_ranks_last_and_a_pruned_trial_is_never_promoted():
    # a NaN (None, or a float NaN) counts as the rung's worst: the best finite value goes on
    for nan in (None, float("nan")):
        trials = [_t(0, {1: nan}), _t(1, {1: 0.5}), _t(2, {1: 0.4})]
        job = _next(trials)
        assert (job.trial, job.why) == ("t1", "promote")
    for t in trials[1:]:
        t.values[1] = None
    assert _next(trials, can_draw=True).new  # all NaN: nothing is promoted, a new trial
    # a pruned trial keeps its place in its rung's ranking but never goes on
    trials = [_t(0, {1: 0.99}, pruned="failed", kind="failed"), _t(1, {1: 0.5}),
              _t(2, {1: 0.4})]
    assert _next(trials, can_draw=True).new
    assert _next(trials).trial == "t1"  # the end game takes the best trial left, not t0
    assert asha.status(trials[0], RUNGS) == "pruned"


def test_the_end_game_finishes_the_best_trial_of_the_highest_rung():
    # four trials, eta 3: rung 3 holds one trial, whose top third is empty; nothing runs and
    # nothing is left: the best at rung 3 goes on so the sweep ends with a finished trial
    trials = [_t(0, {1: 0.9, 3: 0.95}), _t(1, {1: 0.5}), _t(2, {1: 0.4}), _t(3, {1: 0.3})]
    job = _next(trials)
    assert (job.trial, job.target, job.why) == ("t0", 9, "finish")
    assert _next(trials, busy={"t1"}) is None  # only once nothing runs
    trials[0].values[9], trials[0].epochs = 0.97, 9
    assert _next(trials) is None  # one trial finished: the sweep is done
    assert asha.status(trials[0], RUNGS) == "finished" and asha.rung_of(trials[0], RUNGS) == 9


def test_a_grid_starts_in_an_order_drawn_from_its_ids():
    ids = [f"lr-{x}-abc" for x in ("0.001", "0.01", "0.1", "1")]
    order = asha.start_order(ids)
    assert sorted(order) == sorted(ids) and order != ids  # not the grid's rising order
    assert order == ["lr-0.01-abc", "lr-0.1-abc", "lr-0.001-abc", "lr-1-abc"]
    # a trial added to the grid leaves the others' order alone
    assert [i for i in asha.start_order([*ids, "lr-10-abc"]) if i != "lr-10-abc"] == order


def test_plan_trials_start_in_order_before_new_draws():
    trials = [_t(0, {1: 0.5}), TrialState("t1", {}, None, 1), TrialState("t2", {}, None, 2)]
    job = _next(trials, can_draw=True)
    assert (job.trial, job.target, job.why, job.new) == ("t1", 1, "start", False)


# --------------------------------------------------------------------------- TPE
SPACE = {"stages.0.lr": {"log_uniform": [1e-3, 1.0]}, "stages.0.batch_size":
         {"choice": [16, 32]}, "model.kwargs": {"choice": [{"width": 8}, {"width": 16}]}}


def _history(n: int) -> list[TrialState]:
    from ddpflow.sweeps.tpe import draw

    out = []
    for i in range(n):
        point = draw(SPACE, 7, i, 20, out, [1, 3], "max")
        t = TrialState(f"t{i}", point, None, i, "k", {1: point["stages.0.lr"]}, 1, 1)
        if i % 3 == 0:  # some reached the last rung: COMPLETE for TPE, the others PRUNED
            t.values[3], t.epochs, t.target = 2 * point["stages.0.lr"], 3, 3
        out.append(t)
    return out


def test_tpe_draws_the_same_trials_from_the_same_seed_and_results():
    from ddpflow.sweeps.tpe import draw

    pytest.importorskip("optuna")
    a, b = _history(8), _history(8)
    assert [t.overrides for t in a] == [t.overrides for t in b]
    assert len({str(t.overrides) for t in a}) == 8  # one seed per draw: not one point 8 times
    for t in a:
        lr = t.overrides["stages.0.lr"]
        assert 1e-3 <= lr <= 1.0 and lr == float(f"{lr:.4g}")  # four digits, as random's
        assert t.overrides["stages.0.batch_size"] in (16, 32)
        assert t.overrides["model.kwargs"] in ({"width": 8}, {"width": 16})
    # past the random start-up (5 of 20 samples), the draw follows the results it is given:
    # the same results, the same trial; other results, another trial
    nxt = draw(SPACE, 7, 8, 20, a, [1, 3], "max")
    assert nxt == draw(SPACE, 7, 8, 20, b, [1, 3], "max")
    for t in b:
        t.values = {r: -v for r, v in t.values.items()}
    assert nxt != draw(SPACE, 7, 8, 20, b, [1, 3], "max")
    assert nxt != draw(SPACE, 8, 8, 20, a, [1, 3], "max")  # another seed


def test_tpe_sees_finished_trials_as_complete_and_paused_ones_as_pruned():
    import optuna

    from ddpflow.sweeps.tpe import _observed

    point = {"stages.0.lr": 0.1, "stages.0.batch_size": 32, "model.kwargs": {"width": 16}}
    done = _observed(TrialState("a", point, None, 0, "k", {1: 0.5, 2: 0.6, 3: 0.7}, 3, 3),
                     SPACE, [1, 3])
    assert done.state == optuna.trial.TrialState.COMPLETE and done.value == 0.7
    assert done.params == {"stages.0.lr": 0.1, "stages.0.batch_size": 1, "model.kwargs": 1}
    paused = _observed(TrialState("b", point, None, 1, "k", {1: None}, 1, 1), SPACE, [1, 3])
    assert paused.state == optuna.trial.TrialState.PRUNED and paused.value is None
    assert list(paused.intermediate_values) == [1]  # the rung's result (NaN: worst)
    assert _observed(TrialState("c", point, None, 2), SPACE, [1, 3]) is None  # nothing yet


# --------------------------------------------------------------------------- config
ASHA = {"grid": {"stages.0.lr": [0.05, 0.1]}, "scheduler": "asha"}
CONFIG_ROWS = [
    # class, sweep section, stage keys, top-level keys, words of the one message
    ("eta below 2", {**ASHA, "asha": {"eta": 1}}, {}, {},
     ["sweep.asha.eta: 1 is less than the minimum of 2"]),
    ("no rung before the stage's end", {**ASHA, "asha": {"min_epochs": 4}}, {"epochs": 4}, {},
     ["sweep.asha.min_epochs 4 leaves no rung before the end of stages.0 (4 epochs)"]),
    ("a last rung that is not the stage's end", {**ASHA, "asha": {"max_epochs": 9}},
     {"epochs": 4}, {}, ["sweep.asha.max_epochs 9 is not stages.0.epochs 4"]),
    ("a stage measured in steps", ASHA, {"max_steps": 40}, {},
     ["counts rungs in epochs", "stages.0.max_steps is set"]),
    ("a rung that is not validated", {**ASHA, "asha": {"min_epochs": 1, "eta": 2}},
     {"epochs": 8, "validate_every_epochs": 2}, {},
     ["rung at epoch 1 is not validated", "validate_every_epochs is 2"]),
    ("two things that stop a trial early", ASHA, {"epochs": 4, "stop": {"patience": 2}}, {},
     ["stages.0.stop.patience", "use one of them"]),
    ("a swept key that moves the rungs", {**ASHA, "grid": {"stages.0.epochs": [4, 8]}},
     {"epochs": 4}, {}, ["sweep.grid key 'stages.0.epochs' changes stages.0.epochs"]),
    ("a swept ranking metric", {**ASHA, "variants": [{"name": "a", "set": {
        "task.monitor": "val_loss"}}]}, {"epochs": 4}, {},
     ["sweep.variants 'a' set key 'task.monitor'"]),
    ("a swept key inside one that moves the rungs",
     {**ASHA, "grid": {"stages.0.stop.target": [0.5, 0.9]}}, {"epochs": 4}, {},
     ["sweep.grid key 'stages.0.stop.target' changes stages.0.stop"]),
    ("a swept key above the ranking metric",
     {**ASHA, "variants": [{"name": "a", "set": {"task": {"name": "classification"}}}]},
     {"epochs": 4}, {}, ["sweep.variants 'a' set key 'task' changes task.name"]),
    ("a sweep with nothing to schedule", {"scheduler": "asha"}, {"epochs": 4}, {},
     ["sweep.scheduler asha has no trials to run"]),
    ("tpe without a space", {"search": "tpe", "grid": {"stages.0.lr": [0.1]}}, {}, {},
     ["sweep.search tpe draws its trials from sweep.random's space"]),
    ("tpe and a grid: a key in two places", {"search": "tpe", "grid": {"seed": [0, 1]},
                                             "random": {"samples": 2, "space": {
                                                 "stages.0.lr": {"uniform": [0.1, 0.2]}}}},
     {}, {}, ["sweep.grid cannot be combined with it"]),
    ("paused trials that could not resume", ASHA, {"epochs": 4},
     {"checkpoint": {"resume": "never"}}, ["checkpoint.resume is never"]),
]


@pytest.mark.parametrize("what, sweep, stage, top, words", CONFIG_ROWS,
                         ids=[r[0] for r in CONFIG_ROWS])
def test_a_bad_schedule_is_one_message_before_anything_runs(tmp_path, what, sweep, stage,
                                                            top, words):
    st = {"name": "a", "epochs": 4, "batch_size": 32, "lr": 0.1, **stage}
    cfg = tiny_config(tmp_path, sweep=sweep, stages=[st], hardware={"device": "cpu"}, **top)
    with pytest.raises(UserError) as e:
        from_dict(cfg)
    for w in words:
        assert w in str(e.value), (what, str(e.value))


@pytest.mark.parametrize("sweep, stage, expected", [
    ({**ASHA, "asha": {"min_epochs": 2, "eta": 2}}, {"epochs": 5, "validate_every_epochs": 2},
     [2, 4, 5]),  # the stage's end is always validated, whatever validate_every_epochs
    ({**ASHA, "asha": {"max_epochs": 4}}, {"epochs": 4}, [1, 3, 4]),
    ({**ASHA, "grid": {"stages.0.lr": [0.1], "stages.0.weight_decay": [0, 1e-4]},
      "variants": [{"name": "w", "set": {"task.kwargs": {}}}]}, {"epochs": 3}, [1, 3]),
    ({"search": "tpe", "random": {"samples": 2, "space": {"stages.0.lr": {
        "uniform": [0.1, 0.2]}}}}, {"epochs": 3}, [3]),  # tpe alone: the stage's end only
])
def test_a_good_schedule_validates(tmp_path, sweep, stage, expected):
    from ddpflow.config.sweepchecks import schedule_rungs

    st = {"name": "a", "batch_size": 32, "lr": 0.1, **stage}
    cfg = from_dict(tiny_config(tmp_path, sweep=sweep, stages=[st]))
    assert cfg.sweep.scheduled and schedule_rungs(cfg.to_dict()) == expected


def test_a_bad_schedule_through_the_cli_writes_nothing(tmp_path):
    cfg = tiny_config(tmp_path, sweep={**ASHA, "asha": {"eta": 1}}, hardware={"device": "cpu"})
    for command in (["sweep", "schedule"], ["sweep", "plan"], ["validate"]):
        proc = ddpflow(*command, "--config", write_config(tmp_path, cfg), timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert "sweep.asha.eta: 1 is less than the minimum of 2" in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "results").exists()
    # a sweep without a scheduler is not scheduled: the workflow runs its trials as jobs
    cfg = tiny_config(tmp_path, sweep={"grid": {"stages.0.lr": [0.1]}})
    proc = ddpflow("sweep", "schedule", "--config", write_config(tmp_path, cfg), timeout=120)
    assert proc.returncode == 2 and "this sweep has no scheduler" in proc.stderr, proc.stderr
    assert not (tmp_path / "results").exists()


TPE = {"search": "tpe", "random": {"samples": 3, "space": {"stages.0.lr": {
    "log_uniform": [0.01, 0.5]}}}}


def test_tpe_without_optuna_is_one_message(tmp_path, monkeypatch):
    """The package's optional extra absent (a fake: optuna is installed here)."""
    import importlib.metadata

    real = importlib.metadata.version

    def version(name):
        if name == "optuna":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(UserError) as e:
        from_dict(tiny_config(tmp_path, sweep=TPE))
    assert "sweep.search tpe needs Optuna, which is not installed" in str(e.value)
    assert "pip install 'ddpflow[sweep]'" in str(e.value)


def test_tpe_with_an_old_optuna_is_one_message(tmp_path):
    """An Optuna 2 found first on the path (its package metadata), as an old environment has."""
    site = tmp_path / "old"
    (site / "optuna-2.10.0.dist-info").mkdir(parents=True)
    (site / "optuna-2.10.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: optuna\nVersion: 2.10.0\n")
    import os

    from conftest import REPO
    cfg = tiny_config(tmp_path, sweep=TPE)
    proc = ddpflow("validate", "--config", write_config(tmp_path, cfg), timeout=120,
                   env={"PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(site)])})
    assert proc.returncode == 2, proc.stderr
    assert "needs Optuna 3 or newer, found 2.10.0" in proc.stderr, proc.stderr


def test_tpe_is_planned_while_the_sweep_runs(tmp_path):
    """`sweep list` and `sweep plan` check the space's values (random draws of it) and list
    no trial: TPE draws them as results come in."""
    cfg = tiny_config(tmp_path, sweep=TPE, hardware={"device": "cpu"})
    proc = ddpflow("sweep", "list", "--config", write_config(tmp_path, cfg), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "up to 3 trial(s) drawn while the sweep runs" in proc.stdout
    assert "\t" not in proc.stdout
    bad = {**TPE, "random": {"samples": 2, "space": {"stages.0.batch_size": {
        "choice": [16, "big"]}}}}
    proc = ddpflow("sweep", "plan", "--config", write_config(
        tmp_path, tiny_config(tmp_path, sweep=bad, hardware={"device": "cpu"})), timeout=120)
    assert proc.returncode == 2 and "stages.0.batch_size" in proc.stderr, proc.stderr


# --------------------------------------------------------------------------- launch
@pytest.mark.parametrize("stage, flag, words", [
    ({"epochs": 2}, "2", ["--halt-after-epochs 2: stage 's1' trains 2 epoch(s)",
                          "give 1..1"]),
    ({"epochs": 2}, "0", ["--halt-after-epochs 0", "give 1..1"]),
    ({"epochs": 2, "max_steps": 10}, "1", ["measured in steps (max_steps 10)",
                                           "use --halt-after-steps"]),
])
def test_a_halt_the_stage_cannot_make_is_one_message(tmp_path, stage, flag, words):
    st = {"name": "s1", "batch_size": 32, "lr": 0.1, **stage}
    path = write_config(tmp_path, tiny_config(tmp_path, stages=[st]))
    proc = ddpflow("launch", "--config", path, "--stage", "s1", "--halt-after-epochs", flag,
                   timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    for w in words:
        assert w in proc.stderr, proc.stderr
    assert not (tmp_path / "results").exists()


# --------------------------------------------------------------------------- one job's result
def _job(tmp_path, val_lines, rc, target, log="", failed=None):
    """A trial's stage folder as a job left it, read by TrialJob.outcome."""
    import json
    import threading

    from ddpflow.sweeps.trialrun import TrialJob

    cfg = from_dict(tiny_config(tmp_path, stages=[{"name": "a", "epochs": 3, "batch_size": 32,
                                                   "lr": 0.1}]))
    folder = cfg.stage_dir("a")
    folder.mkdir(parents=True)
    lines = [{"kind": "train", "step": 1, "epoch": 0, "loss": 2.0}]
    lines += [{"kind": "val", "step": 4 * (e + 1), "epoch": e, **m} for e, m in val_lines]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    if failed:
        (folder / "failed.json").write_text(json.dumps({"reason": failed}))
    (tmp_path / "train_a.log").write_text(log)
    job = TrialJob(None, tmp_path, tmp_path, "val_acc", {}, threading.Lock())
    return job.outcome(cfg, "key", target, rc, tmp_path / "train_a.log")


NAN = float("nan")
OUTCOME_ROWS = [
    # what, val lines (epoch index, metrics), rc, target, log, failed.json: expected
    ("paused at its rung", [(0, {"val_acc": 0.5})], 75, 1, "", None,
     dict(epochs=1, values={1: 0.5}, pruned=None, stopped=False)),
    ("the rung reached, exit 0", [(0, {"val_acc": 0.5})], 0, 1, "", None,
     dict(epochs=1, pruned=None, stopped=False)),
    ("stopped before its rung", [(0, {"val_acc": 0.5})], 75, 2, "", None,
     dict(epochs=1, values={1: 0.5}, pruned=None, stopped=True)),
    ("killed by a signal", [], 143, 1, "", None, dict(epochs=0, pruned=None, stopped=True)),
    ("ended by a signal it did not catch", [], -15, 1, "", None,
     dict(pruned=None, stopped=True)),
    ("the last rung without a fresh summary", [(2, {"val_acc": 0.7})], 0, 3, "", None,
     dict(pruned=None, stopped=True)),
    ("a failing trial", [], 2, 1, "x\nddpflow: error: stage 'a': batch_size 100000 is "
     "larger than the training split\n", None,
     dict(pruned="stage a: ddpflow: error: stage 'a': batch_size 100000 is larger than the "
          "training split", kind="failed", stopped=False)),
    ("a NaN metric", [(0, {"val_acc": NAN})], 75, 1, "", None,
     dict(pruned="val_acc is NaN at epoch 1", kind="nan", values={1: None})),
    ("an infinite metric", [(0, {"val_acc": float("inf")})], 75, 1, "", None,
     dict(pruned="val_acc is NaN at epoch 1", kind="nan")),
    ("a diverged loss", [], 3, 1, "", "loss nan at step 3 (epoch 0)", dict(
        pruned="diverged: loss nan at step 3 (epoch 0)", kind="diverged")),
    ("the monitor missing from the metrics", [(0, {"val_loss": 0.3})], 75, 1, "", None,
     dict(pruned="task.monitor val_acc is not among its validation metrics (val_loss); set "
                 "task.monitor to one of them", kind="failed", epochs=None)),
]


@pytest.mark.parametrize("what, vals, rc, target, log, failed, expected", OUTCOME_ROWS,
                         ids=[r[0] for r in OUTCOME_ROWS])
def test_a_jobs_result_is_read_from_the_trials_own_files(tmp_path, what, vals, rc, target,
                                                         log, failed, expected):
    out = _job(tmp_path, vals, rc, target, log, failed)
    for k, v in expected.items():
        assert getattr(out, k) == v, (what, k, getattr(out, k))


def test_a_result_into_the_trials_record():
    from ddpflow.sweeps.scheduler import MAX_TRIES, record
    from ddpflow.sweeps.trialrun import Outcome

    t = TrialState("t", {}, None, 0, target=1)
    assert record(t, Outcome(stopped=True), False) == "stopped" and t.tries == 1
    assert record(t, Outcome(key="k", values={1: 0.4}, epochs=1), False) == "reached"
    assert (t.key, t.values, t.epochs, t.tries) == ("k", {1: 0.4}, 1, 0)  # a new count
    t.target = 2
    # stopped before its target: tried again, and pruned after MAX_TRIES stops in a row
    for i in range(1, MAX_TRIES):
        assert record(t, Outcome(stopped=True), False) == "stopped" and t.tries == i
    assert record(t, Outcome(stopped=True), False) == "pruned"
    assert (t.pruned, t.kind) == (f"stopped {MAX_TRIES} times before epoch 2", "failed")
    # a stop after a new epoch (a time limit inside a long rung) starts a new count
    t = TrialState("t", {}, None, 0, target=3, tries=MAX_TRIES - 1)
    assert record(t, Outcome(values={1: 0.4}, epochs=1, stopped=True), False) == "stopped"
    assert t.tries == 0 and t.pruned is None
    assert record(t, Outcome(values={1: 0.4}, epochs=1, stopped=True), False) == "stopped"
    assert t.tries == 1
    # a job the scheduler itself stopped (SIGTERM) is neither a failure nor a try
    t = TrialState("t", {}, None, 0, target=2)
    assert record(t, Outcome(pruned="stage a: killed", kind="failed"), True) == "stopped"
    assert t.pruned is None and t.tries == 0
    assert record(t, Outcome(pruned="stage a: boom", kind="failed"), False) == "pruned"
    assert t.pruned == "stage a: boom"
    # a NaN is a result, whoever stopped the scheduler
    t = TrialState("t", {}, None, 0, target=1)
    out = Outcome(key="k", values={1: None}, epochs=1, pruned="val_acc is NaN", kind="nan")
    assert record(t, out, True) == "pruned" and t.kind == "nan" and t.values == {1: None}


@pytest.mark.parametrize("text, words", [
    ("{\"version\": 1, \"trials\": [", ["is not valid JSON"]),
    ("[1, 2]", ["is not of type 'object'"]),
    ('{"version": 1, "trials": [{"id": "../x", "overrides": {}, "number": 0, "values": {},'
     ' "epochs": 0, "target": 0}]}', ["trials.0.id"]),
    ('{"version": 1, "trials": [{"id": "a", "overrides": {}, "number": 0, "values": '
     '{"one": 0.5}, "epochs": 0, "target": 0}]}', ["trials.0.values"]),
])
def test_a_damaged_scheduler_state_is_one_message(tmp_path, text, words):
    """sweep/schedule/state.json as something else left it: the scheduler and the
    leaderboard say what is wrong with it and what to do, and train nothing."""
    cfg = tiny_config(tmp_path, sweep={**ASHA, "asha": {"min_epochs": 1}},
                      stages=[{"name": "a", "epochs": 2, "batch_size": 32, "lr": 0.1}],
                      hardware={"device": "cpu"})
    path = write_config(tmp_path, cfg)
    state = tmp_path / "results/t/sweep/schedule/state.json"
    state.parent.mkdir(parents=True)
    state.write_text(text)
    for command in (["sweep", "schedule"], ["sweep", "collect"]):
        if command[1] == "collect":
            assert ddpflow("sweep", "plan", "--config", path).returncode == 0
        proc = ddpflow(*command, "--config", path, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert "the sweep's scheduler state" in proc.stderr, proc.stderr
        assert "move it aside" in proc.stderr
        for w in words:
            assert w in proc.stderr, proc.stderr
    assert state.read_text() == text  # not replaced
    assert not list((tmp_path / "results/t/trials").glob("*/stages"))  # nothing trained


# --------------------------------------------------------------------------- runner
def test_sbatch_asks_for_the_trials_sizes_and_quotes_every_word(tmp_path):
    import shlex

    from ddpflow.sweeps.runner import ddpflow_words, sbatch_command, sbatch_options

    cfg = from_dict(tiny_config(tmp_path, slurm={
        "gpus": 2, "cpus_per_gpu": 3, "mem_mb": 4000, "runtime_min": 30, "partition": "p1",
        "account": "acc", "gpu_model": "a100", "extra": "--exclusive --mail-type=END"}))
    log = tmp_path / "it's a $(log) dir" / "train a.log"
    opts = sbatch_options(cfg, log, gpus=True)
    assert opts == [f"--job-name=ddpflow-{cfg.run}", f"--output={log}.slurm", "--time=30",
                    f"--signal=B:USR1@{cfg.slurm.signal_before_end_s}", "--gpus=a100:2",
                    "--cpus-per-gpu=3", "--mem=4000", "--partition=p1", "--account=acc",
                    "--exclusive", "--mail-type=END"]
    cpu = sbatch_options(cfg, log, gpus=False)  # preparing data: one CPU, no GPU
    assert "--cpus-per-task=1" in cpu and not any(o.startswith("--gpus") for o in cpu)
    cfg = from_dict(tiny_config(tmp_path, slurm={"gres": "gpu:t4:1", "cpus": 8},
                                hardware={"nodes": 2}))
    opts = sbatch_options(cfg, log)
    assert "--gres=gpu:t4:1" in opts and "--nodes=2" in opts and "--ntasks=2" in opts
    assert not any(o.startswith("--gpus") for o in opts)
    cfg = from_dict(tiny_config(tmp_path, slurm={"gpus": 0, "cpus": 6}))
    assert "--cpus-per-task=6" in sbatch_options(cfg, log)  # a CPU-only training job
    # the batch shell runs exactly ddpflow's words, whatever the paths hold
    words = ["launch", "--config", tmp_path / "a b;c" / "trial_config.json", "--stage", "x"]
    cmd = sbatch_command(opts, log, words)
    assert cmd[:3] == ["sbatch", "--parsable", "--wait"] and cmd[-2] == "--wrap"
    assert shlex.split(cmd[-1]) == ["exec", *ddpflow_words(log, words)]


def test_how_many_trials_run_at_once(tmp_path, monkeypatch):
    from ddpflow.sweeps.runner import SLURM_PARALLEL, parallel

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # a CPU-only node: a slot per core
    sweep = {"grid": {"stages.0.lr": [0.1, 0.2]}, "scheduler": "asha", "threads_per_trial": 1}
    cfg = from_dict(tiny_config(tmp_path, sweep=sweep, stages=[
        {"name": "a", "epochs": 2, "batch_size": 32, "lr": 0.1}], hardware={"device": "cpu"}))
    import os

    assert parallel(cfg, "node") == len(os.sched_getaffinity(0))  # this node's slots
    assert parallel(cfg, "slurm") == SLURM_PARALLEL
    monkeypatch.setenv("SLURM_JOB_ID", "1")  # inside one job: its allocation is one slot
    assert parallel(cfg, "node") == 1
    cfg = from_dict(tiny_config(tmp_path, sweep={**sweep, "parallel": 3}, stages=[
        {"name": "a", "epochs": 2, "batch_size": 32, "lr": 0.1}], hardware={"device": "cpu"}))
    assert parallel(cfg, "node") == parallel(cfg, "slurm") == 3
