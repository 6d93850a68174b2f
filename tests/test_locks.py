"""core/locks.exclusive on one process: flock belongs to an open file description, so a
second open of the same file conflicts with the first as another process's would."""

from __future__ import annotations

import fcntl
import os
import socket

import pytest

from ddpflow.core.errors import UserError
from ddpflow.core.locks import exclusive


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_one_writer_names_itself_and_a_second_is_refused_with_its_name(tmp_path):
    path = tmp_path / "not" / "yet" / ".lock"
    mine = f"pid {os.getpid()} on host {socket.gethostname()}\n"
    with exclusive(path, "the prepared data"):
        assert path.read_text() == mine and path.stat().st_mode & 0o777 == 0o644
        before = _fds()
        with pytest.raises(UserError) as e:
            with exclusive(path, "the prepared data"):
                pass
        assert str(e.value) == (f"the prepared data is being written by another ddpflow "
                                f"process ({mine.strip()}); wait for it to finish or stop "
                                f"it, then run again")
        assert _fds() == before  # the refused attempt closed what it opened
    assert path.read_text() == "" and _fds() == before - 1
    with exclusive(path, "the prepared data"):  # released: the next writer gets it
        assert path.read_text() == mine


def test_what_an_earlier_holder_wrote_is_replaced_whole(tmp_path):
    path = tmp_path / ".lock"
    path.write_text("pid 1 on host a-much-longer-name-than-this-machine-has\n" * 3)
    with exclusive(path, "stage a"):
        assert path.read_text() == f"pid {os.getpid()} on host {socket.gethostname()}\n"


@pytest.mark.parametrize("content, named", [
    ("", "unknown process"),  # a holder that wrote nothing yet
    ("x" * 250, "x" * 200),  # the first 200 bytes of whatever it holds
    ("  pid 7 on host b\n\n", "pid 7 on host b")])
def test_a_holder_is_named_by_what_it_wrote(tmp_path, content, named):
    path = tmp_path / ".lock"
    path.write_text(content)
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(UserError, match=r"^stage a is being written by another ddpflow "
                           rf"process \({named}\); wait"):
            with exclusive(path, "stage a"):
                pass
    finally:
        os.close(fd)
