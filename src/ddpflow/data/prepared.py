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
import os
import re
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ddpflow.core import reading
from ddpflow.core.errors import UserError
from ddpflow.core.writing import (
    build_folder,
    preallocate,
    write_json_atomic,
    write_text_atomic,  # noqa: F401 - for old importers
)
from ddpflow.data import shards

FORMAT_VERSION = 2  # 2: three splits (test) and store_size
SPLITS = ("train", "val", "test")

_NAME = {"type": "string", "pattern": r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$"}  # a file in the folder
_COUNT = {"type": "integer", "minimum": 0}
_CHANNELS = {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 4}
# meta.json as its readers use it (validated by core/reading.py before any field is used);
# a user dataset read as it is (kind: python) has no arrays, statistics or image shape
META_SCHEMA = {
    "type": "object", "required": ["format_version", "bytes", "sha256", "counts"],
    "properties": {
        "format_version": {"type": "integer"},
        "kind": {"type": "string"},
        "bytes": {"type": "object", "propertyNames": _NAME, "additionalProperties": _COUNT},
        "sha256": {"type": "object", "propertyNames": _NAME,
                   "additionalProperties": {"type": "string", "pattern": "^[0-9a-f]{64}$"}},
        "mtime_ns": {"type": "object", "additionalProperties": {"type": "integer"}},
        "fingerprint": {"type": "string"},
        "encoding": {"enum": ["raw", "jpeg"]},
        "store_size": {"type": "integer", "minimum": 1, "maximum": 8192},
        "counts": {"type": "object", "additionalProperties": {
            "type": "object", "required": ["total"],
            "properties": {"total": _COUNT, "per_class": {"type": "array", "items": _COUNT}}}},
        "num_classes": {"type": ["integer", "null"], "minimum": 1},
        "classes": {"type": "array", "items": {"type": "string"}},
        "mean": _CHANNELS,
        "std": {**_CHANNELS, "items": {"type": "number", "exclusiveMinimum": 0}},
        "image_shape": {"type": "array", "items": {"type": "integer", "minimum": 1},
                        "minItems": 3, "maxItems": 3}},
    "allOf": [
        {"if": {"required": ["kind"], "properties": {"kind": {"const": "python"}}},
         "else": {"required": ["num_classes", "classes", "mean", "std", "image_shape"],
                  "properties": {"num_classes": {"type": "integer"},
                                 "counts": {"required": list(SPLITS)}}}},
        {"if": {"required": ["encoding"], "properties": {"encoding": {"const": "jpeg"}}},
         "then": {"required": ["store_size"]}}]}
META_WHAT = "the prepared data's meta.json"
META_FIX = ("there is no prepared data here until `ddpflow prepare --config ... --force` "
            "rebuilds it")


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _allocated_memmap(path: Path, dtype, shape):
    """open_memmap with the file's blocks reserved first: a full disk is an ENOSPC error
    here, not a SIGBUS later when a page of the (sparse) mapping is written."""
    arr = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
    try:
        preallocate(path)
    except OSError as e:
        del arr
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            need = np.prod(shape, dtype=np.int64) * np.dtype(dtype).itemsize
            raise UserError(f"no space left on {path.parent} ({need / 1e6:.0f} MB needed for "
                            f"{path.name}); free space or point results_dir elsewhere"
                            ) from None
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


def read_meta(folder: Path, damaged_ok: bool = False) -> dict[str, Any] | None:
    """meta.json of a complete prepared folder; None when it is missing, of another format
    version or its arrays are missing or of other sizes (a folder to prepare again). A
    meta.json that is there but damaged or foreign (not JSON, wrong shape, a path out of the
    folder) is one UserError, or None with `damaged_ok` (prepare, which rebuilds it)."""
    folder = Path(folder)
    path = folder / "meta.json"
    try:
        raw = reading.read_json_if_present(path, {"type": "object"}, META_WHAT, META_FIX)
        if raw is None or raw.get("format_version") != FORMAT_VERSION:
            return None
        meta = reading.validate(raw, META_SCHEMA, path, META_WHAT, META_FIX)
        names = [reading.inside(folder, n, f"{path}: bytes", META_FIX) for n in meta["bytes"]]
    except UserError:
        if damaged_ok:
            return None
        raise
    for p, size in zip(names, meta["bytes"].values()):
        if p.name.endswith(shards.SUFFIX):
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


LEGACY_SCHEMA = {"type": "object", "required": ["fingerprint"],
                 "properties": {"bytes": {"type": "object"}}}
_ARRAY = re.compile(r"(train|val|test)[_-][\w.-]*\.(npy|jpgs)")


def is_prepared_folder(folder: Path, strict: bool = True) -> bool:
    """A prepared folder of a version before the `.ddpflow-output` marker: a meta.json of
    ddpflow's (it has a fingerprint) and nothing but the files it lists; in ddpflow's own
    place (`strict` False) also arrays without meta.json (Snakemake deletes it before a job
    that remakes it)."""
    names = os.listdir(folder)
    if not (Path(folder) / "meta.json").exists():
        return not strict and all(_ARRAY.fullmatch(n) for n in names)
    meta = reading.read_json_or_none(Path(folder) / "meta.json", LEGACY_SCHEMA, "meta.json")
    listed = (meta or {}).get("bytes") or {}
    return meta is not None and all(name == "meta.json" or name in listed for name in names)


def build_into(target: Path, build, own_place: bool = False) -> dict[str, Any]:
    """Run `build(partial_folder) -> meta` in a folder of its own beside `target` and move
    the result to `target` atomically (callers hold the folder's lock). A target that holds
    anything ddpflow did not write is refused, untouched (writing.build_folder);
    `own_place`: the default <run>/data, not a folder the user named."""
    return build_folder(target, build, "the prepared data folder", lock=False,
                        legacy=partial(is_prepared_folder, strict=not own_place),
                        other="another data.prepared_dir")
