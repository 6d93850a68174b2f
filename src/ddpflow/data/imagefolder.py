"""`root/<class>/<image>` trees: decoded in parallel, resized and centre-cropped once (to
data.store_size).

`root/train` with optional `root/val` and `root/test` folders is honoured; a split without
its folder is held out of the training images (splits.py). Unreadable files are skipped
and listed; more than `max_bad_fraction` of them is an error.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from ddpflow.core.errors import UserError
from ddpflow.data import shards
from ddpflow.data.prepared import open_split

EXTENSIONS = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm"}


def scan(root: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """Class names (sorted folder names) and (file, label) pairs."""
    if not root.is_dir():
        raise UserError(f"image folder {root} does not exist or is not a folder")
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
    JPEG bytes with a quality, None) or (None, reason): the short side resized to size and
    the centre square kept (predict reads files so)."""
    path, size, grayscale, *quality = args
    from PIL import Image, ImageOps

    try:
        with Image.open(path) as im:
            im.load()
            if im.mode in ("RGBA", "LA", "P") and not grayscale:
                im = im.convert("RGBA")
                bg = Image.new("RGBA", im.size, (255, 255, 255, 255))
                im = Image.alpha_composite(bg, im)
            im = im.convert("L" if grayscale else "RGB")
            im = ImageOps.fit(im, (size, size), Image.BILINEAR)  # resize shorter side + centre crop
            arr = np.asarray(im, dtype=np.uint8)
    except Exception as e:  # noqa: BLE001 - any decode failure is a bad file, reported
        return None, f"{type(e).__name__}: {e}"
    if quality:  # encoded in the worker: the parent only appends bytes to the shard
        return shards.encode(arr, quality[0]), None
    return (arr[..., None] if arr.ndim == 2 else arr), None


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
