"""The device augmentation path (random-resized-crop + flip + mixup) against compute-only
training and against torchvision's per-sample RandomResizedCrop in DataLoader workers; with
--policies, the cost per sample of each augmentation policy against crop-and-flip.

    python bench/augment.py [--size 64] [--steps 20] [--batch 128] [--rounds 3]
    python bench/augment.py --policies [--size 32] [--batch 128] [--rounds 3]

Same model, images, batch and precision for every variant; training steps only:
  compute-only   the device path's first-epoch batches, kept in memory (no work per step)
  device         ddpflow's device loader: uint8 images stored at 1.15 x size, one batched
                 grid_sample random-resized-crop + flip, batched mixup (TrainBatches)
  torchvision    DataLoader workers over the same stored images as PIL: per-sample
                 RandomResizedCrop(size) + flip + ToTensor + Normalize, then torchvision's
                 batched MixUp in the collate function (as a user would write it)
Variants run in rounds and each keeps its best round (machine noise favours none).

--policies: microseconds per sample, on the CPU in one thread (what one DataLoader worker
pays; the device loader pays it on its device), of the crop-and-flip pipeline (the batched
random resized crop + flip + normalisation of TrainBatches.transform, from the stored uint8
images) and of each data.augment.policy (policies.apply: torchvision.transforms.v2 per
sample, seeded per sample) on the same stored images; best of the rounds.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from functools import partial

import torch
from common import pil_loader
from input_pipeline import timed

from ddpflow.config import from_dict
from ddpflow.data import prepared
from ddpflow.data.loaders import Normalize, TrainBatches, forever
from ddpflow.data.mixing import Recipe
from ddpflow.data.prepare import prepare
from ddpflow.seams.models import build_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smallcnn")
    ap.add_argument("--size", type=int, default=64, help="training image size (pixels)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers (torchvision)")
    ap.add_argument("--policies", action="store_true",
                    help="the cost per sample of each augmentation policy vs crop-and-flip")
    args = ap.parse_args()
    if args.policies:
        return policy_costs(args)
    torch.set_num_threads(os.cpu_count() or 1)
    store = round(args.size * 1.15)
    with tempfile.TemporaryDirectory() as d:
        cfg = from_dict({"results_dir": d, "stages": [{"name": "s"}],
                         "data": {"train_size": 4096, "val_size": 64, "test_size": 0,
                                  "image_size": args.size, "store_size": store,
                                  "augment": {"random_resized_crop": {}}}})
        prepare(cfg)
        meta, arrays = prepared.load(cfg.data_dir)
        images, labels = arrays["train"]
        dev = torch.device("cpu")
        norm = Normalize(meta["mean"], meta["std"], dev, 3, False)
        device_tb = TrainBatches("device", images, labels, args.batch, dev, 1, 0, 0,
                                 cfg.data.augment, norm, image_size=args.size,
                                 recipe=Recipe(0.0, 0.2, 0.0, num_classes=10))
        cached = [(x.clone(), y.clone()) for x, y in device_tb.epoch(0)]
        tv = _torchvision(images, labels, args, meta)
        variants = {"compute-only": lambda: forever(lambda e: cached),
                    "device": lambda: forever(device_tb.epoch),
                    "torchvision": lambda: tv}
        model = build_model(args.model, 10, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        best = {k: 0.0 for k in variants}
        for r in range(args.rounds):
            for name, make in variants.items():
                best[name] = max(best[name], timed(model, opt, make(), args.steps,
                                                   args.precision))
            print(f"round {r}: " + ", ".join(f"{k} {v:.0f}" for k, v in best.items()),
                  file=sys.stderr)
    base = best["compute-only"]
    print(f"{args.model} at {args.size} px (stored {store} px), batch {args.batch}, "
          f"{args.precision}, {torch.get_num_threads()} threads, {args.workers} workers, best of "
          f"{args.rounds} rounds x {args.steps} steps")
    for name, v in best.items():
        print(f"  {name:13s} {v:8.0f} samples/s   {v / base:5.3f} of compute-only")
    print(f"  device path vs torchvision workers: {best['device'] / best['torchvision']:.2f}x")


def policy_costs(args) -> None:
    """Microseconds per sample of crop-and-flip and of each policy (module docstring)."""
    import time
    from types import SimpleNamespace

    from ddpflow.data import policies

    torch.set_num_threads(1)  # one DataLoader worker's share
    store = round(args.size * 1.15)
    x = torch.randint(0, 256, (args.batch, store, store, 3), dtype=torch.uint8)
    aug = from_dict({"data": {"image_size": args.size, "store_size": store,
                              "augment": {"random_resized_crop": {}}},
                     "stages": [{"name": "s"}]}).data.augment
    norm = Normalize([0.5] * 3, [0.25] * 3, torch.device("cpu"), 3, False)
    tb = TrainBatches("device", x.numpy(), torch.zeros(args.batch).long().numpy(), args.batch,
                      torch.device("cpu"), 1, 0, 0, aug, norm, image_size=args.size)
    g = torch.Generator().manual_seed(0)
    runs = {"crop-and-flip": lambda: tb.transform(x, g)}
    keys = list(range(args.batch))
    for name in policies.NAMES:
        p = policies.build(SimpleNamespace(policy=name, num_ops=None, magnitude=None))
        runs[name] = partial(policies.apply, p, x, keys)
    best = {k: float("inf") for k in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / args.batch * 1e6)
    base = best["crop-and-flip"]
    print(f"per sample at {args.size} px (stored {store} px), batches of {args.batch}, 1 CPU "
          f"thread, best of {args.rounds} rounds")
    for name, us in best.items():
        print(f"  {name:15s} {us:9.1f} us/sample   {us / base:6.1f} x crop-and-flip")


def _torchvision(images, labels, args, meta):
    """An endless iterator of the torchvision pipeline's batches (workers kept alive)."""
    import torchvision.transforms as T
    from torch.utils.data import default_collate
    from torchvision.transforms import v2

    mixup = v2.MixUp(alpha=0.2, num_classes=10)

    def collate(batch):
        return mixup(*default_collate(batch))

    loader = pil_loader(images, labels, args.batch, meta["mean"], meta["std"], args.workers,
                        crop=T.RandomResizedCrop(args.size), collate=collate)
    return forever(lambda e: loader)


if __name__ == "__main__":
    main()
