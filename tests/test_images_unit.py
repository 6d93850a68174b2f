"""data/images.py, mode by mode at its edges: 16-bit pixels rounded to 8 bits exactly and
refused outside 0..65535, float pixels in 0..1 or 0..255 and refused outside, YCbCr and
palette images through the conversions the module names, and a damaged EXIF block leaving
the pixels as stored. Real PIL images, in memory and in files. Fast."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image, ImageOps

from ddpflow.data.images import BadImage, _eight_bit, load


def _pixels(im, grayscale=True) -> list:
    return np.asarray(_eight_bit(im, grayscale)).ravel().tolist()


def test_sixteen_bit_pixels_round_to_the_nearest_eight_bit_value():
    a = np.array([[0, 128, 129, 385, 386, 65535]], dtype=np.int32)
    # v / 257 rounded: 128 -> 0.498 -> 0, 129 -> 0.502 -> 1, 385 -> 1.498 -> 1, 386 -> 2
    assert _pixels(Image.fromarray(a, "I")) == [0, 0, 1, 1, 2, 255]


@pytest.mark.parametrize("value", [-1, 65536])
def test_integer_pixels_outside_sixteen_bits_are_refused(value):
    a = np.array([[0, value]], dtype=np.int32)
    with pytest.raises(BadImage) as e:
        _eight_bit(Image.fromarray(a, "I"), True)
    assert str(e.value) == (f"32-bit integer pixels span {min(0, value)}..{max(0, value)}, "
                            f"outside 0..65535; save it as an 8- or 16-bit image")


@pytest.mark.parametrize("values, want", [
    ([0.0, 0.5, 1.0], [0, 128, 255]),  # 0..1: scaled
    ([0.0, 1.5], [0, 2]),  # above 1: 0..255, as they are
    ([0.0, 1.5, 255.0], [0, 2, 255]),
])
def test_float_pixels_in_either_range(values, want):
    assert _pixels(Image.fromarray(np.array([values], dtype=np.float32), "F")) == want


@pytest.mark.parametrize("values, span", [([-0.5, 1.0], "-0.5..1"), ([0.0, 255.5], "0..255.5")])
def test_float_pixels_outside_both_ranges_are_refused(values, span):
    with pytest.raises(BadImage) as e:
        _eight_bit(Image.fromarray(np.array([values], dtype=np.float32), "F"), True)
    assert str(e.value) == (f"float pixels span {span}, neither 0..1 nor 0..255; save it as an "
                            f"8- or 16-bit image")


def test_ycbcr_is_converted_through_rgb():
    """Grayscale of a YCbCr image is the RGB image's (PIL's direct YCbCr -> L takes Y as it
    is, one level apart here)."""
    im = Image.new("YCbCr", (2, 2), (100, 90, 200))
    assert _pixels(im) == np.asarray(im.convert("RGB").convert("L")).ravel().tolist()
    assert _pixels(im) != np.asarray(im.convert("L")).ravel().tolist()


def test_a_palette_image_keeps_its_colours(tmp_path):
    p = Image.new("P", (2, 1))
    p.putpalette([255, 0, 0, 0, 255, 0] + [0] * 762)
    p.putpixel((1, 0), 1)
    p.info["transparency"] = 0
    p.save(tmp_path / "p.png")
    assert np.asarray(load(tmp_path / "p.png", False)).tolist() == [[[255, 0, 0], [0, 255, 0]]]


def test_a_damaged_exif_block_leaves_the_pixels_as_stored(tmp_path, monkeypatch):
    """An EXIF block Pillow cannot apply (its parser raises on some damaged files): the
    image is still read, upright as stored. (The fault is injected: no file at hand makes
    this Pillow raise.)"""
    Image.fromarray(np.array([[10, 20], [30, 40]], dtype=np.uint8), "L").save(tmp_path / "a.png")

    def damaged(_im):
        raise SyntaxError("not a TIFF file (header b'garbage')")

    monkeypatch.setattr(ImageOps, "exif_transpose", damaged)
    assert np.asarray(load(tmp_path / "a.png", True)).tolist() == [[10, 20], [30, 40]]
