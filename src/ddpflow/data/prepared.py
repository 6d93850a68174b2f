"""The prepared on-disk format every data source is turned into, once.

A prepared dataset is a folder with
    train_images.npy  uint8 [N, S, S, C]   (memory-mappable, NHWC; S = data.store_size)
    train_labels.npy  int64 [N]
    val_images.npy    uint8 [M, S, S, C]   (held out of the training data: model selection)
    val_labels.npy    int64 [M]
    test_images.npy   uint8 [T, S, S, C]   (the honest figure; T may be 0: no test split)
    test_labels.npy   int64 [T]
    meta.json         classes, counts, mean/std, source, how the splits were drawn,
                      sha256 of each array, format version
With `data.encoding: jpeg` (meta.json's "encoding") each split's images are JPEG shards
and an index instead of `<split>_images.npy` (shards.py); loaders read either through
`open_images`. It is built in a sibling `.<name>.partial-*` folder and renamed into place
only when complete; meta.json is written last; `<name>.lock` admits one writer at a time.
A folder without a valid meta.json is never read as a dataset.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from ddpflow.core.errors import UserError
from ddpflow.data import shards

FORMAT_VERSION = 2  # 2: three splits (test) and store_size
SPLITS = ("train", "val", "test")


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_text_atomic(path: Path, text: str) -> None:
    """Write path whole or not at all: a reader (or a stopped writer) never sees a part."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json_atomic(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _allocated_memmap(path: Path, dtype, shape):
    """open_memmap with the file's blocks reserved first: a full disk is an ENOSPC error
    here, not a SIGBUS later when a page of the (sparse) mapping is written."""
    arr = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
    try:
        with open(path, "r+b") as f:
            os.posix_fallocate(f.fileno(), 0, os.fstat(f.fileno()).st_size)
    except OSError as e:
        del arr
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            need = np.prod(shape, dtype=np.int64) * np.dtype(dtype).itemsize
            raise UserError(f"no space left on {path.parent} ({need / 1e6:.0f} MB needed for "
                            f"{path.name}); free space or point results_dir elsewhere"
                            ) from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # no fallocate here: go on
            raise
    return arr


def open_split(folder: Path, split: str, n: int, shape: tuple[int, int, int]):
    """Allocate the image/label arrays of one split on disk; the caller fills them."""
    images = _allocated_memmap(folder / f"{split}_images.npy", np.uint8, (n, *shape))
    labels = _allocated_memmap(folder / f"{split}_labels.npy", np.int64, (n,))
    return images, labels


def save_split(folder: Path, split: str, images: np.ndarray, labels: np.ndarray,
               store: dict | None = None) -> None:
    """Write one split; store = {"encoding": "jpeg", "quality", "shard_bytes"} or None (raw)."""
    if store and store["encoding"] == "jpeg":
        shards.write_split(folder, split, images, labels, store["quality"],
                           store["shard_bytes"])
        return
    out_x, out_y = open_split(folder, split, len(images), images.shape[1:])
    out_x[:] = images
    out_y[:] = labels
    out_x.flush()
    out_y.flush()
    del out_x, out_y


def empty_like(folder: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Zero images shaped like `split`'s (a split a source does not have)."""
    path = Path(folder) / f"{split}_images.npy"
    if not path.exists():  # JPEG shards: no image is written, the shape does not matter
        return np.zeros((0, 1, 1, 3), np.uint8), np.zeros(0, np.int64)
    x = np.load(path, mmap_mode="r")
    return np.zeros((0, *x.shape[1:]), np.uint8), np.zeros(0, np.int64)


def channel_stats(images, chunk: int = 4096, rows: np.ndarray | None = None
                  ) -> tuple[list[float], list[float]]:
    """Per-channel mean and std on the 0..1 scale, streamed in chunks (float64 sums), over
    all images or the given rows."""
    c = images.shape[-1]
    s = np.zeros(c)
    s2 = np.zeros(c)
    n = 0
    total = len(images) if rows is None else len(rows)
    for i in range(0, total, chunk):
        part = images[i:i + chunk] if rows is None else images[rows[i:i + chunk]]
        x = part.reshape(-1, c).astype(np.float64) / 255.0
        s += x.sum(0)
        s2 += (x * x).sum(0)
        n += len(x)
    mean = s / max(n, 1)
    std = np.sqrt(np.maximum(s2 / max(n, 1) - mean * mean, 1e-12))
    return [round(float(v), 6) for v in mean], [round(float(v), 6) for v in std]


def check_labels(y: np.ndarray, num_classes: int, split: str) -> None:
    if len(y) and (y.min() < 0 or y.max() >= num_classes):
        raise UserError(f"labels out of range in the {split} split: found {int(y.min())}.."
                        f"{int(y.max())}, expected 0..{num_classes - 1}; "
                        f"the source files are corrupt or of another dataset")


def finish(folder: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Check labels, compute stats and checksums, write meta.json last."""
    counts = {}
    for split in SPLITS:
        y = np.load(folder / f"{split}_labels.npy", mmap_mode="r")
        check_labels(y, meta["num_classes"], split)
        per_class = np.bincount(y, minlength=meta["num_classes"]).tolist()
        counts[split] = {"total": int(len(y)), "per_class": per_class}
    if counts["train"]["total"] == 0:
        raise UserError("the prepared training split is empty: no images were found")
    meta.setdefault("encoding", "raw")
    files = sorted(p.name for p in Path(folder).iterdir()
                   if p.is_file() and not p.name.startswith("meta.json"))
    meta["bytes"] = {f: (folder / f).stat().st_size for f in files}
    x = open_images(folder, "train", meta)
    if meta["encoding"] == "jpeg":  # statistics of an even sample: decoding all costs minutes
        step = max(1, len(x) // shards.STATS_SAMPLE)
        meta["mean"], meta["std"] = channel_stats(x, 1024, np.arange(0, len(x), step))
    else:
        meta["mean"], meta["std"] = channel_stats(x)
    meta["image_shape"] = list(x.shape[1:])
    meta["counts"] = counts
    meta["format_version"] = FORMAT_VERSION
    meta["sha256"] = {f: sha256_file(folder / f) for f in files}
    write_json_atomic(folder / "meta.json", meta)
    return meta


def file_stats(folder: Path, meta: dict[str, Any]) -> dict[str, int]:
    """Modification times (ns) of the arrays, recorded once the folder is in place: a later
    change in place (same size) shows as a different time."""
    return {name: (Path(folder) / name).stat().st_mtime_ns for name in meta["bytes"]}


def changed_files(folder: Path, meta: dict[str, Any]) -> list[str]:
    """Arrays whose size or modification time differ from meta.json's record (cheap)."""
    changed = []
    for name, size in meta["bytes"].items():
        try:
            st = (Path(folder) / name).stat()
        except OSError:
            changed.append(name)
            continue
        if st.st_size != size or st.st_mtime_ns != meta.get("mtime_ns", {}).get(name):
            changed.append(name)
    return changed


def read_meta(folder: Path) -> dict[str, Any] | None:
    """meta.json of a complete prepared folder, or None (missing, partial, other version)."""
    try:
        with open(Path(folder) / "meta.json") as f:
            meta = json.load(f)
    except (OSError, ValueError):  # missing, unreadable, not JSON, not UTF-8
        return None
    # a foreign or hand-edited meta.json is "no dataset", never a crash
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        return None
    sizes = meta.get("bytes")
    if not isinstance(sizes, dict) or not isinstance(meta.get("sha256"), dict):
        return None
    for name, size in sizes.items():
        p = Path(folder) / str(name)
        if str(name).endswith(shards.SUFFIX):
            continue  # a short shard costs its samples, counted when read (shards.py)
        if not p.is_file() or p.stat().st_size != size:
            return None
    return meta


def open_images(folder: Path, split: str, meta: dict[str, Any]):
    """A split's images as an array of uint8 [N, S, S, C]: memory-mapped raw pixels, or JPEG
    shards decoded when indexed (shards.JpegImages)."""
    folder = Path(folder)
    if meta.get("encoding") == "jpeg":
        size = meta["store_size"]
        return shards.JpegImages(folder, split, (size, size, 3), meta["bytes"])
    return np.load(folder / f"{split}_images.npy", mmap_mode="r")


def verify(folder: Path, meta: dict[str, Any]) -> None:
    """Full checksum check of the arrays (seconds per GB)."""
    for name, digest in meta["sha256"].items():
        if sha256_file(Path(folder) / name) != digest:
            raise UserError(f"prepared data file {Path(folder) / name} does not match its "
                            f"checksum in meta.json; run `ddpflow prepare --force` to rebuild it")


def load(folder: Path) -> tuple[dict[str, Any], dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Memory-map a prepared folder: meta and {split: (images, labels)}."""
    folder = Path(folder)
    meta = read_meta(folder)
    if meta is None:
        raise UserError(f"no prepared dataset at {folder} (missing or incomplete meta.json); "
                        f"run `ddpflow prepare --config ...` first")
    arrays = {s: (open_images(folder, s, meta),
                  np.load(folder / f"{s}_labels.npy", mmap_mode="r")) for s in SPLITS}
    return meta, arrays


def build_into(target: Path, build) -> dict[str, Any]:
    """Run `build(partial_folder) -> meta` in a folder of its own beside `target` and move
    the result to `target` atomically (callers hold the folder's lock)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".{target.name}.partial-*"):  # left by a killed build
        shutil.rmtree(stale, ignore_errors=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        meta = build(partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    old = target.with_name(target.name + ".old")
    if target.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
    os.replace(partial, target)
    shutil.rmtree(old, ignore_errors=True)
    return meta
