"""What a W&B offline run holds: its `run-<id>.wandb` file read record by record.

The file is wandb's own: a 7-byte header (":W&B", LevelDB's 0xBEE1, version 0), then
32 KiB blocks of LevelDB log records (crc32, length, type: full, first, middle, last),
each record a `wandb.proto` Record. wandb 0.31 no longer ships a Python reader of it, so
the tests read it here; the protobuf classes are the installed wandb's.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header: padding
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if n == 0 and kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        buf = chunk if kind in (FULL, FIRST) else buf + chunk
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(buf)
            yield record


def key_of(item) -> str:
    return item.key or "/".join(item.nested_key)


def read_run(folder: Path) -> dict:
    """An offline run folder as {run, config, history, summary, files, exit, preempting,
    artifacts}: history a list of {step, values}."""
    out = {"run": None, "config": {}, "history": [], "summary": {}, "files": [], "exit": None,
           "preempting": False, "artifacts": []}
    for r in records(next(Path(folder).glob("run-*.wandb"))):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out["run"] = r.run
            out["config"].update({key_of(u): json.loads(u.value_json)
                                  for u in r.run.config.update})
        elif kind == "config":
            out["config"].update({key_of(u): json.loads(u.value_json) for u in r.config.update})
        elif kind == "history":
            out["history"].append({"step": r.history.step.num, "values": {
                key_of(i): json.loads(i.value_json) for i in r.history.item
                if not key_of(i).startswith("_")}})
        elif kind == "summary":
            out["summary"].update({key_of(u): json.loads(u.value_json)
                                   for u in r.summary.update})
        elif kind == "files":
            out["files"] += [f.path for f in r.files.files]
        elif kind == "exit":
            out["exit"] = r.exit.exit_code
        elif kind == "preempting":
            out["preempting"] = True
        elif kind == "artifact":
            out["artifacts"].append({"name": r.artifact.name, "type": r.artifact.type,
                                     "files": [e.path for e in r.artifact.manifest.contents]})
    return out
