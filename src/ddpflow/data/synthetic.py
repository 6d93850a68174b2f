"""A deterministic synthetic image-classification set that is learnable but not trivial.

Each class is drawn from two smooth colour templates (its "modes": a 4x4 grid of colours,
upsampled and blurred). Classes come in pairs that share most of their template (a
common base plus a smaller part of their own), so neighbours are easy to confuse. A
sample is one of its class's modes under nuisance variation: a random shift (up to 1/8
of the side, wrapping), a mirror image, per-channel gain, a grey occluding box and pixel
noise. A small CNN climbs over several epochs and ends below perfect accuracy, and
augmentation (crops, flips, erasing, mixup) visibly matters, which is what the default
run is there to show. `difficulty` 0 gives the old easy set (one mode, no pairs, no
occluder), kept for tests that need a quick learner.
"""

from __future__ import annotations

import numpy as np

SPLIT_STREAMS = {"train": 1, "val": 2, "test": 3}


def _smooth(grid: np.ndarray, size: int) -> np.ndarray:
    """[..., 4, 4, C] colour grids -> [..., size, size, C], block-upsampled then box-blurred
    (3x3) so that classes differ in colour layout, not in sharp edges."""
    reps = -(-size // 4)
    up = grid.repeat(reps, axis=-3).repeat(reps, axis=-2)[..., :size, :size, :]
    pad = np.pad(up, [(0, 0)] * (up.ndim - 3) + [(1, 1), (1, 1), (0, 0)], mode="edge")
    return sum(pad[..., i:i + size, j:j + size, :] for i in range(3) for j in range(3)) / 9.0


def _templates(rng: np.random.Generator, num_classes: int, size: int, channels: int,
               difficulty: float) -> np.ndarray:
    """[num_classes, modes, size, size, channels] in about 0..1."""
    if difficulty == 0:
        grid = rng.uniform(0.15, 0.85, size=(num_classes, 1, 4, 4, channels))
        return _smooth(grid, size)
    pairs = rng.uniform(0.15, 0.85, size=((num_classes + 1) // 2, 1, 4, 4, channels))
    own = rng.uniform(0.15, 0.85, size=(num_classes, 2, 4, 4, channels))
    shared = 0.5 * difficulty  # the share of a template its pair neighbour has too
    grid = shared * pairs[np.arange(num_classes) // 2] + (1 - shared) * own
    return _smooth(grid, size)


def generate(n: int, num_classes: int, size: int, channels: int, seed: int, split: str,
             difficulty: float = 1.0):
    """n images uint8 [n, size, size, channels] and int64 labels, reproducible from seed;
    each split draws from its own stream of the same distribution."""
    templates = _templates(np.random.default_rng(seed), num_classes, size, channels,
                           difficulty)
    rng = np.random.default_rng([seed, SPLIT_STREAMS.get(split, 2)])
    labels = np.arange(n) % num_classes
    rng.shuffle(labels)
    images = np.empty((n, size, size, channels), dtype=np.uint8)
    for i in range(0, n, 512):
        y = labels[i:i + 512]
        x = templates[y, rng.integers(0, templates.shape[1], size=len(y))]
        images[i:i + 512] = _nuisance(x, rng, difficulty)
    return images, labels.astype(np.int64)


def _nuisance(x: np.ndarray, rng: np.random.Generator, difficulty: float) -> np.ndarray:
    """Per-sample shift, mirror, gain, occluder and noise of a chunk [b, s, s, c] in 0..1."""
    b, s, _, c = x.shape
    x = x * rng.uniform(0.7, 1.3, size=(b, 1, 1, 1))  # brightness
    if difficulty == 0:
        shift = rng.integers(-2, 3, size=2)
        x = np.roll(x, tuple(int(v) for v in shift), axis=(1, 2))
        return np.clip((x + rng.normal(0.0, 0.3, size=x.shape)) * 255.0, 0, 255).astype(np.uint8)
    x = x * rng.uniform(1 - 0.25 * difficulty, 1 + 0.25 * difficulty, size=(b, 1, 1, c))
    m = max(1, s // 8)
    rows = (np.arange(s)[None, :] - rng.integers(-m, m + 1, size=(b, 1))) % s  # [b, s]
    cols = (np.arange(s)[None, :] - rng.integers(-m, m + 1, size=(b, 1))) % s
    mirror = rng.random(b) < 0.5
    cols[mirror] = cols[mirror, ::-1]
    x = x[np.arange(b)[:, None, None], rows[:, :, None], cols[:, None, :]]
    # a grey box over part of the image (half of the samples), up to a third of the side
    occ = rng.random(b) < 0.5 * difficulty
    h = rng.integers(s // 6 + 1, s // 3 + 2, size=b)
    top, left = rng.integers(0, s - h + 1), rng.integers(0, s - h + 1)
    for j in np.flatnonzero(occ):
        x[j, top[j]:top[j] + h[j], left[j]:left[j] + h[j]] = rng.uniform(0.3, 0.7)
    x = x + rng.normal(0.0, 0.3 + 0.1 * difficulty, size=x.shape)
    return np.clip(x * 255.0, 0, 255).astype(np.uint8)
