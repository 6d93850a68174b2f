"""engine/checkpoint.py, engine/resume.py and engine/checkpointer.py, piece by piece: a
checkpoint written whole (its temp file's name, gone on a failure; its sidecar's exact text),
which files count as checkpoints and in which order, pruning to the newest `keep_last`, the
newest valid checkpoint of this very stage chosen and every skipped one named with why, a
sharded folder's sidecar checked file by file, the host copy a background write takes (its
own buffers, reused, in the tensor's layout, never overwritten while a write reads them), the
background writer's errors raised once, the messages for weights that are not a state dict;
the resume key, the checkpoint every rank hears of, the global batch kept on other ranks,
every part restored exactly (random streams, momentum layout, the epoch's position); when the
checkpointer saves, what a save holds, and what a NaN blocks. Real files and tensors on the
CPU, no training; a few subprocesses (a process group of one for FSDP, 2-3 gloo ranks).
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import tiny_config
from ddpflow.config import config_hash, from_dict
from ddpflow.core.errors import OneRankError, UserError
from ddpflow.engine import checkpoint, distributed, resume
from ddpflow.engine.checkpointer import Checkpointer, Parts, RankZeroWriter
from ddpflow.engine.distributed import Dist
from ddpflow.engine.ema import Ema
from ddpflow.engine.runtime import weights_sha256
from ddpflow.engine.state import StageFiles, TrainState
from ddpflow.results.provenance import make_record
from fixtures import gloo_ranks


def _refusal(fn, *args, **kw) -> str:
    with pytest.raises(UserError) as e:
        fn(*args, **kw)
    return str(e.value)


def _ckpt(folder: Path, step: int, key: str = "k", **extra) -> Path:
    return checkpoint.save(folder, step, {"step": step, "resume_key": key, **extra}, 100)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# ------------------------------------------------------------------ writing

def test_a_checkpoint_is_written_whole_with_its_sidecar(tmp_path):
    state = {"step": 7, "w": torch.arange(6.0).reshape(2, 3)}
    path = tmp_path / "new" / "deeper" / "ckpt-000000007.pt"
    digest = checkpoint.save_file(path, state)
    payload = path.read_bytes()
    assert digest == hashlib.sha256(payload).hexdigest()
    assert payload == checkpoint.serialize(state)
    assert Path(f"{path}.sha256").read_text() == f"{digest}  ckpt-000000007.pt\n"
    assert checkpoint.verify(path) is None
    back = checkpoint.load(path)
    assert back["step"] == 7 and torch.equal(back["w"], state["w"])
    assert sorted(p.name for p in path.parent.iterdir()) == [
        "ckpt-000000007.pt", "ckpt-000000007.pt.sha256"]  # no temp file left


def test_serialize_is_what_torch_save_writes():
    obj = {"a": torch.ones(3), "b": [1, 2]}
    back = torch.load(io.BytesIO(checkpoint.serialize(obj)), weights_only=True)
    assert torch.equal(back["a"], obj["a"]) and back["b"] == [1, 2]


def test_the_temp_file_is_named_for_remove_partial_and_gone_when_the_rename_fails(
        tmp_path, monkeypatch):
    seen, real = [], os.replace

    def spy(src, dst):
        seen.append(Path(src).name)
        return real(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    checkpoint.write_atomic(tmp_path / "ckpt-000000001.pt", b"abc")
    assert seen == [f".ckpt-000000001.pt.tmp{os.getpid()}"]
    assert list(tmp_path.glob(".ckpt-*.tmp*")) == []
    assert (tmp_path / "ckpt-000000001.pt").read_bytes() == b"abc"

    def fail(src, dst):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        checkpoint.write_atomic(tmp_path / "ckpt-000000002.pt", b"abc")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000001.pt"]


def test_a_temp_file_that_was_never_created_hides_no_error(tmp_path, monkeypatch):
    """open itself failing (an I/O error of the disk): that error, not one of the clean-up."""
    def failing(path, mode="r", *args, **kw):
        raise OSError(errno.EIO, "Input/output error", str(path))

    monkeypatch.setattr(checkpoint, "open", failing, raising=False)
    with pytest.raises(OSError) as e:
        checkpoint.write_atomic(tmp_path / "ckpt-000000001.pt", b"abc")
    assert e.value.errno == errno.EIO and list(tmp_path.iterdir()) == []


def test_fsync_of_a_folder_leaves_no_descriptor_open_and_a_missing_folder_is_no_error(tmp_path):
    before = _fds()
    for _ in range(5):
        checkpoint._fsync_dir(tmp_path)
    assert _fds() == before
    checkpoint._fsync_dir(tmp_path / "missing")  # nothing to sync: no error
    checkpoint.write_atomic(tmp_path / "x.pt", b"1")
    assert _fds() == before


def test_state_bytes_counts_every_tensor_in_nested_containers():
    state = {"a": torch.zeros(3, 4), "b": [torch.zeros(2, dtype=torch.float64), 5],
             "c": (torch.zeros(7, dtype=torch.int8), {"d": torch.zeros(0)}), "e": "text"}
    assert checkpoint.state_bytes(state) == 3 * 4 * 4 + 2 * 8 + 7
    assert checkpoint.state_bytes(torch.zeros(5, dtype=torch.bfloat16)) == 10
    assert checkpoint.state_bytes(3.0) == 0

    class Shard(torch.Tensor):  # a DTensor: this rank's part only
        def to_local(self):
            return torch.zeros(2)

    assert checkpoint.state_bytes([torch.zeros(10).as_subclass(Shard)]) == 8


# ------------------------------------------------------------------ the folder

def test_only_checkpoint_names_count_in_step_order(tmp_path):
    assert checkpoint.list_checkpoints(tmp_path / "missing") == []
    (tmp_path / "afile").write_text("")
    assert checkpoint.list_checkpoints(tmp_path / "afile") == []
    for name in ("ckpt-9.pt", "ckpt-10.dcp", "ckpt-000000003.pt", "ckpt-3.pt.sha256",
                 "ckpt-4.pth", "xckpt-5.pt", "ckpt-6.pt.tmp1", ".ckpt-7.pt.tmp1", "ckpt-.pt",
                 "ckpt-8.ptx", "best.pt"):
        (tmp_path / name).write_text("")
    assert checkpoint.list_checkpoints(tmp_path) == [
        (3, tmp_path / "ckpt-000000003.pt"), (9, tmp_path / "ckpt-9.pt"),
        (10, tmp_path / "ckpt-10.dcp")]


def test_save_names_the_step_and_keeps_the_newest(tmp_path):
    paths = [_ckpt(tmp_path, s) for s in (5, 20, 100)]
    assert [p.name for p in paths] == ["ckpt-000000005.pt", "ckpt-000000020.pt",
                                       "ckpt-000000100.pt"]
    path = checkpoint.save(tmp_path, 1000, {"step": 1000}, 2)
    assert path == tmp_path / "ckpt-000001000.pt"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-000000100.pt", "ckpt-000000100.pt.sha256",
        "ckpt-000001000.pt", "ckpt-000001000.pt.sha256"]


def test_prune_removes_old_files_folders_and_their_sidecars(tmp_path):
    for s in (1, 2):
        _ckpt(tmp_path, s)
    shard = tmp_path / "ckpt-000000003.dcp"
    shard.mkdir()
    (shard / "state.pt").write_bytes(b"x")
    (tmp_path / "ckpt-000000003.dcp.sha256").write_text("x")
    _ckpt(tmp_path, 4)
    (tmp_path / "best.pt").write_bytes(b"b")
    checkpoint.prune(tmp_path, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "best.pt", "ckpt-000000002.pt", "ckpt-000000002.pt.sha256", "ckpt-000000003.dcp",
        "ckpt-000000003.dcp.sha256", "ckpt-000000004.pt", "ckpt-000000004.pt.sha256"]
    checkpoint.prune(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "best.pt", "ckpt-000000004.pt", "ckpt-000000004.pt.sha256"]
    checkpoint.prune(tmp_path, 1)  # nothing more to remove
    assert len(list(tmp_path.iterdir())) == 3


def test_prune_removes_a_checkpoint_whose_write_never_reached_its_sidecar(tmp_path):
    _ckpt(tmp_path, 1)
    (tmp_path / "ckpt-000000001.pt.sha256").unlink()  # killed before the sidecar
    _ckpt(tmp_path, 2)
    checkpoint.prune(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-000000002.pt", "ckpt-000000002.pt.sha256"]


@pytest.fixture
def read_only(tmp_path):
    """A folder on a tmpfs mounted read-only (as a disk that errors remounts itself)."""
    d = tmp_path / "ro"
    d.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)],
                      capture_output=True).returncode != 0:
        pytest.skip("no tmpfs mount here")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def test_a_folder_that_cannot_be_removed_is_no_error(read_only):
    """remove() is clean-up after a failed sharded write (on a disk turned read-only, say):
    the write's own error must be what the user reads, not the clean-up's."""
    folder = read_only / ".ckpt-000000002.dcp.tmp"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "shard").write_bytes(b"x")
    subprocess.run(["mount", "-o", "remount,ro", str(read_only)], check=True)
    checkpoint.remove(folder)
    assert (folder / "sub" / "shard").read_bytes() == b"x"


def test_remove_takes_a_file_a_folder_or_a_link_itself_never_what_a_link_points_at(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    checkpoint.remove(f)
    assert not f.exists()
    checkpoint.remove(f)  # already gone: no error
    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "x").write_text("x")
    checkpoint.remove(d)
    assert not d.exists()
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep").write_text("x")
    link = tmp_path / "link"
    link.symlink_to(target)
    checkpoint.remove(link)
    assert not link.is_symlink() and (target / "keep").read_text() == "x"


def test_empty_folder_and_place_folder(tmp_path):
    tmp = tmp_path / "a" / ".ckpt-000000002.dcp.tmp"
    checkpoint.empty_folder(tmp)
    assert tmp.is_dir() and list(tmp.iterdir()) == []
    (tmp / "old").write_text("x")
    checkpoint.empty_folder(tmp)
    assert tmp.is_dir() and list(tmp.iterdir()) == []
    (tmp / "new").write_text("n")
    final = tmp_path / "a" / "ckpt-000000002.dcp"
    final.mkdir()
    (final / "stale").write_text("s")
    checkpoint.place_folder(tmp, final)
    assert not tmp.exists() and [p.name for p in final.iterdir()] == ["new"]
    tmp.mkdir()
    (tmp / "again").write_text("a")
    other = tmp_path / "a" / "ckpt-000000003.dcp"
    checkpoint.place_folder(tmp, other)  # nothing there before
    assert [p.name for p in other.iterdir()] == ["again"]


def test_set_aside_moves_an_earlier_runs_checkpoints_to_old(tmp_path, capsys):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / "notes").write_text("x")
    checkpoint.set_aside(folder)  # no checkpoint: left alone
    checkpoint.set_aside(tmp_path / "missing")
    assert (folder / "notes").exists() and capsys.readouterr().err == ""
    old = tmp_path / "checkpoints.old"
    old.mkdir()
    (old / "older").write_text("x")
    _ckpt(folder, 4)
    checkpoint.set_aside(folder)
    assert not folder.exists()
    assert sorted(p.name for p in old.iterdir()) == [
        "ckpt-000000004.pt", "ckpt-000000004.pt.sha256", "notes"]
    assert capsys.readouterr().err == f"ddpflow: checkpoints of an earlier run moved to {old}\n"


def test_remove_partial_clears_killed_writes_only(tmp_path, capsys):
    checkpoint.remove_partial(tmp_path / "missing")
    (tmp_path / ".ckpt-000000005.pt.tmp123").write_bytes(b"half")
    (tmp_path / ".ckpt-000000006.dcp.tmp").mkdir()
    (tmp_path / ".ckpt-000000006.dcp.tmp" / "shard").write_bytes(b"half")
    _ckpt(tmp_path, 4)
    (tmp_path / ".other.tmp1").write_text("")
    checkpoint.remove_partial(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".other.tmp1", "ckpt-000000004.pt", "ckpt-000000004.pt.sha256"]
    assert sorted(capsys.readouterr().err.splitlines()) == [
        "ddpflow: removing unfinished checkpoint write .ckpt-000000005.pt.tmp123",
        "ddpflow: removing unfinished checkpoint write .ckpt-000000006.dcp.tmp"]


# ------------------------------------------------------------------ choosing one to resume

def _warnings():
    said = []

    def warn(text, file=None):
        assert file is sys.stderr
        said.append(text)

    return said, warn


def test_latest_valid_is_the_newest_of_this_stage_and_names_each_one_skipped(tmp_path):
    _ckpt(tmp_path, 1)
    _ckpt(tmp_path, 2, key="other")
    _ckpt(tmp_path, 3)
    _ckpt(tmp_path, 4)
    p4 = tmp_path / "ckpt-000000004.pt"
    p4.write_bytes(p4.read_bytes()[:-10])  # truncated after its sidecar
    _ckpt(tmp_path, 5)
    (tmp_path / "ckpt-000000005.pt.sha256").unlink()  # killed before the sidecar
    junk = tmp_path / "ckpt-000000006.pt"
    checkpoint.write_atomic(junk, b"not a torch file")
    digest = hashlib.sha256(b"not a torch file").hexdigest()
    checkpoint.write_atomic(Path(f"{junk}.sha256"), f"{digest}  {junk.name}\n".encode())
    checkpoint.save_file(tmp_path / "ckpt-000000007.pt", [7, "k"])  # verifies, is no state
    said, warn = _warnings()
    path, state = checkpoint.latest_valid(tmp_path, "k", warn=warn)
    assert path == tmp_path / "ckpt-000000003.pt" and state == {"step": 3, "resume_key": "k"}
    skip = "ddpflow: warning: skipping checkpoint"
    assert said == [
        f"{skip} ckpt-000000007.pt: holds a list, not a ddpflow checkpoint",
        f"{skip} ckpt-000000006.pt: cannot be loaded (UnpicklingError)",
        f"{skip} ckpt-000000005.pt: no checksum file (the write did not finish)",
        f"{skip} ckpt-000000004.pt: checksum mismatch (truncated or corrupt)"]
    said, warn = _warnings()
    path, state = checkpoint.latest_valid(tmp_path, "other", warn=warn)
    assert path.name == "ckpt-000000002.pt" and state["step"] == 2
    assert said[-1] == (f"{skip} ckpt-000000003.pt: written with another config, code or "
                        f"starting weights")
    said, warn = _warnings()
    assert checkpoint.latest_valid(tmp_path, "none", warn=warn) is None and len(said) == 7
    assert checkpoint.latest_valid(tmp_path / "missing", "k") is None


def test_latest_valid_warns_on_stderr_by_default(tmp_path, capsys):
    _ckpt(tmp_path, 1, key="other")
    assert checkpoint.latest_valid(tmp_path, "k") is None
    out = capsys.readouterr()
    assert out.out == "" and out.err == (
        "ddpflow: warning: skipping checkpoint ckpt-000000001.pt: written with another config, "
        "code or starting weights\n")


def _sharded(folder: Path, step: int, key: str = "k") -> Path:
    d = folder / f"ckpt-{step:09d}.dcp"
    (d / "shards").mkdir(parents=True)
    checkpoint.write_atomic(d / checkpoint.STATE, checkpoint.serialize(
        {"step": step, "resume_key": key}))
    (d / "shards" / "0.distcp").write_bytes(b"shard zero")
    sums = "".join(f"{checkpoint.sha256_of(f)}  {f.relative_to(d)}\n"
                   for f in sorted(d.rglob("*")) if f.is_file())
    Path(f"{d}.sha256").write_text(sums)
    return d


def test_a_sharded_folder_verifies_file_by_file(tmp_path):
    d = _sharded(tmp_path, 8)
    side = Path(f"{d}.sha256")
    assert checkpoint.verify_folder(d) is None
    assert checkpoint.load_any(d) == {"step": 8, "resume_key": "k"}
    path, state = checkpoint.latest_valid(tmp_path, "k")
    assert path == d and state["step"] == 8
    good = side.read_text()
    (d / "shards" / "0.distcp").write_bytes(b"shard zer0")
    assert checkpoint.verify_folder(d) == (
        "checksum mismatch in shards/0.distcp (truncated or corrupt)")
    (d / "shards" / "0.distcp").write_bytes(b"shard zero")
    side.write_text(good.splitlines()[0] + "\n")  # cut before state.pt's line
    assert checkpoint.verify_folder(d) == "checksum file cut short"
    side.write_text(good + "garbage-line\n")
    assert checkpoint.verify_folder(d) == "checksum mismatch in garbage-line (truncated or corrupt)"
    side.write_text(good + "\n   \n")  # blank lines are no entries
    assert checkpoint.verify_folder(d) is None
    side.write_text(f"{'0' * 64}  ../outside\n" + good)
    assert checkpoint.verify_folder(d) == (
        "its checksum file names a file outside the folder (not written by ddpflow)")
    side.write_text(f"{'0' * 64}  gone\n" + good)
    assert checkpoint.verify_folder(d) == "cannot be read (No such file or directory)"
    side.write_text(f"{'0' * 64}  shards\n" + good)
    assert checkpoint.verify_folder(d).startswith("cannot be read (")
    side.write_text(good.replace("  state.pt", "  state.ptx"))
    assert checkpoint.verify_folder(d) == "checksum file cut short"
    side.unlink()
    assert checkpoint.verify_folder(d) == "no checksum file (the write did not finish)"
    said, warn = _warnings()
    assert checkpoint.latest_valid(tmp_path, "k", warn=warn) is None
    assert said == ["ddpflow: warning: skipping checkpoint ckpt-000000008.dcp: no checksum file "
                    "(the write did not finish)"]


def test_a_sharded_sidecar_with_odd_names_or_bytes_is_read_not_a_crash(tmp_path):
    d = _sharded(tmp_path, 8)
    side = Path(f"{d}.sha256")
    (d / "a  b").write_bytes(b"two spaces")  # a name with the separator in it
    side.write_text(side.read_text() + f"{checkpoint.sha256_of(d / 'a  b')}  a  b\n")
    assert checkpoint.verify_folder(d) is None
    side.write_bytes(side.read_bytes() + b"\xff\xfe  shards/0.distcp\n")  # not UTF-8
    assert checkpoint.verify_folder(d) == (
        "checksum mismatch in shards/0.distcp (truncated or corrupt)")


def test_load_reads_data_only(tmp_path):
    path = tmp_path / "code.pt"
    torch.save({"model": torch.nn.Linear(1, 1)}, path)
    with pytest.raises(Exception, match="weights_only"):
        checkpoint.load(path)


# ------------------------------------------------------------------ the host copy

def test_host_copy_is_a_separate_copy_per_key_in_the_same_structure():
    copy = checkpoint.HostCopy()
    w = torch.ones(2, 3, requires_grad=True)
    state = {"a": w, "b": torch.full((2, 3), 2.0), "n": [torch.zeros(2), (torch.ones(2), 7)],
             "s": "text"}
    got = copy(state, "model")
    assert set(copy.buffers) == {"model/a", "model/b", "model/n/0", "model/n/1/0"}
    assert torch.equal(got["a"], torch.ones(2, 3))
    assert torch.equal(got["b"], torch.full((2, 3), 2.0))
    assert not got["a"].requires_grad and got["a"].grad_fn is None
    assert type(got["n"]) is list and type(got["n"][1]) is tuple and got["n"][1][1] == 7
    assert got["s"] == "text"
    with torch.no_grad():
        w.mul_(5)
    assert torch.equal(got["a"], torch.ones(2, 3))  # training goes on: the copy stays
    again = copy(state, "model")
    assert again["a"].data_ptr() == got["a"].data_ptr()  # the buffers are reused
    assert torch.equal(again["a"], torch.full((2, 3), 5.0))
    assert not again["a"].is_pinned()


def test_host_copy_takes_a_new_buffer_for_a_new_shape_dtype_or_layout():
    copy = checkpoint.HostCopy()
    first = copy(torch.ones(2, 3), "k")
    bigger = copy(torch.ones(3, 3), "k")
    assert bigger.shape == (3, 3) and bigger.data_ptr() != first.data_ptr()
    half = copy(torch.ones(3, 3, dtype=torch.float16), "k")
    assert half.dtype == torch.float16
    t = torch.arange(2 * 3 * 4 * 5.0).reshape(2, 3, 4, 5)
    plain = copy(t, "x")
    cl = t.to(memory_format=torch.channels_last)
    got = copy(cl, "x")
    assert got.stride() == cl.stride() and got.data_ptr() != plain.data_ptr()
    assert torch.equal(got, t)
    copy.finish()  # no GPU: nothing to wait for, no error


# ------------------------------------------------------------------ the background writer

def test_the_background_writer_runs_one_job_at_a_time_in_a_daemon_thread():
    writer = checkpoint.BackgroundWriter()
    go, done = threading.Event(), []

    def job(x):
        assert go.wait(60)
        done.append((x, threading.current_thread().name))

    writer.submit(job, 1)
    thread = writer.thread
    assert thread.daemon and thread.name == "ddpflow-checkpoint-writer" and done == []
    go.set()
    writer.submit(job, 2)  # waits for the first
    assert done[0] == (1, "ddpflow-checkpoint-writer")
    writer.wait()
    assert done == [(1, "ddpflow-checkpoint-writer"), (2, "ddpflow-checkpoint-writer")]
    assert writer.thread is None


def test_a_writers_error_is_raised_once_in_the_training_thread():
    for enabled in (True, False):
        writer = checkpoint.BackgroundWriter(enabled)
        ran = []

        def boom(exc):
            raise exc

        if enabled:
            writer.submit(boom, KeyboardInterrupt("stop"))
            with pytest.raises(KeyboardInterrupt, match="stop"):
                writer.submit(ran.append, 1)  # the error first, the job not run
            assert ran == []
            writer.submit(boom, OSError("disk"))
            with pytest.raises(OSError, match="disk"):
                writer.wait()
            writer.wait()  # raised once
        else:
            with pytest.raises(OSError, match="disk"):
                writer.submit(boom, OSError("disk"))
        writer.submit(ran.append, 3)
        if not enabled:
            assert ran == [3] and writer.thread is None  # ran in this very thread, at once
        writer.wait()
        assert ran == [3]


# ------------------------------------------------------------------ weights from a file

def _weights_error(tmp_path, obj, name="w.pt") -> str:
    path = tmp_path / name
    torch.save(obj, path)
    return _refusal(checkpoint.load_weights, path, "stages.fit.init")


def test_load_weights_takes_a_state_dict_or_a_checkpoints_model(tmp_path):
    sd = {"w": torch.ones(2), "b": torch.zeros(1)}
    torch.save(sd, tmp_path / "sd.pt")
    got = checkpoint.load_weights(tmp_path / "sd.pt", "s")
    assert list(got) == ["w", "b"] and torch.equal(got["w"], sd["w"])
    torch.save({"model": sd, "step": 3}, tmp_path / "ck.pt")
    assert list(checkpoint.load_weights(tmp_path / "ck.pt", "s")) == ["w", "b"]


def test_load_weights_says_what_a_file_holds_instead(tmp_path):
    path = tmp_path / "w.pt"
    head = f"stages.fit.init: {path} holds "
    tail = (", not a state dict (a mapping of names to tensors: torch.save(model.state_dict(), "
            "...)) nor a ddpflow checkpoint")
    assert _weights_error(tmp_path, torch.zeros(2, 3)) == (
        f"{head}a single tensor of shape (2, 3){tail}")
    assert _weights_error(tmp_path, [1, 2, 3]) == f"{head}a list of 3 items{tail}"
    assert _weights_error(tmp_path, (1,)) == f"{head}a tuple of 1 items{tail}"
    assert _weights_error(tmp_path, 5) == f"{head}a int{tail}"
    assert _weights_error(tmp_path, {}) == f"{head}an empty dict{tail}"
    assert _weights_error(tmp_path, {"model": {}}) == f"{head}an empty dict{tail}"
    assert _weights_error(tmp_path, {"model": 3, "w": torch.ones(1)}) == (
        f"{head}a dict whose 'model' is a int, not a tensor (keys model, w: another tool's "
        f"training checkpoint? save its state dict alone){tail}")
    many = {f"k{i}": torch.ones(1) for i in range(6)}
    many[1] = torch.ones(1)
    assert _weights_error(tmp_path, many) == (
        f"{head}a dict whose '1' is a Tensor, not a tensor (keys k0, k1, k2, k3, k4, ...: "
        f"another tool's training checkpoint? save its state dict alone){tail}")
    five = {f"k{i}": torch.ones(1) for i in range(4)} | {"x" * 80: 1}
    assert _weights_error(tmp_path, five) == (
        f"{head}a dict whose {'x' * 60!r} is a int, not a tensor (keys k0, k1, k2, k3, "
        f"{'x' * 80}: another tool's training checkpoint? save its state dict alone){tail}")
    assert checkpoint._not_a_state_dict(torch.nn.Linear(1, 1)) == "a whole Linear model object"


def test_load_weights_of_an_empty_truncated_or_code_holding_file(tmp_path):
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    assert _refusal(checkpoint.load_weights, empty, "init") == (
        f"init: {empty} is empty (a copy or save cut short)")
    text = tmp_path / "text.pt"
    text.write_text("hello\nworld\n")
    msg = _refusal(checkpoint.load_weights, text, "init")
    assert msg.startswith(f"init: {text} cannot be loaded as weights (KeyError: ")
    assert msg.endswith("); is it truncated or not a PyTorch file?") and "\n" not in msg
    assert _refusal(checkpoint.load_weights, tmp_path / "missing.pt", "init") == (
        f"init: {tmp_path / 'missing.pt'} cannot be loaded as weights (FileNotFoundError: "
        f"[Errno 2] No such file or directory: '{tmp_path / 'missing.pt'}'); is it truncated "
        f"or not a PyTorch file?")
    code = tmp_path / "code.pt"
    torch.save(torch.nn.Linear(1, 1), code)
    assert _refusal(checkpoint.load_weights, code, "init") == (
        f"init: {code} holds pickled Python objects (torch.nn.modules.linear.Linear), e.g. a "
        f"whole model saved with torch.save(model); ddpflow reads weights data-only and never "
        f"runs a file's code: save model.state_dict() instead")


def test_unloadable_keeps_the_unpicklers_reason_not_torchs_advice():
    e = RuntimeError("Weights only load failed. Advice...\n WeightsUnpickler error: "
                     "  Unsupported operand 149\n\nCheck the documentation")
    assert checkpoint._unloadable(e) == (
        "cannot be loaded as weights (RuntimeError: Unsupported operand 149); is it truncated "
        "or not a PyTorch file?")
    assert checkpoint._unloadable(ValueError("first\nsecond")) == (
        "cannot be loaded as weights (ValueError: first); is it truncated or not a PyTorch file?")
    assert checkpoint._unloadable(ValueError("")) == (
        "cannot be loaded as weights (ValueError: ); is it truncated or not a PyTorch file?")
    assert checkpoint._unloadable(ValueError("y" * 300)) == (
        f"cannot be loaded as weights (ValueError: {'y' * 160}); is it truncated or not a "
        f"PyTorch file?")


def test_check_fits_names_the_first_tensor_that_does_not_fit():
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    own = model.state_dict()
    checkpoint.check_fits(model, dict(own), "init")
    missing = {k: v for k, v in own.items() if k != "0.bias"}
    assert _refusal(checkpoint.check_fits, model, missing, "init") == (
        "init does not fit the model: it has no tensor '0.bias'")
    assert _refusal(checkpoint.check_fits, model, {**own, "1.weight": torch.zeros(3, 1)},
                    "init") == ("init does not fit the model: '1.weight' is (3, 1) there, "
                                "(1, 3) in the model")
    assert _refusal(checkpoint.check_fits, model, {**own, "z": torch.zeros(1),
                                                   "extra": torch.zeros(1)}, "init") == (
        "init does not fit the model: it has tensors the model lacks, first 'extra'")


# ------------------------------------------------------------------ resume.py

def _dist(rank: int = 0, world: int = 1) -> Dist:
    return Dist(rank, rank, world, torch.device("cpu"), None)


def _files(tmp_path: Path, key: str = "k") -> StageFiles:
    return StageFiles("s1", tmp_path / "stages" / "s1", {"seed": 0}, "ch", "sh", {"r": 1}, key,
                      monitor="val_acc", mode="max")


def test_the_resume_key_leaves_out_placement_and_follows_the_inputs(tmp_path):
    def files(init=None, **top):
        return resume.stage_files(from_dict(tiny_config(tmp_path, **top)), "s1",
                                  {"fingerprint": "fp"}, init)

    base = files()
    cfg = from_dict(tiny_config(tmp_path))
    assert base.stage == "s1" and base.out == cfg.stage_dir("s1")
    assert base.config == cfg.to_dict() and base.config_hash == cfg.hash
    assert base.stage_hash == cfg.stage_hash("s1") and (base.monitor, base.mode) == ("", "")
    assert base.record == make_record(cfg, "s1", "fp", None)
    assert base.resume_key == config_hash(
        {**base.record, "stage_hash": cfg.stage_hash("s1", placement=False)})
    fewer = files(hardware={"nproc_per_node": 1})
    assert fewer.resume_key == base.resume_key  # a requeue onto fewer GPUs resumes
    assert fewer.record != base.record and fewer.stage_hash != base.stage_hash
    assert files(seed=1).resume_key != base.resume_key
    init = tmp_path / "init.pt"
    init.write_bytes(b"weights")
    with_init = files(init)
    assert with_init.record["init_sha256"] == hashlib.sha256(b"weights").hexdigest()
    assert with_init.resume_key != base.resume_key
    init.write_bytes(b"other weights")
    assert files(init).resume_key != with_init.resume_key


def _chosen(world=4, accum=1, batch=32, step=10, saved=None) -> resume.Chosen:
    return resume.Chosen(Path("/r/ckpt-000000010.pt"), step, world, accum, batch, saved)


def test_choose_hands_every_rank_the_checkpoint_and_how_it_was_trained(tmp_path):
    files = _files(tmp_path)
    assert resume.choose(files, _dist()) is None  # no folder yet
    _ckpt(files.ckpt_dir, 3)
    _ckpt(files.ckpt_dir, 6, world=2, accum=3, batch_size=16)
    _ckpt(files.ckpt_dir, 9, key="another run")
    got = resume.choose(files, _dist())
    assert got == resume.Chosen(files.ckpt_dir / "ckpt-000000006.pt", 6, 2, 3, 16, {
        "step": 6, "resume_key": "k", "world": 2, "accum": 3, "batch_size": 16})
    assert resume.choose(files, _dist(world=2)).world == 2
    (files.ckpt_dir / "ckpt-000000006.pt").unlink()
    old = resume.choose(files, _dist(world=2))  # an older ddpflow's: as this run
    assert (old.path.name, old.step, old.world, old.accum, old.batch) == (
        "ckpt-000000003.pt", 3, 0, 0, 0)
    assert old.saved == {"step": 3, "resume_key": "k"}


def test_a_finished_stage_run_again_on_other_ranks_starts_afresh(tmp_path):
    files = _files(tmp_path)
    _ckpt(files.ckpt_dir, 6, world=2, accum=1, batch_size=16)
    assert resume.choose(files, _dist(world=4)).step == 6  # not finished: resumed
    (files.out / "summary.json").write_text("{}")
    assert resume.choose(files, _dist(world=4)) is None
    assert resume.choose(files, _dist(world=2)).step == 6  # the same ranks: resumed
    _ckpt(files.ckpt_dir, 8)  # an older ddpflow's checkpoint: no world recorded
    assert resume.choose(files, _dist(world=4)).step == 8


def test_a_checkpoint_rank_0_cannot_choose_from_is_one_message(tmp_path, monkeypatch):
    files = _files(tmp_path)

    def stale(folder):  # a network filesystem's listing failing
        raise OSError(116, "Stale file handle", str(folder / ("x" * 300)))

    monkeypatch.setattr(checkpoint, "list_checkpoints", stale)
    text = f"[Errno 116] Stale file handle: '{files.ckpt_dir / ('x' * 300)}'"[:160]
    assert _refusal(resume.choose, files, _dist()) == (
        f"cannot choose a checkpoint to resume from in {files.ckpt_dir}: OSError: {text}; move "
        f"the damaged file away (or set checkpoint.resume: never to start afresh)")
    files.out.mkdir(parents=True, exist_ok=True)
    (files.out / "summary.json").write_text("{}")  # whatever the folder holds: still told
    assert f"OSError: {text}; move" in _refusal(resume.choose, files, _dist(world=4))


def test_layout_keeps_the_global_batch_on_other_ranks():
    assert resume.layout(None, 32, 1, 2, "s") == (32, 1, None)
    assert resume.layout(_chosen(world=0), 32, 1, 2, "s") == (32, 1, None)
    assert resume.layout(_chosen(world=2, accum=1, batch=32), 32, 1, 2, "s") == (32, 1, None)
    was = ("ckpt-000000010.pt (step 10) was trained on 4 rank(s) with a global batch of 128 "
           "(32/rank x 4 x 1 accumulation)")
    assert resume.layout(_chosen(), 32, 1, 2, "s") == (
        32, 2, f"resuming {was}; on 2 rank(s) it stays 128: 32/rank x 2 x 2 accumulation")
    assert resume.layout(_chosen(world=1, accum=2, batch=8), 8, 1, 1, "s") == (
        8, 2, "resuming ckpt-000000010.pt (step 10) was trained on 1 rank(s) with a global batch "
              "of 16 (8/rank x 1 x 2 accumulation); on 1 rank(s) it stays 16: 8/rank x 1 x 2 "
              "accumulation")
    assert resume.layout(_chosen(world=2, accum=1, batch=12), 12, 1, 3, "s") == (
        4, 2, "resuming ckpt-000000010.pt (step 10) was trained on 2 rank(s) with a global batch "
              "of 24 (12/rank x 2 x 1 accumulation); on 3 rank(s) it stays 24: 4/rank x 3 x 2 "
              "accumulation (micro-batches of 4, not 12: BatchNorm statistics come from smaller "
              "batches from here on)")


@pytest.mark.parametrize("was, world, expect", [
    ((2, 2, 6), 3, (2, 4)),  # 4 would share 24 over 3 ranks, but does not divide 6
    ((1, 1, 10), 2, (5, 1)),
    ((1, 1, 3), 3, (1, 1)),  # only single samples share it
    ((1, 2, 4), 8, (1, 1)),
    ((4, 1, 8), 2, (8, 2)),
])
def test_layout_takes_the_largest_micro_batch_that_shares_evenly(was, world, expect):
    w, a, b = was
    got = resume.layout(_chosen(world=w, accum=a, batch=b), b, a, world, "s")
    assert got[:2] == expect
    assert got[0] * got[1] * world == w * a * b


def test_a_global_batch_the_ranks_cannot_share_is_one_message():
    assert _refusal(resume.layout, _chosen(world=2, accum=1, batch=32), 32, 1, 3,
                    "stages.fit") == (
        "stages.fit: ckpt-000000010.pt (step 10) was trained on 2 rank(s) with a global batch "
        "of 64 (32/rank x 2 x 1 accumulation), which 3 ranks cannot share evenly; resume on a "
        "number of ranks that divides 64 (hardware.nproc_per_node, or the GPUs the job gets), "
        "or set checkpoint.resume: never to start the stage afresh")


def _parts(ema: bool = False, bias: float = 0.0) -> Parts:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    nn.init.constant_(model.bias, bias)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    scaler = torch.amp.GradScaler("cpu", init_scale=64.0)
    return Parts(model, model, opt, sched, scaler, Ema(model, 0.5, 1) if ema else None, False)


def _trained(parts: Parts, steps: int = 3) -> None:
    for _ in range(steps):
        parts.opt.zero_grad()
        parts.model(torch.ones(4, 3)).sum().backward()
        parts.opt.step()
        parts.sched.step()
        if parts.ema:
            parts.ema.update_now(parts.model)
    parts.scaler.scale(torch.ones(1))
    parts.scaler.update(16.0)


def _saved_state(parts: Parts, step: int = 3, rng=(), **extra) -> dict:
    return {"model": parts.model.state_dict(), "optimizer": parts.opt.state_dict(),
            "scheduler": parts.sched.state_dict(), "scaler": parts.scaler.state_dict(),
            **({"ema": parts.ema.weights(), "ema_updates": parts.ema.updates()}
               if parts.ema else {}),
            "step": step, "resume_key": "k", "rng": list(rng), "step_in_epoch": 12, **extra}


def test_restore_loads_every_part_exactly(tmp_path):
    src = _parts(ema=True, bias=1.0)
    _trained(src)
    saved = _saved_state(src)
    dst = _parts(ema=True, bias=-1.0)
    got = resume.restore(_chosen(saved=saved, accum=0), _files(tmp_path), _dist(), dst, 1)
    assert got is saved
    for a, b in zip(src.model.state_dict().values(), dst.model.state_dict().values()):
        assert torch.equal(a, b)
    assert torch.equal(dst.opt.state_dict()["state"][0]["momentum_buffer"],
                       src.opt.state_dict()["state"][0]["momentum_buffer"])
    assert dst.sched.last_epoch == 3 and dst.opt.param_groups[0]["lr"] == 0.1 * 0.5 ** 3
    assert dst.scaler.get_scale() == 16.0
    assert dst.ema.updates() == 3
    for a, b in zip(src.ema.weights().values(), dst.ema.weights().values()):
        assert torch.equal(a, b)
    assert resume.restore(None, _files(tmp_path), _dist(), dst, 1) is None


def test_a_restored_momentum_takes_its_parameters_layout(tmp_path):
    def conv_parts(layout):
        torch.manual_seed(0)
        model = nn.Conv2d(3, 4, 3).to(memory_format=layout)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        return Parts(model, model, opt, sched, torch.amp.GradScaler("cpu", enabled=False), None,
                     False)

    src = conv_parts(torch.contiguous_format)  # a checkpoint of another layout
    _trained_conv = src.model(torch.ones(2, 3, 5, 5)).sum()
    _trained_conv.backward()
    src.opt.step()
    dst = conv_parts(torch.channels_last)
    resume.restore(_chosen(saved=_saved_state(src)), _files(tmp_path), _dist(), dst, 1)
    weight = dst.model.weight
    momentum = dst.opt.state[weight]["momentum_buffer"]
    assert momentum.stride() == weight.stride() != src.model.weight.stride()
    assert torch.equal(momentum, src.opt.state[src.model.weight]["momentum_buffer"])


def test_restore_sets_this_ranks_random_streams_when_as_many_ranks_wrote_it(tmp_path):
    streams = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        random.seed(seed)
        streams.append(distributed.rng_state(torch.device("cpu")))
    expect = (torch.rand(1).item(), random.random())  # the streams after seed 2
    parts = _parts()
    saved = _saved_state(parts, rng=streams)
    torch.manual_seed(99)
    random.seed(99)
    resume.restore(_chosen(saved=saved, world=2), _files(tmp_path), _dist(world=1), parts, 1)
    torch_next, python_next = torch.rand(1).item(), random.random()
    torch.manual_seed(99)
    random.seed(99)
    assert (torch_next, python_next) == (torch.rand(1).item(), random.random())  # untouched
    files = _files(tmp_path)
    path = _ckpt(files.ckpt_dir, 3, **{k: v for k, v in saved.items()
                                       if k not in ("step", "resume_key")})
    chosen = resume.Chosen(path, 3, 2, 1, 32, None)  # another rank's: read here
    got = resume.restore(chosen, files, _dist(rank=1, world=2), parts, 1)
    assert got["step"] == 3
    assert (torch.rand(1).item(), random.random()) == expect  # rank 1's streams: seed 2


def test_restore_counts_the_epochs_position_in_this_runs_micro_batches(tmp_path):
    parts = _parts()
    saved = _saved_state(parts)  # 12 micro-batches in: 3 steps of 4
    got = resume.restore(_chosen(saved=saved, accum=4), _files(tmp_path), _dist(), parts, 2)
    assert got["step_in_epoch"] == 6 and saved["step_in_epoch"] == 12  # 3 steps of 2
    got = resume.restore(_chosen(saved=saved, accum=4), _files(tmp_path), _dist(), parts, 4)
    assert got["step_in_epoch"] == 12
    got = resume.restore(_chosen(saved=saved, accum=0), _files(tmp_path), _dist(), parts, 3)
    assert got["step_in_epoch"] == 12  # an older ddpflow's: as it was
    saved["step_in_epoch"] = 10  # 2 whole steps of 4 (and a part step, redone)
    got = resume.restore(_chosen(saved=saved, accum=4), _files(tmp_path), _dist(), parts, 3)
    assert got["step_in_epoch"] == 6


def test_another_ranks_read_of_the_chosen_checkpoint(tmp_path):
    path = _ckpt(tmp_path, 7)
    assert resume._load_chosen(path, 7, "k") == ({"step": 7, "resume_key": "k"}, None)
    assert resume._load_chosen(path, 8, "k") == (None, "the file here holds step 7")
    assert resume._load_chosen(path, 7, "j") == (None, "the file here holds step 7 of another run")
    assert resume._load_chosen(path, 8, "j") == (None, "the file here holds step 7 of another run")
    missing = tmp_path / ("ckpt-000000009.pt" + "y" * 100)
    text = f"[Errno 2] No such file or directory: '{missing}'"[:120]
    assert resume._load_chosen(missing, 9, "k") == (
        None, f"it cannot be read here (FileNotFoundError: {text})")
    files = _files(tmp_path)
    files.ckpt_dir.mkdir(parents=True)
    chosen = resume.Chosen(path, 8, 1, 1, 32, None)
    assert _refusal(resume.restore, chosen, files, _dist(rank=1, world=2), _parts(), 1) == (
        f"rank 0 cannot resume from ckpt-000000007.pt, the checkpoint rank 0 chose (step 8): "
        f"the file here holds step 7; every rank must see the same {files.ckpt_dir} (a shared "
        f"filesystem)")


def test_optimizer_state_takes_each_parameters_layout():
    w = nn.Parameter(torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last))
    b = nn.Parameter(torch.randn(3))
    opt = torch.optim.Adam([w, b])
    momentum = torch.randn(2, 3, 4, 5)  # contiguous: another layout
    bias_m = torch.randn(3)
    step = torch.tensor(4.0)
    opt.state[w] = {"exp_avg": momentum.clone(), "step": step}
    opt.state[b] = {"exp_avg": bias_m}
    resume._match_layouts(opt)
    got = opt.state[w]["exp_avg"]
    assert got.stride() == w.stride() and torch.equal(got, momentum)
    assert opt.state[w]["step"] is step  # not a parameter's shape: left alone
    assert opt.state[b]["exp_avg"] is bias_m  # already in its layout
    half = torch.randn(2, 3, 4, 5, dtype=torch.float16)
    opt.state[w]["exp_avg"] = half
    resume._match_layouts(opt)
    assert opt.state[w]["exp_avg"].dtype == torch.float16
    assert opt.state[w]["exp_avg"].stride() == w.stride()


# ------------------------------------------------------------------ checkpointer.py

def _checkpointer(tmp_path: Path, ema: bool = False, **ck) -> Checkpointer:
    cfg = from_dict(tiny_config(tmp_path, checkpoint=ck)).checkpoint
    files = _files(tmp_path)
    return Checkpointer(files, cfg, _dist(), _parts(ema=ema, bias=2.0))


def test_checkpoints_are_due_every_n_steps_and_epochs_or_never(tmp_path):
    c = _checkpointer(tmp_path, every_steps=4, every_epochs=3)
    assert [s for s in range(13) if c.due_at_step(s)] == [0, 4, 8, 12]
    assert [e for e in range(1, 10) if c.due_at_epoch_end(e)] == [3, 6, 9]
    c = _checkpointer(tmp_path, every_steps=0, every_epochs=0)
    assert not any(c.due_at_step(s) or c.due_at_epoch_end(s) for s in range(1, 9))
    c = _checkpointer(tmp_path, every_steps=1, every_epochs=1)
    assert all(c.due_at_step(s) and c.due_at_epoch_end(s) for s in range(1, 9))


def _state(step: int = 6, **kw) -> TrainState:
    return TrainState(step=step, epoch=1, step_in_epoch=step, best={"step": 4, "value": 0.5},
                      world=1, accum=1, batch_size=32, **kw)


def test_a_save_writes_the_whole_state_and_best_pt_when_due(tmp_path):
    c = _checkpointer(tmp_path, ema=True, keep_last=2)
    _trained(c.parts)
    files = c.files
    assert c.save(_state(6), lambda: _state(6, elapsed_s=2.5), (-1, 5)) is None  # inputs alone
    c.wait()
    assert not (files.out / "best.pt").exists()
    saved = checkpoint.load(files.ckpt_dir / "ckpt-000000006.pt")
    assert saved["step"] == 6 and saved["elapsed_s"] == 2.5 and saved["world"] == 1
    assert {k: saved[k] for k in files.stamp()} == files.stamp()
    for k, t in c.parts.model.state_dict().items():
        assert torch.equal(saved["model"][k], t)
    for k, t in c.parts.ema.weights().items():
        assert torch.equal(saved["ema"][k], t)
    assert saved["ema_updates"] == 3
    assert saved["optimizer"]["state"][0]["momentum_buffer"].shape == (2, 3)
    assert saved["scheduler"]["last_epoch"] == 3 and saved["scaler"]["scale"] == 16.0
    assert len(saved["rng"]) == 1 and torch.equal(saved["rng"][0]["torch"], torch.get_rng_state())
    c.best_due = True
    assert c.save(_state(8), lambda: _state(8), (-1, -1), with_ckpt=False) is None
    c.wait()
    assert not c.best_due
    assert not (files.ckpt_dir / "ckpt-000000008.pt").exists()
    best = checkpoint.load(files.out / "best.pt")
    assert best["step"] == 4 and best["value"] == 0.5 and best["weights"] == "ema"
    for k, t in c.parts.model.state_dict().items():
        assert torch.equal(best["model_raw"][k], t)
    for s in (10, 12):
        c.save(_state(s), lambda s=s: _state(s), (-1, -1))
    c.wait()
    assert [p.name for _, p in checkpoint.list_checkpoints(files.ckpt_dir)] == [
        "ckpt-000000010.pt", "ckpt-000000012.pt"]  # keep_last 2


def test_a_save_without_ema_holds_no_ema(tmp_path):
    c = _checkpointer(tmp_path, background=False)
    c.best_due = True
    c.save(_state(6), lambda: _state(6), (-1, -1))
    saved = checkpoint.load(c.files.ckpt_dir / "ckpt-000000006.pt")
    assert "ema" not in saved and "ema_updates" not in saved
    best = checkpoint.load(c.files.out / "best.pt")
    assert best["weights"] == "raw" and torch.equal(best["model"]["bias"], torch.full((2,), 2.0))


def test_weights_a_nan_loss_touched_are_never_saved(tmp_path):
    c = _checkpointer(tmp_path)
    c.best_due = True
    assert c.save(_state(6), lambda: _state(6), (0, -1)) == [(0, -1)]
    assert c.save(_state(6), lambda: _state(6), (5, 2)) == [(5, 2)]
    c.wait()
    assert c.best_due  # best.pt still comes with the next save
    assert not c.files.out.exists()


def test_the_host_copy_is_what_gets_written_while_training_goes_on(tmp_path, monkeypatch):
    c = _checkpointer(tmp_path)
    go, real = threading.Event(), checkpoint.save

    def held(*args):  # the write, held until training has gone on
        assert threading.current_thread().name == "ddpflow-checkpoint-writer"
        assert go.wait(60)
        return real(*args)

    monkeypatch.setattr(checkpoint, "save", held)
    c.save(_state(6), lambda: _state(6), (-1, -1))
    with torch.no_grad():
        c.parts.model.bias.fill_(7.0)  # the next steps, while the write is held
    go.set()
    c.wait()
    saved = checkpoint.load(c.files.ckpt_dir / "ckpt-000000006.pt")
    assert torch.equal(saved["model"]["bias"], torch.full((2,), 2.0))


def test_the_next_save_copies_only_once_the_write_in_flight_is_done(tmp_path, monkeypatch):
    """The host buffers are reused: the next save's copy must not land in them while the
    previous write still reads them."""
    c = _checkpointer(tmp_path)
    go, real = threading.Event(), checkpoint.save
    done = []

    def held(folder, step, state, keep):
        if step == 6:
            assert go.wait(60)
        real(folder, step, state, keep)
        done.append(step)

    monkeypatch.setattr(checkpoint, "save", held)
    c.save(_state(6), lambda: _state(6), (-1, -1))
    with torch.no_grad():
        c.parts.model.bias.fill_(7.0)
    second = threading.Thread(target=c.save, args=(_state(8), lambda: _state(8), (-1, -1)))
    second.start()
    threading.Timer(0.3, go.set).start()  # the second save has started meanwhile
    second.join()
    c.wait()
    assert done == [6, 8]
    first = checkpoint.load(c.files.ckpt_dir / "ckpt-000000006.pt")
    assert torch.equal(first["model"]["bias"], torch.full((2,), 2.0))
    assert torch.equal(checkpoint.load(c.files.ckpt_dir / "ckpt-000000008.pt")["model"]["bias"],
                       torch.full((2,), 7.0))


def test_rank_0s_write_errors_become_one_rank_errors(tmp_path):
    writer = RankZeroWriter()
    for exc, kind in ((UserError("disk full"), OneRankError), (OneRankError("x"), OneRankError),
                      (OSError("io"), OSError)):
        writer.submit(_raise, exc)
        with pytest.raises(kind) as e:
            writer.wait()
        assert type(e.value) is kind and str(e.value) == str(exc)
        if kind is not OneRankError or type(exc) is OneRankError:
            assert e.value is exc  # the very error, with its traceback from the writer
    c = _checkpointer(tmp_path)
    c.writer.submit(_raise, UserError("cannot write"))
    with pytest.raises(OneRankError, match="^cannot write$"):
        c.wait()


def _raise(exc):
    raise exc


def test_restore_clears_a_killed_runs_leftovers_and_sets_a_stale_run_aside(tmp_path, capsys):
    c = _checkpointer(tmp_path)
    files = c.files
    _ckpt(files.ckpt_dir, 4, key="stale")
    (files.ckpt_dir / ".ckpt-000000005.pt.tmp9").write_bytes(b"half")
    (files.out / "failed.json").write_text("{}")
    assert c.restore(None, 1) is None
    assert not (files.out / "failed.json").exists() and not files.ckpt_dir.exists()
    assert sorted(p.name for p in Path(f"{files.ckpt_dir}.old").iterdir()) == [
        "ckpt-000000004.pt", "ckpt-000000004.pt.sha256"]
    capsys.readouterr()
    src = _parts(bias=5.0)
    _trained(src)
    path = checkpoint.save(files.ckpt_dir, 3, {
        **_saved_state(src), "epoch": 2, "elapsed_s": 1.5, "unknown": 1}, 3)
    (files.ckpt_dir / ".ckpt-000000005.pt.tmp9").write_bytes(b"half")
    chosen = resume.choose(files, c.dist)
    assert chosen.path == path
    state = c.restore(chosen, 1)
    assert state == TrainState(step=3, epoch=2, step_in_epoch=12, elapsed_s=1.5)
    assert torch.equal(c.parts.model.bias, src.model.bias)
    assert sorted(p.name for p in files.ckpt_dir.iterdir()) == [
        "ckpt-000000003.pt", "ckpt-000000003.pt.sha256"]  # kept: resumed from


def test_restore_on_another_rank_leaves_the_folder_to_rank_0(tmp_path):
    cfg = from_dict(tiny_config(tmp_path)).checkpoint
    files = _files(tmp_path)
    c = Checkpointer(files, cfg, _dist(rank=1, world=2), _parts())
    _ckpt(files.ckpt_dir, 4, key="stale")
    (files.out / "failed.json").write_text("{}")
    assert c.restore(None, 1) is None
    assert (files.out / "failed.json").exists() and (files.ckpt_dir / "ckpt-000000004.pt").exists()


def test_final_weights_are_the_plain_modules_and_their_hash(tmp_path):
    c = _checkpointer(tmp_path)
    wrapped = nn.DataParallel(c.parts.model)
    c.parts.model = wrapped
    assert c.parts.plain is wrapped.module
    weights, digest = c.final_weights()
    assert list(weights) == ["weight", "bias"] and torch.equal(weights["bias"],
                                                               torch.full((2,), 2.0))
    assert digest == weights_sha256(wrapped.module) == weights_sha256(weights)


_SHARDED = """
import json, os, sys
from pathlib import Path
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from ddpflow.config import from_dict
from ddpflow.engine import checkpoint, distributed, resume
from ddpflow.engine.checkpointer import Checkpointer, Parts
from ddpflow.engine.state import StageFiles, TrainState

cfg = from_dict(json.loads(os.environ["DDPFLOW_TEST_CFG"]))
d = distributed.setup(cfg.hardware, "always")  # a group of one: FSDP needs one
root = Path(sys.argv[1])
files = StageFiles("s1", root / "s1", {}, "c", "s", {}, "k", monitor="m", mode="max")


def parts(bias):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    nn.init.constant_(model[1].bias, bias)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return Parts(model, model, opt, sched, torch.amp.GradScaler("cpu", enabled=False), None, True)


c = Checkpointer(files, cfg.checkpoint, d, parts(3.0))
out = {}
for step, best in ((5, True), (7, False), (9, True)):
    c.best_due = best
    st = TrainState(step=step, epoch=1, best={"step": step, "value": 0.5})
    c.save(st, lambda: st, (-1, -1), with_ckpt=step != 9)
    c.wait()
    out[step] = sorted(x.name for x in files.ckpt_dir.iterdir())
best = checkpoint.load(files.out / "best.pt")
weights, digest = c.final_weights()
out["best"] = [best["step"], best["model"]["1.bias"].tolist()]
out["final"] = [weights["1.bias"].tolist(), digest]
out["state"] = sorted(checkpoint.load_any(files.ckpt_dir / "ckpt-000000007.dcp"))
c = Checkpointer(files, cfg.checkpoint, d, parts(-1.0))
out["step"] = c.restore(resume.choose(files, d), 1).step
out["restored"] = c.final_weights()[0]["1.bias"].tolist()
print(json.dumps(out))
distributed.teardown(d)
"""


def test_a_sharded_stages_checkpointer_saves_shards_best_pt_and_restores_them(tmp_path):
    """strategy fsdp's path through the checkpointer, on a process group of one: each
    checkpoint a folder (keep_last 1), best.pt the whole model gathered, the shards read back."""
    script = tmp_path / "sharded.py"
    script.write_text(_SHARDED)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DDPFLOW_TEST_CFG": json.dumps(
        tiny_config(tmp_path, checkpoint={"keep_last": 1}))}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], text=True, env=env,
                          capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["5"] == ["ckpt-000000005.dcp", "ckpt-000000005.dcp.sha256"]
    assert out["7"] == out["9"] == ["ckpt-000000007.dcp", "ckpt-000000007.dcp.sha256"]
    assert out["best"] == [9, [3.0, 3.0]]
    assert out["final"][0] == [3.0, 3.0]
    weights = {"0.weight": torch.zeros(4, 3), "0.bias": torch.zeros(4),
               "1.weight": torch.zeros(2, 4), "1.bias": torch.zeros(2)}
    assert len(out["final"][1]) == 64 and out["final"][1] != weights_sha256(weights)
    assert "optimizer" not in out["state"] and "model" not in out["state"]
    assert {"scheduler", "scaler", "rng", "step", "resume_key"} <= set(out["state"])
    assert out["step"] == 7 and out["restored"] == [3.0, 3.0]


# ------------------------------------------------------------------ on several ranks

def _ranks(tmp_path: Path, body: str, n: int) -> list:
    """`body` on n gloo ranks (tests/fixtures.py gloo_ranks): each rank's JSON line."""
    return [out for out, _err in gloo_ranks(tmp_path, body, n, tiny_config(tmp_path))]


_OTHER_RUNS = """
from ddpflow.core.errors import UserError
from ddpflow.engine import checkpoint, resume
from ddpflow.engine.state import StageFiles
key = "k" if d.rank == 0 else f"run {d.rank}"  # ranks 1 and 2 expect another run's file
files = StageFiles("s1", root / "s1", {}, "c", "s", {}, key, monitor="m", mode="max")
if d.rank == 0:
    checkpoint.save(files.ckpt_dir, 8, {"step": 8, "resume_key": "k"}, 3)
distributed.gather_objects(d, None)
try:
    resume.restore(resume.choose(files, d), files, d, None, 1)
    out = "no error"
except UserError as e:
    out = str(e)
print(json.dumps(out), flush=True)
"""


def test_ranks_that_cannot_resume_the_chosen_file_name_the_first_of_them(tmp_path):
    said = _ranks(tmp_path, _OTHER_RUNS, 3)
    assert said == [f"rank 1 cannot resume from ckpt-000000008.pt, the checkpoint rank 0 chose "
                    f"(step 8): the file here holds step 8 of another run; every rank must see "
                    f"the same {tmp_path / 's1' / 'checkpoints'} (a shared filesystem)"] * 3


_SHARDED_RANKS = """
from torch import nn
from torch.distributed.fsdp import fully_shard
from ddpflow.engine import checkpoint
from ddpflow.engine.checkpointer import Checkpointer, Parts
from ddpflow.engine.state import StageFiles, TrainState

written, real = [], checkpoint.write_atomic


def spy(path, *args, **kw):  # what this rank writes itself (its shards: DCP's writer)
    written.append(Path(path).name)
    return real(path, *args, **kw)


checkpoint.write_atomic = spy
files = StageFiles("s1", root / "s1", {}, "c", "s", {}, "k", monitor="m", mode="max")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
parts = Parts(model, model, opt, sched, torch.amp.GradScaler("cpu", enabled=False), None, True)
c = Checkpointer(files, cfg.checkpoint, d, parts)
for step, best in ((4, True), (6, False)):
    c.best_due = best
    st = TrainState(step=step, epoch=1, best={"step": step, "value": 0.5})
    c.save(st, lambda: st, (-1, -1))
    c.wait()
print(json.dumps(sorted(written)), flush=True)
"""


def test_on_sharded_ranks_rank_0_alone_writes_the_whole_files(tmp_path):
    rank0, rank1 = _ranks(tmp_path, _SHARDED_RANKS, 2)
    assert rank1 == []
    assert rank0 == sorted(["best.pt", "best.pt.sha256", "state.pt", "state.pt",
                            "ckpt-000000004.dcp.sha256", "ckpt-000000006.dcp.sha256"])
    assert checkpoint.load(tmp_path / "s1" / "best.pt")["step"] == 4
