"""A user mistake found inside a rank, handed to the launcher, which stops every rank and
prints it once (the ranks exit 0: torchrun restarts crashes, not mistakes).

The report is `error.json` in the folder of what the ranks run (a stage, tune, an
evaluation). When that folder cannot take it (the very mistake may be that its disk is
full: a checkpoint, the metrics log), it goes to the launcher's own scratch folder instead
(`DDPFLOW_RANK_ERROR`, on the launcher's node), which the launcher watches too: before, the
rank printed `cannot write error.json ...`, the others crashed on the closed connection and
the launcher said "torchrun exited with 1".
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from ddpflow.core import reading
from ddpflow.core.errors import OneRankError, UserError
from ddpflow.core.writing import remove_scratch, write_json_atomic

RANK_ERROR = "error.json"
SPARE = "DDPFLOW_RANK_ERROR"  # the launcher's scratch report path, for a folder that is full
ONE_RANK_WAIT_S = 60.0  # a rank that alone found a mistake waits this long to be stopped
SCHEMA = {"type": "object", "required": ["message"],
          "properties": {"message": {"type": "string"}}}


def report(folder: Path, err: UserError) -> None:
    """Called in a rank: the mistake for the launcher (error.json; the spare place when the
    folder cannot take it). A OneRankError's rank then waits to be stopped with its peers."""
    record = {"message": str(err), "rank": int(os.environ.get("RANK", 0))}
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        write_json_atomic(Path(folder) / RANK_ERROR, record)
    except (UserError, OSError):
        spare = Path(os.environ.get(SPARE) or "/nonexistent/ddpflow")
        if not spare.parent.is_dir():  # another node, a container: say it here at least
            print(f"ddpflow: error: {err}", file=sys.stderr, flush=True)
            raise
        write_json_atomic(spare, record)
    if isinstance(err, OneRankError):  # its peers wait in a collective: the launcher stops
        time.sleep(ONE_RANK_WAIT_S)    # every rank together, a few seconds from now


class Reports:
    """What the launcher of one run watches: error.json in `folder`, and the spare in a
    scratch folder of its own (`env` hands its path to the ranks). A context manager: the
    scratch folder is removed at the end."""

    def __init__(self, folder: Path):
        self.paths = (Path(folder) / RANK_ERROR,
                      Path(tempfile.mkdtemp(prefix="ddpflow-ranks-")) / RANK_ERROR)
        self.paths[0].unlink(missing_ok=True)  # an earlier run's report never counts
        self.env = {SPARE: str(self.paths[1])}

    def is_file(self) -> bool:  # (what run_torchrun polls)
        return any(p.is_file() for p in self.paths)

    def message(self) -> str | None:
        for p in self.paths:
            rec = reading.read_json_or_none(p, SCHEMA, "a rank's report")
            if rec is not None:
                return rec["message"]
        return None

    def __enter__(self) -> Reports:
        return self

    def __exit__(self, *exc) -> None:
        remove_scratch(self.paths[1].parent)
