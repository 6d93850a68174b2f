"""`ddpflow prepare`: turn the configured source into the prepared format, once.

Re-running with the same inputs is a no-op (a fingerprint of the data settings and
the input files' names, sizes, modification and change times is kept in meta.json).
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

from ddpflow.config import Config
from ddpflow.config.rerun import prepare_settings
from ddpflow.core import locks, reading
from ddpflow.core.errors import UserError, short
from ddpflow.core.writing import write_json_atomic
from ddpflow.data import archives, imagefolder, prepared, splits, synthetic
from ddpflow.seams.userimport import dir_fingerprint


def settings(cfg: Config) -> dict[str, Any]:
    """The config settings the prepared arrays depend on (the seed draws splits and caps);
    for a user dataset also its factory, arguments and the code folder's fingerprint."""
    out = prepare_settings(cfg.to_dict())  # the keys: config/rerun.py (the rerun rule)
    if cfg.data.source == "python":
        out["data.code_dir (fingerprint)"] = dir_fingerprint(cfg.data_code_dir)
    return out


def settings_fingerprint(cfg: Config) -> str:
    """Cheap: the settings only, no file listing. What `launch` and `tune` compare."""
    return hashlib.sha256(json.dumps(settings(cfg), sort_keys=True).encode()).hexdigest()[:16]


def check_settings(cfg: Config, meta: dict[str, Any]) -> None:
    """UserError naming the data settings that differ from those the data was prepared with."""
    if meta.get("settings_fingerprint") == settings_fingerprint(cfg):
        return
    then = meta.get("settings") or {}
    now = settings(cfg)
    diff = [f"{k}: {short(then.get(k))} -> {short(v)}" for k, v in now.items()
            if then.get(k) != v] or ["recorded by an older ddpflow"]
    raise UserError(f"the prepared data at {cfg.data_dir} was made with other data settings "
                    f"({'; '.join(diff[:4])}); run `ddpflow prepare --config ...` to prepare "
                    f"it again (the workflow does this by itself)")


def fingerprint(cfg: Config) -> str:
    """The settings and the input files' names, sizes, modification and change times: a
    file rewritten in place with its size and modification time put back (os.utime) still
    has a new change time, which nothing but the kernel sets, so it is prepared again."""
    d = cfg.data
    h = hashlib.sha256()
    h.update(json.dumps(settings(cfg), sort_keys=True).encode())
    if d.path:
        p = Path(d.path)
        paths = sorted(p.rglob("*")) if p.is_dir() else [p]
        for f in paths:
            if f.is_file():
                st = f.stat()
                h.update(f"{f.relative_to(p) if p.is_dir() else f.name}:{st.st_size}:"
                         f"{st.st_mtime_ns}:{st.st_ctime_ns}\n".encode())
    return h.hexdigest()[:16]


def store(cfg: Config) -> dict[str, Any]:
    """How images are written: raw pixels, or JPEG shards of data.shard_mb at jpeg_quality."""
    d = cfg.data
    return {"encoding": d.encoding, "quality": d.jpeg_quality,
            "shard_bytes": int(d.shard_mb * 2**20)}


def _cap(x: np.ndarray, y: np.ndarray, n: int | None, seed: int):
    """Keep at most n samples (a seeded random subset, order kept)."""
    if n is None or n >= len(x):
        return x, y
    keep = np.sort(np.random.default_rng(seed).choice(len(x), size=n, replace=False))
    return x[keep], y[keep]


def _cap_items(items: list, n: int | None, seed: int) -> list:
    """At most n (file, label) pairs: a seeded random subset, order kept."""
    if n is None or n >= len(items):
        return items
    keep = np.sort(np.random.default_rng(seed).choice(len(items), size=n, replace=False))
    return [items[i] for i in keep]


def _python_source(cfg: Config, folder: Path, meta: dict[str, Any]) -> bool:
    """A user dataset: checked (imports, items), described in meta.json, and with
    data.materialize copied into the arrays. Returns True when there are arrays."""
    from ddpflow.data import (
        factory,  # torch, only for a user dataset: the built-in sources need numpy
    )

    sets = {split: factory.dataset(cfg, split) for split in prepared.SPLITS}
    info = factory.describe(sets["train"], factory.check_item(sets["train"], "train", cfg))
    for split in ("val", "test"):  # the seam contract, and the training images' channels
        if sets[split]:
            factory.check_item(sets[split], split, cfg, info["in_channels"])
    if cfg.data.materialize:
        labels = []
        for split, ds in sets.items():
            if ds is None:  # the factory has no test split
                prepared.save_split(folder, split, *prepared.empty_like(folder, "train"),
                                    store(cfg))
                continue
            x, y = factory.materialize(ds, split, cfg)
            prepared.save_split(folder, split, x, y, store(cfg))
            labels.append(y)
        n = info["num_classes"] or int(max(y.max() for y in labels)) + 1
        meta["classes"] = getattr(sets["train"], "classes", None) or [str(i) for i in range(n)]
        return True
    meta.update(kind="python",
                counts={s: {"total": len(ds) if ds else 0} for s, ds in sets.items()},
                num_classes=info["num_classes"], input_shape=info["input_shape"],
                in_channels=info["in_channels"], bytes={}, sha256={},
                format_version=prepared.FORMAT_VERSION)
    return False


def _build_arrays(cfg: Config, folder: Path, meta: dict[str, Any]) -> bool:
    """Write the source's three splits into folder; False for a user dataset read as it is."""
    d = cfg.data
    if d.source == "python":
        return _python_source(cfg, folder, meta)
    if d.source == "synthetic":
        ch = 1 if d.grayscale else 3
        # null sizes: 4096 / 1024 / 1024 generated samples, each split its own draws
        sizes = {"train": d.train_size or 4096, "val": d.val_size or 1024,
                 "test": 1024 if d.test_size is None else d.test_size}
        for split, n in sizes.items():
            x, y = synthetic.generate(n, d.num_classes, d.store_size, ch, cfg.seed, split,
                                      d.difficulty)
            prepared.save_split(folder, split, x, y, store(cfg))
        meta["classes"] = [f"class{i}" for i in range(d.num_classes)]
        meta["split"] = "generated: train, val and test are independent draws"
        return True
    path = Path(d.path)
    archive = d.source in ("cifar10", "cifar100", "mnist", "fashion_mnist")
    if archive and not path.exists():  # an archive file or the folder it was unpacked in
        reading.existing(path, f"data.path (source {d.source})", "point data.path at the "
                         "dataset's archive or folder")
    elif not archive:
        reading.existing(path, f"data.path (source {d.source})", "point data.path at the "
                         "folder of class folders (or of train/ val/ test/)", folder=True)
    if archive:
        _archive_source(cfg, path, folder, meta)
    else:
        _imagefolder_source(cfg, path, folder, meta)
    return True


def _archive_source(cfg: Config, path: Path, folder: Path, meta: dict[str, Any]) -> None:
    """CIFAR/MNIST: val held out of the official training files, test = the official test
    files (never seen by model selection)."""
    d = cfg.data
    reader = archives.read_cifar if d.source.startswith("cifar") else archives.read_idx
    official, classes, report = reader(d.source, path, d.verify_checksum)
    for split, (_, labels) in official.items():
        prepared.check_labels(labels, len(classes), split)
    x, y = official["train"]
    tr, va = splits.train_val(y, cfg, classes)
    parts = {"train": (x[tr], y[tr], d.train_size), "val": (x[va], y[va], d.val_size),
             "test": (*official["test"], d.test_size)}
    for i, (split, (xs, ys, cap)) in enumerate(parts.items()):
        xs, ys = _cap(xs, ys, cap, cfg.seed + i)
        prepared.save_split(folder, split, archives.resize_all(xs, d.store_size), ys,
                            store(cfg))
    meta["classes"] = classes
    meta["checksums"] = report
    meta["split"] = (f"val: stratified {d.val_fraction} of the official training set (seed "
                     f"{cfg.seed}); test: the official test set")


def _folder_items(cfg: Config, path: Path, meta: dict[str, Any]):
    """(classes, {split: [(file, label)]}): train/, val/ (or valid/, validation/), test/
    folders where they exist, the rest held out of the training pool by data.test_fraction
    and data.val_fraction. No image's bytes are in two splits: a folder's copy of an earlier
    split's image is dropped and listed (meta duplicates); copies inside the pool are drawn
    together."""
    d = cfg.data
    has = splits.folder_splits(path)  # {} when path holds the class folders
    classes, pool = imagefolder.scan(has.get("train", path))
    items, how = {}, {}
    for split in ("test", "val"):
        if split in has:
            found, items[split] = imagefolder.scan(has[split])
            if found != classes:
                raise UserError(f"{has[split]} has classes {found}, {path}/train has "
                                f"{classes}; they must be the same folders")
            how[split] = f"{split}: {path.name}/{has[split].name}/"
    keys = imagefolder.content_keys([f for part in (pool, *items.values()) for f, _ in part])
    given, meta["duplicates"] = imagefolder.drop_duplicates({"train": pool, **items}, classes,
                                                            keys)
    items = {s: v for s, v in given.items() if s != "train"}
    pool, copies = imagefolder.gather_copies(pool, keys)
    for split in ("test", "val"):
        if split in items:
            continue
        labels = np.array([label for _, label in pool])
        keep, held = (splits.pool_test if split == "test" else splits.train_val)(
            labels, cfg, classes)
        items[split] = [pool[i] for i in held]
        pool = [pool[i] for i in keep]
        fraction = d.test_fraction if split == "test" else d.val_fraction
        how[split] = f"{split}: stratified {fraction} held out (seed {cfg.seed})"
    items["train"] = pool
    meta["split"] = "; ".join(how[s] for s in ("test", "val"))
    return classes, {s: [x for it in v for x in (it, *copies.get(it[0], ()))]
                     for s, v in items.items()}


def _imagefolder_source(cfg: Config, path: Path, folder: Path, meta: dict[str, Any]) -> None:
    d = cfg.data
    classes, items = _folder_items(cfg, path, meta)
    if len(classes) < 2:
        raise UserError(f"{path} has one class folder ({classes[0]}); classification needs at "
                        f"least two: add a folder per class")
    caps = {"train": d.train_size, "val": d.val_size, "test": d.test_size}
    items = {s: _cap_items(items[s], caps[s], cfg.seed + i)
             for i, s in enumerate(prepared.SPLITS)}
    nworkers = imagefolder.workers(d.prepare_workers)
    skipped = []
    total = sum(len(v) for v in items.values())
    with tqdm(total=total, desc="decode", unit="img", file=sys.stderr,
              disable=None, mininterval=1.0) as bar:
        for split in prepared.SPLITS:
            _, bad = imagefolder.decode_into(folder, split, items[split], d.store_size,
                                             d.grayscale, nworkers, bar, store(cfg))
            skipped += bad
    if total and len(skipped) / total > d.max_bad_fraction:
        shown = "; ".join(f"{f} ({why})" for f, why in skipped[:3])
        raise UserError(f"{len(skipped)} of {total} images could not be read, more than "
                        f"data.max_bad_fraction={d.max_bad_fraction}: {shown}")
    meta["classes"] = classes
    meta["skipped"] = [{"file": f, "reason": why} for f, why in skipped]
    meta["prepare_workers"] = nworkers


def prepare(cfg: Config, force: bool = False, out: Path | None = None,
            verify: bool = False) -> tuple[dict, bool]:
    """Prepare cfg's dataset into cfg.data_dir (or out). Returns (meta, did_work).

    One writer at a time (`<folder>.lock`). Up to date = same fingerprint and the arrays
    unchanged since (size and modification time; `verify` also re-hashes them)."""
    target = Path(out or cfg.data_dir)
    with locks.exclusive(target.with_name(target.name + ".lock"),
                         f"the prepared data folder {target}"):
        fp = fingerprint(cfg)
        existing = prepared.read_meta(target, damaged_ok=True)  # damaged: rebuilt
        if existing and existing.get("fingerprint") == fp and not force:
            changed = prepared.changed_files(target, existing)
            if not changed and not verify:
                return existing, False
            if _hashes_match(target, existing):
                if changed:  # touched or copied, same bytes: record the new times
                    existing["mtime_ns"] = prepared.file_stats(target, existing)
                    write_json_atomic(target / "meta.json", existing)
                return existing, False
            print(f"ddpflow: prepared data at {target} was changed after it was prepared "
                  f"({', '.join(changed) or 'checksum mismatch'}); preparing it again",
                  file=sys.stderr)
        meta = prepared.build_into(target, lambda folder: _build(cfg, folder, fp),
                                   own_place=out is None and _own_place(cfg))
        meta["mtime_ns"] = prepared.file_stats(target, meta)  # times in their final place
        write_json_atomic(target / "meta.json", meta)
        return meta, True


def _own_place(cfg: Config) -> bool:
    """Whether the prepared folder is in a place ddpflow chose itself: <run>/data, or a
    sweep's shared <run>/sweep/data/<hash> (a trial's results_dir is <run>/trials)."""
    if not cfg.data.prepared_dir:
        return True
    runs = Path(cfg.results_dir)
    where = Path(cfg.data.prepared_dir)
    return runs.name == "trials" and where.parent == runs.parent / "sweep" / "data"


def _hashes_match(folder: Path, meta: dict[str, Any]) -> bool:
    try:
        prepared.verify(folder, meta)
    except UserError:
        return False
    return True


def _build(cfg: Config, folder: Path, fp: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    meta: dict[str, Any] = {"source": cfg.data.source, "path": cfg.data.path,
                            "fingerprint": fp, "settings": settings(cfg),
                            "settings_fingerprint": settings_fingerprint(cfg),
                            "image_size": cfg.data.image_size,
                            "store_size": cfg.data.store_size,
                            "encoding": cfg.data.encoding}
    if not _build_arrays(cfg, folder, meta):  # a user dataset, read as it is when training
        write_json_atomic(folder / "meta.json", meta)
        return meta
    meta["num_classes"] = len(meta["classes"])
    seconds = time.perf_counter() - t0
    meta = prepared.finish(folder, meta)
    n = sum(c["total"] for c in meta["counts"].values())
    meta["seconds"] = round(seconds, 3)
    meta["images_per_s"] = round(n / max(seconds, 1e-9), 1)
    meta["bytes_written"] = sum(meta["bytes"].values())
    write_json_atomic(folder / "meta.json", meta)
    return meta


def describe(meta: dict[str, Any], folder: Path, did_work: bool) -> str:
    lines = [f"prepared {meta['source']} -> {folder}" if did_work else
             f"prepared data at {folder} is up to date (nothing to do)"]
    if meta.get("kind") == "python":
        c = meta["counts"]
        return "\n".join(lines + [
            f"  data.factory {meta['settings'].get('data.factory')}: train {c['train']['total']}"
            f", val {c['val']['total']}, test {c['test']['total']} items, input shape "
            f"{meta['input_shape']}, "
            f"num_classes {meta['num_classes']} (read through DataLoader when training)"])
    for split in prepared.SPLITS:
        c = meta["counts"][split]
        per = ", ".join(f"{name}={n}" for name, n in zip(meta["classes"], c["per_class"]))
        if len(per) > 300:
            per = per[:300] + ", ..."
        lines.append(f"  {split}: {c['total']} images ({per})")
    if meta.get("split"):
        lines.append(f"  splits: {meta['split']}")
    lines.append(f"  image shape {tuple(meta['image_shape'])}, mean {meta['mean']}, "
                 f"std {meta['std']}")
    if meta.get("duplicates"):
        lines.append(f"  dropped {len(meta['duplicates'])} image(s) already in an earlier "
                     f"split (same {'/'.join(sorted({n['by'] for n in meta['duplicates']}))}):")
        lines += [f"    {n['split']}: {n['file']} = {n['same_as_split']}: {n['same_as']}"
                  for n in meta["duplicates"][:20]]
    if meta.get("skipped"):
        lines.append(f"  skipped {len(meta['skipped'])} unreadable files:")
        lines += [f"    {s['file']}: {s['reason']}" for s in meta["skipped"][:20]]
    for name, status in sorted(meta.get("checksums", {}).items()):
        lines.append(f"  checksum {name}: {status}")
    if meta.get("encoding") == "jpeg":
        n = sum(c["total"] for c in meta["counts"].values())
        raw = n * int(np.prod(meta["image_shape"]))
        files = sum(1 for name in meta["bytes"] if name.endswith(".jpgs"))
        lines.append(f"  JPEG shards, quality {meta['settings']['data.jpeg_quality']}: {files} "
                     f"shard files; raw pixels would take {raw / 1e6:.1f} MB "
                     f"({raw / max(meta['bytes_written'], 1):.1f}x more)")
    lines.append(f"  {meta['bytes_written'] / 1e6:.1f} MB written in {meta['seconds']:.2f} s "
                 f"({meta['images_per_s']:.0f} images/s)")
    return "\n".join(lines)
