"""Data sources in their real formats, the prepared format, and both loaders."""

from __future__ import annotations

import io
import json
from collections import Counter

import numpy as np
import pytest
import torch

from conftest import ddpflow, tiny_config, write_config
from ddpflow.config import from_dict
from ddpflow.core.errors import UserError
from ddpflow.data import prepared
from ddpflow.data.archives import read_cifar
from ddpflow.data.loaders import Normalize, TrainBatches
from ddpflow.data.mixing import Recipe
from ddpflow.data.prepare import prepare
from ddpflow.data.splits import hold_out
from fixtures import cifar_archive, idx_files, image_tree


def cfg_for(tmp_path, **data):
    raw = tiny_config(tmp_path)
    raw["data"] = {"image_size": 32, "train_size": None, "val_size": None, **data}
    return raw


def prepare_ok(tmp_path, raw):
    proc = ddpflow("prepare", "--config", write_config(tmp_path, raw), check=True)
    meta = json.loads((tmp_path / "results/t/data/meta.json").read_text())
    return proc, meta


def prepare_fails(tmp_path, raw, *needles):
    proc = ddpflow("prepare", "--config", write_config(tmp_path, raw))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    for n in needles:
        assert n in proc.stderr, proc.stderr
    data = tmp_path / "results/t/data"
    assert not data.exists() or prepared.read_meta(data) is None
    assert not list((tmp_path / "results/t").glob(".data.partial*"))
    return proc


def test_synthetic_is_deterministic_and_rerun_is_noop(tmp_path):
    raw = tiny_config(tmp_path)
    proc, meta = prepare_ok(tmp_path, raw)
    assert "prepared synthetic" in proc.stdout and "images/s" in proc.stdout
    assert meta["format_version"] == 2 and meta["counts"]["train"]["total"] == 1024
    assert meta["counts"]["val"]["total"] == meta["counts"]["test"]["total"] == 256
    assert len(meta["mean"]) == 3 and set(meta["sha256"]) >= {"train_images.npy"}
    proc2, meta2 = prepare_ok(tmp_path, raw)
    assert "up to date" in proc2.stdout and meta2 == meta
    other = tmp_path / "other"
    other.mkdir()
    _, meta3 = prepare_ok(other, tiny_config(other))
    assert meta3["sha256"] == meta["sha256"]  # same seed, same bytes


def test_cifar10_archive_and_checksums(tmp_path):
    arc = cifar_archive(tmp_path / "cifar-10-python.tar.gz")
    # the fixture is not the official release: the MD5 check must refuse it
    prepare_fails(tmp_path, cfg_for(tmp_path, source="cifar10", path=str(arc)),
                  "official MD5", "verify_checksum: false")
    proc, meta = prepare_ok(tmp_path, cfg_for(tmp_path, source="cifar10", path=str(arc),
                                              verify_checksum=False))
    # val: 10% of the official training images (stratified); test: the official test batch
    c = meta["counts"]
    assert (c["train"]["total"], c["val"]["total"], c["test"]["total"]) == (900, 100, 200)
    assert "test: the official test set" in meta["split"]
    assert meta["classes"][3] == "class3" and meta["image_shape"] == [32, 32, 3]
    assert all("not checked" in v for v in meta["checksums"].values())
    data = tmp_path / "results/t/data"
    x = {s: np.load(data / f"{s}_images.npy").reshape(-1, 3072) for s in ("train", "val", "test")}
    assert x["train"].dtype == np.uint8 and x["train"].shape == (900, 3072)
    # train + val partition the official training images (as a multiset: no sample in
    # both, none lost), and test is exactly the official test batch
    official, _, _ = read_cifar("cifar10", arc, verify=False)
    rows = {s: Counter(r.tobytes() for r in v) for s, v in x.items()}
    source = {s: Counter(r.tobytes() for r in official[s][0].reshape(-1, 3072))
              for s in ("train", "test")}
    assert rows["train"] + rows["val"] == source["train"] and rows["test"] == source["test"]


def test_cifar100_extracted_folder(tmp_path):
    import tarfile

    arc = cifar_archive(tmp_path / "c100.tar.gz", n_per_batch=40, cifar100=True, classes=20)
    with tarfile.open(arc) as t:
        t.extractall(tmp_path / "extracted")
    _, meta = prepare_ok(tmp_path, cfg_for(tmp_path, source="cifar100",
                                           path=str(tmp_path / "extracted"),
                                           verify_checksum=False))
    assert meta["num_classes"] == 20 and meta["counts"]["train"]["total"] == 180


def test_truncated_archive(tmp_path):
    arc = cifar_archive(tmp_path / "c.tar.gz")
    blob = arc.read_bytes()
    arc.write_bytes(blob[: len(blob) // 2])
    prepare_fails(tmp_path, cfg_for(tmp_path, source="cifar10", path=str(arc),
                                    verify_checksum=False), "truncated or corrupt")


@pytest.mark.parametrize("gz", [True, False])
def test_mnist_idx(tmp_path, gz):
    folder = idx_files(tmp_path / "mnist", gz=gz)
    _, meta = prepare_ok(tmp_path, cfg_for(tmp_path, source="mnist", path=str(folder),
                                           image_size=28, verify_checksum=False))
    assert meta["image_shape"] == [28, 28, 1] and meta["counts"]["test"]["total"] == 100
    assert meta["counts"]["train"]["per_class"] == [27] * 10
    assert meta["counts"]["val"]["per_class"] == [3] * 10


def test_fashion_mnist_resized_and_bad_labels(tmp_path):
    folder = idx_files(tmp_path / "f")
    _, meta = prepare_ok(tmp_path, cfg_for(tmp_path, source="fashion_mnist", path=str(folder),
                                           image_size=32, verify_checksum=False))
    assert meta["image_shape"] == [32, 32, 1] and meta["classes"][0] == "T-shirt/top"
    bad = idx_files(tmp_path / "bad", bad_label=True)
    other = tmp_path / "o"
    other.mkdir()
    prepare_fails(other, cfg_for(other, source="mnist", path=str(bad), verify_checksum=False),
                  "labels out of range")


def test_truncated_idx(tmp_path):
    folder = idx_files(tmp_path / "m", gz=False)
    f = folder / "train-images-idx3-ubyte"
    f.write_bytes(f.read_bytes()[:5000])
    prepare_fails(tmp_path, cfg_for(tmp_path, source="mnist", path=str(folder),
                                    verify_checksum=False), "truncated")


def test_imagefolder_modes_broken_files_and_split(tmp_path):
    root = image_tree(tmp_path / "imgs", broken=2)
    proc, meta = prepare_ok(tmp_path, cfg_for(tmp_path, source="imagefolder", path=str(root),
                                              image_size=24, max_bad_fraction=0.1,
                                              val_fraction=0.25))
    assert meta["classes"] == ["cat", "dog", "fish"]
    assert len(meta["skipped"]) == 2 and "broken" in proc.stdout
    assert meta["counts"]["val"]["per_class"] == [3, 3, 3]  # 12 per class (+ broken) x 0.25
    assert meta["counts"]["test"]["per_class"] == [1, 1, 1]  # test_fraction 0.1, held out first
    # stored at data.store_size (null: 1.15 x image_size for image folders) for crops
    assert meta["image_shape"] == [28, 28, 3] and meta["store_size"] == 28
    x = np.load(tmp_path / "results/t/data/train_images.npy")
    y = np.load(tmp_path / "results/t/data/train_labels.npy")
    # class colour survives decoding from PNG/JPEG/WebP, grey, RGBA and CMYK files
    for c in range(3):
        assert x[y == c][..., c].mean() > x[y == c][..., (c + 1) % 3].mean() + 50
    # every readable image is in exactly one split: no image's bytes in two (a count per
    # class cannot see a val image also left in train)
    seen = {}
    for split in ("train", "val", "test"):
        for img in np.load(tmp_path / f"results/t/data/{split}_images.npy"):
            seen.setdefault(img.tobytes(), []).append(split)
    assert len(seen) == 3 * 12 and all(len(v) == 1 for v in seen.values()), \
        [v for v in seen.values() if len(v) > 1]


def test_imagefolder_too_many_bad_files_and_grayscale(tmp_path):
    root = image_tree(tmp_path / "imgs", per_class=4, broken=3)
    prepare_fails(tmp_path, cfg_for(tmp_path, source="imagefolder", path=str(root),
                                    max_bad_fraction=0.01), "could not be read")
    ok = tmp_path / "ok"
    ok.mkdir()
    _, meta = prepare_ok(ok, cfg_for(ok, source="imagefolder", path=str(root), grayscale=True,
                                     max_bad_fraction=0.5, prepare_workers=1))
    assert meta["image_shape"] == [37, 37, 1]


def test_imagefolder_explicit_val_and_test_folders(tmp_path):
    image_tree(tmp_path / "ds/train", per_class=6)
    image_tree(tmp_path / "ds/val", per_class=2, seed=1)
    _, meta = prepare_ok(tmp_path, cfg_for(tmp_path, source="imagefolder",
                                           path=str(tmp_path / "ds")))
    c = meta["counts"]
    assert c["val"]["per_class"] == [2, 2, 2] and "val: ds/val/" in meta["split"]
    assert c["test"]["per_class"] == [1, 1, 1] and c["train"]["per_class"] == [5, 5, 5]
    image_tree(tmp_path / "ds/test", per_class=3, seed=2)
    _, meta = prepare_ok(tmp_path, cfg_for(tmp_path, source="imagefolder",
                                           path=str(tmp_path / "ds")))
    c = meta["counts"]
    assert c["test"]["per_class"] == [3, 3, 3] and c["train"]["per_class"] == [6, 6, 6]


@pytest.mark.parametrize("make, needle", [
    (lambda p: None, "does not exist"),
    (lambda p: p.mkdir(), "no class folders"),
    (lambda p: (p / "a").mkdir(parents=True), "has no images"),
])
def test_imagefolder_bad_paths(tmp_path, make, needle):
    make(tmp_path / "imgs")
    prepare_fails(tmp_path, cfg_for(tmp_path, source="imagefolder",
                                    path=str(tmp_path / "imgs")), needle)


def test_missing_cifar_path(tmp_path):
    prepare_fails(tmp_path, cfg_for(tmp_path, source="cifar10", path=str(tmp_path / "nope")),
                  "does not exist")


def test_stratified_split_is_reproducible():
    labels = np.repeat(np.arange(4), [10, 20, 30, 40])
    a = hold_out(labels, 0.1, seed=7)
    b = hold_out(labels, 0.1, seed=7)
    c = hold_out(labels, 0.1, seed=8)
    assert all(np.array_equal(u, v) for u, v in zip(a, b))
    assert not np.array_equal(a[1], c[1])
    assert np.bincount(labels[a[1]]).tolist() == [1, 2, 3, 4]
    assert not set(a[0]) & set(a[1]) and len(a[0]) + len(a[1]) == 100
    # a class too small to keep training images once its val share is held out
    with pytest.raises(UserError, match="leaves class 'b' \\(1 image"):
        hold_out(np.array([0, 0, 0, 1]), 0.2, seed=0, classes=["a", "b"])


def test_pool_test_and_train_val_hold_out_their_own_shares():
    from types import SimpleNamespace

    from ddpflow.data.splits import pool_test, train_val

    labels = np.repeat(np.arange(3), [8, 12, 4])
    cfg = SimpleNamespace(seed=3, data=SimpleNamespace(val_fraction=0.25, test_fraction=0.0))
    pool, test = pool_test(labels, cfg)
    assert pool.tolist() == list(range(24)) and test.size == 0  # test_fraction 0: no split
    cfg.data.test_fraction = 0.5
    want = hold_out(labels, 0.5, seed=3 + 7)  # the test draw: its own seed, not the val one
    assert all(np.array_equal(u, v) for u, v in zip(pool_test(labels, cfg), want))
    assert all(np.array_equal(u, v) for u, v in zip(train_val(labels, cfg),
                                                    hold_out(labels, 0.25, seed=3)))
    # a share that rounds to nothing still holds one image of each class out
    assert np.bincount(labels[hold_out(labels, 0.01, seed=0)[1]]).tolist() == [1, 1, 1]
    with pytest.raises(UserError, match="or lower data.val_fraction$"):
        train_val(np.array([0, 0, 1]), cfg)
    with pytest.raises(UserError, match="no other images .* set data.test_fraction: 0 "):
        pool_test(np.array([0, 0, 1]), cfg)


def _batches(meta, arrays, kind, rank, workers=0, recipe=None, cfg=None):
    norm = Normalize(meta["mean"], meta["std"], torch.device("cpu"), 3, False)
    trace = io.StringIO()
    tb = TrainBatches(kind, *arrays["train"], 32, torch.device("cpu"), 2, rank, 0,
                      cfg.data.augment, norm, num_workers=workers, trace=trace, recipe=recipe,
                      image_size=cfg.data.image_size)
    out = [(x.clone(), y.clone()) for x, y in tb.epoch(1)]
    idx = [int(i) for line in trace.getvalue().splitlines() for i in line.split()[2:]]
    resumed = [(x, y) for x, y in tb.epoch(1, start_step=3)]
    return out, idx, resumed


RRC = {"store_size": 22, "augment": {"random_resized_crop": {}}}


@pytest.mark.parametrize("recipe,data", [
    (None, {}), (Recipe(0.5, 0.2, 1.0, num_classes=10), {}),
    (Recipe(0.0, 0.2, 0.0, num_classes=10), RRC),
    (Recipe(0.0, 0.2, 0.0, num_classes=10), {**RRC, "encoding": "jpeg", "store_size": 22,
                                              "shard_mb": 0.01})],
    ids=["crop-flip", "erasing-mixup-cutmix", "random-resized-crop-flip-mixup",
         "jpeg-shards-random-resized-crop-mixup"])
def test_both_loaders_same_batches_disjoint_ranks(tmp_path, recipe, data):
    cfg = from_dict(tiny_config(tmp_path, data=data))
    prepare(cfg)
    meta, arrays = prepared.load(cfg.data_dir)
    assert arrays["train"][0].shape[1:] == (cfg.data.store_size,) * 2 + (3,)
    dev0, idx0, res0 = _batches(meta, arrays, "device", 0, recipe=recipe, cfg=cfg)
    dev1, idx1, _ = _batches(meta, arrays, "device", 1, recipe=recipe, cfg=cfg)
    dl0, idx_dl, res_dl = _batches(meta, arrays, "dataloader", 0, workers=2, recipe=recipe,
                                   cfg=cfg)
    assert dev0[0][0].shape == (32, 3, 16, 16)  # what the model sees: image_size
    assert not set(idx0) & set(idx1) and len(idx0) == len(idx1) == 512
    # each rank sees each of its samples once, and the ranks together the whole epoch
    assert len(set(idx0)) == len(set(idx1)) == 512 and set(idx0) | set(idx1) == set(range(1024))
    assert idx_dl == idx0
    assert len(dev0) == len(dl0) == 16
    for (xa, ya), (xb, yb) in zip(dev0, dl0):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    # a resumed epoch continues with exactly the batches not yet seen
    assert len(res0) == 13
    for (xa, ya), (xb, yb) in zip(dev0[3:], res0):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert len(res_dl) == len(res0) == 13
    for (xa, ya), (xb, yb) in zip(res0, res_dl):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    if recipe:  # soft targets: a probability per class, mixed from two labels
        y = dev0[0][1]
        assert y.shape == (32, 10) and torch.allclose(y.sum(1), torch.ones(32))


@pytest.mark.slow
def test_training_through_cifar_files_end_to_end(tmp_path):
    arc = cifar_archive(tmp_path / "cifar-10-python.tar.gz", n_per_batch=300, n_test=300)
    raw = cfg_for(tmp_path, source="cifar10", path=str(arc), verify_checksum=False,
                  loader="dataloader", num_workers=1)
    raw["stages"] = [{"name": "s1", "epochs": 3, "batch_size": 50, "lr": 0.1}]
    p = write_config(tmp_path, raw)
    ddpflow("prepare", "--config", p, check=True)
    ddpflow("launch", "--config", p, "--stage", "s1", check=True)
    s = json.loads((tmp_path / "results/t/stages/s1/summary.json").read_text())
    assert s["loader"] == "dataloader" and s["world_size"] == 2
    assert s["final_val_acc"] >= 0.8, s["final_val_acc"]


def test_augment_is_a_crop_of_the_padded_image_or_its_mirror():
    from ddpflow.config.types import AugmentCfg
    from ddpflow.data.loaders import augment, step_generator

    x = torch.randint(0, 256, (16, 8, 8, 3), dtype=torch.uint8)
    out = augment(x, AugmentCfg(crop_padding=2, flip=True, translate=0,
                                random_resized_crop=None, policy=None, num_ops=None,
                                magnitude=None),
                  step_generator(torch.device("cpu"), 0, 0, 0, 0))
    padded = torch.nn.functional.pad(x, (0, 0, 2, 2, 2, 2))
    flips = 0
    for i in range(16):
        crops = {(dy, dx, f): padded[i, dy:dy + 8, dx:dx + 8] for dy in range(5)
                 for dx in range(5) for f in (0, 1)}
        matches = [k for k, v in crops.items() if torch.equal(out[i], v.flip(1) if k[2] else v)]
        assert matches, f"sample {i} is not a crop of its padded image"
        flips += all(k[2] for k in matches)
    assert 0 < flips < 16  # some flipped, some not


def test_normalize_matches_the_formula_and_layout():
    x = torch.randint(0, 256, (4, 6, 6, 3), dtype=torch.uint8)
    mean, std = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]
    ref = (x.permute(0, 3, 1, 2).float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / \
        torch.tensor(std).view(1, 3, 1, 1)
    for cl in (False, True):
        y = Normalize(mean, std, torch.device("cpu"), 3, cl)(x)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
        fmt = torch.channels_last if cl else torch.contiguous_format
        assert y.is_contiguous(memory_format=fmt)
    grey = Normalize([0.5], [0.2], torch.device("cpu"), 3, False)(x[..., :1])
    assert grey.shape == (4, 3, 6, 6) and torch.equal(grey[:, 0], grey[:, 2])


def test_crafted_cifar_pickle_cannot_run_code(tmp_path):
    """A dataset file is data: a pickle that would run a command is refused, even with
    verify_checksum: false."""
    import pickle
    import tarfile

    marker = tmp_path / "PWNED"

    class Exploit:
        def __reduce__(self):
            import os

            return (os.system, (f"touch {marker}",))

    arc = cifar_archive(tmp_path / "c.tar.gz")
    evil = tmp_path / "evil.tar.gz"
    with tarfile.open(arc) as src, tarfile.open(evil, "w:gz") as dst:
        for m in src:
            blob = src.extractfile(m).read()
            if m.name.endswith("data_batch_1"):
                blob = pickle.dumps({b"data": Exploit(), b"labels": [0]})
            m.size = len(blob)
            dst.addfile(m, io.BytesIO(blob))
    prepare_fails(tmp_path, cfg_for(tmp_path, source="cifar10", path=str(evil),
                                    verify_checksum=False), "not plain data", "posix.system")
    assert not marker.exists()


def test_sizes_left_out_mean_all_of_a_real_source(tmp_path):
    arc = cifar_archive(tmp_path / "c.tar.gz")
    raw = cfg_for(tmp_path, source="cifar10", path=str(arc), verify_checksum=False)
    del raw["data"]["train_size"], raw["data"]["val_size"]
    _, meta = prepare_ok(tmp_path, raw)
    assert [meta["counts"][s]["total"] for s in ("train", "val", "test")] == [900, 100, 200]


def test_imagefolder_caps_one_class_and_empty_val(tmp_path):
    root = image_tree(tmp_path / "imgs", per_class=10)
    _, meta = prepare_ok(tmp_path, cfg_for(tmp_path, source="imagefolder", path=str(root),
                                           image_size=16, train_size=12, val_size=3,
                                           val_fraction=0.2))
    assert meta["counts"]["train"]["total"] == 12 and meta["counts"]["val"]["total"] == 3
    one = image_tree(tmp_path / "one", classes=("cat",), per_class=4)
    (tmp_path / "a").mkdir()
    prepare_fails(tmp_path / "a", cfg_for(tmp_path / "a", source="imagefolder", path=str(one)),
                  "one class folder", "at least two")
    single = image_tree(tmp_path / "single", per_class=1)  # nothing left to hold out
    (tmp_path / "b").mkdir()
    prepare_fails(tmp_path / "b", cfg_for(tmp_path / "b", source="imagefolder",
                                          path=str(single)), "leaves class 'cat' (1 image",
                  "data.test_fraction: 0")


def test_arrays_changed_in_place_are_noticed(tmp_path):
    import os

    from ddpflow.launch.launcher import preflight

    raw = tiny_config(tmp_path)
    prepare_ok(tmp_path, raw)
    labels = tmp_path / "results/t/data/train_labels.npy"
    y = np.load(labels)
    y[:10] = (y[:10] + 1) % 10  # same size, other content
    np.save(labels, y)
    with pytest.raises(Exception, match="changed after it was prepared"):
        preflight(from_dict(raw), "s1")
    proc, meta = prepare_ok(tmp_path, raw)
    assert "changed after it was prepared" in proc.stderr and "prepared synthetic" in proc.stdout
    assert meta["sha256"]["train_labels.npy"] == prepared.sha256_file(labels)
    assert not np.array_equal(np.load(labels), y)  # rebuilt from the settings
    # touched, same bytes: recognised by its checksum, only the times are recorded anew
    os.utime(labels, ns=(1, 1))
    proc, _ = prepare_ok(tmp_path, raw)
    assert "up to date" in proc.stdout
    preflight(from_dict(raw), "s1")


@pytest.mark.parametrize("meta_text", ["[1, 2]", "{\"format_version\": 1, \"bytes\": 7}",
                                       "\u00ff not json"])
def test_foreign_meta_never_blocks_a_rebuild(tmp_path, meta_text):
    raw = tiny_config(tmp_path)
    prepare_ok(tmp_path, raw)
    (tmp_path / "results/t/data/meta.json").write_text(meta_text)
    proc = ddpflow("launch", "--config", write_config(tmp_path, raw), "--stage", "s1")
    assert proc.returncode == 2 and "no prepared data" in proc.stderr
    proc = ddpflow("prepare", "--config", write_config(tmp_path, raw), "--force", check=True)
    assert "prepared synthetic" in proc.stdout


def test_a_full_disk_is_one_message_and_leaves_nothing(tmp_path):
    """A real 2 MB tmpfs (the tests run as root in CI): 12 MB of arrays do not fit."""
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    disk = tmp_path / "small"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], check=True)
    try:
        raw = tiny_config(tmp_path, data={"train_size": 4096, "image_size": 32})
        raw["results_dir"] = str(disk)
        proc = ddpflow("prepare", "--config", write_config(tmp_path, raw))
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert "no space left on" in proc.stderr and str(disk) in proc.stderr
        assert prepared.read_meta(disk / "t/data") is None
        assert not list((disk / "t").glob(".data.partial*")) and not (disk / "t/data").exists()
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_sigterm_during_prepare_says_so_and_keeps_nothing_half_written(tmp_path):
    """SIGTERM (Slurm's scancel, Snakemake stopping its jobs, `kill`) in the middle of a build:
    one message, exit 143, no partial folder; the same command then prepares."""
    import signal
    import subprocess
    import sys
    import time

    raw = tiny_config(tmp_path, data={"train_size": 20000, "image_size": 32})  # about 4 s
    path = write_config(tmp_path, raw)
    proc = subprocess.Popen([sys.executable, "-m", "ddpflow", "prepare", "--config", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = tmp_path / "results/t"
    deadline = time.time() + 120
    while not list(run.glob(".data.partial*/train_images.npy")) and time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "stopped by SIGTERM" in err and "Traceback" not in err, err
    assert not list(run.glob(".data.partial*")) and not (run / "data").exists()
    ddpflow("prepare", "--config", path, check=True)
    assert prepared.read_meta(run / "data")["counts"]["train"]["total"] == 20000
