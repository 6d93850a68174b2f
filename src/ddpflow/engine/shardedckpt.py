"""Sharded checkpoints of a `strategy: fsdp` stage, with torch.distributed.checkpoint (DCP).

A checkpoint is a folder `ckpt-<step>.dcp/`: every rank writes its own shards of the model
and optimizer (`__<rank>_0.distcp`, DCP's `.metadata`), rank 0 adds `state.pt` (TrainState,
scheduler, scaler, every rank's RNG, what the stage was made of: the same keys as a DDP
checkpoint's, without the tensors). The same rules as checkpoint.py's files:
    background  DCP stages the shards to host memory (training waits for that copy only) and
                writes them in a thread, over a gloo process group of its own (the training
                loop's collectives never meet the writer's)
    atomic      written into `.ckpt-<step>.dcp.tmp/`, renamed into place once every rank's
                shards and the metadata are there
    checksummed `ckpt-<step>.dcp.sha256` lists every file's SHA-256, written last: a folder
                without it, or with a file that does not match, is skipped on resume
DCP reads the shards back on any number of ranks (resharding them): a requeue onto fewer GPUs
resumes. best.pt and final.pt hold the whole model, gathered once on rank 0 (`full_model`).

A test hook, DDPFLOW_FAULT=<point>:<step> (tests/test_fsdp.py, never set otherwise), SIGKILLs
a rank at one point of one step's write, in torchrun's first attempt only (the restarted
group then resumes): `after-rename` (rank 0: the folder in place, its sidecar not yet
written), `mid-shard` (each rank in the middle of writing its shard file).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch.distributed as torch_dist

from ddpflow.core.checksum import sha256_of
from ddpflow.core.errors import UserError
from ddpflow.core.nativewrite import free_bytes, native_error, need_bytes
from ddpflow.engine import checkpoint


def state_dicts(model, opt) -> dict:
    """The model's and optimizer's sharded state dicts (DTensors, keyed by parameter name)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, opt_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optimizer": opt_sd}


def full_model(model, dist) -> dict | None:
    """The whole model's state dict on rank 0 (host memory), None elsewhere. A collective:
    every rank gathers each parameter's shards once."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                              cpu_offload=True))
    return sd if dist.is_master else None


class ShardedWriter:
    """One sharded checkpoint in flight at a time, every rank taking part."""

    def __init__(self, dist, folder: Path, keep_last: int, background: bool):
        self.dist, self.folder, self.keep_last = dist, Path(folder), keep_last
        # the writer's own collectives (DCP's plan and metadata gathers) run in its thread
        self.group = torch_dist.new_group(backend="gloo") if dist.backend else None
        self.writer = checkpoint.BackgroundWriter(background)

    def save(self, step: int, model, opt, state: dict | None) -> None:
        """All ranks: their shards of `model` and `opt` at this step; rank 0 also `state`
        (checkpoint_state without the optimizer)."""
        import torch.distributed.checkpoint as dcp

        from ddpflow.engine import distributed

        self.writer.wait()  # the previous checkpoint is complete (and its error raised)
        final = self.folder / f"ckpt-{step:09d}.dcp"
        tmp = self.folder / f".{final.name}.tmp"
        if self.dist.is_master:
            checkpoint.empty_folder(tmp)  # (a killed write of this very step: gone)
        # buffers (BatchNorm's statistics) are not sharded and DCP saves one rank's copy:
        # rank 0's, as a DDP checkpoint and validation take them
        distributed.broadcast_buffers(self.dist, model)
        shards = state_dicts(model, opt)
        # every rank's bytes to write and free space, gathered (also the barrier: the folder
        # is there, empty): all ranks refuse together, before DCP's writer could fail in C++
        rooms = distributed.gather_objects(self.dist, room(self.folder,
                                                        checkpoint.state_bytes(shards)))
        try:
            check_room(rooms, self.folder)
        except UserError:
            if self.dist.is_master:
                checkpoint.remove(tmp)  # nothing of this checkpoint is left
            raise
        # blocks until the shards are copied to host memory; the files come in the thread
        future = dcp.async_save(shards, checkpoint_id=str(tmp), process_group=self.group,
                                storage_writer=_faulty(tmp, step))
        if self.dist.is_master:
            self.writer.submit(self._finish, future, tmp, final, state)
        else:
            self.writer.submit(self._shards, future, tmp)

    def _shards(self, future, tmp: Path) -> None:
        """In the thread: until DCP has written this rank's shards. DCP agrees on a failure
        across the ranks (every rank raises it); it is one message naming the place, and
        rank 0 removes the half-written folder."""
        try:
            future.result()
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException
            if self.dist.is_master:
                checkpoint.remove(tmp)
            user = native_error(e, self.folder, WHAT)
            if user is None:
                raise
            raise user from None

    def _finish(self, future, tmp: Path, final: Path, state: dict) -> None:
        """Rank 0, in the thread: once DCP's metadata is written (every rank's shards are),
        state.pt, the rename and the checksums; then keep-last."""
        self._shards(future, tmp)
        try:
            checkpoint.write_atomic(tmp / checkpoint.STATE, checkpoint.serialize(state))
        except BaseException:
            checkpoint.remove(tmp)
            raise
        sums = "".join(f"{sha256_of(f)}  {f.relative_to(tmp)}\n"
                       for f in sorted(tmp.rglob("*")) if f.is_file())
        checkpoint.place_folder(tmp, final)
        if _fault_at("after-rename", int(checkpoint.PATTERN.match(final.name).group(1))):
            _die()
        checkpoint.write_atomic(Path(str(final) + ".sha256"), sums.encode())
        checkpoint.prune(self.folder, self.keep_last)

    def wait(self) -> None:
        self.writer.wait()


def _fault_at(point: str, step: int) -> bool:
    """The test hook (see the top): whether DDPFLOW_FAULT names this point of this write."""
    return (os.environ.get("DDPFLOW_FAULT") == f"{point}:{step}"
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _HalfThenDie:
    """The test hook's shard stream: half of its first chunk reaches the disk, then the
    rank is SIGKILLed."""

    def __init__(self, raw):
        self.raw = raw

    def write(self, data) -> int:
        self.raw.write(bytes(memoryview(data).cast("B"))[:max(1, len(data) // 2)])
        self.raw.flush()
        os.fsync(self.raw.fileno())
        _die()
        return 0

    def __getattr__(self, name):
        return getattr(self.raw, name)


def _faulty(tmp: Path, step: int):
    """DCP's file writer with the test hook's `mid-shard` stream when DDPFLOW_FAULT asks
    for it at this step; None (DCP's own writer, as always) otherwise."""
    if not _fault_at("mid-shard", step):
        return None
    from contextlib import contextmanager

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    class Dying(FileSystem):
        @contextmanager
        def create_stream(self, path, mode):
            with super().create_stream(path, mode) as stream:
                yield _HalfThenDie(stream) if str(path).endswith(".distcp") else stream

    writer = FileSystemWriter(tmp)
    writer.fs = Dying()
    return writer


WHAT = "the sharded checkpoint"


def room(folder: Path, payload: int) -> tuple:
    """This rank's (host, file system, free bytes, bytes it needs) for a write into folder."""
    import os
    import socket

    # (rank 0 may not have made the folder yet: the file system is its nearest existing part)
    there = next(p for p in (folder, *folder.parents) if p.exists())
    return socket.gethostname(), os.stat(there).st_dev, free_bytes(there), need_bytes(payload)


def check_room(rooms: list, folder: Path) -> None:
    """Every rank's `room`, gathered: one UserError (the same on every rank) when the ranks
    that share a file system need more than it has free."""
    by_fs: dict = {}
    for host, dev, free, need in rooms:
        have, total, n = by_fs.get((host, dev), (free, 0, 0))
        by_fs[(host, dev)] = (min(have, free), total + need, n + 1)
    for have, total, n in by_fs.values():
        if total > have:
            raise UserError(f"not enough free space for {WHAT} at {folder}: about "
                            f"{total / 1e6:.1f} MB needed by {n} rank(s), {have / 1e6:.1f} MB "
                            f"free; free space there or choose another results_dir")


def load_shards(path: Path, model, opt) -> None:
    """Every rank: its shards of the model and optimizer from `path`, resharded by DCP for
    this many ranks (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    sd = state_dicts(model, opt)  # the targets: this rank's shards, optimizer state created
    dcp.load(sd, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
