"""How the prepared data grows: prepare time and bytes on disk against the number of images
(raw vs JPEG shards, 64 and 224 px), and decode throughput per core.

    python bench/scale_data.py [--sizes64 1000,10000,100000] [--sizes224 1000,10000]

The images are real photographs: the colour photos that scikit-image and scikit-learn ship
in their wheels (astronaut, coffee, chelsea, rocket, motorcycles, china, flower, ...),
fetched once with `pip download` into bench/.photos. Each source image is a random box of
one photo (5-50% of its area, aspect 3/4-4/3) saved as a JPEG (quality 90) at 1.4x the
training size on its short side, as a camera or ImageNet file is bigger than what training
keeps. `ddpflow prepare` (the library call, all cores) turns the folder into raw pixels or
JPEG shards (quality 90) at the default store size (1.15 x image size). Decode throughput:
one thread, batches of 256 random indices of a prepared 10k split, read as the loaders
read them (raw: memory-mapped rows from the page cache; jpeg: the shard bytes, CRC check and
decode), images/s per core.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
PHOTOS = HERE / ".photos"
WHEELS = {"scikit-image": ["astronaut.png", "coffee.png", "chelsea.png", "rocket.jpg",
                           "motorcycle_left.png", "motorcycle_right.png", "retina.jpg",
                           "hubble_deep_field.jpg", "ihc.png"],
          "scikit-learn": ["china.jpg", "flower.jpg"]}


def photos() -> list[Path]:
    """The photographs, from the two wheels (downloaded once, no install)."""
    want = [n for names in WHEELS.values() for n in names]
    if not all((PHOTOS / n).exists() for n in want):
        wheels = PHOTOS / "wheels"
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d",
                        str(wheels), *WHEELS], check=True)
        for whl in wheels.glob("*.whl"):
            with zipfile.ZipFile(whl) as z:
                for member in z.namelist():
                    if Path(member).name in want and ("skimage/data/" in member or
                                                      "sklearn/datasets/images/" in member):
                        (PHOTOS / Path(member).name).write_bytes(z.read(member))
    return [PHOTOS / n for n in want]


_DECODED: dict = {}  # each worker decodes a photograph once


def _source_image(args):
    i, path, out, short = args
    from PIL import Image

    rng = np.random.default_rng(i)
    if path not in _DECODED:
        with Image.open(path) as im:
            _DECODED[path] = im.convert("RGB")
    im = _DECODED[path]
    w, h = im.size
    area = rng.uniform(0.05, 0.5) * w * h
    ratio = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
    bw = int(min(w, np.sqrt(area * ratio)))
    bh = int(min(h, np.sqrt(area / ratio)))
    x0, y0 = rng.integers(0, w - bw + 1), rng.integers(0, h - bh + 1)
    box = im.crop((x0, y0, x0 + bw, y0 + bh))
    s = short / min(bw, bh)
    box = box.resize((max(short, round(bw * s)), max(short, round(bh * s))),
                     Image.BILINEAR)
    box.save(out, format="JPEG", quality=90)


def make_folder(root: Path, n: int, short: int, srcs: list[Path]) -> Path:
    """root/<photo>/<i>.jpg: n source images, one class per photograph."""
    jobs = []
    for i in range(n):
        src = srcs[i % len(srcs)]
        d = root / src.stem
        d.mkdir(parents=True, exist_ok=True)
        jobs.append((i, src, d / f"{i:06d}.jpg", short))
    with ProcessPoolExecutor() as pool:
        list(pool.map(_source_image, jobs, chunksize=256))
    return root


def prepare_once(folder: Path, out: Path, size: int, encoding: str) -> dict:
    from ddpflow.config import from_dict
    from ddpflow.data.prepare import prepare

    cfg = from_dict({"run": "b", "results_dir": str(out), "data": {
        "source": "imagefolder", "path": str(folder), "image_size": size,
        "encoding": encoding, "jpeg_quality": 90, "test_fraction": 0.0},
        "stages": [{"name": "s"}]})
    t0 = time.perf_counter()
    meta, _ = prepare(cfg, force=True)
    wall = time.perf_counter() - t0
    n = sum(c["total"] for c in meta["counts"].values())
    return {"images": n, "seconds": round(wall, 2), "bytes": meta["bytes_written"],
            "store_size": meta["store_size"], "dir": str(cfg.data_dir)}


def decode_rate(data_dir: str, batches: int = 8, batch: int = 256) -> float:
    """Images/s of one thread reading random batches as the loaders do."""
    import torch

    from ddpflow.data import prepared
    from ddpflow.data.loaders import read_rows

    torch.set_num_threads(1)
    _, arrays = prepared.load(Path(data_dir))
    x, y = arrays["train"]
    rng = np.random.default_rng(0)
    read_rows(x, y, np.sort(rng.choice(len(y), batch, replace=False)))  # warm: imports, cache
    t0 = time.perf_counter()
    for _ in range(batches):
        read_rows(x, y, np.sort(rng.choice(len(y), batch, replace=False)))
    return batches * batch / (time.perf_counter() - t0)


def fit_line(xs, ys) -> tuple[float, float]:
    """Least squares y = a + b x."""
    b, a = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(a), float(b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes64", default="1000,10000,100000")
    ap.add_argument("--sizes224", default="1000,10000")
    ap.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    args = ap.parse_args()
    srcs = photos()
    work = Path(args.work or tempfile.mkdtemp(prefix="ddpflow-scale-"))
    rows, rates = [], {}
    for size, spec in ((64, args.sizes64), (224, args.sizes224)):
        for n in map(int, spec.split(",")):
            folder = make_folder(work / f"src{size}-{n}", n, round(size * 1.4), srcs)
            src_bytes = sum(p.stat().st_size for p in folder.rglob("*.jpg"))
            for enc in ("raw", "jpeg"):
                r = prepare_once(folder, work / f"out{size}-{n}-{enc}", size, enc)
                if n == 10000:
                    rates[(size, enc)] = decode_rate(r["dir"])
                shutil.rmtree(Path(r["dir"]).parent.parent, ignore_errors=True)
                rows.append({"px": size, "n": n, "encoding": enc, "source_bytes": src_bytes,
                             **{k: v for k, v in r.items() if k != "dir"}})
                print(json.dumps(rows[-1]), flush=True)
            shutil.rmtree(folder, ignore_errors=True)
    report(rows, rates)
    shutil.rmtree(work, ignore_errors=True)


def report(rows: list[dict], rates: dict) -> None:
    import torch

    print(f"\nreal photographs, prepare with {len(__import__('os').sched_getaffinity(0))} "
          f"cores, torch {torch.__version__}")
    print("px   images  encoding  seconds  MB on disk  bytes/image  vs raw")
    for r in rows:
        raw = next(x for x in rows if x["px"] == r["px"] and x["n"] == r["n"]
                   and x["encoding"] == "raw")
        print(f"{r['px']:<4} {r['n']:>7}  {r['encoding']:<8} {r['seconds']:>8.2f} "
              f"{r['bytes'] / 1e6:>11.1f} {r['bytes'] / r['images']:>12.0f}  "
              f"{raw['bytes'] / r['bytes']:>5.1f}x")
    print("fits (seconds = a + b * images; bytes = c * images):")
    for px in sorted({r["px"] for r in rows}):
        for enc in ("raw", "jpeg"):
            sel = [r for r in rows if r["px"] == px and r["encoding"] == enc]
            a, b = fit_line([r["images"] for r in sel], [r["seconds"] for r in sel])
            c = np.mean([r["bytes"] / r["images"] for r in sel])
            print(f"  {px} px {enc}: a {a:.2f} s, b {b * 1e3:.3f} ms/image, c {c:.0f} B/image"
                  f" -> 1.28M images: {(a + b * 1.281e6) / 3600:.2f} h on these cores, "
                  f"{c * 1.281e6 / 1e9:.1f} GB")
    print("decode throughput, 1 thread, random batches of 256 from a 10k split (images/s):")
    for (px, enc), v in sorted(rates.items()):
        print(f"  {px} px {enc}: {v:.0f}")


if __name__ == "__main__":
    main()
