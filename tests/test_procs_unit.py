"""When the launcher's torchrun hears of a stop and of a rank's mistake (launch/procs.py):
a stop signal reaches torchrun's processes at once, also one that came while torchrun was
being started; several nodes are told through srun again every 5 s of the launcher's clock;
a rank's report stops the group 3 s (by the launcher's clock) after it was first seen.

Each case runs run_torchrun in a launcher process of its own (it takes the stop signals)
with a real process for torchrun (`sleep`, or a Python script under srun's name). Where the
signal has to be seen the moment it is sent, the launcher blocks SIGTERM (its children
inherit the mask) and the test reads it pending in /proc; where seconds count, the launcher's
clock (procs.time) is one the test moves by a fixed step at each look. Fast: a few seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from ddpflow.launch import procs
from test_launch_unit import _alive  # a pid that is neither gone nor a zombie

LAUNCHER = """
import json, os, signal, subprocess, sys, threading, time
from pathlib import Path
from ddpflow.launch import procs
mode, out = sys.argv[1], Path(sys.argv[2])
cmd = json.loads(sys.argv[3])

def pending(pid, sig):  # sig sent to pid and not yet taken (it blocks it)
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return bool(int(fields["ShdPnd"], 16) & (1 << (sig - 1)))

def running(pid):  # not stopped, not dying, not gone
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return False
    pnd = int(fields["ShdPnd"], 16) | int(fields["SigPnd"], 16)
    return fields["State"].split()[0] in "RSD" and not pnd & (1 << (signal.SIGKILL - 1))

def torchrun_pid():  # written by the command itself (sh -c 'echo $$ > pid; exec ...')
    for _ in range(1200):
        if (out / "pid").is_file() and (out / "pid").read_text().strip():
            return int((out / "pid").read_text())
        time.sleep(0.05)
    raise SystemExit("torchrun never started")

class Clock:  # the launcher's clock: `step` seconds later at each look
    def __init__(self, step, end_at=None):
        self.calls, self.step, self.end_at = 0, step, end_at
    def monotonic(self):
        self.calls += 1
        if self.calls == self.end_at:  # srun's step ends (its stand-in exits 0 on SIGTERM)
            os.kill(torchrun_pid(), signal.SIGTERM)
        return 100.0 + self.step * (self.calls - 1)

class Hang:  # hangreport.HangWatch's place: called at each of the launcher's looks
    def __init__(self):
        self.looks, self.seen = 0, None
    def poll(self, kill):
        self.looks += 1
        pid = torchrun_pid() if mode in ("signal", "watch") else None
        if mode == "signal" and self.looks == 1:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, between two looks
            self.seen = pending(pid, signal.SIGTERM)
            os.kill(pid, signal.SIGKILL)
        if mode == "watch":
            self.seen = (self.seen or 0) + running(pid)
            if self.looks == 12:  # never stopped: end it here
                os.kill(pid, signal.SIGKILL)

class Torchrun(subprocess.Popen):  # the agent's torchrun, looked at as the launcher waits
    seen = None
    def wait(self, timeout=None):
        if self.seen is None:
            self.seen = pending(self.pid, signal.SIGTERM)
            self.kill()
        return super().wait(timeout)

class Starting:  # a warm agent, and Ctrl-C as it is handed the command
    @property
    def pipe(self):
        os.kill(os.getpid(), signal.SIGINT)
        return 1
    def start(self, cmd, env):
        self.proc = Torchrun(["sleep", "600"], process_group=0)
        return self.proc

hang, agent, watch = Hang(), None, None
if mode in ("signal", "starting"):
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # torchrun's too (inherited)
if mode == "starting":
    agent = Starting()
if mode == "watch":
    procs.time = Clock(1.0)
    watch = out / "error.json"
    watch.write_text('{"message": "bad item"}')  # a rank reported its mistake
if mode == "srun":
    procs.time = Clock(2.5, end_at=12)
    def stop():  # Ctrl-C once srun's step is up
        torchrun_pid()
        os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=stop, daemon=True).start()
rc, sig = procs.run_torchrun(cmd, {}, watch=watch, agent=agent, hang=hang)
print(json.dumps([rc, sig, agent.proc.seen if agent else hang.seen]), flush=True)
"""

SRUN = """
import os, signal, sys
from pathlib import Path
out = Path(sys.argv[1])
def told(signum, _frame):
    with open(out / "told", "a") as f:
        f.write(signal.Signals(signum).name + "\\n")
signal.signal(signal.SIGUSR1, told)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
(out / "pid").write_text(str(os.getpid()))
while True:
    signal.pause()
"""

@pytest.fixture
def launcher():
    """This process as the launcher: its signal handlers and child-subreaper flag given back
    afterwards, and run_torchrun interrupted if it never returns."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    reaper = ctypes.c_int()
    libc.prctl(37, ctypes.byref(reaper))  # PR_GET_CHILD_SUBREAPER
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}

    def hung(*_):
        raise AssertionError("run_torchrun did not return in 30 s")

    alarm = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, 30)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, alarm)
        for s, h in handlers.items():
            signal.signal(s, h)
        libc.prctl(36, reaper.value)  # PR_SET_CHILD_SUBREAPER


def test_after_torchrun_ends_the_ranks_of_this_run_it_left_are_stopped(tmp_path, launcher):
    """A rank of this run still running when torchrun has ended (a child of the launcher,
    its command line holding the run's resolved config) is killed and reaped; a process of
    another run is left alone."""
    marker = str(tmp_path / "run" / "config.json")
    sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
    ours = subprocess.Popen([*sleep, "--resolved", marker])
    theirs = subprocess.Popen([*sleep, "--resolved", str(tmp_path / "other" / "config.json")])
    try:
        assert procs.run_torchrun(["true", "--resolved", marker], {}) == (0, None)
        assert not _alive(ours.pid) and _alive(theirs.pid)
    finally:
        for p in (ours, theirs):
            p.kill()
            p.wait()


ITSELF = ["sh", "-c", 'echo $$ > "$0"/pid; exec sleep 600']


def _launch(tmp_path, mode, cmd):
    out = tmp_path / "launcher"
    out.mkdir()
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "srun").write_text(f"#!{sys.executable}\n{SRUN}")  # a step of several nodes
    (bin_ / "srun").chmod(0o755)
    cmd = [str(out) if a == "OUT" else a for a in cmd]
    done = subprocess.run([sys.executable, "-c", LAUNCHER, mode, str(out), json.dumps(cmd)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}"})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), out


def test_a_stop_signal_reaches_torchrun_the_moment_it_comes(tmp_path):
    """Ctrl-C between two looks of the launcher: torchrun's group has its SIGTERM before
    the launcher's next look (no rank yet: torchrun stops what it started)."""
    got, _ = _launch(tmp_path, "signal", [*ITSELF, "OUT"])
    assert got == [-signal.SIGKILL, "SIGINT", True]


def test_a_stop_signal_while_the_agent_is_handed_torchrun_reaches_it_once_started(tmp_path):
    """The signal came before torchrun had a pid: it is relayed as soon as it has one,
    before the launcher first waits on it."""
    got, _ = _launch(tmp_path, "starting", [sys.executable, "-m", "torch.distributed.run"])
    assert got == [-signal.SIGKILL, "SIGINT", True]


def test_a_ranks_mistake_stops_the_group_3_s_after_it_was_first_seen(tmp_path):
    """The launcher looks every half second; its clock here moves 1 s a look: seen at the
    first look, torchrun still runs at the 2nd, 3rd and 4th (3 s: not more than 3) and is
    stopped (SIGKILL, no restart) at the 4th."""
    got, _ = _launch(tmp_path, "watch", [*ITSELF, "OUT"])
    assert got == [-signal.SIGKILL, None, 4]


def test_several_nodes_are_told_through_srun_again_every_5_s(tmp_path):
    """The launcher's clock moves 2.5 s a look: srun is told at once, then again at the
    3rd look after (7.5 s: more than 5 s since), and again 3 looks later; the step ends
    (exit 0) 2 looks after that."""
    got, out = _launch(tmp_path, "srun", ["srun", "OUT"])
    assert got == [0, "SIGINT", None]
    assert (out / "told").read_text().splitlines() == ["SIGUSR1"] * 3
