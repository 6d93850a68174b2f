"""A run that goes wrong on several ranks says who and where (issue 48): the rank that did
not arrive at a collective, its host and every rank's last step, every rank's stack in the
log; the straggler that holds every step back, with its host and the reason. Real torchrun,
2 gloo ranks, a user dataset and model that block or slow one rank on purpose."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import REPO, ddpflow, tiny_config, write_config
from ddpflow.core.writing import write_json_atomic
from ddpflow.engine import hang, heartbeat, stopflag, stragglers
from ddpflow.launch import hangreport

BATCH = 8
# a user dataset: rank 1 blocks in __getitem__ on its call `block_at` (in batch 5: the
# probes of the seam contract read a few items first), in a function of the user's own;
# `slow_rank` sleeps `item_s` per item (a data straggler); Model sleeps `forward_s` per
# forward on `slow_rank` (a compute straggler)
USERCODE = '''
import os
import threading
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset


def stuck_in_user_getitem(mark):
    Path(mark).write_text(repr(time.time()))
    threading.Event().wait()  # never set: blocked in user code


class Items(Dataset):
    def __init__(self, n, seed, block_at, mark, slow_rank, item_s):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.rand(n, 3, 8, 8, generator=g)
        self.y = torch.randint(0, 4, (n,), generator=g)
        self.block_at, self.mark, self.calls = block_at, mark, 0
        self.slow = os.environ.get("RANK") == str(slow_rank)
        self.item_s = item_s
        self.num_classes = 4

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        self.calls += 1
        if self.block_at and os.environ.get("RANK") == "1" and self.calls == self.block_at:
            stuck_in_user_getitem(self.mark)
        if self.slow and self.item_s:
            time.sleep(self.item_s)
        return self.x[i], self.y[i]


def make(split, n=512, block_at=0, mark="", slow_rank=-1, item_s=0.0):
    if split == "test":
        return None
    return Items(n if split == "train" else 64, 0 if split == "train" else 1,
                 block_at if split == "train" else 0, mark, slow_rank, item_s)


class Model(nn.Module):
    def __init__(self, num_classes, in_channels=3, slow_rank=-1, forward_s=0.0):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, num_classes))
        self.sleep = forward_s if os.environ.get("RANK") == str(slow_rank) else 0.0

    def forward(self, x):
        if self.sleep:
            time.sleep(self.sleep)
        return self.net(x)
'''


def user_run(root: Path, data_kwargs: dict, model_kwargs: dict | None = None,
             hardware: dict | None = None, workers: int = 0, **extra) -> Path:
    code = root / "code"
    code.mkdir(parents=True)
    (code / "usercode.py").write_text(USERCODE)
    cfg = tiny_config(
        root, log_every_steps=2,
        data={"source": "python", "factory": "usercode:make", "kwargs": data_kwargs,
              "code_dir": str(code), "num_workers": workers},
        model={"name": "usercode:Model", "code_dir": str(code), "kwargs": model_kwargs or {}},
        checkpoint={"every_steps": 0},
        hardware={"nproc_per_node": 2, "threads_per_rank": 1, "max_restarts": 0,
                  **(hardware or {})},
        stages=[{"name": "s1", "max_steps": 40, "batch_size": BATCH, "lr": 0.05}], **extra)
    p = write_config(root, cfg)
    ddpflow("prepare", "--config", p, check=True)
    return p


def stage(root: Path) -> Path:
    return root / "results" / "t" / "stages" / "s1"


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1])
def test_a_rank_blocked_in_user_code_is_named_with_its_step_and_stack(tmp_path, workers):
    """Rank 1 blocks in the user's __getitem__ for step 5 (in the rank itself, or in its
    DataLoader worker: a data loader that blocks): the job ends non-zero before the
    launcher's own deadline (timeout_s + HANG_MARGIN_S after the hang began, from the run's
    own events), the error line names rank 1, its host and step 4, and rank 1's stack in
    the log shows the user's function."""
    mark = tmp_path / "blocked_at"
    timeout_s = 10
    p = user_run(tmp_path, {"block_at": 4 * BATCH + 5, "mark": str(mark)},
                 hardware={"timeout_s": timeout_s}, workers=workers)
    proc = ddpflow("launch", "--config", p, "--stage", "s1")
    err = proc.stderr
    assert proc.returncode not in (0, 75), err[-3000:]
    line = [x for x in err.splitlines() if x.startswith("ddpflow: error: stage 's1' failed")]
    assert line, err[-3000:]
    host = os.uname().nodename
    assert f"rank 1 (host {host}: alive, stuck where its stack shows) did not arrive" in line[0]
    assert "rank 0 at step 4, rank 1 at step 4" in line[0], line[0]
    assert "(found by torch's monitored_barrier)" in line[0]
    assert f"(up to hardware.timeout_s, {timeout_s} s) said: Timed out waiting" in line[0]
    # every rank's stack is in the log; rank 1's shows the user's function
    rank1 = err.split("== stack of rank 1 ")[1].split("== stack of rank")[0]
    if workers:  # the worker's stack, after the rank's own
        rank1 = rank1.split("== its DataLoader worker pid ")[1]
    assert "stuck_in_user_getitem" in rank1 and "__getitem__" in rank1, rank1[:3000]
    assert "== stack of rank 0 " in err
    report = json.loads((stage(tmp_path) / "hang.json").read_text())
    assert report["missing"] == [1] and report["found_by"] == "torch's monitored_barrier"
    blocked = float(mark.read_text())
    # the collective's own timeout found it (not sooner), and the launcher ended it in time
    assert report["detected_at"] - blocked >= timeout_s - 0.5, report
    deadline = timeout_s + hangreport.HANG_MARGIN_S
    assert report["ended_at"] - report["ranks"][1]["step_at"] <= deadline
    assert report["ended_at"] - blocked <= deadline


def rank_of(folder: Path, pid: int) -> int:
    """The rank whose heartbeat names pid."""
    for f in folder.glob("rank-*.json"):
        beat = json.loads(f.read_text())
        if beat["pid"] == pid:
            return beat["rank"]
    raise AssertionError(f"no heartbeat names pid {pid}")


def training(root: Path, **hardware) -> tuple[subprocess.Popen, Path]:
    """A 2-rank stage on the tiny synthetic set, started; (the launcher, the stage)."""
    cfg = tiny_config(root, log_every_steps=2, checkpoint={"every_steps": 8},
                      data={"train_size": 4096},
                      hardware={"nproc_per_node": 2, "threads_per_rank": 1, "max_restarts": 0,
                                **hardware},
                      stages=[{"name": "s1", "max_steps": 2000, "batch_size": 8, "lr": 0.05}])
    p = write_config(root, cfg)
    ddpflow("prepare", "--config", p, check=True)
    proc = subprocess.Popen([sys.executable, "-m", "ddpflow", "launch", "--config", str(p),
                             "--stage", "s1"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    return proc, stage(root)


def wait_for_step(out: Path, step: int, timeout: float = 300) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        lines = (out / "metrics.jsonl").read_text().splitlines() if (
            out / "metrics.jsonl").is_file() else []
        if any(json.loads(x).get("step", 0) >= step for x in lines if x.strip()):
            return
        time.sleep(0.1)
    raise AssertionError(f"step {step} not reached")


def rank_processes(proc: subprocess.Popen) -> list[psutil.Process]:
    kids = psutil.Process(proc.pid).children(recursive=True)
    return [k for k in kids if "train" in k.cmdline() and "--resolved" in k.cmdline()]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["stopped", "killed"])
def test_a_stopped_or_dead_rank_is_named_and_the_job_ends_in_time(tmp_path, how):
    """A rank stopped without a signal it can answer (SIGSTOP: its heartbeat stops too), or
    killed while the other waits for it: the error line names it, with its host, what
    became of it and every rank's last step; the job ends within the timeout + margin of
    the victim's last heartbeat (the launcher kills a stopped rank at its own deadline)."""
    timeout_s = 10
    proc, out = training(tmp_path, timeout_s=timeout_s)
    try:
        wait_for_step(out, 6)
        victim = rank_processes(proc)[-1]
        folder = hangreport.last_attempt(out)
        rank = rank_of(folder, victim.pid)
        victim.suspend() if how == "stopped" else victim.kill()
        _, err = proc.communicate(timeout=300)  # (only a hang guard)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode not in (0, 75), err[-3000:]
    line = [x for x in err.splitlines() if x.startswith("ddpflow: error: stage 's1' failed")]
    state = {"stopped": "it did not answer: stopped, or blocked in the kernel",
             "killed": "its process had ended"}[how]
    assert line and f"rank {rank} (host {socket.gethostname()}: {state}) did not arrive" in \
        line[0], err[-3000:]
    report = json.loads((out / "hang.json").read_text())
    beats = report["ranks"]
    assert report["missing"] == [rank]
    assert f"rank {rank} at step {beats[rank]['step']}" in line[0]
    assert f"rank {1 - rank} at step {beats[1 - rank]['step']}" in line[0]
    assert f"== stack of rank {1 - rank} " in err  # the survivor's
    assert report["ended_at"] - beats[rank]["beat_at"] <= timeout_s + hangreport.HANG_MARGIN_S
    assert not psutil.pid_exists(victim.pid) or victim.status() == psutil.STATUS_ZOMBIE


@pytest.mark.slow
@pytest.mark.parametrize("slowed,cause", [
    ({"data": {"slow_rank": 1, "item_s": 0.005}}, "data wait"),
    ({"model": {"slow_rank": 1, "forward_s": 0.04}}, "compute")])
def test_a_rank_slowed_on_purpose_is_named_a_straggler(tmp_path, slowed, cause):
    """Rank 1 sleeps in its data (8 items x 5 ms a step) or in its forward (40 ms): the log
    line, the console and summary.json name rank 1 and its host, and where its time went."""
    p = user_run(tmp_path, slowed.get("data", {}), slowed.get("model", {}))
    proc = ddpflow("launch", "--config", p, "--stage", "s1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    host = socket.gethostname()
    records = [json.loads(x) for x in
               (stage(tmp_path) / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train" and not r["warmup"]]
    named = [r for r in train if [s["rank"] for s in r["stragglers"]] == [1]]
    assert len(named) >= 0.8 * len(train), [r["stragglers"] for r in train]
    assert all(s["cause"] == cause and s["host"] == host for r in named for s in r["stragglers"])
    assert f"straggler: rank 1 (host {host}) holds every step back by" in proc.stderr
    assert f"in {cause}" in proc.stderr.split("straggler: rank 1")[1].splitlines()[0]
    summary = json.loads((stage(tmp_path) / "summary.json").read_text())
    ones = [s for s in summary["stragglers"] if s["rank"] == 1]
    assert ones and ones[0]["host"] == host and ones[0]["cause"] == cause
    assert ones[0]["intervals"] == len(named) and ones[0]["of"] == len(train)
    assert ones[0]["mean_above"] > stragglers.STRAGGLER_ABOVE


# ---------------------------------------------------------------- the parts, without torchrun

@pytest.mark.parametrize("wait,compute,step,named", [
    ([0.001, 0.050], [0.010, 0.010], 0.065, [(1, "data wait")]),  # rank 1 waits on its data
    ([0.001, 0.001], [0.010, 0.060], 0.065, [(1, "compute")]),  # rank 1 computes slowly
    ([0.030, 0.001], [0.010, 0.010], 0.045, [(0, "data wait")]),  # rank 0 as well
    ([0.001, 0.001, 0.001, 0.02], [0.01, 0.01, 0.011, 0.01], 0.03, [(3, "data wait")]),
    ([0.001, 0.001], [0.010, 0.011], 0.02, []),  # 1 ms of 20: not a straggler
    ([0.001, 0.002], [0.010, 0.010], 0.005, [(1, "data wait")]),  # 1 ms of a 5 ms step
    ([0.001], [0.010], 0.011, []),  # one rank: nobody to wait for
])
def test_stragglers_are_the_ranks_the_others_wait_for(wait, compute, step, named):
    import statistics

    hosts = [f"h{i}" for i in range(len(wait))]
    found = stragglers.find(wait, compute, step, hosts)
    assert [(s["rank"], s["cause"]) for s in found] == named
    for s in found:
        own = [w + c for w, c in zip(wait, compute)]
        excess = own[s["rank"]] - statistics.median(own[:s["rank"]] + own[s["rank"] + 1:])
        assert s["host"] == hosts[s["rank"]]
        assert s["excess_s"] == pytest.approx(excess)
        assert s["above"] == pytest.approx(excess / (step - excess))


def test_the_straggler_threshold_is_fifteen_percent_of_what_the_others_need():
    # the others need 0.1 s a step: 15% over is named, just under is not
    assert stragglers.STRAGGLER_ABOVE == 0.15
    at = stragglers.find([0.0, 0.0151], [0.05, 0.05], 0.1151, ["a", "b"])
    under = stragglers.find([0.0, 0.0149], [0.05, 0.05], 0.1149, ["a", "b"])
    assert [s["rank"] for s in at] == [1] and under == []
    tie = stragglers.find([0.0, 0.03], [0.0, 0.03], 0.2, ["a", "b"])  # as much of each
    assert tie[0]["cause"] == "data wait"


def test_the_straggler_summary_counts_intervals_past_the_warm_up():
    one = {"rank": 1, "host": "b", "excess_s": 0.1, "above": 0.5, "cause": "compute"}
    records = [{"kind": "train", "warmup": True, "stragglers": [{**one, "above": 9.0}]},
               {"kind": "train", "warmup": False, "stragglers": [one]},
               {"kind": "val", "stragglers": [one]},
               {"kind": "train", "warmup": False, "stragglers": [
                   {**one, "above": 0.3, "cause": "data wait"}]},
               {"kind": "train", "warmup": False, "stragglers": [{**one, "above": 0.4}]},
               {"kind": "train", "warmup": False, "stragglers": []}]
    assert stragglers.summary(records) == [{"rank": 1, "host": "b", "intervals": 3, "of": 4,
                                           "mean_above": pytest.approx(0.4),
                                           "cause": "compute"}]
    assert stragglers.summary([]) == []
    text = stragglers.text([one])
    assert text == ("rank 1 (host b) holds every step back by 0.1 s (+50% over what the other "
                    "ranks need), in compute")


def test_the_compute_clock_sums_the_forward_spans_of_an_interval(monkeypatch):
    import torch

    ticks = iter([1.0, 1.5, 3.0, 3.25, 7.0, 8.0])  # perf_counter at each start and stop
    monkeypatch.setattr(stragglers.time, "perf_counter", lambda: next(ticks))
    clock = stragglers.ComputeClock(torch.device("cpu"))
    for _ in range(2):
        clock.start()
        clock.stop()
    assert clock.take() == 0.75  # the spans, not the time between them
    assert clock.take() == 0.0
    clock.start()
    clock.stop()
    clock.reset()
    assert clock.take() == 0.0


BEAT = {"rank": 1, "world": 2, "host": "n1", "pid": 4242, "step": 4, "step_at": 100.0,
        "beat_at": 101.0, "answered": True}


@pytest.mark.parametrize("content", [
    "", '{"rank": 1, "host": "n1", "pi', "not json", "[1, 2]",
    json.dumps({**BEAT, "step": "four"}), json.dumps({**BEAT, "rank": 0}),
    json.dumps({k: v for k, v in BEAT.items() if k != "pid"}), "FOLDER"])
def test_a_corrupt_heartbeat_is_left_out_and_named_not_a_crash(tmp_path, content):
    """A heartbeat that is empty, truncated, not JSON, another shape, another rank's, or a
    folder: left out and named; the report still names the rank from the views."""
    folder = tmp_path / "ranks" / "0"
    folder.mkdir(parents=True)
    write_json_atomic(folder / "rank-0.json", {**BEAT, "rank": 0, "pid": 4241, "step": 5})
    bad = folder / "rank-1.json"
    bad.mkdir() if content == "FOLDER" else bad.write_text(content)
    beats, problems = heartbeat.read_heartbeats(folder, 2)
    assert list(beats) == [0] and len(problems) == 1 and str(bad) in problems[0]
    write_json_atomic(folder / "hang-0.json", {
        "rank": 0, "world": 2, "host": "n1", "error": "Timed out waiting 10000ms",
        "missing": [1], "ended": [], "found_by": "monitored_barrier", "stacks": "faulthandler",
        "detected_at": 110.0})
    said = []
    line = hangreport.report(tmp_path, 10, lambda *a, **k: said.append(a[0]))
    assert "rank 1 (host ?: it did not answer: stopped, or blocked in the kernel) did not " \
           "arrive (found by torch's monitored_barrier)" in line
    assert "rank 0 at step 5, rank 1 unknown (no readable heartbeat)" in line
    assert f"unreadable heartbeats: {problems[0]}" in line
    assert "== rank 1 (host ?, pid ?): no stack" in "\n".join(said)
    report = json.loads((tmp_path / "hang.json").read_text())
    assert report["missing"] == [1] and report["ranks"][1] is None
    assert report["heartbeat_problems"] == problems and report["detected_at"] == 110.0


def test_the_report_prints_every_stack_and_names_the_first_view(tmp_path):
    folder = tmp_path / "ranks" / "3"
    (tmp_path / "ranks" / "1").mkdir(parents=True)  # an earlier attempt: not the last
    folder.mkdir(parents=True)
    for r in range(3):
        write_json_atomic(folder / f"rank-{r}.json", {**BEAT, "rank": r, "step": 7 + r,
                                                      "answered": r != 2})
        (folder / f"stack-{r}.txt").write_text(f"== stack of rank {r}\n  File x{r}\n"
                                               if r != 2 else "")
    view = {"world": 3, "host": "n1", "missing": None, "ended": [], "found_by": "fb",
            "stacks": "py-spy"}
    write_json_atomic(folder / "hang-1.json", {**view, "rank": 1, "error": "second",
                                               "detected_at": 5.0, "missing": [0]})
    write_json_atomic(folder / "hang-0.json", {**view, "rank": 0, "error": "first",
                                               "detected_at": 4.0, "missing": [2]})
    (folder / "hang-2.json").write_text("{broken")  # a damaged view is left out
    said = []
    line = hangreport.report(tmp_path, 30, lambda *a, **k: said.append(a[0]))
    assert said[0].startswith("ddpflow: the Python stack of every rank") and str(folder) in \
        said[0]
    assert said[1:3] == ["== stack of rank 0\n  File x0", "== stack of rank 1\n  File x1"]
    assert said[3].startswith("== rank 2 (host n1, pid 4242): no stack")
    assert line == ("a collective did not complete: rank 2 (host n1: it did not answer: "
                    "stopped, or blocked in the kernel) did not arrive (found by torch's "
                    "monitored_barrier); last step completed: rank 0 at step 7, rank 1 at step "
                    "8, rank 2 at step 9; the ranks that waited (up to hardware.timeout_s, 30 s) "
                    "said: first; every rank's Python stack (py-spy) is in the log and in "
                    f"{folder}")
    assert hangreport.report(tmp_path / "none", 30) is None


BARRIER, ENDED, SILENT = ("torch's monitored_barrier", "the heartbeats: its process had ended",
                          "the heartbeats: it reported no broken collective")


@pytest.mark.parametrize("views,world,missing,how", [
    ({0: {"missing": [1], "ended": []}}, 2, [1], BARRIER),  # rank 0's monitored_barrier
    ({0: {"missing": [2, 3], "ended": []}, 1: {"missing": [0], "ended": []}}, 4, [2, 3],
     BARRIER),
    ({1: {"missing": [0], "ended": []}}, 2, [0], BARRIER),  # rank 0 did not answer the others
    ({0: {"missing": None, "ended": [1]}}, 2, [1], ENDED),  # a peer gone: its pid ended
    ({0: {"missing": [1], "ended": [2, 1]}}, 3, [1, 2], BARRIER + " and " + ENDED),
    ({0: {"missing": [1], "ended": [1]}}, 3, [1], BARRIER),
    ({0: {"missing": None, "ended": []}, 2: {"missing": None, "ended": []}}, 3, [1], SILENT),
    ({0: {"missing": [], "ended": []}, 1: {"missing": [], "ended": []}}, 2, [], "no rank"),
])
def test_the_missing_ranks_come_from_torch_then_the_ended_then_the_silent(views, world,
                                                                          missing, how):
    assert hangreport.who_missing(views, world) == (missing, how)


@pytest.mark.parametrize("text,rank,named", [
    ("[Rank 0]: Ranks 1 failed to pass monitoredBarrier in 5000 ms", 0, [1]),
    ("[Rank 0]: Ranks 1, 3 failed to pass monitoredBarrier in 5000 ms", 0, [1, 3]),
    ("Rank 2 successfully reached monitoredBarrier, but received errors while waiting for "
     "send/recv from rank 0. Please check rank 0 logs for faulty rank.", 2, [0]),
    ("[/x/pair.cc:561] Connection closed by peer [127.0.0.1]:6538. This is typically caused "
     "by a remote worker crashing.", 0, None),
    ("received errors while waiting for send/recv from rank 0", 0, None),
])
def test_monitored_barrier_s_words_name_the_ranks(text, rank, named):
    got, how = hang.named_by_barrier(text, rank)
    assert got == named
    assert how == "monitored_barrier" if named is not None else how.startswith(
        "monitored_barrier named no rank: ")
    if named is None:
        assert "[/x/pair.cc" not in how and text.split("] ")[-1][:20] in how
        assert "This is typically" not in how  # one sentence


def test_a_rank_s_view_names_the_peer_whose_process_ended_on_this_host(tmp_path, monkeypatch):
    """diagnose, on rank 0 of 3: its own stack with the error first, a stack request for
    the others, and hang-0.json naming rank 1 (its process on this host has ended) but not
    rank 2 (another host's process is not this rank's to judge), all of it returned."""
    from types import SimpleNamespace

    monkeypatch.setattr(hang, "STACK_WAIT_S", 0.3)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # ended and reaped: its pid is gone
    beat = heartbeat.Heartbeat(tmp_path, 0, 3)
    try:
        beat.beat(5, now=True)
        for rank, host in ((1, beat.host), (2, "elsewhere")):
            write_json_atomic(heartbeat.heartbeat_file(tmp_path, rank),
                              {**beat.record(), "rank": rank, "host": host, "pid": dead.pid})
        try:
            raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                               "[127.0.0.1]:5301. This is typically caused by a dead peer")
        except RuntimeError as e:
            err = e
        t0 = time.time()
        view = hang.diagnose(SimpleNamespace(rank=0, world=3), None, beat, err)
        t1 = time.time()
        assert beat.diagnosing is True
    finally:
        beat.close()
    assert view == json.loads((tmp_path / "hang-0.json").read_text())
    assert view["ended"] == [1] and view["missing"] is None
    assert view["found_by"] == "no watch group" and view["heartbeat_problems"] == []
    assert (view["rank"], view["world"], view["host"], view["step"]) == (0, 3, beat.host, 5)
    assert view["error"] == "Connection closed by peer [127.0.0.1]:5301"
    assert view["stacks"] == ("py-spy" if shutil.which("py-spy") else "faulthandler")
    assert t0 <= view["detected_at"] <= view["at"] <= t1
    own = (tmp_path / "stack-0.txt").read_text()
    assert own.startswith(f"== stack of rank 0 (host {beat.host}, pid {os.getpid()}) at step "
                          f"5, where its collective broke, by faulthandler:\nTraceback")
    assert "This is typically caused by a dead peer" in own
    assert "test_a_rank_s_view_names_the_peer_whose_process_ended" in own  # every thread's
    assert (tmp_path / heartbeat.REQUEST).exists()  # the others were asked for theirs


def test_a_broken_collective_is_told_from_other_errors():
    import torch.distributed as dist

    for text in ("[/p/unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation",
                 "[/p/pair.cc:561] Connection closed by peer [127.0.0.1]:1",
                 "Connection reset by peer", "Broken pipe"):
        assert hang.is_broken_collective(RuntimeError(text))
    assert hang.is_broken_collective(dist.DistBackendError("x"))
    assert hang.is_broken_collective(dist.DistNetworkError("x"))
    assert not hang.is_broken_collective(RuntimeError("CUDA out of memory"))
    assert not hang.is_broken_collective(ValueError("Timed out waiting"))
    assert hang.error_text(RuntimeError("[/p/u.cc:78] Timed out waiting 10ms\nmore")) == \
        "Timed out waiting 10ms"
    assert hang.error_text(RuntimeError("[/p/pair.cc:5] Read error [::1]:3: Connection reset by "
                                        "peer. This is typically caused by ...")) == \
        "Read error [::1]:3: Connection reset by peer"
    assert hang.error_text(RuntimeError("")) == "RuntimeError"


def blocked_in_a_test_function(event):
    event.wait()


def test_a_heartbeat_beats_and_answers_a_stack_request(tmp_path, monkeypatch):
    """The thread writes the last step (at once after a log line), answers a request with
    the stack of every thread (the main thread's own frames included), and a rank that
    answered leaves when stopped (SIGTERM) unless it diagnoses the failure itself."""
    import threading

    monkeypatch.setattr(heartbeat, "TICK_S", 0.02)
    left = []
    monkeypatch.setattr(heartbeat.os, "_exit", lambda code: left.append(code))
    beat = heartbeat.Heartbeat(tmp_path, 1, 2)
    try:
        assert json.loads((tmp_path / "rank-1.json").read_text())["step"] == 0
        beat.beat(3, now=True)
        wait_until(lambda: json.loads((tmp_path / "rank-1.json").read_text())["step"] == 3)
        first = json.loads((tmp_path / "rank-1.json").read_text())
        beat.beat(3, now=True)  # the same step: its time is kept
        assert beat.step_at == first["step_at"] and first["pid"] == os.getpid()
        event = threading.Event()
        worker = threading.Thread(target=blocked_in_a_test_function, args=(event,))
        worker.start()
        assert beat.request() and not beat.request()  # the first asker creates it
        wait_until(lambda: "blocked_in_a_test_function" in (tmp_path / "stack-1.txt")
                   .read_text())
        text = (tmp_path / "stack-1.txt").read_text()
        assert text.startswith(f"== stack of rank 1 (host {socket.gethostname()}, pid "
                               f"{os.getpid()}) at step 3, by faulthandler:")
        assert "test_a_heartbeat_beats_and_answers_a_stack_request" in text  # main thread
        assert json.loads((tmp_path / "rank-1.json").read_text())["answered"] is True
        event.set()
        worker.join()
        assert not beat.should_leave() and not left  # not stopped, not yet LEAVE_AFTER_S
        beat.diagnosing = True
        monkeypatch.setattr(stopflag, "_received", ["SIGTERM"])
        assert not beat.should_leave()  # the rank that reports leaves by itself
        beat.diagnosing = False
        wait_until(lambda: left)
        assert set(left) == {heartbeat.EXIT_HUNG}
        monkeypatch.setattr(stopflag, "_received", [])
        beat.answered -= heartbeat.LEAVE_AFTER_S + 1
        assert beat.should_leave()
    finally:
        beat.close()
    assert not beat.should_leave()  # closed: never


def wait_until(cond, timeout=20.0):
    t0 = time.time()
    while not cond():
        assert time.time() - t0 < timeout, "not reached"
        time.sleep(0.02)


def test_sigusr2_writes_the_stack_where_the_thread_cannot(tmp_path):
    """faulthandler's C handler answers SIGUSR2 into the rank's stack file."""
    beat = heartbeat.Heartbeat(tmp_path, 0, 1)
    try:
        beat.done.set()  # the thread stopped: only the signal can answer
        os.kill(os.getpid(), heartbeat.STACK_SIGNAL)
        wait_until(lambda: "test_sigusr2_writes_the_stack" in (tmp_path / "stack-0.txt")
                   .read_text())
    finally:
        beat.close()


def test_the_launcher_deadline_kills_the_attempt_s_ranks_on_this_host(tmp_path, monkeypatch):
    folder = tmp_path / "ranks" / "0"
    folder.mkdir(parents=True)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        write_json_atomic(folder / "rank-0.json", {**BEAT, "rank": 0, "pid": os.getpid(),
                                                   "host": "elsewhere"})
        write_json_atomic(folder / "rank-1.json", {**BEAT, "pid": sleeper.pid,
                                                   "host": socket.gethostname()})
        killed = []
        watch = hangreport.HangWatch(tmp_path)
        watch.poll(killed.append)
        assert watch.deadline is None  # no report yet
        write_json_atomic(folder / "hang-0.json", {
            "rank": 0, "world": 2, "host": "n", "error": "e", "missing": [1], "ended": [],
            "detected_at": 1.0})
        monkeypatch.setattr(hangreport, "KILL_AFTER_S", 3600)
        watch.poll(killed.append)
        assert watch.folder == folder and watch.deadline is not None
        watch.poll(killed.append)
        assert not killed  # not before the deadline
        watch.deadline = time.monotonic() - 1
        watch.poll(killed.append)
        watch.poll(killed.append)
        assert killed == [sleeper.pid]  # once, and only this host's rank
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_flight_recorder_is_on_unless_the_user_set_it(tmp_path, monkeypatch):
    for name in (*hangreport.BUFFER_VARIABLES, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
    dump = {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "ranks" / "nccl_trace_rank_")}
    entries = str(hangreport.FLIGHT_ENTRIES)
    # the buffer under the name this torch reads without a deprecation warning (2.11 on)
    assert hangreport.flight_recorder(tmp_path, "2.14.1+cu130") == {
        "TORCH_FR_BUFFER_SIZE": entries, **dump}
    for new in ("2.11.0", "2.12.0a0+git1234", "3.0.1"):
        assert "TORCH_FR_BUFFER_SIZE" in hangreport.flight_recorder(tmp_path, new), new
    for old in ("2.10.9", "2.4.1+cu121", "1.13.0"):
        assert hangreport.flight_recorder(tmp_path, old) == {
            "TORCH_NCCL_TRACE_BUFFER_SIZE": entries, **dump}, old
    # the user's buffer size, under either name, is theirs: no second name beside it
    for name in hangreport.BUFFER_VARIABLES:
        monkeypatch.setenv(name, "50")
        assert hangreport.flight_recorder(tmp_path, "2.14.1") == dump
        assert hangreport.flight_recorder(tmp_path, "2.4.0") == dump
        monkeypatch.delenv(name)
    monkeypatch.setenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "/elsewhere/fr_")
    assert hangreport.flight_recorder(tmp_path, "2.14.1") == {"TORCH_FR_BUFFER_SIZE": entries}
    monkeypatch.delenv("TORCH_NCCL_DUMP_ON_TIMEOUT")
    assert hangreport.flight_recorder(tmp_path, "2.14.1")["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert 0 < hangreport.FLIGHT_ENTRIES <= 10000  # bounded


def test_flight_recorder_dumps_alone_are_reported_with_torch_s_reader(tmp_path):
    ranks = tmp_path / "ranks"
    (ranks / "0").mkdir(parents=True)
    assert hangreport.report(tmp_path, 10) is None  # nothing left: torchrun's own words
    write_json_atomic(ranks / "0" / "rank-0.json", {**BEAT, "rank": 0, "step": 11})
    (ranks / "nccl_trace_rank_0").write_bytes(b"x")
    line = hangreport.report(tmp_path, 10)
    assert "rank 0 at step 11" in line and f"torchfrtrace {ranks} -p nccl_trace_rank_" in line
