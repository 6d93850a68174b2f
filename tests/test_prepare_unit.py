"""The prepare stage, in process, edge by edge.

data/prepare.py: the settings and fingerprint that decide whether data is prepared again
(and the message when it is stale), caps drawn as seeded subsets, the synthetic defaults,
the path checks' messages, archives and image folders split and capped, a user dataset
described or materialized, the up-to-date rule (touched, changed, verify, force, another
--out, the lock, a failed last write), the place ddpflow owns, meta.json's record and the
summary `ddpflow prepare` prints. data/archives.py: CIFAR members (pixels, schema, labels,
code refused) and IDX files (headers cut at each byte, ranks, counts), resizing.
data/imagefolder.py: scanning, decoding into arrays or JPEG shards (unreadable files kept
out, worker processes), content keys, copies and duplicates across splits. data/shards.py:
the decoder's fallbacks, files closed, index entries out of range, file order.
Fast: tiny synthetic sets, small archives, folders and shards in tmp_path.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import tiny_config
from ddpflow.config import from_dict
from ddpflow.config.rerun import prepare_settings
from ddpflow.core.errors import UserError
from ddpflow.data import prepare as prep
from ddpflow.data import prepared
from ddpflow.seams.userimport import dir_fingerprint
from fixtures import cifar_archive, idx_files, image_tree


def _cfg(tmp_path, **data):
    raw = tiny_config(tmp_path)
    raw["data"] = {"image_size": 8, "train_size": 40, "val_size": 10, "test_size": 10,
                   "num_classes": 4, "difficulty": 0, **data}
    return from_dict(raw)


def _refusal(fn, *args, **kw) -> str:
    with pytest.raises(UserError) as e:
        fn(*args, **kw)
    return str(e.value)


def _disk_meta(cfg):
    return json.loads((cfg.data_dir / "meta.json").read_text())


# ------------------------------------------------------------------ settings, fingerprints

def test_settings_are_the_rerun_rules_keys_and_a_user_datasets_code(tmp_path):
    cfg = _cfg(tmp_path)
    assert prep.settings(cfg) == prepare_settings(cfg.to_dict())
    assert "data.code_dir (fingerprint)" not in prep.settings(cfg)
    code = tmp_path / "code"
    code.mkdir()
    (code / "mydata.py").write_text("def make(split):\n    return None\n")
    py = _cfg(tmp_path, source="python", factory="mydata:make", code_dir=str(code))
    got = prep.settings(py)
    assert got == {**prepare_settings(py.to_dict()),
                   "data.code_dir (fingerprint)": dir_fingerprint(str(code))}


def test_the_settings_fingerprint_is_16_hex_of_the_sorted_settings(tmp_path):
    cfg = _cfg(tmp_path)
    blob = json.dumps(prep.settings(cfg), sort_keys=True).encode()
    assert prep.settings_fingerprint(cfg) == hashlib.sha256(blob).hexdigest()[:16]
    # with no input files the full fingerprint is the settings' one
    assert prep.fingerprint(cfg) == prep.settings_fingerprint(cfg)
    raw = tiny_config(tmp_path)
    raw["seed"] = 1
    assert prep.fingerprint(from_dict(raw)) != prep.fingerprint(from_dict(tiny_config(tmp_path)))


def test_stale_settings_name_each_difference_and_the_command(tmp_path):
    cfg = _cfg(tmp_path)
    now = prep.settings(cfg)
    assert prep.check_settings(cfg, {"settings_fingerprint": prep.settings_fingerprint(cfg)}) \
        is None
    then = {**now, "data.image_size": 32, "data.grayscale": True}
    fix = ("run `ddpflow prepare --config ...` to prepare it again (the workflow does this by "
           "itself)")
    assert _refusal(prep.check_settings, cfg, {"settings_fingerprint": "x", "settings": then}) \
        == (f"the prepared data at {cfg.data_dir} was made with other data settings "
            f"(data.image_size: 32 -> 8; data.grayscale: True -> False); {fix}")
    assert _refusal(prep.check_settings, cfg, {"settings_fingerprint": "x"}) == (
        f"the prepared data at {cfg.data_dir} was made with other data settings "
        f"(data.source: None -> 'synthetic'; data.image_size: None -> 8; data.store_size: "
        f"None -> 8; data.num_classes: None -> 4); {fix}")
    assert _refusal(prep.check_settings, cfg, {"settings_fingerprint": "x",
                                               "settings": now}) == (
        f"the prepared data at {cfg.data_dir} was made with other data settings (recorded by "
        f"an older ddpflow); {fix}")


def _same_inode_trees(tmp_path):
    """Two image folders holding one file (one inode: same size and times) under another
    class folder, and a symlink `ds` the user points at either."""
    a, b = tmp_path / "v1/cat", tmp_path / "v2/dog"
    a.mkdir(parents=True)
    b.mkdir(parents=True)
    (a / "x.png").write_bytes(b"12345")
    os.link(a / "x.png", b / "x.png")
    link = tmp_path / "ds"
    link.symlink_to(tmp_path / "v1")
    return link


def test_the_fingerprint_sees_a_file_moved_to_another_class_or_rewritten(tmp_path):
    link = _same_inode_trees(tmp_path)
    cfg = _cfg(tmp_path, source="imagefolder", path=str(link))
    before = prep.fingerprint(cfg)
    assert len(before) == 16 and int(before, 16) >= 0
    link.unlink()
    link.symlink_to(tmp_path / "v2")  # the same bytes and times, labelled dog now
    assert prep.fingerprint(cfg) != before
    f = tmp_path / "v2/dog/x.png"
    st = f.stat()
    moved = prep.fingerprint(cfg)
    f.write_bytes(b"54321")  # rewritten in place, size and modification time put back
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert prep.fingerprint(cfg) != moved
    one = _cfg(tmp_path, source="cifar10", path=str(f))  # a single file: its name and times
    first = prep.fingerprint(one)
    f.write_bytes(b"5432")
    assert prep.fingerprint(one) != first


def test_store_is_the_encoding_quality_and_shard_size_in_bytes(tmp_path):
    cfg = _cfg(tmp_path, encoding="jpeg", jpeg_quality=77, shard_mb=0.5, image_size=16)
    assert prep.store(cfg) == {"encoding": "jpeg", "quality": 77, "shard_bytes": 524288}
    assert prep.store(_cfg(tmp_path, shard_mb=3)) == {"encoding": "raw", "quality": 90,
                                                      "shard_bytes": 3 * 1048576}


# ------------------------------------------------------------------ caps

def test_a_cap_is_a_seeded_subset_in_order_and_no_cap_keeps_all():
    x = np.arange(100)
    y = x * 2
    for n in (None, 100, 150):
        kx, ky = prep._cap(x, y, n, 0)
        assert kx.tolist() == x.tolist() and ky.tolist() == y.tolist()
        assert prep._cap_items(list(x), n, 0) == list(x)
    kx, ky = prep._cap(x, y, 90, 5)
    want = np.sort(np.random.default_rng(5).choice(100, size=90, replace=False))
    assert kx.tolist() == want.tolist() and ky.tolist() == (want * 2).tolist()
    assert len(set(kx.tolist())) == 90
    items = [(f"f{i}", i % 3) for i in range(100)]
    got = prep._cap_items(items, 90, 5)
    assert got == [items[i] for i in want] and len(set(got)) == 90


# ------------------------------------------------------------------ synthetic

def test_synthetic_sizes_left_out_are_4096_1024_1024_and_a_zero_test_is_none(tmp_path):
    cfg = _cfg(tmp_path, image_size=4, train_size=None, val_size=None, test_size=None)
    meta, did = prep.prepare(cfg)
    assert did and [meta["counts"][s]["total"] for s in prepared.SPLITS] == [4096, 1024, 1024]
    other = tmp_path / "o"
    other.mkdir()
    cfg = _cfg(other, train_size=12, val_size=5, test_size=0, grayscale=True)
    meta, _ = prep.prepare(cfg)
    assert [meta["counts"][s]["total"] for s in prepared.SPLITS] == [12, 5, 0]
    assert meta["image_shape"] == [8, 8, 1] and meta["classes"] == [
        "class0", "class1", "class2", "class3"]
    assert meta["split"] == "generated: train, val and test are independent draws"
    assert _cfg(other).data.grayscale is False


def test_synthetic_colour_has_three_channels_and_meta_is_the_record(tmp_path):
    cfg = _cfg(tmp_path)
    t0 = time.perf_counter()
    meta, did = prep.prepare(cfg)
    wall = time.perf_counter() - t0
    assert did is True and meta == _disk_meta(cfg)
    assert meta["image_shape"] == [8, 8, 3] and meta["num_classes"] == 4
    assert meta["source"] == "synthetic" and meta["path"] is None
    assert meta["fingerprint"] == prep.fingerprint(cfg)
    assert meta["settings"] == prep.settings(cfg)
    assert meta["settings_fingerprint"] == prep.settings_fingerprint(cfg)
    assert (meta["image_size"], meta["store_size"], meta["encoding"]) == (8, 8, "raw")
    assert meta["mtime_ns"] == prepared.file_stats(cfg.data_dir, meta)
    assert meta["bytes_written"] == sum(meta["bytes"].values()) > 0
    n = sum(c["total"] for c in meta["counts"].values())
    for _ in range(3):  # measured times: milliseconds, images/s to a tenth
        assert 0 < meta["seconds"] <= wall and meta["seconds"] == round(meta["seconds"], 3)
        s = meta["seconds"]  # the time rounded to 0.5 ms either way
        assert abs(meta["images_per_s"] - n / s) <= n * 0.0005 / (s * (s - 0.0005)) + 0.05
        assert meta["images_per_s"] == round(meta["images_per_s"], 1)
        t0 = time.perf_counter()
        meta, _ = prep.prepare(cfg, force=True)
        wall = time.perf_counter() - t0


# ------------------------------------------------------------------ paths

def test_a_missing_or_wrong_kind_of_path_is_named_with_the_fix(tmp_path):
    nope = tmp_path / "nope"
    assert _refusal(prep.prepare, _cfg(tmp_path, source="cifar10", path=str(nope))) == (
        f"data.path (source cifar10): {nope} does not exist; point data.path at the dataset's "
        f"archive or folder")
    assert _refusal(prep.prepare, _cfg(tmp_path, source="imagefolder", path=str(nope))) == (
        f"data.path (source imagefolder): {nope} does not exist; point data.path at the folder "
        f"of class folders (or of train/ val/ test/)")
    f = tmp_path / "file.png"
    f.write_bytes(b"x")
    assert _refusal(prep.prepare, _cfg(tmp_path, source="imagefolder", path=str(f))) == (
        f"data.path (source imagefolder): {f} is a file, not a folder; point data.path at the "
        f"folder of class folders (or of train/ val/ test/)")
    assert not (tmp_path / "results/t/data").exists()


# ------------------------------------------------------------------ archives

def test_an_archive_is_split_capped_with_seeded_draws_and_recorded(tmp_path):
    arc = cifar_archive(tmp_path / "c.tar.gz", n_per_batch=20, n_test=30)
    cfg = _cfg(tmp_path, source="cifar10", path=str(arc), image_size=32, train_size=None,
               val_size=6, test_size=12, num_classes=10, verify_checksum=False)
    meta, did = prep.prepare(cfg)
    assert did and [meta["counts"][s]["total"] for s in prepared.SPLITS] == [90, 6, 12]
    assert meta["classes"] == [f"class{i}" for i in range(10)]
    assert meta["split"] == ("val: stratified 0.1 of the official training set (seed 0); "
                             "test: the official test set")
    assert sorted(meta["checksums"]) == ["batches.meta", "data_batch_1", "data_batch_2",
                                         "data_batch_3", "data_batch_4", "data_batch_5",
                                         "test_batch"]
    from ddpflow.data.archives import read_cifar

    official, _, _ = read_cifar("cifar10", arc, False)
    x, y = official["test"]
    keep = np.sort(np.random.default_rng(0 + 2).choice(30, size=12, replace=False))
    got = np.load(cfg.data_dir / "test_images.npy")
    assert np.array_equal(got, x[keep]) and np.array_equal(
        np.load(cfg.data_dir / "test_labels.npy"), y[keep])


def test_labels_out_of_range_in_an_archive_are_named_before_splitting(tmp_path):
    folder = idx_files(tmp_path / "m", n_train=60, n_test=20, bad_label=True)
    cfg = _cfg(tmp_path, source="mnist", path=str(folder), image_size=28, train_size=None,
               val_size=None, test_size=None, num_classes=10, verify_checksum=False)
    msg = _refusal(prep.prepare, cfg)
    assert msg.startswith("labels out of range in the train split: found 0..12, expected "
                          "0..9;"), msg


# ------------------------------------------------------------------ image folders

def _folder_cfg(tmp_path, root, **data):
    return _cfg(tmp_path, **{"source": "imagefolder", "path": str(root), "train_size": None,
                             "val_size": None, "test_size": None, "prepare_workers": 1, **data})


def test_image_folder_splits_caps_and_bad_files(tmp_path):
    root = image_tree(tmp_path / "imgs", classes=("a", "b"), per_class=10, size=(8, 8),
                      broken=2)
    cfg = _folder_cfg(tmp_path, root, val_size=2, test_size=1, max_bad_fraction=0.2,
                      val_fraction=0.2)
    meta, _ = prep.prepare(cfg)
    assert [meta["counts"][s]["total"] for s in prepared.SPLITS] == [14, 2, 1]
    assert meta["split"] == ("test: stratified 0.1 held out (seed 0); val: stratified 0.2 "
                             "held out (seed 0)")
    assert meta["classes"] == ["a", "b"] and meta["prepare_workers"] == 1
    assert sorted(s["file"] for s in meta["skipped"]) == [str(root / "a/broken0.jpg"),
                                                          str(root / "b/broken1.jpg")]
    assert {s["reason"] for s in meta["skipped"]} and meta["duplicates"] == []


def test_bad_files_at_exactly_the_allowed_fraction_pass_and_more_are_refused(tmp_path):
    root = image_tree(tmp_path / "imgs", classes=("a", "b"), per_class=3, size=(8, 8),
                      broken=1)  # 7 files, 1 unreadable
    meta, _ = prep.prepare(_folder_cfg(tmp_path, root, max_bad_fraction=1 / 7,
                                       val_fraction=0.25, test_fraction=0.0))
    assert [s["file"] for s in meta["skipped"]] == [str(root / "a/broken0.jpg")]
    for j in range(1, 4):
        (root / "a" / f"broken{j}.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    msg = _refusal(prep.prepare, _folder_cfg(tmp_path / "b", root, max_bad_fraction=0.3,
                                             val_fraction=0.25, test_fraction=0.0))
    head = "4 of 10 images could not be read, more than data.max_bad_fraction=0.3: "
    assert msg.startswith(head), msg
    shown = msg[len(head):].split("; ")
    broken = {str(root / "a" / f"broken{j}.jpg") for j in range(4)}
    files = {entry.split(" (")[0] for entry in shown}
    assert len(shown) == 3 and files < broken, shown
    assert shown == [f"{f} (UnidentifiedImageError: cannot identify image file '{f}')"
                     for f in (entry.split(" (")[0] for entry in shown)]


def test_one_class_folder_is_refused_and_two_are_enough(tmp_path):
    one = image_tree(tmp_path / "one", classes=("cat",), per_class=3, size=(8, 8))
    assert _refusal(prep.prepare, _folder_cfg(tmp_path, one)) == (
        f"{one} has one class folder (cat); classification needs at least two: add a folder "
        f"per class")
    two = image_tree(tmp_path / "two", classes=("cat", "dog"), per_class=3, size=(8, 8))
    meta, _ = prep.prepare(_folder_cfg(tmp_path / "x", two, val_fraction=0.3,
                                       test_fraction=0.0))
    assert meta["classes"] == ["cat", "dog"]


def test_split_folders_must_hold_the_same_classes(tmp_path):
    image_tree(tmp_path / "ds/train", classes=("a", "b"), per_class=3, size=(8, 8))
    image_tree(tmp_path / "ds/val", classes=("a", "c"), per_class=1, size=(8, 8), seed=1)
    ds = tmp_path / "ds"
    assert _refusal(prep.prepare, _folder_cfg(tmp_path, ds)) == (
        f"{ds / 'val'} has classes ['a', 'c'], {ds}/train has ['a', 'b']; they must be the "
        f"same folders")


def test_given_split_folders_are_kept_and_only_the_missing_split_is_held_out(tmp_path):
    image_tree(tmp_path / "ds/train", classes=("a", "b"), per_class=5, size=(8, 8))
    image_tree(tmp_path / "ds/test", classes=("a", "b"), per_class=2, size=(8, 8), seed=1)
    ds = tmp_path / "ds"
    meta, _ = prep.prepare(_folder_cfg(tmp_path, ds, val_fraction=0.2))
    assert meta["split"] == "test: ds/test/; val: stratified 0.2 held out (seed 0)"
    assert [meta["counts"][s]["per_class"] for s in prepared.SPLITS] == [[4, 4], [1, 1],
                                                                         [2, 2]]


def test_copies_inside_the_pool_stay_together(tmp_path):
    root = image_tree(tmp_path / "imgs", classes=("a", "b"), per_class=6, size=(8, 8))
    for c in ("a", "b"):
        for i in range(6):
            src = root / c / f"img{i:03d}"
            f = next(root.glob(f"{c}/img{i:03d}.*"))
            (src.parent / f"copy{i:03d}{f.suffix}").write_bytes(f.read_bytes())
    cfg = _folder_cfg(tmp_path, root, val_fraction=0.2, test_fraction=0.0)
    prep.prepare(cfg)
    seen = {}
    for split in prepared.SPLITS:
        for img in np.load(cfg.data_dir / f"{split}_images.npy"):
            seen.setdefault(img.tobytes(), set()).add(split)
    assert all(len(v) == 1 for v in seen.values())
    counts = {s: len(np.load(cfg.data_dir / f"{s}_labels.npy")) for s in prepared.SPLITS}
    assert counts == {"train": 20, "val": 4, "test": 0}


# ------------------------------------------------------------------ a user dataset

USER = '''
import torch
from torch.utils.data import Dataset


class Squares(Dataset):
    """8 x 8 images; label i % k (in val only the first k - 1 labels)."""

    def __init__(self, n, k, channels=3, top=None):
        self.n, self.k, self.channels, self.top = n, k, channels, top

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        label = i % (self.top or self.k)
        return torch.full((self.channels, 8, 8), label / self.k), label


class Named(Squares):
    classes = ["dark", "dim", "light"]


class Counted(Squares):
    num_classes = 5


def named(split):
    return None if split == "test" else Named(12 if split == "train" else 6, 3)


def counted(split):
    return Counted(10, 3)


def unnamed(split):
    return Squares(8 if split == "train" else 4, 4, top=4 if split == "train" else 2)


def grey_val(split):
    return Named(6, 3, channels=1 if split == "val" else 3)
'''


def _user_cfg(tmp_path, factory, **data):
    code = tmp_path / "code"
    code.mkdir(exist_ok=True)
    (code / "prepunitdata.py").write_text(USER)
    return _cfg(tmp_path, **{"source": "python", "factory": f"prepunitdata:{factory}",
                             "code_dir": str(code), **data})


def test_a_user_dataset_read_as_it_is_is_described_and_prepared_again(tmp_path, capsys):
    cfg = _user_cfg(tmp_path, "named")
    meta, did = prep.prepare(cfg)
    assert did and meta == _disk_meta(cfg)
    assert {k: meta[k] for k in ("kind", "counts", "num_classes", "input_shape",
                                 "in_channels", "bytes", "sha256", "format_version")} == {
        "kind": "python", "counts": {"train": {"total": 12}, "val": {"total": 6},
                                     "test": {"total": 0}},
        "num_classes": 3, "input_shape": [3, 8, 8], "in_channels": 3, "bytes": {},
        "sha256": {}, "format_version": prepared.FORMAT_VERSION}
    assert prep.describe(meta, cfg.data_dir, True) == (
        f"prepared python -> {cfg.data_dir}\n"
        f"  data.factory prepunitdata:named: train 12, val 6, test 0 items, input shape [3, 8, 8], "
        f"num_classes 3 (read through DataLoader when training)")
    assert prep.prepare(cfg) == (meta, False)
    # other settings: the folder (ddpflow's, meta.json included) is replaced
    meta2, did = prep.prepare(_user_cfg(tmp_path, "counted"))
    assert did and meta2["counts"]["test"] == {"total": 10} and meta2["num_classes"] == 5


def test_a_user_datasets_val_items_are_checked_against_the_training_channels(tmp_path):
    msg = _refusal(prep.prepare, _user_cfg(tmp_path, "grey_val"))
    assert "'val'" in msg and "channel" in msg, msg


def test_a_materialized_user_dataset_is_copied_with_its_class_names(tmp_path):
    cfg = _user_cfg(tmp_path, "named", materialize=True)
    meta, did = prep.prepare(cfg)
    assert did and meta["classes"] == ["dark", "dim", "light"] and meta["num_classes"] == 3
    assert [meta["counts"][s]["total"] for s in prepared.SPLITS] == [12, 6, 0]
    x = np.load(cfg.data_dir / "test_images.npy")
    assert x.shape == (0, 8, 8, 3) and x.dtype == np.uint8
    assert np.load(cfg.data_dir / "val_labels.npy").tolist() == [0, 1, 2] * 2


def test_a_materialized_dataset_without_names_has_its_count_or_the_largest_label(tmp_path):
    meta, _ = prep.prepare(_user_cfg(tmp_path, "counted", materialize=True))
    assert meta["classes"] == ["0", "1", "2", "3", "4"]  # num_classes 5, labels 0..2
    other = tmp_path / "o"
    other.mkdir()
    meta, _ = prep.prepare(_user_cfg(other, "unnamed", materialize=True))
    # train labels 0..3, val 0..1: the largest label of any split
    assert meta["classes"] == ["0", "1", "2", "3"]


# ------------------------------------------------------------------ the up-to-date rule

def test_up_to_date_touched_changed_verified_and_forced(tmp_path, capsys):
    cfg = _cfg(tmp_path)
    meta, did = prep.prepare(cfg)
    assert did is True
    assert prep.prepare(cfg) == (meta, False)
    labels = cfg.data_dir / "train_labels.npy"
    st = labels.stat()
    # touched, same bytes: up to date, the new time recorded
    os.utime(labels, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    again, did = prep.prepare(cfg)
    assert did is False and again["mtime_ns"]["train_labels.npy"] == st.st_mtime_ns + 10**9
    assert _disk_meta(cfg) == again
    assert prep.prepare(cfg) == (again, False)
    # other bytes, size and time put back: only `verify` (a full checksum) sees it
    y = np.load(labels)
    y[:4] = (y[:4] + 1) % 4
    np.save(labels, y)
    os.utime(labels, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert prep.prepare(cfg) == (again, False)
    capsys.readouterr()
    meta, did = prep.prepare(cfg, verify=True)
    assert did is True and meta == _disk_meta(cfg)
    assert capsys.readouterr().err == (
        f"ddpflow: prepared data at {cfg.data_dir} was changed after it was prepared "
        f"(checksum mismatch); preparing it again\n")
    assert prep.prepare(cfg, verify=True) == (meta, False)
    # changed in place (a new time): named, and prepared again
    np.save(labels, y)
    meta, did = prep.prepare(cfg)
    assert did is True and "changed after it was prepared (train_labels.npy)" in \
        capsys.readouterr().err
    forced, did = prep.prepare(cfg, force=True)
    assert did is True and forced["fingerprint"] == meta["fingerprint"]


def test_other_settings_or_a_damaged_meta_prepare_again(tmp_path):
    cfg = _cfg(tmp_path)
    prep.prepare(cfg)
    meta, did = prep.prepare(_cfg(tmp_path, train_size=20))
    assert did and meta["counts"]["train"]["total"] == 20
    (cfg.data_dir / "meta.json").write_text("[1, 2]")
    meta, did = prep.prepare(cfg)
    assert did and meta == _disk_meta(cfg) and meta["counts"]["train"]["total"] == 40


def test_out_writes_there_and_leaves_the_run_alone(tmp_path):
    cfg = _cfg(tmp_path)
    out = tmp_path / "elsewhere"
    meta, did = prep.prepare(cfg, out=out)
    assert did and prepared.read_meta(out) == meta and not cfg.data_dir.exists()
    # a folder the user named that holds arrays without meta.json is not ddpflow's to replace
    other = tmp_path / "foreign"
    other.mkdir()
    (other / "train_images.npy").write_bytes(b"x")
    msg = _refusal(prep.prepare, cfg, out=other)
    assert str(other) in msg and "train_images.npy" in msg, msg
    assert (other / "train_images.npy").read_bytes() == b"x"


def test_arrays_left_without_meta_in_ddpflows_own_place_are_rebuilt(tmp_path):
    cfg = _cfg(tmp_path)
    prep.prepare(cfg)
    (cfg.data_dir / "meta.json").unlink()  # Snakemake deletes an output before remaking it
    (cfg.data_dir / ".ddpflow-output").unlink(missing_ok=True)
    meta, did = prep.prepare(cfg)
    assert did and prepared.read_meta(cfg.data_dir) == meta


def test_a_held_lock_names_the_folder(tmp_path):
    cfg = _cfg(tmp_path)
    lock = cfg.data_dir.with_name("data.lock")
    lock.parent.mkdir(parents=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, b"pid 1 on host h\n")
        assert _refusal(prep.prepare, cfg) == (
            f"the prepared data folder {cfg.data_dir} is being written by another ddpflow "
            f"process (pid 1 on host h); wait for it to finish or stop it, then run again")
    finally:
        os.close(fd)


def test_own_place_is_the_run_or_a_sweeps_shared_data(tmp_path):
    def own(results_dir, prepared_dir):
        raw = tiny_config(tmp_path)
        raw["results_dir"] = str(results_dir)
        raw["data"]["prepared_dir"] = prepared_dir and str(prepared_dir)
        return prep._own_place(from_dict(raw))

    run = tmp_path / "results/t"
    assert own(tmp_path / "results", None) is True
    assert own(run / "trials", run / "sweep/data/abc") is True
    assert own(run / "trials", run / "data") is False
    assert own(run / "trials", tmp_path / "sweep/data/abc") is False
    assert own(run / "other", run / "sweep/data/abc") is False
    assert own(tmp_path / "results", tmp_path / "mine") is False


# ------------------------------------------------------------------ the summary printed

def _meta(**extra):
    meta = {"source": "imagefolder", "classes": ["a", "b"], "settings": {},
            "counts": {"train": {"total": 5, "per_class": [2, 3]},
                       "val": {"total": 2, "per_class": [1, 1]},
                       "test": {"total": 0, "per_class": [0, 0]}},
            "image_shape": [4, 4, 3], "mean": [0.5, 0.25, 0.125], "std": [0.1, 0.2, 0.3],
            "bytes": {"train_images.npy": 1000}, "bytes_written": 2_500_000, "seconds": 1.25,
            "images_per_s": 5.6}
    return {**meta, **extra}


def test_the_summary_lists_splits_shape_and_speed(tmp_path):
    assert prep.describe(_meta(), tmp_path, True) == "\n".join([
        f"prepared imagefolder -> {tmp_path}",
        "  train: 5 images (a=2, b=3)",
        "  val: 2 images (a=1, b=1)",
        "  test: 0 images (a=0, b=0)",
        "  image shape (4, 4, 3), mean [0.5, 0.25, 0.125], std [0.1, 0.2, 0.3]",
        "  2.5 MB written in 1.25 s (6 images/s)"])
    up = prep.describe(_meta(split="test: x; val: y", checksums={"b": "ok", "a": "not checked"}),
                       tmp_path, False)
    assert up.splitlines()[0] == f"prepared data at {tmp_path} is up to date (nothing to do)"
    lines = up.splitlines()
    assert lines[4] == "  splits: test: x; val: y"
    assert lines[6:8] == ["  checksum a: not checked", "  checksum b: ok"]


def test_the_summary_caps_long_class_lists_at_300_characters(tmp_path):
    def per(name):
        meta = _meta(classes=[name], counts={s: {"total": 1, "per_class": [1]}
                                             for s in prepared.SPLITS})
        return prep.describe(meta, tmp_path, True).splitlines()[1]

    assert per("x" * 298) == f"  train: 1 images ({'x' * 298}=1)"  # 300 characters: all
    assert per("x" * 299) == f"  train: 1 images ({'x' * 299}=, ...)"  # 301: cut at 300
    assert per("x" * 297) == f"  train: 1 images ({'x' * 297}=1)"


def test_the_summary_lists_dropped_copies_and_skipped_files_twenty_at_most(tmp_path):
    dups = [{"split": "val", "file": f"v{i}.png", "same_as_split": "train",
             "same_as": f"t{i}.png", "by": "sha256" if i else "inode"} for i in range(21)]
    skipped = [{"file": f"bad{i}.jpg", "reason": f"why {i}"} for i in range(21)]
    lines = prep.describe(_meta(duplicates=dups, skipped=skipped), tmp_path, True).splitlines()
    i = lines.index("  dropped 21 image(s) already in an earlier split (same inode/sha256):")
    assert lines[i + 1:i + 21] == [f"    val: v{k}.png = train: t{k}.png" for k in range(20)]
    assert lines[i + 21] == "  skipped 21 unreadable files:"
    assert lines[i + 22:i + 42] == [f"    bad{k}.jpg: why {k}" for k in range(20)]
    assert lines[i + 42].startswith("  2.5 MB written")


def test_the_summary_of_jpeg_shards_compares_with_raw_pixels(tmp_path):
    meta = _meta(encoding="jpeg", settings={"data.jpeg_quality": 85},
                 bytes={"train-000.jpgs": 10, "val-000.jpgs": 10, "train_labels.npy": 5},
                 bytes_written=200, image_shape=[10, 10, 3])
    assert prep.describe(meta, tmp_path, True).splitlines()[-2] == (
        "  JPEG shards, quality 85: 2 shard files; raw pixels would take 0.0 MB (10.5x more)")


# ------------------------------------------------------------------ archives.py: CIFAR

def _rows(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, 3072), dtype=np.uint8)


def _cifar(path, names=None, labels=(0, 1), folder=None, **members):
    """A CIFAR-10 python archive (a folder when `folder`), 2 rows a batch, members replaced
    by `members` (values pickled; None leaves the member out)."""
    import io
    import pickle
    import tarfile

    names = [b"a", b"b"] if names is None else names
    blobs = {f"data_batch_{i}": {b"data": _rows(len(labels), i), b"labels": list(labels)}
             for i in range(1, 6)}
    blobs["test_batch"] = {b"data": _rows(len(labels), 9), b"labels": list(labels)}
    blobs["batches.meta"] = {b"label_names": names}
    blobs.update(members)
    blobs = {k: v if isinstance(v, bytes) else pickle.dumps(v) for k, v in blobs.items()
             if v is not None}
    if folder:
        path.mkdir(parents=True)
        for k, v in blobs.items():
            (path / k).write_bytes(v)
        return path
    with tarfile.open(path, "w:gz") as tar:
        for k, v in blobs.items():
            info = tarfile.TarInfo(f"cifar-10-batches-py/{k}")
            info.size = len(v)
            tar.addfile(info, io.BytesIO(v))
    return path


def _cifar_refusal(path, verify=False):
    from ddpflow.data.archives import read_cifar

    return _refusal(read_cifar, "cifar10", path, verify)


def test_md5_reports_each_file_or_refuses_a_mismatch():
    from ddpflow.data.archives import _check_md5

    report = {}
    _check_md5("a", b"x", None, True, report)
    _check_md5("b", b"x", "0" * 32, False, report)
    _check_md5("c", b"x", hashlib.md5(b"x").hexdigest(), True, report)
    assert report == {"a": "no official checksum known",
                      "b": "not checked (data.verify_checksum: false)",
                      "c": "official MD5 verified"}
    assert _refusal(_check_md5, "d", b"x", "0" * 32, True, report) == (
        "d fails its official MD5 checksum: the file is corrupt, truncated or not the official "
        "release. Replace it, or set data.verify_checksum: false to use it anyway")
    assert "d" not in report


def test_cifar_pixels_are_hwc_rows_and_labels_with_a_report(tmp_path):
    from ddpflow.data.archives import read_cifar

    arc = _cifar(tmp_path / "c.tar.gz", labels=(1, 0, 1))
    splits, classes, report = read_cifar("cifar10", arc, False)
    assert classes == ["a", "b"]
    assert report == {n: "not checked (data.verify_checksum: false)" for n in (
        "data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5",
        "test_batch", "batches.meta")}
    x, y = splits["train"]
    want = np.concatenate([_rows(3, i) for i in range(1, 6)]).reshape(-1, 3, 32, 32)
    assert x.shape == (15, 32, 32, 3) and np.array_equal(x, want.transpose(0, 2, 3, 1))
    assert x[0, 1, 2, 1] == _rows(3, 1)[0, 1024 + 32 + 2]  # green plane, row 1, column 2
    assert y.dtype == np.int64 and y.tolist() == [1, 0, 1] * 5
    assert np.array_equal(splits["test"][0], _rows(3, 9).reshape(-1, 3, 32, 32).transpose(
        0, 2, 3, 1)) and splits["test"][1].tolist() == [1, 0, 1]
    # the official checksums are checked when asked (these are not the official files)
    assert _cifar_refusal(arc, True).endswith("fails its official MD5 checksum: the file is "
                                              "corrupt, truncated or not the official release. "
                                              "Replace it, or set data.verify_checksum: false "
                                              "to use it anyway")


def test_cifar_extracted_folders_at_either_level(tmp_path):
    from ddpflow.data.archives import read_cifar

    inner = _cifar(tmp_path / "x/cifar-10-batches-py", folder=True)
    for path in (inner, tmp_path / "x"):
        splits, classes, _ = read_cifar("cifar10", path, False)
        assert classes == ["a", "b"] and splits["train"][0].shape == (10, 32, 32, 3)


def test_cifar_members_missing_damaged_or_beside_a_folder_of_their_name(tmp_path):
    import io
    import tarfile

    arc = _cifar(tmp_path / "c.tar.gz", test_batch=None, **{"batches.meta": None})
    assert _cifar_refusal(arc) == (
        f"{arc} lacks batches.meta, test_batch: expected the official CIFAR 'python version' "
        f"archive or its extracted folder 'cifar-10-batches-py'")
    half = tmp_path / "half.tar.gz"
    half.write_bytes(_cifar(tmp_path / "full.tar.gz").read_bytes()[:300])
    assert _cifar_refusal(half).startswith(f"cannot read archive {half}: it is truncated or "
                                           f"corrupt (")
    assert _cifar_refusal(half).endswith("); download the official archive again")
    # a folder named like a member (after the member) is not the member
    arc = _cifar(tmp_path / "d.tar.gz")
    with tarfile.open(arc) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar]
    with tarfile.open(arc, "w:gz") as tar:
        for m, blob in members:
            tar.addfile(m, io.BytesIO(blob))
        d = tarfile.TarInfo("extra/test_batch")
        d.type = tarfile.DIRTYPE
        tar.addfile(d)
    from ddpflow.data.archives import read_cifar

    assert read_cifar("cifar10", arc, False)[1] == ["a", "b"]


def test_a_cifar_file_that_is_code_or_not_a_pickle_is_one_message(tmp_path):
    import pickle

    class Exploit:
        def __reduce__(self):
            return (os.system, ("true",))

    arc = _cifar(tmp_path / "c.tar.gz", data_batch_3=pickle.dumps({b"data": Exploit()}))
    assert _cifar_refusal(arc) == (
        "CIFAR file data_batch_3 is not plain data (refused to load posix.system: not dataset "
        "content); it is not an official CIFAR file: replace it")
    arc = _cifar(tmp_path / "e.tar.gz", test_batch=b"")
    assert _cifar_refusal(arc) == ("CIFAR file test_batch cannot be read (EOFError); it is "
                                   "truncated or corrupt")


def test_what_a_cifar_member_holds_as_the_schema_sees_it():
    from ddpflow.data.archives import view

    def nest(n, leaf):
        for _ in range(n):
            leaf = [leaf]
        return leaf

    marker = "(nested too deep)"
    assert view(nest(8, b"s")) == nest(8, "s")
    assert view(nest(12, "s")) == nest(9, marker)
    deep = b"v"
    for _ in range(9):
        deep = {b"k": deep}
    got = view(deep)
    for _ in range(8):
        assert list(got) == ["k"]
        got = got["k"]
    assert got == {marker: marker}
    assert view(np.zeros((2, 3), np.uint8)) == {"array": [2, 3], "dtype": "uint8"}
    assert view([1, np.int16(2)]) == {"array": [2], "dtype": "int64"}
    assert view([]) == [] and view([True, False]) == [True, False]
    assert view(["a", 1]) == ["a", 1] and view([1, "a"]) == [1, "a"]
    assert len(view(["a"] * 1001)) == 1000 and len(view(["a"] * 999)) == 999
    assert view(np.int64(3)) == 3 and type(view(np.int64(3))) is int and view(2.5) == 2.5
    assert view(None) == "NoneType" and view(b"\xff") == "\ufffd" and view("t") == "t"


@pytest.mark.parametrize("members, message", [
    ({"data_batch_2": {b"data": np.zeros((2, 3072, 1), np.uint8), b"labels": [0, 1]}},
     "data.array: 3 item(s), expected at most 2"),
    ({"data_batch_2": {b"data": np.zeros(6144, np.uint8), b"labels": [0, 1]}},
     "data.array: 1 item(s), expected at least 2"),
    ({"batches.meta": {b"label_names": [b"a"]}}, "label_names: 1 item(s), expected at least 2"),
    ({"batches.meta": {b"label_names": [b"a", b""]}},
     "label_names.1: '' is not allowed here (minLength 1)"),
    ({"batches.meta": {b"label_names": [b"a", b"a"]}},
     "label_names: \"['a', 'a'] has non-unique elements\""),
])
def test_a_cifar_member_outside_its_schema_is_named(tmp_path, members, message):
    msg = _cifar_refusal(_cifar(tmp_path / "c.tar.gz", **members))
    name = next(iter(members))
    assert msg.startswith(f"{tmp_path / 'c.tar.gz'}: {name} (a cifar10 file): "), msg
    assert message in msg, msg


def test_cifar_class_lists_at_the_schemas_edges_are_read(tmp_path):
    from ddpflow.data.archives import read_cifar

    arc = _cifar(tmp_path / "c.tar.gz", names=[b"c%d" % i for i in range(1000)])
    assert len(read_cifar("cifar10", arc, False)[1]) == 1000
    arc = _cifar(tmp_path / "d.tar.gz", names=[b"x", b"y"], labels=(0, 1))
    assert read_cifar("cifar10", arc, False)[1] == ["x", "y"]


@pytest.mark.parametrize("labels, message", [
    ((0, -1), "labels -1..0, but batches.meta names 2 classes"),
    ((2, 0), "labels 0..2, but batches.meta names 2 classes"),
])
def test_cifar_labels_outside_the_names_are_refused(tmp_path, labels, message):
    arc = _cifar(tmp_path / "c.tar.gz", data_batch_4={b"data": _rows(2), b"labels": labels})
    assert _cifar_refusal(arc) == (f"CIFAR file data_batch_4: {message}; it is not an "
                                   f"official CIFAR file: replace the archive")


def test_cifar_rows_and_labels_must_pair(tmp_path):
    arc = _cifar(tmp_path / "c.tar.gz", test_batch={b"data": _rows(3), b"labels": [0, 1]})
    assert _cifar_refusal(arc) == ("CIFAR file test_batch: 3 images but 2 labels; it is not an "
                                   "official CIFAR file: replace the archive")


# ------------------------------------------------------------------ archives.py: IDX

def _idx(folder, n=3, rows=4, cols=4, gz=False, images=None, labels=None):
    import gzip
    import struct

    folder.mkdir(parents=True, exist_ok=True)
    for prefix in ("train", "t10k"):
        x = np.arange(n * rows * cols, dtype=np.uint8).reshape(n, rows, cols)
        img = images if images is not None else (
            struct.pack(">HBB", 0, 8, 3) + struct.pack(">III", n, rows, cols) + x.tobytes())
        lab = labels if labels is not None else (
            struct.pack(">HBB", 0, 8, 1) + struct.pack(">I", n) + bytes(range(n)))
        for stem, blob in ((f"{prefix}-images-idx3-ubyte", img),
                           (f"{prefix}-labels-idx1-ubyte", lab)):
            if gz:
                (folder / (stem + ".gz")).write_bytes(gzip.compress(blob))
            else:
                (folder / stem).write_bytes(blob)
    return folder


def test_idx_files_read_plain_or_gzipped_with_their_classes(tmp_path):
    from ddpflow.data.archives import read_idx

    folder = _idx(tmp_path / "m")
    splits, classes, report = read_idx("mnist", folder, False)
    assert classes == [str(i) for i in range(10)]
    x, y = splits["train"]
    assert x.shape == (3, 4, 4, 1) and x.ravel().tolist() == list(range(48))
    assert y.dtype == np.int64 and y.tolist() == [0, 1, 2] and splits["test"][1].tolist() == \
        [0, 1, 2]
    assert report == {f"{p}-{k}": "no official checksum for the uncompressed file"
                      for p in ("train", "t10k")
                      for k in ("images-idx3-ubyte", "labels-idx1-ubyte")}
    splits, classes, report = read_idx("fashion_mnist", _idx(tmp_path / "f", gz=True), False)
    assert classes[0] == "T-shirt/top" and len(classes) == 10
    assert splits["test"][0].ravel().tolist() == list(range(48))
    assert set(report.values()) == {"not checked (data.verify_checksum: false)"}
    assert len(report) == 4 and all(k.endswith(".gz") for k in report)


def test_idx_folder_and_files_missing_or_damaged_are_named(tmp_path):
    from ddpflow.data.archives import read_idx

    f = tmp_path / "file"
    f.write_bytes(b"")
    assert _refusal(read_idx, "mnist", f, False) == (
        f"data.path for mnist must be the folder holding the IDX files, got {f}")
    folder = _idx(tmp_path / "m")
    (folder / "t10k-labels-idx1-ubyte").unlink()
    assert _refusal(read_idx, "mnist", folder, False) == (
        f"{folder} lacks t10k-labels-idx1-ubyte(.gz): expected the four official IDX files")
    gz = _idx(tmp_path / "g", gz=True)
    bad = gz / "train-images-idx3-ubyte.gz"
    bad.write_bytes(bad.read_bytes()[:20])
    assert _refusal(read_idx, "mnist", gz, False).startswith(f"{bad} is truncated or corrupt (")


def test_idx_files_of_the_wrong_rank_or_count_are_named(tmp_path):
    import struct

    from ddpflow.data.archives import read_idx

    flat = struct.pack(">HBB", 0, 8, 1) + struct.pack(">I", 3) + b"abc"
    folder = _idx(tmp_path / "a", images=flat)
    assert _refusal(read_idx, "mnist", folder, False) == (
        f"{folder / 'train-images-idx3-ubyte'} holds an array of shape (3,), where an MNIST "
        f"file holds (count, rows, columns): replace it with the official file")
    cube = struct.pack(">HBB", 0, 8, 3) + struct.pack(">III", 3, 1, 1) + b"abc"
    folder = _idx(tmp_path / "b", labels=cube)
    assert _refusal(read_idx, "mnist", folder, False) == (
        f"{folder / 'train-labels-idx1-ubyte'} holds an array of shape (3, 1, 1), where an "
        f"MNIST file holds (count,): replace it with the official file")
    two = struct.pack(">HBB", 0, 8, 1) + struct.pack(">I", 2) + b"ab"
    folder = _idx(tmp_path / "c", labels=two)
    assert _refusal(read_idx, "mnist", folder, False) == (
        f"{folder / 'train-images-idx3-ubyte'} and train-labels-idx1-ubyte do not match (3 "
        f"images, 2 labels): replace them with the official files")


@pytest.mark.parametrize("raw, words", [
    (b"\x00\x00\x08", "is truncated: it ends inside its IDX header"),
    (b"\x00\x00\x08\x01\x00\x00\x00", "is truncated: it ends inside its IDX header"),
    (b"\x00\x00\x08\x01\x00\x00\x00\x03",
     "is truncated: its header says (3,) (3 bytes), 0 bytes of data follow"),
])
def test_idx_headers_cut_at_each_byte_are_named(tmp_path, raw, words):
    from ddpflow.data.archives import _read_idx

    (tmp_path / "f").write_bytes(raw)
    assert _refusal(_read_idx, tmp_path / "f", False, None, {}) == (
        f"{tmp_path / 'f'} {words}; replace the file")


def test_resize_keeps_matching_images_and_resizes_the_rest_like_pillow():
    from PIL import Image

    from ddpflow.data.archives import resize_all

    rng = np.random.default_rng(0)
    same = rng.integers(0, 256, (2, 8, 8, 3), dtype=np.uint8)
    assert resize_all(same, 8) is same
    for shape, size in (((1, 6, 8, 3), 8), ((1, 8, 6, 3), 8), ((8, 6, 8, 3), 8),
                        ((1, 3, 5, 3), 3), ((2, 5, 5, 1), 3), ((3, 4, 3, 3), 3)):
        x = rng.integers(0, 256, shape, dtype=np.uint8)
        out = resize_all(x, size)
        assert out.shape == (shape[0], size, size, shape[3]) and out.dtype == np.uint8
        for im, got in zip(x, out):
            pil = Image.fromarray(im[..., 0] if shape[3] == 1 else im)
            want = np.asarray(pil.resize((size, size), Image.BILINEAR))
            assert np.array_equal(got, want.reshape(size, size, shape[3]))


# ------------------------------------------------------------------ imagefolder.py

def _png(path, colour, size=(6, 4)):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return str(path)


def test_scan_takes_sorted_class_folders_and_their_images_only(tmp_path):
    from ddpflow.data import imagefolder

    root = tmp_path / "r"
    b1 = _png(root / "b/x/deep.PNG", (0, 0, 255))
    a1 = _png(root / "a/1.png", (255, 0, 0))
    (root / "a/notes.txt").write_text("x")
    (root / "a/dir.png").mkdir()
    (root / ".cache/c.png").parent.mkdir()
    _png(root / ".cache/c.png", (0, 0, 0))
    (root / "README.png").write_bytes(b"")
    assert imagefolder.scan(root) == (["a", "b"], [(a1, 0), (b1, 1)])


def test_scan_names_a_missing_root_and_empty_folders(tmp_path):
    from ddpflow.data import imagefolder

    root = tmp_path / "r"
    assert _refusal(imagefolder.scan, root) == (
        f"image folder: {root} does not exist; expected <folder>/<class>/<image> files")
    root.mkdir()
    (root / ".hidden").mkdir()
    assert _refusal(imagefolder.scan, root) == (
        f"{root} has no class folders: expected {root}/<class>/<image> files")
    (root / "a").mkdir()
    (root / "a/x.txt").write_text("")
    exts = ".bmp, .gif, .jpeg, .jpg, .png, .ppm, .tif, .tiff, .webp"
    assert _refusal(imagefolder.scan, root) == (
        f"class folder {root / 'a'} has no images ({exts}); remove it or add images")


def test_workers_auto_is_the_cpu_count_or_one_when_unknown(monkeypatch):
    from ddpflow.data import imagefolder

    assert imagefolder.workers("3") == 3 and imagefolder.workers(2) == 2
    assert imagefolder.workers("auto") == (os.cpu_count() or 1)
    monkeypatch.setattr(os, "cpu_count", lambda: None)  # a system that cannot say
    assert imagefolder.workers("auto") == 1


class _Progress:
    """A progress bar that notes how many worker processes run at each update."""

    def __init__(self):
        self.steps, self.children = [], []

    def update(self, n):
        import multiprocessing

        self.steps.append(n)
        self.children.append(len(multiprocessing.active_children()))


def _decode_set(tmp_path):
    files = [(_png(tmp_path / "in/0.png", (255, 0, 0)), 0),
             (str(tmp_path / "in/bad.png"), 1),
             (_png(tmp_path / "in/2.png", (0, 255, 0), size=(4, 6)), 1),
             (_png(tmp_path / "in/3.png", (0, 0, 255)), 2)]
    (tmp_path / "in/bad.png").write_bytes(b"\x89PNG broken")
    return files


def test_decode_into_keeps_the_readable_in_order_and_shrinks_the_arrays(tmp_path):
    from ddpflow.data import imagefolder

    files = _decode_set(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    for grey, nworkers in ((False, 1), (True, 2)):
        bar = _Progress()
        kept, skipped = imagefolder.decode_into(out, "val", files, 4, grey, nworkers, bar)
        assert kept == 3 and [f for f, _ in skipped] == [files[1][0]]
        assert skipped[0][1].startswith("UnidentifiedImageError: cannot identify image file")
        assert bar.steps == [1, 1, 1, 1]
        assert (max(bar.children) > 0) == (nworkers > 1)
        import multiprocessing

        assert multiprocessing.active_children() == []  # the workers ended
        x = np.load(out / "val_images.npy")
        assert np.load(out / "val_labels.npy").tolist() == [0, 1, 2]
        if grey:
            assert x.shape == (3, 4, 4, 1)
            assert x[:, 0, 0, 0].tolist() == [76, 150, 29]  # ITU-R 601 luma of R, G, B
        else:
            assert x.shape == (3, 4, 4, 3)
            assert x[:, 2, 1].tolist() == [[255, 0, 0], [0, 255, 0], [0, 0, 255]]
    kept, skipped = imagefolder.decode_into(out, "test", files[:1], 4, False, 1, None)
    assert (kept, skipped) == (1, []) and np.load(out / "test_images.npy").shape == (1, 4, 4, 3)


def test_decode_into_jpeg_shards_in_colour_and_reports_unreadable_files(tmp_path):
    from ddpflow.data import imagefolder, shards

    files = _decode_set(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    store = {"encoding": "jpeg", "quality": 95, "shard_bytes": 1 << 20}
    kept, skipped = imagefolder.decode_into(out, "train", files, 16, False, 1, None, store)
    assert kept == 3 and [f for f, _ in skipped] == [files[1][0]]
    names = {p.name: p.stat().st_size for p in out.iterdir()}
    x = shards.JpegImages(out, "train", (16, 16, 3), names)
    assert len(x) == 3
    got = np.stack([x[i] for i in range(3)])[:, 8, 8].astype(int)
    want = np.array([[255, 0, 0], [0, 255, 0], [0, 0, 255]])
    assert np.abs(got - want).max() < 8, got
    assert np.load(out / "train_labels.npy").tolist() == [0, 1, 2]


def test_content_keys_hash_only_sizes_that_repeat_and_links_once(tmp_path):
    from ddpflow.data import imagefolder

    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    a.write_bytes(b"same")
    b.write_bytes(b"same")
    c.write_bytes(b"unique size")
    os.link(a, tmp_path / "a2")
    big = tmp_path / "big1"
    big.write_bytes(b"x" * (3 << 20) + b"1")
    (tmp_path / "big2").write_bytes(b"x" * (3 << 20) + b"2")
    keys = imagefolder.content_keys([str(p) for p in (a, b, c, tmp_path / "a2", big,
                                                      tmp_path / "big2")])
    digest = hashlib.sha256(b"same").hexdigest()
    ino = {p: (os.stat(p).st_dev, os.stat(p).st_ino) for p in (a, b, c)}
    assert keys[str(a)] == (digest, ino[a]) and keys[str(b)] == (digest, ino[b])
    assert keys[str(tmp_path / "a2")] == (digest, ino[a]) and keys[str(c)] == (None, ino[c])
    assert keys[str(big)][0] == hashlib.sha256(big.read_bytes()).hexdigest()
    assert keys[str(big)][0] != keys[str(tmp_path / "big2")][0]


def test_copies_in_the_pool_follow_their_first(tmp_path):
    from ddpflow.data import imagefolder

    keys = {"a": ("h1", 1), "b": (None, 2), "a2": ("h1", 3), "c": ("h2", 4), "a3": ("h1", 5),
            "d": (None, 6)}
    pool = [("a", 0), ("b", 0), ("a2", 1), ("c", 1), ("a3", 0), ("d", 1)]
    assert imagefolder.gather_copies(pool, keys) == (
        [("a", 0), ("b", 0), ("c", 1), ("d", 1)], {"a": [("a2", 1), ("a3", 0)]})


def test_an_image_already_in_an_earlier_split_is_dropped_and_noted(tmp_path):
    from ddpflow.data import imagefolder

    t1 = tmp_path / "t1.png"
    t1.write_bytes(b"one")
    (tmp_path / "t1copy.png").write_bytes(b"one")  # a copy inside train: kept
    os.link(t1, tmp_path / "v_link.png")
    (tmp_path / "v_copy.png").write_bytes(b"one")
    (tmp_path / "v_own.png").write_bytes(b"two")
    (tmp_path / "u.png").write_bytes(b"thre")
    (tmp_path / "w.png").write_bytes(b"four")
    f = {p: str(tmp_path / f"{p}.png") for p in ("t1", "t1copy", "v_link", "v_copy",
                                                "v_own", "u", "w")}
    items = {"test": [(f["v_copy"], 0), (f["u"], 1), (f["w"], 1)],
             "val": [(f["v_link"], 1), (f["v_own"], 1), (f["u"], 0), (f["v_own"], 0)],
             "train": [(f["t1"], 0), (f["t1copy"], 1)]}
    out, notes = imagefolder.drop_duplicates(items, ["cat", "dog"])
    assert out == {"train": [(f["t1"], 0), (f["t1copy"], 1)],
                   "val": [(f["v_own"], 1), (f["u"], 0), (f["v_own"], 0)],
                   "test": [(f["w"], 1)]}
    assert list(out) == ["train", "val", "test"]
    assert notes == [
        {"file": f["v_link"], "split": "val", "same_as": f["t1"], "same_as_split": "train",
         "by": "link", "classes": ["cat", "dog"]},
        {"file": f["v_copy"], "split": "test", "same_as": f["t1"], "same_as_split": "train",
         "by": "content", "classes": ["cat", "cat"]},
        {"file": f["u"], "split": "test", "same_as": f["u"], "same_as_split": "val",
         "by": "link", "classes": ["cat", "dog"]}]


def test_a_split_made_only_of_earlier_images_is_refused(tmp_path):
    from ddpflow.data import imagefolder

    for name, blob in (("t", b"one"), ("v", b"two"), ("c", b"one"), ("w", b"four")):
        (tmp_path / f"{name}.png").write_bytes(blob)
    f = {n: str(tmp_path / f"{n}.png") for n in "tvcw"}
    items = {"train": [(f["t"], 1)], "val": [(f["v"], 0)], "test": [(f["c"], 0)]}
    assert _refusal(imagefolder.drop_duplicates, items, ["cat", "dog"]) == (
        f"every test image is also in the train images (e.g. {f['c']} = {f['t']}), so test "
        f"would be empty; give the test split images of its own")
    keys = imagefolder.content_keys(list(f.values()))
    items["test"] = [(f["c"], 0), (f["w"], 0)]
    out, notes = imagefolder.drop_duplicates(items, ["cat", "dog"], keys)
    assert out["test"] == [(f["w"], 0)] and notes == [
        {"file": f["c"], "split": "test", "same_as": f["t"], "same_as_split": "train",
         "by": "content", "classes": ["dog", "cat"]}]
    assert imagefolder.drop_duplicates({"train": [(f["t"], 0)], "val": []}, ["a"], keys) == (
        {"train": [(f["t"], 0)], "val": []}, [])


def test_a_prepare_stopped_once_its_folder_is_in_place_leaves_a_whole_record(tmp_path,
                                                                             monkeypatch):
    """The last write (the times in their final place) fails: the folder in place already
    holds a complete meta.json, so the next run finds it up to date and can summarise it."""
    from ddpflow.core import writing

    cfg = _cfg(tmp_path)
    final = cfg.data_dir / "meta.json"

    def failing(path, obj, *a, **kw):
        if Path(path) == final:
            raise OSError(5, "Input/output error")  # a disk that fails that one write
        return writing.write_json_atomic(path, obj, *a, **kw)

    monkeypatch.setattr(prep, "write_json_atomic", failing)
    with pytest.raises(OSError):
        prep.prepare(cfg)
    monkeypatch.undo()
    meta, did = prep.prepare(cfg)
    assert did is False and meta["counts"]["train"]["total"] == 40
    assert prep.describe(meta, cfg.data_dir, did).splitlines()[-1].endswith("images/s)")


# ------------------------------------------------------------------ shards.py

def _jpegs(n=3):
    from ddpflow.data import shards

    return [np.frombuffer(shards.encode(np.full((8, 8, 3), 40 * i, np.uint8), 90), np.uint8)
            for i in range(n)]


def test_decode_many_without_torchvision_decodes_with_pillow(monkeypatch):
    import sys

    from ddpflow.data import shards

    bufs = _jpegs()
    monkeypatch.setitem(sys.modules, "torchvision.io", None)  # a torch without torchvision
    out = shards.decode_many(bufs)
    assert len(out) == 3 and all(np.array_equal(a, shards.decode(b)) for a, b in zip(out, bufs))


def test_decode_many_hides_torchvisions_deprecation_warning():
    import warnings

    from ddpflow.data import shards

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        shards.decode_many(_jpegs(1))
    assert not [w for w in seen if "decoding and encoding capabilities" in str(w.message)]


def test_decode_many_keeps_torch_dynamo_out_of_the_process(tmp_path):
    """`import torchvision` would import torch._dynamo (seconds of a loader's start-up)."""
    import subprocess
    import sys

    code = ("import sys, numpy as np\n"
            "from ddpflow.data import shards\n"
            "b = np.frombuffer(shards.encode(np.zeros((8, 8, 3), np.uint8), 90), np.uint8)\n"
            "assert shards.decode_many([b])[0].shape == (8, 8, 3)\n"
            "print(type(sys.modules['torch._dynamo']).__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                         check=True).stdout
    assert out.strip() == "_Standin"


def test_a_written_split_leaves_no_file_open(tmp_path):
    """Each shard is closed by the writer, not left to the garbage collector (Python's
    ResourceWarning: an unclosed file, whose last write could be lost)."""
    import gc
    import warnings

    from ddpflow.data import shards

    before = len(os.listdir("/proc/self/fd"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", ResourceWarning)
        w = shards.ShardWriter(tmp_path, "train", 1)
        for b in _jpegs(4):
            w.append(bytes(b), 0)
        assert w.close() == 4 and len(list(tmp_path.glob("train-*.jpgs"))) == 4
        assert len(os.listdir("/proc/self/fd")) == before
        del w
        gc.collect()
    assert not [x for x in seen if issubclass(x.category, ResourceWarning)]


def test_one_byte_images_under_a_zero_size_each_get_a_shard(tmp_path):
    from ddpflow.data import shards

    w = shards.ShardWriter(tmp_path, "val", 0)
    for i in range(3):
        w.append(b"x", i)
    w.close()
    assert np.load(tmp_path / "val_index.npy")[:, :2].tolist() == [[0, 0], [1, 0], [2, 0]]
    recorded = {p.name: p.stat().st_size for p in tmp_path.iterdir()}
    x = shards.JpegImages(tmp_path, "val", (1, 1, 3), recorded)
    assert [bytes(x.encoded(i)) for i in range(3)] == [b"x"] * 3  # stored bytes, as stored


def _shard_split(tmp_path, n=4):
    from ddpflow.data import shards

    imgs = np.stack([np.full((16, 16, 3), 30 * i, np.uint8) for i in range(n)])
    shards.write_split(tmp_path, "train", imgs, np.arange(n), 90, 10**6)
    recorded = {p.name: p.stat().st_size for p in tmp_path.iterdir()}
    return recorded


def test_an_entry_naming_the_shard_one_past_the_last_is_a_bad_sample(tmp_path):
    from ddpflow.data import shards

    recorded = _shard_split(tmp_path)
    index = np.load(tmp_path / "train_index.npy")
    index[2, 0] = 1  # one shard only: shard 1 does not exist
    np.save(tmp_path / "train_index.npy", index)
    x = shards.JpegImages(tmp_path, "train", (16, 16, 3), recorded)
    off, n = int(index[2, 1]), int(index[2, 2])
    assert x.where(2) == f"train sample 2 (shard #1 @ {off})"
    with pytest.raises(ValueError) as e:
        x.encoded(2)
    assert str(e.value) == (f"index entry (shard 1, offset {off}, {n} bytes) lies outside the "
                            f"shard's 0 bytes")


def test_bad_entries_of_one_shard_are_reported_in_file_order(tmp_path):
    from ddpflow.data import shards

    recorded = _shard_split(tmp_path)
    index = np.load(tmp_path / "train_index.npy")
    index[[1, 3], 3] += 1  # both CRCs wrong
    np.save(tmp_path / "train_index.npy", index)
    x = shards.JpegImages(tmp_path, "train", (16, 16, 3), recorded)
    bufs, bad = x.read([3, 2, 1])
    assert sorted(bufs) == [1] and [i for i, _ in bad] == [1, 3]
    images, kept, bad = x.fetch([3, 2, 1, 0])
    assert kept == [1, 3] and [i for i, _ in bad] == [1, 3] and images.shape == (2, 16, 16, 3)
