"""The figures of bench/gpu.sh as a markdown table for docs/BENCHMARKS.md.

    python bench/gpu_table.py SUMMARY.json [SUMMARY.json ...]

One row per stage summary: images/s (steady state and wall clock), batch, precision, layout,
MFU, TFLOP/s, GPU utilisation and data wait. A figure a summary does not have (no NVML, a
CPU run, a stage too short for a second log line) prints as "-", never as an error.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLUMNS = ["stage", "model", "px", "batch/GPU", "precision", "channels_last", "compile",
           "images/s", "wall images/s", "MFU", "TFLOP/s", "GPU util", "data wait"]


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def row(path: Path) -> list[str]:
    s = json.loads(path.read_text())
    cfg = s.get("config", {})
    util = s.get("gpu_util")
    return [f"{cfg.get('run', '?')}/{s.get('stage', '?')}", cfg.get("model", {}).get("name", "?"),
            str(cfg.get("data", {}).get("image_size", "?")), str(s.get("batch_size_per_rank")),
            str(s.get("precision")), str(s.get("channels_last")), str(s.get("compile")),
            _num(s.get("mean_samples_per_s"), ".0f"), _num(s.get("wall_samples_per_s"), ".0f"),
            _num(s.get("mfu"), ".1%"), _num(s.get("mean_tflops"), ".1f"),
            "-" if util is None else f"{util:.0f}%", _num(s.get("data_wait_fraction"), ".1%")]


def table(paths: list[Path]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    lines += ["| " + " | ".join(row(p)) + " |" for p in paths]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    print(table([Path(p) for p in sys.argv[1:]]))
