"""A split copied to the training device, for the device loader (loaders.py) and `ddpflow tune`.

    read_rows       rows of a prepared split: raw arrays as they are, JPEG shards decoded on
                    the CPU
    upload          rows of a split into one device tensor, chunk by chunk through pinned
                    staging buffers
    resident_split  the whole training split on the device; with JPEG shards and a process
                    group, each of a node's ranks decodes a 1/N share and the ranks exchange
                    their shares (one all-gather, over NVLink on a GPU node): every image is
                    decoded once per node, not once per rank
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist

from ddpflow.data.shards import JpegImages


def read_rows(images, labels, idx):
    """(uint8 images, labels, idx kept, [(index, reason)] unreadable) of rows idx: raw arrays
    are read as they are, JPEG shards decoded on the CPU (in ascending file order)."""
    x, y, kept, bad = read_kept(images, labels, idx)
    return x, y, np.asarray(idx, dtype=np.int64)[kept], bad


def read_kept(images, labels, idx):
    """read_rows, with the positions in idx of the rows kept instead of their indices."""
    idx = np.asarray(idx, dtype=np.int64)
    if isinstance(images, JpegImages):
        x, kept, bad = images.fetch(idx)
        return x, labels[idx[kept]], np.asarray(kept, dtype=np.int64), bad
    return images[idx], labels[idx], np.arange(len(idx)), []


def upload(images, labels, idx, device: torch.device, bad,
           chunk_bytes: int = 64 * 2**20) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows idx of a split as device tensors (uint8 images, int64 labels), without its
    unreadable samples (given to bad.note: loaders.BadSamples). The device tensor is
    allocated once and filled chunk by chunk, so host memory holds one chunk (about
    chunk_bytes) at a time, never the split: 8 ranks x a 40 GB set would not fit a node's
    RAM. On a GPU each chunk's images and labels go through pinned staging buffers (fast,
    asynchronous copies); two alternate, so reading the next chunk from the memmap
    overlaps the copies of the last."""
    idx = np.asarray(idx, dtype=np.int64)
    row_bytes = max(1, int(np.prod(images.shape[1:], dtype=np.int64)))
    rows = max(1, min(len(idx), chunk_bytes // row_bytes))
    x = torch.empty((len(idx), *images.shape[1:]), dtype=torch.uint8, device=device)
    y = torch.empty(len(idx), dtype=torch.long, device=device)
    cuda = device.type == "cuda"
    staging = [(torch.empty((rows, *images.shape[1:]), dtype=torch.uint8, pin_memory=True),
                torch.empty(rows, dtype=torch.long, pin_memory=True))
               for _ in range(2)] if cuda else []
    copied = [None, None]  # the event after each staging pair's last copies
    kept = 0
    for k, start in enumerate(range(0, len(idx), rows)):
        part, lab, _, lost = read_rows(images, labels, idx[start:start + rows])
        bad.note(lost)
        m = len(lab)
        if cuda:
            (bx, by), slot = staging[k % 2], k % 2
            if copied[slot] is not None:
                copied[slot].synchronize()  # sync point: this pair's last copies are done
            bx[:m].numpy()[...] = part
            by[:m].numpy()[...] = lab
            x[kept:kept + m].copy_(bx[:m], non_blocking=True)
            y[kept:kept + m].copy_(by[:m], non_blocking=True)
            copied[slot] = torch.cuda.Event()
            copied[slot].record()
        else:
            x[kept:kept + m].copy_(torch.from_numpy(np.ascontiguousarray(part)))
            y[kept:kept + m].copy_(torch.from_numpy(np.asarray(lab, dtype=np.int64)))
        kept += m
    if cuda:
        torch.cuda.current_stream(device).synchronize()  # the staging buffers are freed next
    return x[:kept], y[:kept]




class _Unreadable:
    """Collects a share's unreadable samples (the ranks judge them together, after the
    exchange: a rank raising alone would leave the others in the all-gather)."""

    def __init__(self):
        self.items: list[tuple[int, str]] = []

    def note(self, bad) -> None:
        self.items.extend(bad)


_NODE_GROUPS: dict = {}  # the default group's id -> this node's group (made once)


def node_group():
    """The process group of this node's ranks (torchrun numbers a node's ranks one after
    the other); None, the default group, where every rank is on this node or the nodes'
    rank counts differ (the exchange then spans the job: still one decode per image)."""
    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if local >= world or world % local:
        return None
    key = id(dist.group.WORLD)
    if key not in _NODE_GROUPS:  # every rank creates every node's group, in the same order
        _NODE_GROUPS[key] = dist.new_subgroups(group_size=local)[0]
    return _NODE_GROUPS[key]


def _gather(out: torch.Tensor, mine: torch.Tensor, group) -> None:
    """Every rank's equal-sized `mine`, in rank order, into `out` (one collective)."""
    dist.all_gather_into_tensor(out, mine, group=group)


def _move_down(t: torch.Tensor, src: int, dst: int, n: int) -> None:
    """Rows src..src+n of t to dst (< src), in pieces that never overlap their source."""
    step = src - dst
    for i in range(0, n, step):
        m = min(step, n - i)
        t[dst + i:dst + i + m].copy_(t[src + i:src + i + m])


def upload_shared(images, labels, device: torch.device, bad, group=None,
                  chunk_bytes: int = 64 * 2**20) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole split on every rank of `group`, each rank decoding only its 1/N share (the
    contiguous rows rank*ceil(n/N)...): the same rows in the same order as one rank's
    `upload` of the whole split, unreadable samples left out and noted on every rank."""
    n, size, me = len(labels), dist.get_world_size(group), dist.get_rank(group)
    share = -(-n // size)
    lost = _Unreadable()
    x, y = upload(images, labels, np.arange(min(n, me * share), min(n, (me + 1) * share)),
                  device, lost, chunk_bytes)
    counts: list = [None] * size
    dist.all_gather_object(counts, (len(y), lost.items), group=group)
    if len(y) < share:  # the last share, or one with unreadable samples: padded
        x = torch.cat([x, x.new_zeros((share - len(y), *x.shape[1:]))])
        y = torch.cat([y, y.new_zeros(share - len(y))])
    full_x = torch.empty((size * share, *x.shape[1:]), dtype=x.dtype, device=device)
    full_y = torch.empty(size * share, dtype=y.dtype, device=device)
    _gather(full_x, x, group)
    _gather(full_y, y, group)
    del x, y
    bad.note([item for _, items in counts for item in items])  # every rank, the same list
    kept = 0
    for r, (m, _) in enumerate(counts):  # close the padding's gaps
        if r * share != kept:
            _move_down(full_x, r * share, kept, m)
            _move_down(full_y, r * share, kept, m)
        kept += m
    return full_x[:kept], full_y[:kept]


def resident_split(images, labels, device: torch.device, bad) -> tuple[torch.Tensor,
                                                                        torch.Tensor]:
    """The whole split as device tensors: JPEG shards under a process group decoded once
    per node (`upload_shared` over the node's ranks), anything else by `upload`. Every rank
    calls it at the same point (a collective where it shares)."""
    if (isinstance(images, JpegImages) and dist.is_available() and dist.is_initialized()
            and dist.get_world_size() > 1):
        group = node_group()
        if dist.get_world_size(group) > 1:
            return upload_shared(images, labels, device, bad, group)
    return upload(images, labels, np.arange(len(labels)), device, bad)
