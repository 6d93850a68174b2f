"""data/loaders.py, edge by edge on the CPU: the generator of a step (seeded by its position
alone), the pad-crop-flip gather and the normalisation, unreadable samples reported once and
too many of them one message, the workers' batches (raw arrays and JPEG shards, the bytes
the GPU decodes), the training batches of a rank (its samples normalised, the same on any
number of ranks, resumed exactly, traced), the endless epochs, the validation share of a
rank (streamed or resident), reading ahead, and the loader `auto` picks. Fast: tiny arrays,
no training.
"""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_config
from ddpflow.config import from_dict
from ddpflow.config.types import AugmentCfg
from ddpflow.core.errors import UserError
from ddpflow.core.seeds import seed_sequence
from ddpflow.data import loaders, policies, prepared, shards
from ddpflow.data.crops import EvalCrop, center_crop, random_resized_crop
from ddpflow.data.loaders import (
    BadSamples,
    Normalize,
    TrainBatches,
    augment,
    choose_loader,
    forever,
    host_batch,
    read_ahead,
    step_generator,
    val_batches,
)
from ddpflow.data.mixing import Recipe
from ddpflow.data.mixing import apply as apply_recipe
from ddpflow.data.prepare import prepare
from ddpflow.data.sampling import EpochSampler, Spec

CPU = torch.device("cpu")
MEAN, STD = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]


def _aug(crop_padding=0, flip=False, translate=0, rrc=None, policy=None):
    return AugmentCfg(crop_padding=crop_padding, flip=flip, translate=translate,
                      random_resized_crop=rrc, policy=policy, num_ops=None, magnitude=None)


def _data(n=26, size=8, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8),
            rng.integers(0, 4, n).astype(np.int64))


def _norm(channels_last=False):
    return Normalize(MEAN, STD, CPU, 3, channels_last)


def _refusal(fn, *args, **kw) -> str:
    with pytest.raises(UserError) as e:
        fn(*args, **kw)
    return str(e.value)


# ------------------------------------------------------------------ a step's randomness

def test_a_steps_generator_is_seeded_by_its_whole_position():
    ref = torch.Generator()
    ref.manual_seed(seed_sequence(7, 2, 3, 1))
    g = step_generator(CPU, 7, 2, 3, 1)
    assert g.device == CPU and torch.equal(torch.rand(8, generator=g), torch.rand(8, generator=ref))


def _reference_augment(x, pad, flip, g):
    """Each sample's crop of its zero-padded image, mirrored where drawn: per sample, slowly."""
    b, h, w, _ = x.shape
    dy = torch.randint(0, 2 * pad + 1, (b,), generator=g)
    dx = torch.randint(0, 2 * pad + 1, (b,), generator=g)
    mirror = (torch.rand(b, generator=g) < 0.5) if flip else torch.zeros(b, dtype=torch.bool)
    padded = F.pad(x, (0, 0, pad, pad, pad, pad))
    out = [padded[i, dy[i]:dy[i] + h, dx[i]:dx[i] + w] for i in range(b)]
    return torch.stack([o.flip(1) if m else o for o, m in zip(out, mirror)])


@pytest.mark.parametrize("padding,translate,flip", [(2, 0, True), (1, 2, False), (0, 0, True),
                                                    (0, 3, True)])
def test_augment_crops_the_padded_image_and_mirrors_as_drawn(padding, translate, flip):
    x = torch.randint(0, 256, (24, 5, 7, 3), dtype=torch.uint8)  # not square: rows != columns
    out = augment(x, _aug(padding, flip, translate), step_generator(CPU, 1, 0, 0, 0))
    want = _reference_augment(x, padding + translate, flip, step_generator(CPU, 1, 0, 0, 0))
    assert out.shape == x.shape and torch.equal(out, want)
    if flip and padding + translate == 0:  # a mirror or the image itself, both drawn
        mirrored = [torch.equal(o, i.flip(1)) for o, i in zip(out, x)]
        assert any(mirrored) and not all(mirrored)


def test_no_padding_and_no_flip_leave_the_batch_itself():
    x = torch.randint(0, 256, (4, 5, 5, 3), dtype=torch.uint8)
    assert augment(x, _aug(), step_generator(CPU, 0, 0, 0, 0)) is x


def test_normalize_widens_one_channel_to_the_models_in_its_layout():
    x = torch.randint(0, 256, (4, 5, 6, 1), dtype=torch.uint8)
    ref = (x.permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.2
    for cl in (False, True):
        y = Normalize([0.5], [0.2], CPU, 3, cl)(x)
        assert y.shape == (4, 3, 5, 6) and y.dtype == torch.float32
        fmt = torch.channels_last if cl else torch.contiguous_format
        assert y.is_contiguous(memory_format=fmt)
        for c in range(3):
            torch.testing.assert_close(y[:, c:c + 1], ref, rtol=1e-5, atol=1e-5)
    rgb = torch.randint(0, 256, (2, 5, 6, 3), dtype=torch.uint8)
    assert Normalize(MEAN, STD, CPU, 3, False)(rgb).is_contiguous()
    assert Normalize(MEAN, STD, CPU, 3, True)(rgb).is_contiguous(memory_format=torch.channels_last)
    # whatever the batch and the image's height (3 images 3 rows high: still widened)
    assert Normalize([0.5], [0.2], CPU, 3, False)(x[:3, :3]).shape == (3, 3, 3, 6)
    one = Normalize([0.5], [0.2], CPU, 1, False)(x)
    assert one.shape == (4, 1, 5, 6)
    torch.testing.assert_close(one, ref, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ unreadable samples

def test_unreadable_samples_are_reported_once_and_too_many_are_one_message(capfd):
    bad = BadSamples("val", 10, 0.2, 3)
    bad.note([(4, "val sample 4 (val-0.jpgs @ 12): CRC-32 mismatch")])
    bad.note([(4, "val sample 4 again"), (7, "val sample 7 (val-1.jpgs @ 0): lies outside")])
    bad.note([])
    assert capfd.readouterr().err == (
        "ddpflow: rank 3: skipped unreadable val sample 4 (val-0.jpgs @ 12): CRC-32 mismatch\n"
        "ddpflow: rank 3: skipped unreadable val sample 7 (val-1.jpgs @ 0): lies outside\n")
    assert _refusal(bad.note, [(1, "val sample 1 (val-0.jpgs @ 0): short")]) == (
        "3 unreadable samples of the val split's 10, more than data.max_bad_fraction=0.2; "
        "first: val sample 4 (val-0.jpgs @ 12): CRC-32 mismatch; the prepared data is "
        "damaged: run `ddpflow prepare --force` (the workflow re-prepares by itself)")
    assert BadSamples("train", 5, 0.0, 0).note([]) is None  # nothing unreadable: no error


# ------------------------------------------------------------------ the workers' batches

def _keyed_policy(t):
    """A per-sample augmentation drawing from torch's global generator (as torchvision's)."""
    return (t.int() + torch.randint(0, 100, (1,))).clamp(0, 255).to(torch.uint8)


def test_a_workers_batch_is_its_rows_labels_and_indices_in_order():
    images, labels = _data(10)
    ds = loaders._Memmap(images, labels)
    assert len(ds) == 10
    x, y, idx, bad = ds[3]
    assert torch.equal(x, torch.from_numpy(images[[3]])) and y.tolist() == [labels[3]]
    assert y.dtype == torch.long and idx.tolist() == [3] and bad == []
    x, y, idx, bad = ds.__getitems__([5, 2, 9])
    assert torch.equal(x, torch.from_numpy(images[[5, 2, 9]])) and idx.tolist() == [5, 2, 9]
    assert y.tolist() == labels[[5, 2, 9]].tolist() and bad == []
    # (index, key) pairs: each image through the policy seeded by its key
    keyed = loaders._Memmap(images, labels, policy=_keyed_policy)
    x, y, idx, _ = keyed.__getitems__([(5, 11), (2, 12)])
    want = policies.apply(_keyed_policy, torch.from_numpy(images[[5, 2]]), [11, 12])
    assert torch.equal(x, want) and idx.tolist() == [5, 2] and not torch.equal(
        x, torch.from_numpy(images[[5, 2]]))


@pytest.fixture(scope="module")
def jpeg(tmp_path_factory):
    """A small JPEG-sharded prepared set: (cfg, train images, train labels)."""
    tmp = tmp_path_factory.mktemp("jpeg")
    cfg = from_dict(tiny_config(tmp, data={"encoding": "jpeg", "train_size": 48,
                                           "val_size": 16, "test_size": 0, "shard_mb": 0.002,
                                           "image_size": 16, "store_size": 16}))
    prepare(cfg)
    _, arrays = prepared.load(cfg.data_dir)
    return cfg, *arrays["train"]


def test_a_workers_jpeg_batch_is_decoded_or_left_as_the_bytes_the_gpu_decodes(jpeg):
    _, images, labels = jpeg
    decoded = images[np.arange(len(labels))]
    ds = loaders._Memmap(images, labels)
    x, y, idx, bad = ds.__getitems__([7, 1, 30])
    assert torch.equal(x, torch.from_numpy(decoded[[7, 1, 30]])) and bad == []
    assert idx.tolist() == [7, 1, 30] and y.tolist() == labels[[7, 1, 30]].tolist()
    enc = loaders._Memmap(images, labels, encoded=True)
    bufs, y, idx, bad = enc.__getitems__([7, 1, 30])
    assert [bytes(b) for b in bufs] == [bytes(images.encoded(i)) for i in (7, 1, 30)]
    assert idx.tolist() == [7, 1, 30] and y.tolist() == labels[[7, 1, 30]].tolist()
    assert y.dtype == torch.long and bad == []
    *_, keys = enc.__getitems__([(7, 70), (1, 10)])
    assert keys == [70, 10]
    # decoded where the training runs (torchvision's decode, here the CPU's): the same pixels
    x, y2, idx2, bad = loaders._decode_on_device((bufs, y, idx, []), images, CPU)
    assert torch.equal(x, torch.from_numpy(decoded[[7, 1, 30]])) and bad == []
    assert torch.equal(y2, y) and torch.equal(idx2, idx)
    x, *_ = loaders._decode_on_device((bufs[:2], y[:2], idx[:2], [], [11, 12]), images, CPU,
                                      _keyed_policy)
    assert torch.equal(x, policies.apply(_keyed_policy, torch.from_numpy(decoded[[7, 1]]),
                                         [11, 12]))


def test_bytes_that_do_not_decode_are_named_and_left_out(jpeg):
    _, images, labels = jpeg
    bufs = [np.asarray(images.encoded(3)), np.frombuffer(b"not a jpeg", np.uint8),
            np.asarray(images.encoded(4))]
    y, idx = torch.tensor([0, 1, 2]), torch.tensor([3, 9, 4])
    x, y2, idx2, bad = loaders._decode_on_device((bufs, y, idx, [(8, "earlier")]), images, CPU)
    assert x.shape == (2, *images.shape[1:]) and y2.tolist() == [0, 2]
    assert idx2.tolist() == [3, 4] and bad[0] == (8, "earlier") and len(bad) == 2
    assert bad[1][0] == 9 and bad[1][1].startswith(f"{images.where(9)}: RuntimeError: ")
    x, y2, idx2, bad = loaders._decode_on_device(
        ([bufs[1]], y[1:2], idx[1:2], [], [5]), images, CPU, _keyed_policy)
    assert x.shape == (0, *images.shape[1:]) and x.dtype == torch.uint8
    assert y2.tolist() == [] and idx2.tolist() == [] and [i for i, _ in bad] == [9]


# ------------------------------------------------------------------ training batches

def _train(kind, images, labels, world=1, rank=0, batch=3, aug=None, seed=5, **kw):
    trace = io.StringIO()
    tb = TrainBatches(kind, images, labels, batch, CPU, world, rank, seed, aug or _aug(),
                      _norm(), trace=trace, **kw)
    return tb, trace


def _epoch(tb, epoch=0, start=0):
    return [(x.clone(), y.clone()) for x, y in tb.epoch(epoch, start)]


def _order(n, world, rank, batch, epoch, seed=5, accum=1, draws=None, repeats=1):
    sampler = EpochSampler(n, world, rank, seed, batch, accum, draws, repeats)
    sampler.set_epoch(epoch)
    return sampler.mine()[0].view(-1, batch)


def _traced(order, epoch, first=0):
    return "".join(f"{epoch} {s} {' '.join(map(str, order[s].tolist()))}\n"
                   for s in range(first, len(order)))


@pytest.mark.parametrize("kind", ["device", "dataloader"])
def test_a_ranks_batches_are_its_samples_normalised_in_the_epochs_order(kind):
    images, labels = _data(26)
    tb, trace = _train(kind, images, labels, world=2, rank=1)
    assert len(tb) == 4  # 26 samples, 2 ranks of 3 a step: 4 whole steps
    batches = _epoch(tb, 2)
    order = _order(26, 2, 1, 3, epoch=2)
    assert trace.getvalue() == _traced(order, 2) and len(batches) == 4
    for (x, y), idx in zip(batches, order):
        assert torch.equal(x, _norm()(torch.from_numpy(images[idx.numpy()])))
        assert y.dtype == torch.long and y.tolist() == labels[idx.numpy()].tolist()
    # resumed at step 2: exactly the batches not yet seen, traced with their own steps
    trace.seek(0)
    trace.truncate()
    resumed = _epoch(tb, 2, start=2)
    assert trace.getvalue() == _traced(order, 2, first=2) and len(resumed) == 2
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
               for a, b in zip(batches[2:], resumed))


RRC = {"scale": (0.25, 1.0), "ratio": (0.75, 1.3333)}
SETUPS = {
    "crop-flip": dict(aug=_aug(2, True, 1)),
    "crop-flip-smaller-bicubic": dict(aug=_aug(1, True), image_size=6,
                                      interpolation="bicubic"),
    "random-resized-crop": dict(aug=_aug(flip=True, rrc=RRC), image_size=6),
    "random-resized-crop-bicubic": dict(aug=_aug(flip=True, rrc=RRC), image_size=5,
                                        interpolation="bicubic"),
    "erasing-mixup-cutmix": dict(aug=_aug(1, True), recipe=Recipe(0.5, 0.2, 1.0,
                                                                   num_classes=4)),
}


def _expected(images, labels, idx, setup, seed, epoch, step, slot):
    """A batch as the loaders promise it: the stored images normalised and augmented with the
    generator of (seed, epoch, step, slot), then the stage's recipe."""
    aug = setup["aug"]
    size = setup.get("image_size", images.shape[1])
    mode = setup.get("interpolation", "bilinear")
    g = step_generator(CPU, seed, epoch, step, slot)
    x = torch.from_numpy(images[idx])
    if aug.random_resized_crop:
        x = random_resized_crop(_norm()(x), size, RRC["scale"], RRC["ratio"], True, g, mode)
    else:
        x = _reference_augment(x, aug.crop_padding + aug.translate, aug.flip, g)
        x = center_crop(_norm()(x), size, mode=mode)
    y = torch.from_numpy(labels[idx])
    if setup.get("recipe"):
        x, y = apply_recipe(x, y, setup["recipe"], g, (seed, epoch, step, slot))
    return x, y


@pytest.mark.parametrize("kind", ["device", "dataloader"])
@pytest.mark.parametrize("setup", SETUPS.values(), ids=SETUPS)
def test_a_slot_is_augmented_by_its_place_alike_on_any_number_of_ranks(setup, kind):
    images, labels = _data(24)
    one = _epoch(_train(kind, images, labels, world=1, batch=3, accum=2, **setup)[0], 1)
    ranks = [_epoch(_train(kind, images, labels, world=2, rank=r, **setup)[0], 1)
             for r in (0, 1)]
    assert len(one) == 8 and len(ranks[0]) == len(ranks[1]) == 4
    order = [_order(24, 2, r, 3, epoch=1) for r in (0, 1)]
    for step in range(4):
        for r in (0, 1):
            x, y = ranks[r][step]
            assert torch.equal(x, one[2 * step + r][0]) and torch.equal(y, one[2 * step + r][1])
            want_x, want_y = _expected(images, labels, order[r][step].numpy(), setup, 5, 1,
                                       step, r)
            assert torch.equal(x, want_x) and torch.equal(y, want_y)


@pytest.mark.parametrize("kind", ["device", "dataloader"])
def test_progressive_resizing_trains_each_epoch_at_its_size(kind):
    images, labels = _data(12)
    tb, _ = _train(kind, images, labels, aug=_aug(1, True))
    tb.size_at = {0: 4, 1: 6}.get
    assert {tuple(x.shape) for x, _ in tb.epoch(0)} == {(3, 3, 4, 4)}
    assert {tuple(x.shape) for x, _ in tb.epoch(1)} == {(3, 3, 6, 6)}
    rrc, _ = _train(kind, images, labels, aug=_aug(rrc=RRC), image_size=6)
    rrc.size_at = {0: 4}.get
    assert {tuple(x.shape) for x, _ in rrc.epoch(0)} == {(3, 3, 4, 4)}


def test_a_policy_draws_each_sample_from_its_place_in_the_epoch_on_either_loader():
    images, labels = _data(12)
    aug = _aug(policy="trivialaugment")
    policy = policies.build(aug)
    device, trace = _train("device", images, labels, aug=aug)
    loader, _ = _train("dataloader", images, labels, aug=aug)
    a, b = _epoch(device, 3), _epoch(loader, 3)
    sampler = EpochSampler(12, 1, 0, 5, 3)
    sampler.set_epoch(3)
    idx, place = sampler.mine()
    changed = 0
    for step, ((xa, ya), (xb, yb)) in enumerate(zip(a, b)):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        rows = idx[step * 3:(step + 1) * 3]
        x = policies.apply(policy, torch.from_numpy(images[rows.numpy()]),
                           sampler.keys(place[step * 3:(step + 1) * 3]))
        assert torch.equal(xa, _norm()(x))
        changed += not torch.equal(xa, _norm()(torch.from_numpy(images[rows.numpy()])))
    assert len(a) == 4 and changed


@pytest.mark.parametrize("kind", ["device", "dataloader"])
@pytest.mark.parametrize("spec", [Spec("balanced", True, num_classes=4), Spec(repeats=2),
                                  Spec("uniform", True)], ids=["balanced", "repeats", "replace"])
def test_a_stages_sampling_decides_the_draws(kind, spec):
    images, labels = _data(24)
    tb, trace = _train(kind, images, labels, world=2, rank=1, sampling=spec)
    _epoch(tb, 4)
    order = _order(24, 2, 1, 3, epoch=4, draws=spec.draws(labels), repeats=spec.repeats)
    assert trace.getvalue() == _traced(order, 4) and len(tb) == len(order)


def test_the_dataloader_gets_the_workers_settings_and_gives_the_same_batches():
    images, labels = _data(18)
    plain, _ = _train("dataloader", images, labels)
    assert plain.loader.num_workers == 0 and plain.loader.prefetch_factor is None
    assert plain.loader.batch_size == 3
    workers, _ = _train("dataloader", images, labels, num_workers=1, persistent_workers=True,
                        prefetch_factor=3)
    assert workers.loader.num_workers == 1 and workers.loader.persistent_workers is True
    assert workers.loader.prefetch_factor == 3
    for (xa, ya), (xb, yb) in zip(_epoch(plain, 1), _epoch(workers, 1), strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_the_device_loader_reuses_an_earlier_upload():
    images, labels = _data(12)
    other, other_labels = _data(12, seed=9)
    tb, trace = _train("device", images, labels,
                       resident=(torch.from_numpy(other), torch.from_numpy(other_labels)))
    order = _order(12, 1, 0, 3, epoch=0)
    for (x, y), idx in zip(_epoch(tb), order, strict=True):
        assert torch.equal(x, _norm()(torch.from_numpy(other[idx.numpy()])))
        assert y.tolist() == other_labels[idx.numpy()].tolist()


# ------------------------------------------------------------------ epochs without end

def test_epochs_follow_each_other_and_an_epoch_without_a_batch_is_one_message():
    made = []

    def make(epoch):
        made.append(epoch)
        assert epoch <= 2, "an empty epoch was followed by another"
        return iter([(epoch, 0), (epoch, 1)] if epoch < 2 else [])

    batches = forever(make)
    assert [next(batches) for _ in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert _refusal(next, batches) == (
        "an epoch has no batch: the batch is larger than a rank's share of the training "
        "data; lower the batch size")
    assert made == [0, 1, 2]


# ------------------------------------------------------------------ validation batches

@pytest.mark.parametrize("resident", [False, True], ids=["streamed", "resident"])
def test_a_ranks_validation_share_is_strided_in_order_and_centre_cropped(resident):
    images, labels = _data(23)
    batches = val_batches(images, labels, CPU, 3, 1, _norm(), resident=resident)
    got = list(batches(3))
    idx = np.arange(1, 23, 3)  # rank 1 of 3: samples 1, 4, ..., 22
    assert [len(y) for _, y in got] == [3, 3, 2]
    x = torch.cat([x for x, _ in got])
    assert torch.equal(x, _norm()(torch.from_numpy(images[idx])))
    assert torch.cat([y for _, y in got]).tolist() == labels[idx].tolist()
    smaller = val_batches(images, labels, CPU, 3, 1, _norm(), resident=resident, image_size=6)
    want = EvalCrop(6)(_norm()(torch.from_numpy(images[idx])))
    assert torch.equal(torch.cat([x for x, _ in smaller(4)]), want)
    crop = EvalCrop(4, resize=6, mode="bicubic")
    cropped = val_batches(images, labels, CPU, 3, 1, _norm(), resident=resident, crop=crop)
    assert torch.equal(torch.cat([x for x, _ in cropped(5)]),
                       crop(_norm()(torch.from_numpy(images[idx]))))
    # resident: copied once, at the first validation; streamed: read at each
    images[idx] = 0
    again = torch.cat([x for x, _ in batches(8)])
    assert torch.equal(again, x) == resident
    assert torch.equal(again, _norm()(torch.from_numpy(images[idx]))) != resident


# ------------------------------------------------------------------ host memory, reading

def test_a_host_batch_is_the_array_as_a_contiguous_tensor():
    a = np.arange(24, dtype=np.int64).reshape(4, 6)[:, ::2]
    t = host_batch(a, False)
    assert t.is_contiguous() and t.tolist() == a.tolist() and not t.is_pinned()


def test_reading_ahead_keeps_the_order_one_read_at_a_time_one_part_ahead():
    started = {k: threading.Event() for k in range(5)}
    running, most, names = [0], [0], set()
    lock = threading.Lock()

    overlap = []

    def read(part):
        started[part].set()
        if part == 0:  # another read starting meanwhile would be a second reader thread
            overlap.append(started[1].wait(2))
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        names.add(threading.current_thread().name.split("_")[0])
        with lock:
            running[0] -= 1
        return part * 10

    out = []
    for v in read_ahead(read, iter(range(5))):
        k = v // 10
        if k < 4:  # the next part is read while this one is used
            assert started[k + 1].wait(60), f"part {k + 1} not read ahead"
        out.append(v)
    assert out == [0, 10, 20, 30, 40] and most[0] == 1 and names == {"ddpflow-read"}
    assert overlap == [False]
    assert list(read_ahead(read, iter([]))) == []


def test_a_failed_read_is_raised_at_its_part_after_the_parts_before_it():
    def read(part):
        if part == 2:
            raise UserError("part 2 is damaged")
        return part

    got = []
    with pytest.raises(UserError, match="^part 2 is damaged$"):
        for v in read_ahead(read, [0, 1, 2, 3]):
            got.append(v)
    assert got == [0, 1]


# ------------------------------------------------------------------ which loader

def test_the_room_is_in_gib_from_one_gib_of_free_memory_and_in_mib_under_it():
    GiB, MiB = 2**30, 2**20
    assert choose_loader("auto", 512 * MiB, CPU, 0.5, free=GiB) == (
        "device", "dataset 512 MiB fits in 0.5 of 1.0 GiB free cpu memory")
    assert choose_loader("auto", 512 * MiB, CPU, 0.5, free=GiB - 1) == (
        "dataloader", "dataset 512 MiB does not fit in 0.5 of 1024 MiB free cpu memory")
    assert choose_loader("auto", 1, CPU, 0.5)[0] == "device"  # this machine's free memory
    assert choose_loader("auto", 2**60, CPU, 0.5)[0] == "dataloader"


def test_free_host_memory_is_memavailable_or_four_gib_where_unreadable(monkeypatch):
    # /proc/meminfo cannot be written: its text (and its absence) stood in for the reading
    meminfo = "MemTotal:       16000000 kB\nMemFree:  1000 kB\nMemAvailable:   2048 kB\n"

    def fake_open(path, *a, **kw):
        assert path == "/proc/meminfo"
        return io.StringIO(meminfo)

    monkeypatch.setattr(loaders, "open", fake_open, raising=False)
    assert loaders._available_host_memory() == 2048 * 1024
    assert loaders.free_memory(CPU) == 2048 * 1024
    meminfo = "MemTotal:       16000000 kB\n"
    assert loaders._available_host_memory() == 4 * 2**30

    def unreadable(path, *a, **kw):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(loaders, "open", unreadable, raising=False)
    assert loaders._available_host_memory() == 4 * 2**30


# ------------------------------------------------------------------ a user's dataset (factory)

SETS = '''
import torch
from torch.utils.data import Dataset


class Items(Dataset):
    def __init__(self, n, size=8, dtype="float", label=None, bad_at=None, big_at=None,
                 label_at=None, **declared):
        self.n, self.size, self.dtype, self.label, self.bad_at = n, size, dtype, label, bad_at
        self.big_at, self.label_at = big_at, label_at
        for k, v in declared.items():
            setattr(self, k, v)

    def __len__(self):
        if self.n == "boom":
            raise ValueError("no length today")
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        shape = (3, self.size + (i == self.bad_at), self.size)
        x = (torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
             if self.dtype == "uint8" else torch.rand(shape, generator=g))
        if self.dtype == "vector":
            x = x.flatten()
        if i == self.big_at:
            x = x + 1.5
        if self.label is not None and self.label_at in (None, i):
            return x, self.label
        return x, i % 4


class NoLength:
    def __getitem__(self, i):
        return i


def make(split, n=12, kind="items", val=None, **kw):
    if kind == "none" or (kind == "no-test" and split == "test"):
        return None
    if kind == "no-length":
        return NoLength()
    if split == "val" and val:
        kw = {**kw, **val}
    sizes = {"train": n, "val": 0 if kind == "empty-val" else 5, "test": 3}
    return Items(sizes[split], **kw)
'''


def _factory_cfg(tmp_path, name, task="classification", materialize=False, **kwargs):
    code = tmp_path / "code"
    code.mkdir(exist_ok=True)
    (code / f"{name}.py").write_text(SETS)
    raw = tiny_config(tmp_path, data={"source": "python", "factory": f"{name}:make",
                                      "code_dir": str(code), "kwargs": kwargs,
                                      "materialize": materialize})
    if task != "classification":
        raw["task"] = {"name": task}
    return from_dict(raw)


def test_a_factorys_dataset_per_split_or_one_message(tmp_path):
    from ddpflow.data import factory

    cfg = _factory_cfg(tmp_path, "lu_sets_a", n=7, size=6)
    train = factory.dataset(cfg, "train")
    assert len(train) == 7 and train.size == 6 and len(factory.dataset(cfg, "val")) == 5
    cfg = _factory_cfg(tmp_path, "lu_sets_b", kind="no-test")
    assert factory.dataset(cfg, "test") is None
    cfg = _factory_cfg(tmp_path, "lu_sets_c", kind="none")
    assert _refusal(factory.dataset, cfg, "val") == (
        "data.factory lu_sets_c:make returned NoneType for split 'val', not a map-style "
        "Dataset (__len__ and __getitem__)")
    cfg = _factory_cfg(tmp_path, "lu_sets_d", kind="no-length")
    assert _refusal(factory.dataset, cfg, "train") == (
        "data.factory lu_sets_d:make returned NoLength for split 'train', not a map-style "
        "Dataset (__len__ and __getitem__)")
    cfg = _factory_cfg(tmp_path, "lu_sets_e", n="boom")
    assert _refusal(factory.dataset, cfg, "train") == (
        "data.factory: len() of the 'train' dataset failed (ValueError: no length today)")
    cfg = _factory_cfg(tmp_path, "lu_sets_f", kind="empty-val")
    assert _refusal(factory.dataset, cfg, "val") == (
        "data.factory lu_sets_f:make returned an empty 'val' dataset")


def _items(tmp_path, name="lu_sets_items"):
    import importlib
    import sys

    code = tmp_path / "items"
    code.mkdir(exist_ok=True)
    (code / f"{name}.py").write_text(SETS)
    sys.path.insert(0, str(code))
    try:
        return importlib.import_module(name).Items
    finally:
        sys.path.remove(str(code))


def test_a_datasets_class_count_is_declared_or_unknown(tmp_path):
    from ddpflow.data.factory import describe, num_classes_of

    Items = _items(tmp_path)
    assert num_classes_of(Items(3, num_classes=5, classes=["a", "b"])) == 5
    assert num_classes_of(Items(3, classes=["a", "b", "c"])) == 3
    assert num_classes_of(Items(3)) is None and num_classes_of(Items(3, classes=[])) is None
    ds = Items(3, size=6, classes=["a", "b"])
    assert describe(ds, ds[0]) == {"input_shape": [3, 7 - 1, 6], "num_classes": 2,
                                   "in_channels": 3}
    assert describe(ds, (torch.zeros(4, 5), 1)) == {"input_shape": [4, 5], "num_classes": 2,
                                                    "in_channels": None}
    assert describe(Items(3), ({"a": torch.zeros(2)}, 1)) == {
        "input_shape": None, "num_classes": None, "in_channels": None}


def test_the_probe_names_the_setting_and_checks_labels_of_classification_only(tmp_path):
    from ddpflow.data.factory import check_item

    Items = _items(tmp_path)
    cfg = _factory_cfg(tmp_path, "lu_sets_g")
    ds = Items(9, classes=["a", "b"], label=3)
    msg = _refusal(check_item, ds, "val", cfg)
    assert msg == ("data.factory lu_sets_g:make: item 0 of the 'val' dataset: its target is "
                   "label 3, out of range; expected a class index in [0, 2)")
    mat = _factory_cfg(tmp_path, "lu_sets_h", materialize=True)
    assert _refusal(check_item, ds, "train", mat).startswith(
        "data.materialize lu_sets_h:make: item 0 of the 'train' dataset: its target is label 3")
    assert "has shape" in _refusal(check_item, Items(9, bad_at=4), "train", cfg)
    assert "channels" in _refusal(check_item, Items(9), "train", cfg, in_channels=1)
    good = Items(9)
    first = check_item(good, "train", cfg, in_channels=3)
    assert torch.equal(first[0], good[0][0]) and first[1] == 0
    # a user task's targets are its own: a label beyond the classes is no error
    task = _factory_cfg(tmp_path, "lu_sets_i", task="regression")
    assert check_item(ds, "train", task)[1] == 3


def test_a_batch_goes_to_the_device_whole_keeping_its_containers():
    from ddpflow.data.factory import to_device

    batch = ({"a": torch.ones(2), "b": [torch.zeros(1), 3]}, (torch.ones(1), "x"))
    out = to_device(batch, CPU)
    assert type(out) is tuple and type(out[0]["b"]) is list and type(out[1]) is tuple
    assert torch.equal(out[0]["a"], torch.ones(2)) and out[0]["b"][1] == 3
    assert out[1][1] == "x" and torch.equal(out[0]["b"][0], torch.zeros(1))
    t = torch.ones(3)
    assert to_device(t, CPU) is t and to_device(7, CPU) == 7


def _data_cfg(**kw):
    from types import SimpleNamespace

    return SimpleNamespace(**{"factory": "mine:make", "num_workers": 0, "pin_memory": False,
                              "persistent_workers": False, "prefetch_factor": 2, **kw})


def test_a_ranks_factory_batches_follow_the_epochs_order_and_resume_exactly(tmp_path):
    from ddpflow.data.factory import FactoryBatches

    Items = _items(tmp_path)
    ds = Items(26, classes=["a", "b", "c", "d"])
    trace = io.StringIO()
    fb = FactoryBatches(ds, 3, CPU, 2, 1, 5, _data_cfg(), trace=trace, classify=True)
    assert len(fb) == 4 and fb.loader.num_workers == 0 and fb.loader.prefetch_factor is None
    batches = list(fb.epoch(2))
    order = _order(26, 2, 1, 3, epoch=2)
    assert trace.getvalue() == "".join(f"2 {s}\n" for s in range(4)) and len(batches) == 4
    for (x, y), idx in zip(batches, order):
        assert torch.equal(x, torch.stack([ds[int(i)][0] for i in idx]))
        assert y.tolist() == [int(i) % 4 for i in idx]
    trace.seek(0)
    trace.truncate()
    resumed = list(fb.epoch(2, start_step=3))
    assert trace.getvalue() == "2 3\n" and len(resumed) == 1
    assert torch.equal(resumed[0][0], batches[3][0])
    # the stage's sampling over the dataset's labels; the workers' settings
    labels = np.arange(26) % 4
    spec = Spec("balanced", True, num_classes=4)
    fb = FactoryBatches(ds, 3, CPU, 2, 1, 5, _data_cfg(num_workers=1, persistent_workers=True,
                                                       prefetch_factor=3),
                        sampling=spec, labels=labels)
    assert fb.loader.num_workers == 1 and fb.loader.persistent_workers is True
    assert fb.loader.prefetch_factor == 3 and not fb.loader.pin_memory
    want = _order(26, 2, 1, 3, epoch=0, draws=spec.draws(labels))
    got = [y.tolist() for _, y in fb.epoch(0)]
    assert got == [[int(i) % 4 for i in idx] for idx in want]


def test_a_bad_item_in_a_factory_batch_names_the_setting_and_split(tmp_path):
    from ddpflow.core.errors import OneRankError
    from ddpflow.data.factory import FactoryBatches, val_batches

    Items = _items(tmp_path)
    ds = Items(8, classes=["a", "b"], label=3)
    fb = FactoryBatches(ds, 2, CPU, 1, 0, 0, _data_cfg(factory="sets:make"), classify=True)
    with pytest.raises(OneRankError, match=r"^data.factory sets:make: item \d of the 'train' "
                                           r"dataset has label 3, out of range for its 2 "):
        list(fb.epoch(0))
    assert len(list(FactoryBatches(ds, 2, CPU, 1, 0, 0, _data_cfg()).epoch(0))) == 4
    with pytest.raises(OneRankError, match=r"^data.factory sets:make: item 1 of the 'test' "
                                           r"dataset has label 3"):
        list(val_batches(ds, 2, CPU, 2, 1, _data_cfg(factory="sets:make"), "test",
                         classify=True))


class _Workers(torch.utils.data.Dataset):
    """Items that say how many workers read them (0: the main process)."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        info = torch.utils.data.get_worker_info()
        return torch.full((1,), float(i)), (info.num_workers if info else 0)


def test_a_ranks_validation_share_of_a_factory_set_is_strided_with_two_workers_at_most():
    from ddpflow.data.factory import val_batches

    got = list(val_batches(_Workers(), 2, CPU, 3, 2, _data_cfg(num_workers=4)))
    assert [x.flatten().tolist() for x, _ in got] == [[2.0, 5.0], [8.0, 11.0]]
    assert {n for _, y in got for n in y.tolist()} == {2}
    one = list(val_batches(_Workers(), 4, CPU, 1, 0, _data_cfg(num_workers=1)))
    assert {n for _, y in one for n in y.tolist()} == {1} and len(one) == 3


def test_a_materialized_set_is_its_images_as_uint8_nhwc_and_its_labels(tmp_path):
    from ddpflow.data.factory import materialize

    Items = _items(tmp_path)
    cfg = _factory_cfg(tmp_path, "lu_sets_j", materialize=True)
    for dtype in ("uint8", "float"):
        ds = Items(5, size=4, dtype=dtype, classes=["a", "b", "c", "d"])
        images, labels = materialize(ds, "train", cfg)
        assert images.shape == (5, 4, 4, 3) and images.dtype == np.uint8
        assert labels.dtype == np.int64 and labels.tolist() == [0, 1, 2, 3, 0]
        for i in range(5):
            x = ds[i][0]
            want = x if dtype == "uint8" else (x * 255).round().to(torch.uint8)
            assert np.array_equal(images[i], want.permute(1, 2, 0).numpy())
    assert "data.materialize needs C x H x W" in _refusal(
        materialize, Items(5, dtype="vector"), "train", cfg)
    # every item checked, not only the probe's (0, 2 and 4 of 5)
    assert _refusal(materialize, Items(5, big_at=1), "train", cfg).startswith(
        "data.materialize lu_sets_j:make: item 1 of the 'train' dataset: its image is a Tensor "
        "of shape (3, 8, 8) (float32): values in [1.5")
    ds = Items(5, size=4, bad_at=1, classes=["a", "b", "c", "d"])
    assert _refusal(materialize, ds, "val", cfg) == (
        "data.materialize lu_sets_j:make: item 1 of 'val' has shape (3, 5, 4), item 0 has "
        "(3, 4, 4); images must be one size")


# ------------------------------------------------------------------ sample weights (seam)

def test_weights_come_back_scaled_to_one_from_any_container_or_one_message():
    from ddpflow.seams.sampleweights import check_weights

    w = torch.tensor([1.0, 4.0, 2.0], requires_grad=True)
    for value in (w, [1, 4, 2], (1, 4, 2), np.array([1, 4, 2], dtype=np.uint8)):
        got = check_weights(value, 3, "w")
        assert got.dtype == np.float64 and got.tolist() == [0.25, 1.0, 0.5]
    name = "data.sample_weights w:f"
    assert _refusal(check_weights, np.ones((3, 1)), 3, name) == (
        "data.sample_weights w:f returned a ndarray of shape (3, 1) (float64); expected 3 "
        "weights, one per training sample: a list, numpy array or tensor of numbers")
    assert _refusal(check_weights, [1, 2], 3, name).startswith(
        "data.sample_weights w:f returned a list of 2: (int 1, int 2); expected 3 weights")
    assert _refusal(check_weights, np.array(["a", "b", "c"]), 3, name).startswith(
        "data.sample_weights w:f returned a ndarray of shape (3,) (<U1); expected 3 weights")
    assert _refusal(check_weights, [1.0, -2.0, float("nan")], 3, name) == (
        "data.sample_weights w:f returned weight 1 = -2.0; expected one finite weight >= 0 per "
        "training sample, some of them > 0")
    assert _refusal(check_weights, [1.0, 2.0, float("inf")], 3, name).startswith(
        "data.sample_weights w:f returned weight 2 = inf; expected")
    assert _refusal(check_weights, [0, 0, 0], 3, name) == (
        "data.sample_weights w:f returned all 3 weights 0; expected one finite weight >= 0 per "
        "training sample, some of them > 0")
    assert check_weights([0, 0, 3], 3, name).tolist() == [0.0, 0.0, 1.0]


WEIGHTS = '''
import numpy as np


def by_label(labels):
    return [1.0 + float(v) for v in labels]


def plain(labels):
    assert labels is None
    return [2.0, 1.0]


def by_rank(labels):
    import torch.distributed as dist

    return [1.0, 2.0, 3.0 + dist.get_rank()]  # another weight on each rank
'''


def _weights_cfg(tmp_path, name, fn):
    code = tmp_path / "wcode"
    code.mkdir(exist_ok=True)
    (code / f"{name}.py").write_text(WEIGHTS)
    return from_dict(tiny_config(tmp_path, data={"sampling": "weights", "code_dir": str(code),
                                                 "sample_weights": f"{name}:{fn}"}))


def test_the_users_weights_callable_gets_the_labels_and_is_checked(tmp_path):
    from ddpflow.seams.sampleweights import sample_weights

    cfg = _weights_cfg(tmp_path, "lu_weights_a", "by_label")
    got = sample_weights(cfg, np.array([0, 3, 1], dtype=np.int64), 3)
    assert got.tolist() == [0.25, 1.0, 0.5]
    assert _refusal(sample_weights, cfg, np.array([0, 3], dtype=np.int64), 3).startswith(
        "data.sample_weights lu_weights_a:by_label returned a list of 2: ")
    cfg = _weights_cfg(tmp_path, "lu_weights_b", "plain")
    assert sample_weights(cfg, None, 2).tolist() == [1.0, 0.5]


AGREE = '''
import json
import sys

import numpy as np
import torch.distributed as dist

from ddpflow.core.errors import UserError
from ddpflow.seams.sampleweights import agree

rank, store, config = int(sys.argv[1]), sys.argv[2], sys.argv[3]
agree(np.ones(3), "w:f")  # no process group yet: nothing to compare
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
try:
    agree(np.array([1.0, 2.0, 3.0]), "w:f")
    print("agreed")
    from ddpflow.config import from_dict
    from ddpflow.data.pipeline import sampling

    sampling(from_dict(json.loads(open(config).read())), np.array([0, 1, 0]), 3, 2)
    print("sampled")
except UserError as e:
    print(e)
dist.destroy_process_group()
'''


def test_the_ranks_weights_are_compared_and_a_difference_names_the_rank(tmp_path):
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "agree.py"
    script.write_text(AGREE)
    cfg = _weights_cfg(tmp_path, "lu_weights_rank", "by_rank")  # writes the callable's module
    raw = tiny_config(tmp_path, data={"sampling": "weights", "code_dir": str(tmp_path / "wcode"),
                                      "sample_weights": "lu_weights_rank:by_rank"})
    assert cfg.data.sample_weights == raw["data"]["sample_weights"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path / "store"),
                               str(tmp_path / "config.json")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=os.environ.copy()) for r in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    msg = ("data.sample_weights lu_weights_rank:by_rank returned other weights on rank 1 than "
           "on rank 0; it must give the same weights every time it is called (seed what it "
           "draws at random)")
    assert [o.splitlines() for o, _ in outs] == [["agreed", msg]] * 2


def test_one_process_group_of_one_rank_has_nothing_to_compare(tmp_path):
    import torch.distributed as dist

    from ddpflow.seams.sampleweights import agree

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        assert agree(np.ones(2), "w:f") is None
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ one rank's pipeline

def _dist(world=1, rank=0):
    from types import SimpleNamespace

    return SimpleNamespace(device=CPU, world=world, rank=rank)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """A small prepared synthetic set (64 train, 16 val, 8 test images of 12 x 12)."""
    tmp = tmp_path_factory.mktemp("synthetic")
    raw = tiny_config(tmp, data={"train_size": 64, "val_size": 16, "test_size": 8,
                                 "image_size": 12, "loader": "dataloader"})
    prepare(from_dict(raw))
    return raw


def _prepared(tmp_path, synthetic, **data):
    import copy

    raw = copy.deepcopy(synthetic)
    raw["data"].update(data)
    cfg = from_dict(raw)
    return cfg, prepared.load(cfg.data_dir)[0]


def test_a_prepared_sets_pipeline_follows_the_data_settings(tmp_path, synthetic):
    from ddpflow.data.pipeline import open_pipeline

    cfg, meta = _prepared(tmp_path, synthetic, num_workers=1, persistent_workers=True,
                          prefetch_factor=3, interpolation="bicubic", max_bad_fraction=0.25,
                          sampling="balanced", eval_crop_size=10)
    asked = []
    p = open_pipeline(cfg, _dist(2, 1), meta, 4, None, lambda c: asked.append(c) or 3, True,
                      recipe=Recipe(0.0, 0.2, 0.0), accum=2)
    assert asked == [3] and p.kind == "dataloader" and p.reason == (
        "data.loader is set to 'dataloader'")
    assert (p.num_classes, p.in_channels, p.train_samples) == (meta["num_classes"], 3, 64)
    assert p.normalize.want_channels == 3 and p.normalize.channels_last is True
    p.use_channels_last(False)
    assert p.normalize.channels_last is False and p.train.normalize is p.normalize
    t = p.train
    assert (t.loader.num_workers, t.loader.persistent_workers, t.loader.prefetch_factor) == (
        1, True, 3)
    assert t.interpolation == "bicubic" and t.image_size == 12 and t.bad.fraction == 0.25
    assert t.recipe.num_classes == meta["num_classes"] and t.recipe.mixup_alpha == 0.2
    assert (t.sampler.world, t.sampler.rank, t.sampler.accum, t.sampler.seed) == (2, 1, 2, 0)
    assert t.sampler.draws is not None and t.sampler.draws.mode == "balanced"
    _, arrays = prepared.load(cfg.data_dir)
    val_x = arrays["val"][0][1::2]  # rank 1 of 2: the odd samples, centre-cropped to 10
    want = EvalCrop(10, mode="bicubic")(Normalize(meta["mean"], meta["std"], CPU, 3, False)(
        torch.from_numpy(np.asarray(val_x))))
    assert torch.equal(torch.cat([x for x, _ in p.val(3)]), want)
    assert len(torch.cat([y for _, y in p.test(8)])) == 4


def test_a_dataloader_stops_its_workers_when_asked(tmp_path, synthetic):
    from ddpflow.data.pipeline import close_workers, open_pipeline

    cfg, meta = _prepared(tmp_path, synthetic, num_workers=1, persistent_workers=True)
    p = open_pipeline(cfg, _dist(), meta, 4, None, lambda c: c, False)
    next(iter(p.train.epoch(0)))
    workers = p.train.loader._iterator._workers
    assert workers and all(w.is_alive() for w in workers)
    close_workers(p.train)
    assert not any(w.is_alive() for w in workers)
    close_workers(object())  # no loader, or one never iterated: nothing to stop
    close_workers(_train("dataloader", *_data(6))[0])


def test_the_loader_auto_picks_fits_train_and_val_in_the_budget(tmp_path, synthetic):
    from ddpflow.data.pipeline import open_pipeline

    cfg, meta = _prepared(tmp_path, synthetic, loader="auto", device_memory_fraction=1.0)
    _, arrays = prepared.load(cfg.data_dir)
    nbytes = sum(a.nbytes for split in ("train", "val") for a in arrays[split])
    p = open_pipeline(cfg, _dist(), meta, 4, None, lambda c: c, False,
                      budget=(nbytes, " (agreed)"))
    assert p.kind == "device" and p.reason.endswith(" (agreed)")
    p = open_pipeline(cfg, _dist(), meta, 4, None, lambda c: c, False,
                      budget=(nbytes - 1, " (agreed)"))
    assert p.kind == "dataloader"
    tuned = {"loader": "dataloader", "num_workers": 1, "prefetch_factor": 5}
    p = open_pipeline(cfg, _dist(), meta, 4, tuned, lambda c: c, False)
    assert (p.kind, p.reason) == ("dataloader", "measured fastest by ddpflow tune")
    assert p.train.loader.num_workers == 1 and p.train.loader.prefetch_factor == 5
    cfg, meta = _prepared(tmp_path, synthetic, loader="device")
    p = open_pipeline(cfg, _dist(), meta, 4, tuned, lambda c: c, False)
    assert p.kind == "device" and p.reason == "data.loader is set to 'device'"


def test_a_prepared_set_without_a_test_split_has_no_test_batches(tmp_path):
    from ddpflow.data.pipeline import open_pipeline

    cfg = from_dict(tiny_config(tmp_path, data={"train_size": 32, "val_size": 8,
                                                "test_size": 0, "image_size": 8}))
    meta, _ = prepare(cfg)
    p = open_pipeline(cfg, _dist(), meta, 4, None, lambda c: c, False)
    assert p.test is None and p.kind == "device" and p.train_samples == 32


def test_a_user_datasets_pipeline(tmp_path):
    from ddpflow.data.pipeline import open_pipeline

    cfg = _factory_cfg(tmp_path, "lu_sets_k", n=10, classes=["a", "b", "c", "d"])
    meta = {"kind": "python", "counts": {"test": {"total": 5}}, "num_classes": 9}
    trace = io.StringIO()
    p = open_pipeline(cfg, _dist(2, 1), meta, 2, None, lambda c: c, False, trace=trace,
                      accum=2)
    assert (p.kind, p.reason) == ("dataloader", "data.source python (lu_sets_k:make)")
    assert (p.num_classes, p.in_channels, p.train_samples, p.normalize) == (4, 3, 10, None)
    p.use_channels_last(True)  # a user dataset's layout is its own: nothing to change
    assert p.train.sampler.accum == 2 and p.train.sampler.rank == 1 and len(p.train) == 2
    assert len(list(p.train.epoch(0))) == 2 and trace.getvalue() == "0 0\n0 1\n"
    val = list(p.val(2))  # rank 1 of 2: items 1 and 3 of the 5 val items
    assert [y.tolist() for _, y in val] == [[1, 3]]
    assert [y.tolist() for _, y in p.test(5)] == [[1]]  # the test split's 3 items: item 1
    meta = {"kind": "python", "counts": {"test": {"total": 0}}}
    cfg = _factory_cfg(tmp_path, "lu_sets_l", n=10)
    p = open_pipeline(cfg, _dist(), meta, 2, None, lambda c: c, False)
    assert p.test is None and p.num_classes is None
    meta["num_classes"] = 4
    assert open_pipeline(cfg, _dist(), meta, 2, None, lambda c: c, False).num_classes == 4


def test_a_user_datasets_items_are_checked_as_the_task_needs(tmp_path):
    from ddpflow.core.errors import OneRankError
    from ddpflow.data.pipeline import open_pipeline

    meta = {"kind": "python", "counts": {}}
    four = ["a", "b", "c", "d"]
    cfg = _factory_cfg(tmp_path, "lu_sets_n", classes=four, val={"label": 9})
    assert _refusal(open_pipeline, cfg, _dist(), meta, 2, None, lambda c: c, False) == (
        "data.factory lu_sets_n:make: item 0 of the 'val' dataset: its target is label 9, "
        "out of range; expected a class index in [0, 4)")
    # a label past the probe (items 0, 6 and 11 of 12) is found in its batch, for a
    # classification task only
    cfg = _factory_cfg(tmp_path, "lu_sets_o", classes=four, label=9, label_at=3)
    p = open_pipeline(cfg, _dist(), meta, 12, None, lambda c: c, False)
    with pytest.raises(OneRankError, match="^data.factory lu_sets_o:make: item 3 of the "
                                           "'train' dataset has label 9, out of range"):
        list(p.train.epoch(0))
    cfg = _factory_cfg(tmp_path, "lu_sets_p", task="regression", classes=four, label=9,
                       label_at=3)
    p = open_pipeline(cfg, _dist(), meta, 12, None, lambda c: c, False)
    assert len(list(p.train.epoch(0))) == 1
    # the dataset's `targets` decide the draws; checked, in a message naming the factory
    code = tmp_path / "code"
    raw = tiny_config(tmp_path, data={"source": "python", "factory": "lu_sets_q:make",
                                      "code_dir": str(code), "sampling": "balanced",
                                      "kwargs": {"targets": [0, 1, 2, 3] * 3,
                                                 "classes": ["a", "b", "c", "d", "e"]}})
    (code / "lu_sets_q.py").write_text(SETS)
    assert _refusal(open_pipeline, from_dict(raw), _dist(), meta, 2, None, lambda c: c,
                    False).startswith("data.sampling balanced: class 4 has no sample in ")
    raw["data"]["kwargs"] = {"targets": [0, 1] * 5, "classes": four}
    raw["data"]["factory"] = "lu_sets_r:make"
    (code / "lu_sets_r.py").write_text(SETS)
    assert _refusal(open_pipeline, from_dict(raw), _dist(), meta, 2, None, lambda c: c,
                    False) == (
        "data.factory lu_sets_r:make: the dataset's `targets` is int64 of shape (10,); "
        "data.sampling needs one class index >= 0 per sample (12)")


def test_a_user_dataset_without_targets_cannot_be_balanced(tmp_path):
    from ddpflow.data.pipeline import open_pipeline

    code = tmp_path / "code"
    code.mkdir()
    (code / "lu_sets_m.py").write_text(SETS)
    raw = tiny_config(tmp_path, data={"source": "python", "factory": "lu_sets_m:make",
                                      "code_dir": str(code), "sampling": "balanced"})
    meta = {"kind": "python", "counts": {}}
    assert _refusal(open_pipeline, from_dict(raw), _dist(), meta, 2, None, lambda c: c,
                    False) == (
        "data.sampling balanced draws each class equally often, and the data.factory "
        "lu_sets_m:make dataset does not say its samples' classes; give it `targets` (a class "
        "index per sample, as torchvision's datasets have), or set data.materialize: true")


def test_weights_sampling_calls_the_users_weights_with_the_labels(tmp_path):
    from ddpflow.data.pipeline import sampling

    cfg = _weights_cfg(tmp_path, "lu_weights_c", "by_label")
    spec = sampling(cfg, [0, 3, 1], 3, 4)
    assert spec.mode == "weights" and spec.weights.tolist() == [0.25, 1.0, 0.5]
    assert spec.replacement is True and spec.num_classes == 4
    cfg = _weights_cfg(tmp_path, "lu_weights_d", "plain")
    assert sampling(cfg, None, 2, None).weights.tolist() == [1.0, 0.5]
    plain = sampling(from_dict(tiny_config(tmp_path)), [0, 1], 2, 2)
    assert (plain.mode, plain.weights, plain.num_classes) == ("uniform", None, 2)


def test_sampling_is_checked_before_the_ranks_start(tmp_path, synthetic):
    from ddpflow.data.pipeline import check_sampling

    cfg, meta = _prepared(tmp_path, synthetic, sampling="balanced")
    assert check_sampling(cfg, meta) is None
    meta = {**meta, "num_classes": meta["num_classes"] + 1}  # a class without a sample
    assert _refusal(check_sampling, cfg, meta).startswith(
        f"data.sampling balanced: class {meta['num_classes'] - 1} has no sample in the "
        f"training split")
    cfg = from_dict(tiny_config(tmp_path / "nowhere", data={"sampling": "balanced"}))
    assert check_sampling(cfg, {"kind": "python"}) is None  # a user dataset: checked by ranks
    cfg = from_dict(tiny_config(tmp_path / "nowhere"))
    assert check_sampling(cfg, {}) is None  # uniform: nothing to check, nothing read


# ------------------------------------------------------------------ a user dataset's batches

class _Odd(torch.utils.data.Dataset):
    """8 items of 3 x 4 x 4, label i % 4; item `at` spoilt as `bad` says."""

    def __init__(self, bad=None, at=5, n=8):
        self.bad, self.at, self.n = bad, at, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x, y = torch.full((3, 4, 4), float(i)), i % 4
        if i == self.at:
            if self.bad == "shape":
                x = torch.zeros(3, 5, 4)
            elif self.bad == "raises":
                raise ValueError(f"cannot read {i}")
            elif self.bad == "user":
                raise UserError(f"item {i}: the user's own message")
            elif self.bad == "text":
                y = "cat"
            elif self.bad == "float":
                y = 2.5
            elif self.bad == "label":
                y = 7
        return x, y


def _checked(ds, batch=4, workers=0, classes=4, classify=True, split="train"):
    from torch.utils.data import DataLoader

    from ddpflow.data import stream

    loader = DataLoader(ds, batch_size=batch, num_workers=workers)
    return list(stream.checked(loader, ds, list(range(len(ds))), batch, "data.factory s:m",
                               split, classes, classify))


def _one_rank_error(fn, *args, **kw) -> str:
    from ddpflow.core.errors import OneRankError

    with pytest.raises(OneRankError) as e:
        fn(*args, **kw)
    return str(e.value)


def test_a_batchs_items_are_listed_up_to_five_and_shapes_shown_as_the_input_alone():
    from ddpflow.data import stream

    assert stream._items([3, 1, 4, 1, 5]) == "3, 1, 4, 1, 5"
    assert stream._items([3, 1, 4, 1, 5, 9]) == "3, 1, 4, 1, 5 ... (6 items)"
    assert stream._shown(((3, 4, 4), ())) == "(3, 4, 4)"
    assert stream._shown(((3, 4, 4), (2,))) == "((3, 4, 4), (2,))"
    assert stream._shown(((3, 4, 4), (), ())) == "((3, 4, 4), (), ())"
    assert stream._shown((3, 4)) == "(3, 4)"


@pytest.mark.parametrize("workers", [0, 1])
def test_a_batch_that_cannot_be_made_names_its_item(workers):
    assert _one_rank_error(_checked, _Odd("shape"), workers=workers) == (
        "data.factory s:m: item 5 of the 'train' dataset has shape (3, 5, 4), the other items "
        "of its batch (3, 4, 4); items must be of one shape to make a batch (resize or crop "
        "them, e.g. in the dataset's transform)")
    assert _one_rank_error(_checked, _Odd("raises", at=2), workers=workers, split="val") \
        .startswith("data.factory s:m: reading item 2 of the 'val' dataset failed (ValueError: "
                    "cannot read 2 at test_loaders_unit.py:")
    # items that read well and are of one shape, but make no batch together (a str target)
    msg = _one_rank_error(_checked, _Odd("text", at=7), workers=workers, batch=6,
                          classify=False)
    assert msg.startswith("data.factory s:m: reading items 6, 7 of the 'train' dataset into a "
                          "batch failed (TypeError: "), msg
    assert msg.endswith("); fix the dataset's __getitem__ (or its transform) for these items")
    if workers:  # the worker's exception: its last line, and where it rose
        assert "Caught" not in msg and ".py:" in msg and "\n" not in msg


def test_the_datasets_own_message_and_a_killed_worker_are_not_renamed():
    from ddpflow.data import stream

    with pytest.raises(UserError, match="^item 5: the user's own message$"):
        _checked(_Odd("user"))
    killed = RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed.")
    assert stream.loader_error(killed, _Odd("shape"), [4, 5], "n", "train") is None
    fine = stream.loader_error(RuntimeError("collate failed\nsecond line"), _Odd(), [0, 1],
                               "n", "train")
    assert str(fine) == ("n: reading items 0, 1 of the 'train' dataset into a batch failed "
                         "(RuntimeError: collate failed); fix the dataset's __getitem__ (or "
                         "its transform) for these items")
    text = ("Caught KeyError in DataLoader worker process 0.\nOriginal Traceback (most recent "
            "call last):\n  File \"/x/torch/collate.py\", line 12, in f\n    raise\n  File "
            "\"/home/u/sets.py\", line 40, in g\n    d[k]\nKeyError: 'k'\n")
    err = stream.loader_error(RuntimeError(text), _Odd(), [0, 1], "n", "val")
    assert str(err) == ("n: reading items 0, 1 of the 'val' dataset into a batch failed "
                        "(KeyError: 'k' at sets.py:40); fix the dataset's __getitem__ (or its "
                        "transform) for these items")
    text = "Caught KeyError in DataLoader worker process 1.\nsomething else entirely\n"
    err = stream.loader_error(RuntimeError(text), _Odd(), [0], "n", "val")
    assert "failed (KeyError: something else entirely); fix" in str(err)
    long = stream.loader_error(RuntimeError("x" * 300), _Odd(), [0], "n", "val")
    assert f"(RuntimeError: {'x' * 200}); fix" in str(long)
    err = stream.loader_error(RuntimeError("e"), _Odd(), list(range(8)), "n", "val")
    assert "reading items 0, 1, 2, 3, 4 ... (8 items) of the 'val'" in str(err)


class _Killed(_Odd):
    """A worker killed (as the kernel's OOM killer would) while reading item 5."""

    def __getitem__(self, i):
        import os
        import signal

        if i == 5 and torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(i)


def test_a_killed_worker_is_torchs_own_error_not_the_datasets():
    with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid"):
        _checked(_Killed(), workers=1)


def test_labels_out_of_range_name_the_dataset_index():
    from ddpflow.data import stream

    assert _one_rank_error(_checked, _Odd("label", at=6)) == (
        "data.factory s:m: item 6 of the 'train' dataset has label 7, out of range for its 4 "
        "classes (its num_classes / classes); expected a class index in [0, 4): fix the "
        "item's label, or the dataset's class count")
    assert len(_checked(_Odd("label", at=6), classes=None)) == 2  # no count: 7 may be a class
    assert len(_checked(_Odd("label", at=6), classes=8)) == 2
    assert len(_checked(_Odd("label", at=6), classify=False)) == 2
    check = stream.check_labels
    assert _one_rank_error(check, torch.tensor([1, -2]), [10, 11], None, "n", "test") == (
        "n: item 11 of the 'test' dataset has label -2, out of range for its classes; expected "
        "a class index in 0 or more: fix the item's label, or the dataset's class count")
    assert _one_rank_error(check, torch.tensor([0, 1, 9]), [4, 5], 3, "n", "val").startswith(
        "n: item #2 of its batch of the 'val' dataset has label 9")
    assert _one_rank_error(check, torch.tensor([0, 9, 8]), [4, 5, 6], 3, "n", "val").startswith(
        "n: item 5 of the 'val' dataset has label 9")  # the first of them
    assert _one_rank_error(check, torch.tensor([3]), [4], 3, "n", "val").startswith(
        "n: item 4 of the 'val' dataset has label 3")
    for y in (torch.tensor([9.0]), torch.tensor([[9, 9]]), torch.tensor([True]),
              torch.tensor([9 + 0j]), [9], torch.tensor([2, 1])):
        assert check(y, [0, 1], 3, "n", "val") is None  # soft, a task's own, or in range


def test_a_target_that_is_no_class_index_names_its_item():
    assert _one_rank_error(_checked, _Odd("float", at=4)) == (
        "data.factory s:m: item 4 of the 'train' dataset: its target is a float label 2.5; "
        "expected an integer class index")
    assert len(_checked(_Odd("float", at=4), classify=False)) == 2


def test_the_batches_end_where_the_loader_ends():
    from ddpflow.data import stream

    class Short(list):
        def __len__(self):
            return 3  # says 3 batches, has 2

    batches = Short([(torch.zeros(2), torch.tensor([0, 1])), (torch.zeros(2),
                                                               torch.tensor([2, 3]))])
    got = list(stream.checked(batches, _Odd(), list(range(8)), 2, "n", "train", 4, True))
    assert len(got) == 2
    odd = [[torch.zeros(1), torch.tensor([1])]]  # a batch of three parts: no targets to check
    assert len(list(stream.checked(odd, _Odd(), [0], 1, "n", "train", 4, True))) == 1
    labels_as_they_came = [(torch.zeros(2), ["a", "b"])]
    assert _one_rank_error(lambda: list(stream.checked(
        labels_as_they_came, _Odd("text", at=1), [0, 1], 2, "n", "train", 4, True))) == (
        "n: item 1 of the 'train' dataset: its target is a str label 'cat'; expected an "
        "integer class index")


# ------------------------------------------------------------------ damaged JPEG shards

def _spoilt(jpeg, tmp_path, other_size=True):
    """A copy of the JPEG set whose train sample 3 is a whole, CRC-checked JPEG of another
    size (appended to its shard; other_size) and whose sample 9's index entry points past its
    shard."""
    import shutil
    import zlib

    from PIL import Image

    cfg, images, _ = jpeg
    folder = tmp_path / "data"
    shutil.copytree(cfg.data_dir, folder)
    meta = prepared.load(folder)[0]
    index = np.load(folder / "train_index.npy")
    k = int(index[3, 0])
    shard = folder / shards.shard_name("train", k)
    other = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(other, format="JPEG")
    data = other.getvalue()
    at = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(data)
    if other_size:
        index[3] = (k, at, len(data), zlib.crc32(data))
    index[9, 1] = 10**9
    np.save(folder / "train_index.npy", index)
    recorded = {**meta["bytes"], shard.name: at + len(data)}
    return shards.JpegImages(folder, "train", images.shape[1:], recorded), shard.name


@pytest.mark.parametrize("kind", ["device", "dataloader"])
def test_damaged_jpegs_are_left_out_of_training_and_too_many_are_one_message(jpeg, tmp_path,
                                                                          kind, capfd):
    _, _, labels = jpeg
    images, name = _spoilt(jpeg, tmp_path)
    tb, trace = _train(kind, images, labels, batch=4, max_bad=0.05)
    sizes = [len(y) for _, y in tb.epoch(0)]
    seen = [int(i) for line in trace.getvalue().splitlines() for i in line.split()[2:]]
    err = capfd.readouterr().err
    assert (f"ddpflow: rank 0: skipped unreadable train sample 3 ({name} @ ") in err
    assert "decoded to (8, 8, 3), expected (16, 16, 3)" in err
    assert "skipped unreadable train sample 9 (" in err and "lies outside" in err
    if kind == "dataloader":  # the dataset's indices, each batch without its unreadable ones
        assert 3 not in seen and 9 not in seen and len(seen) == sum(sizes) == 46
    else:  # the readable samples resident, the epoch drawn from them
        assert len(tb.labels) == 46 and sizes == [4] * 11
        assert tb.labels.tolist() == np.delete(labels, [3, 9]).tolist()
    with pytest.raises(UserError) as e:
        _epoch(_train(kind, images, labels, batch=4, max_bad=0.03)[0])
    assert str(e.value).startswith("2 unreadable samples of the train split's 48, more than "
                                   "data.max_bad_fraction=0.03; first: train sample ")


def test_pinned_memory_is_asked_for_only_where_a_gpu_copies_the_batches(recwarn, tmp_path):
    """data.pin_memory on a CPU run: nothing to pin for, and no warning about it."""
    from ddpflow.data.factory import FactoryBatches, val_batches

    images, labels = _data(12)
    tb, _ = _train("dataloader", images, labels, pin_memory=True)
    assert not tb.loader.pin_memory and len(_epoch(tb)) == 4
    Items = _items(tmp_path)
    fb = FactoryBatches(Items(8), 2, CPU, 1, 0, 0, _data_cfg(pin_memory=True))
    assert not fb.loader.pin_memory and len(list(fb.epoch(0))) == 4
    assert len(list(val_batches(Items(8), 4, CPU, 1, 0, _data_cfg(pin_memory=True)))) == 2
    assert not [w for w in recwarn if "pin" in str(w.message)]


@pytest.mark.parametrize("resident", [False, True], ids=["streamed", "resident"])
def test_damaged_jpegs_are_left_out_of_validation_and_too_many_are_one_message(
        jpeg, tmp_path, resident, capfd):
    _, _, labels = jpeg
    images, name = _spoilt(jpeg, tmp_path)
    norm = Normalize(MEAN, STD, CPU, 3, False)
    batches = val_batches(images, labels, CPU, 1, 0, norm, resident=resident, split="test",
                          max_bad=0.05, image_size=16)
    assert sum(len(y) for _, y in batches(8)) == 46
    err = capfd.readouterr().err
    assert f"ddpflow: rank 0: skipped unreadable train sample 3 ({name} @ " in err
    assert "skipped unreadable train sample 9 (" in err
    refused = val_batches(images, labels, CPU, 1, 0, norm, resident=resident, split="test",
                          max_bad=0.03, image_size=16)
    with pytest.raises(UserError, match=r"^2 unreadable samples of the test split's 48, more "
                                        r"than data.max_bad_fraction=0.03; first: train "):
        list(refused(8))


def test_the_gpu_decode_path_gives_the_workers_decoded_batches(jpeg, tmp_path, capfd):
    """TrainBatches' nvJPEG path (workers read the bytes, the training device decodes a batch
    ahead in a thread), run on the CPU: torchvision's decode_jpeg decodes on either device;
    only the flag a CUDA device sets is set here by hand."""
    _, _, labels = jpeg
    images, _ = _spoilt(jpeg, tmp_path, other_size=False)
    aug = _aug(policy="trivialaugment")
    plain, trace = _train("dataloader", images, labels, batch=4, max_bad=0.05, aug=aug)
    want = _epoch(plain, 1)
    gpu, gpu_trace = _train("dataloader", images, labels, batch=4, max_bad=0.05, aug=aug)
    gpu.gpu_decode = gpu.loader.dataset.encoded = True
    got = _epoch(gpu, 1)
    assert len(got) == len(want) == 12 and gpu_trace.getvalue() == trace.getvalue()
    for (xa, ya), (xb, yb) in zip(got, want):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    err = capfd.readouterr().err
    assert err.count("ddpflow: rank 0: skipped unreadable train sample 9 (") == 2


def test_a_gpus_free_memory_is_what_cuda_says_is_free_not_its_total(monkeypatch):
    """No GPU here: torch.cuda.mem_get_info, the driver's (free, total) bytes, stood in."""
    gpu, asked = torch.device("cuda", 1), []
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda dev: asked.append(dev) or (3 * 2**30, 80 * 2**30))
    assert loaders.free_memory(gpu) == 3 * 2**30 and asked == [gpu]
    assert choose_loader("auto", 2 * 2**30, gpu, 0.5) == (
        "dataloader", "dataset 2048 MiB does not fit in 0.5 of 3.0 GiB free cuda memory")


def test_the_device_loader_keeps_val_resident_and_streams_the_test_split(tmp_path):
    """Held on the device: the val split, copied at the first validation (a change to the
    files after it is not seen); the test split (read once, at the end) and every split of
    the DataLoader are read from the files each time."""
    from ddpflow.data.pipeline import open_pipeline

    def held(p):
        return (torch.cat([x for x, _ in p.val(8)]), torch.cat([x for x, _ in p.test(8)]))

    for kind in ("device", "dataloader"):
        cfg = from_dict(tiny_config(tmp_path / kind, data={
            "train_size": 16, "val_size": 8, "test_size": 8, "image_size": 8,
            "loader": kind}))
        meta, _ = prepare(cfg)
        p = open_pipeline(cfg, _dist(), meta, 4, None, lambda c: c, False)
        val, test = held(p)
        for split in ("val", "test"):
            arr = np.load(cfg.data_dir / f"{split}_images.npy", mmap_mode="r+")
            arr[:] = 255 - arr
            arr.flush()
        val2, test2 = held(p)
        assert torch.equal(val, val2) == (kind == "device") and not torch.equal(test, test2)


def test_on_a_gpu_the_workers_hand_over_a_jpeg_sets_bytes(jpeg):
    """Training on a GPU (only the device named: nothing here touches CUDA), the DataLoader
    workers of a JPEG set read the stored bytes and leave the decode to the GPU (nvJPEG)."""
    _, images, labels = jpeg
    tb = TrainBatches("dataloader", images, labels, 4, torch.device("cuda"), 1, 0, 5, _aug(),
                      _norm())
    bufs, y, idx, bad = next(iter(tb.loader))
    assert [bytes(b) for b in bufs] == [bytes(images.encoded(int(i))) for i in idx]
    assert y.tolist() == labels[idx.numpy()].tolist() and bad == []
    cpu = TrainBatches("dataloader", images, labels, 4, CPU, 1, 0, 5, _aug(), _norm())
    x, *_ = next(iter(cpu.loader))
    assert x.shape == (4, 16, 16, 3) and x.dtype == torch.uint8  # decoded by the workers
