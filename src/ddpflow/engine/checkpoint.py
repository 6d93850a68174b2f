"""Atomic checkpoints with checksums, keep-last-k, and resume from the newest valid one.

A checkpoint `ckpt-<step>.pt` is serialised in memory, hashed, written to a temp
file, fsynced and renamed into place; its SHA-256 then goes into `ckpt-<step>.pt.sha256`
(also atomic). A checkpoint without a matching sidecar (killed mid-write, truncated,
corrupted) is skipped with a warning and the previous one is used. Loading uses
`torch.load(weights_only=True)`: a checkpoint is data, never code. An FSDP stage's
checkpoints are folders `ckpt-<step>.dcp/` under the same rules (shardedckpt.py writes them;
their sidecar lists every file's SHA-256).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import sys
import threading
from pathlib import Path

import torch

from ddpflow.core import reading
from ddpflow.core.checksum import sha256_of, verify  # noqa: F401 - checkpoint.verify/sha256_of
from ddpflow.core.errors import UserError
from ddpflow.core.nativewrite import native_writer
from ddpflow.core.writing import writing

PATTERN = re.compile(r"^ckpt-(\d+)\.(?:pt|dcp)$")
STATE = "state.pt"  # the TrainState part of a sharded checkpoint folder


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


WHAT = "the stage's checkpoints"  # how a full or read-only stage folder is named


def write_atomic(path: Path, payload: bytes, what: str = WHAT) -> None:
    """payload into path, whole or not at all: the free space checked first (with a margin),
    the temp file removed on any failure (the space it took is free again for the one-line
    report), a full or read-only place one UserError naming it (core/nativewrite.py)."""
    path = Path(path)
    with writing(path, what):
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with native_writer(path, what, len(payload)):
        try:
            with open(tmp, "wb") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    _fsync_dir(path.parent)


def state_bytes(obj) -> int:
    """Bytes of the tensors in a state (nested dicts/lists; a DTensor: this rank's shard):
    what a writer of it is about to put on disk."""
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return local.numel() * local.element_size()
    return 0


def serialize(obj) -> bytes:
    """What torch.save writes for obj, in memory."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def save_file(path: Path, obj) -> str:
    """torch.save obj to path atomically; returns its SHA-256 (also written beside it)."""
    payload = serialize(obj)
    digest = hashlib.sha256(payload).hexdigest()
    write_atomic(path, payload)
    write_atomic(Path(str(path) + ".sha256"), f"{digest}  {Path(path).name}\n".encode())
    return digest


def list_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    if not Path(folder).is_dir():
        return []
    found = [(int(m.group(1)), p) for p in Path(folder).iterdir() if (m := PATTERN.match(p.name))]
    return sorted(found)


def save(folder: Path, step: int, state: dict, keep_last: int) -> Path:
    path = Path(folder) / f"ckpt-{step:09d}.pt"
    save_file(path, state)
    prune(folder, keep_last)
    return path


def prune(folder: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` checkpoints (files or sharded folders) of `folder`."""
    for _, old in list_checkpoints(folder)[:-keep_last]:
        remove(old)
        Path(str(old) + ".sha256").unlink(missing_ok=True)


def remove(path: Path) -> None:
    """A checkpoint (file or sharded folder) of the stage's own folder, or its temp copy."""
    import shutil

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def empty_folder(path: Path) -> None:
    """`path` (a sharded checkpoint's temp folder under checkpoints/) new and empty."""
    remove(path)
    path.mkdir(parents=True)


def place_folder(tmp: Path, final: Path) -> None:
    """A finished sharded checkpoint's temp folder renamed into place (an older run's
    folder of the same step, never resumed, replaced)."""
    if final.exists():
        remove(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)


class HostCopy:
    """A copy of a state (nested dicts/lists of tensors) in host memory, taken at a step
    boundary so training can go on changing the originals while a background thread writes
    the copy. Buffers are kept and reused by the next save (page-locked for GPU tensors, so
    the device-to-host copies run asynchronously and one synchronize ends them all)."""

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}

    def __call__(self, obj, key: str = ""):
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj.detach(), key)
        if isinstance(obj, dict):
            return {k: self(v, f"{key}/{k}") for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self(v, f"{key}/{i}") for i, v in enumerate(obj))
        return obj

    def _tensor(self, t: torch.Tensor, key: str) -> torch.Tensor:
        buf = self.buffers.get(key)
        if (buf is None or buf.shape != t.shape or buf.dtype != t.dtype
                or buf.stride() != t.stride()):
            pin = t.device.type == "cuda"
            # in the tensor's own layout (channels_last stays channels_last): a resumed
            # optimizer's state must match its parameters' strides (resume.restore)
            buf = torch.empty_like(t, device="cpu", pin_memory=pin)
            self.buffers[key] = buf
        return buf.copy_(t, non_blocking=t.device.type == "cuda")

    def finish(self) -> None:
        """Sync point (GPU): every device-to-host copy of this save has landed."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()


class BackgroundWriter:
    """One checkpoint write at a time in a background thread (TorchTitan-style asynchronous
    save): serialising, hashing, fsync and rename run while training goes on. `submit` and
    `wait` block until the previous write is done and raise its error, if it had one. The
    thread is a daemon: a process that dies mid-write leaves only a temp file, and the
    previous checkpoint stays the newest valid one."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def submit(self, job, *args) -> None:
        self.wait()
        if not self.enabled:
            job(*args)
            return
        self.thread = threading.Thread(target=self._run, args=(job, args),
                                       name="ddpflow-checkpoint-writer", daemon=True)
        self.thread.start()

    def _run(self, job, args) -> None:
        try:
            job(*args)
        except BaseException as e:  # noqa: BLE001 - raised again in the training thread
            self.error = e

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            err, self.error = self.error, None
            raise err


def load(path: Path, map_location="cpu") -> dict:
    return torch.load(path, map_location=map_location, weights_only=True)


def verify_folder(path: Path) -> str | None:
    """A sharded checkpoint folder: None if every file its sidecar lists is there and
    matches, else why not."""
    side = Path(str(path) + ".sha256")
    if not side.is_file():
        return "no checksum file (the write did not finish)"
    try:
        listed = [line.split("  ", 1) for line in side.read_text(errors="replace").splitlines()
                  if line.strip()]
        if not any(len(x) == 2 and x[1] == STATE for x in listed):
            return "checksum file cut short"
        for entry in listed:
            if len(entry) != 2:
                return f"checksum mismatch in {entry[-1]} (truncated or corrupt)"
            # a name that leaves the folder ('..', absolute, a symlink out) is never read
            inside = reading.inside(path, entry[1], f"{side.name}: a file it lists")
            if sha256_of(inside) != entry[0]:
                return f"checksum mismatch in {entry[-1]} (truncated or corrupt)"
    except UserError:
        return "its checksum file names a file outside the folder (not written by ddpflow)"
    except OSError as e:
        return f"cannot be read ({e.strerror or type(e).__name__})"
    return None


def load_any(path: Path) -> dict:
    """A checkpoint's state: the file, or a sharded folder's state.pt (its tensors stay)."""
    return load(Path(path) / STATE if Path(path).is_dir() else path)


def latest_valid(folder: Path, resume_key: str, warn=print) -> tuple[Path, dict] | None:
    """The newest checkpoint that verifies and was written by this very stage (same config,
    code and starting weights: its resume_key), loaded (a sharded one: its state.pt)."""
    for _, path in reversed(list_checkpoints(folder)):
        problem = verify_folder(path) if path.is_dir() else verify(path)
        if problem is None:
            try:
                state = load_any(path)
            except Exception as e:  # noqa: BLE001 - an unreadable file is skipped, not fatal
                problem = f"cannot be loaded ({type(e).__name__})"
            else:
                if not isinstance(state, dict):  # a file someone else saved under our name
                    problem = f"holds a {type(state).__name__}, not a ddpflow checkpoint"
                elif state.get("resume_key") == resume_key:
                    return path, state
                else:
                    problem = "written with another config, code or starting weights"
        warn(f"ddpflow: warning: skipping checkpoint {path.name}: {problem}", file=sys.stderr)
    return None


def set_aside(folder: Path) -> None:
    """Move checkpoints of an earlier, different run of this stage to <folder>.old."""
    folder = Path(folder)
    if list_checkpoints(folder):
        old = folder.with_name(folder.name + ".old")
        if old.exists():
            import shutil

            shutil.rmtree(old)
        os.replace(folder, old)
        print(f"ddpflow: checkpoints of an earlier run moved to {old}", file=sys.stderr)


def remove_partial(folder: Path) -> None:
    """Delete temp files left by a write that was killed (they never became checkpoints)."""
    if Path(folder).is_dir():
        for p in Path(folder).glob(".ckpt-*.tmp*"):
            print(f"ddpflow: removing unfinished checkpoint write {p.name}", file=sys.stderr)
            remove(p)


def load_weights(path: Path, setting: str) -> dict:
    """A state dict from a ddpflow checkpoint ({"model": ...}) or a plain state dict file,
    read data-only (weights_only=True); anything else is one UserError naming `setting` and
    what the file holds instead (a pickled model object, a list, a tensor ...)."""
    from ddpflow.core.errors import UserError

    if Path(path).is_file() and Path(path).stat().st_size == 0:
        raise UserError(f"{setting}: {path} is empty (a copy or save cut short)")
    try:
        obj = load(path)
    except Exception as e:  # noqa: BLE001 - not a torch file, truncated, or holds code
        raise UserError(f"{setting}: {path} {_unloadable(e)}") from None
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        obj = obj["model"]
    what = _not_a_state_dict(obj)
    if what:
        raise UserError(f"{setting}: {path} holds {what}, not a state dict (a mapping of "
                        f"names to tensors: torch.save(model.state_dict(), ...)) nor a "
                        f"ddpflow checkpoint")
    return obj


def _unloadable(e: Exception) -> str:
    text = str(e)
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
    if found:
        return (f"holds pickled Python objects ({found.group(1)}), e.g. a whole model saved "
                f"with torch.save(model); ddpflow reads weights data-only and never runs a "
                f"file's code: save model.state_dict() instead")
    detail = re.search(r"WeightsUnpickler error: \s*(.+)", text)  # not torch's advice
    first = (detail.group(1) if detail else text.splitlines()[0] if text else "")[:160]
    return f"cannot be loaded as weights ({type(e).__name__}: {first}); is it truncated or " \
           f"not a PyTorch file?"


def _not_a_state_dict(obj) -> str | None:
    """What `obj` is when it is not a non-empty mapping of str -> tensor; None if it is."""
    if isinstance(obj, torch.Tensor):
        return f"a single tensor of shape {tuple(obj.shape)}"
    if isinstance(obj, torch.nn.Module):
        return f"a whole {type(obj).__name__} model object"
    if isinstance(obj, (list, tuple)):
        return f"a {type(obj).__name__} of {len(obj)} items"
    if not isinstance(obj, dict):
        return f"a {type(obj).__name__}"
    if not obj:
        return "an empty dict"
    for k, v in obj.items():
        if not isinstance(k, str) or not isinstance(v, torch.Tensor):
            keys = ", ".join(map(str, list(obj)[:5]))
            return (f"a dict whose {str(k)[:60]!r} is a {type(v).__name__}, not a tensor (keys "
                    f"{keys}{', ...' if len(obj) > 5 else ''}: another tool's training "
                    f"checkpoint? save its state dict alone)")
    return None


def check_fits(model: torch.nn.Module, weights: dict, setting: str) -> None:
    """UserError naming the first tensor whose name or shape does not fit the model."""
    from ddpflow.core.errors import UserError

    own = model.state_dict()
    for name, t in own.items():
        if name not in weights:
            raise UserError(f"{setting} does not fit the model: it has no tensor '{name}'")
        if tuple(weights[name].shape) != tuple(t.shape):
            raise UserError(f"{setting} does not fit the model: '{name}' is "
                            f"{tuple(weights[name].shape)} there, {tuple(t.shape)} in the model")
    extra = sorted(set(weights) - set(own))
    if extra:
        raise UserError(f"{setting} does not fit the model: it has tensors the model lacks, "
                        f"first '{extra[0]}'")
