"""`ddpflow prepare` throughput on an image folder, with 1 worker and with all cores.

    python bench/prepare_imagefolder.py [--images 2000] [--size 160] [--out 64]

Writes a tree of JPEG/PNG files (160 x 120 pixels by default, 10 classes) into a
temporary folder, then prepares it twice (prepare_workers 1, then auto = all cores)
and prints images/s of each and the ratio.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from ddpflow.config import from_dict
from ddpflow.data.prepare import prepare


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--size", type=int, default=160, help="source width in pixels")
    ap.add_argument("--out", type=int, default=64, help="data.image_size")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "imgs"
        for i in range(args.images):
            folder = root / f"c{i % 10}"
            folder.mkdir(parents=True, exist_ok=True)
            arr = rng.integers(0, 256, (args.size * 3 // 4, args.size, 3), dtype=np.uint8)
            Image.fromarray(arr).save(folder / f"{i}.{'jpg' if i % 4 else 'png'}")
        speed = {}
        for workers in (1, "auto"):
            cfg = from_dict({"results_dir": f"{d}/r{workers}", "stages": [{"name": "s"}],
                             "data": {"source": "imagefolder", "path": str(root),
                                      "image_size": args.out, "prepare_workers": workers}})
            meta, _ = prepare(cfg)
            speed[workers] = meta["images_per_s"]
    cores = os.cpu_count()
    print(f"{args.images} images ({args.size}x{args.size * 3 // 4} JPEG/PNG) -> {args.out}px")
    print(f"  1 worker: {speed[1]:.0f} images/s   {cores} workers: {speed['auto']:.0f} images/s"
          f"   ratio {speed['auto'] / speed[1]:.2f}x")


if __name__ == "__main__":
    main()
