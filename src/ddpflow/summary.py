"""Stage summaries: written last and atomically, so their presence means "stage finished"."""

from __future__ import annotations

import json
from pathlib import Path

from .data.prepared import write_json_atomic


def write_summary(path: Path, summary: dict) -> None:
    write_json_atomic(Path(path), summary)


def read_summary(path: Path) -> dict | None:
    try:
        with open(path) as f:
            s = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    return s if s.get("finished") else None
