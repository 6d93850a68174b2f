"""The one rerun rule: what each result depends on.

A stage's result depends on the whole config up to and including the stage, except the keys
in LEFT_OUT: how often ddpflow looks and saves, where results live, which GPUs, cores and
port of the node run it, what a Slurm job asks of a node and where the trackers are. None of
them changes a number the stage computes. `ddpflow validate --json` prints these hashes and
the workflow's rules take them as their params, so Snakemake reruns a stage exactly when
ddpflow would call its result stale (results/provenance.py compares the same hash).

A checkpoint's resume key leaves out PLACEMENT too (how many ranks, nodes and GPUs, and what
changes only memory): a requeue onto fewer GPUs, or a stage that ran out of memory with
activation checkpointing turned on, resumes.

The prepared data depends on PREPARE_KEYS of `data` and the seed (it draws splits and caps).
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

# dotted keys; `stages.*.k` is k of every stage
LEFT_OUT = ("run", "results_dir", "log_every_steps", "stop_check_s", "checkpoint", "sweep",
            "tracking", "profile", "slurm", "hardware.slots", "hardware.rdzv_port",
            "data.prepared_dir")
PLACEMENT = ("hardware.nproc_per_node", "hardware.devices", "hardware.nodes",
             "hardware.threads_per_rank", "hardware.max_restarts", "hardware.timeout_s",
             "model.shard_blocks", "stages.*.activation_checkpointing",
             "stages.*.reshard_after_forward")
PREPARE_KEYS = ("source", "factory", "kwargs", "materialize", "path", "image_size",
                "store_size", "num_classes", "difficulty", "train_size", "val_size",
                "test_size", "grayscale", "val_fraction", "test_fraction", "max_bad_fraction",
                "verify_checksum", "encoding", "jpeg_quality", "shard_mb")
PYTHON_ONLY = ("factory", "kwargs", "materialize")  # prepare keys of data.source python only


def config_hash(d: dict[str, Any]) -> str:
    blob = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _drop(d: dict[str, Any], dotted: str) -> None:
    head, _, rest = dotted.partition(".")
    if head == "*":
        for item in d:
            _drop(item, rest)
    elif not rest:
        d.pop(head, None)
    elif isinstance(d.get(head), (dict, list)):
        _drop(d[head], rest)


def stage_dict(d: dict[str, Any], stage: str, placement: bool = True) -> dict[str, Any]:
    """The part of a resolved config dict that stage `stage`'s result depends on."""
    names = [s["name"] for s in d["stages"]]
    if stage not in names:
        raise KeyError(stage)
    d = copy.deepcopy(d)
    d["stages"] = d["stages"][: names.index(stage) + 1]
    for key in LEFT_OUT + (() if placement else PLACEMENT):
        _drop(d, key)
    return d


def stage_hash(d: dict[str, Any], stage: str, placement: bool = True) -> str:
    return config_hash(stage_dict(d, stage, placement))


def prepare_settings(d: dict[str, Any]) -> dict[str, Any]:
    """The settings the prepared arrays depend on (data/prepare.py adds the user code's
    fingerprint for a data.source python dataset)."""
    data = d["data"]
    keys = [k for k in PREPARE_KEYS if data["source"] == "python" or k not in PYTHON_ONLY]
    return {**{f"data.{k}": data[k] for k in keys}, "seed": d["seed"]}


def hashes(d: dict[str, Any]) -> dict[str, Any]:
    """What `ddpflow validate --json` prints beside the config: the whole config's hash, each
    stage's, and the prepared data's settings' (the workflow's rerun params)."""
    return {"config": config_hash(d), "prepare": config_hash(prepare_settings(d)),
            "stages": {s["name"]: stage_hash(d, s["name"]) for s in d["stages"]}}
