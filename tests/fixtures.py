"""Small datasets in the real on-disk formats, written by the tests themselves."""

from __future__ import annotations

import gzip
import io
import pickle
import struct
import tarfile
from pathlib import Path

import numpy as np

from ddpflow.data.synthetic import generate


def cifar_archive(path: Path, n_per_batch: int = 200, n_test: int = 200, classes: int = 10,
                  cifar100: bool = False, seed: int = 3) -> Path:
    """A CIFAR 'python version' .tar.gz with learnable images (NOT the official bytes)."""
    folder = "cifar-100-python" if cifar100 else "cifar-10-batches-py"
    label_key = b"fine_labels" if cifar100 else b"labels"

    def batch(split, i, n):
        x, y = generate(n, classes, 32, 3, seed, split, difficulty=0)
        x = np.roll(x, i, axis=0)  # different content per batch file
        y = np.roll(y, i)
        rows = x.transpose(0, 3, 1, 2).reshape(n, 3072)
        return pickle.dumps({b"data": rows, label_key: y.tolist(),
                             b"batch_label": f"batch {i}".encode()})

    members = {}
    if cifar100:
        members["train"] = batch("train", 0, 5 * n_per_batch)
        members["test"] = batch("val", 0, n_test)
        members["meta"] = pickle.dumps({b"fine_label_names": [f"c{i}".encode()
                                                              for i in range(classes)]})
    else:
        for i in range(1, 6):
            members[f"data_batch_{i}"] = batch("train", i, n_per_batch)
        members["test_batch"] = batch("val", 0, n_test)
        members["batches.meta"] = pickle.dumps(
            {b"label_names": [f"class{i}".encode() for i in range(classes)]})
    with tarfile.open(path, "w:gz") as tar:
        for name, blob in members.items():
            info = tarfile.TarInfo(f"{folder}/{name}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    return path


def idx_files(folder: Path, n_train=300, n_test=100, gz=True, bad_label=False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for prefix, n, split in (("train", n_train, "train"), ("t10k", n_test, "val")):
        x, y = generate(n, 10, 28, 1, 5, split, difficulty=0)
        if bad_label:
            y[0] = 12
        img = struct.pack(">HBB", 0, 8, 3) + struct.pack(">III", n, 28, 28) + x.tobytes()
        lab = struct.pack(">HBB", 0, 8, 1) + struct.pack(">I", n) + y.astype(np.uint8).tobytes()
        for stem, blob in ((f"{prefix}-images-idx3-ubyte", img), (f"{prefix}-labels-idx1-ubyte",
                                                                   lab)):
            if gz:
                (folder / (stem + ".gz")).write_bytes(gzip.compress(blob))
            else:
                (folder / stem).write_bytes(blob)
    return folder


def image_tree(root: Path, classes=("cat", "dog", "fish"), per_class=12, size=(40, 30),
               broken: int = 0, seed: int = 0) -> Path:
    """root/<class>/*.{png,jpg,webp} in several modes (RGB, L, RGBA, CMYK), plus broken files
    (another seed for another split: the same seed makes the same files, dropped by prepare
    from the later split as duplicates)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    formats = [("png", "RGB"), ("jpg", "RGB"), ("webp", "RGB"), ("png", "L"), ("png", "RGBA"),
               ("jpg", "CMYK")]
    for c, name in enumerate(classes):
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            ext, mode = formats[i % len(formats)]
            base = np.zeros((size[1], size[0], 3), dtype=np.uint8)
            base[..., c % 3] = 200  # class colour
            base = np.clip(base + rng.integers(0, 40, base.shape), 0, 255).astype(np.uint8)
            im = Image.fromarray(base).convert(mode)
            im.save(d / f"img{i:03d}.{ext}")
    for j in range(broken):
        (root / classes[j % len(classes)] / f"broken{j}.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    return root


def gloo_ranks(tmp_path: Path, body: str, n: int, config: dict) -> list:
    """`body` on n gloo ranks started as torchrun starts them (its environment; d: the Dist,
    root: tmp_path; config: the config dict the ranks resolve); each rank's (last stdout line
    as JSON, stderr), in rank order."""
    import json
    import os
    import socket
    import subprocess
    import sys

    script = tmp_path / "ranks.py"
    script.write_text("import json, os, sys, time\nfrom pathlib import Path\nimport torch\n"
                      "from ddpflow.config import from_dict\n"
                      "from ddpflow.engine import distributed\n"
                      "cfg = from_dict(json.loads(os.environ['DDPFLOW_TEST_CFG']))\n"
                      "d = distributed.setup(cfg.hardware)\nroot = Path(sys.argv[1])\n" + body
                      + "\ndistributed.teardown(d)\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "DDPFLOW_TEST_CFG": json.dumps(config),
           "OMP_NUM_THREADS": "1", "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path)], text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for r in range(n)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err
    return [(json.loads(out.strip().splitlines()[-1]), err) for out, err in outs]
