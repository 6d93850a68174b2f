"""core/writing.py and core/nativewrite.py, edge by edge: the names in a message when a
write fails (the outermost place the user chose), the file a write leaves (mode, JSON text),
a folder replaced only when it is ddpflow's and put back when the swap fails, claims of a
folder and a file, locks that name their output, and how a C++ writer's error becomes one
message. Fast: no training, no torch.
"""

from __future__ import annotations

import errno
import itertools
import os
from pathlib import Path

import pytest

from ddpflow.core import nativewrite, writing
from ddpflow.core.errors import UserError


def _refusal(fn, *args, **kw) -> str:
    with pytest.raises(UserError) as e:
        fn(*args, **kw)
    return str(e.value)


# ------------------------------------------------------------------ single files

def test_a_failed_write_names_the_file_or_what_the_caller_calls_it(tmp_path):
    (tmp_path / "f").write_text("")
    bad = tmp_path / "f" / "x.json"
    assert _refusal(writing.write_bytes_atomic, bad, b"{}") == (
        f"cannot write x.json at {bad}: a part of the path is a file, not a folder; choose "
        f"another path")
    assert _refusal(writing.write_bytes_atomic, bad, b"{}", "the plan").startswith(
        f"cannot write the plan at {bad}:")
    src = tmp_path / "src"
    src.write_text("x")
    assert _refusal(writing.move_into_place, src, bad).startswith(f"cannot write x.json at {bad}")
    assert src.read_text() == "x"


def test_a_file_inside_a_place_being_written_is_named_by_that_place(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(UserError) as e:
        with writing.writing(tmp_path / "bundle", "the bundle"):
            writing.write_bytes_atomic(tmp_path / "f" / "inner.json", b"{}")
    assert str(e.value).startswith(f"cannot write the bundle at {tmp_path / 'bundle'}: a part"), e


def test_an_error_the_user_cannot_fix_keeps_its_type():
    with pytest.raises(OSError) as e:
        with writing.writing("/x", "a file"):
            raise OSError(errno.EIO, "Input/output error")
    assert e.value.errno == errno.EIO and not isinstance(e.value, UserError)


def test_a_written_file_has_the_usual_mode_and_leaves_no_temp(tmp_path, monkeypatch):
    old = os.umask(0o022)
    try:
        writing.write_bytes_atomic(tmp_path / "a.bin", b"abc")
    finally:
        os.umask(old)
    assert (tmp_path / "a.bin").stat().st_mode & 0o777 == 0o644
    assert os.listdir(tmp_path) == ["a.bin"]
    moved = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (moved.append(Path(a).name), real(a, b)))
    writing.write_bytes_atomic(tmp_path / "b.json", b"{}")
    assert moved[0].startswith(".b.json.tmp") and (tmp_path / "b.json").read_bytes() == b"{}"


def test_json_is_written_sorted_and_indented_by_two(tmp_path):
    writing.write_json_atomic(tmp_path / "a.json", {"b": 1, "a": [1]})
    assert (tmp_path / "a.json").read_text() == '{\n  "a": [\n    1\n  ],\n  "b": 1\n}\n'


def test_a_scratch_folder_that_is_gone_is_no_error(tmp_path):
    writing.remove_scratch(tmp_path / "nodes")
    (tmp_path / "nodes" / "x").mkdir(parents=True)
    writing.remove_scratch(tmp_path / "nodes")
    assert not (tmp_path / "nodes").exists()


def test_preallocating_an_empty_file_is_no_error(tmp_path):
    """posix_fallocate refuses a length of 0 (EINVAL): nothing to reserve."""
    (tmp_path / "empty").write_bytes(b"")
    writing.preallocate(tmp_path / "empty")
    (tmp_path / "sized").write_bytes(b"\0" * 10000)
    writing.preallocate(tmp_path / "sized")
    assert (tmp_path / "sized").stat().st_blocks * 512 >= 10000


# ------------------------------------------------------------------ folders

def _build(text: str):
    def build(partial: Path) -> str:
        (partial / "model.pt").write_text(text)
        return text
    return build


def test_a_folder_is_built_under_missing_parents_with_or_without_the_lock(tmp_path):
    for lock in (True, False):
        target = tmp_path / f"lock{lock}" / "a" / "bundle"
        assert writing.build_folder(target, _build("1"), "the bundle", lock=lock) == "1"
        assert (target / "model.pt").read_text() == "1"
        assert writing.marked_files(target) == {"model.pt"}


def test_a_folder_is_not_built_over_the_folder_you_are_in(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _refusal(writing.build_folder, tmp_path, _build("1"), "the bundle") == (
        f"cannot write the bundle at {tmp_path}: it is the folder you are in (or holds it), "
        f"which would be replaced; give a new folder, e.g. --out {tmp_path / 'bundle'}")


def test_whether_a_target_exists_is_what_check_replaceable_returns(tmp_path):
    assert writing.check_replaceable(tmp_path / "none", "the bundle") is False
    (tmp_path / "empty").mkdir()
    assert writing.check_replaceable(tmp_path / "empty", "the bundle") is True
    writing.build_folder(tmp_path / "ours", _build("1"), "the bundle")
    assert writing.check_replaceable(tmp_path / "ours", "the bundle") is True


@pytest.mark.parametrize("n, shown", [
    (5, "'f0', 'f1', 'f2', 'f3', 'f4')"),
    (6, "'f0', 'f1', 'f2', 'f3', 'f4' and 1 more)"),
    (8, "'f0', 'f1', 'f2', 'f3', 'f4' and 3 more)"),
])
def test_a_foreign_folder_is_refused_naming_at_most_five_of_its_files(tmp_path, n, shown):
    target = tmp_path / "out"
    target.mkdir()
    for i in range(n):
        (target / f"f{i}").write_text("mine")
    text = _refusal(writing.build_folder, target, _build("1"), "the bundle")
    assert text.startswith(f"the bundle: {target} already holds files ddpflow did not write "
                           f"({shown}; ddpflow never deletes"), text
    assert sorted(os.listdir(target)) == [f"f{i}" for i in range(n)]


def _partial_cannot_move(monkeypatch) -> None:
    """os.replace fails for the built folder only (a fault injected: a rename across
    devices), as it would after the old target was moved aside."""
    real = os.replace

    def replace(src, dst):
        if ".partial-" in Path(src).name:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)


def test_a_failed_swap_puts_the_old_folder_back(tmp_path, monkeypatch):
    target = tmp_path / "bundle"
    writing.build_folder(target, _build("old"), "the bundle")
    _partial_cannot_move(monkeypatch)
    with pytest.raises(OSError):
        writing.build_folder(target, _build("new"), "the bundle")
    monkeypatch.undo()
    assert (target / "model.pt").read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == [".bundle.lock", "bundle"]  # no partial, no old


def test_stale_temp_folders_of_a_killed_build_are_removed_and_nothing_else(tmp_path):
    target = tmp_path / "bundle"
    (tmp_path / ".bundle.partial-abc").mkdir()
    (tmp_path / ".bundle.old-123" / "x").mkdir(parents=True)
    (tmp_path / "keep").mkdir()
    (tmp_path / ".bundle.partial-link").symlink_to(tmp_path / "keep")
    writing.build_folder(target, _build("1"), "the bundle")
    assert sorted(os.listdir(tmp_path)) == [".bundle.lock", ".bundle.partial-link", "bundle",
                                            "keep"]


def test_claiming_a_folder(tmp_path):
    folder = tmp_path / "a" / "b"
    assert writing.claim_folder(folder, "the report", ["r.html"]) == folder
    assert writing.marked_files(folder) == {"r.html"}
    marker = folder / writing.MARKER
    inode = marker.stat().st_ino
    (folder / "r.html").write_text("x")
    writing.claim_folder(folder, "the report", ["r.html"])  # nothing new: the marker stays
    assert marker.stat().st_ino == inode
    writing.claim_folder(folder, "the report", ["r.html", "p.png"])
    assert writing.marked_files(folder) == {"r.html", "p.png"}


def test_an_older_ddpflow_folder_without_a_marker_is_claimed_by_legacy(tmp_path):
    folder = tmp_path / "rep"
    folder.mkdir()
    (folder / "r.html").write_text("old")
    assert _refusal(writing.claim_folder, folder, "the report", ["r.html"]).startswith(
        f"the report: {folder} already holds 'r.html', not written by ddpflow")
    assert writing.claim_folder(folder, "the report", ["r.html"],
                                legacy=lambda p: True) == folder
    assert (folder / "r.html").read_text() == "old"


def test_a_marker_that_is_a_symlink_is_not_trusted(tmp_path):
    writing.write_marker(tmp_path, "x", ["a"])
    other = tmp_path / "other"
    other.mkdir()
    (other / writing.MARKER).symlink_to(tmp_path / writing.MARKER)
    assert writing.marked_files(tmp_path) == {"a"} and writing.marked_files(other) is None


def test_claiming_a_file(tmp_path):
    p = tmp_path / "log.txt"
    assert writing.claim_file(p, "the log", lambda p: False) == p
    (tmp_path / "real").write_text("x")
    p.symlink_to(tmp_path / "real")
    assert _refusal(writing.claim_file, p, "the log", lambda p: True).startswith(
        f"the log: {p} is a symbolic link; ddpflow never deletes")


def test_a_second_writer_of_an_output_is_told_which_output(tmp_path):
    target = tmp_path / "x" / "y" / "bundle"
    with writing.output_lock(target, "the bundle"):
        text = _refusal(lambda: writing.output_lock(target, "the bundle").__enter__())
    assert text.startswith(f"the bundle {target} is being written by another ddpflow process "
                           f"(pid {os.getpid()}"), text


# ------------------------------------------------------------------ C++ writers

def test_a_writers_need_is_its_payload_with_the_margin():
    assert nativewrite.need_bytes(0) == nativewrite.SLACK
    assert nativewrite.need_bytes(-5) == nativewrite.SLACK
    assert nativewrite.need_bytes(1000) == 1250 + nativewrite.SLACK


def test_free_bytes_of_a_folder(tmp_path):
    free = nativewrite.free_bytes(tmp_path)
    assert isinstance(free, int) and free > 0


def test_a_cycle_of_causes_is_walked_once():
    a, b = ValueError("a"), ValueError("b")
    a.__context__, b.__context__ = b, a
    assert list(itertools.islice(nativewrite._causes(a), 10)) == [a, b]


@pytest.mark.parametrize("text, first", [
    ("[enforce fail at inline_container.cc:672] . unexpected writer state\nat frame 1",
     "unexpected writer state"),
    ("[enforce fail at inline_container.cc:1] [x] no room\nmore", "[x] no room"),
    ("[enforce fail at inline_container.cc:1] " + "y" * 300, "y" * 160),
])
def test_torchs_zip_writer_stopping_is_one_message_with_its_first_words(text, first):
    user = nativewrite.native_error(RuntimeError(text), "/out/m.pt", "the model")
    assert str(user) == (f"cannot write the model at /out/m.pt: torch's writer stopped "
                         f"({first}); check the free space and permissions there, or choose "
                         f"another place")
    assert user.errno == errno.EIO


def test_inside_a_native_writer_errors_of_the_place_are_one_message(tmp_path):
    with pytest.raises(UserError) as e:
        with nativewrite.native_writer(tmp_path / "m.pt", "the model", 10):
            raise RuntimeError("basic_ios::clear: No space left on device")
    assert str(e.value).startswith(f"cannot write the model at {tmp_path / 'm.pt'}: no space")
    with pytest.raises(KeyError):  # a bug stays a bug
        with nativewrite.native_writer(tmp_path / "m.pt", "the model", 10):
            raise KeyError("x")


def test_free_space_is_asked_in_the_name_of_the_place_being_written(tmp_path):
    with pytest.raises(UserError) as e:
        with writing.writing(tmp_path / "bundle", "the bundle"):
            writing.require_free_space(tmp_path, 1 << 62, "its shards")
    assert str(e.value).startswith(f"not enough free space for the bundle at "
                                   f"{tmp_path / 'bundle'}: about "), e.value
    with writing.writing(tmp_path / "other", "the report"):
        pass
    with pytest.raises(UserError) as e:  # outside: the place is its own again
        writing.require_free_space(tmp_path, 1 << 62, "its shards")
    assert str(e.value).startswith(f"not enough free space for its shards at {tmp_path}: "), e


def test_a_failed_move_into_a_new_place_keeps_its_error_and_leaves_nothing(tmp_path,
                                                                             monkeypatch):
    _partial_cannot_move(monkeypatch)
    with pytest.raises(OSError) as e:
        writing.build_folder(tmp_path / "bundle", _build("new"), "the bundle")
    assert e.value.errno == errno.EXDEV
    assert os.listdir(tmp_path) == [".bundle.lock"]


@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_a_log_is_refused_where_a_folder_or_a_fifo_is(tmp_path, kind):
    log = tmp_path / "run.log"
    log.mkdir() if kind == "folder" else os.mkfifo(log)
    what = "a folder" if kind == "folder" else "not a regular file"
    assert _refusal(writing.check_log_place, log, {}) == (
        f"--log {log} is {what}; give --log a file of its own, e.g. run.log")
