"""JPEG shards (`data.encoding: jpeg`): the round trip, damaged samples, an exact resume."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest
import torch

from conftest import ddpflow, tiny_config, write_config
from ddpflow.config import from_dict
from ddpflow.core.errors import UserError
from ddpflow.data import prepared, shards
from ddpflow.data.loaders import Normalize, TrainBatches
from ddpflow.data.prepare import prepare
from fixtures import image_tree


def _folder_cfg(tmp_path, root, encoding, **data):
    raw = tiny_config(tmp_path, data={"source": "imagefolder", "path": str(root),
                                      "image_size": 24, "store_size": 28, "train_size": None,
                                      "val_size": None, "test_size": None,
                                      "encoding": encoding, "jpeg_quality": 85,
                                      "shard_mb": 0.004, "prepare_workers": 2, **data})
    raw["run"] = encoding
    return from_dict(raw)


def test_jpeg_shards_round_trip_against_the_reference_decode(tmp_path):
    from PIL import Image

    root = image_tree(tmp_path / "imgs", per_class=12, broken=1)
    cfg_raw = _folder_cfg(tmp_path, root, "raw", max_bad_fraction=0.1)
    cfg_jpg = _folder_cfg(tmp_path, root, "jpeg", max_bad_fraction=0.1)
    meta_raw, _ = prepare(cfg_raw)
    meta, _ = prepare(cfg_jpg)
    assert meta["encoding"] == "jpeg" and len(meta["skipped"]) == 1  # the broken file
    folder = cfg_jpg.data_dir
    names = sorted(meta["bytes"])
    assert not [n for n in names if n.endswith("_images.npy")]
    train_shards = [n for n in names if n.startswith("train-") and n.endswith(".jpgs")]
    assert len(train_shards) > 1  # shard_mb 0.004: several shards, each within its size
    assert all(meta["bytes"][n] <= 0.004 * 2**20 + 3000 for n in train_shards)
    _, raw = prepared.load(cfg_raw.data_dir)
    _, enc = prepared.load(folder)
    for split in prepared.SPLITS:
        xr, yr = raw[split]
        xj, yj = enc[split]
        assert np.array_equal(yr, yj) and xj.shape == xr.shape
        index = np.load(folder / f"{split}_index.npy")
        assert (np.diff(index[:, 0] * 2**40 + index[:, 1]) > 0).all()  # written in order
        decoded = xj[:]
        for i in range(len(yj)):
            # the stored bytes are the encoder's output for the raw centre square, and the
            # loaders' decode equals Pillow's reference decode of them
            ref = io.BytesIO()
            Image.fromarray(np.asarray(xr[i])).save(ref, format="JPEG", quality=85,
                                                    subsampling=2)
            assert bytes(xj.encoded(i)) == ref.getvalue()
            assert np.array_equal(decoded[i], shards.decode(ref.getvalue()))
        assert np.abs(decoded.astype(int) - xr).mean() < 8  # lossy, but the same images
    # the CPU decoder the loaders use (torchvision) and Pillow agree to the pixel
    bufs = [enc["train"][0].encoded(i) for i in range(8)]
    assert all(np.array_equal(a, shards.decode(b))
               for a, b in zip(shards.decode_many(bufs), bufs))
    assert meta["mean"] == pytest.approx(meta_raw["mean"], abs=0.02)
    # a re-run is a no-op; a changed quality prepares again
    assert prepare(cfg_jpg)[1] is False


def _epoch(cfg, max_bad, workers=0):
    meta, arrays = prepared.load(cfg.data_dir)
    norm = Normalize(meta["mean"], meta["std"], torch.device("cpu"), 3, False)
    trace = io.StringIO()
    tb = TrainBatches("dataloader", *arrays["train"], 16, torch.device("cpu"), 1, 0, 0,
                      cfg.data.augment, norm, num_workers=workers, trace=trace,
                      image_size=cfg.data.image_size, max_bad=max_bad)
    sizes = [len(y) for _, y in tb.epoch(0)]
    seen = [int(i) for line in trace.getvalue().splitlines() for i in line.split()[2:]]
    return sizes, seen


def _damage(folder, meta):
    """Flip a byte inside train sample 5 and point sample 9's index entry past its shard,
    keeping every file's size and modification time (damage no stat() can see)."""
    index_path = folder / "train_index.npy"
    index = np.load(index_path)
    k, off, n, _ = index[5]
    shard = folder / shards.shard_name("train", int(k))
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[off + n // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    st = index_path.stat()
    index[9, 1] = 10**9
    with open(index_path, "r+b") as f:  # same header, same size: only the entry changes
        np.save(f, index)
    os.utime(index_path, ns=(st.st_atime_ns, st.st_mtime_ns))
    return shard.name


def test_damaged_samples_are_reported_and_skipped_or_refused(tmp_path, capfd):
    raw = tiny_config(tmp_path, data={"encoding": "jpeg", "train_size": 256, "val_size": 64,
                                      "test_size": 0, "shard_mb": 0.002,
                                      "max_bad_fraction": 0.001})
    cfg = from_dict(raw)
    meta, _ = prepare(cfg)
    sizes, seen = _epoch(cfg, 0.0)
    assert sizes == [16] * 16 and sorted(seen) == list(range(256))
    name = _damage(cfg.data_dir, meta)
    assert prepared.changed_files(cfg.data_dir, meta) == []  # invisible to stat()
    sizes, seen = _epoch(cfg, 0.01, workers=1)
    err = capfd.readouterr().err
    assert f"skipped unreadable train sample 5 ({name} @" in err and "CRC-32" in err
    assert "skipped unreadable train sample 9" in err and "lies outside" in err
    assert 5 not in seen and 9 not in seen and len(seen) == 254 and sum(sizes) == 254
    with pytest.raises(UserError, match=r"2 unreadable samples of the train split's 256, "
                                        r"more than data.max_bad_fraction=0.005.*prepare"):
        _epoch(cfg, 0.005)
    # through the real launcher: one clear message, no traceback; `prepare --verify` repairs
    path = write_config(tmp_path, raw)
    proc = ddpflow("launch", "--config", path, "--stage", "s1")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "more than data.max_bad_fraction=0.001" in proc.stderr
    assert not (tmp_path / "results/t/stages/s1/final.pt").exists()
    proc = ddpflow("prepare", "--config", path, "--verify", check=True)
    assert "preparing it again" in proc.stderr
    assert _epoch(cfg, 0.0)[0] == [16] * 16


def test_a_truncated_shard_is_named_before_training(tmp_path):
    raw = tiny_config(tmp_path, data={"encoding": "jpeg", "shard_mb": 0.01})
    path = write_config(tmp_path, raw)
    ddpflow("prepare", "--config", path, check=True)
    folder = tmp_path / "results/t/data"
    shard = folder / shards.shard_name("train", 1)
    shard.write_bytes(shard.read_bytes()[:100])
    proc = ddpflow("launch", "--config", path, "--stage", "s1")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "changed after it was prepared (train-00001.jpgs)" in proc.stderr


@pytest.mark.parametrize("data, needle", [
    ({"grayscale": True}, "grayscale"),
    ({"store_size": 33}, "even data.store_size of at least 16 (it is 33)"),
    ({"image_size": 8, "store_size": 8}, "(it is 8)"),
    ({"source": "python", "factory": "m:f"}, "data.materialize"),
])
def test_jpeg_settings_that_cannot_work(tmp_path, data, needle):
    raw = tiny_config(tmp_path, data={"encoding": "jpeg", **data})
    with pytest.raises(UserError, match="invalid config: data.encoding jpeg") as e:
        from_dict(raw)
    assert needle in str(e.value)


@pytest.mark.slow
def test_exact_resume_over_jpeg_shards(tmp_path):
    stage = {"name": "s1", "max_steps": 12, "batch_size": 32, "lr": 0.05}
    data = {"encoding": "jpeg", "shard_mb": 0.01, "store_size": 20, "loader": "dataloader",
            "num_workers": 1, "augment": {"random_resized_crop": {}}}
    base = dict(deterministic=True, stages=[stage], checkpoint={"every_steps": 0}, data=data)
    runs = {}
    for name in ("straight", "resumed"):
        d = tmp_path / name
        d.mkdir()
        runs[name] = write_config(d, tiny_config(d, **base))
        ddpflow("prepare", "--config", runs[name], check=True)
    ddpflow("launch", "--config", runs["straight"], "--stage", "s1", check=True)
    proc = ddpflow("launch", "--config", runs["resumed"], "--stage", "s1",
                   "--halt-after-steps", "5")
    assert proc.returncode == 75, proc.stderr
    ddpflow("launch", "--config", runs["resumed"], "--stage", "s1", check=True)
    fa, fb = (torch.load(tmp_path / n / "results/t/stages/s1/final.pt", weights_only=True)
              for n in ("straight", "resumed"))
    assert fa["model"].keys() == fb["model"].keys()
    assert all(torch.equal(fa["model"][k], fb["model"][k]) for k in fa["model"])
    summary = json.loads((tmp_path / "resumed/results/t/stages/s1/summary.json").read_text())
    assert summary["loader"] == "dataloader"
