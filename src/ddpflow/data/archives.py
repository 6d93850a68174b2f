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

from ddpflow.core import reading
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


def view(value, depth: int = 0):
    """What an unpickled archive member holds, as JSON-Schema can see it (reading.validate):
    byte keys and strings as text, an array as {"array": shape, "dtype": name}, a list of
    numbers as such an array; other lists item by item (the first 1000)."""
    if depth > 8:
        return "(nested too deep)"
    if isinstance(value, (bytes, str)):
        return value.decode(errors="replace") if isinstance(value, bytes) else value
    if isinstance(value, dict):
        return {str(view(k, depth + 1)): view(v, depth + 1) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return {"array": list(value.shape), "dtype": value.dtype.name}
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool)
                         for v in value):
            return {"array": [len(value)], "dtype": "int64"}
        return [view(v, depth + 1) for v in value[:1000]]
    if isinstance(value, (bool, int, float, np.integer, np.floating)):
        return value.item() if isinstance(value, np.generic) else value
    return type(value).__name__


_INTS = {"type": "object", "required": ["array", "dtype"],
         "properties": {"array": {"type": "array", "minItems": 1, "maxItems": 1},
                        "dtype": {"type": "string", "pattern": "^u?int"}}}


def _batch_schema(label_key: str) -> dict:
    """A CIFAR batch as read: `data` rows of 3 x 32 x 32 bytes, one integer label per row."""
    return {"type": "object", "required": ["data", label_key],
            "properties": {"data": {"type": "object", "required": ["array", "dtype"],
                                    "properties": {
                                        "array": {"type": "array", "minItems": 2,
                                                  "maxItems": 2,
                                                  "prefixItems": [{"type": "integer"},
                                                                  {"const": 3072}]},
                                        "dtype": {"const": "uint8"}}},
                           label_key: _INTS}}


def _meta_schema(names_key: str) -> dict:
    return {"type": "object", "required": [names_key],
            "properties": {names_key: {"type": "array",
                                       "items": {"type": "string", "minLength": 1},
                                       "minItems": 2, "maxItems": 1000,
                                       "uniqueItems": True}}}  # a class named twice: no


def _member(source: str, path: Path, name: str, blob: bytes, schema: dict) -> dict:
    """A CIFAR member unpickled (data only) and checked against its schema before any field
    is used (core/reading.py: one message naming the file and the field)."""
    value = _unpickle(name, blob)
    reading.validate(view(value), schema, f"{path}: {name}", f"a {source} file",
                     "it is not an official CIFAR file: replace the archive (the python "
                     "version from the dataset's site)")
    return {(k.decode(errors="replace") if isinstance(k, bytes) else k): v
            for k, v in value.items()}


def read_cifar(source: str, path: Path, verify: bool):
    """({train|test: (images NHWC uint8, labels)} of the official files, class names,
    checksum report)."""
    spec = CIFAR[source]
    members = _cifar_members(path, spec)
    report: dict[str, str] = {}
    for name, blob in members.items():
        _check_md5(name, blob, spec["md5"].get(name), verify, report)
    meta_name, names_key = spec["meta"][0], spec["meta"][1].decode()
    meta = _member(source, path, meta_name, members[meta_name], _meta_schema(names_key))
    classes = [c.decode(errors="replace") if isinstance(c, bytes) else str(c)
               for c in meta[names_key]]
    label_key = spec["label_key"].decode()
    splits = {}
    for split in ("train", "test"):
        xs, ys = [], []
        for name in spec[split]:
            d = _member(source, path, name, members[name], _batch_schema(label_key))
            x = np.asarray(d["data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
            y = np.asarray(d[label_key], dtype=np.int64)
            if len(x) != len(y):
                raise UserError(f"CIFAR file {name}: {len(x)} images but {len(y)} labels; "
                                f"it is not an official CIFAR file: replace the archive")
            if len(y) and (y.min() < 0 or y.max() >= len(classes)):
                raise UserError(f"CIFAR file {name}: labels {y.min()}..{y.max()}, but "
                                f"{meta_name} names {len(classes)} classes; it is not an "
                                f"official CIFAR file: replace the archive")
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
    header = idx_header(raw)
    if not header["complete"]:
        raise UserError(f"{path} is truncated: it ends inside its IDX header; replace the file")
    reading.validate(header, IDX_SCHEMA, path, "an IDX file",
                     "it is not an official (Fashion-)MNIST file: replace it")
    dims = tuple(header["dims"])
    body = raw[4 + 4 * len(dims):]
    want = int(np.prod(dims, dtype=np.int64))
    if len(body) != want:
        state = "truncated" if len(body) < want else "longer than its header says"
        raise UserError(f"{path} is {state}: its header says {dims} ({want} bytes), "
                        f"{len(body)} bytes of data follow; replace the file")
    return np.frombuffer(body, dtype=np.uint8).reshape(dims)


# an IDX header as ddpflow reads it: magic 0 0, unsigned bytes (0x08), images (3 dims) or
# labels (1 dim), each dimension within what (Fashion-)MNIST can hold
IDX_SCHEMA = {"type": "object", "required": ["zero", "dtype", "dims"],
              "properties": {"zero": {"const": 0}, "dtype": {"const": 8},
                             "dims": {"type": "array", "minItems": 1, "maxItems": 3,
                                      "items": {"type": "integer", "minimum": 1,
                                                "maximum": 10_000_000}}}}


def idx_header(raw: bytes) -> dict:
    """The fields of an IDX header (for IDX_SCHEMA), whatever the bytes: `complete` False
    when the file ends inside its header."""
    if len(raw) < 4:
        return {"zero": None, "dtype": None, "dims": [], "complete": False}
    zero, dtype_code, ndim = struct.unpack(">HBB", raw[:4])
    n = min(ndim, (len(raw) - 4) // 4)
    dims = list(struct.unpack(">" + "I" * n, raw[4:4 + 4 * n]))
    return {"zero": zero, "dtype": dtype_code, "dims": dims, "complete": n == ndim}


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
        for file, array, holds in ((ipath, x, "(count, rows, columns)"), (lpath, y, "(count,)")):
            if array.ndim != len(holds.split(",")) - (holds == "(count,)"):
                raise UserError(f"{file} holds an array of shape {array.shape}, where an "
                                f"MNIST file holds {holds}: replace it with the official file")
        if len(x) != len(y):
            raise UserError(f"{ipath} and {lpath.name} do not match ({len(x)} images, "
                            f"{len(y)} labels): replace them with the official files")
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


