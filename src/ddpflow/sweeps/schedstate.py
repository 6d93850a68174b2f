"""sweep/schedule/state.json: what the sweep's scheduler knows, written after every event.

One file, one writer (the scheduler holds sweep/schedule/.lock): every trial's overrides,
the epochs it trained to a checkpoint, the monitored value of every validated epoch, the
rung it was last sent to and why it was pruned. The trials' own folders hold the truth
(checkpoints, metrics.jsonl); this file holds the decisions, so a scheduler stopped at any
point (SIGTERM, a lost node) continues where it stopped, and a rerun reuses every rung
already trained. Each trial's values carry the resume key they were made under: a trial
whose settings, code or data changed since starts again (its old checkpoints are set aside
by the trainer for the same reason).
"""

from __future__ import annotations

from pathlib import Path

from ddpflow.config import Config
from ddpflow.core import reading
from ddpflow.sweeps.asha import TrialState

VERSION = 1
_NUM_OR_NULL = {"type": ["number", "null"]}
STATE_SCHEMA = {
    "type": "object", "required": ["version", "trials"],
    "properties": {
        "version": {"const": VERSION},
        "monitor": {"type": ["string", "null"]}, "mode": {"enum": ["min", "max", None]},
        "rungs": {"type": "array", "items": {"type": "integer", "minimum": 1}},
        "trials": {"type": "array", "items": {
            "type": "object",
            "required": ["id", "overrides", "number", "values", "epochs", "target"],
            "properties": {
                "id": {"type": "string", "pattern": r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$"},
                "overrides": {"type": "object"}, "variant": {"type": ["string", "null"]},
                "number": {"type": "integer", "minimum": 0},
                "key": {"type": ["string", "null"]},
                "values": {"type": "object", "patternProperties": {r"^[0-9]+$": _NUM_OR_NULL},
                           "additionalProperties": False},
                "epochs": {"type": "integer", "minimum": 0},
                "target": {"type": "integer", "minimum": 0},
                "pruned": {"type": ["string", "null"]},
                "kind": {"enum": ["failed", "diverged", "nan", None]},
                "tries": {"type": "integer", "minimum": 0}}}}}}
FIX = ("it is written by `ddpflow sweep schedule`; move it aside to schedule the sweep from "
       "the trials' own checkpoints again")


def folder(cfg: Config) -> Path:
    return cfg.run_dir / "sweep" / "schedule"


def state_path(cfg: Config) -> Path:
    return folder(cfg) / "state.json"


def read_state(cfg: Config) -> dict | None:
    """The recorded state, validated (None: no scheduler has run here yet)."""
    return reading.read_json_if_present(state_path(cfg), STATE_SCHEMA, "the sweep's scheduler "
                                        "state", FIX)


def trials_of(state: dict | None) -> list[TrialState]:
    out = []
    for t in (state or {}).get("trials", []):
        values = {int(k): v for k, v in t["values"].items()}
        out.append(TrialState(t["id"], t["overrides"], t.get("variant"), t["number"],
                              t.get("key"), values, t["epochs"], t["target"], t.get("pruned"),
                              t.get("kind"), t.get("tries", 0)))
    return out


def write_state(cfg: Config, trials: list[TrialState], monitor: str | None, mode: str | None,
                rungs: list[int]) -> None:
    from ddpflow.core.writing import write_json_atomic

    rows = [{"id": t.id, "overrides": t.overrides, "variant": t.variant, "number": t.number,
             "key": t.key, "values": {str(k): v for k, v in sorted(t.values.items())},
             "epochs": t.epochs, "target": t.target, "pruned": t.pruned, "kind": t.kind,
             "tries": t.tries} for t in sorted(trials, key=lambda t: t.number)]
    folder(cfg).mkdir(parents=True, exist_ok=True)
    write_json_atomic(state_path(cfg), {"version": VERSION, "monitor": monitor, "mode": mode,
                                        "rungs": rungs, "trials": rows})
