"""Reading ahead in a background thread (data/prefetch.py) and the CPU paths of the resident
split (data/resident.py): the order and content of the batches, the bound on how far the
thread runs ahead, an error in the source or the work raised at its item, closing early,
depth 0 as the plain loop, the CUDA calls' order with the calls stood in; the rows a split
reads (raw arrays and JPEG shards), the upload chunk by chunk without unreadable samples,
the node group and the exchange of shares under gloo. Fast: tiny arrays, no training.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from ddpflow.data import prefetch, resident, shards
from ddpflow.data.loaders import BadSamples
from ddpflow.data.prefetch import Ahead, tensors

CPU = torch.device("cpu")
HANG = 15  # seconds a test waits for what takes milliseconds, before calling it a hang


def _drain(it):
    """list(it) in a thread: (items, error), asserting it ends (a lost end hangs forever)."""
    got, err = [], []

    def run():
        try:
            for item in it:
                got.append(item)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            err.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(HANG)
    assert not t.is_alive(), f"the iteration hangs after {got}"
    return got, (err[0] if err else None)


def _next(it):
    """next(it) in a thread, asserting it returns (a lost batch hangs forever)."""
    got = []
    t = threading.Thread(target=lambda: got.append(next(it)), daemon=True)
    t.start()
    t.join(HANG)
    assert got, "next() hangs or fails"
    return got[0]


class _Source:
    """An iterable that records how many items were taken from it, and by which thread."""

    def __init__(self, n, fail_at=None):
        self.n, self.fail_at, self.taken, self.threads = n, fail_at, 0, set()
        self.pulled = [threading.Event() for _ in range(n + 1)]

    def __iter__(self):
        for k in range(self.n):
            if k == self.fail_at:
                raise OSError(f"shard {k} unreadable")
            self.threads.add(threading.get_ident())
            self.taken += 1
            self.pulled[k].set()
            yield k


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_the_batches_come_in_order_with_their_content_from_another_thread(depth):
    src, workers = _Source(7), set()

    def work(k):
        workers.add(threading.get_ident())
        return (torch.full((2,), float(k)), [torch.tensor([k]), k * 10])

    ahead = Ahead(src, work, CPU, depth)
    assert (ahead.depth, ahead.device, ahead.cuda, ahead.thread) == (depth, CPU, False, None)
    got, err = _drain(ahead)
    assert err is None
    assert [int(g[0][0]) for g in got] == list(range(7))
    assert [g[1][1] for g in got] == [k * 10 for k in range(7)]
    assert all(g[1][0].tolist() == [k] for k, g in enumerate(got))
    assert ahead.thread.name == "ddpflow-prefetch" and ahead.thread.daemon
    assert workers == {ahead.thread.ident} and src.threads == {ahead.thread.ident}
    ahead.thread.join(HANG)
    assert not ahead.thread.is_alive()


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_the_thread_runs_exactly_depth_batches_ahead_of_the_one_held(depth):
    """While the caller holds batch 0, batches 1..depth are worked on and no more: a deeper
    queue holds more decoded batches in GPU memory than the config allows."""
    src, done = _Source(10), [threading.Event() for _ in range(10)]

    def work(k):
        done[k].set()
        return k

    ahead = Ahead(src, work, CPU, depth)
    it = iter(ahead)
    assert _next(it) == 0
    assert done[depth].wait(HANG), f"batch {depth} was not worked on while batch 0 was held"
    assert src.pulled[depth + 1].wait(HANG)  # the next item taken, its slot awaited
    time.sleep(0.3)  # room for a thread that would go further
    assert not done[depth + 1].is_set()
    assert _next(it) == 1
    assert done[depth + 1].wait(HANG)
    time.sleep(0.3)
    assert not done[depth + 2].is_set()
    it.close()
    ahead.thread.join(HANG)
    assert not ahead.thread.is_alive()


@pytest.mark.parametrize("depth", [0, -1])
def test_depth_0_is_the_plain_loop_in_the_callers_thread(depth):
    src, workers = _Source(4), set()
    ahead = Ahead(src, lambda k: workers.add(threading.get_ident()) or k * 3, CPU, depth)
    got, err = _drain(ahead)
    assert err is None and got == [0, 3, 6, 9]
    assert ahead.thread is None and len(workers) == 1 and src.threads == workers
    assert threading.get_ident() not in workers  # _drain's thread, not this one


def test_an_error_in_the_work_comes_at_its_batch_after_the_ones_before():
    def work(k):
        if k == 3:
            raise ValueError("batch 3 damaged")
        return k

    ahead = Ahead(range(10), work, CPU, 2)
    got, err = _drain(ahead)
    assert got == [0, 1, 2]
    assert isinstance(err, ValueError) and str(err) == "batch 3 damaged"
    ahead.thread.join(HANG)
    assert not ahead.thread.is_alive()


def test_an_error_in_the_source_comes_at_its_item():
    ahead = Ahead(_Source(6, fail_at=4), lambda k: k + 100, CPU, 1)
    got, err = _drain(ahead)
    assert got == [100, 101, 102, 103]
    assert isinstance(err, OSError) and str(err) == "shard 4 unreadable"


def test_a_keyboard_interrupt_in_the_work_reaches_the_caller():
    """Not only Exceptions: a KeyboardInterrupt (or SystemExit) in the thread would else
    end it silently and leave the caller waiting forever."""
    def work(k):
        if k == 1:
            raise KeyboardInterrupt
        return k

    got, err = _drain(Ahead(range(5), work, CPU, 2))
    assert got == [0] and isinstance(err, KeyboardInterrupt)


@pytest.mark.parametrize("depth", [1, 2])
def test_closing_early_stops_the_thread_after_its_item(depth):
    src = _Source(1000)
    ahead = Ahead(src, lambda k: k, CPU, depth)
    it = iter(ahead)
    assert _next(it) == 0
    assert src.pulled[depth + 1].wait(HANG)  # the thread waits for a slot
    it.close()  # a break
    ahead.thread.join(HANG)
    assert not ahead.thread.is_alive()
    assert src.taken == depth + 2  # nothing taken after the stop
    assert ahead._ready.qsize() <= depth  # and nothing more worked on


def test_closing_before_the_end_in_a_for_loop_leaves_no_thread():
    ahead = Ahead(range(50), lambda k: k, CPU, 1)
    for k in ahead:
        if k == 5:
            break
    ahead.thread.join(HANG)
    assert not ahead.thread.is_alive()


def test_on_cuda_each_batch_is_worked_on_the_side_stream_and_waited_for(monkeypatch):
    """The CUDA calls stood in (no GPU here): the side stream is made in the thread for the
    given device, each batch's work runs inside its context, an event is recorded after the
    work, and the caller waits for that batch's own event before it gets the batch."""
    log = []
    dev = torch.device("cuda", 1)

    def side_stream(d):
        log.append(("stream", d, threading.current_thread().name))
        return "side"

    class Ctx:
        def __init__(self, s):
            self.s = s

        def __enter__(self):
            log.append(("enter", self.s))

        def __exit__(self, *a):
            log.append(("exit", self.s))

    monkeypatch.setattr(prefetch, "side_stream", side_stream)
    monkeypatch.setattr(prefetch, "stream_context", Ctx)
    monkeypatch.setattr(prefetch, "mark_ready",
                        lambda s: log.append(("event", s)) or f"ev{len(log)}")
    monkeypatch.setattr(prefetch, "wait_ready",
                        lambda out, ev, d: log.append(("wait", out, ev, d)))
    ahead = Ahead(range(3), lambda k: log.append(("work", k)) or k * 2, dev, 1)
    assert ahead.cuda
    def steps():
        for k in ahead:
            log.append(("step", k))
            yield k

    got, err = _drain(steps())
    assert err is None and got == [0, 2, 4]
    assert log[0] == ("stream", dev, "ddpflow-prefetch")
    for k in range(3):
        i = log.index(("work", k))
        assert log[i - 1:i + 3] == [("enter", "side"), ("work", k), ("event", "side"),
                                    ("exit", "side")], log
        waits = [e for e in log if e[0] == "wait" and e[1] == k * 2]
        assert waits == [("wait", k * 2, f"ev{i + 2}", dev)], log
        assert log.index(waits[0]) < log.index(("step", k * 2)), log


def test_tensors_finds_every_tensor_in_nested_tuples_and_lists():
    a, b, c = torch.zeros(1), torch.ones(2), torch.arange(3)
    assert [t is x for t, x in zip(tensors((a, [b, (c, 5)], "x", None)), (a, b, c))] == [True] * 3
    assert len(list(tensors((a, [b, (c, 5)], "x", None)))) == 3
    assert list(tensors(a))[0] is a and len(list(tensors(a))) == 1
    assert list(tensors({"x": a})) == [] and list(tensors(7)) == []
    assert len(list(tensors([[[]], ()]))) == 0


# ------------------------------------------------------------- data/resident.py, CPU paths
def _jpeg_split(folder: Path, n: int, damaged=()) -> tuple:
    """A JPEG split of n 8x8 images in small shards, the samples in `damaged` with a flipped
    byte (their CRC fails): (JpegImages, labels, the decoded images of an intact copy)."""
    rng = np.random.default_rng(0)
    folder.mkdir()
    labels = (np.arange(n) * 7) % 10
    shards.write_split(folder, "train", rng.integers(0, 255, (n, 8, 8, 3), dtype=np.uint8),
                       labels, quality=90, shard_bytes=4000)
    recorded = {p.name: p.stat().st_size for p in folder.glob("*.jpgs")}
    whole = shards.JpegImages(folder, "train", (8, 8, 3), recorded)[np.arange(n)]
    index = np.load(folder / "train_index.npy")
    for i in damaged:
        k, off = int(index[i][0]), int(index[i][1])
        shard = folder / shards.shard_name("train", k)
        data = bytearray(shard.read_bytes())
        data[off + 20] ^= 0xFF
        shard.write_bytes(bytes(data))
    (folder / "recorded.json").write_text(json.dumps(recorded))
    return shards.JpegImages(folder, "train", (8, 8, 3), recorded), np.load(
        folder / "train_labels.npy"), whole


def test_raw_rows_are_read_as_they_are_in_the_order_asked():
    images = np.arange(6 * 2 * 2, dtype=np.uint8).reshape(6, 2, 2)
    labels = np.arange(6) + 10
    x, y, idx, bad = resident.read_rows(images, labels, [4, 1, 5])
    assert np.array_equal(x, images[[4, 1, 5]]) and y.tolist() == [14, 11, 15]
    assert idx.dtype == np.int64 and idx.tolist() == [4, 1, 5] and bad == []
    x, y, kept, bad = resident.read_kept(images, labels, [4, 1, 5])
    assert kept.tolist() == [0, 1, 2] and y.tolist() == [14, 11, 15] and bad == []


def test_jpeg_rows_leave_out_the_unreadable_ones_and_name_them(tmp_path):
    images, labels, whole = _jpeg_split(tmp_path / "jpeg", 9, damaged=[2])
    x, y, idx, bad = resident.read_rows(images, labels, [4, 2, 0, 7])
    assert idx.tolist() == [4, 0, 7] and y.tolist() == labels[[4, 0, 7]].tolist()
    assert np.array_equal(x, whole[[4, 0, 7]])
    assert [i for i, _ in bad] == [2] and bad[0][1].startswith("train sample 2 (train-")
    assert "CRC-32" in bad[0][1]
    x, y, kept, bad = resident.read_kept(images, labels, np.array([4, 2, 0, 7]))
    assert kept.dtype == np.int64 and kept.tolist() == [0, 2, 3]
    assert y.tolist() == labels[[4, 0, 7]].tolist() and [i for i, _ in bad] == [2]


def test_the_unreadable_of_a_share_are_collected_in_order():
    lost = resident._Unreadable()
    assert lost.items == []
    lost.note([(3, "a")])
    lost.note([])
    lost.note([(1, "b"), (9, "c")])
    assert lost.items == [(3, "a"), (1, "b"), (9, "c")]
    assert resident._Unreadable().items == []  # not shared between instances


@pytest.mark.parametrize("src, dst, n", [(6, 1, 4), (3, 1, 6), (5, 4, 5), (4, 0, 6),
                                         (7, 2, 1)])
def test_rows_moved_down_arrive_whole_even_where_source_and_target_overlap(src, dst, n):
    t = torch.arange(10 * 2).reshape(10, 2)
    want = t.clone()
    want[dst:dst + n] = t[src:src + n].clone()
    resident._move_down(t, src, dst, n)
    assert torch.equal(t, want)


def test_a_split_without_a_process_group_is_uploaded_whole(tmp_path):
    images = np.arange(5 * 3, dtype=np.uint8).reshape(5, 3)
    labels = np.array([4, 3, 2, 1, 0])
    bad = BadSamples("train", 5, 0.5, 0)
    x, y = resident.resident_split(images, labels, CPU, bad)
    assert torch.equal(x, torch.from_numpy(images)) and y.tolist() == [4, 3, 2, 1, 0]
    assert y.dtype == torch.long and bad.seen == {}
    jpeg, jlabels, whole = _jpeg_split(tmp_path / "jpeg", 6, damaged=[1])
    x, y = resident.resident_split(jpeg, jlabels, CPU, bad)
    assert torch.equal(x, torch.from_numpy(whole[[0, 2, 3, 4, 5]]))
    assert y.tolist() == jlabels[[0, 2, 3, 4, 5]].tolist() and list(bad.seen) == [1]


_SHARED = """
import json, os, sys
from pathlib import Path
import numpy as np
import torch
import torch.distributed as dist
from ddpflow.data import resident, shards
from ddpflow.data.loaders import BadSamples

dist.init_process_group("gloo")
decoded = []
real = shards.decode_many
shards.decode_many = lambda bufs: decoded.extend(len(b) for b in bufs) or real(bufs)
folder = Path(sys.argv[1])
images = shards.JpegImages(folder, "train", (8, 8, 3),
                           json.loads((folder / "recorded.json").read_text()))
labels = np.load(folder / "train_labels.npy")
groups = {}
for local in ("3", "4", "5", "2"):  # uneven nodes, one node, more than the job; then 2 a node
    os.environ["LOCAL_WORLD_SIZE"] = local
    g = resident.node_group()
    groups[local] = None if g is None else sorted(dist.get_process_group_ranks(g))
again = resident.node_group() is resident.node_group()
bad = BadSamples("train", len(labels), 0.5, dist.get_rank())
x, y = resident.resident_split(images, labels, torch.device("cpu"), bad, **{})
raw = resident.resident_split(np.arange(12, dtype=np.uint8).reshape(4, 3), np.arange(4),
                              torch.device("cpu"), BadSamples("train", 4, 0.5, 0))
print(json.dumps({"groups": groups, "again": again, "decoded": len(decoded),
                  "x": x.flatten().tolist(), "y": y.tolist(), "bad": bad.seen,
                  "raw": [raw[0].flatten().tolist(), raw[1].tolist()]}), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("world", [2, 4])
def test_jpeg_shares_are_decoded_once_per_node_and_exchanged(tmp_path, world):
    """2 or 4 gloo ranks, 2 a node (torchrun's environment): each node's 2 ranks decode half
    the split each and exchange their halves; every rank holds the whole split in order, as
    one rank's upload, the damaged samples (one in each half) left out and known to all."""
    n = 23  # odd: the halves differ in length
    images, labels, whole = _jpeg_split(tmp_path / "jpeg", n, damaged=[5, 16])
    script = tmp_path / "shared.py"
    script.write_text(_SHARED)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": str(world),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / "jpeg")],
                              cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r % 2)})
             for r in range(world)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err
    ranks = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    keep = [i for i in range(n) if i not in (5, 16)]
    for r, got in enumerate(ranks):
        node = None if world == 2 else [0, 1] if r < 2 else [2, 3]
        assert got["groups"] == {"3": None, "4": None, "5": None, "2": node}, got["groups"]
        assert got["again"]
        # 12 and 11 rows read, one damaged in each
        assert got["decoded"] == [11, 10][r % 2], (r, got["decoded"])
        assert got["x"] == torch.from_numpy(whole[keep]).flatten().tolist(), r
        assert got["y"] == labels[keep].tolist(), r
        assert sorted(got["bad"]) == ["16", "5"], r
        assert "CRC-32" in got["bad"]["5"] and "train sample 16" in got["bad"]["16"]
        assert got["raw"] == [list(range(12)), [0, 1, 2, 3]], r
