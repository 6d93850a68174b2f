"""The sweep scheduler's pure parts, piece by piece: a trial's state and status, ASHA's
promotions at the last rung, the scheduler's state file written and read back, and TPE's
draws (the search space as Optuna's distributions, the direction it optimizes, the number
of random draws before it models, distinct draws from distinct draw numbers). Fast: no
training."""

from __future__ import annotations

import logging

import pytest

from conftest import tiny_config
from ddpflow.config import from_dict
from ddpflow.sweeps import asha, schedstate, tpe
from ddpflow.sweeps.asha import TrialState

RUNGS = [1, 3, 9]


def _t(i: int, values: dict, epochs: int | None = None, target: int | None = None,
       **kw) -> TrialState:
    epochs = max(values, default=0) if epochs is None else epochs
    return TrialState(f"t{i}", {"lr": 0.1 * (i + 1)}, None, i, "k", values, epochs,
                      epochs if target is None else target, **kw)


def test_a_trial_reached_a_rung_only_with_a_value_there_and_the_epochs():
    t = _t(0, {1: 0.5, 9: 0.7}, epochs=3)  # a value at 9 from a run since set aside
    assert t.reached(1) and not t.reached(3) and not t.reached(9)
    assert (t.value_at(1), t.value_at(3), t.value_at(9)) == (0.5, None, None)
    t.epochs = 9
    assert t.value_at(9) == 0.7 and t.reached(9)


def test_the_status_of_a_trial():
    assert asha.status(_t(0, {1: 0.5, 3: 0.6}), RUNGS) == "paused"
    assert asha.status(_t(0, {1: 0.5, 3: 0.6, 9: 0.7}), RUNGS) == "finished"
    assert asha.status(_t(0, {1: 0.5}), RUNGS, busy={"t0"}) == "running"
    assert asha.status(_t(0, {1: 0.5}, target=3), RUNGS) == "stopped"
    assert asha.status(_t(0, {}), RUNGS) == "waiting"
    assert asha.status(_t(0, {1: 0.5}, pruned="diverged"), RUNGS, busy={"t0"}) == "pruned"


def test_trials_at_the_last_rung_are_promoted_nowhere():
    """Three trials finished the last rung (eta 3: one of them is in its top third): no
    promotion out of the last rung, and no restart at the first."""
    done = [_t(i, {1: 0.1 * i, 3: 0.2 * i, 9: 0.3 * i}) for i in range(3)]
    assert asha.promotable(done, RUNGS, 3, "max", set()) is None
    assert asha.next_job(done, RUNGS, 3, "max", set(), can_draw=False) is None


# ------------------------------------------------------------------ the state file

def test_the_schedulers_state_is_written_and_read_back(tmp_path):
    cfg = from_dict(tiny_config(tmp_path))
    assert schedstate.read_state(cfg) is None and schedstate.trials_of(None) == []
    trials = [_t(1, {1: 0.5, 3: None}, target=9, kind=None, tries=2),
              _t(0, {1: 0.25}, pruned="failed", kind="failed")]
    schedstate.write_state(cfg, trials, "val_acc", "max", RUNGS)
    schedstate.write_state(cfg, trials, "val_acc", "max", RUNGS)  # again: replaced
    state = schedstate.read_state(cfg)
    assert state["rungs"] == RUNGS and [t["id"] for t in state["trials"]] == ["t0", "t1"]
    assert schedstate.trials_of(state) == sorted(trials, key=lambda t: t.number)
    del state["trials"][0]["tries"]  # written by an older ddpflow
    assert schedstate.trials_of(state)[0].tries == 0


# ------------------------------------------------------------------ TPE

SPACE = {"lr": {"uniform": [0.0, 1.0]}}


def test_the_space_becomes_optunas_distributions():
    from optuna.distributions import FloatDistribution, IntDistribution

    d = tpe._distribution({"int_uniform": [2, 9]})
    assert isinstance(d, IntDistribution) and (d.low, d.high) == (2, 9)
    assert tpe._distribution({"log_uniform": [1e-4, 1e-1]}).log is True
    d = tpe._distribution({"uniform": [0.0, 1.0]})
    assert isinstance(d, FloatDistribution) and d.log is False
    assert tpe._value({"int_uniform": [2, 9]}, 4.0) == 4 and \
        type(tpe._value({"int_uniform": [2, 9]}, 4.0)) is int


def test_a_recorded_choice_is_found_whatever_the_order_of_its_keys():
    spec = {"choice": [{"b": 1, "a": 2}, {"a": 0}]}
    assert tpe._param(spec, {"b": 1, "a": 2}) == 0
    assert tpe._param(spec, {"a": 2, "b": 1}) == 0
    assert tpe._param(spec, {"a": 0}) == 1


def test_what_tpe_is_told_of_a_trial():
    import optuna

    two = {"lr": {"uniform": [0.0, 1.0]}, "wd": {"uniform": [0.0, 1.0]}}
    assert tpe._observed(_t(0, {1: 0.5}), two, RUNGS) is None  # a key the space has, missing
    done = tpe._observed(_t(0, {1: 0.5, 3: 0.6, 9: 0.7}), SPACE, RUNGS)
    assert done.state == optuna.trial.TrialState.COMPLETE and done.value == 0.7
    nan_end = tpe._observed(_t(0, {1: 0.5, 3: 0.6, 9: None}), SPACE, RUNGS)
    assert nan_end.state == optuna.trial.TrialState.PRUNED and nan_end.value is None
    assert nan_end.intermediate_values[1] == 0.5


@pytest.mark.parametrize("samples, startup", [
    (4, 2), (7, 2), (8, 2), (12, 3), (13, 3), (20, 5), (40, 10), (400, 10)])
def test_random_draws_before_tpe_models_are_a_quarter_of_the_samples(samples, startup):
    assert tpe.startup_trials(samples) == startup


def test_draws_of_distinct_numbers_differ_and_the_same_number_repeats():
    numbers = [0, 1, 2, 3, 64, 65]
    draws = [tpe.draw(SPACE, 0, n, 20, [], RUNGS, "max")["lr"] for n in numbers]
    assert len(set(draws)) == len(numbers), draws
    assert tpe.draw(SPACE, 0, 3, 20, [], RUNGS, "max")["lr"] == draws[3]


def test_a_large_sweep_seed_draws():
    """sweep.seed is any integer the schema takes: the sampler's seed stays in numpy's
    range (under 2**32) whatever it is."""
    for seed in (4295, 10**9):
        assert 0.0 <= tpe.draw(SPACE, seed, 0, 20, [], RUNGS, "max")["lr"] <= 1.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tpe_draws_towards_the_better_end_for_the_monitors_mode(seed):
    """16 results where the value rises with lr: maximizing, TPE draws a high lr next;
    minimizing, a low one."""
    history = [TrialState(f"t{i}", {"lr": (i + 0.5) / 16}, None, i, "k",
                          {r: (i + 0.5) / 16 for r in RUNGS}, 9, 9) for i in range(16)]
    high = tpe.draw(SPACE, seed, 16, 8, history, RUNGS, "max")["lr"]
    low = tpe.draw(SPACE, seed, 16, 8, history, RUNGS, "min")["lr"]
    assert high > 0.5 > low, (high, low)


def test_a_draw_logs_nothing_of_optunas_own(caplog, capfd):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.INFO)  # as a fresh process has it
    with caplog.at_level(logging.DEBUG):
        tpe.draw(SPACE, 0, 0, 8, [], RUNGS, "max")
    assert "A new study created" not in capfd.readouterr().err + caplog.text
