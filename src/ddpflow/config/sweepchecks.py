"""A sweep's scheduler and search against the stages they act on (the schema checks one key
at a time): each mistake is one `invalid config: sweep.<key> ...` message naming the key and
what to write instead.

`sweep.scheduler: asha` pauses every trial at rungs counted in epochs of the LAST stage
(earlier stages train fully), because validation, the metric a rung ranks by, and the
epoch-end checkpoint a paused trial resumes from both come at epoch ends. The last rung is
that stage's `epochs`: a trial's learning-rate schedule is the maximum resource's from its
first step, so a promoted trial continues its schedule instead of restarting one.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from ddpflow.core.errors import UserError

OPTUNA_FIX = "install it with pip install 'ddpflow[sweep]' (or pip install 'optuna>=3')"


def rungs(min_epochs: int, max_epochs: int, eta: int) -> list[int]:
    """The rungs in epochs: min, min x eta, min x eta^2, ... below max, then max."""
    out, r = [], min_epochs
    while r < max_epochs:
        out.append(r)
        r *= eta
    return [*out, max_epochs]


def schedule_rungs(d: dict[str, Any]) -> list[int]:
    """A validated config dict's rungs: asha's, or only the last stage's end (tpe alone)."""
    last = d["stages"][-1]
    a = d["sweep"]["asha"]
    if d["sweep"]["scheduler"] != "asha":
        return [last["epochs"]]
    return rungs(a["min_epochs"], a["max_epochs"] or last["epochs"], a["eta"])


def check_sweep(d: dict[str, Any]) -> None:
    """sweep.scheduler and sweep.search (nothing to check when both are none)."""
    sw = d["sweep"]
    if sw["scheduler"] == "none" and sw["search"] == "none":
        return
    which = (f"sweep.scheduler {sw['scheduler']}" if sw["scheduler"] != "none"
             else f"sweep.search {sw['search']}")
    if not (sw["grid"] or sw["variants"] or sw.get("random")):
        raise UserError(f"invalid config: {which} has no trials to run: set sweep.grid, "
                        f"sweep.random or sweep.variants")
    if sw["search"] == "tpe":
        _check_tpe(sw)
    if sw["scheduler"] == "asha":
        _check_asha(d)
    _check_fixed_keys(d, which)
    if d["checkpoint"]["resume"] != "auto":
        raise UserError(f"invalid config: {which} resumes paused and stopped trials from "
                        f"their checkpoints, but checkpoint.resume is "
                        f"{d['checkpoint']['resume']}; set checkpoint.resume: auto")


def _check_tpe(sw: dict[str, Any]) -> None:
    if not sw.get("random"):
        raise UserError("invalid config: sweep.search tpe draws its trials from sweep.random's "
                        "space: set sweep.random {samples, seed, space} (and no sweep.grid)")
    if sw["grid"] or sw["variants"]:
        key = "sweep.grid" if sw["grid"] else "sweep.variants"
        raise UserError(f"invalid config: sweep.search tpe draws every trial from "
                        f"sweep.random.space; {key} cannot be combined with it (put the "
                        f"setting into the space, e.g. as a choice)")
    try:
        version = importlib.metadata.version("optuna")
    except importlib.metadata.PackageNotFoundError:
        raise UserError(f"invalid config: sweep.search tpe needs Optuna, which is not "
                        f"installed: {OPTUNA_FIX}") from None
    if int(version.split(".")[0]) < 3:
        raise UserError(f"invalid config: sweep.search tpe needs Optuna 3 or newer, found "
                        f"{version}: {OPTUNA_FIX}")


def _check_asha(d: dict[str, Any]) -> None:
    """The rungs fit the last stage: epochs (not steps), below its end, each validated."""
    i, last, a = len(d["stages"]) - 1, d["stages"][-1], d["sweep"]["asha"]
    key = f"stages.{i}"
    if last["max_steps"] is not None:
        raise UserError(f"invalid config: sweep.scheduler asha counts rungs in epochs of the "
                        f"last stage, but {key}.max_steps is set; give {key}.epochs instead")
    if a["max_epochs"] is not None and a["max_epochs"] != last["epochs"]:
        raise UserError(f"invalid config: sweep.asha.max_epochs {a['max_epochs']} is not "
                        f"{key}.epochs {last['epochs']}; the last rung is the stage's end (its "
                        f"learning-rate schedule runs to it): set one to the other, or "
                        f"max_epochs: null")
    if a["min_epochs"] >= last["epochs"]:
        raise UserError(f"invalid config: sweep.asha.min_epochs {a['min_epochs']} leaves no "
                        f"rung before the end of {key} ({last['epochs']} epochs); give "
                        f"min_epochs below {last['epochs']}")
    every = last["validate_every_epochs"]
    off = [r for r in schedule_rungs(d)[:-1] if r % every]
    if off:
        raise UserError(f"invalid config: sweep.asha rung at epoch {off[0]} is not validated: "
                        f"{key}.validate_every_epochs is {every}; make sweep.asha.min_epochs a "
                        f"multiple of {every} (or validate_every_epochs: 1)")
    if last["stop"].get("patience") is not None:
        raise UserError(f"invalid config: {key}.stop.patience stops trials early on its own, "
                        f"and sweep.scheduler asha stops them too; use one of them (set "
                        f"{key}.stop.patience: null)")


def _canonical(key: str) -> str:
    return ".".join(str(int(p)) if p.isascii() and p.isdigit() else p for p in key.split("."))


def _check_fixed_keys(d: dict[str, Any], which: str) -> None:
    """Trials of one scheduler share the rungs and the ranking metric: a swept key that
    changes them is refused."""
    i = len(d["stages"]) - 1
    fixed = [f"stages.{i}.{k}" for k in ("epochs", "max_steps", "validate_every_epochs",
                                          "stop")] + ["task.name", "task.monitor", "task.mode"]
    sw = d["sweep"]
    swept = [(k, "sweep.grid") for k in sw["grid"]]
    swept += [(k, "sweep.random.space") for k in (sw.get("random") or {}).get("space", {})]
    swept += [(k, f"sweep.variants '{v['name']}' set") for v in sw["variants"]
              for k in (v.get("set") or {})]
    for key, where in swept:
        c = _canonical(key)
        for f in fixed:
            if c == f or f.startswith(c + ".") or c.startswith(f + "."):
                raise UserError(f"invalid config: {where} key '{key}' changes {f}, which "
                                f"{which} needs to be the same for every trial (the rungs "
                                f"and the metric they rank by); set it once, outside the sweep")
