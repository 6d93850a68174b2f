"""JPEG shards: the prepared format for datasets bigger than memory (`data.encoding: jpeg`).

One split is
    <split>-00000.jpgs, <split>-00001.jpgs, ...   JPEG files back to back (data.shard_mb each)
    <split>_index.npy   int64 [N, 4]: shard number, byte offset, byte length and CRC-32 of
                        each image (a flipped bit inside a shard is a bad sample, not noise)
    <split>_labels.npy  int64 [N]
Images are written in the split's order, so the index is sorted by (shard, offset): a batch
whose indices are read in ascending order reads each shard front to back. Every stored image
is a store_size square (the same centre square the raw format keeps), so decoded batches
stack into the uint8 NHWC arrays the raw format holds, and the recipe runs on them unchanged.

`JpegImages` is the array-like view the loaders read: `images[idx]` decodes (on the CPU,
Pillow's libjpeg-turbo); `fetch(idx)` also reports what could not be decoded, so a damaged
shard or index entry costs its samples, not the run (data.max_bad_fraction), and
`decode_cuda` decodes a batch of encoded images on the GPU (nvJPEG, unverified here).
"""

from __future__ import annotations

import io
import os
import warnings
import zlib
from pathlib import Path

import numpy as np

from ddpflow.core.errors import UserError

SUFFIX = ".jpgs"
STATS_SAMPLE = 10_000  # images decoded for mean/std (evenly spaced over the training split)


def encode(image: np.ndarray, quality: int) -> bytes:
    """uint8 HWC (3 channels) -> JPEG bytes (4:2:0 chroma, baseline: what every decoder,
    nvJPEG included, reads fastest)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="JPEG", quality=quality, subsampling=2)
    return buf.getvalue()


def decode(data) -> np.ndarray:
    """JPEG bytes -> uint8 HWC (RGB) with Pillow. Raises on anything that is not a whole JPEG."""
    from PIL import Image

    with Image.open(io.BytesIO(bytes(data))) as im:
        if im.format != "JPEG":
            raise ValueError(f"not a JPEG ({im.format})")
        im.load()  # a truncated stream raises here (Pillow does not pad it with grey)
        return np.asarray(im.convert("RGB"), dtype=np.uint8)


def decode_many(buffers: list) -> list[np.ndarray]:
    """Decode a batch on the CPU: torchvision's decode_jpeg (libjpeg-turbo without Pillow's
    per-image overhead: 1.5-2.4x faster here, the same pixels) where torchvision imports,
    else Pillow. Raises if any of them fails (the caller then decodes one by one)."""
    from ddpflow.core import lazydynamo

    lazydynamo.defer()  # `import torchvision` would import torch._dynamo (seconds) otherwise
    try:
        import torch
        from torchvision.io import ImageReadMode, decode_jpeg
    except ImportError:  # e.g. a CPU-only torch without a matching torchvision
        return [decode(b) for b in buffers]
    # torchvision 0.29 warns at every call that TorchCodec will take over its decoders
    warnings.filterwarnings("ignore", "The image decoding and encoding capabilities",
                            DeprecationWarning)
    chw = decode_jpeg([torch.from_numpy(np.array(b)) for b in buffers], mode=ImageReadMode.RGB)
    return [t.permute(1, 2, 0).numpy() for t in chw]


def shard_name(split: str, k: int) -> str:
    return f"{split}-{k:05d}{SUFFIX}"


class ShardWriter:
    """Appends encoded images of one split to shards of about `shard_bytes`; `close()`
    writes the index and labels (the caller's meta.json, written last, makes them count)."""

    def __init__(self, folder: Path, split: str, shard_bytes: int):
        self.folder, self.split, self.shard_bytes = Path(folder), split, max(1, shard_bytes)
        self.index: list[tuple[int, int, int, int]] = []
        self.labels: list[int] = []
        self.shard, self.offset, self.file = -1, 0, None
        self._next_shard()

    def _next_shard(self) -> None:
        if self.file:
            self._seal()
        self.shard += 1
        self.offset = 0
        self.file = open(self.folder / shard_name(self.split, self.shard), "wb")

    def _seal(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()

    def append(self, data: bytes, label: int) -> None:
        if self.offset and self.offset + len(data) > self.shard_bytes:
            self._next_shard()
        self.file.write(data)
        self.index.append((self.shard, self.offset, len(data), zlib.crc32(data)))
        self.labels.append(int(label))
        self.offset += len(data)

    def close(self) -> int:
        self._seal()
        index = np.array(self.index, dtype=np.int64).reshape(-1, 4)
        np.save(self.folder / f"{self.split}_index.npy", index)
        np.save(self.folder / f"{self.split}_labels.npy", np.array(self.labels, np.int64))
        return len(self.labels)


def write_split(folder: Path, split: str, images: np.ndarray, labels: np.ndarray,
                quality: int, shard_bytes: int) -> None:
    """Encode a split held as arrays (synthetic, CIFAR-like archives, materialised data)."""
    w = ShardWriter(folder, split, shard_bytes)
    for x, y in zip(images, labels):
        w.append(encode(np.ascontiguousarray(x), quality), y)
    w.close()


class JpegImages:
    """The images of one split as an array-like of uint8 [N, S, S, 3]: indexing decodes."""

    def __init__(self, folder: Path, split: str, shape: tuple[int, ...],
                 recorded: dict[str, int]):
        self.folder, self.split = Path(folder), split
        self.index = np.load(self.folder / f"{split}_index.npy", mmap_mode="r")
        self.shape = (len(self.index), *shape)
        self.dtype = np.dtype(np.uint8)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64))  # decoded: what a loader holds
        names = sorted(n for n in recorded if n.startswith(f"{split}-") and n.endswith(SUFFIX))
        self.shards = [self.folder / n for n in names]
        # a shard shorter than meta.json says (truncated on a shared filesystem): the images
        # past its end are unreadable samples, reported like a bad index entry
        self.sizes = [min(p.stat().st_size, recorded[p.name]) if p.exists() else 0
                      for p in self.shards]
        self._maps: dict[int, np.memmap] = {}  # opened per process (DataLoader workers fork)

    def __len__(self) -> int:
        return self.shape[0]

    def __getstate__(self):  # to a spawned worker: paths and index, not open mappings
        return {**self.__dict__, "_maps": {}}

    def _map(self, k: int):
        key = (os.getpid(), k)
        if key not in self._maps:
            self._maps[key] = (np.memmap(self.shards[k], np.uint8, mode="r")
                               if self.sizes[k] else np.zeros(0, np.uint8))
        return self._maps[key]

    def where(self, i: int) -> str:
        k, off = (int(v) for v in self.index[i][:2])
        name = self.shards[k].name if 0 <= k < len(self.shards) else f"shard #{k}"
        return f"{self.split} sample {i} ({name} @ {off})"

    def encoded(self, i: int) -> np.ndarray:
        """The stored bytes of image i; ValueError when its index entry points outside a
        shard or the bytes fail their CRC-32."""
        k, off, n, crc = (int(v) for v in self.index[i])
        if not 0 <= k < len(self.shards) or off < 0 or n <= 0 or off + n > self.sizes[k]:
            have = self.sizes[k] if 0 <= k < len(self.sizes) else 0
            raise ValueError(f"index entry (shard {k}, offset {off}, {n} bytes) lies outside "
                             f"the shard's {have} bytes")
        data = self._map(k)[off:off + n]
        if zlib.crc32(data) != crc:
            raise ValueError("bytes do not match their CRC-32 (damaged on disk)")
        return data

    def read(self, idx: list[int]) -> tuple[dict[int, np.ndarray], list[tuple[int, str]]]:
        """The stored bytes of idx, read in ascending file order: ({position in idx: bytes},
        [(index, reason)] of the entries that fail their bounds or CRC check)."""
        bufs: dict[int, np.ndarray] = {}
        bad: list[tuple[int, str]] = []
        for pos in sorted(range(len(idx)), key=lambda p: tuple(self.index[idx[p]][:2])):
            try:
                bufs[pos] = self.encoded(idx[pos])
            except ValueError as e:
                bad.append((idx[pos], f"{self.where(idx[pos])}: {e}"))
        return bufs, bad

    def fetch(self, idx) -> tuple[np.ndarray, list[int], list[tuple[int, str]]]:
        """Decode idx, read in ascending file order: (images of the readable ones in idx's
        order, their positions in idx, [(index, reason)] of the others)."""
        idx = [int(i) for i in np.asarray(idx).reshape(-1)]
        bufs, bad = self.read(idx)
        kept = sorted(bufs)
        try:
            decoded = dict(zip(kept, decode_many([bufs[p] for p in kept])))
        except Exception:  # noqa: BLE001 - one bad image fails the batch: find it alone
            decoded = {}
            for p in kept:
                try:
                    decoded[p] = decode(bufs[p])
                except Exception as e:  # noqa: BLE001 - any undecodable image is a bad sample
                    bad.append((idx[p], f"{self.where(idx[p])}: {type(e).__name__}: {e}"))
        for p, img in list(decoded.items()):
            if img.shape != self.shape[1:]:
                bad.append((idx[p], f"{self.where(idx[p])}: decoded to {img.shape}, "
                                    f"expected {self.shape[1:]}"))
                del decoded[p]
        kept = sorted(decoded)
        images = (np.stack([decoded[p] for p in kept]) if kept
                  else np.zeros((0, *self.shape[1:]), np.uint8))
        return images, kept, bad

    def __getitem__(self, key) -> np.ndarray:
        """Decoded images; any unreadable one is an error (loaders use fetch())."""
        idx = np.arange(len(self))[key] if isinstance(key, slice) else key
        images, kept, bad = self.fetch(idx)
        if bad:
            raise UserError(f"unreadable {bad[0][1]}; the prepared data is damaged: run "
                            f"`ddpflow prepare --force`")
        return images if np.ndim(idx) else images[0]

    def __array__(self, dtype=None, copy=None):
        out = self[:]
        return out if dtype is None else out.astype(dtype)


def decode_cuda(buffers: list[np.ndarray], device
                ) -> "tuple[object, list[int], list[tuple[int, str]]]":
    """A batch of encoded images decoded on the GPU in one call (nvJPEG through torchvision):
    (uint8 NHWC tensor on device, positions kept, [(position, reason)] of the others). One
    bad image makes the batched call fail; then each is decoded alone to find it."""
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    data = [torch.from_numpy(np.array(b)) for b in buffers]
    try:
        chw = decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
        kept, bad = list(range(len(data))), []
    except RuntimeError:
        chw, kept, bad = [], [], []
        for i, d in enumerate(data):
            try:
                chw.append(decode_jpeg(d, mode=ImageReadMode.RGB, device=device))
                kept.append(i)
            except RuntimeError as e:
                bad.append((i, f"{type(e).__name__}: {e}"))
    if not chw:
        return None, kept, bad
    return torch.stack(chw).permute(0, 2, 3, 1).contiguous(), kept, bad
