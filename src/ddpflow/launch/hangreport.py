"""What the launcher says when a collective did not complete: the ranks that did not arrive,
their host, the last step every rank completed, and every rank's Python stack, from what
the ranks left in `<stage>/ranks/<attempt>/` (engine/heartbeat.py, engine/hang.py).

While torchrun runs, `HangWatch` holds the launcher's own deadline: KILL_AFTER_S after the
first rank reported a broken collective, the ranks of that attempt still alive on this node
are killed (a stopped rank answers no signal but SIGKILL; torchrun would give it 30 s). So
a stage whose collective hangs ends within `hardware.timeout_s` + HANG_MARGIN_S.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import time
from pathlib import Path

from ddpflow.core import reading
from ddpflow.core.errors import UserError
from ddpflow.core.writing import write_json_atomic
from ddpflow.engine import hang
from ddpflow.engine.heartbeat import RANKS, read_heartbeats, stack_file

# after the first rank's report: its diagnosis (monitored_barrier, the stacks) and its exit
KILL_AFTER_S = hang.BARRIER_S + hang.STACK_WAIT_S + 10.0
# a hung stage ends within hardware.timeout_s + this: the diagnosis and the launcher's
# deadline (KILL_AFTER_S), torchrun's teardown, this report
HANG_MARGIN_S = KILL_AFTER_S + 15.0
REPORT = "hang.json"  # the launcher's merged report, in the stage folder
FLIGHT_PREFIX = "nccl_trace_rank_"  # the NCCL flight recorder's dumps, in `ranks/`
FLIGHT_ENTRIES = 2000  # the flight recorder's ring buffer: the last collectives per rank
BUFFER_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")  # new, old name
STACK_MAX_BYTES = 1 << 20  # a rank's stack file (threads and workers) is far smaller

_RANKS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
VIEW_SCHEMA = {
    "type": "object",
    "required": ["rank", "world", "host", "error", "missing", "ended", "detected_at"],
    "properties": {"rank": {"type": "integer", "minimum": 0},
                   "world": {"type": "integer", "minimum": 1, "maximum": 1 << 20},
                   "host": {"type": "string"}, "error": {"type": "string"},
                   "missing": {"type": ["array", "null"], "items": _RANKS["items"]},
                   "ended": _RANKS, "found_by": {"type": "string"},
                   "stacks": {"type": "string"}, "detected_at": {"type": "number"}}}


def buffer_variable(torch_version: str) -> str:
    """The flight recorder's buffer variable that this torch reads without a warning: torch
    2.11 calls TORCH_NCCL_TRACE_BUFFER_SIZE deprecated ("use TORCH_FR_BUFFER_SIZE instead",
    seen on the H200 run); an older torch knows the NCCL name."""
    major, minor = (int(p) for p in re.match(r"(\d+)\.(\d+)", torch_version).groups())
    return BUFFER_VARIABLES[0] if (major, minor) >= (2, 11) else BUFFER_VARIABLES[1]


def flight_recorder(out: Path, torch_version: str) -> dict[str, str]:
    """NCCL's flight recorder on (a bounded buffer), dumped on a collective's timeout into
    the stage's `ranks/` folder; a variable the user set wins (the buffer's under either
    name). Seen working on one H200 (torch 2.11): a timed-out all-reduce's dump, written
    there (bench/gpu.sh's flight_recorder check)."""
    user_buffer = any(name in os.environ for name in BUFFER_VARIABLES)
    want = {**({} if user_buffer else {buffer_variable(torch_version): str(FLIGHT_ENTRIES)}),
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(Path(out) / RANKS / FLIGHT_PREFIX)}
    return {k: v for k, v in want.items() if k not in os.environ}


def last_attempt(out: Path) -> Path | None:
    """The latest attempt's folder under `<stage>/ranks/` (torchrun's restart count)."""
    folders = [p for p in (Path(out) / RANKS).glob("*") if p.name.isdigit() and p.is_dir()]
    return max(folders, key=lambda p: int(p.name)) if folders else None


def views(folder: Path) -> dict[int, dict]:
    """Each reporting rank's view of the broken collective (a damaged one is left out)."""
    found = {}
    for path in sorted(folder.glob("hang-*.json")):
        v = reading.read_json_or_none(path, VIEW_SCHEMA, "a rank's hang report")
        if v is not None:
            found[v["rank"]] = v
    return found


class HangWatch:
    """The launcher's deadline for a hung attempt (see the module's docstring); `poll` runs
    in the launcher's wait loop, `kill(pid)` ends one rank."""

    def __init__(self, out: Path):
        self.out, self.folder, self.deadline, self.done = Path(out), None, None, False

    def poll(self, kill) -> None:
        if self.done:
            return
        if self.deadline is None:
            folder = last_attempt(self.out)
            if folder is not None and any(folder.glob("hang-*.json")):
                self.folder, self.deadline = folder, time.monotonic() + KILL_AFTER_S
            return
        if time.monotonic() >= self.deadline:
            self.done = True
            world = max((v["world"] for v in views(self.folder).values()), default=0)
            beats, _ = read_heartbeats(self.folder, world)
            for b in beats.values():
                if b["host"] == socket.gethostname():
                    kill(b["pid"])


def who_missing(vs: dict[int, dict], world: int) -> tuple[list[int], str]:
    """(the ranks that did not arrive, how they were found): rank 0's monitored_barrier
    names them, else the other ranks name rank 0 when it did not answer them; with the ranks
    whose process had ended (their heartbeat's pid); else (none named) the ranks that
    reported nothing."""
    if 0 in vs and vs[0]["missing"] is not None:
        named = set(vs[0]["missing"])
    else:
        named = {m for v in vs.values() for m in v["missing"] or []}
    ended = {e for v in vs.values() for e in v["ended"]} - named
    how = (["torch's monitored_barrier"] if named else []) + (
        ["the heartbeats: its process had ended"] if ended else [])
    if not named and not ended:
        named = {r for r in range(world) if r not in vs}
        how = ["the heartbeats: it reported no broken collective"] if named else []
    return sorted(named | ended), " and ".join(how) or "no rank"


def _state(rank: int, beats: dict, vs: dict) -> str:
    if any(rank in v["ended"] for v in vs.values()):
        return "its process had ended"
    if beats.get(rank, {}).get("answered"):
        return "alive, stuck where its stack shows"
    return "it did not answer: stopped, or blocked in the kernel"


def print_stacks(folder: Path, world: int, beats: dict, said=print) -> None:
    """Every rank's stack file into the log (after one console line)."""
    said(f"ddpflow: the Python stack of every rank when the collective broke (from {folder}):",
         file=sys.stderr)
    for rank in range(world):
        path = stack_file(folder, rank)
        try:
            text = reading.read_text(path, "a rank's stack", max_bytes=STACK_MAX_BYTES,
                                     empty_ok=True) if path.exists() else ""
        except UserError as e:
            text = f"== rank {rank}: its stack file is unreadable: {e}\n"
        if not text.strip():
            b = beats.get(rank, {})
            text = (f"== rank {rank} (host {b.get('host', '?')}, pid {b.get('pid', '?')}): no "
                    f"stack: the process did not answer (stopped, ended, or blocked in the "
                    f"kernel)\n")
        said(text.rstrip("\n"), file=sys.stderr)


def report(out: Path, timeout_s: int, said=print) -> str | None:
    """The reason of the launcher's error line when a collective broke, with every rank's
    stack printed before it and `hang.json` written; None when no rank reported one."""
    folder = last_attempt(out)
    vs = views(folder) if folder is not None else {}
    if not vs:
        return _flight_recorder_only(out, folder)
    world = max(v["world"] for v in vs.values())
    beats, problems = read_heartbeats(folder, world)
    missing, how = who_missing(vs, world)
    print_stacks(folder, world, beats, said)
    who = ", ".join(f"rank {r} (host {beats.get(r, {}).get('host', '?')}: "
                    f"{_state(r, beats, vs)})" for r in missing) or "no rank"
    steps = ", ".join(f"rank {r} at step {beats[r]['step']}" if r in beats else
                      f"rank {r} unknown (no readable heartbeat)" for r in range(world))
    first = min(vs.values(), key=lambda v: v["detected_at"])
    tool = first.get("stacks", "faulthandler")
    write_json_atomic(Path(out) / REPORT, {
        "missing": missing, "world": world, "timeout_s": timeout_s, "margin_s": HANG_MARGIN_S,
        "error": first["error"], "found_by": how, "stacks": tool,
        "detected_at": first["detected_at"], "ended_at": time.time(),
        "ranks": [beats.get(r) for r in range(world)], "heartbeat_problems": problems})
    return (f"a collective did not complete: {who} did not arrive (found by {how}); last "
            f"step completed: {steps}; the ranks that waited (up to hardware.timeout_s, "
            f"{timeout_s} s) said: {first['error'][:160]}; every rank's Python stack ({tool}) "
            f"is in the log and in {folder}"
            + (f"; unreadable heartbeats: {'; '.join(problems)}" if problems else ""))


def _flight_recorder_only(out: Path, folder: Path | None) -> str | None:
    """NCCL: the watchdog ended the ranks before Python could report; the flight recorder's
    dumps and the heartbeats are what is left (unverified until a GPU run)."""
    ranks = Path(out) / RANKS
    dumps = sorted(ranks.glob(FLIGHT_PREFIX + "*"))
    if not dumps:
        return None
    beats, _ = read_heartbeats(folder, len(dumps) + 64) if folder else ({}, [])
    steps = ", ".join(f"rank {r} at step {b['step']}" for r, b in sorted(beats.items()))
    return (f"a NCCL collective did not complete and its watchdog ended the ranks; last step "
            f"completed: {steps or 'unknown'}; the flight recorder's dumps in {ranks} name the "
            f"rank that did not arrive: torchfrtrace {ranks} -p {FLIGHT_PREFIX} "
            f"--allow-incomplete-ranks")
