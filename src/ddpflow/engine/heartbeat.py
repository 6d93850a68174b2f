"""Each rank's heartbeat and, on request, its Python stack: what names a stuck rank.

Every rank keeps `ranks/<attempt>/rank-<r>.json` in its stage folder (attempt: torchrun's
restart count): its host, pid, the last optimizer step it completed and when. A daemon
thread rewrites it about every BEAT_S seconds and at once after a log line, so a main
thread stuck in user code does not stop it, and a dead or stopped process leaves it stale.

When a rank finds a collective broken (hang.py), it creates `request` in that folder. Each
rank's thread answers once: a last heartbeat, then the stack of every thread of the rank
(faulthandler) and of its DataLoader workers into `stack-<r>.txt`. A rank whose thread cannot
run (a C call that holds the GIL) is reached by SIGUSR2 from a rank on its host, whose
faulthandler handler (C, no GIL) writes the same file. Having answered, a rank that is not
diagnosing the failure itself leaves when torchrun stops it (SIGTERM) or LEAVE_AFTER_S later:
a rank stuck in user code would otherwise hold the job for torchrun's 30 s grace.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import threading
import time
from pathlib import Path

from ddpflow.core import reading
from ddpflow.core.errors import UserError
from ddpflow.core.writing import write_json_atomic
from ddpflow.engine import stopflag

BEAT_S = 1.0  # seconds between heartbeat writes (a small file, from a thread)
TICK_S = 0.2  # seconds between the thread's looks for a stack request
LEAVE_AFTER_S = 15.0  # seconds a rank that answered a request waits before it exits
EXIT_HUNG = 1  # the exit code of a rank that left after answering a request
STACK_SIGNAL = signal.SIGUSR2
REQUEST = "request"
RANKS = "ranks"  # the stage folder's subfolder of heartbeats, stacks and hang reports

HEARTBEAT_SCHEMA = {
    "type": "object", "required": ["rank", "host", "pid", "step", "step_at", "beat_at"],
    "properties": {"rank": {"type": "integer", "minimum": 0},
                   "world": {"type": "integer", "minimum": 1},
                   "host": {"type": "string", "maxLength": 255},
                   "pid": {"type": "integer", "minimum": 1},
                   "step": {"type": "integer", "minimum": 0},
                   "step_at": {"type": "number"}, "beat_at": {"type": "number"},
                   "answered": {"type": "boolean"}}}


def attempt_folder(stage_dir: Path) -> Path:
    """This attempt's folder: torchrun's restart count (0 for the first) under `ranks/`."""
    return Path(stage_dir) / RANKS / os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def stack_file(folder: Path, rank: int) -> Path:
    return Path(folder) / f"stack-{rank}.txt"


def heartbeat_file(folder: Path, rank: int) -> Path:
    return Path(folder) / f"rank-{rank}.json"


def read_heartbeats(folder: Path, world: int) -> tuple[dict[int, dict], list[str]]:
    """({rank: heartbeat}, problems): a missing heartbeat is left out, one that cannot be
    read (truncated, not JSON, another shape, another rank's) is left out and named."""
    beats, problems = {}, []
    for rank in range(world):
        path = heartbeat_file(folder, rank)
        if not os.path.lexists(path):
            continue
        try:
            beat = reading.read_json(path, HEARTBEAT_SCHEMA, "a rank's heartbeat",
                                     "it is rewritten by the next run", max_bytes=1 << 16)
        except UserError as e:
            problems.append(str(e))
            continue
        if beat["rank"] != rank:
            problems.append(f"{path} (a rank's heartbeat) names rank {beat['rank']}")
            continue
        beats[rank] = beat
    return beats, problems


def append_text(path: Path, text: str) -> None:
    """Append to a stack file (O_APPEND: whole writes never interleave with faulthandler's)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, text.encode("utf-8", "replace"))
    finally:
        os.close(fd)


class Heartbeat:
    """One rank's heartbeat thread and stack file (see the module's docstring)."""

    def __init__(self, folder: Path, rank: int, world: int):
        self.folder, self.rank, self.world = Path(folder), rank, world
        self.folder.mkdir(parents=True, exist_ok=True)
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.step, self.step_at = 0, time.time()
        self.diagnosing = False  # hang.py runs in this rank: the thread never ends it
        self.answered: float | None = None  # monotonic time the request was answered
        self.stacks = stack_file(self.folder, rank)
        # the stack file stays open: faulthandler's signal handler writes to its descriptor
        self.fd = os.open(self.stacks, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_TRUNC,
                          0o644)
        faulthandler.register(STACK_SIGNAL, file=self.fd, all_threads=True, chain=False)
        self.wake, self.done = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, name="ddpflow-heartbeat", daemon=True)
        self.write()
        self.thread.start()

    def beat(self, step: int, now: bool = False) -> None:
        """Step `step` is complete (the loop's only cost per step: two assignments); now:
        write it at once (a log line)."""
        if step != self.step:
            self.step, self.step_at = step, time.time()
        if now:
            self.wake.set()

    def record(self) -> dict:
        return {"rank": self.rank, "world": self.world, "host": self.host, "pid": self.pid,
                "step": self.step, "step_at": self.step_at, "beat_at": time.time(),
                "answered": self.answered is not None}

    def write(self) -> None:
        try:
            write_json_atomic(heartbeat_file(self.folder, self.rank), self.record())
        except OSError:  # a full or vanished folder: the next beat tries again
            pass

    def _run(self) -> None:
        next_beat = 0.0
        while not self.done.is_set():
            woke = self.wake.wait(TICK_S)
            self.wake.clear()
            if self.answered is None and (self.folder / REQUEST).exists():
                self.answer()
            if woke or time.monotonic() >= next_beat:
                self.write()
                next_beat = time.monotonic() + BEAT_S
            if self.should_leave():
                os._exit(EXIT_HUNG)

    def should_leave(self) -> bool:
        """A rank that answered a stack request and is not diagnosing the failure itself
        leaves once torchrun asks it to stop, or LEAVE_AFTER_S after answering."""
        if self.answered is None or self.diagnosing or self.done.is_set():
            return False
        return bool(stopflag.received()) or time.monotonic() - self.answered > LEAVE_AFTER_S

    def answer(self) -> None:
        """The request: a last heartbeat, then every thread's stack and its workers' (a rank
        diagnosing the failure writes its own stack, hang.py)."""
        self.answered = time.monotonic()
        self.write()
        if self.diagnosing:
            return
        self.dump(f"== stack of rank {self.rank} (host {self.host}, pid {self.pid}) "
                  f"at step {self.step}, by faulthandler:\n")
        for pid in forked_children(self.pid):  # DataLoader workers: the handler inherited
            append_text(self.stacks, f"== its DataLoader worker pid {pid}:\n")
            try:
                os.kill(pid, STACK_SIGNAL)
            except ProcessLookupError:
                continue
            time.sleep(0.2)  # one at a time: their dumps go to the same file

    def dump(self, header: str, before: str = "") -> None:
        """A header line, `before` (a traceback), then every thread's stack."""
        append_text(self.stacks, header + before)
        faulthandler.dump_traceback(file=self.fd, all_threads=True)

    def request(self) -> bool:
        """Ask every rank of this attempt for its stack (the first rank to ask creates the
        request; True for it)."""
        try:
            os.close(os.open(self.folder / REQUEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                             0o644))
            return True
        except FileExistsError:
            return False

    def close(self) -> None:
        self.done.set()
        self.wake.set()
        self.thread.join(timeout=5)
        faulthandler.unregister(STACK_SIGNAL)
        self.write()
        os.close(self.fd)


def _proc(pid: int | str, name: str) -> bytes:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read()
    except OSError:
        return b""


def forked_children(pid: int) -> list[int]:
    """The children of pid that are forks of it (its DataLoader workers: the same command
    line), from /proc; a program it started (a compiler, a tracker's service) is left out:
    SIGUSR2 would end it."""
    own = _proc(pid, "cmdline")
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        stat = _proc(entry, "stat") if entry.isdigit() else b""
        try:
            ppid = int(stat.rsplit(b")", 1)[1].split()[1])
        except (IndexError, ValueError):
            continue
        if ppid == pid and _proc(entry, "cmdline") == own:
            found.append(int(entry))
    return found
