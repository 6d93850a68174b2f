"""Test accuracy on real photographs: the new recipe (stored 1.15x larger, random-resized
crop; with and without mixup) against the old one (stored at the training size,
pad-and-crop), same model, epochs and seeds, one run side by side.

    pip install scikit-image   # the photographs (shipped inside the package, no download)
    python bench/recipe_accuracy.py [--seeds 2] [--epochs 30]

The image folder: 13 classes, one per scikit-image photograph (astronaut, cat, coffee,
rocket, cameraman, Hubble deep field, immunohistochemistry, retina, coins, moon, brick,
grass, gravel); 40 images per class, each a random box (15-45% of the photo's short side,
aspect 3:4..4:3, saved at its own size as JPEG). The task: which photograph a crop comes
from. Each run: ddpflow prepare + launch (2 ranks), test accuracy from the held-out test
split (20% of each class), val (15%) chooses nothing here but is reported.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import numpy as np
from common import launch_stage
from PIL import Image

PHOTOS = ["astronaut", "chelsea", "coffee", "rocket", "camera", "hubble_deep_field",
          "immunohistochemistry", "retina", "coins", "moon", "brick", "grass", "gravel"]


def photo_folder(root: Path, per_class: int = 40, seed: int = 0) -> Path:
    import skimage.data

    rng = np.random.default_rng(seed)
    for name in PHOTOS:
        im = getattr(skimage.data, name)()
        im = np.stack([im] * 3, -1) if im.ndim == 2 else im[..., :3]
        h, w = im.shape[:2]
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            side = rng.uniform(0.15, 0.45) * min(h, w)
            ratio = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
            bw, bh = int(min(w, side * ratio ** 0.5)), int(min(h, side / ratio ** 0.5))
            top, left = rng.integers(0, h - bh + 1), rng.integers(0, w - bw + 1)
            Image.fromarray(im[top:top + bh, left:left + bw]).save(
                root / name / f"{i:03d}.jpg", quality=90)
    return root


RECIPES = {
    "old: stored at 48 px, pad-and-crop 4 + flip": {
        "data": {"store_size": 48, "augment": {"crop_padding": 4, "flip": True}},
        "stage": {}},
    "new: stored at 55 px, random-resized-crop (0.35-1) + flip": {
        "data": {"augment": {"random_resized_crop": {"scale": [0.35, 1.0]}, "flip": True}},
        "stage": {}},
    "new + mixup 0.2": {
        "data": {"augment": {"random_resized_crop": {"scale": [0.35, 1.0]}, "flip": True}},
        "stage": {"mixup_alpha": 0.2}},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=30)
    args = ap.parse_args()
    results: dict[str, list[float]] = {k: [] for k in RECIPES}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        folder = photo_folder(tmp / "photos")
        for seed in range(args.seeds):
            for i, (label, r) in enumerate(RECIPES.items()):
                name = f"r{i}s{seed}"
                cfg = {"run": name, "results_dir": str(tmp / "results"), "seed": seed,
                       "log_every_steps": 10,
                       "data": {"source": "imagefolder", "path": str(folder),
                                "image_size": 48, "val_fraction": 0.15,
                                "test_fraction": 0.2, **r["data"]},
                       "hardware": {"nproc_per_node": 2},
                       "checkpoint": {"every_steps": 0, "every_epochs": 0},
                       "stages": [{"name": name, "epochs": args.epochs, "batch_size": 32,
                                   "lr": 0.1, "warmup_epochs": 1, **r["stage"]}]}
                s = launch_stage(tmp, name, cfg)
                results[label].append(s["test_acc"])
                print(f"seed {seed} {label}: test_acc {s['test_acc']:.4f} "
                      f"(val_acc {s['final_val_acc']:.4f}, {s['wall_time_s']:.0f} s)",
                      flush=True)
    print(f"smallcnn, 48 px, {args.epochs} epochs, batch 32 x 2 ranks, seeds 0..{args.seeds - 1}")
    for label, accs in results.items():
        print(f"  {label:62s} test_acc mean {statistics.mean(accs):.4f}  "
              f"({', '.join(f'{a:.4f}' for a in accs)})")


if __name__ == "__main__":
    main()
