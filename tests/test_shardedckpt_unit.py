"""engine/shardedckpt.py on the CPU, one gloo rank in this process (FSDP2 on a tiny model):
a sharded checkpoint's folder (shards, state.pt, its checksum sidecar, keep-last), the stale
temp folder of a killed write, the refusal when the disk has no room (every rank's needs per
file system), a failed write (one message, nothing left), loading the shards back (model and
optimizer), the whole model for best.pt, and the fault hooks tests/test_fsdp.py uses (in
subprocesses: they SIGKILL). Fast: no training.
"""

from __future__ import annotations

import array
import errno
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import tiny_config
from ddpflow.core import nativewrite
from ddpflow.core.errors import UserError
from ddpflow.engine import checkpoint, shardedckpt
from ddpflow.engine.distributed import Dist
from fixtures import gloo_ranks

SRC = str(Path(shardedckpt.__file__).resolve().parents[2])


@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    yield Dist(0, 0, 1, torch.device("cpu"), "gloo")
    dist.destroy_process_group()


def _model(seed: int = 0):
    """A sharded model (two blocks and the root) and its Adam, one step taken."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 8), nn.Linear(8, 2))
    fully_shard(model[2])
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(6, 4)).sum().backward()
    opt.step()
    return model, opt


def _full(model) -> dict:
    return {k: v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone()
            for k, v in model.state_dict().items()}


def _refusal(fn, *args) -> str:
    with pytest.raises(UserError) as e:
        fn(*args)
    return str(e.value)


# ------------------------------------------------------------------ room on the disk

def test_the_ranks_that_share_a_file_system_need_its_free_space_together(tmp_path):
    mb = 1_000_000
    shardedckpt.check_room([("n1", 7, 10 * mb, 5 * mb), ("n1", 7, 10 * mb, 5 * mb)], tmp_path)
    assert _refusal(shardedckpt.check_room, [("n1", 7, 10 * mb, 5 * mb),
                                             ("n1", 7, 10 * mb, 5 * mb + 1)], tmp_path) == (
        f"not enough free space for the sharded checkpoint at {tmp_path}: about 10.0 MB "
        f"needed by 2 rank(s), 10.0 MB free; free space there or choose another results_dir")
    # one file system seen with less free by a later rank: the least counts
    assert _refusal(shardedckpt.check_room, [("n1", 7, 12 * mb, 2 * mb),
                                             ("n1", 7, 3_250_000, 2 * mb)], tmp_path) == (
        f"not enough free space for the sharded checkpoint at {tmp_path}: about 4.0 MB "
        f"needed by 2 rank(s), 3.2 MB free; free space there or choose another results_dir")
    assert "9.0 MB free" in _refusal(shardedckpt.check_room, [
        ("n1", 7, 9 * mb, 2 * mb), ("n1", 7, 12 * mb, 8 * mb)], tmp_path)
    # other hosts, other file systems: apart; the one that does not fit is named
    shardedckpt.check_room([("n1", 7, 6 * mb, 5 * mb), ("n2", 7, 6 * mb, 5 * mb),
                            ("n1", 8, 6 * mb, 5 * mb)], tmp_path)
    assert "about 7.0 MB needed by 1 rank(s), 6.0 MB free" in _refusal(
        shardedckpt.check_room, [("n1", 7, 6 * mb, 5 * mb), ("n1", 8, 6 * mb, 7 * mb)], tmp_path)
    assert "needed by 3 rank(s)" in _refusal(
        shardedckpt.check_room, [("n2", 1, 9 * mb, 3 * mb + 1)] * 3 + [("n1", 1, 9 * mb, 1)],
        tmp_path)
    shardedckpt.check_room([], tmp_path)


def test_a_ranks_room_is_its_host_file_system_free_space_and_need(tmp_path):
    host, dev, free, need = shardedckpt.room(tmp_path / "not" / "yet", 1000)
    assert (host, dev, need) == (socket.gethostname(), os.stat(tmp_path).st_dev,
                                 nativewrite.need_bytes(1000))
    assert abs(free - shutil.disk_usage(tmp_path).free) < 1 << 30
    assert shardedckpt.room(tmp_path, 0)[3] == nativewrite.need_bytes(0)


# ------------------------------------------------------------------ the fault hooks

def test_the_fault_hook_names_one_point_of_one_step_in_torchruns_first_attempt(monkeypatch):
    monkeypatch.delenv("DDPFLOW_FAULT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert not shardedckpt._fault_at("mid-shard", 3)
    assert shardedckpt._faulty(Path("x"), 3) is None
    monkeypatch.setenv("DDPFLOW_FAULT", "mid-shard:3")
    assert shardedckpt._fault_at("mid-shard", 3)
    assert not shardedckpt._fault_at("mid-shard", 4)
    assert not shardedckpt._fault_at("after-rename", 3)
    assert shardedckpt._faulty(Path("x"), 4) is None
    assert shardedckpt._faulty(Path("x"), 3) is not None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert shardedckpt._fault_at("mid-shard", 3)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert not shardedckpt._fault_at("mid-shard", 3)
    assert shardedckpt._faulty(Path("x"), 3) is None


def _python(tmp_path, code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, text=True,
                          capture_output=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1",
                               **env})


def test_the_half_written_stream_keeps_half_its_first_chunk_then_the_rank_dies(tmp_path):
    r = _python(tmp_path, "from ddpflow.engine import shardedckpt as s\n"
                          "f = open('out', 'wb')\nw = s._HalfThenDie(f)\n"
                          "print(w.name, w.tell(), flush=True)\n"
                          "w.write(memoryview(b'0123456789'))\nprint('alive')\n")
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert r.stdout == "out 0\n"
    assert (tmp_path / "out").read_bytes() == b"01234"
    # a chunk of one 2-byte item: its first byte (at least one byte, never nothing)
    r = _python(tmp_path, "import array\nfrom ddpflow.engine import shardedckpt as s\n"
                          "s._HalfThenDie(open('one', 'wb')).write(memoryview(array.array("
                          "'h', [0x4142])))\nprint('alive')\n")
    assert (r.returncode, r.stdout) == (-signal.SIGKILL, "")
    assert (tmp_path / "one").read_bytes() == bytes(memoryview(
        array.array("h", [0x4142])).cast("B"))[:1]


RANK = """
import os, sys, torch
from pathlib import Path
import torch.distributed as td
from torch import nn
from torch.distributed.fsdp import fully_shard
from ddpflow.engine import shardedckpt
from ddpflow.engine.distributed import Dist
td.init_process_group("gloo", init_method="file://" + os.path.abspath("store"), rank=0,
                      world_size=1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
fully_shard(model[0]); fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
w = shardedckpt.ShardedWriter(Dist(0, 0, 1, torch.device("cpu"), "gloo"), Path("ck"), 5, True)
w.save(2, model, opt, {"step": 2}); w.wait()
print("saved 2", flush=True)
w.save(3, model, opt, {"step": 3}); w.wait()
print("saved 3", flush=True)
"""


def test_a_rank_dies_mid_shard_or_after_the_rename_where_the_hook_says(tmp_path):
    (tmp_path / "a").mkdir()
    r = _python(tmp_path / "a", RANK, DDPFLOW_FAULT="mid-shard:3")
    assert (r.returncode, r.stdout) == (-signal.SIGKILL, "saved 2\n"), r.stderr
    ck = tmp_path / "a" / "ck"
    assert sorted(p.name for p in ck.iterdir()) == [
        ".ckpt-000000003.dcp.tmp", "ckpt-000000002.dcp", "ckpt-000000002.dcp.sha256"]
    shard = ck / ".ckpt-000000003.dcp.tmp" / "__0_0.distcp"
    whole = (ck / "ckpt-000000002.dcp" / "__0_0.distcp").stat().st_size
    assert 0 < shard.stat().st_size < whole  # cut short, not a whole shard
    assert not (ck / ".ckpt-000000003.dcp.tmp" / ".metadata").exists()

    (tmp_path / "b").mkdir()
    r = _python(tmp_path / "b", RANK, DDPFLOW_FAULT="after-rename:3")
    assert (r.returncode, r.stdout) == (-signal.SIGKILL, "saved 2\n"), r.stderr
    ck = tmp_path / "b" / "ck"
    assert sorted(p.name for p in ck.iterdir()) == [
        "ckpt-000000002.dcp", "ckpt-000000002.dcp.sha256", "ckpt-000000003.dcp"]
    assert checkpoint.verify_folder(ck / "ckpt-000000003.dcp") == (
        "no checksum file (the write did not finish)")


# ------------------------------------------------------------------ writing and reading back

def test_a_sharded_checkpoint_is_a_checksummed_folder_that_loads_back(one_rank, tmp_path):
    import torch.distributed as td

    model, opt = _model()
    want = _full(model)
    want_opt = {k: v.full_tensor().clone() for k, v in opt.state[opt.param_groups[0]
                                                                    ["params"][0]].items()
                if hasattr(v, "full_tensor")}
    folder = tmp_path / "ck"
    stale = folder / ".ckpt-000000004.dcp.tmp"  # a killed write of this very step
    stale.mkdir(parents=True)
    (stale / "__7_0.distcp").write_bytes(b"old")
    writer = shardedckpt.ShardedWriter(one_rank, folder, 2, False)
    assert writer.group is not None and writer.group is not td.group.WORLD
    assert td.get_backend(writer.group) == "gloo"
    writer.save(4, model, opt, {"step": 4, "note": "four"})  # not in the background: done
    final = folder / "ckpt-000000004.dcp"
    assert sorted(p.name for p in folder.iterdir()) == ["ckpt-000000004.dcp",
                                                        "ckpt-000000004.dcp.sha256"]
    assert sorted(p.name for p in final.iterdir()) == [".metadata", "__0_0.distcp",
                                                       checkpoint.STATE]
    assert checkpoint.verify_folder(final) is None
    assert (folder / "ckpt-000000004.dcp.sha256").read_text() == "".join(
        f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n"
        for p in sorted(final.iterdir()))
    assert checkpoint.load_any(final) == {"step": 4, "note": "four"}

    # keep-last: the newest two, their sidecars with them
    for step in (5, 6):
        writer.save(step, model, opt, {"step": step})
    writer.wait()
    assert sorted(p.name for p in folder.iterdir()) == [
        "ckpt-000000005.dcp", "ckpt-000000005.dcp.sha256", "ckpt-000000006.dcp",
        "ckpt-000000006.dcp.sha256"]

    # another model's values, then the checkpoint's back: model, BatchNorm's statistics, Adam
    other, other_opt = _model(seed=1)
    other_opt.param_groups[0]["lr"] = 0.5  # (a scheduler moved it on)
    assert not torch.equal(_full(other)["0.weight"], want["0.weight"])
    shardedckpt.load_shards(folder / "ckpt-000000006.dcp", other, other_opt)
    got = _full(other)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    state = other_opt.state[other_opt.param_groups[0]["params"][0]]
    for k, v in want_opt.items():
        assert torch.equal(state[k].full_tensor(), v), k
    assert other_opt.param_groups[0]["lr"] == 0.1
    sd = shardedckpt.state_dicts(other, other_opt)
    assert sorted(sd) == ["model", "optimizer"] and "0.weight" in sd["model"]


def test_background_writes_raise_at_the_next_wait_and_leave_nothing(one_rank, tmp_path):
    model, opt = _model()
    folder = tmp_path / "ck"
    unpicklable = {"step": 3, "f": lambda: 0}
    sync = shardedckpt.ShardedWriter(one_rank, folder, 2, False)
    with pytest.raises(Exception, match="lambda"):
        sync.save(3, model, opt, unpicklable)  # not in the background: raised by save
    assert sorted(folder.iterdir()) == []
    background = shardedckpt.ShardedWriter(one_rank, folder, 2, True)
    background.save(3, model, opt, unpicklable)
    with pytest.raises(Exception, match="lambda"):
        background.wait()
    assert sorted(folder.iterdir()) == []
    # the next save raises the failed write's error before it starts its own
    background.save(3, model, opt, unpicklable)
    with pytest.raises(Exception, match="lambda"):
        background.save(4, model, opt, {"step": 4})
    assert sorted(folder.iterdir()) == []
    background.save(3, model, opt, {"step": 3})
    background.wait()
    background.wait()
    assert checkpoint.verify_folder(folder / "ckpt-000000003.dcp") is None


def test_a_full_disk_is_one_message_before_any_shard_is_written(one_rank, tmp_path,
                                                                 monkeypatch):
    model, opt = _model()
    folder = tmp_path / "ck"
    writer = shardedckpt.ShardedWriter(one_rank, folder, 2, False)
    # (a full disk cannot be made here: this rank sees 1000 bytes free)
    monkeypatch.setattr(shardedckpt, "free_bytes", lambda _p: 1000)
    message = _refusal(writer.save, 3, model, opt, {"step": 3})
    assert message.startswith(f"not enough free space for the sharded checkpoint at {folder}:")
    assert "needed by 1 rank(s), 0.0 MB free" in message
    assert sorted(folder.iterdir()) == []


def test_a_shard_write_that_fails_is_one_message_naming_the_folder(one_rank, tmp_path,
                                                                  monkeypatch):
    from torch.distributed.checkpoint import filesystem

    model, opt = _model()
    folder = tmp_path / "ck"
    writer = shardedckpt.ShardedWriter(one_rank, folder, 2, True)
    real = filesystem._write_item

    def full(*args, **kwargs):  # (a disk that fills up mid-write cannot be made here)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(filesystem, "_write_item", full)
    writer.save(3, model, opt, {"step": 3})
    with pytest.raises(UserError) as e:
        writer.wait()
    assert str(e.value).startswith(f"cannot write the sharded checkpoint at {folder}:")
    assert e.value.__cause__ is None and e.value.__suppress_context__
    assert sorted(folder.iterdir()) == []

    def broken(*args, **kwargs):
        raise ValueError("a bug, not a place")
    monkeypatch.setattr(filesystem, "_write_item", broken)
    writer.save(3, model, opt, {"step": 3})
    with pytest.raises(BaseException) as e:  # DCP's own error (a BaseException)
        writer.wait()
    assert type(e.value).__name__ == "CheckpointException"
    assert sorted(folder.iterdir()) == []
    monkeypatch.setattr(filesystem, "_write_item", real)
    writer.save(3, model, opt, {"step": 3})
    writer.wait()
    assert checkpoint.verify_folder(folder / "ckpt-000000003.dcp") is None


def test_the_whole_model_is_gathered_on_rank_0_alone(one_rank):
    from torch.distributed.tensor import DTensor

    model, _ = _model()
    want = _full(model)
    sd = shardedckpt.full_model(model, one_rank)
    assert sd.keys() == want.keys()
    for k, v in sd.items():
        assert not isinstance(v, DTensor) and v.device.type == "cpu", k
        assert torch.equal(v, want[k]), k
    assert shardedckpt.full_model(model, Dist(1, 1, 2, torch.device("cpu"), "gloo")) is None


TWO_RANKS = """
from torch import nn
from torch.distributed.fsdp import fully_shard
from ddpflow.engine import shardedckpt
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 8))
model[1].running_mean.fill_(d.rank + 1.0)  # each rank's own statistics, as after training
fully_shard(model[2]); fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
w = shardedckpt.ShardedWriter(d, root / "ck", 2, True)
w.save(1, model, opt, {"step": 1} if d.is_master else None)
w.wait()
torch.distributed.barrier()  # rank 0's thread has renamed the folder into place
after = model[1].running_mean.tolist()
model[1].running_mean.fill_(5.0)
shardedckpt.load_shards(root / "ck" / "ckpt-000000001.dcp", model, opt)
files = sorted(p.name for p in (root / "ck").iterdir())
torch.distributed.barrier()  # every rank has looked before rank 0 starts the next write
if d.rank == 1:  # (rank 1's disk fills up mid-write: cannot be made here)
    from torch.distributed.checkpoint import filesystem

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    filesystem._write_item = full
w.save(2, model, opt, {"step": 2} if d.is_master else None)
try:
    w.wait()
    error = None
except Exception as e:
    error = str(e)
print(json.dumps({"after": after, "loaded": model[1].running_mean.tolist(), "files": files,
                  "error": error}))
"""


def test_two_ranks_save_rank_0s_statistics_once_and_fail_together(tmp_path):
    outs = [out for out, _err in gloo_ranks(tmp_path, TWO_RANKS, 2, tiny_config(tmp_path))]
    for out in outs:
        assert out["after"] == out["loaded"] == [1.0] * 8  # rank 0's, on every rank
        assert out["files"] == ["ckpt-000000001.dcp", "ckpt-000000001.dcp.sha256"]
        # one rank's failed write: every rank raises it, as one message naming the folder
        assert out["error"].startswith(
            f"cannot write the sharded checkpoint at {tmp_path / 'ck'}: "), out["error"]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == outs[0]["files"]  # no tmp
    assert sorted(p.name for p in (tmp_path / "ck" / "ckpt-000000001.dcp").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "state.pt"]
    assert checkpoint.verify_folder(tmp_path / "ck" / "ckpt-000000001.dcp") is None
