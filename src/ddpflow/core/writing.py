"""Writing where the user names the place (--out, results_dir, a bundle or prepared folder).

Every writer goes through here, so that whatever the place holds, the answer is the
right result or one UserError naming the path and what to do:
- `write_text_atomic` / `write_json_atomic` / `write_bytes_atomic`: a file is written under
  a unique hidden temp name in its folder, fsynced and renamed into place: whole or not at
  all, and nothing partial left behind on any exception.
- `build_folder(target, build, what)`: a folder is built under `.<name>.partial-*` beside
  `target` and renamed into place. An existing target is replaced only when it is empty or
  ddpflow's own (its `.ddpflow-output` marker lists every entry, or `legacy` recognises an
  output of a version before markers); a folder holding anything else, a file or a link is
  refused, untouched. The old copy is moved to a unique `.<name>.old-*` and only that is
  removed: nothing ddpflow did not create is ever deleted.
- `claim_folder(folder, what, names)`: a folder written in place (evaluate): refused when a
  file ddpflow would write there is someone else's; other files are left alone.
- `claim_file(path, what, ours)`: a single output file (predict's CSV) may replace only a
  file `ours` recognises.
- `writing(path, what)`: OSError of a full disk, a read-only place, a path of the wrong
  kind or a too-long name -> one UserError (`user_os_error`).
- `require_free_space(folder, need, what)`: before a C++ writer that aborts the process
  on a full disk (torch.jit.save, the ONNX exporter).
- `output_lock(target, what)`: one writer per place; a second is told who holds it.
- `check_log_place(path, inputs)`: `--log FILE` is a place a log can be, and none of the
  command's inputs (teelog.py then truncates it, as `> FILE` would).
The C++ writers (torch.save, DCP, TorchScript, ONNX, safetensors) go through
`nativewrite.native_writer`, which uses this module's messages.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import stat
import tempfile
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Callable

from ddpflow.core import reading
from ddpflow.core.errors import UserError
from ddpflow.core.locks import exclusive

MARKER = ".ddpflow-output"  # in a folder ddpflow made: JSON {"written_by", "what", "files"}
PARTIAL = ".{name}.partial-"  # ddpflow's temp prefixes beside a target
OLD = ".{name}.old-"
MARKER_SCHEMA = {"type": "object", "required": ["written_by", "files"],
                 "properties": {"written_by": {"const": "ddpflow"},
                                "files": {"type": "array", "items": {"type": "string"}}}}

# errno -> (what happened, what to do)
_ERRNOS = {
    errno.ENOSPC: ("no space left on the device", "free space there or choose another place"),
    errno.EDQUOT: ("disk quota exceeded", "free space there or choose another place"),
    errno.EROFS: ("the file system is read-only", "choose a writable place"),
    errno.EACCES: ("permission denied", "choose a place you may write to"),
    errno.EPERM: ("not permitted", "choose a place you may write to"),
    errno.ENOTDIR: ("a part of the path is a file, not a folder", "choose another path"),
    errno.EISDIR: ("a folder is where a file belongs", "choose another path"),
    errno.EEXIST: ("a file is where a folder belongs", "choose another path"),
    errno.ENOTEMPTY: ("a folder that is not empty is in the way", "choose another path"),
    errno.ENAMETOOLONG: ("the file name is too long", "choose a shorter path"),
}


class PlaceError(UserError, OSError):
    """A place that cannot be written (full, read-only, of the wrong kind): a UserError for
    the CLI (one line, exit 2), still an OSError for a caller that goes on without the file
    (a cache in a read-only home)."""

    def __str__(self) -> str:
        return str(self.args[0])


def user_os_error(err: OSError, path: str | Path, what: str) -> PlaceError | None:
    """A UserError naming `path` for an OSError the user can fix; None for any other."""
    if err.errno not in _ERRNOS:
        return None
    reason, todo = _ERRNOS[err.errno]
    user = PlaceError(f"cannot write {what} at {path}: {reason}; {todo}")
    user.errno, user.filename = err.errno, str(path)
    return user


# the outermost place being written: a file inside a folder being built is named by the
# folder the user chose, never by a temp name
_PLACE: ContextVar[tuple | None] = ContextVar("ddpflow_writing_place", default=None)


@contextmanager
def writing(path: str | Path, what: str):
    """Turn a fixable OSError raised inside into one UserError naming `path` (or the place
    an enclosing `writing` names)."""
    outer = _PLACE.get()
    token = _PLACE.set(outer or (path, what))
    try:
        yield
    except OSError as e:
        user = user_os_error(e, *(outer or (path, what)))
        if user is None:
            raise
        raise user from None
    finally:
        _PLACE.reset(token)


def write_bytes_atomic(path: str | Path, data: bytes, what: str | None = None) -> None:
    """Write path whole or not at all: a reader (or a stopped writer) never sees a part."""
    path = Path(path)
    with writing(path, what or path.name):
        # (a name near the 255-byte limit still gets a temp name that fits)
        tmp = path.with_name(f".{path.name[:200]}.tmp{os.getpid()}-{secrets.token_hex(3)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # umask applies
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def move_into_place(src: str | Path, dst: str | Path, what: str | None = None) -> None:
    """Rename a complete file (written by another tool under a temp name beside `dst`) to
    `dst` in one step; a fixable OSError is one UserError naming dst."""
    with writing(dst, what or Path(dst).name):
        os.replace(src, dst)


def write_text_atomic(path: str | Path, text: str, what: str | None = None) -> None:
    write_bytes_atomic(path, text.encode("utf-8"), what)


def write_json_atomic(path: str | Path, obj: Any, what: str | None = None) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n", what)


def remove_scratch(folder: str | Path) -> None:
    """Remove a scratch folder ddpflow made for itself inside its own run folder (a roll
    call's answers): never a place the user named."""
    shutil.rmtree(folder, ignore_errors=True)


def preallocate(path: str | Path) -> None:
    """Reserve the blocks of `path` (a file just sized, e.g. a memory map): a full disk is an
    OSError (ENOSPC) here, not a SIGBUS later when a page of a sparse file is written. A
    file system without fallocate is left as it is."""
    try:
        with open(path, "r+b") as f:
            os.posix_fallocate(f.fileno(), 0, os.fstat(f.fileno()).st_size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise


def require_free_space(folder: str | Path, need_bytes: int, what: str) -> None:
    """Refuse before writing when `folder`'s file system has less than need_bytes free."""
    with writing(folder, what):
        free = shutil.disk_usage(folder).free
    if free < need_bytes:
        folder, what = _PLACE.get() or (folder, what)  # the place the user chose, not a temp
        raise UserError(f"not enough free space for {what} at {folder}: about "
                        f"{_mb(need_bytes)} needed, {_mb(free)} free; free space there or "
                        f"choose another place")


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def lock_path(target: str | Path) -> Path:
    target = Path(target).absolute()  # `--out .` has no name of its own to put a lock beside
    return target.with_name(f".{target.name}.lock")


def output_lock(target: str | Path, what: str):
    """One writer of `target` at a time (a hidden `.<name>.lock` beside it)."""
    target = Path(target).absolute()
    with writing(target, what):
        target.parent.mkdir(parents=True, exist_ok=True)
    return exclusive(lock_path(target), f"{what} {target}")


def marked_files(folder: Path) -> set[str] | None:
    """The names ddpflow's marker in `folder` says it wrote, or None (no valid marker)."""
    p = Path(folder) / MARKER
    if p.is_symlink() or not p.is_file():
        return None
    rec = reading.read_json_or_none(p, MARKER_SCHEMA, "ddpflow's output marker")
    return None if rec is None else set(rec["files"])


def write_marker(folder: Path, what: str, files) -> None:
    write_json_atomic(Path(folder) / MARKER, {"written_by": "ddpflow", "what": what,
                                              "files": sorted(set(files) - {MARKER})})


def _refuse(target: Path, what: str, why: str, other: str) -> UserError:
    return UserError(f"{what}: {target} {why}; ddpflow never deletes or overwrites what it "
                     f"did not write, and nothing was changed: choose {other}, or empty or "
                     f"remove it yourself")


def _shown(names) -> str:
    names = sorted(names)
    return ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more"
                                                     if len(names) > 5 else "")


def check_replaceable(target: Path, what: str, legacy: Callable[[Path], bool] | None = None,
                      other: str = "another --out") -> bool:
    """Whether `target` exists; raises when it is there and not ddpflow's to replace."""
    target = Path(target)
    with writing(target, what):
        return _check_replaceable(target, what, legacy, other)


def _check_replaceable(target: Path, what: str, legacy, other: str) -> bool:
    if target.is_symlink():
        raise _refuse(target, what, "is a symbolic link", other)
    if not target.exists():
        return False
    if not target.is_dir():
        raise _refuse(target, what, "is a file, not a folder", other)
    entries = set(os.listdir(target))
    if not entries:
        return True
    owned = marked_files(target)
    if owned is None:
        if legacy is not None and legacy(target):
            return True
        raise _refuse(target, what, f"already holds files ddpflow did not write "
                      f"({_shown(entries)})", other)
    extra = entries - owned - {MARKER}
    if extra:
        raise _refuse(target, what, f"holds files ddpflow did not write ({_shown(extra)})",
                      other)
    return True


def _remove_stale(target: Path) -> None:
    """Temp folders of a killed earlier build of `target` (the caller holds its lock)."""
    for prefix in (PARTIAL, OLD):
        for stale in target.parent.glob(prefix.format(name=target.name) + "*"):
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)


def build_folder(target: str | Path, build: Callable[[Path], Any], what: str,
                 legacy: Callable[[Path], bool] | None = None, lock: bool = True,
                 other: str = "another --out") -> Any:
    """Run `build(partial_folder) -> result` in a hidden folder beside `target`, mark it as
    ddpflow's and rename it into place; an existing target is replaced only when
    `check_replaceable` allows it. `lock=False`: the caller holds the target's lock."""
    target = Path(target).absolute()
    if Path.cwd().absolute().is_relative_to(target):  # `--out .`: it would be moved away
        raise UserError(f"cannot write {what} at {target}: it is the folder you are in (or "
                        f"holds it), which would be replaced; give a new folder, e.g. "
                        f"--out {target / 'bundle'}")
    check_replaceable(target, what, legacy, other)  # before the lock: a refusal leaves none
    with writing(target, what):
        target.parent.mkdir(parents=True, exist_ok=True)
        with output_lock(target, what) if lock else nullcontext():
            check_replaceable(target, what, legacy, other)  # again, now that no one else writes
            _remove_stale(target)
            partial = Path(tempfile.mkdtemp(prefix=PARTIAL.format(name=target.name),
                                            dir=target.parent))
            try:
                result = build(partial)
                write_marker(partial, what, os.listdir(partial))
                _swap(partial, target, what, legacy, other)
            except BaseException:
                shutil.rmtree(partial, ignore_errors=True)
                raise
    return result


def _swap(partial: Path, target: Path, what: str, legacy, other: str) -> None:
    """Move the complete `partial` to `target`, the old one (checked again) aside first."""
    old = None
    if check_replaceable(target, what, legacy, other):
        old = target.with_name(OLD.format(name=target.name) + secrets.token_hex(4))
        os.replace(target, old)
    try:
        os.replace(partial, target)
    except BaseException:
        if old is not None and not os.path.lexists(target):
            os.replace(old, target)  # put the old one back
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def claim_folder(folder: str | Path, what: str, names, legacy: Callable[[Path], bool] | None
                 = None, other: str = "another --out") -> Path:
    """Make `folder` (a folder written in place) ddpflow's for `names`: created if missing;
    refused when it is a file, or when one of `names` is already there and neither the
    marker nor `legacy` says ddpflow wrote it. Other files in it are left alone."""
    folder = Path(folder)
    with writing(folder, what):
        if folder.exists() and not folder.is_dir():
            raise _refuse(folder, what, "is a file, not a folder", other)
        folder.mkdir(parents=True, exist_ok=True)
        owned = marked_files(folder)
        if owned is None and legacy is not None and legacy(folder):
            owned = set(names)
        taken = {n for n in names if os.path.lexists(folder / n)} - (owned or set())
        if taken:
            raise _refuse(folder, what, f"already holds {_shown(taken)}, not written by "
                          f"ddpflow", other)
        if not set(names) <= (owned or set()):
            write_marker(folder, what, (owned or set()) | set(names))
    return folder


def claim_file(path: str | Path, what: str, ours: Callable[[Path], bool],
               other: str = "another --out") -> Path:
    """Check a single output file's place: missing, or a file `ours` recognises."""
    path = Path(path)
    with writing(path, what):
        if path.is_symlink():
            raise _refuse(path, what, "is a symbolic link", other)
        if path.is_dir():
            raise _refuse(path, what, "is a folder, not a file", other)
        if path.exists() and not ours(path):
            raise _refuse(path, what, "already exists and was not written by ddpflow", other)
    return path


# files a log never replaces: what configs, weights, data, code and reports are named
NOT_A_LOG = frozenset(".yaml .yml .json .jsonl .toml .py .smk .sh .ipynb .md .html .csv .tsv "
                      ".pt .pth .ckpt .bin .safetensors .onnx .ts .npy .npz .distcp .sif .gz "
                      ".tgz .tar .zip .png .jpg .jpeg .webp .bmp .tif .tiff .gif .svg .pdf "
                      ".sha256 .lock .pkl .pickle .parquet .h5 .hdf5".split())


def check_log_place(path: str | Path, inputs: dict[str, str]) -> Path:
    """`path` as a place for a command's log, which is truncated before the command runs:
    refused (one UserError, nothing touched) when it is one of the command's `inputs`
    (what -> path: the config, a file the config or an argument names), when its name is
    that of a config, weights, data or code file, or when it is a folder, a FIFO or a
    device."""
    path = Path(path)
    fix = "give --log a file of its own, e.g. run.log"
    if os.path.exists(path):  # (a dangling symlink: its target is made, as `>` makes it)
        with writing(path, "the log"):
            kind = os.stat(path).st_mode
        if not stat.S_ISREG(kind):
            what = "a folder" if stat.S_ISDIR(kind) else "not a regular file"
            raise UserError(f"--log {path} is {what}; {fix}")
        for what, other in inputs.items():
            try:
                same = os.path.samefile(path, other)
            except OSError:
                continue
            if same:
                raise UserError(f"--log {path} is {what} of this command ({other}): the log "
                                f"would be written over it; nothing was changed; {fix}")
    if path.name == MARKER:
        raise UserError(f"--log {path}: {MARKER} is the record ddpflow keeps of what it "
                        f"wrote in that folder; nothing was changed; {fix}")
    if path.suffix.lower() in NOT_A_LOG:
        raise UserError(f"--log {path}: a log does not take the name of a {path.suffix} file "
                        f"(a config, weights, data, code, or a checksum or lock ddpflow "
                        f"keeps); nothing was changed; {fix}")
    return path
