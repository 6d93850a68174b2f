"""Roll call of a stage on several nodes: which nodes reached the rendezvous.

srun starts `python -m ddpflow.launch.rollcall` on every node of the allocation in place of
torchrun.
A node other than the rendezvous host first waits until the host's rendezvous port accepts a
connection (at most hardware.timeout_s seconds), then records itself as <folder>/<node> on
the filesystem the nodes share and becomes torchrun (exec). The host records itself at once:
its own torchrun opens that port. A node that cannot reach the port exits with EXIT_UNREACHED,
so srun (--kill-on-bad-exit) ends the step at once instead of the host's torchrun waiting out
its join timeout, and the launcher names the nodes that never joined (`missing`).

Only the standard library is imported here: this runs before every torchrun of the job.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

from ddpflow.core.writing import write_bytes_atomic

EXIT_UNREACHED = 3


def node_name() -> str:
    """The Slurm name of this node (what `scontrol show hostnames` lists), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def is_host(host: str) -> bool:
    """Whether the rendezvous host is this machine: its Slurm name, or an address that a
    socket here can bind (two agents on one machine, as tests start them)."""
    if host == node_name():
        return True
    try:
        with socket.socket() as s:
            s.bind((socket.gethostbyname(host), 0))
        return True
    except OSError:
        return False


def reachable(host: str, port: int, timeout_s: float) -> bool:
    """Whether host:port accepts a TCP connection within timeout_s (polled: the host's
    torchrun may not have opened it yet)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            with socket.create_connection((host, port), timeout=min(2.0, left)):
                return True
        except OSError:  # refused (not open yet), unreachable, or dropped until the timeout
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def answer(folder: Path) -> None:
    """Record this node as present: an empty file named after it, written in one step."""
    folder.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(folder / node_name(), b"")


def present(folder: Path) -> set[str]:
    try:
        return {p.name for p in Path(folder).iterdir() if not p.name.startswith(".")}
    except OSError:
        return set()


def missing(folder: Path, hosts: list[str]) -> list[str]:
    """The allocation's nodes that did not answer the roll call, in node-list order."""
    here = present(folder)
    return [h for h in hosts if h not in here]


def main(argv: list[str]) -> int:
    """rollcall FOLDER HOST PORT TIMEOUT_S -- COMMAND...: answer, then exec COMMAND."""
    if len(argv) < 6 or argv[4] != "--":
        print("usage: python -m ddpflow.launch.rollcall FOLDER HOST PORT TIMEOUT_S -- COMMAND...",
              file=sys.stderr)
        return 2
    folder, host, port, timeout_s, command = Path(argv[0]), argv[1], int(argv[2]), \
        float(argv[3]), argv[5:]
    if not is_host(host) and not reachable(host, port, timeout_s):
        print(f"ddpflow: node {node_name()} could not reach the rendezvous at {host}:{port} "
              f"within {timeout_s:.0f} s", file=sys.stderr)
        return EXIT_UNREACHED
    answer(folder)
    # a scheduler's SIGUSR1 (sbatch --signal=USR1@T, scancel --signal=USR1) reaches every
    # process of the step: torchrun has no handler and would die of it, taking its ranks down
    # before they checkpoint; the ranks install their own handler (a stop at a checkpoint)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    sys.stdout.flush()
    os.execvp(command[0], command)  # this process becomes the node's torchrun agent
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
