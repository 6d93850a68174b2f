"""The data surfaces hardened by class (docs/RELIABILITY.md, notes/hardening.md): an image
folder's split folders (the names neighbouring tools use recognised, split-like others
refused), the same image in two splits (dropped from the later one, listed), and image
encodings (one decoding, images.load, for prepare and for predict / evaluate --images)."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from conftest import ddpflow, tiny_config, write_config
from ddpflow.config import from_dict
from ddpflow.core.errors import UserError
from ddpflow.data import imagefolder, images, splits
from ddpflow.data.prepare import _folder_items
from ddpflow.inference import common

S = 16  # every test image is S x S, stored at store_size S: the fit is the identity


def png(path, value=0):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((8, 8, 3), value, np.uint8)).save(path)
    return path


def tree(root, folders, classes=("cat", "dog")):
    """root/<folder>/<class>/0.png, or root/<class>/0.png for folders ()."""
    for i, f in enumerate(folders or [""]):
        for j, c in enumerate(classes):
            png(root / f / c / "0.png", 10 * i + j)
    return root


# ---- split folders: one row per naming class --------------------------------------------
SPLIT_ROWS = [  # (folders at the top, {split: folder} or the UserError's words)
    ((), {}),  # class folders only: splits held out of them
    (("train", "val", "test"), {"train": "train", "val": "val", "test": "test"}),
    (("train", "valid"), {"train": "train", "val": "valid"}),  # Roboflow / YOLO
    (("train", "validation", "test"), {"train": "train", "val": "validation", "test": "test"}),
    (("training", "val"), "training looks like a split folder"),  # the report
    (("Train", "Val"), "Train looks like a split folder"),  # capitalised
    (("train", "testing"), "testing looks like a split folder"),
    (("train", "eval"), "eval looks like a split folder"),
    (("train", "val", "valid"), "two val folders, val/ and valid/"),
    (("train", "val", "cat"), "mixes split folders (train, val) with other folders (cat)"),
    (("val", "test"), "no train/ folder"),
]


@pytest.mark.parametrize("folders, want", SPLIT_ROWS, ids=[
    "classes-only", "train-val-test", "valid", "validation", "training", "capitalised",
    "testing", "eval", "two-val-folders", "splits-and-classes", "no-train"])
def test_split_folder_names(tmp_path, folders, want):
    root = tree(tmp_path / "ds", folders)
    if isinstance(want, dict):
        assert splits.folder_splits(root) == {s: root / f for s, f in want.items()}
        return
    with pytest.raises(UserError) as e:
        splits.folder_splits(root)
    msg = str(e.value)
    assert want in msg and "\n" not in msg
    assert "train/, val/ (or valid/, validation/) and test/" in msg or "keep one" in msg


def test_split_folder_names_skip_files_and_hidden_folders_and_name_the_first_odd_one(
        tmp_path):
    assert splits.folder_splits(tmp_path / "missing") == {}
    root = tree(tmp_path / "ds", ("train", "val"))
    (root / "notes.txt").write_text("not a folder")
    (root / ".cache").mkdir()
    assert splits.folder_splits(root) == {"train": root / "train", "val": root / "val"}
    with pytest.raises(UserError, match="two/testing looks like"):
        splits.folder_splits(tree(tmp_path / "two", ("testing", "training")))


def test_prepare_refuses_training_folder_in_one_line(tmp_path):
    root = tree(tmp_path / "ds", ("training", "val"))
    raw = tiny_config(tmp_path, data={"source": "imagefolder", "path": str(root),
                                      "train_size": None, "val_size": None})
    proc = ddpflow("prepare", "--config", write_config(tmp_path, raw))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "ds/training looks like a split folder" in lines[0]
    assert "rename it to train/" in lines[0]
    assert not (tmp_path / "results/t/data").exists()
    assert not list((tmp_path / "results/t").glob(".data.partial*"))


# ---- the same image in two splits ---------------------------------------------------------
def _copy(a, b):
    b.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(a, b)


def _symlink(a, b):
    b.parent.mkdir(parents=True, exist_ok=True)
    b.symlink_to(a)


def _hardlink(a, b):
    b.parent.mkdir(parents=True, exist_ok=True)
    os.link(a, b)


@pytest.mark.parametrize("make, by", [(_copy, "content"), (_symlink, "link"),
                                      (_hardlink, "link")], ids=["copy", "symlink", "hardlink"])
def test_an_image_in_two_splits_is_dropped_from_the_later(tmp_path, make, by):
    a = png(tmp_path / "train/cat/a.png", 1)
    own = png(tmp_path / "train/cat/b.png", 2)  # same size as a, other bytes: kept
    also = png(tmp_path / "val/cat/own.png", 3)
    make(a, tmp_path / "val/cat/dup.png")
    make(a, tmp_path / "test/cat/dup.png")
    make(a, tmp_path / "train/cat/again.png")  # twice in one split: not a leak, kept
    items = {"train": [(str(a), 0), (str(own), 0), (str(tmp_path / "train/cat/again.png"), 0)],
             "val": [(str(tmp_path / "val/cat/dup.png"), 0), (str(also), 0)],
             "test": [(str(tmp_path / "test/cat/dup.png"), 0), (str(png(tmp_path / "t.png", 4)),
                                                                 0)]}
    kept, notes = imagefolder.drop_duplicates(dict(reversed(items.items())), ["cat"])
    assert kept["train"] == items["train"]
    assert kept["val"] == [(str(also), 0)] and len(kept["test"]) == 1
    assert [(n["split"], n["same_as_split"], n["same_as"], n["by"]) for n in notes] == [
        ("val", "train", str(a), by), ("test", "train", str(a), by)]


@pytest.mark.parametrize("layout", ["classes-only", "train-and-valid"])
def test_held_out_draws_never_split_copies(tmp_path, layout):
    """Copies inside the pool are drawn together; a valid/ link to a train/ image is dropped
    from valid/ whichever split the draw sends the train/ image to."""
    root = tmp_path / "ds"
    pool = root / ("train" if layout == "train-and-valid" else "")
    for c, name in enumerate(("cat", "dog")):
        for i in range(10):
            _copy(png(pool / name / f"{i}.png", 20 * c + i), pool / name / f"copy{i}.png")
        if layout == "train-and-valid":
            png(root / "valid" / name / "own.png", 99 - c)
            _symlink(pool / name / "0.png", root / "valid" / name / "link.png")
    cfg = from_dict(tiny_config(tmp_path, data={
        "source": "imagefolder", "path": str(root), "val_fraction": 0.2, "test_fraction": 0.2}))
    meta = {}
    _, items = _folder_items(cfg, root, meta)
    where = {}
    for split, part in items.items():
        for f, _ in part:
            where.setdefault(Path(f).read_bytes(), set()).add(split)
    assert all(len(v) == 1 for v in where.values()) and len(where) == 20 + 2 * (
        layout == "train-and-valid")
    assert sum(map(len, items.values())) == 40 + 2 * (layout == "train-and-valid")
    assert [d["file"] for d in meta["duplicates"]] == (
        [str(root / f"valid/{n}/link.png") for n in ("cat", "dog")]
        if layout == "train-and-valid" else [])


def test_a_split_that_is_a_copy_of_train_is_refused(tmp_path):
    a = png(tmp_path / "train/cat/a.png", 1)
    _copy(a, tmp_path / "val/cat/a.png")
    with pytest.raises(UserError, match="every val image is also in the train images"):
        imagefolder.drop_duplicates({"train": [(str(a), 0)],
                                     "val": [(str(tmp_path / "val/cat/a.png"), 0)]}, ["cat"])


# ---- encodings: one row per class, through prepare's and predict's callers -------------------
def _grad16():
    return (np.arange(S * S) * 257).reshape(S, S).astype(np.uint16)


def _steps():
    return np.arange(S * S, dtype=np.uint8).reshape(S, S)


def _rgb(a):
    return np.repeat(a[..., None], 3, axis=2)


def _palette(p):
    im = Image.new("P", (S, S), 0)
    im.putpalette([10, 20, 30, 200, 100, 50] + [0] * 762)
    im.paste(1, (0, 0, S // 2, S))
    im.save(p, transparency=0)  # index 0 transparent: its colour kept, alpha dropped
    want = np.zeros((S, S, 3), np.uint8)
    want[:] = (10, 20, 30)
    want[:, : S // 2] = (200, 100, 50)
    return want


def _exif(p):
    a = np.zeros((S, S, 3), np.uint8)
    a[: S // 2, :, 0] = 255  # red top half, green left column: asymmetric
    a[:, 0, 1] = 255
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: shown rotated 90 degrees clockwise
    Image.fromarray(a).save(p, exif=exif)
    return np.rot90(a, -1)


def _cmyk(p):
    c = np.zeros((S, S, 4), np.uint8)
    c[: S // 2, :, 0] = 255  # cyan
    c[S // 2:, : S // 2, 3] = 255  # black
    Image.fromarray(c, "CMYK").save(p)  # bottom right: no ink, white
    want = np.full((S, S, 3), 255, np.uint8)
    want[: S // 2] = (0, 255, 255)
    want[S // 2:, : S // 2] = 0
    return want


def _gif(p):
    frames = [Image.new("RGB", (S, S), (255, 0, 0)), Image.new("RGB", (S, S), (0, 0, 255))]
    frames[0].save(p, save_all=True, append_images=frames[1:])
    return np.tile(np.array([255, 0, 0], np.uint8), (S, S, 1))


def _save(a, mode=None):
    return lambda p: Image.fromarray(a, mode).save(p)


ENCODINGS = {  # name: (file name, writer returning the expected RGB or None, or (writer, want))
    "16-bit-png": ("g16.png", _save(_grad16()), _rgb(_steps())),  # the report: was all 255
    "16-bit-big-endian-tiff": ("g16b.tif", lambda p: Image.frombytes(
        "I;16B", (S, S), _grad16().astype(">u2").tobytes()).save(p), _rgb(_steps())),
    "32-bit-int-tiff": ("i32.tif", _save(_grad16().astype(np.int32)), _rgb(_steps())),
    "float-0-1-tiff": ("f01.tif", _save((_steps() / 255).astype(np.float32)), _rgb(_steps())),
    "float-0-255-tiff": ("f255.tif", _save(_steps().astype(np.float32)), _rgb(_steps())),
    "palette-transparency": ("p.png", _palette, None),
    "la-alpha-dropped": ("la.png", _save(np.stack([_steps(), np.zeros((S, S), np.uint8)], 2),
                                         "LA"), _rgb(_steps())),
    "rgba-alpha-dropped": ("rgba.png", _save(np.dstack([_rgb(_steps()), _steps()[::-1]])),
                           _rgb(_steps())),
    "cmyk-tiff": ("cmyk.tif", _cmyk, None),
    "exif-orientation": ("exif.png", _exif, None),
    "multi-frame-gif": ("anim.gif", _gif, None),
}


def _write(folder, name):
    file, writer, want = ENCODINGS[name]
    path = folder / file
    path.parent.mkdir(parents=True, exist_ok=True)
    got = writer(path)
    return path, got if want is None else want


def _both_callers(path, grayscale):
    """What prepare's decoding (imagefolder.decode_file) and predict's (common.decode) make of
    the file: the same array, or the same reason."""
    arr, err = imagefolder.decode_file((str(path), S, grayscale))
    x, kept, bad = common.decode([str(path)], S, grayscale)
    if arr is None:
        assert kept == [] and bad == {0: err}
        return None, err
    assert kept == [0] and np.array_equal(x[0], arr)
    return arr, None


def test_prepare_and_predict_decode_through_images_fitted(tmp_path, monkeypatch):
    calls, real = [], images.fitted
    monkeypatch.setattr(images, "fitted", lambda *a: calls.append(a) or real(*a))
    path = png(tmp_path / "a.png")
    imagefolder.decode_file((str(path), S, False))  # prepare's worker
    common.decode([str(path)], S, True)  # predict's and evaluate --images' reading
    assert calls == [(str(path), S, False), (str(path), S, True)]


@pytest.mark.parametrize("name", list(ENCODINGS))
def test_encodings_decode_faithfully(tmp_path, name):
    path, want = _write(tmp_path, name)
    arr, err = _both_callers(path, grayscale=False)
    assert err is None and arr.dtype == np.uint8 and np.array_equal(arr, want), (arr, want)


@pytest.mark.parametrize("name, want", [
    ("16-bit-png", _steps()[..., None]),
    ("rgba-alpha-dropped", _steps()[..., None]),
    ("cmyk-tiff", None)], ids=["16-bit", "rgba", "cmyk"])
def test_encodings_as_grayscale(tmp_path, name, want):
    path, rgb = _write(tmp_path, name)
    arr, err = _both_callers(path, grayscale=True)
    if want is None:  # ITU-R 601 luma of the RGB: white 255, black 0, cyan 179
        want = np.asarray(Image.fromarray(rgb).convert("L"))[..., None]
        assert {int(v) for v in np.unique(want)} == {0, 179, 255}
    assert err is None and arr.shape == (S, S, 1) and np.array_equal(arr, want)


@pytest.mark.parametrize("make, words", [
    (_save(np.full((S, S), 300.0, np.float32)), "float pixels span 300..300, neither 0..1"),
    (_save(np.full((S, S), np.nan, np.float32)), "float pixels include NaN"),
    (_save(np.full((S, S), -5, np.int32)), "32-bit integer pixels span -5..-5"),
    (lambda p: p.write_bytes(b"\x89PNG\r\n\x1a\n truncated"), "OSError: Truncated"),
    (lambda p: p.write_bytes(b"not an image at all"), "UnidentifiedImageError"),
], ids=["float-out-of-range", "float-nan", "int-negative", "truncated", "not-an-image"])
def test_encodings_refused_with_a_reason(tmp_path, make, words):
    path = tmp_path / "x.tif"
    make(path)
    arr, err = _both_callers(path, grayscale=False)
    assert arr is None and words in err and "\n" not in err


@pytest.mark.parametrize("limit", [200, 100], ids=["over-the-limit", "over-twice-the-limit"])
def test_a_decompression_bomb_is_a_reason_not_a_traceback(tmp_path, monkeypatch, limit):
    """S x S = 256 pixels: over PIL's limit (a warning in PIL) and over twice it (an error in
    PIL) are both a per-file refusal."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", limit)
    path = tmp_path / "big.png"
    Image.new("RGB", (S, S)).save(path)
    arr, err = _both_callers(path, grayscale=False)
    assert arr is None and err.startswith("too many pixels") and "decompression bomb" in err


def test_prepare_stores_what_predict_reads(tmp_path):
    """One image folder, a class per encoding in train/, validation/ and test/ of their own
    (plus a copy of a training image in test/, dropped): prepare's stored pixels are the
    expected ones and what predict's reading of the same files gives."""
    root, wants = tmp_path / "ds", {}
    for name in ENCODINGS:
        path, wants[name] = _write(root / "train" / name, name)
        png(root / "validation" / name / "v.png", 7)
        png(root / "test" / name / "t.png", 9)
    _copy(root / "train/16-bit-png/g16.png", root / "test/16-bit-png/copy.png")
    raw = tiny_config(tmp_path, data={"source": "imagefolder", "path": str(root),
                                      "image_size": S, "store_size": S, "train_size": None,
                                      "val_size": None, "prepare_workers": 2})
    proc = ddpflow("prepare", "--config", write_config(tmp_path, raw), check=True)
    data = tmp_path / "results/t/data"
    meta = json.loads((data / "meta.json").read_text())
    assert meta["classes"] == sorted(ENCODINGS) and "val: ds/validation/" in meta["split"]
    assert [(d["split"], d["by"]) for d in meta["duplicates"]] == [("test", "content")]
    assert "copy.png" in proc.stdout and meta["counts"]["test"]["total"] == len(ENCODINGS)
    x = np.load(data / "train_images.npy")
    y = np.load(data / "train_labels.npy")
    for label, name in enumerate(meta["classes"]):
        file = root / "train" / name / ENCODINGS[name][0]
        stored = x[y == label]
        assert len(stored) == 1 and np.array_equal(stored[0], wants[name]), name
        assert np.array_equal(common.decode([str(file)], S, False)[0][0], stored[0]), name


# --------------------------------------------------------------------------- archives
# Every field read from a CIFAR or IDX file is a field of a file ddpflow did not write: each
# member goes through the reading boundary's schema (core/reading.validate) before any field
# is used. A row per class: (member spoiled, content, the message)
GOOD_ROWS = np.zeros((2, 3072), np.uint8)
CIFAR_ROWS = [
    ("meta without label_names", "batches.meta", {b"names": [b"a"] * 10},
     "batches.meta (a cifar10 file): label_names: missing"),
    ("meta names not a list", "batches.meta", {b"label_names": b"airplane"},
     "label_names: 'airplane' is not of type 'array'"),
    ("meta names of one class", "batches.meta", {b"label_names": [b"a"]},
     "label_names: 1 item(s), expected at least 2"),
    ("meta names a class twice", "batches.meta", {b"label_names": [b"cat", b"cat", b"dog"]},
     "label_names: \"['cat', 'cat', 'dog'] has non-unique elements\""),
    ("meta names an empty class", "batches.meta", {b"label_names": [b"cat", b""]},
     "label_names.1: '' is not allowed here (minLength 1)"),
    ("meta a list, not a dict", "batches.meta", [b"a", b"b"],
     "batches.meta (a cifar10 file): (top level)"),
    ("batch without data", "data_batch_2", {b"labels": [0, 1]}, "data_batch_2 (a cifar10 "
                                                                 "file): data: missing"),
    ("batch rows of the wrong width", "data_batch_2", {b"data": np.zeros((2, 3000), np.uint8),
                                                       b"labels": [0, 1]}, "data.array.1"),
    ("batch of floats", "data_batch_2", {b"data": np.zeros((2, 3072), np.float32),
                                         b"labels": [0, 1]}, "data.dtype: 'float32' is not "
                                                             "'uint8'"),
    ("labels of text", "data_batch_2", {b"data": GOOD_ROWS, b"labels": [b"cat", b"dog"]},
     "labels: ['cat', 'dog'] is not of type 'object'"),
    ("labels of floats", "data_batch_2", {b"data": GOOD_ROWS,
                                          b"labels": np.array([0.5, 1.0])},
     "labels.dtype: 'float64' is not allowed here"),
    ("labels beyond the names", "data_batch_2", {b"data": GOOD_ROWS, b"labels": [0, 10]},
     "CIFAR file data_batch_2: labels 0..10, but batches.meta names 10 classes"),
    ("fewer labels than rows", "data_batch_2", {b"data": GOOD_ROWS, b"labels": [0]},
     "CIFAR file data_batch_2: 2 images but 1 labels"),
]


def _cifar_with(tmp_path: Path, member: str, content) -> Path:
    import io
    import pickle
    import tarfile

    from fixtures import cifar_archive

    arc = cifar_archive(tmp_path / "c.tar.gz", n_per_batch=20, n_test=20)
    with tarfile.open(arc) as tar:
        blobs = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}
    blobs[f"cifar-10-batches-py/{member}"] = pickle.dumps(content)
    with tarfile.open(arc, "w:gz") as tar:
        for name, blob in blobs.items():
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    return arc


@pytest.mark.parametrize("case, member, content, words", CIFAR_ROWS,
                         ids=[r[0] for r in CIFAR_ROWS])
def test_a_cifar_member_of_the_wrong_shape_is_one_message(tmp_path, case, member, content,
                                                          words):
    """A `batches.meta` without `label_names` was a KeyError traceback."""
    from ddpflow.data.archives import read_cifar

    arc = _cifar_with(tmp_path, member, content)
    with pytest.raises(UserError) as e:
        read_cifar("cifar10", arc, verify=False)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert "replace" in str(e.value)


def test_a_cifar_archive_that_keeps_the_schema_is_read(tmp_path):
    from ddpflow.data.archives import read_cifar

    arc = _cifar_with(tmp_path, "batches.meta", {b"label_names": [f"c{i}".encode()
                                                                  for i in range(10)]})
    splits_, classes, _ = read_cifar("cifar10", arc, verify=False)
    assert classes == [f"c{i}" for i in range(10)]
    assert splits_["train"][0].shape == (100, 32, 32, 3) and splits_["test"][1].dtype == np.int64


IDX_ROWS = [
    ("header promises more than the file holds",
     struct.pack(">HBB", 0, 8, 3) + struct.pack(">III", 1000, 28, 28) + b"x" * 100,
     "is truncated: its header says (1000, 28, 28) (784000 bytes), 100 bytes of data follow"),
    ("more data than its header promises",
     struct.pack(">HBB", 0, 8, 1) + struct.pack(">I", 3) + b"abc" + b"\0" * 16,
     "is longer than its header says: its header says (3,) (3 bytes), 19 bytes of data "
     "follow"),
    ("ends inside its header", struct.pack(">HBB", 0, 8, 3) + struct.pack(">I", 5),
     "is truncated: it ends inside its IDX header"),
    ("shorter than a header", b"\x00\x00", "is truncated: it ends inside its IDX header"),
    ("no dimensions", struct.pack(">HBB", 0, 8, 0), "dims: 0 item(s), expected at least 1"),
    ("not unsigned bytes", struct.pack(">HBB", 0, 13, 1) + struct.pack(">I", 3) + b"abc",
     "(an IDX file): dtype: 13 is not 8"),
    ("not an IDX magic", struct.pack(">HBB", 2049, 8, 1) + struct.pack(">I", 3) + b"abc",
     "zero: 2049 is not 0"),
    ("a dimension of 4 billion", struct.pack(">HBB", 0, 8, 3) + struct.pack(">III", 2**32 - 1,
                                                                              28, 28),
     "dims.0: 4294967295 is above the maximum 10000000"),
    ("four dimensions", struct.pack(">HBB", 0, 8, 4) + struct.pack(">IIII", 1, 1, 1, 1) + b"x",
     "dims: 4 item(s), expected at most 3"),
]


@pytest.mark.parametrize("case, raw, words", IDX_ROWS, ids=[r[0] for r in IDX_ROWS])
def test_an_idx_file_whose_header_lies_is_one_message(tmp_path, case, raw, words):
    """An IDX header that promises more than the file holds was a struct.error traceback."""
    from ddpflow.data.archives import _read_idx

    (tmp_path / "f").write_bytes(raw)
    with pytest.raises(UserError) as e:
        _read_idx(tmp_path / "f", False, None, {})
    assert str(tmp_path / "f") in str(e.value) and words in str(e.value), str(e.value)


def test_prepare_of_a_cifar_archive_without_label_names_writes_nothing(tmp_path):
    arc = _cifar_with(tmp_path, "batches.meta", {b"names": []})
    raw = tiny_config(tmp_path)
    raw["data"] = {"source": "cifar10", "path": str(arc), "verify_checksum": False,
                   "image_size": 32, "train_size": None, "val_size": None}
    proc = ddpflow("prepare", "--config", write_config(tmp_path, raw))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"ddpflow: error: {arc}: batches.meta (a cifar10 file): label_names: missing; it is "
        f"not an official CIFAR file: replace the archive (the python version from the "
        f"dataset's site)"]
    assert not (tmp_path / "results/t/data").exists()
    assert not list((tmp_path / "results/t").glob(".data.partial*"))


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(raw=st.one_of(st.binary(max_size=64), st.tuples(
    st.integers(0, 3), st.integers(0, 20), st.integers(0, 5),
    st.lists(st.integers(0, 70), max_size=5), st.binary(max_size=200)).map(
    lambda t: struct.pack(">HBB", t[0], t[1] * 8 if t[1] < 3 else t[1], t[2])
    + b"".join(struct.pack(">I", d) for d in t[3]) + t[4])))
def test_property_any_idx_bytes_are_an_array_or_one_message(tmp_path_factory, raw):
    from ddpflow.data.archives import _read_idx

    path = tmp_path_factory.mktemp("idx") / "f"
    path.write_bytes(raw)
    try:
        out = _read_idx(path, False, None, {})
    except UserError as e:
        assert "\n" not in str(e)
    else:
        assert out.dtype == np.uint8 and 1 <= out.ndim <= 3


_LEAF = st.one_of(st.integers(-2, 12), st.binary(max_size=4), st.text(max_size=3),
                  st.floats(allow_nan=True), st.none(),
                  st.sampled_from([GOOD_ROWS, np.zeros((2, 3072), np.float32),
                                   np.zeros(3, np.int64), np.zeros((2, 3000), np.uint8)]))
_VALUE = st.one_of(_LEAF, st.lists(_LEAF, max_size=4))


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(member=st.sampled_from(["batches.meta", "data_batch_1", "test_batch"]),
       content=st.one_of(_VALUE, st.dictionaries(
           st.sampled_from([b"data", b"labels", b"label_names", b"other", "data"]), _VALUE,
           max_size=3)))
def test_property_any_cifar_member_is_data_or_one_message(tmp_path_factory, member, content):
    from ddpflow.data.archives import read_cifar

    arc = _cifar_with(tmp_path_factory.mktemp("cifar"), member, content)
    try:
        read_cifar("cifar10", arc, verify=False)
    except UserError as e:
        assert "\n" not in str(e)
