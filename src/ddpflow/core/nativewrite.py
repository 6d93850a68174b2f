"""The C++ writers behind the writing boundary: torch.save into a file, torch.distributed.
checkpoint (DCP), TorchScript's `save`, the ONNX exporter and safetensors.

They fail in their own words on a full or read-only file system: TorchScript's zip writer
throws from a destructor and aborts the process (SIGABRT, no Python exception at all),
torch.save raises `[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534`,
DCP wraps each rank's error in a CheckpointException (a BaseException, with a traceback per
rank) and safetensors says `Error while serializing: I/O error: No space left on device`.
So every such writer runs inside `native_writer`, once:
  - before it starts, its folder must be writable and its file system have the free space,
    with a margin, for what it is about to write (`need_bytes`): a writer that would abort
    never starts;
  - an error it raises that names a full disk, a quota, a read-only place, a permission, or
    the zip writer's `unexpected pos` / `enforce fail` (a write cut short) is one UserError
    naming the place (`native_error`); any other error stays as it is (a bug).
The caller removes what it half-wrote (it wrote under a temp name), so nothing partial is
left where a complete file would be looked for. No torch import here (core stays light).
"""

from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from ddpflow.core import writing

MARGIN = 1.25  # a writer's file is its tensors' bytes plus headers, padding, code (ONNX)
SLACK = 64 << 10  # bytes on top: a small file still needs its blocks and metadata

# what a C++ writer's message says -> the errno it stands for (first match wins)
NATIVE_WORDS = (
    ("No space left on device", errno.ENOSPC), ("StorageFull", errno.ENOSPC),
    ("Disk quota exceeded", errno.EDQUOT), ("Read-only file system", errno.EROFS),
    ("Permission denied", errno.EACCES), ("Not a directory", errno.ENOTDIR),
    ("Is a directory", errno.EISDIR), ("File name too long", errno.ENAMETOOLONG),
    # PyTorchStreamWriter (torch.save, DCP's shards, TorchScript) when a write was short:
    # the file system took fewer bytes than it was given
    ("unexpected pos", errno.ENOSPC), ("file write failed", errno.ENOSPC),
)
ZIP_WRITER = "enforce fail at inline_container"  # any other failure of torch's zip writer


def need_bytes(payload: int) -> int:
    """Free bytes a writer of `payload` bytes of tensors needs, with the margin."""
    return int(max(0, payload) * MARGIN) + SLACK


def free_bytes(folder: str | Path) -> int:
    """Free bytes of `folder`'s file system (an unusable folder: one UserError)."""
    with writing.writing(folder, "the folder"):
        return shutil.disk_usage(folder).free


def _causes(err: BaseException):
    """err and what it was raised from (__cause__ / __context__). (DCP's CheckpointException
    quotes every rank's error and traceback in its own message.)"""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def native_error(err: BaseException, place: str | Path, what: str) -> writing.PlaceError | None:
    """One UserError naming `place` for what a writer raised on a full, read-only or
    forbidden place (its OSError, or its words for one); None for any other error."""
    for e in _causes(err):
        if isinstance(e, OSError) and (user := writing.user_os_error(e, place, what)):
            return user
    for e in _causes(err):
        text = str(e)
        for words, code in NATIVE_WORDS:
            if words in text:
                return writing.user_os_error(OSError(code, words), place, what)
    for e in _causes(err):
        if ZIP_WRITER in str(e):
            first = str(e).split("] ", 1)[-1].strip(" .").splitlines()[0][:160]
            user = writing.PlaceError(f"cannot write {what} at {place}: torch's writer stopped "
                                      f"({first}); check the free space and permissions there, "
                                      f"or choose another place")
            user.errno, user.filename = errno.EIO, str(place)
            return user
    return None


@contextmanager
def native_writer(place: str | Path, what: str, payload: int, folder: str | Path | None = None):
    """Around one C++ writer that writes about `payload` bytes at `place` (a file, or a
    folder DCP fills) in `folder` (default: place's parent): the free space checked first,
    its errors of the place as one UserError naming it."""
    folder = Path(folder) if folder is not None else Path(place).parent
    with writing.writing(folder, what):  # a read-only place says so, not "no space"
        if not os.access(folder, os.W_OK):
            ro = os.statvfs(folder).f_flag & os.ST_RDONLY
            raise OSError(errno.EROFS if ro else errno.EACCES, "not writable", str(folder))
    writing.require_free_space(folder, need_bytes(payload), what)
    with writing.writing(place, what):  # (an enclosing `writing` names the user's place)
        try:
            yield
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is one
            user = native_error(e, place, what)
            if user is None:
                raise
            raise user from None  # an OSError: `writing` names it by the outermost place
