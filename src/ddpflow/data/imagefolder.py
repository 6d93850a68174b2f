"""`root/<class>/<image>` trees: decoded in parallel, resized and centre-cropped once (to
data.store_size).

`root/train` with optional `root/val` (or valid/, validation/) and `root/test` folders is
honoured, other split-like names refused (splits.folder_splits); a split without its folder
is held out of the training images (splits.py). An image whose bytes are in an earlier split
is dropped from the later one and listed (drop_duplicates). Files are decoded by
images.fitted; unreadable ones are skipped and listed; more than `max_bad_fraction` of them
is an error.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from ddpflow.core.errors import UserError
from ddpflow.core.reading import existing
from ddpflow.data import images, shards
from ddpflow.data.prepared import SPLITS, open_split

EXTENSIONS = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm"}


def scan(root: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """Class names (sorted folder names) and (file, label) pairs."""
    existing(root, "image folder", "expected <folder>/<class>/<image> files", folder=True)
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise UserError(f"{root} has no class folders: expected {root}/<class>/<image> files")
    items = []
    for label, name in enumerate(classes):
        files = sorted(p for p in (root / name).rglob("*")
                       if p.is_file() and p.suffix.lower() in EXTENSIONS)
        if not files:
            raise UserError(f"class folder {root / name} has no images "
                            f"({', '.join(sorted(EXTENSIONS))}); remove it or add images")
        items += [(str(f), label) for f in files]
    return classes, items


def decode_file(args):
    """(path, size, grayscale[, jpeg quality]) -> (uint8 HWC array of size x size, or its
    JPEG bytes with a quality, None) or (None, reason): images.fitted, the one decoding of
    image files (predict and evaluate --images read files through it too)."""
    path, size, grayscale, *quality = args
    try:
        arr = images.fitted(path, size, grayscale)
    except Exception as e:  # noqa: BLE001 - any decode failure is a bad file, reported
        return None, images.reason(e)
    if quality:  # encoded in the worker: the parent only appends bytes to the shard
        return shards.encode(arr[..., 0] if arr.shape[-1] == 1 else arr, quality[0]), None
    return arr, None


def workers(setting) -> int:
    return os.cpu_count() or 1 if setting == "auto" else int(setting)


def _decoded(items, jobs, nworkers: int, progress):
    """(file, label, result, error) per item, decoded by nworkers processes, in order."""
    pool = ProcessPoolExecutor(nworkers) if nworkers > 1 else None
    try:
        results = pool.map(decode_file, jobs, chunksize=64) if pool else map(decode_file, jobs)
        for (f, label), (out, err) in zip(items, results):
            if progress is not None:
                progress.update(1)
            yield f, label, out, err
    finally:
        if pool:
            pool.shutdown()


def decode_into(folder: Path, split: str, items, size: int, grayscale: bool, nworkers: int,
                progress=None, store: dict | None = None):
    """Decode items into the split's arrays, or (data.encoding jpeg) re-encode each in the
    workers into JPEG shards; returns (kept count, [(file, reason)] skipped)."""
    skipped = []
    if store and store["encoding"] == "jpeg":
        writer = shards.ShardWriter(folder, split, store["shard_bytes"])
        jobs = [(f, size, False, store["quality"]) for f, _ in items]
        for f, label, data, err in _decoded(items, jobs, nworkers, progress):
            if data is None:
                skipped.append((f, err))
            else:
                writer.append(data, label)
        return writer.close(), skipped
    channels = 1 if grayscale else 3
    images, labels = open_split(folder, split, len(items), (size, size, channels))
    kept = 0
    jobs = [(f, size, grayscale) for f, _ in items]
    for f, label, arr, err in _decoded(items, jobs, nworkers, progress):
        if arr is None:
            skipped.append((f, err))
            continue
        images[kept] = arr
        labels[kept] = label
        kept += 1
    images.flush()
    labels.flush()
    del images, labels
    if kept < len(items):  # shrink the arrays to what was decoded
        _truncate(folder, split, kept)
    return kept, skipped


def _truncate(folder: Path, split: str, n: int) -> None:
    for kind in ("images", "labels"):
        p = folder / f"{split}_{kind}.npy"
        full = np.load(p, mmap_mode="r")
        part = np.array(full[:n])
        del full
        np.save(p, part)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def content_keys(files) -> dict[str, tuple]:
    """{file: (SHA-256 of its bytes or None, (device, inode))}: the bytes are read only for
    files whose size another file has (a unique size cannot be a copy); a symlink or hard
    link is the same inode, read once."""
    stat = {f: os.stat(f) for f in files}
    sizes = Counter(st.st_size for st in stat.values())
    digests: dict[tuple, str] = {}
    out = {}
    for f, st in stat.items():
        inode = (st.st_dev, st.st_ino)
        if sizes[st.st_size] > 1 and inode not in digests:
            digests[inode] = _sha256(f)
        out[f] = (digests.get(inode), inode)
    return out


def gather_copies(pool: list, keys: dict) -> tuple[list, dict]:
    """(pool with one (file, label) per content, {kept file: [its copies' (file, label)]}):
    held-out draws are made on the first and the copies follow it into the same split, so
    no draw puts one image's bytes in two splits."""
    first: dict[str, str] = {}
    kept, copies = [], defaultdict(list)
    for f, label in pool:
        k = keys[f][0]
        if k is not None and k in first:
            copies[first[k]].append((f, label))
            continue
        if k is not None:
            first[k] = f
        kept.append((f, label))
    return kept, dict(copies)


def drop_duplicates(items: dict[str, list], classes: list[str], keys: dict | None = None):
    """({split: [(file, label)]}, notes): an image whose bytes are already in an earlier split
    (train < val < test) dropped from the later one, so val and test only score images the
    model never trained on. Found by the file itself (a symlink or hard link: same device
    and inode) and by content (SHA-256 of the bytes, content_keys). Copies inside one split
    are kept. A split left with no image is a UserError."""
    if keys is None:
        keys = content_keys([f for split in items for f, _ in items[split]])
    first: dict[str, tuple] = {}  # digest -> (split, file, label)
    out, notes = {}, []
    for split in sorted(items, key=SPLITS.index):
        out[split] = []
        for f, label in items[split]:
            k = keys[f][0]
            seen = first.get(k) if k else None
            if seen is None or seen[0] == split:
                if k:
                    first.setdefault(k, (split, f, label))
                out[split].append((f, label))
                continue
            notes.append({"file": f, "split": split, "same_as": seen[1],
                          "same_as_split": seen[0],
                          "by": "link" if keys[f][1] == keys[seen[1]][1] else "content",
                          "classes": [classes[seen[2]], classes[label]]})
        if items[split] and not out[split]:
            raise UserError(f"every {split} image is also in the {notes[-1]['same_as_split']} "
                            f"images (e.g. {notes[-1]['file']} = {notes[-1]['same_as']}), so "
                            f"{split} would be empty; give the {split} split images of its own")
    return out, notes
