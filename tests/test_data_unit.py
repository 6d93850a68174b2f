"""data/shards.py, data/prepared.py and data/sampling.py, edge by edge: the bytes a JPEG
shard holds and where its index says they are (a shard's size limit at its boundary), what a
damaged entry is reported as (bounds, CRC, a wrong size, an undecodable image), meta.json's
checks of a prepared folder, the statistics and checksums `finish` writes, and the draws of
every sampling mode as exact values (a resumed epoch draws the same). Fast: no training; real
files in tmp_path, real JPEGs, torch on the CPU.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import zlib
from collections import Counter

import numpy as np
import pytest
import torch

from ddpflow.core import writing
from ddpflow.core.errors import UserError
from ddpflow.data import prepared, shards
from ddpflow.data.sampling import Draws, EpochSampler, Spec, class_counts, dataset_labels


def _refusal(fn, *args, **kw) -> str:
    with pytest.raises(UserError) as e:
        fn(*args, **kw)
    return str(e.value)


def _image(seed: int, size: int = 16) -> np.ndarray:
    """A smooth image (JPEG keeps it close) with a colour of its own."""
    rng = np.random.default_rng(seed)
    base = rng.integers(30, 220, 3)
    ramp = np.linspace(0, 20, size)[:, None, None]
    return np.clip(base + ramp + np.zeros((size, size, 3)), 0, 255).astype(np.uint8)


# ------------------------------------------------------------------ encoding

def test_encode_is_pillows_baseline_jpeg_at_the_quality_with_420_chroma():
    from PIL import Image, JpegImagePlugin

    img = _image(1)
    data = shards.encode(img, 70)
    with Image.open(__import__("io").BytesIO(data)) as im:
        assert im.format == "JPEG" and im.size == (16, 16)
        assert JpegImagePlugin.get_sampling(im) == 2  # 4:2:0
        assert not im.info.get("progressive")
    assert data != shards.encode(img, 71)  # the quality is the one asked for
    assert np.abs(shards.decode(data).astype(int) - img).mean() < 3


def test_decode_gives_rgb_and_refuses_what_is_not_a_whole_jpeg(tmp_path):
    import io

    from PIL import Image

    gray = io.BytesIO()
    Image.fromarray(np.full((8, 8), 100, np.uint8)).save(gray, format="JPEG")
    out = shards.decode(gray.getvalue())
    assert out.shape == (8, 8, 3) and out.dtype == np.uint8 and (np.abs(out - 100) <= 1).all()
    png = io.BytesIO()
    Image.fromarray(_image(2)).save(png, format="PNG")
    with pytest.raises(ValueError, match=r"^not a JPEG \(PNG\)$"):
        shards.decode(png.getvalue())
    whole = shards.encode(_image(3), 90)
    with pytest.raises(OSError):
        shards.decode(whole[:len(whole) // 2])


def test_decode_many_equals_pillow_image_by_image():
    bufs = [np.frombuffer(shards.encode(_image(i, 8 + 8 * i), 85), np.uint8) for i in range(3)]
    out = shards.decode_many(bufs)
    assert [o.shape for o in out] == [(8, 8, 3), (16, 16, 3), (24, 24, 3)]
    assert all(np.array_equal(a, shards.decode(b)) for a, b in zip(out, bufs))


def test_shard_names_count_from_zero_in_five_digits():
    assert shards.shard_name("train", 0) == "train-00000.jpgs"
    assert shards.shard_name("val", 123) == "val-00123.jpgs"


# ------------------------------------------------------------------ writing shards

def _written(tmp_path, sizes, shard_bytes, split="train"):
    w = shards.ShardWriter(tmp_path, split, shard_bytes)
    blobs = [bytes([i + 1]) * n for i, n in enumerate(sizes)]
    for i, b in enumerate(blobs):
        w.append(b, 10 + i)
    assert w.close() == len(sizes)
    index = np.load(tmp_path / f"{split}_index.npy")
    return blobs, index, np.load(tmp_path / f"{split}_labels.npy")


def test_a_shard_fills_up_to_its_size_exactly_and_the_index_says_where(tmp_path):
    blobs, index, labels = _written(tmp_path, [4, 6, 1, 12, 3], 10)
    # 4 + 6 fill shard 0 to exactly 10 bytes; 1 more opens shard 1; an image bigger than a
    # shard has one of its own
    assert index.dtype == np.int64 and index.tolist() == [
        [0, 0, 4, zlib.crc32(blobs[0])], [0, 4, 6, zlib.crc32(blobs[1])],
        [1, 0, 1, zlib.crc32(blobs[2])], [2, 0, 12, zlib.crc32(blobs[3])],
        [3, 0, 3, zlib.crc32(blobs[4])]]
    assert labels.dtype == np.int64 and labels.tolist() == [10, 11, 12, 13, 14]
    assert sorted(p.name for p in tmp_path.glob("*.jpgs")) == [
        f"train-0000{k}.jpgs" for k in range(4)]
    assert (tmp_path / "train-00000.jpgs").read_bytes() == blobs[0] + blobs[1]
    assert (tmp_path / "train-00002.jpgs").read_bytes() == blobs[3]
    assert (tmp_path / "train-00003.jpgs").read_bytes() == blobs[4]


def test_a_shard_size_under_one_byte_is_one_image_a_shard(tmp_path):
    _, index, _ = _written(tmp_path, [2, 2, 2], 0)
    assert index[:, :2].tolist() == [[0, 0], [1, 0], [2, 0]]


def test_an_empty_split_has_an_empty_index_of_four_columns(tmp_path):
    _, index, labels = _written(tmp_path, [], 10, split="test")
    assert index.shape == (0, 4) and index.dtype == np.int64
    assert labels.shape == (0,) and labels.dtype == np.int64
    assert (tmp_path / "test-00000.jpgs").read_bytes() == b""


def test_write_split_stores_each_images_encoding_with_its_label(tmp_path):
    imgs = np.stack([_image(i) for i in range(5)])
    shards.write_split(tmp_path, "val", imgs[:, ::-1][:, ::-1], np.arange(5) % 2, 80,
                       2 * len(shards.encode(imgs[0], 80)))
    index = np.load(tmp_path / "val_index.npy")
    assert np.load(tmp_path / "val_labels.npy").tolist() == [0, 1, 0, 1, 0]
    assert index[:, 0].max() >= 1  # more than one shard
    for i in range(5):
        k, off, n, _ = index[i]
        data = (tmp_path / shards.shard_name("val", int(k))).read_bytes()[off:off + n]
        assert data == shards.encode(imgs[i], 80)


# ------------------------------------------------------------------ reading shards

def _split(tmp_path, n=6, size=16, shard_bytes=None, split="train"):
    """n images of `size` in shards of about two images; (images, JpegImages, recorded)."""
    imgs = np.stack([_image(i, size) for i in range(n)])
    one = len(shards.encode(imgs[0], 90))
    shards.write_split(tmp_path, split, imgs, np.arange(n), 90, shard_bytes or 2 * one + 50)
    recorded = {p.name: p.stat().st_size for p in tmp_path.iterdir()}
    return imgs, shards.JpegImages(tmp_path, split, (size, size, 3), recorded), recorded


def _damage_index(tmp_path, split, row, col, value):
    path = tmp_path / f"{split}_index.npy"
    index = np.load(path)
    index[row, col] = value
    np.save(path, index)


def test_jpeg_images_look_like_the_uint8_array_they_decode_to(tmp_path):
    imgs, x, _ = _split(tmp_path, n=5)
    assert len(x) == 5 and x.shape == (5, 16, 16, 3) and x.dtype == np.uint8
    assert x.nbytes == 5 * 16 * 16 * 3
    assert [p.name for p in x.shards] == [f"train-0000{k}.jpgs" for k in range(3)]
    whole = np.asarray(x)
    assert whole.shape == (5, 16, 16, 3) and whole.dtype == np.uint8
    assert np.abs(whole.astype(int) - imgs).max() < 12
    assert np.asarray(x, dtype=np.float32).dtype == np.float32
    assert np.array_equal(np.asarray(x, dtype=np.float32), whole.astype(np.float32))
    assert np.array_equal(x[3], whole[3]) and x[3].shape == (16, 16, 3)
    assert np.array_equal(x[[4, 0]], whole[[4, 0]])
    assert np.array_equal(x[1:4], whole[1:4]) and np.array_equal(x[::2], whole[::2])
    assert np.array_equal(x[np.int64(2)], whole[2])


def test_only_this_splits_shards_are_read_and_in_their_order(tmp_path):
    _split(tmp_path, n=3, split="val")
    _, x, recorded = _split(tmp_path, n=25, split="train", shard_bytes=1)
    assert len(x.shards) == 25 and x.shards[10].name == "train-00010.jpgs"
    assert x.shards == sorted(x.shards) and all(p.name.startswith("train-") for p in x.shards)
    (tmp_path / "train-00000.jpgs.bak").write_bytes(b"")
    again = shards.JpegImages(tmp_path, "train", (16, 16, 3),
                              {**recorded, "train-00000.jpgs.bak": 0, "xtrain-00001.jpgs": 1})
    assert again.shards == x.shards
    assert np.array_equal(again[24], x[24])


def test_a_shard_shorter_or_missing_costs_the_samples_past_its_end(tmp_path):
    _, x, recorded = _split(tmp_path, n=6)
    index = np.load(tmp_path / "train_index.npy")
    shard1 = tmp_path / "train-00001.jpgs"
    size1 = shard1.stat().st_size
    shard1.write_bytes(shard1.read_bytes()[:int(index[3, 1]) + 5])  # sample 3 cut, 2 kept
    (tmp_path / "train-00002.jpgs").unlink()
    y = shards.JpegImages(tmp_path, "train", (16, 16, 3), recorded)
    assert y.sizes == [recorded["train-00000.jpgs"], int(index[3, 1]) + 5, 0]
    images, kept, bad = y.fetch(range(6))
    assert kept == [0, 1, 2] and images.shape == (3, 16, 16, 3)
    n3 = int(index[3, 2])
    assert bad[0] == (3, f"train sample 3 (train-00001.jpgs @ {index[3, 1]}): index entry "
                         f"(shard 1, offset {index[3, 1]}, {n3} bytes) lies outside the "
                         f"shard's {int(index[3, 1]) + 5} bytes")
    assert [b[0] for b in bad] == [3, 4, 5] and bad[1][1].endswith("the shard's 0 bytes")
    # a shard longer than meta.json says is read up to what was recorded
    shard1.write_bytes(b"\0" * (size1 * 2))
    z = shards.JpegImages(tmp_path, "train", (16, 16, 3), recorded)
    assert z.sizes[1] == size1


@pytest.mark.parametrize("col, value, words", [
    (0, 7, "index entry (shard 7, offset {off}, {n} bytes) lies outside the shard's 0 bytes"),
    (0, -1, "index entry (shard -1, offset {off}, {n} bytes) lies outside the shard's 0 bytes"),
    (1, -1, "index entry (shard 0, offset -1, {n} bytes) lies outside the shard's {size} bytes"),
    (2, 0, "index entry (shard 0, offset {off}, 0 bytes) lies outside the shard's {size} bytes"),
    (2, -4, "index entry (shard 0, offset {off}, -4 bytes) lies outside the shard's {size} "
            "bytes"),
])
def test_an_index_entry_out_of_its_shard_is_named(tmp_path, col, value, words):
    _, x, recorded = _split(tmp_path, n=4)
    off, n = (int(v) for v in np.load(tmp_path / "train_index.npy")[1, 1:3])
    size = recorded["train-00000.jpgs"]
    _damage_index(tmp_path, "train", 1, col, value)
    y = shards.JpegImages(tmp_path, "train", (16, 16, 3), recorded)
    with pytest.raises(ValueError) as e:
        y.encoded(1)
    assert str(e.value) == words.format(off=off if col != 1 else -1, n=n, size=size)
    where = y.where(1)
    shard = {7: "shard #7", -1: "shard #-1"}.get(value, "train-00000.jpgs") if col == 0 \
        else "train-00000.jpgs"
    assert where == f"train sample 1 ({shard} @ {off if col != 1 else -1})"
    assert _refusal(y.__getitem__, 1) == (
        f"unreadable {where}: {e.value}; the prepared data is damaged: run "
        f"`ddpflow prepare --force`")


def test_an_entry_that_ends_exactly_at_its_shards_end_is_read(tmp_path):
    _, x, recorded = _split(tmp_path, n=2, shard_bytes=10**6)
    index = np.load(tmp_path / "train_index.npy")
    assert index[1, 1] + index[1, 2] == recorded["train-00000.jpgs"]
    assert bytes(x.encoded(1)) == (tmp_path / "train-00000.jpgs").read_bytes()[index[1, 1]:]
    _damage_index(tmp_path, "train", 1, 2, int(index[1, 2]) + 1)  # one byte past the end
    with pytest.raises(ValueError, match="lies outside"):
        shards.JpegImages(tmp_path, "train", (16, 16, 3), recorded).encoded(1)


def test_a_flipped_byte_fails_the_crc_and_the_others_are_read_in_file_order(tmp_path):
    imgs, x, recorded = _split(tmp_path, n=6)
    index = np.load(tmp_path / "train_index.npy")
    k, off, n = (int(v) for v in index[4, :3])
    shard = tmp_path / shards.shard_name("train", k)
    data = bytearray(shard.read_bytes())
    data[off + n // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    _damage_index(tmp_path, "train", 1, 1, 10**9)
    y = shards.JpegImages(tmp_path, "train", (16, 16, 3), recorded)
    with pytest.raises(ValueError, match=r"^bytes do not match their CRC-32 \(damaged on disk\)$"):
        y.encoded(4)
    bufs, bad = y.read([5, 4, 1, 0, 3])
    assert sorted(bufs) == [0, 3, 4] and bytes(bufs[3]) == bytes(x.encoded(0))
    # reported in file order: sample 1 (shard 0) before sample 4 (shard 2)
    assert [b[0] for b in bad] == [1, 4]
    assert bad[1][1] == (f"train sample 4 (train-0000{k}.jpgs @ {off}): bytes do not match "
                         f"their CRC-32 (damaged on disk)")
    images, kept, bad = y.fetch(np.array([[5, 4], [1, 0]]))
    assert kept == [0, 3] and [b[0] for b in bad] == [1, 4]
    assert np.array_equal(images, np.stack([x[5], x[0]]))


def test_an_image_that_does_not_decode_or_has_another_size_is_a_bad_sample(tmp_path):
    imgs, x, recorded = _split(tmp_path, n=4, shard_bytes=10**6)
    index = np.load(tmp_path / "train_index.npy")
    # sample 2's bytes replaced by a 20 x 16 JPEG, sample 1's by non-JPEG bytes (CRCs fixed)
    other = shards.encode(_image(9, 20)[:, :16], 90)
    junk = b"\xff\xd8" + b"\x00" * 40
    blobs = [bytes(x.encoded(0)), junk, other, bytes(x.encoded(3))]
    shard = tmp_path / "train-00000.jpgs"
    shard.write_bytes(b"".join(blobs))
    offs = np.cumsum([0] + [len(b) for b in blobs])[:-1]
    index[:, 1] = offs
    index[:, 2] = [len(b) for b in blobs]
    index[:, 3] = [zlib.crc32(b) for b in blobs]
    np.save(tmp_path / "train_index.npy", index)
    recorded["train-00000.jpgs"] = shard.stat().st_size
    y = shards.JpegImages(tmp_path, "train", (16, 16, 3), recorded)
    images, kept, bad = y.fetch([3, 2, 1, 0])
    assert kept == [0, 3] and np.array_equal(images, np.stack([x[3], x[0]]))
    assert sorted(i for i, _ in bad) == [1, 2]
    reason = dict(bad)
    assert reason[2] == (f"train sample 2 (train-00000.jpgs @ {offs[2]}): decoded to "
                         f"(20, 16, 3), expected (16, 16, 3)")
    assert reason[1].startswith(f"train sample 1 (train-00000.jpgs @ {offs[1]}): ")
    assert reason[1].split(": ")[1] in ("OSError", "ValueError", "UnidentifiedImageError",
                                        "SyntaxError")
    # none readable: an empty batch of the split's image shape
    images, kept, bad = y.fetch([1, 2])
    assert images.shape == (0, 16, 16, 3) and images.dtype == np.uint8 and kept == []


def test_a_pickled_view_opens_its_own_mappings(tmp_path):
    _, x, _ = _split(tmp_path, n=4)
    first = x[0]
    assert x._maps  # a mapping is open in this process
    y = pickle.loads(pickle.dumps(x))
    assert y._maps == {} and x._maps
    assert np.array_equal(y[0], first) and y.shards == x.shards


def test_decode_cuda_on_a_device_decodes_the_batch_and_names_a_bad_image():
    bufs = [np.frombuffer(shards.encode(_image(i), 85), np.uint8) for i in range(3)]
    out, kept, bad = shards.decode_cuda(bufs, "cpu")
    assert isinstance(out, torch.Tensor) and out.shape == (3, 16, 16, 3) and out.is_contiguous()
    assert kept == [0, 1, 2] and bad == []
    assert all(np.array_equal(out[i].numpy(), shards.decode(bufs[i])) for i in range(3))
    out, kept, bad = shards.decode_cuda([bufs[0], np.zeros(10, np.uint8), bufs[2]], "cpu")
    assert out.shape == (2, 16, 16, 3) and kept == [0, 2]
    assert np.array_equal(out[1].numpy(), shards.decode(bufs[2]))
    assert [i for i, _ in bad] == [1] and bad[0][1].startswith("RuntimeError: ")
    out, kept, bad = shards.decode_cuda([np.zeros(10, np.uint8)], "cpu")
    assert out is None and kept == [] and [i for i, _ in bad] == [0]


# ------------------------------------------------------------------ prepared folders

def _arrays(n, size=4, seed=0, classes=3):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8),
            np.arange(n, dtype=np.int64) % classes)


def _prepared(folder, encoding="raw", sizes=(6, 3, 2), classes=3, size=16):
    """A prepared folder built as `prepare` builds it: the three splits, then finish()."""
    folder.mkdir(parents=True, exist_ok=True)
    store = ({"encoding": "jpeg", "quality": 90, "shard_bytes": 2000}
             if encoding == "jpeg" else None)
    for split, n in zip(prepared.SPLITS, sizes):
        x = np.stack([_image(i, size) for i in range(n)]) if n else np.zeros((0, size, size, 3),
                                                                              np.uint8)
        prepared.save_split(folder, split, x, np.arange(n, dtype=np.int64) % classes, store)
    meta = {"num_classes": classes, "classes": [str(c) for c in range(classes)],
            "fingerprint": "f" * 8, "store_size": size}
    if encoding == "jpeg":
        meta["encoding"] = "jpeg"
    return prepared.finish(folder, meta)


def test_sha256_file_reads_a_file_in_chunks_as_one(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(bytes(range(256)) * 5)
    want = hashlib.sha256(p.read_bytes()).hexdigest()
    assert prepared.sha256_file(p, chunk=7) == want == prepared.sha256_file(p)
    (tmp_path / "e").write_bytes(b"")
    assert prepared.sha256_file(tmp_path / "e") == hashlib.sha256(b"").hexdigest()


def test_open_split_allocates_arrays_of_the_split_on_disk(tmp_path):
    x, y = prepared.open_split(tmp_path, "val", 3, (5, 5, 1))
    assert x.shape == (3, 5, 5, 1) and x.dtype == np.uint8
    assert y.shape == (3,) and y.dtype == np.int64
    x[:] = 7
    y[:] = [1, 2, 3]
    x.flush()
    y.flush()
    del x, y
    assert (np.load(tmp_path / "val_images.npy") == 7).all()
    assert np.load(tmp_path / "val_labels.npy").tolist() == [1, 2, 3]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_at_allocation_is_one_message_with_the_size(tmp_path, monkeypatch, code):
    def full(path):  # the filesystem refuses the blocks (a real full disk: test_data.py)
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(prepared, "preallocate", full)
    assert _refusal(prepared.open_split, tmp_path, "train", 3_000_000, (1, 1, 1)) == (
        f"no space left on {tmp_path} (3 MB needed for train_images.npy); free space or point "
        f"results_dir elsewhere")
    assert _refusal(prepared._allocated_memmap, tmp_path / "y.npy", np.int64, (500_000,)) == (
        f"no space left on {tmp_path} (4 MB needed for y.npy); free space or point "
        f"results_dir elsewhere")


def test_another_error_at_allocation_stays_what_it_is(tmp_path, monkeypatch):
    def broken(path):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(prepared, "preallocate", broken)
    with pytest.raises(OSError) as e:
        prepared.open_split(tmp_path, "train", 2, (1, 1, 1))
    assert e.value.errno == errno.EIO and not isinstance(e.value, UserError)


def test_save_split_writes_raw_arrays_unless_jpeg_is_asked(tmp_path):
    x, y = _arrays(4)
    prepared.save_split(tmp_path, "train", x, y)
    prepared.save_split(tmp_path, "val", x, y, {"encoding": "raw"})
    for split in ("train", "val"):
        assert np.array_equal(np.load(tmp_path / f"{split}_images.npy"), x)
        assert np.array_equal(np.load(tmp_path / f"{split}_labels.npy"), y)
    imgs = np.stack([_image(i) for i in range(3)])
    prepared.save_split(tmp_path, "test", imgs, np.array([2, 0, 1]),
                        {"encoding": "jpeg", "quality": 75, "shard_bytes": 10**6})
    assert not (tmp_path / "test_images.npy").exists()
    index = np.load(tmp_path / "test_index.npy")
    blob = (tmp_path / "test-00000.jpgs").read_bytes()
    assert blob[index[1, 1]:index[1, 1] + index[1, 2]] == shards.encode(imgs[1], 75)
    assert np.load(tmp_path / "test_labels.npy").tolist() == [2, 0, 1]


def test_empty_like_takes_the_image_shape_of_a_raw_split(tmp_path):
    prepared.save_split(tmp_path, "train", *_arrays(2, size=6))
    x, y = prepared.empty_like(tmp_path, "train")
    assert x.shape == (0, 6, 6, 3) and x.dtype == np.uint8
    assert y.shape == (0,) and y.dtype == np.int64
    x, y = prepared.empty_like(tmp_path / "none", "train")  # JPEG shards: no image array
    assert x.shape == (0, 1, 1, 3) and x.dtype == np.uint8
    assert y.shape == (0,) and y.dtype == np.int64


def test_channel_stats_are_the_mean_and_std_of_each_channel_on_the_0_1_scale():
    x = np.zeros((3, 2, 2, 3), np.uint8)
    x[:, 0, :, 0], x[:, 1, :, 0] = 0, 255  # half black, half white: mean .5, std .5
    x[:, :, :, 1] = 51  # constant: std is the floor 1e-6
    x[0, :, :, 2], x[1:, :, :, 2] = 255, 0  # one image in three
    want = ([0.5, 0.2, 0.333333], [0.5, 1e-06, 0.471405])
    assert prepared.channel_stats(x) == want
    assert prepared.channel_stats(x, chunk=1) == want
    assert prepared.channel_stats(x, 2, rows=np.array([1, 2])) == ([0.5, 0.2, 0.0],
                                                                   [0.5, 1e-06, 1e-06])
    one = np.array([[[[255, 102, 0]]]], np.uint8)  # a single pixel
    assert prepared.channel_stats(one) == ([1.0, 0.4, 0.0], [1e-06, 1e-06, 1e-06])
    assert prepared.channel_stats(np.zeros((0, 2, 2, 1), np.uint8)) == ([0.0], [1e-06])


def test_labels_out_of_range_name_the_split_and_the_range():
    prepared.check_labels(np.array([0, 2, 1]), 3, "train")
    prepared.check_labels(np.array([], np.int64), 3, "test")
    assert _refusal(prepared.check_labels, np.array([0, 3, 1]), 3, "val") == (
        "labels out of range in the val split: found 0..3, expected 0..2; the source files "
        "are corrupt or of another dataset")
    assert _refusal(prepared.check_labels, np.array([2, -1]), 3, "test").startswith(
        "labels out of range in the test split: found -1..2, expected 0..2;")


def test_finish_records_counts_statistics_sizes_and_checksums_in_meta_json(tmp_path):
    folder = tmp_path / "data"
    (folder / "sub").mkdir(parents=True)  # not a file: not listed
    (folder / "meta.json.tmp1").write_text("{}")  # a leftover of meta.json: not listed
    meta = _prepared(folder, sizes=(7, 2, 0))
    names = sorted(f"{s}_{k}.npy" for s in prepared.SPLITS for k in ("images", "labels"))
    assert sorted(meta["bytes"]) == names and list(meta["sha256"]) == names
    for n in names:
        assert meta["bytes"][n] == (folder / n).stat().st_size
        assert meta["sha256"][n] == hashlib.sha256((folder / n).read_bytes()).hexdigest()
    assert meta["counts"] == {"train": {"total": 7, "per_class": [3, 2, 2]},
                              "val": {"total": 2, "per_class": [1, 1, 0]},
                              "test": {"total": 0, "per_class": [0, 0, 0]}}
    train = np.load(folder / "train_images.npy")
    assert (meta["mean"], meta["std"]) == prepared.channel_stats(train)
    assert meta["image_shape"] == [16, 16, 3] and meta["format_version"] == 2
    assert meta["encoding"] == "raw" and meta["num_classes"] == 3
    assert json.loads((folder / "meta.json").read_text()) == meta
    assert prepared.read_meta(folder) == meta


def test_finish_refuses_labels_out_of_range_and_an_empty_training_split(tmp_path):
    for split, n in zip(prepared.SPLITS, (2, 1, 1)):
        prepared.save_split(tmp_path, split, *_arrays(n))
    np.save(tmp_path / "test_labels.npy", np.array([3]))
    assert _refusal(prepared.finish, tmp_path, {"num_classes": 3}).startswith(
        "labels out of range in the test split: found 3..3")
    (tmp_path / "test_labels.npy").unlink()
    for split in prepared.SPLITS:
        prepared.save_split(tmp_path, split, *_arrays(0))
    assert _refusal(prepared.finish, tmp_path, {"num_classes": 3}) == (
        "the prepared training split is empty: no images were found")
    assert not (tmp_path / "meta.json").exists()


def test_finish_of_jpeg_shards_takes_statistics_of_an_even_sample(tmp_path):
    """2.5 x STATS_SAMPLE training images: every other one is decoded for the mean (the
    black ones, here), the others (white) are not."""
    n = 2 * shards.STATS_SAMPLE + shards.STATS_SAMPLE // 2
    black, white = shards.encode(np.zeros((8, 8, 3), np.uint8), 90), shards.encode(
        np.full((8, 8, 3), 255, np.uint8), 90)
    w = shards.ShardWriter(tmp_path, "train", 10**8)
    for i in range(n):
        w.append(white if i % 2 else black, 0)
    w.close()
    for split in ("val", "test"):
        shards.write_split(tmp_path, split, np.zeros((0, 8, 8, 3), np.uint8), [], 90, 10**8)
    meta = prepared.finish(tmp_path, {"num_classes": 1, "encoding": "jpeg", "store_size": 8})
    assert meta["mean"] == [0.0, 0.0, 0.0] and meta["std"] == [1e-06] * 3
    assert meta["image_shape"] == [8, 8, 3] and meta["counts"]["train"]["total"] == n
    assert sorted(meta["bytes"]) == ["test-00000.jpgs", "test_index.npy", "test_labels.npy",
                                     "train-00000.jpgs", "train_index.npy", "train_labels.npy",
                                     "val-00000.jpgs", "val_index.npy", "val_labels.npy"]


def test_finish_of_a_few_jpeg_images_takes_statistics_of_all(tmp_path):
    meta = _prepared(tmp_path, "jpeg", sizes=(5, 1, 1))
    x = prepared.open_images(tmp_path, "train", meta)
    assert isinstance(x, shards.JpegImages) and x.shape == (5, 16, 16, 3)
    assert (meta["mean"], meta["std"]) == prepared.channel_stats(np.asarray(x))


def test_file_stats_and_changed_files_see_a_size_or_a_time_changed(tmp_path):
    meta = _prepared(tmp_path)
    meta["mtime_ns"] = prepared.file_stats(tmp_path, meta)
    assert meta["mtime_ns"] == {n: (tmp_path / n).stat().st_mtime_ns for n in meta["bytes"]}
    assert sorted(meta["mtime_ns"]) == sorted(meta["bytes"])
    assert prepared.changed_files(tmp_path, meta) == []
    st = (tmp_path / "val_labels.npy").stat()
    os.utime(tmp_path / "val_labels.npy", ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    with open(tmp_path / "train_labels.npy", "ab") as f:
        f.write(b"x")
    os.utime(tmp_path / "train_labels.npy", ns=(1, meta["mtime_ns"]["train_labels.npy"]))
    (tmp_path / "test_images.npy").unlink()
    assert prepared.changed_files(tmp_path, meta) == [
        n for n in meta["bytes"] if n in ("val_labels.npy", "train_labels.npy",
                                          "test_images.npy")]
    del meta["mtime_ns"]  # no times recorded: every file counts as changed
    assert prepared.changed_files(tmp_path, meta) == list(meta["bytes"])


def test_read_meta_is_none_for_a_folder_to_prepare_again(tmp_path):
    assert prepared.read_meta(tmp_path / "none") is None
    meta = _prepared(tmp_path)
    assert prepared.read_meta(tmp_path) == meta
    (tmp_path / "meta.json").write_text(json.dumps({**meta, "format_version": 1}))
    assert prepared.read_meta(tmp_path) is None
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with open(tmp_path / "val_images.npy", "ab") as f:
        f.write(b"x")
    assert prepared.read_meta(tmp_path) is None  # an array of another size
    (tmp_path / "val_images.npy").unlink()
    (tmp_path / "val_images.npy").mkdir()
    assert prepared.read_meta(tmp_path) is None  # a folder in its place
    (tmp_path / "val_images.npy").rmdir()
    assert prepared.read_meta(tmp_path) is None  # missing


def test_a_short_shard_does_not_unmake_a_jpeg_folder(tmp_path):
    meta = _prepared(tmp_path, "jpeg", sizes=(6, 1, 1))
    shard = tmp_path / "train-00000.jpgs"
    shard.write_bytes(shard.read_bytes()[:50])
    assert prepared.read_meta(tmp_path) == meta  # its samples are counted when read
    (tmp_path / "train_index.npy").write_bytes(b"x")
    assert prepared.read_meta(tmp_path) is None


@pytest.mark.parametrize("change, words", [
    (lambda m: m.pop("sha256"), "): sha256: missing;"),
    (lambda m: m["bytes"].update({"../x.npy": 1}), "): bytes: '../x.npy'"),
    (lambda m: m.update(encoding="png"), "encoding"),
])
def test_a_damaged_meta_json_is_one_message_or_none_for_prepare(tmp_path, change, words):
    meta = _prepared(tmp_path)
    change(meta)
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    msg = _refusal(prepared.read_meta, tmp_path)
    assert msg.startswith(f"{tmp_path / 'meta.json'} (the prepared data's meta.json): ")
    assert words in msg and msg.endswith(
        "; there is no prepared data here until `ddpflow prepare --config ... --force` "
        "rebuilds it")
    assert prepared.read_meta(tmp_path, damaged_ok=True) is None
    assert "no prepared dataset" not in msg
    (tmp_path / "meta.json").write_text("[1]")
    assert prepared.read_meta(tmp_path, damaged_ok=True) is None
    with pytest.raises(UserError):
        prepared.read_meta(tmp_path)


def test_a_meta_json_naming_a_file_through_a_link_out_of_the_folder_is_refused(tmp_path):
    folder = tmp_path / "data"
    meta = _prepared(folder)
    (tmp_path / "outside.npy").write_bytes(b"x" * 3)
    os.symlink(tmp_path / "outside.npy", folder / "link.npy")
    meta["bytes"]["link.npy"] = 3
    (folder / "meta.json").write_text(json.dumps(meta))
    msg = _refusal(prepared.read_meta, folder)
    assert f"{folder / 'meta.json'}: bytes" in msg and "link.npy" in msg
    assert msg.endswith("rebuilds it")
    assert prepared.read_meta(folder, damaged_ok=True) is None


def test_verify_names_the_file_whose_bytes_changed(tmp_path):
    meta = _prepared(tmp_path)
    prepared.verify(tmp_path, meta)
    p = tmp_path / "val_images.npy"
    data = bytearray(p.read_bytes())
    data[-1] ^= 1
    p.write_bytes(bytes(data))
    assert _refusal(prepared.verify, tmp_path, meta) == (
        f"prepared data file {p} does not match its checksum in meta.json; run `ddpflow "
        f"prepare --force` to rebuild it")


def test_load_maps_every_split_or_says_to_prepare(tmp_path):
    assert _refusal(prepared.load, tmp_path) == (
        f"no prepared dataset at {tmp_path} (missing or incomplete meta.json); run `ddpflow "
        f"prepare --config ...` first")
    meta = _prepared(tmp_path, sizes=(4, 2, 1))
    got, arrays = prepared.load(str(tmp_path))
    assert got == meta and list(arrays) == list(prepared.SPLITS)
    for split, n in zip(prepared.SPLITS, (4, 2, 1)):
        x, y = arrays[split]
        assert isinstance(x, np.memmap) and x.shape == (n, 16, 16, 3)
        assert np.array_equal(x, np.load(tmp_path / f"{split}_images.npy"))
        assert isinstance(y, np.memmap) and y.tolist() == [i % 3 for i in range(n)]


def test_open_images_of_jpeg_shards_decodes_at_the_store_size(tmp_path):
    meta = _prepared(tmp_path / "j", "jpeg", sizes=(3, 2, 1), size=8)
    x = prepared.open_images(str(tmp_path / "j"), "val", meta)
    assert isinstance(x, shards.JpegImages) and x.shape == (2, 8, 8, 3)
    assert [p.name for p in x.shards] == ["val-00000.jpgs"]
    _, arrays = prepared.load(tmp_path / "j")
    assert arrays["test"][0].shape == (1, 8, 8, 3)


@pytest.mark.parametrize("names, strict, want", [
    (["train_images.npy", "val-00001.jpgs", "test_index.npy"], False, True),
    (["train_images.npy", "val-00001.jpgs", "test_index.npy"], True, False),
    (["train_images.npy", "notes.txt"], False, False),
    (["train_images.npy.bak"], False, False),
    (["xtrain_images.npy"], False, False),
    ([], False, True),
])
def test_a_folder_of_arrays_without_meta_json_is_ddpflows_only_in_its_own_place(
        tmp_path, names, strict, want):
    for n in names:
        (tmp_path / n).write_bytes(b"")
    assert prepared.is_prepared_folder(tmp_path, strict=strict) is want


@pytest.mark.parametrize("meta, extra, want", [
    ({"fingerprint": "f", "bytes": {"a.npy": 1, "b.npy": 2}}, [], True),
    ({"fingerprint": "f", "bytes": {"a.npy": 1, "b.npy": 2}}, ["c.txt"], False),
    ({"fingerprint": "f", "bytes": {"a.npy": 1}}, [], False),
    ({"fingerprint": "f"}, [], False),
    ({"bytes": {"a.npy": 1, "b.npy": 2}}, [], False),
    ("not json", [], False),
])
def test_an_older_prepared_folder_is_one_whose_meta_json_lists_all_it_holds(
        tmp_path, meta, extra, want):
    for n in ["a.npy", "b.npy", *extra]:
        (tmp_path / n).write_bytes(b"")
    (tmp_path / "meta.json").write_text(meta if isinstance(meta, str) else json.dumps(meta))
    assert prepared.is_prepared_folder(tmp_path) is want
    assert prepared.is_prepared_folder(tmp_path, strict=False) is want


def test_a_meta_json_alone_without_bytes_is_an_older_prepared_folder(tmp_path):
    (tmp_path / "meta.json").write_text(json.dumps({"fingerprint": "f"}))
    assert prepared.is_prepared_folder(tmp_path) is True


def _build(folder):
    return _prepared(folder, sizes=(3, 1, 1))


def test_build_into_runs_under_the_callers_lock_and_moves_the_folder_in(tmp_path):
    target = tmp_path / "data"
    with writing.output_lock(target, "the prepared data folder"):
        meta = prepared.build_into(target, _build)
        assert prepared.read_meta(target) == meta
        again = prepared.build_into(target, _build)  # ddpflow's own folder is replaced
    assert again["sha256"] == meta["sha256"]
    assert not [p for p in tmp_path.iterdir() if ".partial" in p.name]


def test_build_into_refuses_a_folder_of_user_files_naming_the_setting(tmp_path):
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("keep")
    msg = _refusal(prepared.build_into, target, _build)
    assert msg == (f"the prepared data folder: {target} already holds files ddpflow did not "
                   f"write ('notes.txt'); ddpflow never deletes or overwrites what it did not "
                   f"write, and nothing was changed: choose another data.prepared_dir, or empty "
                   f"or remove it yourself")
    assert (target / "notes.txt").read_text() == "keep"


def test_arrays_without_meta_json_are_rebuilt_only_in_ddpflows_own_place(tmp_path):
    target = tmp_path / "data"
    target.mkdir()
    (target / "train_images.npy").write_bytes(b"old")  # Snakemake removed meta.json
    with pytest.raises(UserError, match="already holds files ddpflow did not write"):
        prepared.build_into(target, _build)
    assert (target / "train_images.npy").read_bytes() == b"old"
    meta = prepared.build_into(target, _build, own_place=True)
    assert prepared.read_meta(target) == meta


# ------------------------------------------------------------------ sampling

Y = [0, 0, 0, 1, 1, 2, 2, 2, 2, 2]  # classes of 3, 2 and 5 samples
W = [0, 1, 2, 0, 3, 1, 0, 5, 1, 1]


@pytest.mark.parametrize("mode, replacement, want", [
    ("uniform", True, [9, 6, 5, 0, 2, 8, 2, 3, 4, 4]),
    ("balanced", True, [8, 6, 3, 3, 5, 4, 1, 1, 9, 8]),
    ("balanced", False, [6, 9, 0, 2, 4, 3]),
    ("weights", True, [2, 4, 1, 1, 4, 4, 7, 1, 7, 4]),
    ("weights", False, [7, 2, 4, 5, 9, 1, 8]),
])
def test_each_modes_draws_are_pinned(mode, replacement, want):
    """The draws of seed 5, epoch 2, pinned: a run resumed by another version or on another
    machine trains the epoch it would have trained."""
    d = Draws(10, mode, replacement, labels=np.array(Y), weights=np.array(W, np.float64))
    got = d(5, 2)
    assert got.dtype == torch.int64 and got.tolist() == want and d.length == len(want)
    assert torch.equal(d(5, 2), got) and not torch.equal(d(5, 3), got)


@pytest.mark.parametrize("replacement, length, head, total, weighted", [
    (True, 1000, [236, 101, 228, 294, 491, 689, 975, 889, 175, 100, 787, 607], 492182,
     246575488),
    (False, 912, [96, 760, 100, 995, 346, 851, 297, 295, 523, 291, 475, 849], 454560,
     208027308),
])
def test_balanced_draws_over_a_thousand_shuffled_labels_are_pinned(replacement, length, head,
                                                                   total, weighted):
    """Over labels in no order (where an unstable sort would order a class's samples its own
    way, from one machine or thread count to the next) the draws are pinned as well."""
    y = np.random.default_rng(0).integers(0, 4, 1000)
    got = Draws(1000, "balanced", replacement, labels=y)(5, 2)
    assert len(got) == length and got[:12].tolist() == head and int(got.sum()) == total
    assert int((got * torch.arange(len(got))).sum()) == weighted


def test_balanced_draws_reach_every_sample_of_a_class_and_a_lone_sample_is_its_class():
    y = np.array([0, 0, 0, 1, 1, 2])  # class 2 has one sample
    d = Spec("balanced", True, num_classes=3).draws(y)
    seen = torch.cat([d(0, e) for e in range(30)])
    assert sorted(set(seen.tolist())) == list(range(6))
    per_class = Counter(y[seen.numpy()].tolist())  # 180 draws: 60 each, within 4 sigma
    assert all(abs(per_class[c] - 60) < 4 * (180 * 2 / 9) ** 0.5 for c in range(3)), per_class
    without = Spec("balanced", False).draws(y)
    assert without.length == 3
    for e in range(5):
        got = without(0, e).tolist()
        assert sorted(y[got].tolist()) == [0, 1, 2] and 5 in got


def test_weights_without_replacement_draw_each_sample_of_weight_above_zero_once():
    w = np.array([0.0, 1.0, 1e-300, 0.0, 2.0])
    d = Spec("weights", False, weights=w).draws(None, n=5)
    assert d.length == 3
    for e in range(5):
        assert sorted(d(1, e).tolist()) == [1, 2, 4]
    assert Counter(int(Spec("weights", True, weights=w).draws(None, n=5)(1, e)[0])
                   for e in range(200)).keys() <= {1, 2, 4}


def test_weights_of_another_length_than_the_readable_samples_are_one_message():
    spec = Spec("weights", True, weights=np.ones(5))
    assert _refusal(spec.draws, np.zeros(4, np.int64)) == (
        "data.sample_weights gave 5 weights, but 4 of the training samples are readable; "
        "prepare the data again (`ddpflow prepare --force`) or use data.loader dataloader")
    assert spec.draws(torch.zeros(5, dtype=torch.int64)).length == 5
    assert _refusal(spec.draws, None, n=6).startswith("data.sample_weights gave 5 weights, but 6")


def test_a_sampler_knows_its_slots_length_and_the_keys_of_its_draws():
    s = EpochSampler(100, 2, 1, 3, batch=4, accum=3)
    assert s.steps == 100 // 24 and s.num_samples == 4 * 3 * 4 and len(s) == 48
    assert [s.slot(m) for m in (0, 1, 2, 3, 4)] == [(0, 1), (0, 3), (0, 5), (1, 1), (1, 3)]
    s.set_epoch(2, 10)
    assert len(s) == 38 and s.epoch == 2 and s.start == 10
    from ddpflow.core.seeds import seed_sequence

    base = seed_sequence(3, 2, 0)
    assert s.keys([0, 5]) == [base, base + 5]
    high = EpochSampler(100, 1, 0, 0)  # seed 0, epoch 0: a base seed of 63 bits
    assert high.keys([1]) == [seed_sequence(0, 0, 0) + 1] and high.keys([1])[0] >= 2**62
    assert s.keys([2**63 - base]) == [0]  # within 63 bits: a torch seed
    s.keyed = True
    pairs = list(s)
    idx, place = s.mine()
    assert pairs == list(zip(idx.tolist(), s.keys(place))) and len(pairs) == 38
    s.keyed = False
    assert list(s) == idx.tolist()


class _Targets(list):
    targets = None


@pytest.mark.parametrize("targets, shown", [
    ([[0], [1], [2]], "int64 of shape (3, 1)"),
    ([0, 1], "int64 of shape (2,)"),
    ([0, 1, 2, 3], "int64 of shape (4,)"),
    ([0, -1, 2], "int64 of shape (3,)"),
    (np.array([True, False, True]), "bool of shape (3,)"),
])
def test_a_user_datasets_targets_that_are_not_a_class_per_sample_are_one_message(targets,
                                                                                shown):
    ds = _Targets([1, 2, 3])
    ds.targets = targets
    assert _refusal(dataset_labels, ds, "data.factory m:f") == (
        f"data.factory m:f: the dataset's `targets` is {shown}; data.sampling needs one class "
        f"index >= 0 per sample (3)")


def test_a_user_datasets_targets_of_any_integer_type_are_int64_labels():
    ds = _Targets([1, 2, 3])
    for targets in ([0, 2, 0], np.array([0, 2, 0], np.uint8), torch.tensor([0, 2, 0])):
        ds.targets = targets
        got = dataset_labels(ds, "f")
        assert got.dtype == np.int64 and got.tolist() == [0, 2, 0]


def test_a_fresh_sampler_draws_epoch_0():
    s = EpochSampler(50, 2, 1, 7, batch=5)
    first = list(s)
    s.set_epoch(0)
    assert first == list(s) and len(first) == 25


def test_class_counts_over_no_labels_are_none_or_zero_per_known_class():
    assert class_counts(np.zeros(0, np.int64), None).tolist() == []
    assert class_counts([], 3).tolist() == [0, 0, 0]
    assert class_counts(np.array([[2], [0], [2]]), None).tolist() == [1, 0, 2]
