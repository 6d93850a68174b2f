"""Running torchrun for the launcher: its own process group, stop signals relayed to the
ranks themselves, and the group stopped when a rank reports a user mistake.

torchrun starts each rank in a session of its own, and when a SIGTERM reaches torchrun it
kills its ranks 30 s later. So a stop signal goes to the ranks directly (they checkpoint at
their next check and exit 0; torchrun then ends by itself), also to ranks that torchrun
restarts after it. For the same reason, killing torchrun does not stop its ranks: the
launcher stops them itself (a rank's mistake: _stop_all; torchrun killed by someone else:
the ranks are handed to the launcher, a child subreaper, and _stop_orphans ends them).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _children(pid: int) -> list[int]:
    """Direct children of pid (torchrun's ranks; not their DataLoader workers), from /proc."""
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            found.append(int(entry))
    return found


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _stop_all(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and every rank it started. torchrun starts each rank in a session of
    its own, so killing torchrun's group alone leaves its ranks running, orphaned: a rank
    that lags, or one torchrun just restarted, then waits on a peer or a store that is gone
    (until the collective timeout) and holds the job's output open."""
    try:
        os.killpg(proc.pid, signal.SIGSTOP)  # no restart while its ranks are listed
    except ProcessLookupError:
        return
    for pid in _children(proc.pid):
        _kill_session(pid)
    _kill_group(proc)


def _kill_session(pid: int) -> None:
    """SIGKILL a rank and its session (its DataLoader workers), or the one process when it
    leads no session (a rank not yet in its own, or an orphaned worker)."""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _adopt_orphans() -> None:
    """Make this launcher a child subreaper: ranks that outlive their torchrun (killed: each
    rank lives in a session of its own) become its children, not init's (_stop_orphans)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
    except OSError:
        pass


def _stop_orphans(marker: str) -> None:
    """After torchrun ended: SIGKILL (and reap) the ranks it left, and their DataLoader
    workers: the children of this launcher whose command line holds marker (the resolved
    config's path). Left alone, they would train on and write into the stage folder after
    the launcher has released its lock."""
    for pid in _children(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() not in f.read():
                    continue
        except OSError:
            continue
        _kill_session(pid)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def _child_setup() -> None:
    # runs in the torchrun process before exec: its own process group, no death from
    # SIGUSR1 (torchrun has no handler for it; a scheduler may signal every process of the
    # job; the ranks install their own), and SIGTERM if this launcher dies (torchrun then
    # stops its ranks: no orphans)
    os.setpgid(0, 0)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    # Ctrl-C reaches this launcher, which turns it into SIGTERM for the group: the ranks
    # then stop at a checkpoint instead of dying of KeyboardInterrupt mid-import
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class WarmAgent:
    """A torchrun agent started ahead (agent.py): it imports torch while the launcher checks
    the config. `start` hands it the torchrun arguments; `cancel` ends it unused."""

    def __init__(self):
        r, self.pipe = os.pipe()
        self.proc = subprocess.Popen([sys.executable, "-m", "ddpflow.launch.agent", str(r)],
                                     pass_fds=(r,), preexec_fn=_child_setup)
        os.close(r)

    def start(self, cmd: list, env: dict) -> subprocess.Popen:
        with os.fdopen(self.pipe, "wb") as f:
            f.write(json.dumps({"args": cmd[len(TORCHRUN):], "env": env}).encode())
        self.pipe = None
        return self.proc

    def cancel(self) -> None:
        if self.pipe is not None:
            os.close(self.pipe)
            self.pipe = None
            _kill_group(self.proc)
            self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.cancel()


def warm_agent(cfg, dry_run: bool):
    """The one decision whether a stage's torchrun agent is started ahead: where this
    process runs torchrun itself on one node (not a dry run, not the container engine's
    launch, which runs it inside the container). A WarmAgent (a context: unused, it ends
    having started nothing), or a context giving None."""
    from contextlib import nullcontext

    from ddpflow.launch.container import IN_CONTAINER

    local = cfg.container.engine == "none" or os.environ.get(IN_CONTAINER)
    if local and not dry_run and cfg.hardware.nodes == 1:
        return WarmAgent()
    return nullcontext()


def run_torchrun(cmd: list, env: dict, watch: Path | None = None,
                 agent: WarmAgent | None = None, hang=None) -> tuple[int, str | None]:
    """Run torchrun; relay stop signals to its ranks; stop the group soon after a
    rank reports a user mistake in `watch` (the other ranks may be waiting for it in a
    collective); `hang` (hangreport.HangWatch): the deadline of an attempt whose collective
    broke, after which its ranks left on this node are killed. Returns (exit code, signal)."""
    got: dict = {"signal": None}
    proc = None
    told: set[int] = set()  # ranks already given the stop signal

    def forward(signum, _frame):
        got["signal"] = signal.Signals(signum).name
        if proc is not None:  # else it is relayed as soon as torchrun has started
            relay(signum)

    def relay(signum):
        if cmd[0] == "srun":  # several nodes: the ranks are on the nodes, not children here
            relay_through_srun()
            return
        # torchrun starts each rank in a session of its own, and on SIGTERM it kills its
        # ranks 30 s later: so the signal goes to the ranks themselves (SIGINT as SIGTERM).
        # They checkpoint at their next check and exit 0; torchrun then ends by itself.
        sig = signal.SIGUSR1 if signum == signal.SIGUSR1 else signal.SIGTERM
        ranks = _children(proc.pid)
        for pid in set(ranks) - told:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        told.update(ranks)
        # no rank yet, nothing to save: torchrun stops what it started. (Ranks told already
        # and gone have stopped: torchrun is ending by itself, a SIGTERM now would only
        # interrupt its shutdown with a traceback.)
        if not ranks and not told:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def relay_through_srun():
        # srun hands SIGUSR1 to every process of its step: the ranks stop at a checkpoint
        # and exit 0, the torchrun agents ignore it (rollcall.py) and then end by themselves.
        # Again every few seconds, for ranks that were still starting (signals ignored).
        if time.monotonic() - told_srun[0] > 5.0:
            told_srun[0] = time.monotonic()
            try:
                os.kill(proc.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass

    told_srun = [-1e9]
    _adopt_orphans()
    for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(s, forward)
    if agent is not None and agent.pipe is not None and cmd[:len(TORCHRUN)] == TORCHRUN:
        proc = agent.start(cmd, {**os.environ, **env})
    else:
        proc = subprocess.Popen(cmd, env={**os.environ, **env}, preexec_fn=_child_setup)
    if got["signal"]:
        relay(signal.Signals[got["signal"]])
    seen = None
    while True:
        try:
            rc = proc.wait(timeout=0.5)
            break
        except subprocess.TimeoutExpired:
            pass
        if got["signal"]:  # ranks torchrun restarted after the signal are told as well
            relay(signal.Signals[got["signal"]])
        if hang is not None and cmd[0] != "srun":  # (several nodes: each rank leaves itself)
            hang.poll(lambda pid: _kill_session(pid) if pid in _children(proc.pid) else None)
        if watch is not None and watch.is_file():
            seen = seen or time.monotonic()
            if time.monotonic() - seen > 3.0:  # the others had time to report too
                _stop_all(proc)
    if "--resolved" in cmd:  # torchrun killed: ranks it could not stop are still running
        _stop_orphans(str(cmd[cmd.index("--resolved") + 1]))
    return rc, got["signal"]
