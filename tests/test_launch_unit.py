"""The launcher's pieces around torchrun, edge by edge: which GPUs and cores a slot of a shared
node gets and the lock and record that hold it (launch/slots.py); a rank's mistake reported
once, in its folder or the launcher's spare (launch/rankerror.py); the roll call of a
several-node stage (launch/rollcall.py); torchrun's process group, the stop signals relayed
to its ranks and the ranks stopped after a mistake (launch/procs.py); the container engines'
commands and messages (launch/container.py). Fast: real files, locks, sockets and small
subprocesses, no training.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import tiny_config
from ddpflow.config import from_dict
from ddpflow.core.errors import UserError
from ddpflow.launch import container, procs, rankerror, rollcall, slots
from ddpflow.launch.container import IN_CONTAINER
from ddpflow.launch.slots import Slot


def _refusal(fn, *args, **kw) -> str:
    with pytest.raises(UserError) as e:
        fn(*args, **kw)
    return str(e.value)


@pytest.fixture
def affinity():
    """This process's CPU affinity, put back after the test (a slot narrows it)."""
    before = os.sched_getaffinity(0)
    yield sorted(before)
    os.sched_setaffinity(0, before)


# ------------------------------------------------------------------ slots: the node's GPUs

FAKE_NVML = """
import os
def nvmlInit():
    if os.environ.get("FAKE_NVML_FAILS"):
        raise RuntimeError("NVML Shared Library Not Found")
def nvmlDeviceGetCount():
    return 3
def nvmlShutdown():
    open(os.environ["FAKE_NVML_SHUT"], "w").close()
"""


def _node(tmp_path, monkeypatch, smi: str | None = None, nvml: bool = False):
    """A node whose driver answers through NVML (a pynvml module) or nvidia-smi (a script
    printing `smi`), or neither; no CUDA_VISIBLE_DEVICES."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # no NVML ...
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    if smi is not None:
        tool = bin_ / "nvidia-smi"
        tool.write_text(f"#!/bin/sh\nprintf '{smi}'\n")
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_))
    if nvml:  # ... unless the node has it
        monkeypatch.delitem(sys.modules, "pynvml")
        (tmp_path / "pynvml.py").write_text(FAKE_NVML)
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.setenv("FAKE_NVML_SHUT", str(tmp_path / "shut"))


def test_the_gpus_are_those_cuda_visible_devices_names(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,GPU-1a2b,,-1")
    assert slots.gpu_ids() == ["3", "GPU-1a2b"]  # an empty entry and -1 name no GPU
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert slots.gpu_ids() == []  # set and empty: no GPU, whatever the driver says
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0, 2,-1,1")
    assert slots.gpu_ids() == ["0", "2"]  # spaces go; CUDA hides every GPU after a -1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", " 5 ")
    assert slots.gpu_ids() == ["5"]


def test_without_cuda_visible_devices_the_driver_counts_the_gpus(tmp_path, monkeypatch):
    _node(tmp_path, monkeypatch, smi="7\\n", nvml=True)
    assert slots.gpu_ids() == ["0", "1", "2"]  # NVML first
    assert (tmp_path / "shut").is_file()  # and NVML shut down after


def test_without_nvml_nvidia_smi_lists_the_gpus(tmp_path, monkeypatch):
    _node(tmp_path, monkeypatch, smi=" 0\\n1\\nNo devices were found\\n\\n", nvml=True)
    monkeypatch.setenv("FAKE_NVML_FAILS", "1")
    assert slots.gpu_ids() == ["0", "1"]


def test_without_a_driver_the_node_has_no_gpu(tmp_path, monkeypatch):
    _node(tmp_path, monkeypatch)
    assert slots.gpu_ids() == []


def test_the_usable_cores_are_this_processs_affinity(affinity):
    os.sched_setaffinity(0, affinity[-1:])
    assert slots.usable_cores() == affinity[-1:]
    os.sched_setaffinity(0, affinity)
    assert slots.usable_cores() == affinity


# ------------------------------------------------------------------ slots: the layout

def test_gpu_slots_split_the_gpus_and_share_the_cores():
    gpus, cores = ["0", "1", "2", "3"], list(range(8))
    assert slots.layout("auto", 2, 99, gpus=gpus, cores=cores) == [
        Slot(0, ("0", "1"), (0, 1, 2, 3)), Slot(1, ("2", "3"), (4, 5, 6, 7))]
    assert slots.layout("cuda", 4, 99, gpus=gpus, cores=cores) == [
        Slot(0, ("0", "1", "2", "3"), tuple(cores))]  # all of them: one slot
    # fewer cores than slots: a core each, and a slot past the cores shares all of them
    assert slots.layout("auto", 1, 99, gpus=gpus, cores=[5, 6]) == [
        Slot(0, ("0",), (5,)), Slot(1, ("1",), (6,)), Slot(2, ("2",), (5, 6)),
        Slot(3, ("3",), (5, 6))]
    assert slots.layout("auto", 2, 99, gpus=gpus, cores=[0, 1, 2, 3, 4]) == [
        Slot(0, ("0", "1"), (0, 1)), Slot(1, ("2", "3"), (2, 3))]  # a core left over


@pytest.mark.parametrize("g, n", [(3, 4), (5, 4), (2, 1)])
def test_gpus_per_trial_that_does_not_divide_the_gpus_is_one_message(g, n):
    gpus = [str(i) for i in range(n)]
    assert _refusal(slots.layout, "auto", g, 1, gpus=gpus, cores=[0]) == (
        f"sweep.gpus_per_trial is {g} but this node has {n} GPU(s); use a number that "
        f"divides {n} (a GPU left over would idle)")


def test_cpu_slots_split_the_cores():
    assert slots.layout("cpu", 2, 2, gpus=["0", "1"], cores=[0, 1, 2, 3, 4]) == [
        Slot(0, (), (0, 1)), Slot(1, (), (2, 3))]  # device cpu: the GPUs are not used
    assert slots.layout("auto", 1, 3, gpus=[], cores=[4, 5, 6]) == [Slot(0, (), (4, 5, 6))]
    assert _refusal(slots.layout, "auto", 1, 4, gpus=[], cores=[4, 5, 6]) == (
        "sweep.threads_per_trial is 4 but this machine has 3 usable CPU core(s); use at most 3")


def test_the_layout_asks_the_node_by_default(monkeypatch, affinity):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert slots.layout("auto", 1, 1) == [
        Slot(0, ("4",), tuple(affinity[:max(1, len(affinity) // 2)])),
        Slot(1, ("6",), tuple(affinity[max(1, len(affinity) // 2):2 * max(1, len(affinity) // 2)]
                              or affinity))]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert slots.layout("auto", 1, len(affinity)) == [Slot(0, (), tuple(affinity))]


# ------------------------------------------------------------------ slots: the lock

def _locked_by_another(path: Path) -> bool:
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _open_locks(pool: Path) -> list[str]:
    """This process's descriptors open on a lock file of the pool."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(str(pool)):
                found.append(fd)
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return found


def test_a_slot_is_taken_with_a_lock_that_says_who_holds_it(tmp_path):
    pool = tmp_path / "pool"
    pool.mkdir()
    two = [Slot(0, (), (0,)), Slot(1, (), (1,))]
    (pool / "slot0.lock").write_text("an earlier holder's much longer line than this one\n")
    slot, fd = slots._take(pool, two, "r/a")
    try:
        assert slot == two[0] and _locked_by_another(pool / "slot0.lock")
        assert (pool / "slot0.lock").read_text() == (
            f"r/a, pid {os.getpid()} on host {socket.gethostname()}\n")
        assert stat.S_IMODE((pool / "slot0.lock").stat().st_mode) == 0o644
        slot1, fd1 = slots._take(pool, two, "r/b")  # the next free one
        assert slot1 == two[1]
        assert stat.S_IMODE((pool / "slot1.lock").stat().st_mode) == 0o644  # made here
        assert slots._take(pool, two, "r/c") is None  # all taken
        assert len(_open_locks(pool)) == 2  # (a try that failed left nothing open)
        os.close(fd1)
        assert slots._take(pool, two, "r/c")[0] == two[1]  # a closed lock is free again
    finally:
        os.close(fd)


def test_acquire_waits_for_a_slot_saying_so_once(tmp_path, capsys):
    pool = tmp_path / "a" / "pool"  # made when missing
    one = [Slot(0, (), (0,))]
    slot, fd = slots.acquire(pool, one, "r/a")
    assert slot == one[0] and capsys.readouterr().err == ""
    got = []
    waiter = threading.Thread(target=lambda: got.append(slots.acquire(pool, one, "r/b")))
    waiter.start()
    time.sleep(4 * slots.POLL_S)  # it looks several times while the slot is held
    assert not got
    os.close(fd)
    waiter.join(timeout=60)
    assert got and got[0][0] == one[0]
    os.close(got[0][1])
    assert capsys.readouterr().err == (
        f"ddpflow: r/b: all 1 slot(s) of {pool} are taken; waiting for one to free up\n")


WAITER = """
import sys
from pathlib import Path
from ddpflow.launch.slots import Slot, acquire
print("waiting", flush=True)
acquire(Path(sys.argv[1]), [Slot(0, (), (0,))], "r/b")
"""


def test_a_launcher_waiting_for_a_slot_sleeps_between_looks(tmp_path):
    """(it does not spin on a core another run could use)"""
    pool = tmp_path / "pool"
    slot, fd = slots.acquire(pool, [Slot(0, (), (0,))], "r/a")
    waiter = subprocess.Popen([sys.executable, "-c", WAITER, str(pool)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert waiter.stdout.readline() == "waiting\n"
        assert waiter.stderr.readline().startswith("ddpflow: r/b: all 1 slot(s)")
        states = []
        for _ in range(40):
            with open(f"/proc/{waiter.pid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
            time.sleep(0.025)
        assert states.count("S") > 30, states  # asleep, not running nor waiting for a core
    finally:
        waiter.kill()
        waiter.wait()
        os.close(fd)


def test_narrowing_to_a_slot_sets_the_gpus_and_cores(monkeypatch, affinity):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    slots.narrow_to(Slot(1, ("2", "3"), tuple(affinity[-1:])))
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert sorted(os.sched_getaffinity(0)) == affinity[-1:]
    os.sched_setaffinity(0, affinity)
    slots.narrow_to(Slot(0, (), ()))  # a slot without GPUs or cores changes neither
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert sorted(os.sched_getaffinity(0)) == affinity


# ------------------------------------------------------------------ slots: a stage's hold

def _slot_cfg(tmp_path, pool, device="cpu", gpus=1, threads=1):
    return from_dict(tiny_config(tmp_path, hardware={
        "device": device, "slots": {"pool": str(pool) if pool else None, "gpus": gpus,
                                    "threads": threads}}))


def test_a_stage_holds_its_slot_and_records_it(tmp_path, monkeypatch, affinity, capsys):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    pool, record = tmp_path / "pool", tmp_path / "stage" / "s1" / "slot.json"
    cfg = _slot_cfg(tmp_path, pool, threads=len(affinity))
    t0 = time.time()
    with slots.hold(cfg, record, "t/s1") as slot:
        assert slot == Slot(0, (), tuple(affinity))
        held = json.loads(record.read_text())
        assert _locked_by_another(pool / "slot0.lock")
    assert not _locked_by_another(pool / "slot0.lock")  # released with the hold
    assert not [fd for fd in os.listdir("/proc/self/fd")  # and its descriptor closed
                if os.path.realpath(f"/proc/self/fd/{fd}") == str(pool / "slot0.lock")]
    done = json.loads(record.read_text())
    assert held == {"slot": 0, "slots": 1, "gpus": [], "cores": affinity,
                    "host": socket.gethostname(), "pid": os.getpid(),
                    "acquired_at": held["acquired_at"], "released_at": None}
    assert done == {**held, "released_at": done["released_at"]}
    assert t0 <= held["acquired_at"] <= done["released_at"] <= time.time()
    assert capsys.readouterr().err == (
        f"ddpflow: t/s1: slot 0 of 1 (CPU cores {','.join(map(str, affinity))})\n")
    assert slots.read_record(record) == done


def test_a_gpu_slot_is_named_by_its_gpus(tmp_path, monkeypatch, affinity, capsys):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    record = tmp_path / "slot.json"
    with slots.hold(_slot_cfg(tmp_path, tmp_path / "pool", "auto", gpus=2), record,
                    "t/s1") as slot:
        assert slot.gpus == ("5", "7") and os.environ["CUDA_VISIBLE_DEVICES"] == "5,7"
    assert capsys.readouterr().err == "ddpflow: t/s1: slot 0 of 1 (GPU 5,7)\n"
    assert json.loads(record.read_text())["gpus"] == ["5", "7"]
    with slots.hold(_slot_cfg(tmp_path, tmp_path / "pool", "auto", gpus=1), record,
                    "t/s1") as slot:  # one of two: this process (and all it starts) sees it
        assert slot.gpus == ("5",) and os.environ["CUDA_VISIBLE_DEVICES"] == "5"
    assert capsys.readouterr().err == "ddpflow: t/s1: slot 0 of 2 (GPU 5)\n"


def test_no_pool_or_a_slurm_job_holds_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    record = tmp_path / "slot.json"
    with slots.hold(_slot_cfg(tmp_path, None), record, "t/s1") as slot:
        assert slot is None
    monkeypatch.setenv("SLURM_JOB_ID", "42")  # the allocation is the slot
    with slots.hold(_slot_cfg(tmp_path, tmp_path / "pool"), record, "t/s1") as slot:
        assert slot is None
    assert not record.exists() and not (tmp_path / "pool").exists()


def test_a_damaged_slot_record_counts_as_none(tmp_path):
    p = tmp_path / "slot.json"
    p.write_text('{"gpus": "0"}')
    assert slots.read_record(p) is None
    p.write_text('{"slot": 0, "gpus": null}')
    assert slots.read_record(p) == {"slot": 0, "gpus": None}
    assert slots.read_record(tmp_path / "missing.json") is None


# ------------------------------------------------------------------ a rank's mistake

def test_a_ranks_report_is_error_json_in_its_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    folder = tmp_path / "run" / "stages" / "s1"  # made when missing
    with rankerror.Reports(folder) as reports:
        assert not reports.is_file() and reports.message() is None
        rankerror.report(folder, UserError("data.path x: no such folder"))
        assert json.loads((folder / "error.json").read_text()) == {
            "message": "data.path x: no such folder", "rank": 3}
        assert reports.is_file() and reports.message() == "data.path x: no such folder"
    monkeypatch.delenv("RANK")
    rankerror.report(folder, UserError("again"))
    assert json.loads((folder / "error.json").read_text()) == {"message": "again", "rank": 0}


def test_a_folder_that_cannot_take_the_report_sends_it_to_the_spare(tmp_path, monkeypatch,
                                                                   capsys):
    (tmp_path / "file").write_text("")
    folder = tmp_path / "file" / "stage"  # a part of the path is a file: no folder there
    with rankerror.Reports(tmp_path / "other") as reports:
        monkeypatch.setenv(rankerror.SPARE, reports.env[rankerror.SPARE])
        rankerror.report(folder, UserError("bad item"))
        assert json.loads(reports.paths[1].read_text()) == {"message": "bad item", "rank": 0}
        assert reports.is_file() and reports.message() == "bad item"
    assert capsys.readouterr().err == ""
    monkeypatch.delenv(rankerror.SPARE)  # a rank on another node: no spare there
    with pytest.raises(NotADirectoryError):
        rankerror.report(folder, UserError("bad item"))
    assert capsys.readouterr().err == "ddpflow: error: bad item\n"


def test_an_earlier_runs_report_never_counts_and_a_damaged_one_is_skipped(tmp_path):
    (tmp_path / "error.json").write_text('{"message": "from before"}')
    with rankerror.Reports(tmp_path) as reports:
        assert not (tmp_path / "error.json").exists() and not reports.is_file()
        (tmp_path / "error.json").write_text('{"message": 7}')  # not a report
        reports.paths[1].write_text('{"message": "in the spare"}')
        assert reports.message() == "in the spare"
        (tmp_path / "error.json").write_text('{"message": "in the folder"}')
        assert reports.message() == "in the folder"  # the folder's first
        scratch = reports.paths[1].parent
        assert scratch.is_dir() and reports.env == {rankerror.SPARE: str(reports.paths[1])}
    assert not scratch.exists()


ONE_RANK = """
import sys
from pathlib import Path
from ddpflow.core.errors import OneRankError, UserError
from ddpflow.launch import rankerror
rankerror.ONE_RANK_WAIT_S = 600
err = OneRankError if sys.argv[2] == "one" else UserError
rankerror.report(Path(sys.argv[1]), err("a bad item in rank 1's share"))
"""


def test_a_mistake_one_rank_alone_found_waits_to_be_stopped(tmp_path):
    """Its peers wait in a collective with it: the launcher stops them all together."""
    runs = {kind: subprocess.Popen([sys.executable, "-c", ONE_RANK, str(tmp_path / kind), kind])
            for kind in ("one", "all")}
    try:
        assert runs["all"].wait(timeout=60) == 0  # a mistake every rank finds: it leaves
        while not (tmp_path / "one" / "error.json").is_file():
            assert runs["one"].poll() is None
            time.sleep(0.05)
        time.sleep(1.0)
        assert runs["one"].poll() is None  # reported, and waiting
    finally:
        runs["one"].kill()
        runs["one"].wait()


# ------------------------------------------------------------------ the roll call

def _listening() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def _closed_port() -> int:
    with socket.socket() as s:  # a port free a moment ago: nobody listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_node_is_named_as_slurm_names_it(monkeypatch):
    monkeypatch.setenv("SLURMD_NODENAME", "ddpn7")
    assert rollcall.node_name() == "ddpn7"
    monkeypatch.setenv("SLURMD_NODENAME", "")
    assert rollcall.node_name() == socket.gethostname()
    monkeypatch.delenv("SLURMD_NODENAME")
    assert rollcall.node_name() == socket.gethostname()


def test_the_rendezvous_host_is_this_node_by_its_name_or_an_address_here(monkeypatch):
    monkeypatch.setenv("SLURMD_NODENAME", "ddpn7")
    assert rollcall.is_host("ddpn7") is True  # its Slurm name (no address needed)
    assert rollcall.is_host("127.0.0.1") is True and rollcall.is_host("localhost") is True
    assert rollcall.is_host("192.0.2.1") is False  # an address of no interface here
    assert rollcall.is_host("no-such-host.invalid") is False
    assert rollcall.is_host("ddpn8") is False


def _within(fn, *args):
    """fn(*args), which returns in seconds: a call that does not within 30 s fails the test."""
    got = []
    t = threading.Thread(target=lambda: got.append(fn(*args)), daemon=True)
    t.start()
    t.join(timeout=30)
    assert got, f"{fn.__name__}{args} did not return in 30 s"
    return got[0]


def test_a_port_is_reachable_when_it_accepts_within_the_timeout():
    with _listening() as s:
        assert _within(rollcall.reachable, "127.0.0.1", s.getsockname()[1], 30.0) is True
    port = _closed_port()
    assert _within(rollcall.reachable, "127.0.0.1", port, 0.0) is False
    assert _within(rollcall.reachable, "127.0.0.1", port, 1.0) is False  # refused to the end
    # a port that opens a moment later (the host's torchrun still starting)
    late = socket.socket()
    late.bind(("127.0.0.1", 0))
    opener = threading.Timer(1.0, late.listen)
    opener.start()
    try:
        assert _within(rollcall.reachable, "127.0.0.1", late.getsockname()[1], 20.0) is True
    finally:
        opener.join()
        late.close()


def test_a_port_open_just_before_the_deadline_is_reached():
    with _listening() as s:
        assert _within(rollcall.reachable, "127.0.0.1", s.getsockname()[1], 0.5) is True


def test_a_host_that_does_not_answer_is_given_up_at_the_deadline():
    """A silent host (its connection queue full: the handshake is never answered): each try
    waits at most the time left, not its own two seconds."""
    with _listening() as s:
        s.listen(0)
        port = s.getsockname()[1]
        held = [socket.create_connection(("127.0.0.1", port), timeout=5)]
        try:
            t0 = time.monotonic()
            assert _within(rollcall.reachable, "127.0.0.1", port, 0.3) is False
            assert time.monotonic() - t0 < 1.9
        finally:
            for c in held:
                c.close()


def test_an_unprivileged_node_knows_an_address_of_its_own():
    """(binding a port below 1024 is a right root has and users lack)"""
    done = subprocess.run(["setpriv", "--bounding-set=-net_bind_service", sys.executable, "-c",
                           "from ddpflow.launch import rollcall; "
                           "print(rollcall.is_host('127.0.0.1'))"],
                          capture_output=True, text=True, timeout=30)
    assert done.stdout == "True\n", done.stderr


def test_a_node_waiting_for_the_host_sleeps_between_tries():
    """(it does not spin on a core of the node the job holds)"""
    node = subprocess.Popen([sys.executable, "-c", "from ddpflow.launch import rollcall; "
                             f"rollcall.reachable('127.0.0.1', {_closed_port()}, 60)"])
    try:
        time.sleep(0.5)
        states = []
        for _ in range(40):
            with open(f"/proc/{node.pid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
            time.sleep(0.025)
        assert node.poll() is None and states.count("S") > 30, states
    finally:
        node.kill()
        node.wait()


def test_the_roll_call_lists_who_answered_and_who_did_not(tmp_path, monkeypatch):
    folder = tmp_path / "run" / "nodes"
    assert rollcall.present(folder) == set()  # nobody yet: no folder
    assert rollcall.missing(folder, ["ddpn1", "ddpn2"]) == ["ddpn1", "ddpn2"]
    for node in ("ddpn2", "ddpn3"):
        monkeypatch.setenv("SLURMD_NODENAME", node)
        rollcall.answer(folder)
    assert (folder / "ddpn2").read_bytes() == b""
    (folder / ".ddpn1.tmp").write_bytes(b"")  # a write not finished: no answer
    assert rollcall.present(folder) == {"ddpn2", "ddpn3"}
    assert rollcall.missing(folder, ["ddpn4", "ddpn1", "ddpn2", "ddpn0"]) == [
        "ddpn4", "ddpn1", "ddpn0"]


def _rollcall(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddpflow.launch.rollcall", *map(str, args)],
                          capture_output=True, text=True, timeout=30,
                          env={**os.environ, "SLURMD_NODENAME": "ddpn1", **(env or {})})


SHOW = "import signal; print(signal.getsignal(signal.SIGUSR1).name)"


def test_a_node_answers_and_becomes_its_command(tmp_path):
    folder = tmp_path / "nodes"
    # the host itself: no wait for its own port (its torchrun opens it)
    done = _rollcall(folder, "ddpn1", _closed_port(), 0, "--", sys.executable, "-c", SHOW)
    assert (done.returncode, done.stdout, done.stderr) == (0, "SIG_IGN\n", "")
    assert rollcall.present(folder) == {"ddpn1"}
    # another node: it answers once the host's port accepts
    with _listening() as s:
        done = _rollcall(folder, "127.0.0.1", s.getsockname()[1], 30, "--", sys.executable,
                         "-c", SHOW, env={"SLURMD_NODENAME": "ddpn2"})
    assert (done.returncode, done.stdout) == (0, "SIG_IGN\n"), done.stderr
    assert rollcall.present(folder) == {"ddpn1", "ddpn2"}


def test_a_node_that_cannot_reach_the_host_leaves_at_once_without_answering(tmp_path):
    port = _closed_port()
    done = _rollcall(tmp_path / "nodes", "192.0.2.1", port, 1.4, "--", "true")
    assert (done.returncode, done.stdout) == (rollcall.EXIT_UNREACHED, "")
    assert done.stderr == (f"ddpflow: node ddpn1 could not reach the rendezvous at "
                           f"192.0.2.1:{port} within 1 s\n")
    assert not (tmp_path / "nodes").exists()


@pytest.mark.parametrize("args", [["f", "h", "1", "5", "--"], ["f", "h", "1", "5", "true", "x"],
                                  []])
def test_a_roll_call_without_its_arguments_says_how_to_call_it(args, capsys):
    assert rollcall.main(args) == 2
    assert capsys.readouterr().err == ("usage: python -m ddpflow.launch.rollcall FOLDER HOST "
                                       "PORT TIMEOUT_S -- COMMAND...\n")


# ------------------------------------------------------------------ torchrun's processes

RANK = """
import os, signal, subprocess, sys, time
out, i = sys.argv[1], sys.argv[2]
def note(what):
    with open(os.path.join(out, "log"), "a") as f:
        f.write(what + "\\n")
def stop(signum, _frame):  # a rank checkpoints at its next check, then leaves with 0
    note(f"rank{i} {signal.Signals(signum).name}")
    time.sleep(1.0)
    worker.kill()
    os._exit(0)
if i != "bystander":
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGUSR1, stop)
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
with open(os.path.join(out, f"rank{i}.pids.tmp"), "w") as f:
    f.write(f"{os.getpid()} {worker.pid} {os.environ.get('FROM_LAUNCHER')}")
os.rename(os.path.join(out, f"rank{i}.pids.tmp"), os.path.join(out, f"rank{i}.pids"))
if sys.argv[3:4] == ["crash"]:  # a rank that fails when told to stop: torchrun restarts it
    signal.signal(signal.SIGTERM, lambda *_: (worker.kill(), os._exit(1)))
while True:
    time.sleep(1)
"""

TORCHRUN = """
import os, signal, subprocess, sys, time
out, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
rest = sys.argv[4:]
def note(what):
    with open(os.path.join(out, "log"), "a") as f:
        f.write(what + "\\n")
told = []
def on_signal(signum, _frame):
    note(f"torchrun {signal.Signals(signum).name}")
    told.append(signum)
    if mode == "norank" or (mode == "srun" and len(told) == 2):
        os._exit(7)
for s in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(s, on_signal)
def rank(i, *extra):
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL} if i == "bystander" \
        else {}
    return subprocess.Popen([sys.executable, os.path.join(out, "rank.py"), out, str(i), *extra],
                            start_new_session=True, **quiet)
ranks = [rank(i, *(["crash"] if mode == "restart" and i == 0 else []), *rest)
         for i in range(n)]
if mode == "orphans":
    ranks.append(rank("bystander"))
with open(os.path.join(out, "torchrun.pid"), "w") as f:
    f.write(str(os.getpid()))
while mode in ("norank", "srun"):  # until a signal ends it
    time.sleep(1)
restarted = False
while ranks:
    for r in list(ranks):
        if r.poll() is None:
            continue
        ranks.remove(r)
        if r.returncode != 0 and not restarted:
            restarted = True
            ranks.append(rank("again"))
    time.sleep(0.05)
time.sleep(1.5)  # its own shutdown, after the ranks left
note("torchrun done")
"""

LAUNCHER = """
import json, os, signal, sys
from pathlib import Path
from ddpflow.launch import procs
cmd, watch, kill_file = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
class Hang:  # hangreport.HangWatch: past its deadline it names the pids to kill
    def poll(self, kill):
        if os.path.exists(kill_file):
            for pid in Path(kill_file).read_text().split():
                kill(int(pid))
class Early:  # a stop signal that arrives while torchrun is being started
    @property
    def pipe(self):
        os.kill(os.getpid(), signal.SIGTERM)
        return None
rc, sig = procs.run_torchrun(cmd, {"FROM_LAUNCHER": "yes"}, Path(watch) if watch else None,
                             agent=Early() if sys.argv[4:] == ["early"] else None, hang=Hang())
print(json.dumps([rc, sig]), flush=True)
"""


class Fake:
    """A launcher (run_torchrun in a process of its own) running a fake torchrun: each rank in
    a session of its own, with a worker; every signal a rank or torchrun gets noted in `log`."""

    def __init__(self, tmp_path: Path, mode: str = "ranks", n: int = 2, watch: Path | None = None,
                 first: str | None = None, extra: tuple = (), early: bool = False):
        self.out = tmp_path / "fake"
        self.out.mkdir()
        (self.out / "rank.py").write_text(RANK)
        (self.out / "torchrun.py").write_text(TORCHRUN)
        bin_ = self.out / "bin"  # srun: torchrun's stand-in under srun's name
        bin_.mkdir()
        (bin_ / "srun").write_text(f"#!{sys.executable}\n{TORCHRUN}")
        (bin_ / "srun").chmod(0o755)
        self.kill_file = self.out / "kill"
        cmd = [first or sys.executable, *([] if first else [str(self.out / "torchrun.py")]),
               str(self.out), mode, str(n), *extra]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", LAUNCHER, json.dumps(cmd), str(watch or ""),
             str(self.kill_file), *(["early"] if early else [])], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}"})
        self.n = n

    def wait_for(self, *names: str) -> None:
        for _ in range(600):  # (a second or two normally: a hang fails in 30 s)
            if all((self.out / name).exists() for name in names):
                return
            assert self.proc.poll() is None, self.proc.communicate()
            time.sleep(0.05)
        raise AssertionError(f"no {names} in 30 s")

    def ranks(self, *names) -> dict[str, list[int]]:
        """{rank: [pid, worker pid]} once every rank has started."""
        names = names or tuple(map(str, range(self.n)))
        self.wait_for(*(f"rank{i}.pids" for i in names))
        got = {i: (self.out / f"rank{i}.pids").read_text().split() for i in names}
        assert all(v[2] == "yes" for v in got.values())  # the launcher's env reached them
        return {i: [int(v[0]), int(v[1])] for i, v in got.items()}

    def result(self) -> tuple[list, list[str]]:
        out, err = self.proc.communicate(timeout=30)  # (seconds normally: a hang fails)
        assert self.proc.returncode == 0, err
        return json.loads(out), sorted(self.log())

    def log(self) -> list[str]:
        p = self.out / "log"
        return p.read_text().splitlines() if p.exists() else []

    def end(self) -> None:
        """The launcher killed, and whatever it left (a test that failed: nothing else)."""
        self.proc.kill()
        self.proc.wait()
        for f in [*self.out.glob("rank*.pids"), self.out / "torchrun.pid"]:
            for pid in map(int, f.read_text().split()[:2] if f.exists() else []):
                try:  # still one of this test's processes (never a pid reused since)
                    with open(f"/proc/{pid}/cmdline", "rb") as c:
                        line = c.read()
                except OSError:
                    continue
                if line.startswith(sys.executable.encode()) and (
                        str(self.out).encode() in line or b"time.sleep(600)" in line):
                    _reap_all([pid])


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def _reap_all(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("sig, told", [(signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "SIGTERM"),
                                       (signal.SIGUSR1, "SIGUSR1")])
def test_a_stop_signal_goes_to_the_ranks_once_and_torchrun_ends_by_itself(tmp_path, sig, told):
    fake = Fake(tmp_path)
    try:
        pids = fake.ranks()
        fake.proc.send_signal(sig)
        assert fake.result() == ([0, sig.name], ["rank0 " + told, "rank1 " + told,
                                                 "torchrun done"])
        assert not any(_alive(p) for v in pids.values() for p in v[:1])
    finally:
        fake.end()


def test_a_rank_torchrun_restarts_after_the_signal_is_told_too(tmp_path):
    fake = Fake(tmp_path, "restart")
    try:
        fake.ranks()
        fake.proc.send_signal(signal.SIGTERM)
        fake.ranks("again")
        assert fake.result() == ([0, "SIGTERM"], ["rank1 SIGTERM", "rankagain SIGTERM",
                                                  "torchrun done"])
    finally:
        fake.end()


def test_a_signal_before_any_rank_stops_torchrun_itself(tmp_path):
    fake = Fake(tmp_path, "norank", n=0)
    try:
        fake.wait_for("torchrun.pid")
        fake.proc.send_signal(signal.SIGTERM)
        assert fake.result() == ([7, "SIGTERM"], ["torchrun SIGTERM"])
    finally:
        fake.end()


def test_a_signal_while_torchrun_starts_is_relayed_once_it_has(tmp_path):
    fake = Fake(tmp_path, "norank", n=0, early=True)
    try:  # (torchrun ends of it, whether or not it has its handler yet)
        assert fake.result() in [([7, "SIGTERM"], ["torchrun SIGTERM"]),
                                 ([-signal.SIGTERM, "SIGTERM"], [])]
    finally:
        fake.end()


def test_a_ranks_mistake_stops_every_rank_and_its_workers(tmp_path):
    watch = tmp_path / "stage" / "error.json"
    fake = Fake(tmp_path, watch=watch)
    try:
        pids = fake.ranks()
        assert fake.proc.poll() is None
        watch.parent.mkdir()
        watch.write_text('{"message": "bad item"}')  # a rank reported; its peers wait
        assert fake.result() == ([-signal.SIGKILL, None], [])
        assert not any(_alive(p) for v in pids.values() for p in v)
    finally:
        fake.end()


def test_past_a_hangs_deadline_only_torchruns_ranks_are_killed(tmp_path):
    fake = Fake(tmp_path)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        pids = fake.ranks()
        fake.kill_file.write_text(f"{pids['0'][0]} {other.pid}")
        for _ in range(600):  # (its next look: half a second; a hang fails in 30 s)
            if not _alive(pids["0"][0]):
                break
            time.sleep(0.05)
        assert not _alive(pids["0"][0])
        assert not _alive(pids["0"][1]) and _alive(other.pid)  # its worker too; no stranger
        fake.ranks("again")  # (torchrun restarted it)
        fake.proc.send_signal(signal.SIGTERM)
        assert fake.result() == ([0, "SIGTERM"], ["rank1 SIGTERM", "rankagain SIGTERM",
                                                  "torchrun done"])
    finally:
        fake.end()
        other.kill()
        other.wait()


def test_ranks_left_by_a_killed_torchrun_are_stopped_by_the_launcher(tmp_path):
    marker = str(tmp_path / "run" / "config.json")
    fake = Fake(tmp_path, "orphans", extra=("--resolved", marker))
    try:
        pids = fake.ranks()
        bystander = fake.ranks("bystander")["bystander"]
        os.kill(int((fake.out / "torchrun.pid").read_text()), signal.SIGKILL)
        assert fake.result() == ([-signal.SIGKILL, None], [])
        assert not any(_alive(p) for v in pids.values() for p in v)
        assert _alive(bystander[0])  # a process without the run's config is not the run's
    finally:
        fake.end()
        _reap_all(bystander)


def test_several_nodes_are_told_through_srun_and_again_for_ranks_still_starting(tmp_path):
    """srun hands SIGUSR1 to every process of its step (the ranks on the nodes are no
    children here); it is sent again a few seconds later, and never as SIGTERM."""
    fake = Fake(tmp_path, "srun", n=0, first="srun")
    try:
        fake.wait_for("torchrun.pid")
        fake.proc.send_signal(signal.SIGTERM)
        assert fake.result() == ([7, "SIGTERM"], ["torchrun SIGUSR1", "torchrun SIGUSR1"])
    finally:
        fake.end()


AGENT = """
import json, sys
from pathlib import Path
from ddpflow.launch import procs
cmd = json.loads(sys.argv[1])
with procs.WarmAgent() as agent:
    rc, sig = procs.run_torchrun(cmd, {"FROM_LAUNCHER": "yes"}, agent=agent)
    print(json.dumps([rc, sig, agent.pipe is None]), flush=True)
"""


def test_a_warm_agent_runs_torchrun_when_the_command_is_torchrun(tmp_path):
    out = tmp_path / "rank0.txt"
    rank = ["--no-python", "sh", "-c", f'echo "$RANK $FROM_LAUNCHER" > {out}']
    torchrun = [*procs.TORCHRUN, "--nnodes=1", "--nproc-per-node=1", "--rdzv-backend=c10d",
                "--rdzv-endpoint=127.0.0.1:0", *rank]
    done = subprocess.run([sys.executable, "-c", AGENT, json.dumps(torchrun)],
                          capture_output=True, text=True, timeout=300)
    assert json.loads(done.stdout) == [0, None, True], done.stderr  # the agent ran it
    assert out.read_text() == "0 yes\n"
    # another command (srun's step, say): run as it is; the agent is left unused
    done = subprocess.run([sys.executable, "-c", AGENT, json.dumps(
        ["sh", "-c", f'echo "$FROM_LAUNCHER" > {out}; exit 3'])], capture_output=True,
        text=True, timeout=300)
    assert json.loads(done.stdout) == [3, None, False], done.stderr
    assert out.read_text() == "yes\n"


def _pipes() -> set[str]:
    """The pipes this process holds open (by descriptor)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:"):
                found.add(fd)
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return found


def test_a_warm_agent_cancelled_ends_having_started_nothing():
    before = _pipes()
    agent = procs.WarmAgent()
    assert _pipes() - before == {str(agent.pipe)}  # the launcher keeps the writing end alone
    with agent as entered:
        assert entered is agent and agent.proc.poll() is None
    # killed at once (not left to finish importing torch), and nothing left open here
    assert agent.pipe is None and agent.proc.returncode == -signal.SIGKILL
    assert _pipes() - before == set()
    agent.cancel()  # twice: nothing more to do
    procs._kill_group(agent.proc)  # its group is gone: nothing to kill
    procs._stop_all(agent.proc)


@pytest.mark.parametrize("engine, inside, dry, nodes, warm", [
    ("none", None, False, 1, True), ("none", None, True, 1, False),
    ("none", None, False, 2, False), ("docker", None, False, 1, False),
    ("docker", "docker:img", False, 1, True)])
def test_the_agent_is_started_ahead_only_where_this_process_runs_torchrun(
        tmp_path, monkeypatch, engine, inside, dry, nodes, warm):
    from ddpflow.launch.container import IN_CONTAINER

    if inside:
        monkeypatch.setenv(IN_CONTAINER, inside)
    else:
        monkeypatch.delenv(IN_CONTAINER, raising=False)
    cfg = from_dict(tiny_config(tmp_path, container={"engine": engine},
                                hardware={"nodes": nodes}))
    with procs.warm_agent(cfg, dry) as agent:
        assert isinstance(agent, procs.WarmAgent) if warm else agent is None


CHILDREN = """
import os, subprocess, sys
odd = subprocess.Popen([sys.argv[1], "600"])  # its name holds ") " (/proc/PID/stat's comm)
mid = subprocess.Popen(["sh", "-c", "sleep 600 & wait"], start_new_session=True)
print(odd.pid, mid.pid, flush=True)
sys.stdin.read()
odd.kill()
os.killpg(mid.pid, 9)  # with its child
"""


def test_the_children_of_a_process_are_read_from_proc(tmp_path, monkeypatch):
    import shutil

    odd = tmp_path / "r) 1 2 3"
    odd.symlink_to(shutil.which("sleep"))
    parent = subprocess.Popen([sys.executable, "-c", CHILDREN, str(odd)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        kids = sorted(map(int, parent.stdout.readline().split()))
        assert sorted(procs._children(parent.pid)) == kids  # not the grandchild
        assert os.getpid() in procs._children(os.getppid())
        # a process that ended between the listing and its reading is left out
        listdir = os.listdir
        monkeypatch.setattr(os, "listdir", lambda p: ["999999999", *listdir(p)])
        assert sorted(procs._children(parent.pid)) == kids
    finally:
        parent.stdin.close()
        parent.wait()


def test_a_rank_is_killed_with_its_session_or_alone(tmp_path):
    leader = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; p = "
                               "subprocess.Popen(['sleep', '600']); print(p.pid, flush=True); "
                               "time.sleep(600)"], start_new_session=True,
                              stdout=subprocess.PIPE, text=True)
    worker = int(leader.stdout.readline())
    alone = subprocess.Popen(["sleep", "600"])  # leads no session (nor group)
    procs._kill_session(leader.pid)
    procs._kill_session(alone.pid)
    assert leader.wait(timeout=60) == -signal.SIGKILL and alone.wait(timeout=60) == -9
    for _ in range(600):  # its worker too (orphaned, then reaped by init)
        if not _alive(worker):
            break
        time.sleep(0.05)
    assert not _alive(worker)
    procs._kill_session(alone.pid)  # gone already: nothing to do


ORPHANS = """
import json, os, signal, subprocess, sys, time
from ddpflow.launch import procs
marker, mode = sys.argv[1], sys.argv[2]
if mode == "adopt":
    procs._adopt_orphans()
if mode == "autoreap":
    procs._adopt_orphans()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children reaped by the kernel
# a torchrun that starts two ranks in sessions of their own (one of this run, one not) and
# dies: its ranks are orphans
ranks = subprocess.run([sys.executable, "-c", '''
import subprocess, sys
for m in (sys.argv[1], "another-run"):
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", m],
                         start_new_session=True, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    print(p.pid)
''', marker], capture_output=True, text=True).stdout.split()
ours, theirs = map(int, ranks)
print(ours, theirs, flush=True)
adopted = sorted(procs._children(os.getpid()))
procs._stop_orphans(marker)
def state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
print(json.dumps([adopted == sorted([ours, theirs]), state(ours), state(theirs) != "gone"]))
"""


@pytest.mark.parametrize("mode, want", [("adopt", [True, "gone", True]),
                                        ("autoreap", [True, "gone", True]),
                                        ("none", [False, "gone", True])])
def test_the_ranks_a_dead_torchrun_left_are_adopted_and_stopped(tmp_path, mode, want):
    marker = str(tmp_path / "run" / "config.json")
    done = subprocess.run([sys.executable, "-c", ORPHANS, marker, mode], capture_output=True,
                          text=True, timeout=30)
    pids, got = done.stdout.splitlines()[0], json.loads(done.stdout.splitlines()[1])
    _reap_all(map(int, pids.split()))  # (not children of this process: no zombies)
    if mode == "none":  # not adopted: the launcher cannot see them (init's children now)
        assert got[0] is False, done.stderr
        return
    assert got == want, done.stderr


SETUP = """
import ctypes, os, signal
sig = ctypes.c_int()
ctypes.CDLL("libc.so.6").prctl(2, ctypes.byref(sig))  # PR_GET_PDEATHSIG
print(os.getpgid(0) == os.getpid(), signal.getsignal(signal.SIGUSR1).name,
      signal.getsignal(signal.SIGINT).name, sig.value)
"""


def test_torchrun_runs_in_a_group_of_its_own_ignoring_usr1_and_int(monkeypatch):
    def run():
        return subprocess.run([sys.executable, "-c", SETUP], capture_output=True, text=True,
                              preexec_fn=procs._child_setup, timeout=60).stdout.split()

    assert run() == ["True", "SIG_IGN", "SIG_IGN", str(int(signal.SIGTERM))]
    import ctypes

    def no_libc(*_a, **_k):
        raise OSError("libc.so.6: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_libc)  # a C library without that name (musl)
    assert run() == ["True", "SIG_IGN", "SIG_IGN", "0"]  # all but the death signal
    procs._adopt_orphans()  # nothing to do without it


# ------------------------------------------------------------------ container engines

def test_the_engine_addresses_tried_in_order(monkeypatch):
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert container._sockets("docker") == ["unix:///var/run/docker.sock"]
    assert container._sockets("podman") == ["unix:///run/user/1000/podman/podman.sock",
                                            "unix:///run/podman/podman.sock"]
    monkeypatch.setenv("XDG_RUNTIME_DIR", "")
    assert container._sockets("podman") == ["unix:///run/podman/podman.sock"]
    monkeypatch.setenv("DOCKER_HOST", "tcp://10.0.0.5:2375")
    assert container._sockets("podman") == ["tcp://10.0.0.5:2375"]  # the user's, alone


def test_an_engine_that_does_not_answer_says_why_and_what_to_do(tmp_path, monkeypatch):
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    monkeypatch.setenv("PATH", str(bin_))  # neither engine installed
    gone = f"unix://{tmp_path}/gone.sock"
    start = "start it with `dockerd &` (or `systemctl start docker`)"
    assert str(container._unreachable("docker", [gone], None)) == (
        f"container.engine is 'docker', but the docker engine at {gone} does not answer: "
        f"the socket does not exist; install it (apt-get install docker.io), then {start}, "
        f"or set container.engine: none to run the stages in the host environment")
    two = [gone, f"unix://{tmp_path}/also.sock"]
    assert str(container._unreachable("podman", two, None)).startswith(
        f"container.engine is 'podman', but the podman engine at {two[0]} or {two[1]} does "
        f"not answer: none of these sockets exists; install it (apt-get install podman), then "
        f"start its API with `podman system service --time=0 &`, or set")
    (bin_ / "docker").write_text("#!/bin/sh\n")
    (bin_ / "docker").chmod(0o755)  # installed: only to start
    (tmp_path / "here.sock").write_text("")
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/here.sock")
    err = ConnectionError("Connection aborted.\nsecond line " + "x" * 300)
    assert str(container._unreachable("docker", [f"unix://{tmp_path}/here.sock"], err)) == (
        f"container.engine is 'docker', but the docker engine at unix://{tmp_path}/here.sock "
        f"(from DOCKER_HOST) does not answer: ConnectionError: Connection aborted.; {start}, "
        f"or set container.engine: none to run the stages in the host environment")
    long = ConnectionError("y" * 300)
    assert f"ConnectionError: {'y' * 160};" in str(
        container._unreachable("docker", ["tcp://10.0.0.5:2375"], long))
    assert "does not answer: OSError: ; start" in str(
        container._unreachable("docker", ["tcp://10.0.0.5:2375"], OSError()))


def test_the_docker_engine_answers_at_its_socket(monkeypatch):
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    c = container.client("docker")
    assert c.ping() is True and c.api.base_url == "http+docker://localhost"


def test_podman_is_reached_at_the_first_of_its_sockets_that_exists(tmp_path, monkeypatch):
    """(the Docker engine's socket stands in for podman's: both answer the Docker API)"""
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    (tmp_path / "podman").mkdir()
    (tmp_path / "podman" / "podman.sock").symlink_to("/var/run/docker.sock")
    monkeypatch.setattr(container, "PODMAN_SOCKETS", (str(tmp_path / "none.sock"),))
    c = container.client("podman")
    assert c.ping() is True
    # a socket that exists but where nothing answers: the error named, one message
    (tmp_path / "podman" / "podman.sock").unlink()
    (tmp_path / "podman" / "podman.sock").write_text("")
    text = _refusal(container.client, "podman")
    assert text.startswith(f"container.engine is 'podman', but the podman engine at "
                           f"unix://{tmp_path}/podman/podman.sock does not answer: "
                           f"DockerException: Error while fetching server API version: "), text
    assert "\n" not in text


def _fake_torch(tmp_path, monkeypatch, version_py: str | None):
    pkg = tmp_path / "site" / "torch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    if version_py is not None:
        (pkg / "version.py").write_text(version_py)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))


def test_the_torch_version_is_read_without_importing_torch(tmp_path, monkeypatch):
    import importlib.metadata

    installed = importlib.metadata.version("torch")
    _fake_torch(tmp_path, monkeypatch, "git_version = 'abc'\n__version__ = '2.14.1+cu130'\n")
    assert container.torch_version() == "2.14.1+cu130"
    (tmp_path / "site" / "torch" / "version.py").write_text("__version__ = x\n")
    assert container.torch_version() == installed  # unreadable: the installed package's
    (tmp_path / "site" / "torch" / "version.py").unlink()
    assert container.torch_version() == installed
    monkeypatch.setitem(sys.modules, "torch", None)  # no torch at all
    assert container.torch_version() is None


def test_without_an_engine_the_image_record_is_the_host_environment(tmp_path):
    import platform

    from ddpflow import __version__

    cfg = from_dict(tiny_config(tmp_path, container={"engine": "none", "image": "ddpflow:x"}))
    out = tmp_path / "run" / "image.json"
    out.parent.mkdir()
    rec = container.build(cfg, tmp_path, out)
    assert rec == json.loads(out.read_text()) == {
        "engine": "none", "tag": "ddpflow:x", "package_version": __version__,
        "image_id": None, "note": "stages run in the host environment",
        "python": platform.python_version(), "torch": container.torch_version()}


def test_the_mounts_are_the_outermost_folders_a_stage_needs(tmp_path, monkeypatch):
    work = tmp_path / "work"
    for d in ("work/results", "data/sub", "code", "w", "lone"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "data" / "sub" / "x.npz").write_text("")
    (tmp_path / "w" / "m.pt").write_text("")
    monkeypatch.chdir(work)
    cfg = from_dict(tiny_config(tmp_path, results_dir="results", data={
        "path": str(tmp_path / "data" / "sub" / "x.npz"), "code_dir": str(work / "results")},
        model={"code_dir": str(tmp_path / "code"), "weights": str(tmp_path / "w" / "m.pt")}))
    assert sorted(container._mounts(cfg)) == [tmp_path / "code", tmp_path / "data" / "sub",
                                              tmp_path / "w", work]  # results: in work
    cfg = from_dict(tiny_config(tmp_path, results_dir=str(tmp_path / "lone"), data={
        "path": str(tmp_path / "data")}, model={"weights": "resnet18.IMAGENET1K_V1"}))
    assert sorted(container._mounts(cfg)) == [tmp_path / "data", tmp_path / "lone", work]


def test_the_container_runs_as_the_caller_with_a_home_and_a_kernel_cache(tmp_path,
                                                                       monkeypatch):
    cfg = from_dict(tiny_config(tmp_path))
    cache = str((cfg.run_dir / "cache" / "inductor").resolve())
    monkeypatch.setenv("USER", "ada")
    monkeypatch.setenv("LOGNAME", "lovelace")
    assert container._caller_env(cfg) == {"HOME": "/tmp", "USER": "ada", "LOGNAME": "ada",
                                          "TORCHINDUCTOR_CACHE_DIR": cache}
    monkeypatch.delenv("USER")
    assert container._caller_env(cfg)["USER"] == "lovelace"
    monkeypatch.delenv("LOGNAME")
    assert container._caller_env(cfg)["LOGNAME"] == "ddpflow"


def test_a_narrowed_launcher_hands_its_cores_to_the_container(affinity):
    if len(affinity) == os.cpu_count():
        assert container._cpuset() is None  # all of them: no cpuset
    os.sched_setaffinity(0, affinity[-1:])
    assert container._cpuset() == str(affinity[-1])


# the image: a Debian root file system (tests/setup/docker.sh) whose entry point shows what a
# stage's container gets, and exits 5
DOCKERFILE = """FROM ddpflow-test-root:bookworm
ARG VERSION
ARG REVISION
ARG REQUIRE_CUDA
ARG BASE_IMAGE=unset
LABEL unit.version=$VERSION unit.require_cuda=$REQUIRE_CUDA unit.base=$BASE_IMAGE
ENTRYPOINT ["/bin/sh", "-c", "echo \\"argv $*\\"; echo \\"env $DDPFLOW_IN_CONTAINER $USER \
$LOGNAME $HOME $TORCHINDUCTOR_CACHE_DIR $DDPFLOW_LAUNCH_T0\\"; echo \\"as $(id -u):$(id -g) \
in $(pwd)\\"; ls -d \\"${4%/*}\\"; exit 5", "sh"]
"""


@pytest.fixture
def image_cfg(tmp_path, monkeypatch):
    """A config whose docker image (tagged for this test, removed after) is built from
    DOCKERFILE in tmp_path/context."""
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    monkeypatch.delenv(IN_CONTAINER, raising=False)
    context = tmp_path / "context"
    context.mkdir()
    (context / "Dockerfile").write_text(DOCKERFILE)
    tag = f"ddpflow-launch-unit:{os.getpid()}-{tmp_path.name[-12:].lower()}"
    yield from_dict(tiny_config(tmp_path, container={"engine": "docker", "image": tag})), context
    try:
        container.client("docker").images.remove(tag, force=True)
    except Exception:  # noqa: BLE001 - never built
        pass


def test_an_image_is_built_from_the_dockerfile_and_recorded(image_cfg, tmp_path, capsys):
    from ddpflow import __version__

    cfg, context = image_cfg
    out = tmp_path / "run" / "image.json"
    out.parent.mkdir()
    rec = container.build(cfg, context, out)
    assert rec == json.loads(out.read_text())
    c = container.client("docker")
    image = c.images.get(cfg.container.image)
    version = c.version()
    assert {k: rec[k] for k in ("engine", "tag", "package_version", "image_id", "revision",
                                "build_args", "labels", "size_bytes", "engine_version",
                                "engine_api", "digest")} == {
        "engine": "docker", "tag": cfg.container.image, "package_version": __version__,
        "image_id": image.id, "revision": "unknown",  # (the context is no git checkout)
        "build_args": {"VERSION": __version__, "REVISION": "unknown", "REQUIRE_CUDA": "0"},
        "labels": image.labels, "size_bytes": image.attrs["Size"],
        "engine_version": version["Version"], "engine_api": version["ApiVersion"],
        "digest": None}
    assert image.labels["unit.version"] == __version__ and image.labels["unit.base"] == "unset"
    assert rec["build_time_s"] >= 0
    assert "Step 1/7 : FROM ddpflow-test-root:bookworm" in capsys.readouterr().out


def test_a_base_image_is_handed_to_the_build(image_cfg, tmp_path):
    cfg, context = image_cfg
    cfg = from_dict({**cfg.to_dict(), "container": {**cfg.to_dict()["container"],
                                                    "base_image": "org/base:1.0"}})
    rec = container.build(cfg, context, tmp_path / "image.json")
    assert rec["build_args"]["BASE_IMAGE"] == "org/base:1.0"
    assert rec["labels"]["unit.base"] == "org/base:1.0"


def test_a_failed_build_is_one_message(image_cfg, tmp_path):
    cfg, context = image_cfg
    (context / "Dockerfile").write_text("FROM ddpflow-test-root:bookworm\nRUN exit 3\n")
    out = tmp_path / "image.json"
    assert _refusal(container.build, cfg, context, out) == (
        "image build failed: The command '/bin/sh -c exit 3' returned a non-zero code: 3")
    assert not out.exists()


def test_a_stage_runs_in_the_image_as_the_caller_with_its_folders(image_cfg, tmp_path,
                                                                  monkeypatch, capfd):
    cfg, context = image_cfg
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("USER", "ada")
    cfg.run_dir.mkdir(parents=True)
    image_id = container.build(cfg, context, cfg.run_dir / "image.json")["image_id"]
    capfd.readouterr()
    resolved = cfg.run_dir / "config.json"
    before = signal.getsignal(signal.SIGTERM)
    rc = container.run_stage(cfg, resolved, "s1", ["--halt-after-steps", "2"], t0=1234.5)
    assert rc == 5 and signal.getsignal(signal.SIGTERM) is before
    err = capfd.readouterr().err.splitlines()
    cache = cfg.run_dir.resolve() / "cache" / "inductor"
    assert err == [
        f"ddpflow: running in docker image {image_id[:19]} (0 GPU(s), shm 16g)",
        f"argv ddpflow launch --config {resolved.resolve()} --stage s1 --halt-after-steps 2",
        f"env docker:{image_id} ada ada /tmp {cache} 1234.500000",
        f"as {os.getuid()}:{os.getgid()} in {tmp_path}",
        str(resolved.resolve().parent)], err  # the run folder, mounted
    assert not container.client("docker").containers.list(
        all=True, filters={"ancestor": image_id})  # removed


def test_a_child_whose_command_line_cannot_be_read_is_left_alone(tmp_path, monkeypatch):
    marker = str(tmp_path / "run" / "config.json")
    kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", marker])
            for _ in range(2)]
    try:
        gone = f"/proc/{kids[0].pid}/cmdline"

        def reading(path, *a, **k):  # kids[0] ended between the listing and the reading
            if path == gone:
                raise FileNotFoundError(2, "No such file or directory", path)
            return open(path, *a, **k)

        monkeypatch.setattr(procs, "open", reading, raising=False)
        stopping = threading.Thread(target=procs._stop_orphans, args=(marker,), daemon=True)
        stopping.start()
        stopping.join(timeout=30)  # (a second normally: it would wait on a child not killed)
        assert not stopping.is_alive()
        assert kids[0].poll() is None and not _alive(kids[1].pid)  # killed and reaped
    finally:
        _reap_all(k.pid for k in kids)
        kids[0].wait()
