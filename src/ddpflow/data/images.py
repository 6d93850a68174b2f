"""Image files -> 8-bit pixels, the one way: prepare's image folders (imagefolder.decode_file)
and predict / evaluate --images (inference/common.decode) both read files through `load`.

Every mode is converted faithfully or the file is refused with a one-line reason (`BadImage`;
prepare skips and lists it, predict writes it in the error column):

    16-bit (I;16, I;16B, I;16L, I)  value / 257, rounded: 0..65535 -> 0..255 ("I" must hold
                                    0..65535: a 16-bit PNG opened by an older Pillow)
    float (F)                       values in 0..1 x 255, in 0..255 as they are; any other
                                    range, NaN or inf is refused (a per-image min-max would
                                    give the same scene another brightness in each file)
    palette (P, PA)                 through RGBA (its transparency), then as RGBA below
    alpha (LA, RGBA, PA)            dropped: the colour stored under it is kept, as
                                    torchvision's and Keras's loaders keep it, so a model
                                    trained here sees what it would see there
    CMYK, YCbCr, 1, RGBX, ...       PIL's conversion to RGB (or L)
    EXIF orientation                applied (ImageOps.exif_transpose): as a viewer shows it
    multi-frame (GIF, TIFF, APNG)   the first frame
    > PIL.Image.MAX_IMAGE_PIXELS    refused, a possible decompression bomb, before decoding
then L (data.grayscale) or RGB.
"""

from __future__ import annotations

import warnings

import numpy as np

SIXTEEN_BIT = ("I;16", "I;16B", "I;16L", "I;16N", "I")


class BadImage(Exception):
    """A file that is an image but one ddpflow refuses to convert (the reason is the text)."""


def load(path, grayscale: bool):
    """The file's first frame, upright, as a PIL image of mode L (grayscale) or RGB."""
    from PIL import Image, ImageOps

    with warnings.catch_warnings():  # over the limit: a refusal, never a warning or a hang
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            with Image.open(path) as im:
                im.load()  # the first frame (Image.open stays on frame 0)
                try:
                    im = ImageOps.exif_transpose(im)
                except Exception:  # noqa: BLE001 - a damaged EXIF block: the pixels as stored
                    pass
                return _eight_bit(im, grayscale)
        except (Image.DecompressionBombWarning, Image.DecompressionBombError) as e:
            raise BadImage(f"too many pixels ({e}); shrink the image, or raise "
                           f"PIL.Image.MAX_IMAGE_PIXELS in your own code if it is "
                           f"trusted") from None


def _eight_bit(im, grayscale: bool):
    from PIL import Image

    if im.mode in SIXTEEN_BIT:
        a = np.asarray(im).astype(np.int64)
        if a.size and (a.min() < 0 or a.max() > 65535):
            raise BadImage(f"32-bit integer pixels span {a.min()}..{a.max()}, outside "
                           f"0..65535; save it as an 8- or 16-bit image")
        im = Image.fromarray(((a + 128) // 257).astype(np.uint8), "L")
    elif im.mode == "F":
        a = np.asarray(im, dtype=np.float64)
        if not np.isfinite(a).all():
            raise BadImage("float pixels include NaN or infinity")
        lo, hi = (float(a.min()), float(a.max())) if a.size else (0.0, 0.0)
        if lo < 0 or hi > 255:
            raise BadImage(f"float pixels span {lo:g}..{hi:g}, neither 0..1 nor 0..255; save "
                           f"it as an 8- or 16-bit image")
        scale = 255.0 if hi <= 1 else 1.0
        im = Image.fromarray(np.rint(a * scale).astype(np.uint8), "L")
    if im.mode in ("P", "PA"):
        im = im.convert("RGBA")  # applies the palette's transparency, dropped just below
    if im.mode not in ("1", "L", "LA", "RGB", "RGBA"):
        im = im.convert("RGB")  # CMYK, YCbCr, RGBX, RGBa, LAB (refused by PIL), ...
    return im.convert("L" if grayscale else "RGB")


def fitted(path, size: int, grayscale: bool) -> np.ndarray:
    """uint8 [size, size, channels]: the short side resized to size, the centre square kept."""
    from PIL import Image, ImageOps

    im = ImageOps.fit(load(path, grayscale), (size, size), Image.BILINEAR)
    arr = np.asarray(im, dtype=np.uint8)
    return arr[..., None] if arr.ndim == 2 else arr


def reason(e: BaseException) -> str:
    """One line for a file that could not be read."""
    text = " ".join(str(e).split())
    return text if isinstance(e, BadImage) else f"{type(e).__name__}: {text}"
