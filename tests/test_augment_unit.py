"""data/crops.py and data/mixing.py, edge by edge: the evaluation crop (its sizes, the one
resampling, the centre it keeps, its description), the random-resized-crop boxes
(torchvision's rule: inside the image, in the scale and ratio asked, its fallback, every
position reachable), the batched resampling against PyTorch's antialiased resize, mirrors
and memory layout; random erasing, mixup and cutmix (the seeded draws, the pasted box and the
soft targets that match it), their order, and progressive resizing. Fast: tiny CPU tensors,
no training.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ddpflow.config import from_dict
from ddpflow.data import crops
from ddpflow.data.crops import EvalCrop, center_crop, crop_resize, eval_resize, eval_sizes
from ddpflow.data.mixing import Recipe, apply, mix, progressive_sizes, random_erase, resize


def _aa(x, size, mode="bilinear"):
    return F.interpolate(x, size=(size, size), mode=mode, antialias=True, align_corners=False)


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- evaluation crop

def test_the_evaluation_resize_is_the_crop_over_seven_eighths():
    assert [eval_resize(s) for s in (224, 32, 7, 16, 24)] == [256, 37, 8, 18, 27]


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_a_stored_margin_is_resized_once_then_the_centre_kept(mode):
    x = torch.rand(2, 3, 40, 40, dtype=torch.float64)
    got = center_crop(x, 32, mode=mode)
    assert got.shape == (2, 3, 32, 32)
    _close(got, _aa(x, 37, mode)[..., 2:34, 2:34])
    # progressive resizing: straight to the epoch's size, from its own /0.875 resize
    _close(center_crop(x, 32, out=24, mode=mode), _aa(x, 27, mode)[..., 1:25, 1:25])
    # an explicit resize side
    _close(center_crop(x, 32, resize=36, mode=mode), _aa(x, 36, mode)[..., 2:34, 2:34])
    if mode == "bicubic":
        assert (center_crop(x, 32, mode=mode) - center_crop(x, 32)).abs().max() > 1e-3


def test_a_stored_image_at_the_resize_side_is_only_cut():
    x = torch.rand(1, 3, 37, 37)
    got = center_crop(x, 32)
    assert torch.equal(got, x[..., 2:34, 2:34]) and got.data_ptr() != x.data_ptr()
    assert got.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()  # a view


def test_without_a_margin_the_whole_image_is_kept_or_resized_to_the_epochs_size():
    x = torch.rand(2, 3, 32, 32, dtype=torch.float64)
    assert center_crop(x, 32) is x
    _close(center_crop(x, 32, out=24), _aa(x, 24))
    _close(center_crop(x, 32, out=24, mode="bicubic"), _aa(x, 24, "bicubic"))
    _close(center_crop(x, 32, resize=36), _aa(x, 36)[..., 2:34, 2:34])


def test_the_evaluation_crop_and_its_description():
    x = torch.rand(1, 3, 40, 40, dtype=torch.float64)
    _close(EvalCrop(28, 36, "bicubic")(x), _aa(x, 36, "bicubic")[..., 4:32, 4:32])
    _close(EvalCrop(32)(x), _aa(x, 37)[..., 2:34, 2:34])
    assert EvalCrop(28, 36, "bicubic").describe() == (
        "resize to 36 (bicubic, antialiased), centre crop 28")
    assert EvalCrop(24).describe() == (
        "resize to 27 (bilinear, antialiased) unless already 24, centre crop 24")


def test_the_evaluation_crop_of_a_config():
    def data(**kw):
        return from_dict({"data": {"image_size": 32, **kw}, "stages": [{"name": "a"}]}).data

    assert eval_sizes(data(eval_crop_size=28, eval_resize_size=36, interpolation="bicubic")
                      ) == EvalCrop(28, 36, "bicubic")
    assert eval_sizes(data()) == EvalCrop(32, None, "bilinear")
    assert eval_sizes(data(eval_resize_size=40)) == EvalCrop(32, 40, "bilinear")


# --------------------------------------------------------------------------- random boxes

def _draw(n, h, w, scale, ratio, seed=0):
    boxes = crops._boxes(n, h, w, scale, ratio, torch.Generator().manual_seed(seed), "cpu")
    assert torch.equal(boxes, boxes.round())  # whole pixels
    left, top, bw, bh = (boxes[:, i].long() for i in range(4))
    return left, top, bw, bh


def _inside(left, top, bw, bh, h, w):
    return bool(((left >= 0) & (top >= 0) & (bw >= 1) & (bh >= 1)
                 & (left + bw <= w) & (top + bh <= h)).all())


def test_boxes_are_inside_the_image_with_the_scale_and_ratio_asked():
    h, w = 16, 24
    left, top, bw, bh = _draw(4000, h, w, (0.1, 0.5), (1.0, 3.0))
    assert _inside(left, top, bw, bh, h, w)
    share, r = (bw * bh).double() / (h * w), bw.double() / bh.double()
    assert 0.08 < share.min() < 0.12 and 0.45 < share.max() < 0.56, (share.min(), share.max())
    assert 0.9 < r.min() < 1.1 and 2.6 < r.max() < 3.4, (r.min(), r.max())  # wide, never tall
    assert abs(r.log().mean() - math.log(3) / 2) < 0.05  # log-uniform ratio
    assert abs(share.mean() - 0.3) < 0.02  # uniform area
    # a box too large on most tries: one of them that fits, never the whole-image fallback
    left, top, bw, bh = _draw(2000, 16, 16, (0.08, 0.5), (0.2, 5.0))
    assert _inside(left, top, bw, bh, 16, 16)
    assert ((bw * bh).double() / 256).max() < 0.6


def test_every_position_of_a_box_is_drawn_independently():
    left, top, bw, bh = _draw(3000, 16, 25, (0.16, 0.16), (1.0, 1.0))  # 8x8 boxes
    assert bool((bw == 8).all() and (bh == 8).all())
    assert set(top.tolist()) == set(range(9)) and set(left.tolist()) == set(range(18))
    assert abs(np.corrcoef(top.numpy(), left.numpy())[0, 1]) < 0.1


@pytest.mark.parametrize("h, w, ratio", [(16, 16, (4.0, 4.0)), (16, 16, (0.25, 0.25))])
def test_boxes_as_thin_as_one_pixel_are_drawn(h, w, ratio):
    left, top, bw, bh = _draw(500, h, w, (1.5 / 256, 3.5 / 256), ratio)
    thin = bh if ratio[0] > 1 else bw
    assert bool((thin == 1).all()) and bool(((bw * bh) <= 4).all())
    assert _inside(left, top, bw, bh, h, w)


@pytest.mark.parametrize("h, w, ratio", [(8, 16, (1.0, 4.0)), (16, 8, (0.25, 1.0))])
def test_boxes_as_long_as_the_image_are_drawn(h, w, ratio):
    left, top, bw, bh = _draw(2000, h, w, (0.5, 0.5), ratio)
    assert _inside(left, top, bw, bh, h, w)
    full = (bw == w) if w > h else (bh == h)
    assert 0 < int(full.sum()) < 400


@pytest.mark.parametrize("h, w, want", [(10, 20, [5, 0, 10, 10]), (20, 10, [0, 5, 10, 10]),
                                        (10, 10, [0, 0, 10, 10])])
def test_when_no_box_fits_the_centre_at_the_nearest_ratio_is_taken(h, w, want):
    """torchvision's fallback: the whole image cut to the nearest allowed ratio, centred."""
    left, top, bw, bh = _draw(4, h, w, (1.0, 1.0), (1.0, 1.0))
    assert all([int(v[i]) for v in (left, top, bw, bh)] == want for i in range(4))
    # the image's own ratio allowed: the whole of it (no box of 1.2 x its area fits)
    left, top, bw, bh = _draw(4, 10, 20, (1.2, 1.2), (0.5, 2.5))
    assert bool((left == 0).all() and (top == 0).all() and (bw == 20).all() and (bh == 10).all())


@pytest.mark.parametrize("h, w, want", [(30, 10, [0, 5, 10, 20]), (10, 30, [5, 0, 20, 10]),
                                        (20, 11, [0, 4, 11, 11]), (11, 20, [4, 0, 11, 11])])
def test_an_image_beyond_the_ratios_falls_back_to_the_nearest_one(h, w, want):
    """Nothing of 1.2 x the area fits: the tall image cut to the tallest ratio allowed (0.5),
    the wide one to the widest (2); an odd margin puts the extra pixel after the box."""
    ratio = (0.5, 2.0) if h * w == 300 else (1.0, 1.0)
    left, top, bw, bh = _draw(3, h, w, (1.2, 1.2), ratio)
    assert all([int(v[i]) for v in (left, top, bw, bh)] == want for i in range(3))


def test_boxes_rounded_to_nothing_are_never_drawn():
    left, top, bw, bh = _draw(2000, 16, 16, (0.2 / 256, 2.5 / 256), (0.25, 4.0))
    assert _inside(left, top, bw, bh, 16, 16)
    assert ((bw * bh) <= 4).float().mean() > 0.9  # a box that fits, not the fallback


# --------------------------------------------------------------------------- resampling

@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("size", [5, 11, 30])
def test_a_box_is_resampled_as_pytorch_resizes_the_box_cut_out(mode, size):
    x = torch.rand(3, 2, 20, 24, dtype=torch.float64)
    boxes = torch.tensor([[3, 2, 13, 9], [0, 0, 24, 20], [10, 7, 14, 13]])
    got = crop_resize(x, boxes, size, mode=mode)
    assert got.shape == (3, 2, size, size)
    for i, (left, top, bw, bh) in enumerate(boxes.tolist()):
        want = _aa(x[i:i + 1, :, top:top + bh, left:left + bw], size, mode)
        _close(got[i:i + 1], want)


def test_the_cubic_filter_is_pytorchs():
    t = torch.tensor([0.0, 0.25, 0.5, 1.0, 1.5, 1.75, 2.0, 2.5, -0.5, -1.5])
    a = -0.5
    want = [1.0, ((a + 2) * 0.25 - (a + 3)) * 0.0625 + 1, ((a + 2) * 0.5 - (a + 3)) * 0.25 + 1,
            0.0, ((a * 1.5 - 5 * a) * 1.5 + 8 * a) * 1.5 - 4 * a,
            ((a * 1.75 - 5 * a) * 1.75 + 8 * a) * 1.75 - 4 * a, 0.0, 0.0]
    want += [want[2], want[4]]
    _close(crops._cubic(t), torch.tensor(want))


def test_mirrored_samples_are_the_mirror_of_their_box():
    x = torch.rand(2, 3, 12, 12, dtype=torch.float64)
    boxes = torch.tensor([[1, 2, 9, 8], [1, 2, 9, 8]])
    plain = crop_resize(x, boxes, 6)
    got = crop_resize(x, boxes, 6, torch.tensor([True, False]))
    _close(got[0], plain[0].flip(-1))
    _close(got[1], plain[1])


def test_the_output_keeps_the_memory_layout_it_was_given():
    x = torch.rand(2, 3, 12, 12)
    boxes = torch.tensor([[0, 0, 12, 12], [2, 2, 8, 8]])
    last = crop_resize(x.contiguous(memory_format=torch.channels_last), boxes, 6)
    assert last.is_contiguous(memory_format=torch.channels_last) and not last.is_contiguous()
    _close(last, crop_resize(x, boxes, 6))
    strided = crop_resize(torch.rand(2, 3, 12, 24)[..., ::2], boxes, 6)  # neither layout
    assert strided.is_contiguous()
    assert crop_resize(x, boxes, 6).is_contiguous()


def test_random_resized_crop_mirrors_half_the_samples_and_uses_the_filter():
    x = torch.rand(1, 1, 8, 8).expand(400, 1, 8, 8).contiguous()
    g = torch.Generator().manual_seed(1)
    out = crops.random_resized_crop(x, 8, (1.0, 1.0), (1.0, 1.0), True, g)
    mirrored = [bool(torch.allclose(out[i], x[0].flip(-1), atol=1e-5)) for i in range(400)]
    same = [bool(torch.allclose(out[i], x[0], atol=1e-5)) for i in range(400)]
    assert all(m != s for m, s in zip(mirrored, same)) and 150 < sum(mirrored) < 250
    out = crops.random_resized_crop(x, 8, (1.0, 1.0), (1.0, 1.0), False, g)
    _close(out, x)
    small = torch.rand(2, 3, 16, 16, dtype=torch.float64)
    for mode in ("bilinear", "bicubic"):
        got = crops.random_resized_crop(small, 7, (1.0, 1.0), (1.0, 1.0), False, g, mode)
        _close(got, _aa(small, 7, mode))


# --------------------------------------------------------------------------- random erasing

def _holes(n=3000, h=40, w=40, p=1.0, seed=0):
    x = torch.rand(n, 2, h, w) + 1.0  # no value is 0 before erasing
    out = random_erase(x, p, torch.Generator().manual_seed(seed))
    hole = out[:, 0] == 0
    assert torch.equal(hole, out[:, 1] == 0) and torch.equal(out[~(out == 0)], x[~(out == 0)])
    rows, cols = hole.any(2), hole.any(1)
    # one rectangle per erased image
    assert torch.equal(hole, rows.unsqueeze(2) & cols.unsqueeze(1))
    on = rows.any(1)
    r = rows[on].float()
    c = cols[on].float()
    eh, ew = r.sum(1), c.sum(1)
    y0 = r.argmax(1).float()
    x0 = c.argmax(1).float()
    return on, y0, x0, eh, ew


def test_erased_boxes_have_torchvisions_area_and_aspect():
    on, y0, x0, eh, ew = _holes()
    assert bool(on.all())
    share, aspect = eh * ew / 1600, eh / ew
    assert 0.015 < share.min() < 0.03 and 0.3 < share.max() < 0.36, (share.min(), share.max())
    big = share > 0.1  # rounding matters little there
    assert 0.27 < aspect[big].min() < 0.4 and 2.7 < aspect[big].max() < 3.6
    assert abs(aspect[big].log().mean()) < 0.1  # log-uniform, around a square


def test_erased_boxes_reach_every_edge_and_are_placed_independently():
    on, y0, x0, eh, ew = _holes()
    assert (y0 == 0).any() and (x0 == 0).any()
    assert (y0 + eh == 40).any() and (x0 + ew == 40).any()
    free = (eh < 36) & (ew < 36)
    py, px = y0[free] / (40 - eh[free]), x0[free] / (40 - ew[free])
    assert abs(np.corrcoef(py.numpy(), px.numpy())[0, 1]) < 0.1
    assert abs(np.corrcoef(py.numpy(), (eh / ew)[free].log().numpy())[0, 1]) < 0.1
    assert abs(np.corrcoef(py.numpy(), (eh * ew)[free].numpy())[0, 1]) < 0.1
    assert 0.45 < py.mean() < 0.55 and 0.45 < px.mean() < 0.55


def test_erasing_chooses_images_with_the_probability_and_apart_from_the_box():
    on, y0, x0, eh, ew = _holes(p=0.3, seed=1)
    assert 0.25 < on.float().mean() < 0.35
    free = (eh < 36) & (ew < 36)
    px = x0[free] / (40 - ew[free])
    py = y0[free] / (40 - eh[free])
    assert 0.42 < px.mean() < 0.58 and 0.42 < py.mean() < 0.58
    x = torch.rand(4, 3, 8, 8) + 1
    assert torch.equal(random_erase(x, 0.0, torch.Generator().manual_seed(0)), x)


def test_a_non_square_image_is_erased_within_its_sides():
    on, y0, x0, eh, ew = _holes(n=2000, h=12, w=40)
    assert bool(on.all()) and bool(((y0 + eh) <= 12).all()) and bool(((x0 + ew) <= 40).all())
    assert (x0 + ew == 40).any() and (y0 + eh == 12).any()
    assert 0.3 < (eh * ew / 480).max() < 0.36


# --------------------------------------------------------------------------- mixup, cutmix

def _onehot(y, n, dtype=torch.float64):
    return F.one_hot(y, n).to(dtype)


def _beta(alpha, seed):
    return float(np.random.default_rng((*seed, 1)).beta(alpha, alpha))


def _cut_box(seed, alpha, h, w, both):
    """Where cutmix pastes: a box of side round(side * sqrt(1 - lam)) centred on a uniform
    pixel, clipped to the image; with mixup also on, a coin first."""
    rng = np.random.default_rng(seed)
    if both and rng.random() >= 0.5:
        return None
    cut = math.sqrt(1 - _beta(alpha, seed))
    ch, cw = round(h * cut), round(w * cut)
    cy, cx = int(rng.integers(0, h)), int(rng.integers(0, w))
    return (max(cy - ch // 2, 0), min(cy + ch - ch // 2, h),
            max(cx - cw // 2, 0), min(cx + cw - cw // 2, w))


def test_mixup_blends_each_sample_with_its_mirror_in_the_batch():
    x = torch.rand(6, 3, 5, 7, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 3, 1, 2])
    for seed in [(0, 1, 2, 3), (5, 0, 1, 0), (7, 2, 0, 1)]:
        lam = _beta(0.4, seed)
        got, soft = mix(x, y, Recipe(mixup_alpha=0.4, num_classes=4), seed)
        _close(got, lam * x + (1 - lam) * x.flip(0))
        _close(soft, lam * _onehot(y, 4) + (1 - lam) * _onehot(y, 4).flip(0))
        assert soft.dtype == torch.float64


def test_the_mixing_weight_follows_its_beta():
    from ddpflow.data.mixing import _lam

    def draws(alpha):
        return np.array([_lam(alpha, (s, 1)) for s in range(400)])

    spread, middle = draws(0.2), draws(8.0)
    assert ((spread < 0.05) | (spread > 0.95)).mean() > 0.4
    assert 0.1 < middle.min() and middle.max() < 0.9
    assert abs(spread.mean() - 0.5) < 0.06 and abs(middle.mean() - 0.5) < 0.03
    assert _lam(0.4, (3, 1)) == float(np.random.default_rng((3, 1)).beta(0.4, 0.4))


@pytest.mark.parametrize("h, w", [(12, 20), (9, 9)])
def test_cutmix_pastes_the_box_of_its_seed_and_the_targets_match_it(h, w):
    x = torch.rand(4, 2, h, w, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 1])
    r = Recipe(cutmix_alpha=1.0, num_classes=3)
    clipped = 0
    for s in range(40):
        seed = (s, 3, 1)
        y0, y1, x0, x1 = _cut_box(seed, 1.0, h, w, False)
        clipped += (y0 == 0 or x0 == 0 or y1 == h or x1 == w)
        got, soft = mix(x, y, r, seed)
        want = x.clone()
        want[:, :, y0:y1, x0:x1] = x.flip(0)[:, :, y0:y1, x0:x1]
        assert torch.equal(got, want), seed
        lam = 1 - (y1 - y0) * (x1 - x0) / (h * w)
        _close(soft, lam * _onehot(y, 3) + (1 - lam) * _onehot(y, 3).flip(0))
    assert clipped


def test_with_both_on_each_batch_takes_one_by_its_seed():
    x = torch.rand(4, 1, 10, 10, dtype=torch.float64)
    y = torch.tensor([0, 1, 1, 0])
    r = Recipe(mixup_alpha=0.5, cutmix_alpha=1.0, num_classes=2)
    kinds = []
    for s in range(30):
        seed = (s, 0, 0)
        box = _cut_box(seed, 1.0, 10, 10, True)
        got, soft = mix(x, y, r, seed)
        if box is None:
            lam = _beta(0.5, seed)
            _close(got, lam * x + (1 - lam) * x.flip(0))
        else:
            y0, y1, x0, x1 = box
            want = x.clone()
            want[:, :, y0:y1, x0:x1] = x.flip(0)[:, :, y0:y1, x0:x1]
            assert torch.equal(got, want)
            lam = 1 - (y1 - y0) * (x1 - x0) / 100
        _close(soft, lam * _onehot(y, 2) + (1 - lam) * _onehot(y, 2).flip(0))
        kinds.append(box is None)
    assert 5 < sum(kinds) < 25


def test_cutmix_of_integer_images_gives_float_targets():
    x = torch.randint(0, 255, (2, 3, 6, 6), dtype=torch.uint8)
    got, soft = mix(x, torch.tensor([0, 1]), Recipe(cutmix_alpha=1.0, num_classes=2), (1, 2))
    assert got.dtype == torch.uint8 and soft.dtype == torch.float32
    _close(soft.sum(1), torch.ones(2))


def test_the_recipe_erases_then_mixes_and_only_what_is_on():
    x = torch.rand(4, 3, 8, 8, dtype=torch.float64) + 1
    y = torch.tensor([0, 1, 2, 0])
    seed = (1, 2, 3)
    r = Recipe(random_erasing=1.0, mixup_alpha=0.4, num_classes=3)
    got, soft = apply(x, y, r, torch.Generator().manual_seed(4), seed)
    erased = random_erase(x, 1.0, torch.Generator().manual_seed(4))
    want, want_soft = mix(erased, y, r, seed)
    assert torch.equal(got, want) and torch.equal(soft, want_soft)
    got, same = apply(x, y, Recipe(random_erasing=1.0, num_classes=3),
                      torch.Generator().manual_seed(4), seed)
    assert torch.equal(got, erased) and same is y
    got, soft = apply(x, y, Recipe(cutmix_alpha=1.0, num_classes=3),
                      torch.Generator().manual_seed(4), seed)
    assert torch.equal((got, soft)[1], mix(x, y, Recipe(cutmix_alpha=1.0, num_classes=3),
                                           seed)[1])
    got, same = apply(x, y, Recipe(num_classes=3), torch.Generator().manual_seed(4), seed)
    assert got is x and same is y


def test_a_recipe_is_active_when_any_option_is_on():
    assert not Recipe(num_classes=3).active
    assert Recipe(random_erasing=0.5).active and Recipe(mixup_alpha=0.2).active
    assert Recipe(cutmix_alpha=1.0).active


# --------------------------------------------------------------------------- progressive

def test_progressive_sizes_run_from_the_first_to_the_last_epoch():
    size_at = progressive_sizes({"start_size": 12, "end_size": 16}, 5)
    assert [size_at(e) for e in range(7)] == [12, 13, 14, 15, 16, 16, 16]
    assert [progressive_sizes({"start_size": 10, "end_size": 20}, 2)(e) for e in range(3)] == [
        10, 20, 20]
    assert progressive_sizes({"start_size": 24, "end_size": 32}, 1)(0) == 24
    assert [progressive_sizes({"start_size": 32, "end_size": 16}, 3)(e) for e in range(3)] == [
        32, 24, 16]


def test_resize_resamples_to_a_square_antialiased_when_shrinking():
    x = torch.rand(2, 3, 16, 16, dtype=torch.float64)
    assert resize(x, 16) is x
    _close(resize(x, 11), _aa(x, 11))
    _close(resize(x, 21), F.interpolate(x, size=(21, 21), mode="bilinear",
                                        align_corners=False))
    wide = torch.rand(2, 3, 12, 16, dtype=torch.float64)
    _close(resize(wide, 16), F.interpolate(wide, size=(16, 16), mode="bilinear",
                                           align_corners=False))
    narrow = torch.rand(2, 3, 16, 12, dtype=torch.float64)  # the height is the size already
    _close(resize(narrow, 16), F.interpolate(narrow, size=(16, 16), mode="bilinear",
                                             align_corners=False))
    tall = torch.rand(2, 3, 20, 16, dtype=torch.float64)  # the height shrinks
    _close(resize(tall, 16), _aa(tall, 16))


def test_a_tiny_image_always_loses_at_least_one_pixel():
    on, y0, x0, eh, ew = _holes(n=500, h=4, w=4)
    assert bool(on.all())  # never an empty box
    assert (ew == 1).any() and (eh == 1).any() and (ew * eh >= 4).any()


def test_each_erased_box_comes_from_its_own_column_of_the_steps_draws():
    """The box of image i from the generator's 6 x b uniforms, column i: area share
    0.02 + 0.31 u0, aspect exp(log 0.3 + log(11) u1), top and left u2, u3 of the free
    rows/columns, erased when u4 < p (so both loaders, and a resume, erase the same)."""
    b, h, w, p = 64, 10, 14, 0.7
    x = torch.rand(b, 1, h, w) + 1
    got = random_erase(x, p, torch.Generator().manual_seed(5)) == 0
    u = torch.rand(6, b, generator=torch.Generator().manual_seed(5)).double().tolist()
    for i in range(b):
        area = h * w * (0.02 + 0.31 * u[0][i])
        aspect = math.exp(math.log(0.3) + math.log(3.3 / 0.3) * u[1][i])
        eh = min(max(round(math.sqrt(area * aspect)), 1), h)
        ew = min(max(round(math.sqrt(area / aspect)), 1), w)
        y0, x0 = math.floor(u[2][i] * (h - eh + 1)), math.floor(u[3][i] * (w - ew + 1))
        want = torch.zeros(h, w, dtype=torch.bool)
        if u[4][i] < p:
            want[y0:y0 + eh, x0:x0 + ew] = True
        assert torch.equal(got[i, 0], want), i
