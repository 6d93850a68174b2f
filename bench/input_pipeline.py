"""Input-pipeline throughput against the compute-only limit, in one process.

    python bench/input_pipeline.py [--model smallcnn] [--steps 30] [--batch 128]

Same model, data, batch and precision for every variant; training steps only:
  compute-only   the same batches already in memory, normalised (no loading, no augmentation)
  device         ddpflow's device loader (uint8 set resident, batched augmentation)
  dataloader     ddpflow's DataLoader loader (memory-mapped arrays, workers, batched augmentation)
  plain          a DataLoader over decoded PIL images with per-sample torchvision transforms,
                 as a user would write it (RandomCrop(pad 4), flip, ToTensor, Normalize)
Variants run in rounds (A B C D, A B C D, ...) and each keeps its best round, so
machine noise does not favour one. Prints samples/s and the ratio to compute-only.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
from common import pil_loader
from torch import nn

from ddpflow.config import from_dict
from ddpflow.data import prepared
from ddpflow.data.loaders import Normalize, TrainBatches, forever
from ddpflow.data.prepare import prepare
from ddpflow.seams.models import build_model


def timed(model, opt, batches, steps, precision):
    """samples/s over `steps` training steps after 3 warm-up steps."""
    crit = nn.CrossEntropyLoss()
    dtype = torch.bfloat16 if precision == "bf16" else None
    it = iter(batches)
    n = 0
    for i in range(steps + 3):
        if i == 3:
            t0 = time.perf_counter()
            n = 0
        x, y = next(it)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = crit(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        n += len(y)
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smallcnn")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers (both loaders)")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as d:
        cfg = from_dict({"results_dir": d, "data": {"train_size": 8192, "val_size": 256},
                         "stages": [{"name": "s"}]})
        prepare(cfg)
        meta, arrays = prepared.load(cfg.data_dir)
        images, labels = arrays["train"]
        dev = torch.device("cpu")
        norm = Normalize(meta["mean"], meta["std"], dev, 3, False)
        kw = dict(batch_size=args.batch, device=dev, world=1, rank=0, seed=0,
                  aug=cfg.data.augment, normalize=norm)
        device_tb = TrainBatches("device", images, labels, **kw)
        dl_tb = TrainBatches("dataloader", images, labels, num_workers=args.workers,
                             persistent_workers=True, prefetch_factor=4, **kw)
        # compute-only: the first epoch's batches of the device loader, kept in memory
        cached = [(x.clone(), y.clone()) for x, y in device_tb.epoch(0)]
        variants = {
            "compute-only": lambda: forever(lambda e: cached),
            "device": lambda: forever(device_tb.epoch),
            "dataloader": lambda: forever(dl_tb.epoch),
            "plain": lambda: forever(lambda e: pil_loader(
                images, labels, args.batch, meta["mean"], meta["std"], args.workers)),
        }
        model = build_model(args.model, 10, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        best = {k: 0.0 for k in variants}
        plain_iter = None
        for r in range(args.rounds):
            for name, make in variants.items():
                if name == "plain":  # keep its worker processes across rounds, as a user would
                    plain_iter = plain_iter or make()
                    batches = plain_iter
                else:
                    batches = make()
                best[name] = max(best[name], timed(model, opt, batches, args.steps,
                                                   args.precision))
            print(f"round {r}: " + ", ".join(f"{k} {v:.0f}" for k, v in best.items()),
                  file=sys.stderr)
    base = best["compute-only"]
    print(f"{args.model}, batch {args.batch}, {args.precision}, {torch.get_num_threads()} "
          f"threads, {args.workers} workers, best of {args.rounds} rounds x {args.steps} steps")
    for name, v in best.items():
        print(f"  {name:13s} {v:8.0f} samples/s   {v / base:5.3f} of compute-only")
    print(f"  device loader vs plain DataLoader: {best['device'] / best['plain']:.2f}x")


if __name__ == "__main__":
    main()
