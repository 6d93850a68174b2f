"""A sweep: one config, many trials (`sweep.grid`, `sweep.variants`, `sweep.random`).

Each trial is a full run of the config with some keys overridden, under
`<results_dir>/<run>/trials/<id>/`, with its own resolved config (`trial_config.json`).
Its id is readable and stable: built from its own overrides only (plus a short hash of
them), so adding a grid value adds trials without renaming the others. `plan` checks every
trial against the schema before anything is written; trials with equal data settings share
one prepared dataset (`data.prepared_dir` under `<run>/sweep/data/`), and all trials take
their GPUs/cores from one slot pool (`hardware.slots`, see slots.py).

    ddpflow sweep plan     --config F   # check, then write sweep/plan.json and trial configs
    ddpflow sweep list     --config F   # print the trials
    ddpflow sweep schedule --config F   # sweep.scheduler asha / search tpe (scheduler.py)
    ddpflow sweep collect  --config F   # leaderboard (leaderboard.py)
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import itertools
import json
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpflow.config import Config, from_dict, set_key
from ddpflow.core import reading
from ddpflow.core.errors import UserError

# keys a trial may not change: where results live, the sweep itself, and what all trials
# share (the container image is built once, the slot pool is the sweep's)
FIXED = ("run", "results_dir", "sweep", "hardware.slots", "data.prepared_dir", "container")


@dataclass(frozen=True)
class Trial:
    id: str
    overrides: dict  # dotted key -> value, in the order they were declared
    variant: str | None


# --------------------------------------------------------------------------- expanding
def _label(value: Any) -> str:
    text = (json.dumps(value, separators=(",", ":")) if isinstance(value, (list, dict))
            else str(value).lower() if isinstance(value, bool) else str(value))
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")[:24] or "x"


def trial_id(point: dict, variant: str | None, overrides: dict) -> str:
    """`<variant>_<key>-<value>_..-<hash6>`: the variant's name, then each grid/random key's
    last part (the whole key when two swept keys end alike) and value; the hash of all the
    trial's overrides keeps ids unique after shortening."""
    tails = [k.split(".")[-1] for k in point]
    parts = [variant] if variant else []
    for key, tail in zip(point, tails):
        name = tail if tails.count(tail) == 1 else key
        parts.append(f"{name}-{_label(point[key])}")
    blob = json.dumps(sorted(overrides.items(), key=lambda kv: kv[0]), sort_keys=True,
                      default=str)
    readable = "_".join(parts)[:80] or "base"
    return f"{readable}-{hashlib.sha256(blob.encode()).hexdigest()[:6]}"


def _draw(rng: random.Random, key: str, spec: dict) -> Any:
    (kind, arg), = spec.items()
    if kind == "choice":
        return copy.deepcopy(rng.choice(arg))
    lo, hi = arg
    if lo > hi:
        raise UserError(f"invalid sweep: sweep.random.space.{key}.{kind}: the lower bound "
                        f"{lo} is above the upper bound {hi}")
    if kind == "int_uniform":
        return rng.randint(int(lo), int(hi))
    if kind == "log_uniform":
        if lo <= 0:
            raise UserError(f"invalid sweep: sweep.random.space.{key}.log_uniform bounds must "
                            f"be > 0, got [{lo}, {hi}]; use uniform for ranges that reach 0")
        x = math.exp(rng.uniform(math.log(lo), math.log(hi)))
    else:
        x = rng.uniform(lo, hi)
    return float(f"{x:.4g}")  # four significant digits: readable ids, same value everywhere


def _points(sw: dict) -> list[dict]:
    """Grid or random points: dicts of dotted key -> value."""
    if sw["grid"] and sw["random"]:
        raise UserError("invalid sweep: use sweep.grid or sweep.random, not both (variants "
                        "combine with either)")
    if sw["random"]:
        r = sw["random"]
        rng = random.Random(r.get("seed", 0))
        return [{k: _draw(rng, k, spec) for k, spec in r["space"].items()}
                for _ in range(r["samples"])]
    keys = list(sw["grid"])
    return [dict(zip(keys, values)) for values in itertools.product(*sw["grid"].values())]


def count(sw: dict) -> int:
    """How many trials a sweep section makes, computed without expanding anything."""
    points = sw["random"]["samples"] if sw["random"] else math.prod(map(len, sw["grid"].values()))
    return max(len(sw["variants"]), 1) * points


def expand(d: dict) -> list[Trial]:
    """The trials of a validated config dict (defaults filled), in a stable order."""
    sw = d["sweep"]
    names = [v["name"] for v in sw["variants"]]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise UserError(f"invalid sweep: sweep.variants names must be unique, repeated: "
                        f"{', '.join(dupes)}")
    n = count(sw)
    if n > sw["max_trials"]:
        raise UserError(f"invalid sweep: {n} trials, more than sweep.max_trials "
                        f"{sw['max_trials']}; shrink the grid or raise sweep.max_trials")
    check_values(sw)
    check_places(sw)
    variants = [(v["name"], v.get("set") or {}) for v in sw["variants"]] or [(None, {})]
    trials = []
    for (name, sets), point in itertools.product(variants, _points(sw)):
        overrides = {**sets, **point}
        trials.append(Trial(trial_id(point, name, overrides), overrides, name))
    return trials


def _same(value: Any) -> str:
    """One text per meaning: 1 and 1.0 alike (YAML and --set write either), true not 1."""
    def norm(v):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, dict):
            return {str(k): norm(x) for k, x in v.items()}
        if isinstance(v, list):
            return [norm(x) for x in v]
        return v
    return json.dumps(norm(value), sort_keys=True, default=repr)


def check_values(sw: dict) -> None:
    """A grid list (or a choice list) that names one value twice, or two variants that set
    the same values, would run one trial twice."""
    lists = [(f"sweep.grid.{k}", v) for k, v in sw["grid"].items()]
    lists += [(f"sweep.random.space.{k}.choice", spec["choice"])
              for k, spec in ((sw["random"] or {}).get("space") or {}).items()
              if "choice" in spec]
    for where, values in lists:
        seen: dict[str, Any] = {}
        for v in values:
            if (text := _same(v)) in seen:
                first = seen[text]
                also = (f" ({json.dumps(first)} and {json.dumps(v)} mean the same setting)"
                        if json.dumps(first) != json.dumps(v) else "")
                raise UserError(f"invalid sweep: {where} lists the value {json.dumps(first)} "
                                f"twice{also}; remove one")
            seen[text] = v
    sets: dict[str, str] = {}
    for v in sw["variants"]:
        text = _same({_canonical(k): x for k, x in (v.get("set") or {}).items()})
        if (other := sets.setdefault(text, v["name"])) != v["name"]:
            raise UserError(f"invalid sweep: sweep.variants '{other}' and '{v['name']}' set the "
                            f"same values, so their trials would be the same runs; remove one")


def _canonical(key: str) -> str:
    return ".".join(str(int(p)) if p.isascii() and p.isdigit() else p for p in key.split("."))


def check_places(sw: dict) -> None:
    """A setting given in two places of one trial (the grid or random space and a variant's
    `set`, or two spellings of one key): refused, so no value is silently dropped."""
    swept = [(k, "sweep.grid") for k in sw["grid"]]
    swept += [(k, "sweep.random.space") for k in ((sw["random"] or {}).get("space") or {})]
    groups = [[(k, f"sweep.variants '{v['name']}' set") for k in (v.get("set") or {})]
              for v in sw["variants"]] or [[]]
    for group in groups:
        places = swept + group
        for i, (a, wa) in enumerate(places):
            for b, wb in places[i + 1:]:
                ca, cb = _canonical(a), _canonical(b)
                if ca == cb or ca.startswith(cb + ".") or cb.startswith(ca + "."):
                    why = (" (a variant's set may not repeat a swept key)"
                           if "variants" in wb else "")
                    raise UserError(f"invalid sweep: {wa} key '{a}' and {wb} key '{b}' set the "
                                    f"same setting {min(ca, cb, key=len)}; set it in one "
                                    f"place{why}")


# --------------------------------------------------------------------------- checking
def _schema() -> dict:
    from ddpflow.config.loading import _schema as cached

    return cached()


def check_key(key: str, where: str, schema: dict | None = None) -> None:
    """A dotted key that names a config setting (stages.<i>.x, model.kwargs.<anything>)."""
    node = schema or _schema()
    parts = key.split(".")
    for i, p in enumerate(parts):
        if any(key == f or key.startswith(f + ".") for f in FIXED):
            raise UserError(f"invalid sweep: {where} '{key}': {'.'.join(parts[:i + 1])} is the "
                            f"same for every trial of a sweep and cannot be swept")
        if node.get("type") == "array" or "items" in node:
            if not (p.isascii() and p.isdigit()):
                raise UserError(f"invalid sweep: {where} '{key}': '{p}' is not a list index")
            node = node.get("items", {})
            continue
        props = node.get("properties")
        if props is None:  # a free mapping (kwargs): any key below it
            return
        if p not in props:
            close = _closest(p, list(props))
            near = (f"did you mean '{close}'?" if close
                    else f"it has: {', '.join(sorted(props)[:12])}")
            raise UserError(f"invalid sweep: {where} '{key}': no setting '{p}' in "
                            f"{'.'.join(parts[:i]) or 'the config'} ({near})")
        node = props[p]


def _closest(word: str, names: list[str]) -> str | None:
    """The setting a misspelt key most likely meant: same letters in another case, a name
    the key begins with (or that begins with it), else the nearest by difflib."""
    low = word.lower()
    for n in names:
        if n.lower() == low:
            return n
    stems = [n for n in names if len(n) > 1 and (low.startswith(n.lower())
                                                 or n.lower().startswith(low))]
    if stems and len(low) > 1:
        return max(stems, key=len)
    close = difflib.get_close_matches(word, names, n=1)
    return close[0] if close else None


def trial_dict(d: dict, trial: Trial) -> dict:
    """A trial's whole config: the base without its sweep, plus the trial's overrides."""
    t = copy.deepcopy(d)
    t.pop("sweep", None)
    for key, value in trial.overrides.items():
        set_key(t, key.split("."), copy.deepcopy(value), f"sweep trial {trial.id}:")
    return t


def _place(cfg: Config, t: dict, trial: Trial) -> dict:
    """Where a valid trial lives, which prepared data it shares and which slots it takes."""
    from ddpflow.data.prepare import settings_fingerprint

    sw = cfg.sweep
    t["results_dir"] = str(cfg.run_dir / "trials")
    t["run"] = trial.id
    t["data"]["prepared_dir"] = str(cfg.run_dir / "sweep" / "data"
                                    / settings_fingerprint(from_dict(t)))
    t["hardware"]["slots"] = {"pool": str(cfg.run_dir / "sweep" / "slots"),
                              "gpus": sw.gpus_per_trial, "threads": sw.threads_per_trial}
    if t["hardware"]["threads_per_rank"] == "auto" and t["hardware"]["device"] == "cpu":
        t["hardware"]["threads_per_rank"] = sw.threads_per_trial
    if t["slurm"]["gpus"] > 0:  # a Slurm job per trial stage, asking the trial's GPUs
        t["slurm"]["gpus"] = sw.gpus_per_trial
        if t["slurm"]["gres"]:  # gpu[:type]:N with the trial's N
            t["slurm"]["gres"] = f"{t['slurm']['gres'].rsplit(':', 1)[0]}:{sw.gpus_per_trial}"
    else:
        t["slurm"]["cpus"] = max(t["slurm"]["cpus"], sw.threads_per_trial)
    return t


def plan(cfg: Config) -> list[tuple[Trial, dict]]:
    """Every trial with its resolved config dict; a UserError naming the first bad trial.
    Writes nothing."""
    if not cfg.sweep.enabled:
        raise UserError("this config has no sweep: set sweep.grid, sweep.variants or "
                        "sweep.random (see docs/SWEEPS.md)")
    d = cfg.to_dict()
    schema = _schema()
    for key in d["sweep"]["grid"]:
        check_key(key, "sweep.grid key", schema)
    for key in (d["sweep"]["random"] or {}).get("space", {}):
        check_key(key, "sweep.random.space key", schema)
    for v in d["sweep"]["variants"]:
        for key in v.get("set") or {}:
            check_key(key, f"sweep.variants '{v['name']}' key", schema)
    models: set = set()  # the distinct model settings checked so far (modelcheck.py)
    out = [(trial, resolve(cfg, d, trial, models)) for trial in expand(d)]
    _check_node(cfg)
    # search tpe: the trials are drawn while the sweep runs (sweeps/tpe.py); these random
    # draws of the same space only checked that every value fits its setting
    return [] if cfg.sweep.search == "tpe" else out


def resolve(cfg: Config, d: dict, trial: Trial, models: set | None = None) -> dict:
    """A trial's resolved config dict, validated, its model checked as launch checks it
    (once per distinct model setting in `models`); a UserError naming the trial."""
    from ddpflow.engine.modelcheck import check_model

    try:
        t = _place(cfg, trial_dict(d, trial), trial)
        check_model(from_dict(t), models)
    except UserError as e:
        raise UserError(f"sweep trial {trial.id} ({_shown(trial)}): {e}") from None
    return t


def _check_node(cfg: Config) -> None:
    """Trials that cannot fit this node stop the sweep here (in a Slurm job the
    allocation is checked by Slurm instead)."""
    import os

    from ddpflow.launch.slots import layout

    if not os.environ.get("SLURM_JOB_ID"):
        layout(cfg.hardware.device, cfg.sweep.gpus_per_trial, cfg.sweep.threads_per_trial)


def _shown(trial: Trial) -> str:
    return ", ".join(f"{k}={json.dumps(v)}" for k, v in trial.overrides.items())


# --------------------------------------------------------------------------- writing
def write_trial_config(cfg: Config, trial: Trial, t: dict) -> Path:
    """trials/<id>/trial_config.json (rewritten only when changed)."""
    from ddpflow.core.writing import write_text_atomic

    path = cfg.run_dir / "trials" / trial.id / "trial_config.json"
    text = json.dumps(t, indent=2, sort_keys=True)
    if not path.is_file() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, text, "a trial's config")
    return path


def write_plan(cfg: Config, trials: list[tuple[Trial, dict]]) -> Path:
    """sweep/plan.json and every trial's trial_config.json."""
    from ddpflow.config.rerun import hashes
    from ddpflow.core.writing import write_json_atomic

    rows = []
    for trial, t in trials:
        path = write_trial_config(cfg, trial, t)
        rows.append({"id": trial.id, "variant": trial.variant, "overrides": trial.overrides,
                     "config": str(path), "prepared_dir": t["data"]["prepared_dir"],
                     "stages": [s["name"] for s in t["stages"]],
                     "hashes": hashes(t)})  # the workflow's rerun params for the trial
    out = cfg.run_dir / "sweep" / "plan.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    space = (cfg.sweep.random or {}).get("space", {}) if cfg.sweep.search == "tpe" else {}
    blob = {"run": cfg.run, "trials": rows, "search": cfg.sweep.search,
            "swept": sorted({k for r in rows for k in r["overrides"]} | set(space))}
    if reading.read_json_or_none(out, PLAN_SCHEMA, "sweep plan") != blob:
        write_json_atomic(out, blob)
    return out


_STRING = {"type": "string"}
# sweep/plan.json as the leaderboard reads it (core/reading.py validates it first)
PLAN_SCHEMA = {
    "type": "object", "required": ["trials", "swept"],
    "properties": {
        "run": _STRING, "search": _STRING,
        "swept": {"type": "array", "items": _STRING},
        "trials": {"type": "array", "items": {
            "type": "object", "required": ["id", "overrides"],
            "properties": {"id": {"type": "string", "pattern": r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$"},
                           "variant": {"type": ["string", "null"]},
                           "overrides": {"type": "object"},
                           "config": _STRING, "prepared_dir": _STRING,
                           "stages": {"type": "array", "items": _STRING},
                           "hashes": {"type": "object"}}}}}}
PLAN_FIX = "run `ddpflow sweep plan --config ...` again (the workflow does this when it starts)"


def read_plan(cfg: Config) -> dict:
    path = cfg.run_dir / "sweep" / "plan.json"
    if not path.exists():
        raise UserError(f"no sweep plan at {path}; run `ddpflow sweep plan --config ...` "
                        f"(the workflow does this when it starts)")
    return reading.read_json(path, PLAN_SCHEMA, "sweep plan", PLAN_FIX)


def trial_config_path(cfg: Config, entry: dict) -> Path:
    """trials/<id>/trial_config.json of a plan entry, kept inside the run's trials folder
    (the entry's recorded "config" path is where it was when planned; this is where it is)."""
    folder = reading.inside(cfg.run_dir / "trials", entry["id"],
                            f"{cfg.run_dir / 'sweep' / 'plan.json'}: trials.id")
    return folder / "trial_config.json"
