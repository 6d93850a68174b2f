"""Three splits of every source, never overlapping:

    train  what the model learns from
    val    held out from the training data (stratified, seeded, data.val_fraction): it
           chooses best.pt, drives early stopping and tuning
    test   the source's own test set (CIFAR/MNIST official test files, an image folder's
           test/), else held out like val (data.test_fraction); read once per stage end

A draw is per class: a seeded shuffle and round(n x fraction) held out, at least one, and
at least one left; a class too small for that is an error naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ddpflow.core.errors import UserError


def hold_out(labels: np.ndarray, fraction: float, seed: int, what: str = "val",
             setting: str = "data.val_fraction", classes: Sequence[str] | None = None):
    """Indices (kept, held out): per class a seeded shuffle, round(n * fraction) held out
    (at least 1). A class that would be left with nothing is a UserError."""
    rng = np.random.default_rng(seed)
    kept, held = [], []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        rng.shuffle(idx)
        k = max(int(round(len(idx) * fraction)), 1)
        if k >= len(idx):
            name = classes[int(c)] if classes is not None else str(int(c))
            way = ("set data.test_fraction: 0 (no test split)" if what == "test" else
                   f"lower {setting}")
            raise UserError(f"{setting} {fraction} leaves class '{name}' ({len(idx)} "
                            f"image(s)) with no {'training' if what == 'val' else 'other'} "
                            f"images once its {what} share (at least one) is held out; add "
                            f"images to the class, bring a {what}/ folder, or {way}")
        held.append(idx[:k])
        kept.append(idx[k:])
    return np.sort(np.concatenate(kept)), np.sort(np.concatenate(held))


def train_val(labels: np.ndarray, cfg, classes=None):
    """(train, val) indices of a training pool, by data.val_fraction (seed: cfg.seed)."""
    return hold_out(labels, cfg.data.val_fraction, cfg.seed, "val", classes=classes)


def pool_test(labels: np.ndarray, cfg, classes=None):
    """(pool, test) indices by data.test_fraction for a source without a test set of its
    own; test_fraction 0 = no test split (all in the pool)."""
    if cfg.data.test_fraction == 0:
        return np.arange(len(labels)), np.arange(0)
    return hold_out(labels, cfg.data.test_fraction, cfg.seed + 7, "test",
                    "data.test_fraction", classes)


# An image folder's split folders, by the names neighbouring tools use (torchvision
# ImageFolder, Keras, Roboflow, Hugging Face): exact, lower case.
SPLIT_FOLDERS = {"train": "train", "val": "val", "valid": "val", "validation": "val",
                 "test": "test"}
# Names that look like a split but are not one of those: refused, never taken as classes.
SPLIT_LIKE = {"train": "train", "training": "train", "trn": "train", "val": "val",
              "valid": "val", "validation": "val", "validate": "val", "dev": "val",
              "eval": "val", "evaluation": "val", "test": "test", "testing": "test",
              "tst": "test", "holdout": "test"}
EXPECTED = "train/, val/ (or valid/, validation/) and test/"


def folder_splits(root: Path) -> dict[str, Path]:
    """{split: folder} of an image folder's split folders ({} when root holds the class
    folders themselves). A folder that looks like a split under another name (training/,
    Train/, testing/, eval/), two folders for one split, split folders without train/ or
    beside class folders: a UserError naming the folder and the names expected."""
    if not root.is_dir():
        return {}
    folders = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    like = [n for n in folders if n.lower() in SPLIT_LIKE]
    if not like:
        return {}
    odd = [n for n in like if n not in SPLIT_FOLDERS]
    if odd:
        n = odd[0]
        raise UserError(f"{root / n} looks like a split folder, but ddpflow reads {EXPECTED} "
                        f"(never as classes): rename it to {SPLIT_LIKE[n.lower()]}/, or, if it "
                        f"is a class, put the class folders under {root / 'train'}/")
    found: dict[str, Path] = {}
    for n in like:
        split = SPLIT_FOLDERS[n]
        if split in found:
            raise UserError(f"{root} has two {split} folders, {found[split].name}/ and {n}/; "
                            f"keep one ({EXPECTED})")
        found[split] = root / n
    others = [n for n in folders if n not in like]
    if others:
        raise UserError(f"{root} mixes split folders ({', '.join(like)}) with other folders "
                        f"({', '.join(others[:5])}); expected either class folders only or "
                        f"{EXPECTED} holding the class folders: move them under train/")
    if "train" not in found:
        raise UserError(f"{root} has {', '.join(n + '/' for n in like)} but no train/ folder: "
                        f"expected {EXPECTED}; rename the training images' folder to train/")
    return found
