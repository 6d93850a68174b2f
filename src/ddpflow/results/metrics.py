"""metrics.jsonl (one JSON object per log interval / validation) and stage summaries."""

from __future__ import annotations

import json
from pathlib import Path

from ddpflow.core import reading
from ddpflow.core.errors import OneRankError, UserError
from ddpflow.core.writing import write_text_atomic, writing

METRICS_MAX_BYTES = 1 << 30  # a line per log interval: long runs write tens of MB


class MetricsLog:
    """Append-only JSONL written by rank 0; on resume, records after the checkpoint are dropped
    so that a resumed run's file reads as if it had never stopped."""

    def __init__(self, path: Path, keep_until_step: int | None, tracker=None):
        self.path = Path(path)
        self.tracker = tracker  # also gets every record (tracking.py), or None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if keep_until_step is not None and self.path.exists():
            kept = [r for r in read_records(self.path)[0] if r.get("step", 0) <= keep_until_step]
        write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self.f = open(self.path, "a", buffering=1)

    def write(self, record: dict) -> dict:
        try:  # (line-buffered: a full or read-only stage folder raises here)
            with writing(self.path, "the stage's metrics log"):
                self.f.write(json.dumps(record) + "\n")
        except UserError as e:  # rank 0 alone writes it, the others train on (OneRankError)
            raise OneRankError(str(e)) from None
        if self.tracker is not None:
            self.tracker.record(record)
        return record

    def close(self) -> None:
        self.f.close()


def read_records(path: Path) -> tuple[list[dict], list[str]]:
    """(records, problems): a truncated or malformed line is reported, not silently dropped."""
    records, bad = reading.read_jsonl(path, {"type": "object"}, "metrics log",
                                      max_bytes=METRICS_MAX_BYTES, cut_ok=False)
    return records, [f"{Path(path).name} line {n} is truncated or malformed" for n in bad]


def efficiency_means(records: list[dict]) -> dict:
    """Means over train intervals, each start's warm-up interval left out (peak memory:
    the largest)."""
    train = [r for r in records if r.get("kind") == "train" and not r.get("warmup")]

    def mean(key):
        xs = [r[key] for r in train if r.get(key) is not None]
        return sum(xs) / len(xs) if xs else None

    return {"mean_samples_per_s": mean("samples_per_s"),
            "mean_compute_samples_per_s": mean("compute_samples_per_s"),
            "mean_tflops": mean("tflops"), "mfu": mean("mfu"),
            "data_wait_fraction": mean("data_wait_fraction"), "gpu_util": mean("gpu_util"),
            "peak_mem_mib": max((r["peak_mem_mib"] for r in train), default=None)}
