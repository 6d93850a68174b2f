"""ddpflow's trainer vs a reference loop as torchvision's reference script writes it, and vs
the compute-only limit: same model, data, global batch and precision.

    python bench/trainer_vs_reference.py [--model resnet18] [--steps 60] [--rounds 3]
                                        [--precision bf16|fp32]

  ddpflow       `ddpflow launch` (real torchrun, 1 rank, all cores): device loader, batched
                augmentation; wall-clock samples/s over the same steps as the others (after
                the same warm-up, from its metrics' timestamps; the epoch is longer than the
                run, so no validation or checkpoint falls inside), at its defaults
                (channels_last: auto, loader: auto); also with channels_last: false, shown
                apart (the headline is the default)
  reference     DataLoader + DistributedSampler over decoded PIL images with per-sample
                transforms (RandomCrop pad 4, flip, ToTensor, Normalize), workers,
                autocast + GradScaler, SGD in torch's default implementation, as torchvision's
                references/classification/train.py
  compute-only  the same model, batch and optimizer as ddpflow's trainer (fused SGD) with the
                batches already in memory, in its best memory format (contiguous or
                channels_last, both measured)
Rounds alternate the variants; each keeps its best round. Prints the ratios, also per round.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import launch_stage, pil_loader
from torch import nn

from ddpflow.config import from_dict
from ddpflow.data import prepared
from ddpflow.data.loaders import Normalize, TrainBatches, forever
from ddpflow.data.prepare import prepare
from ddpflow.engine.runtime import build_optimizer
from ddpflow.seams.models import build_model

BATCH, WARMUP = 64, 10


def config(tmp: Path, name: str, args, channels_last: bool | None) -> dict:
    layout = {} if channels_last is None else {"channels_last": channels_last}  # None: auto
    return {"run": "bench", "results_dir": str(tmp / "results"), "log_every_steps": 10,
            # longer than the run: no epoch end (validation, checkpoint) in the timed steps
            "data": {"train_size": BATCH * (args.steps + WARMUP + 8), "val_size": 256},
            "model": {"name": args.model},
            "hardware": {"nproc_per_node": 1, "device": "cpu"},
            "checkpoint": {"every_steps": 0, "resume": "never"},
            "stages": [{"name": name, "max_steps": args.steps + WARMUP, "batch_size": BATCH,
                        "lr": 0.05, "precision": args.precision, **layout}]}


def ddpflow_run(tmp: Path, name: str, args, channels_last: bool | None, waits: list,
                layouts: list) -> float:
    """Wall-clock samples/s from the end of step WARMUP to the last step, as timed_loop
    times the others (the metrics' time_s is read after the step's results are on the host)."""
    summary = launch_stage(tmp, name, config(tmp, name, args, channels_last), prepare=False)
    waits.append(summary["data_wait_fraction"])  # the stage's own share of time spent waiting
    layouts.append(summary["layout_reason"])
    metrics = tmp / "results" / "bench" / "stages" / name / "metrics.jsonl"
    train = [r for r in map(json.loads, metrics.read_text().splitlines())
             if r["kind"] == "train"]
    first = next(r for r in train if r["step"] == WARMUP)
    last = train[-1]
    return (last["step"] - first["step"]) * BATCH / (last["time_s"] - first["time_s"])


def reference_optimizer(model):
    # references/classification/train.py: SGD with nesterov momentum and weight decay, torch's
    # default implementation (on the CPU, one tensor at a time); no decay on norms and biases
    decay = [p for p in model.parameters() if p.ndim > 1]
    rest = [p for p in model.parameters() if p.ndim <= 1]
    return torch.optim.SGD([{"params": decay, "weight_decay": 5e-4},
                            {"params": rest, "weight_decay": 0.0}], lr=0.01, momentum=0.9,
                           nesterov=True)


def timed_loop(model, opt, batches, steps, precision: str) -> float:
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # bf16 and fp32 need no scaling
    crit = nn.CrossEntropyLoss()
    it = iter(batches)
    t0, n = time.perf_counter(), 0
    for i in range(steps + WARMUP):
        if i == WARMUP:
            t0, n = time.perf_counter(), 0
        x, y = next(it)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = crit(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        n += len(y)
    return n / (time.perf_counter() - t0)


def reference_batches(images, labels, mean, std, workers):
    """The reference script's input: DistributedSampler + DataLoader over PIL images."""
    def sampler(ds):
        return torch.utils.data.distributed.DistributedSampler(ds, num_replicas=1, rank=0)

    loader = pil_loader(images, labels, BATCH, mean, std, workers, sampler=sampler)

    def epoch(e):
        loader.sampler.set_epoch(e)
        return loader

    return forever(epoch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16",
                    help="bf16 (emulated, several times slower, on CPUs without AVX-512/AMX)")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cfg = from_dict(config(tmp, "p", args, False))
        prepare(cfg)
        meta, arrays = prepared.load(cfg.data_dir)
        images, labels = arrays["train"]
        dev = torch.device("cpu")
        norm = Normalize(meta["mean"], meta["std"], dev, 3, False)
        tb = TrainBatches("device", images, labels, BATCH, dev, 1, 0, 0, cfg.data.augment, norm)
        cached = [(x.clone(), y.clone()) for x, y in tb.epoch(0)]

        ref = reference_batches(images, labels, meta["mean"], meta["std"], args.workers)
        cached_cl = [(x.contiguous(memory_format=torch.channels_last), y) for x, y in cached]
        st = cfg.stage("p")

        def compute_only(batches, layout):
            model = build_model(args.model, 10, 3).to(memory_format=layout)
            opt = build_optimizer(model, st, 0.05, dev)
            return timed_loop(model, opt, forever(lambda e: batches), args.steps,
                              args.precision)

        def reference():
            model = build_model(args.model, 10, 3)
            return timed_loop(model, reference_optimizer(model), ref, args.steps,
                              args.precision)

        waits, layouts = [], []
        variants = {
            "ddpflow (defaults)": lambda r: ddpflow_run(tmp, f"a{r}", args, None, waits,
                                                        layouts),
            "ddpflow (channels_last false)": lambda r: ddpflow_run(tmp, f"b{r}", args, False,
                                                                   [], []),
            "reference": lambda r: reference(),
            "compute-only": lambda r: compute_only(cached, torch.contiguous_format),
            "compute-only (channels_last)": lambda r: compute_only(cached_cl,
                                                                   torch.channels_last),
        }
        runs = {k: [] for k in variants}
        for r in range(args.rounds):
            for name, measure in variants.items():
                runs[name].append(measure(r))
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in runs.items()),
                  file=sys.stderr)
    best = {k: max(v) for k, v in runs.items()}
    ours = best["ddpflow (defaults)"]
    limit = max(best["compute-only"], best["compute-only (channels_last)"])
    # the same ratios round by round (variants of one round ran minutes apart, not hours)
    per_round = [(runs["ddpflow (defaults)"][r],
                  runs["reference"][r],
                  max(runs["compute-only"][r], runs["compute-only (channels_last)"][r]))
                 for r in range(args.rounds)]
    print(f"{args.model}, 32 px, batch {BATCH}, {args.precision}, "
          f"{torch.get_num_threads()} threads, "
          f"{args.workers} reference workers, best of {args.rounds} rounds x {args.steps} steps")
    for k, v in best.items():
        print(f"  {k:30s} {v:8.0f} samples/s")
    print(f"  ddpflow / reference loop:  {ours / best['reference']:.2f}x   per round: "
          + " ".join(f"{o / ref:.2f}" for o, ref, _ in per_round))
    print(f"  ddpflow / compute-only:    {ours / limit:.3f}   per round: "
          + " ".join(f"{o / lim:.3f}" for o, _, lim in per_round))
    print(f"  compute-only / reference:  {limit / best['reference']:.2f}x")
    print(f"  ddpflow data wait:         {100 * sum(waits) / len(waits):.1f}% of its step time "
          f"(mean of its {len(waits)} runs at defaults)")
    print(f"  ddpflow's layout at defaults: {layouts[-1]}")


if __name__ == "__main__":
    main()
