"""A command's whole output into its log file, and the lines a person watches on the console.

A Snakemake rule sends a job's output to its log file, so the console stays silent while a
stage trains for hours and, on failure, shows only Snakemake's own error block.
`ddpflow --log FILE <command>` writes everything to FILE (the ranks' output too: child processes
inherit the file descriptors) and also echoes ddpflow's own lines to the console: `ddpflow: ...`
(what the launcher decided, and the one-line error) and `[stage] ...` (a line per log interval,
each validation, the end).
"""

from __future__ import annotations

import os
import re
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

from ddpflow.core.errors import UserError

SHOWN = re.compile(rb"^(ddpflow: |\[[\w.+-]+\] )")
# the last line of a Python traceback, in a rank's output ("[rank1]: RuntimeError: ...") or the
# process's own; torchrun's summary of its failed children is not the cause
RAISED = re.compile(rb"^(\[rank\d+\]: )?(?!\S*ChildFailedError)"
                    rb"[A-Za-z_][\w.]*(Error|Exception)\b.*")
# where torch's rank-prefixed output starts ("[rank1]: Traceback ..."): ranks share the pipe,
# and another rank's text can land inside a line before its newline
RANK_PREFIX = re.compile(rb"(?=\[rank\d+\]:)")
DRAIN_S = 10.0  # seconds to wait for a child that still holds the pipe (a daemon) at the end


class Tee:
    """What the pump saw: the last exception line (`last_error`, text or None), and why the
    log stopped taking output (`log_failed`: a full disk, say; None while it takes it)."""

    last_error: str | None = None
    log_failed: str | None = None


def _to_log(log, chunk: bytes, tee: Tee, console_fd: int) -> None:
    """chunk into the log, flushed (a log someone tails, and the part written before a
    kill). A log that cannot take more (its disk filled up) is said once, on the console, and
    the command goes on: its result does not depend on its log."""
    if tee.log_failed is not None:
        return
    try:
        log.write(chunk)
        log.flush()
    except OSError as e:
        from ddpflow.core.writing import user_os_error

        user = user_os_error(e, log.name, "the log")
        tee.log_failed = str(user) if user else f"cannot write the log {log.name}: {e}"
        os.write(console_fd, f"ddpflow: warning: {tee.log_failed}; the command goes on, its "
                             f"output from here on is not in the log\n".encode())


def _pump(read_fd: int, log, console_fd: int, shown: re.Pattern, tee: Tee) -> None:
    """Copy the pipe into the log as it comes; whole lines that match also to the console."""
    pending = b""
    while chunk := os.read(read_fd, 1 << 16):
        _to_log(log, chunk, tee, console_fd)
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            # a progress bar's redraws end in \r: the console gets the last state only
            first, *others = RANK_PREFIX.split(line.rsplit(b"\r", 1)[-1])
            if shown.match(first):
                os.write(console_fd, first + b"\n")
            for part in (first, *others):
                if RAISED.match(part):
                    tee.last_error = part.decode(errors="replace")[:400]
    if pending and shown.match(pending):
        os.write(console_fd, pending + b"\n")
    os.close(read_fd)


def run_logged(path: Path, command) -> int:
    """command() (returning an exit code) with its output teed into `path`; after a crash
    (not a mistake: that is already one ddpflow line) its cause on the console."""
    with tee_log(path) as tee:
        rc = command()
    if rc and tee.last_error:
        print(f"ddpflow: the last exception in {path}: {tee.last_error}", file=sys.stderr)
    return rc


@contextmanager
def tee_log(path: Path, shown: re.Pattern = SHOWN):
    """Inside the block, file descriptors 1 and 2 go to `path` (truncated, as `> path 2>&1`
    does); lines matching `shown` also reach the console the command was started with.
    Yields a Tee whose last_error is complete once the block has ended."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        log = open(path, "wb")
    except OSError as e:  # before anything is redirected: the message reaches the console
        raise UserError(f"cannot write the log {path}: {e.strerror or e}; give --log a "
                        f"file in a folder you can write") from None
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    read_fd, write_fd = os.pipe()
    os.dup2(write_fd, 1)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    tee = Tee()
    pump = threading.Thread(target=_pump, args=(read_fd, log, saved[1], shown, tee),
                            daemon=True)
    pump.start()
    try:
        yield tee
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)  # this process's last ends of the pipe: the pump sees the end
        os.dup2(saved[1], 2)  # once the children's ends are closed too
        pump.join(DRAIN_S)
        os.close(saved[0])
        if not pump.is_alive():  # else a leftover child still writes: the pump keeps both
            try:
                log.close()
            except OSError:  # (a full disk: already said by the pump)
                pass
            os.close(saved[1])
