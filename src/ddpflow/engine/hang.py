"""A rank that finds a collective broken names the ranks that did not arrive.

A collective that does not complete fails on the ranks that wait in it: gloo raises after
`hardware.timeout_s` ("Timed out waiting ..."), or at once when a peer's process ended
("Connection closed by peer"). Such a rank then (`diagnose`), before it leaves:
 1. writes its own stack (the failed call's traceback and every thread) to its stack file;
 2. asks every rank for its stack (heartbeat.py: `request`);
 3. meets the others in torch's `monitored_barrier` on a gloo group of its own (made at
    start-up by `watch_group`, so a broken training group does not matter): on rank 0 it
    names the ranks that did not arrive within BARRIER_S; on another rank it fails when
    rank 0 does not answer;
 4. reads the heartbeats: the last step of every rank, and which ranks on its host have
    ended (their pid is gone);
 5. signals SIGUSR2 to the ranks on its host whose stack has not come within STACK_WAIT_S
    (faulthandler's C handler answers where the rank's thread cannot), or runs py-spy on
    them where py-spy is installed;
 6. writes `hang-<rank>.json`: its view, which the launcher reads (launch/hangreport.py).
On NCCL the watchdog ends the process instead (TORCH_NCCL_ASYNC_ERROR_HANDLING=1) after the
flight recorder wrote its dump (launcher.py sets it up); faulthandler, enabled in every rank,
prints that rank's stack on the abort. (The dump was seen on one H200, one rank; a hang
across several GPUs is unverified.)
"""

from __future__ import annotations

import datetime
import os
import re
import shutil
import subprocess
import time
import traceback

from ddpflow.core.writing import write_json_atomic
from ddpflow.engine import heartbeat as hb

BARRIER_S = 5.0  # seconds monitored_barrier waits for the ranks that did not arrive
STACK_WAIT_S = 3.0  # seconds to wait for the other ranks' stacks before signalling them
# the exceptions gloo raises in a rank whose collective broke (a timeout, a peer gone)
BROKEN = ("Timed out waiting", "Connection closed by peer", "Connection reset by peer",
          "Broken pipe", "failed to pass monitoredBarrier")
NAMED = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")
FROM_RANK_0 = re.compile(r"while waiting for send/recv from rank (\d+)")


def watch_group(dist):
    """Every rank, right after the process group: the gloo group monitored_barrier runs on
    (a group of its own: the training group may be the broken one). None for one rank."""
    import torch.distributed as torch_dist

    if not dist.backend or dist.world < 2:
        return None
    return torch_dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=BARRIER_S))


def is_broken_collective(e: BaseException) -> bool:
    """Whether `e` is a collective that did not complete (torch's distributed errors, or
    gloo's runtime errors for a timeout or a peer that is gone)."""
    import torch.distributed as torch_dist

    if isinstance(e, (torch_dist.DistBackendError, torch_dist.DistNetworkError)):
        return True
    return isinstance(e, RuntimeError) and any(s in str(e) for s in BROKEN)


def missing_ranks(dist, group) -> tuple[list[int] | None, str]:
    """(the ranks that did not arrive, how that was found) by torch's monitored_barrier:
    rank 0 names them; another rank learns only that rank 0 did not answer; None when
    torch named no rank (a peer gone breaks the barrier before it can)."""
    import torch.distributed as torch_dist

    try:
        torch_dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=BARRIER_S),
                               wait_all_ranks=True)
        return [], "monitored_barrier"  # every rank arrived
    except RuntimeError as e:
        return named_by_barrier(str(e), dist.rank)


def named_by_barrier(text: str, rank: int) -> tuple[list[int] | None, str]:
    """The ranks monitored_barrier's error names as missing (rank 0's "Ranks 1, 3 failed to
    pass monitoredBarrier", another rank's "... from rank 0"), or None and why not."""
    named = NAMED.search(text)
    if named:
        return sorted(int(r) for r in named.group(1).split(",")), "monitored_barrier"
    silent = FROM_RANK_0.search(text)
    if rank != 0 and silent:
        return [int(silent.group(1))], "monitored_barrier"
    return None, f"monitored_barrier named no rank: {error_text(RuntimeError(text))}"


def error_text(err: BaseException) -> str:
    """The error's first sentence, without gloo's source position ("[.../pair.cc:561] ")
    and its advice ("This is typically caused by ...")."""
    lines = str(err).strip().splitlines()
    text = re.sub(r"^\[[^\]]*\]\s*", "", lines[0]) if lines else ""
    return text.split(". ")[0][:300] or type(err).__name__


def alive(pid: int) -> bool:
    """Whether process pid runs (a zombie, ended and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def stack_is_in(folder, rank: int) -> bool:
    path = hb.stack_file(folder, rank)
    return path.is_file() and path.stat().st_size > 0


def fetch_stacks(beat: hb.Heartbeat, beats: dict[int, dict]) -> str:
    """Wait up to STACK_WAIT_S for every rank's stack; then reach the ranks on this host
    that have not answered (py-spy where installed, else SIGUSR2). Returns the tool used."""
    deadline = time.monotonic() + STACK_WAIT_S
    while time.monotonic() < deadline and not all(
            stack_is_in(beat.folder, r) for r in range(beat.world)):
        time.sleep(hb.TICK_S)
    spy, signalled = shutil.which("py-spy"), False
    for rank, b in sorted(beats.items()):
        if stack_is_in(beat.folder, rank) or b["host"] != beat.host or not alive(b["pid"]):
            continue
        try:  # one rank on this host reaches it (the first to claim it)
            os.close(os.open(beat.folder / f"reached-{rank}", os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            continue
        hb.append_text(hb.stack_file(beat.folder, rank),
                       f"== stack of rank {rank} (host {b['host']}, pid {b['pid']}), "
                       f"by {'py-spy' if spy else 'faulthandler (SIGUSR2)'}:\n")
        if spy:
            # a py-spy that hangs or cannot run must not cost this rank its hang report
            limit = STACK_WAIT_S * 3  # seconds: a dump takes well under one
            try:
                out = subprocess.run([spy, "dump", "--pid", str(b["pid"])],
                                     capture_output=True, text=True, timeout=limit)
                said = out.stdout + out.stderr
            except subprocess.TimeoutExpired:
                said = f"(py-spy gave no stack within {limit:g} s)\n"
            except OSError as e:
                said = f"(py-spy could not run: {e.strerror or type(e).__name__})\n"
            hb.append_text(hb.stack_file(beat.folder, rank), said)
        else:
            os.kill(b["pid"], hb.STACK_SIGNAL)
            signalled = True
    if signalled:
        time.sleep(1.0)  # the signalled handlers write at once
    return "py-spy" if spy else "faulthandler"


def diagnose(dist, group, beat: hb.Heartbeat, err: BaseException) -> dict:
    """This rank's view of a broken collective (see the module's docstring), written to
    `hang-<rank>.json` in the attempt's folder; returned too."""
    beat.diagnosing = True
    detected = time.time()
    beat.dump(f"== stack of rank {dist.rank} (host {beat.host}, pid {beat.pid}) at step "
              f"{beat.step}, where its collective broke, by faulthandler:\n",
              "".join(traceback.format_exception(err)))
    beat.request()
    missing, how = missing_ranks(dist, group) if group is not None else (None, "no watch group")
    beats, problems = hb.read_heartbeats(beat.folder, dist.world)
    tool = fetch_stacks(beat, beats)
    # after the wait for stacks: a killed rank's socket closes while its process still
    # exits (under load, longer than this rank takes to get here), so only now is it gone
    ended = sorted(r for r, b in beats.items() if b["host"] == beat.host and r != dist.rank
                   and not alive(b["pid"]))
    view = {"rank": dist.rank, "world": dist.world, "host": beat.host, "step": beat.step,
            "error": error_text(err), "missing": missing, "found_by": how, "ended": ended,
            "stacks": tool, "heartbeat_problems": problems, "detected_at": detected,
            "at": time.time()}
    write_json_atomic(beat.folder / f"hang-{dist.rank}.json", view)
    return view
