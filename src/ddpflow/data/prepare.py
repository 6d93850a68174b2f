"""`ddpflow prepare`: turn the configured source into the prepared format, once.

Re-running with the same inputs is a no-op (a fingerprint of the data settings and
the input files' names, sizes and modification times is kept in meta.json).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from ..config import Config
from ..errors import UserError
from . import archives, imagefolder, prepared, synthetic

PREPARE_KEYS = ("source", "path", "image_size", "num_classes", "train_size", "val_size",
                "grayscale", "val_fraction", "max_bad_fraction", "verify_checksum")


def fingerprint(cfg: Config) -> str:
    d = cfg.data
    h = hashlib.sha256()
    h.update(json.dumps({k: getattr(d, k) for k in PREPARE_KEYS}, sort_keys=True).encode())
    h.update(str(cfg.seed).encode())
    if d.path:
        p = Path(d.path)
        paths = sorted(p.rglob("*")) if p.is_dir() else [p]
        for f in paths:
            if f.is_file():
                st = f.stat()
                h.update(f"{f.relative_to(p) if p.is_dir() else f.name}:{st.st_size}:"
                         f"{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _cap(x: np.ndarray, y: np.ndarray, n: int | None, seed: int):
    """Keep at most n samples (a seeded random subset, order kept)."""
    if n is None or n >= len(x):
        return x, y
    keep = np.sort(np.random.default_rng(seed).choice(len(x), size=n, replace=False))
    return x[keep], y[keep]


def _build_arrays(cfg: Config, folder: Path, meta: dict[str, Any]) -> None:
    d = cfg.data
    if d.source == "synthetic":
        ch = 1 if d.grayscale else 3
        for split, n in (("train", d.train_size or 4096), ("val", d.val_size or 1024)):
            x, y = synthetic.generate(n, d.num_classes, d.image_size, ch, cfg.seed, split)
            prepared.save_split(folder, split, x, y)
        meta["classes"] = [f"class{i}" for i in range(d.num_classes)]
        return
    path = Path(d.path)
    if not path.exists():
        raise UserError(f"data.path {path} does not exist (source {d.source}); "
                        f"point data.path at the dataset's archive or folder")
    if d.source in ("cifar10", "cifar100", "mnist", "fashion_mnist"):
        reader = archives.read_cifar if d.source.startswith("cifar") else archives.read_idx
        splits, classes, report = reader(d.source, path, d.verify_checksum)
        for i, (split, n) in enumerate((("train", d.train_size), ("val", d.val_size))):
            x, y = splits[split]
            x, y = _cap(x, y, n, cfg.seed + i)
            prepared.save_split(folder, split, archives.resize_all(x, d.image_size), y)
        meta["classes"] = classes
        meta["checksums"] = report
        return
    # imagefolder
    has_split = (path / "train").is_dir() and (path / "val").is_dir()
    if has_split:
        classes, train_items = imagefolder.scan(path / "train")
        val_classes, val_items = imagefolder.scan(path / "val")
        if val_classes != classes:
            raise UserError(f"{path}/val has classes {val_classes}, {path}/train has {classes}; "
                            f"they must be the same folders")
        meta["split"] = "explicit train/ and val/ folders"
    else:
        classes, items = imagefolder.scan(path)
        labels = np.array([label for _, label in items])
        tr, va = imagefolder.stratified_split(labels, d.val_fraction, cfg.seed)
        train_items, val_items = [items[i] for i in tr], [items[i] for i in va]
        meta["split"] = f"stratified, val_fraction {d.val_fraction}, seed {cfg.seed}"
    nworkers = imagefolder.workers(d.prepare_workers)
    skipped = []
    total = len(train_items) + len(val_items)
    with tqdm(total=total, desc="decode", unit="img", file=sys.stderr,
              disable=None, mininterval=1.0) as bar:
        for split, items in (("train", train_items), ("val", val_items)):
            _, bad = imagefolder.decode_into(folder, split, items, d.image_size, d.grayscale,
                                             nworkers, bar)
            skipped += bad
    if total and len(skipped) / total > d.max_bad_fraction:
        shown = "; ".join(f"{f} ({why})" for f, why in skipped[:3])
        raise UserError(f"{len(skipped)} of {total} images could not be read, more than "
                        f"data.max_bad_fraction={d.max_bad_fraction}: {shown}")
    meta["classes"] = classes
    meta["skipped"] = [{"file": f, "reason": why} for f, why in skipped]
    meta["prepare_workers"] = nworkers


def prepare(cfg: Config, force: bool = False, out: Path | None = None) -> tuple[dict, bool]:
    """Prepare cfg's dataset into cfg.data_dir (or out). Returns (meta, did_work)."""
    target = Path(out or cfg.data_dir)
    fp = fingerprint(cfg)
    existing = prepared.read_meta(target)
    if existing and existing.get("fingerprint") == fp and not force:
        return existing, False

    def build(folder: Path) -> dict[str, Any]:
        t0 = time.perf_counter()
        meta: dict[str, Any] = {"source": cfg.data.source, "path": cfg.data.path,
                                "fingerprint": fp, "image_size": cfg.data.image_size}
        _build_arrays(cfg, folder, meta)
        meta["num_classes"] = len(meta["classes"])
        seconds = time.perf_counter() - t0
        meta = prepared.finish(folder, meta)
        n = meta["counts"]["train"]["total"] + meta["counts"]["val"]["total"]
        meta["seconds"] = round(seconds, 3)
        meta["images_per_s"] = round(n / max(seconds, 1e-9), 1)
        meta["bytes_written"] = sum(meta["bytes"].values())
        prepared.write_json_atomic(folder / "meta.json", meta)
        return meta

    return prepared.build_into(target, build), True


def describe(meta: dict[str, Any], folder: Path, did_work: bool) -> str:
    lines = [f"prepared {meta['source']} -> {folder}" if did_work else
             f"prepared data at {folder} is up to date (nothing to do)"]
    for split in prepared.SPLITS:
        c = meta["counts"][split]
        per = ", ".join(f"{name}={n}" for name, n in zip(meta["classes"], c["per_class"]))
        if len(per) > 300:
            per = per[:300] + ", ..."
        lines.append(f"  {split}: {c['total']} images ({per})")
    lines.append(f"  image shape {tuple(meta['image_shape'])}, mean {meta['mean']}, "
                 f"std {meta['std']}")
    if meta.get("skipped"):
        lines.append(f"  skipped {len(meta['skipped'])} unreadable files:")
        lines += [f"    {s['file']}: {s['reason']}" for s in meta["skipped"][:20]]
    for name, status in sorted(meta.get("checksums", {}).items()):
        lines.append(f"  checksum {name}: {status}")
    lines.append(f"  {meta['bytes_written'] / 1e6:.1f} MB written in {meta['seconds']:.2f} s "
                 f"({meta['images_per_s']:.0f} images/s)")
    return "\n".join(lines)
