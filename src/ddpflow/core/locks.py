"""One writer at a time: an advisory file lock per prepared-data folder, stage and tune run.

`exclusive(path, what)` takes a non-blocking `flock` on `path` (created if missing) and
writes the holder's PID and host into it. A second process that wants the same lock stops
at once with a message naming the holder. The kernel releases the lock when the holder
exits, however it exits (SIGKILL included), so a lock is never left stale.
"""

from __future__ import annotations

import fcntl
import os
import socket
from contextlib import contextmanager
from pathlib import Path

from ddpflow.core.errors import UserError


@contextmanager
def exclusive(path: Path, what: str):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown process"
        os.close(fd)
        raise UserError(f"{what} is being written by another ddpflow process ({holder}); "
                        f"wait for it to finish or stop it, then run again") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        os.ftruncate(fd, 0)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
