"""Metrics records (the lines of metrics.jsonl) as the values trackers take: scalars by tag
(train/loss, perf/mfu, val/acc, test/acc...) and a nested config as flat hparams. Shared by
TensorBoard (trackers.py) and MLflow (mlflowrun.py)."""

from __future__ import annotations

import json

TRAIN_SCALARS = {"loss": "train/loss", "lr": "train/lr", "samples_per_s": "perf/samples_per_s",
                 "compute_samples_per_s": "perf/compute_samples_per_s",
                 "data_wait_fraction": "perf/data_wait_fraction", "tflops": "perf/tflops",
                 "mfu": "perf/mfu", "peak_mem_mib": "perf/peak_mem_mib",
                 "grad_scale": "train/grad_scale"}


def scalars(rec: dict) -> dict:
    """A metrics record's values by tracker tag: train/loss, perf/mfu, val/acc, test/acc..."""
    if rec.get("kind") == "train":
        return {tag: rec[k] for k, tag in TRAIN_SCALARS.items()
                if isinstance(rec.get(k), (int, float))}
    if rec.get("kind") in ("val", "test"):
        return {f"{k.split('_', 1)[0]}/{k.split('_', 1)[1]}": v for k, v in rec.items()
                if k.startswith(("val_", "test_")) and isinstance(v, (int, float))}
    return {}


def flat(d: dict, prefix: str = "") -> dict:
    """{'stages.0.lr': 0.1, ...}: nested config as scalar hparams (lists as JSON text)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat(v, key + "."))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            for i, x in enumerate(v):
                out.update(flat(x, f"{key}.{i}."))
        elif isinstance(v, (bool, int, float, str)):
            out[key] = v
        else:
            out[key] = json.dumps(v)
    return out
