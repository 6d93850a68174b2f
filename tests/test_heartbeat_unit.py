"""engine/heartbeat.py edge by edge: the files' names and modes, the size a heartbeat may
have, what the thread writes and when (at start, on a wake, never between beats unwoken),
a stack request answered once with the stacks of every thread and of the rank's forked
DataLoader workers (not of a program it started), and close() that stops the thread, writes
the last step and releases the stack file. Real threads, files and forked processes; the
beat interval set long or short so that no assertion depends on this machine's speed.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ddpflow.core.writing import write_json_atomic
from ddpflow.engine import heartbeat


def wait_until(cond, timeout=20.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "not reached"
        time.sleep(0.01)


def read(path):
    return json.loads(path.read_text())


@pytest.fixture
def umask():
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.fixture
def quiet(monkeypatch):
    """A thread that never beats unless woken (the first look comes an hour later)."""
    monkeypatch.setattr(heartbeat, "TICK_S", 3600.0)
    monkeypatch.setattr(heartbeat, "BEAT_S", 3600.0)


# ------------------------------------------------------------------ files

def test_the_files_of_an_attempt_are_named_by_restart_count_and_rank(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert heartbeat.attempt_folder(tmp_path) == tmp_path / "ranks" / "0"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert heartbeat.attempt_folder(str(tmp_path)) == tmp_path / "ranks" / "2"
    assert heartbeat.stack_file(str(tmp_path), 3) == tmp_path / "stack-3.txt"
    assert heartbeat.heartbeat_file(str(tmp_path), 3) == tmp_path / "rank-3.json"


BEAT = {"rank": 1, "world": 2, "host": "n1", "pid": 4242, "step": 4, "step_at": 100.0,
        "beat_at": 101.0, "answered": False}


def test_heartbeats_up_to_64_kib_are_read_and_a_larger_one_is_named(tmp_path):
    text = json.dumps(BEAT)
    (tmp_path / "rank-1.json").write_text(text + " " * (2**16 - len(text)))
    beats, problems = heartbeat.read_heartbeats(tmp_path, 3)  # rank 0 and 2: none yet
    assert beats == {1: BEAT} and problems == []
    (tmp_path / "rank-1.json").write_text(text + " " * (2**16 + 1 - len(text)))
    beats, problems = heartbeat.read_heartbeats(tmp_path, 2)
    assert beats == {} and len(problems) == 1
    assert problems[0].startswith(f"{tmp_path / 'rank-1.json'} (a rank's heartbeat) is ")


def test_a_heartbeat_that_names_another_rank_is_left_out_and_named(tmp_path):
    write_json_atomic(tmp_path / "rank-0.json", BEAT)
    write_json_atomic(tmp_path / "rank-1.json", BEAT)
    beats, problems = heartbeat.read_heartbeats(tmp_path, 2)
    assert beats == {1: BEAT}
    assert problems == [f"{tmp_path / 'rank-0.json'} (a rank's heartbeat) names rank 1"]


def test_stack_text_is_appended_whole_to_a_file_of_mode_644(tmp_path, umask):
    path = tmp_path / "stack-0.txt"
    fds = len(os.listdir("/proc/self/fd"))
    heartbeat.append_text(path, "one\n")
    heartbeat.append_text(path, "two \udcff\n")  # a lone surrogate: replaced, not a crash
    assert path.read_bytes() == b"one\ntwo ?\n"
    assert (path.stat().st_mode & 0o777) == 0o644
    assert len(os.listdir("/proc/self/fd")) == fds  # every descriptor closed


# ------------------------------------------------------------------ the thread

def test_a_new_heartbeat_is_written_before_its_thread_runs(tmp_path, quiet, umask):
    folder = tmp_path / "stage" / "ranks" / "0"  # made with its parents
    beat = heartbeat.Heartbeat(folder, 1, 2)
    try:
        rec = read(folder / "rank-1.json")
        assert {k: rec[k] for k in ("rank", "world", "pid", "step", "answered")} == {
            "rank": 1, "world": 2, "pid": os.getpid(), "step": 0, "answered": False}
        assert (beat.diagnosing, beat.answered) == (False, None)
        assert beat.thread.daemon and beat.thread.name == "ddpflow-heartbeat"
        assert ((folder / "stack-1.txt").stat().st_mode & 0o777) == 0o644
        again = heartbeat.Heartbeat(folder, 2, 2)  # the folder exists already
        again.close()
    finally:
        beat.close()


def test_the_stack_file_starts_empty_for_each_attempt(tmp_path, quiet):
    (tmp_path / "stack-0.txt").write_text("an earlier attempt's stacks\n")
    beat = heartbeat.Heartbeat(tmp_path, 0, 1)
    beat.close()
    assert (tmp_path / "stack-0.txt").read_text() == ""


def test_between_beats_nothing_is_written_unless_woken(tmp_path, quiet):
    beat = heartbeat.Heartbeat(tmp_path, 0, 1)
    try:
        beat.beat(5, now=True)
        wait_until(lambda: read(tmp_path / "rank-0.json")["step"] == 5)
        written = (tmp_path / "rank-0.json").read_text()
        beat.beat(6)  # not a log line: kept for the next beat
        time.sleep(0.3)
        assert (tmp_path / "rank-0.json").read_text() == written
        assert not (tmp_path / "stack-0.txt").read_text()  # no request: no stack
    finally:
        beat.close()
    assert read(tmp_path / "rank-0.json")["step"] == 6  # close writes the last step


def test_the_thread_beats_by_itself_every_beat_interval(tmp_path, monkeypatch):
    monkeypatch.setattr(heartbeat, "TICK_S", 0.01)
    monkeypatch.setattr(heartbeat, "BEAT_S", 0.0)
    beat = heartbeat.Heartbeat(tmp_path, 0, 1)
    try:
        first = read(tmp_path / "rank-0.json")["beat_at"]
        wait_until(lambda: read(tmp_path / "rank-0.json")["beat_at"] > first)
    finally:
        beat.close()


def test_a_vanished_folder_does_not_stop_the_heartbeat(tmp_path, quiet):
    import shutil

    folder = tmp_path / "ranks"
    beat = heartbeat.Heartbeat(folder, 0, 1)
    try:
        shutil.rmtree(folder)
        beat.write()  # no exception: the next beat tries again
        folder.mkdir()
        beat.write()
        assert read(folder / "rank-0.json")["rank"] == 0
    finally:
        beat.close()


def test_close_writes_the_last_step_also_when_the_thread_has_stopped(tmp_path, quiet):
    beat = heartbeat.Heartbeat(tmp_path, 0, 1)
    beat.done.set()  # the thread ends (as if it had died)
    beat.wake.set()
    beat.thread.join()
    beat.beat(7)
    beat.close()
    assert read(tmp_path / "rank-0.json")["step"] == 7


def test_close_stops_the_thread_and_releases_the_stack_file(tmp_path, quiet):
    beat = heartbeat.Heartbeat(tmp_path, 0, 1)
    beat.close()
    assert not beat.thread.is_alive()
    with pytest.raises(OSError):
        os.fstat(beat.fd)
    assert faulthandler.unregister(heartbeat.STACK_SIGNAL) is False  # unregistered already


def test_a_request_file_is_created_once_with_mode_644(tmp_path, quiet, umask):
    beat = heartbeat.Heartbeat(tmp_path, 0, 1)
    try:
        assert beat.request() is True and beat.request() is False
        assert ((tmp_path / heartbeat.REQUEST).stat().st_mode & 0o777) == 0o644
    finally:
        beat.close()


# ------------------------------------------------------------------ stacks

def sleeping_worker():
    with open("/proc/self/comm", "w") as f:  # a name with a parenthesis, as /proc/<pid>/stat
        f.write("worker) 1")                  # shows it: "(worker) 1)"
    time.sleep(60)


def test_a_request_gets_the_stacks_of_the_forked_workers_and_not_of_other_programs(
        tmp_path, quiet):
    beat = heartbeat.Heartbeat(tmp_path, 0, 1)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    pid = os.fork()
    if pid == 0:  # a DataLoader worker: a fork of this process, the same command line
        try:
            sleeping_worker()
        finally:
            os._exit(0)
    try:
        wait_until(lambda: heartbeat._proc(pid, "comm") == b"worker) 1\n")
        assert heartbeat.forked_children(os.getpid()) == [pid]
        assert heartbeat.forked_children(other.pid) == []
        beat.beat(2)
        t0 = time.monotonic()
        beat.answer()  # as the thread does on a request
        assert time.monotonic() - t0 >= 0.2  # the worker had its time to dump alone
        wait_until(lambda: "sleeping_worker" in (tmp_path / "stack-0.txt").read_text())
        text = (tmp_path / "stack-0.txt").read_text()
        head, worker = text.split(f"== its DataLoader worker pid {pid}:\n")
        assert head.startswith(f"== stack of rank 0 (host {beat.host}, pid {os.getpid()}) at "
                               f"step 2, by faulthandler:\n")
        assert "sleeping_worker" not in head and "sleeping_worker" in worker
        assert other.poll() is None  # the program it started got no signal
        wait_until(lambda: read(tmp_path / "rank-0.json")["answered"])
    finally:
        beat.close()
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        other.kill()
        other.wait()


def test_a_worker_gone_before_its_signal_is_skipped(tmp_path, monkeypatch, quiet):
    beat = heartbeat.Heartbeat(tmp_path, 0, 1)
    monkeypatch.setattr(heartbeat, "forked_children", lambda pid: [4242, 4243])

    def gone(pid, sig):  # the workers ended between the listing and the signal
        raise ProcessLookupError(pid)
    monkeypatch.setattr(heartbeat.os, "kill", gone)
    try:
        beat.answer()
        text = (tmp_path / "stack-0.txt").read_text()
        assert "== its DataLoader worker pid 4242:\n== its DataLoader worker pid 4243:\n" in text
    finally:
        beat.close()


def test_a_dump_writes_its_header_and_text_before_every_threads_stack(tmp_path, quiet):
    beat = heartbeat.Heartbeat(tmp_path, 0, 1)
    try:
        beat.dump("== header\n", "Traceback: x\n")
        text = (tmp_path / "stack-0.txt").read_text()
        assert text.startswith("== header\nTraceback: x\n")
        assert "\nThread 0x" in text  # the heartbeat thread too (all threads)
        assert "test_a_dump_writes_its_header" in text
    finally:
        beat.close()


def test_proc_reads_a_process_file_or_nothing():
    assert heartbeat._proc(os.getpid(), "cmdline") == open("/proc/self/cmdline", "rb").read()
    assert heartbeat._proc(2**22 + 7, "stat") == b""


def blocked_in_another_thread(event):
    event.wait()


def test_sigusr2_writes_the_stack_of_every_thread(tmp_path, quiet):
    """faulthandler's C handler (a rank whose thread cannot run) dumps all the threads, not
    only the one the signal interrupted."""
    import threading

    beat = heartbeat.Heartbeat(tmp_path, 0, 1)
    event = threading.Event()
    other = threading.Thread(target=blocked_in_another_thread, args=(event,))
    other.start()
    try:
        os.kill(os.getpid(), heartbeat.STACK_SIGNAL)
        wait_until(lambda: "blocked_in_another_thread" in (tmp_path / "stack-0.txt").read_text())
    finally:
        event.set()
        other.join()
        beat.close()


def test_unwoken_the_thread_waits_the_whole_beat_interval(tmp_path, monkeypatch):
    """It looks for a request every TICK_S but writes only every BEAT_S (an hour here): after
    the write a log line asked for, at most that one more (a wake that raced its first beat)."""
    monkeypatch.setattr(heartbeat, "TICK_S", 0.01)
    monkeypatch.setattr(heartbeat, "BEAT_S", 3600.0)
    beat = heartbeat.Heartbeat(tmp_path, 0, 1)
    try:
        beat.beat(1, now=True)
        wait_until(lambda: read(tmp_path / "rank-0.json")["step"] == 1)
        seen = set()
        for _ in range(25):  # fifty looks of the thread, or so
            seen.add((tmp_path / "rank-0.json").read_text())
            time.sleep(0.02)
        assert len(seen) <= 2
    finally:
        beat.close()
