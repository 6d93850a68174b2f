"""Stage summaries: written last and atomically, so their presence means "stage finished"."""

from __future__ import annotations

import json
from pathlib import Path

from ddpflow.data.prepared import write_json_atomic


def write_summary(path: Path, summary: dict) -> None:
    write_json_atomic(Path(path), summary)


def read_summary(path: Path) -> dict | None:
    try:
        with open(path) as f:
            s = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    return s if s.get("finished") else None


def result_text(s: dict) -> str:
    """'val_acc 0.9120 (best 0.9150)': the monitored metric, final and best."""
    name = s.get("monitor") or "val_acc"
    final = (s.get("final_metrics") or {}).get(name, s.get("final_val_acc"))
    best = s.get("best_value", s.get("best_val_acc"))
    fmt = (lambda v: "n/a" if v is None else f"{v:.4f}")  # noqa: E731 - a one-line formatter
    test = "test_" + name.split("_", 1)[-1]
    tail = f", {test} {fmt(s[test])}" if s.get(test) is not None else ""
    return f"{name} {fmt(final)} (best {fmt(best)}){tail}"
