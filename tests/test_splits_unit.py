"""data/splits.py's refusals, word for word: each names the folder (or the setting) it is
about, so a user with several image folders knows which one to fix."""

from __future__ import annotations

import numpy as np
import pytest

from ddpflow.core.errors import UserError
from ddpflow.data.splits import EXPECTED, folder_splits, hold_out


def _folders(root, *names):
    for n in names:
        (root / n).mkdir(parents=True)
    return root


def _refusal(root) -> str:
    with pytest.raises(UserError) as e:
        folder_splits(root)
    return str(e.value)


def test_two_folders_for_one_split_are_named_with_their_root(tmp_path):
    root = _folders(tmp_path / "imgs", "train", "val", "valid")
    assert _refusal(root) == f"{root} has two val folders, val/ and valid/; keep one ({EXPECTED})"


def test_split_folders_beside_class_folders_are_named_with_their_root(tmp_path):
    root = _folders(tmp_path / "imgs", "train", "cats")
    assert _refusal(root) == (
        f"{root} mixes split folders (train) with other folders (cats); expected either class "
        f"folders only or {EXPECTED} holding the class folders: move them under train/")


def test_split_folders_without_train_are_named_with_their_root(tmp_path):
    root = _folders(tmp_path / "imgs", "val", "test")
    assert _refusal(root) == (f"{root} has test/, val/ but no train/ folder: expected "
                              f"{EXPECTED}; rename the training images' folder to train/")


def test_a_class_a_held_out_share_would_empty_is_named_with_the_setting():
    with pytest.raises(UserError) as e:
        hold_out(np.array([0, 0, 0, 1]), 0.2, seed=0, classes=["cats", "dogs"])
    assert str(e.value) == (
        "data.val_fraction 0.2 leaves class 'dogs' (1 image(s)) with no training images once "
        "its val share (at least one) is held out; add images to the class, bring a val/ "
        "folder, or lower data.val_fraction")
