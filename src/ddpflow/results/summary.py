"""Stage summaries: written last and atomically, so their presence means "stage finished"."""

from __future__ import annotations

from pathlib import Path

from ddpflow.core import reading
from ddpflow.core.errors import UserError
from ddpflow.core.writing import write_json_atomic

_NUMBER = {"type": ["number", "null"]}
# a metric: a number, or one per class (a list, null where the split has none of it)
_METRIC = {"anyOf": [_NUMBER, {"type": "array", "items": _NUMBER}]}
_METRICS = {"type": ["object", "null"], "additionalProperties": _METRIC}
# summary.json as its readers use it (core/reading.py validates it before any field is used)
SUMMARY_SCHEMA = {
    "type": "object", "required": ["finished"],
    "properties": {
        "finished": {"type": "boolean"},
        "steps": {"type": "integer", "minimum": 0},
        "wall_time_s": {"type": "number", "minimum": 0},
        "world_size": {"type": "integer", "minimum": 1},
        "monitor": {"type": ["string", "null"]},
        "final_metrics": _METRICS, "best_metrics": _METRICS, "test_metrics": _METRICS,
        "best_value": _NUMBER, "final_val_acc": _NUMBER, "best_val_acc": _NUMBER,
        "mean_samples_per_s": _NUMBER,
        "wall": {"type": ["object", "null"],
                 "properties": {"split_s": {"type": ["object", "null"]}}},
        "final_sha256": {"type": ["string", "null"]},
        "early_stop": {"type": ["object", "null"], "required": ["step", "reason"]},
        "environment": {"type": ["object", "null"]}},
    "patternProperties": {"^test_(?!metrics$)": _METRIC},
    "if": {"properties": {"finished": {"const": True}}},
    "then": {"required": ["steps", "wall_time_s", "world_size"]}}
WHAT = "stage summary"
FIX = "delete it and run the stage again (it is written by the stage's last step)"


def write_summary(path: Path, summary: dict) -> None:
    write_json_atomic(Path(path), summary)


def read_summary(path: Path, damaged_ok: bool = False) -> dict | None:
    """A finished stage's summary; None when there is none (missing, or not finished). One
    that is there but damaged (truncated, not JSON, fields of the wrong type) is one
    UserError naming the file and field, or None with `damaged_ok` (callers for which a
    damaged summary means "run the stage again": see `summary_problem`)."""
    try:
        s = reading.read_json_if_present(path, SUMMARY_SCHEMA, WHAT, FIX)
    except UserError:
        if damaged_ok:
            return None
        raise
    return s if s and s["finished"] else None


def summary_problem(path: Path) -> str | None:
    """What is wrong with a summary that is there but cannot be used, or None."""
    try:
        read_summary(path)
    except UserError as e:
        return str(e)
    return None


def result_text(s: dict) -> str:
    """'val_acc 0.9120 (best 0.9150)': the monitored metric, final and best."""
    name = s.get("monitor") or "val_acc"
    final = (s.get("final_metrics") or {}).get(name, s.get("final_val_acc"))
    best = s.get("best_value", s.get("best_val_acc"))
    fmt = (lambda v: "n/a" if v is None else f"{v:.4f}")  # noqa: E731 - a one-line formatter
    test = "test_" + name.split("_", 1)[-1]
    tail = f", {test} {fmt(s[test])}" if s.get(test) is not None else ""
    return f"{name} {fmt(final)} (best {fmt(best)}){tail}"
