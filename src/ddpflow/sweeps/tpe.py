"""`sweep.search: tpe`: the next trial drawn by Optuna's TPE sampler from `sweep.random.space`,
given every result the scheduler has so far.

Optuna is the sampler only; the scheduler's state (schedstate.py) is the record. Each draw
builds an in-memory study from that record: a trial at the last rung is COMPLETE with its
value, a paused one is PRUNED with its rungs' values as intermediate values (TPE ranks pruned
trials by the furthest rung they reached, then by its value), a failed one is left out. The
sampler's seed is the sweep's seed and the draw's number, so a draw depends only on the
results it was given: with `sweep.parallel: 1` the same seed draws the same trials; with more
at once, which results are in when a trial is drawn depends on timing. Every draw is recorded,
and a rerun reuses the recorded trials instead of drawing again.
"""

from __future__ import annotations

import json
from typing import Any

from ddpflow.sweeps.asha import TrialState

STARTUP_MAX = 10  # Optuna's default number of random draws before TPE models the results


def _distribution(spec: dict):
    from optuna.distributions import (
        CategoricalDistribution,
        FloatDistribution,
        IntDistribution,
    )

    (kind, arg), = spec.items()
    if kind == "choice":  # by index: a choice may be a list or a mapping, which Optuna refuses
        return CategoricalDistribution(list(range(len(arg))))
    lo, hi = arg
    if kind == "int_uniform":
        return IntDistribution(int(lo), int(hi))
    return FloatDistribution(lo, hi, log=kind == "log_uniform")


def _param(spec: dict, value: Any) -> Any:
    """A recorded override as the distribution's parameter (a choice: its index)."""
    (kind, arg), = spec.items()
    if kind != "choice":
        return value
    texts = [json.dumps(c, sort_keys=True) for c in arg]
    return texts.index(json.dumps(value, sort_keys=True))


def _value(spec: dict, param: Any) -> Any:
    """A drawn parameter as the override (floats to four significant digits, as random's)."""
    (kind, arg), = spec.items()
    if kind == "choice":
        return arg[param]
    if kind == "int_uniform":
        return int(param)
    lo, hi = arg
    return min(max(float(f"{param:.4g}"), lo), hi)


def _observed(t: TrialState, space: dict, rungs: list[int]):
    """A trial as Optuna's FrozenTrial, or None (nothing measured yet, or failed)."""
    import optuna

    values = {r: t.values[r] for r in rungs if t.reached(r)}
    if not values or any(k not in t.overrides for k in space):
        return None
    nan = {r: float("nan") if v is None else v for r, v in values.items()}
    params = {k: _param(spec, t.overrides[k]) for k, spec in space.items()}
    dists = {k: _distribution(spec) for k, spec in space.items()}
    done = t.reached(rungs[-1]) and values[rungs[-1]] is not None
    state = optuna.trial.TrialState.COMPLETE if done else optuna.trial.TrialState.PRUNED
    return optuna.trial.create_trial(params=params, distributions=dists,
                                     value=nan[rungs[-1]] if done else None,
                                     intermediate_values=nan, state=state)


def startup_trials(samples: int) -> int:
    """Random draws before TPE models the results: a quarter of the sweep's samples, at
    least 2 (TPE needs two results to split into good and bad), at most Optuna's default."""
    return min(STARTUP_MAX, max(2, samples // 4))


def draw(space: dict, seed: int, number: int, samples: int, history: list[TrialState],
         rungs: list[int], mode: str) -> dict:
    """The overrides of draw `number` (0-based) given the trials so far."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=(seed * 1_000_003 + number) % 2**32,
                                         n_startup_trials=startup_trials(samples))
    study = optuna.create_study(direction="maximize" if mode == "max" else "minimize",
                                sampler=sampler)
    for t in sorted(history, key=lambda t: t.number):
        frozen = _observed(t, space, rungs)
        if frozen is not None:
            study.add_trial(frozen)
    trial = study.ask({k: _distribution(spec) for k, spec in space.items()})
    return {k: _value(spec, trial.params[k]) for k, spec in space.items()}
