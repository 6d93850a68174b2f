"""Readers for the standard files users already have: CIFAR python batches, MNIST IDX.

Nothing is downloaded. Official MD5 sums (as published with the datasets) are
checked when known and `data.verify_checksum` is on.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import pickle
import struct
import tarfile
import zlib
from pathlib import Path

import numpy as np

from ddpflow.core.errors import UserError

# Official MD5 sums of the files inside the CIFAR "python version" archives.
CIFAR = {
    "cifar10": {
        "folder": "cifar-10-batches-py",
        "train": ["data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5"],
        "test": ["test_batch"],
        "meta": ("batches.meta", b"label_names"),
        "label_key": b"labels",
        "md5": {
            "data_batch_1": "c99cafc152244af753f735de768cd75f",
            "data_batch_2": "d4bba439e000b95fd0a9bffe97cbabec",
            "data_batch_3": "54ebc095f3ab1f0389bbae665268c751",
            "data_batch_4": "634d18415352ddfa80567beed471001a",
            "data_batch_5": "482c414d41f54cd18b22e5b47cb7c3cb",
            "test_batch": "40351d587109b95175f43aff81a1287e",
            "batches.meta": "5ff9c542aee3614f3951f8cda6e48888",
        },
    },
    "cifar100": {
        "folder": "cifar-100-python",
        "train": ["train"],
        "test": ["test"],
        "meta": ("meta", b"fine_label_names"),
        "label_key": b"fine_labels",
        "md5": {
            "train": "16019d7e3df5f24257cddd939b257f8d",
            "test": "f0ef6b0ae62326f3e7ffdfab6717acfc",
            "meta": "7973b15100ade9c7d40fb424638fde48",
        },
    },
}

# Official MD5 sums of the gzipped IDX files.
IDX_MD5 = {
    "mnist": {
        "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
        "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
        "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
        "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
    },
    "fashion_mnist": {
        "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
        "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
        "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
        "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
    },
}
FASHION_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                   "Sneaker", "Bag", "Ankle boot"]


def _check_md5(name: str, blob: bytes, expected: str | None, verify: bool, report: dict) -> None:
    if expected is None:
        report[name] = "no official checksum known"
        return
    if not verify:
        report[name] = "not checked (data.verify_checksum: false)"
        return
    if hashlib.md5(blob).hexdigest() != expected:
        raise UserError(f"{name} fails its official MD5 checksum: the file is corrupt, truncated "
                        f"or not the official release. Replace it, or set "
                        f"data.verify_checksum: false to use it anyway")
    report[name] = "official MD5 verified"


# --------------------------------------------------------------------------- CIFAR
def _cifar_members(path: Path, spec: dict) -> dict[str, bytes]:
    wanted = set(spec["train"] + spec["test"] + [spec["meta"][0]])
    found: dict[str, bytes] = {}
    if path.is_dir():
        folder = path / spec["folder"] if (path / spec["folder"]).is_dir() else path
        for name in wanted:
            if (folder / name).is_file():
                found[name] = (folder / name).read_bytes()
    else:
        try:
            with tarfile.open(path, "r:*") as tar:
                for m in tar:
                    base = m.name.rsplit("/", 1)[-1]
                    if m.isfile() and base in wanted:
                        found[base] = tar.extractfile(m).read()
        except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
            raise UserError(f"cannot read archive {path}: it is truncated or corrupt ({e}); "
                            f"download the official archive again") from None
    missing = sorted(wanted - set(found))
    if missing:
        raise UserError(f"{path} lacks {', '.join(missing)}: expected the official CIFAR "
                        f"'python version' archive or its extracted folder '{spec['folder']}'")
    return found


class _DataOnlyUnpickler(pickle.Unpickler):
    """Unpickles what the official CIFAR files hold (dicts, lists, bytes, numbers, numpy
    arrays) and nothing else: a dataset file is data, never code, even with
    verify_checksum: false."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"),
               ("numpy._core.multiarray", "_reconstruct"), ("numpy", "ndarray"),
               ("numpy", "dtype")}

    def find_class(self, module: str, name: str):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused to load {module}.{name}: not dataset content")


def _unpickle(name: str, blob: bytes) -> dict:
    try:
        return _DataOnlyUnpickler(io.BytesIO(blob), encoding="bytes").load()
    except pickle.UnpicklingError as e:
        raise UserError(f"CIFAR file {name} is not plain data ({e}); it is not an official "
                        f"CIFAR file: replace it") from None
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad file
        raise UserError(f"CIFAR file {name} cannot be read ({type(e).__name__}); "
                        f"it is truncated or corrupt") from None


def read_cifar(source: str, path: Path, verify: bool):
    """({train|test: (images NHWC uint8, labels)} of the official files, class names,
    checksum report)."""
    spec = CIFAR[source]
    members = _cifar_members(path, spec)
    report: dict[str, str] = {}
    for name, blob in members.items():
        _check_md5(name, blob, spec["md5"].get(name), verify, report)
    meta = _unpickle(spec["meta"][0], members[spec["meta"][0]])
    classes = [c.decode() if isinstance(c, bytes) else str(c) for c in meta[spec["meta"][1]]]
    splits = {}
    for split in ("train", "test"):
        xs, ys = [], []
        for name in spec[split]:
            d = _unpickle(name, members[name])
            try:
                x = np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
                y = np.asarray(d[spec["label_key"]], dtype=np.int64)
            except (KeyError, ValueError) as e:
                raise UserError(f"CIFAR file {name} has an unexpected layout ({e})") from None
            if len(x) != len(y):
                raise UserError(f"CIFAR file {name}: {len(x)} images but {len(y)} labels")
            xs.append(x.transpose(0, 2, 3, 1))
            ys.append(y)
        splits[split] = (np.concatenate(xs), np.concatenate(ys))
    return splits, classes, report


# --------------------------------------------------------------------------- MNIST IDX
def _find_idx(folder: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz"):
        if (folder / name).is_file():
            return folder / name
    raise UserError(f"{folder} lacks {stem}(.gz): expected the four official IDX files")


def _read_idx(path: Path, verify: bool, expected_md5: str | None, report: dict) -> np.ndarray:
    raw = path.read_bytes()
    if path.suffix == ".gz":
        _check_md5(path.name, raw, expected_md5, verify, report)
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise UserError(f"{path} is truncated or corrupt ({e})") from None
    else:
        report[path.name] = "no official checksum for the uncompressed file"
    if len(raw) < 4:
        raise UserError(f"{path} is truncated: no IDX header")
    zero, dtype_code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype_code != 0x08:
        raise UserError(f"{path} is not an IDX file of unsigned bytes")
    dims = struct.unpack(">" + "I" * ndim, raw[4:4 + 4 * ndim])
    body = raw[4 + 4 * ndim:]
    if len(body) != int(np.prod(dims)):
        raise UserError(f"{path} is truncated: header says {dims}, "
                        f"{len(body)} bytes of data follow")
    return np.frombuffer(body, dtype=np.uint8).reshape(dims)


def read_idx(source: str, path: Path, verify: bool):
    if not path.is_dir():
        raise UserError(f"data.path for {source} must be the folder holding the IDX files, "
                        f"got {path}")
    sums = IDX_MD5[source]
    report: dict[str, str] = {}
    splits = {}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        ipath = _find_idx(path, f"{prefix}-images-idx3-ubyte")
        lpath = _find_idx(path, f"{prefix}-labels-idx1-ubyte")
        x = _read_idx(ipath, verify, sums.get(ipath.name), report)
        y = _read_idx(lpath, verify, sums.get(lpath.name), report).astype(np.int64)
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
            raise UserError(f"{ipath.name} and {lpath.name} do not match "
                            f"({x.shape} images, {y.shape} labels)")
        splits[split] = (x[..., None].copy(), y)
    classes = FASHION_CLASSES if source == "fashion_mnist" else [str(i) for i in range(10)]
    return splits, classes, report


def resize_all(images: np.ndarray, size: int) -> np.ndarray:
    """Resize NHWC uint8 images to size x size (bilinear, via Pillow)."""
    from PIL import Image

    if images.shape[1] == size and images.shape[2] == size:
        return images
    out = np.empty((len(images), size, size, images.shape[3]), dtype=np.uint8)
    for i, im in enumerate(images):
        pil = Image.fromarray(im[..., 0] if im.shape[2] == 1 else im)
        r = np.asarray(pil.resize((size, size), Image.BILINEAR))
        out[i] = r[..., None] if r.ndim == 2 else r
    return out


