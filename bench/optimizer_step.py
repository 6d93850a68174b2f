"""Time of one optimizer step for a model's parameters: torch's per-tensor, foreach and
fused implementations (the trainer uses fused where the device has one).

    python bench/optimizer_step.py [--model resnet18] [--optimizer sgd] [--repeats 20]

Gradients are random; each implementation is timed in alternating blocks, median per step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from ddpflow.seams.models import build_model

IMPLS = {"per-tensor": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def make(kind: str, model, impl: dict):
    decay = [p for p in model.parameters() if p.ndim > 1]
    rest = [p for p in model.parameters() if p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": 5e-4}, {"params": rest, "weight_decay": 0.0}]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.01, momentum=0.9, nesterov=True, **impl)
    return torch.optim.AdamW(groups, lr=1e-3, **impl)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    model = build_model(args.model, 10, 3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opts = {name: make(args.optimizer, model, impl) for name, impl in IMPLS.items()}
    times = {name: [] for name in IMPLS}
    for _ in range(args.repeats):
        for name, opt in opts.items():  # alternate: drift on the machine hits all alike
            t0 = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v[1:]) for k, v in times.items()}  # the first step allocates
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.model} ({params / 1e6:.1f} M params), {args.optimizer}, CPU, "
          f"{torch.get_num_threads()} threads, median of {args.repeats - 1} steps")
    for name, t in med.items():
        print(f"  {name:11s} {t * 1e3:7.1f} ms   {med['per-tensor'] / t:5.2f}x per-tensor")


if __name__ == "__main__":
    main()
