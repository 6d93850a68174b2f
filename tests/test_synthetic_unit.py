"""data/synthetic.py, the default run's data: its shape and balance, each split and each
seed its own draw, and the exact bytes of a few draws. Those bytes are pinned on purpose:
the figures in docs/BENCHMARKS.md and the accuracy the default run reaches were measured on
this set, and a change to the generator (a constant, a draw order) would quietly make them
incomparable; a deliberate change updates the digests here and re-measures the figures.
Fast: a few hundred small images."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from ddpflow.data.synthetic import SPLIT_STREAMS, _smooth, generate


def _digest(*arrays) -> str:
    return hashlib.sha256(b"".join(a.tobytes() for a in arrays)).hexdigest()[:16]


@pytest.mark.parametrize("difficulty, split, digest", [
    (0, "train", "c28f26482d74a6a3"), (0, "val", "6de6c6931e545d86"),
    (0, "test", "b46ce9f384fbf384"), (1.0, "train", "54f5700d94b6270c"),
    (1.0, "val", "aea30856f465854a"), (1.0, "test", "c143afabf532fdc5"),
    (0.5, "train", "7c5476c1584ea5f3"), (0.5, "val", "dcf427219dfd22f6"),
    (0.5, "test", "506afc7534a3277b"),
])
def test_the_synthetic_set_is_the_one_the_figures_were_measured_on(difficulty, split, digest):
    assert _digest(*generate(600, 10, 16, 3, 7, split, difficulty)) == digest


@pytest.mark.parametrize("size, digest", [
    (6, "edb5e5cf6e6af7d0"), (7, "1df626a694670d9c"), (12, "4595bfb8bff7e63f"),
    (14, "e2382e4ecd0359d3")])
def test_small_and_in_between_image_sizes_are_pinned_too(size, digest):
    """The shift (at least a pixel, an eighth of the side) and the occluder's size (a
    sixth to a third of the side) round differently at these sizes."""
    assert _digest(*generate(64, 3, size, 3, 1, "train", 1.0)) == digest


def test_odd_sizes_one_channel_and_an_odd_number_of_classes():
    x, y = generate(10, 3, 9, 1, 0, "train", 1.0)
    assert _digest(x, y) == "03556a9e69e96941"
    assert x.shape == (10, 9, 9, 1) and x.dtype == np.uint8 and y.dtype == np.int64


def test_a_draw_is_balanced_shuffled_and_spans_the_pixel_range():
    x, y = generate(1000, 10, 16, 3, 0, "train", 1.0)
    assert x.shape == (1000, 16, 16, 3) and x.dtype == np.uint8
    assert y.dtype == np.int64 and np.bincount(y).tolist() == [100] * 10
    assert y[:10].tolist() != list(range(10))  # not in class order
    assert x.min() == 0 and x.max() == 255  # noise reaches both ends, clipped


def test_splits_and_seeds_draw_apart_from_the_same_classes():
    train, _ = generate(200, 4, 16, 3, 5, "train", 1.0)
    val, _ = generate(200, 4, 16, 3, 5, "val", 1.0)
    other, _ = generate(200, 4, 16, 3, 6, "train", 1.0)
    again, _ = generate(200, 4, 16, 3, 5, "train", 1.0)
    assert np.array_equal(train, again)
    assert not np.array_equal(train, val) and not np.array_equal(train, other)
    assert np.array_equal(generate(50, 4, 16, 3, 5, "holdout", 1.0)[0],
                          generate(50, 4, 16, 3, 5, "val", 1.0)[0])  # an unknown split: val's
    assert sorted(SPLIT_STREAMS.values()) == [1, 2, 3]


def test_classes_differ_in_their_mean_image():
    """Learnable: the mean image of a class is nearer to its own class's than to another's."""
    x, y = generate(2000, 4, 16, 3, 0, "train", 0)
    means = np.stack([x[y == c].mean(0) for c in range(4)])
    x2, y2 = generate(400, 4, 16, 3, 0, "val", 0)
    d = ((x2[:, None].astype(float) - means[None]) ** 2).sum(axis=(2, 3, 4))
    assert (d.argmin(1) == y2).mean() > 0.5


def test_smoothing_keeps_a_flat_grid_flat_and_the_size_asked():
    grid = np.full((4, 4, 2), 0.25)
    out = _smooth(grid, 10)
    assert out.shape == (10, 10, 2) and np.allclose(out, 0.25)
    step = np.zeros((4, 4, 1))
    step[:, 2:] = 1.0
    row = _smooth(step, 8)[0, :, 0]
    assert row[0] == 0.0 and row[-1] == 1.0 and 0 < row[3] < 1 and 0 < row[4] < 1
