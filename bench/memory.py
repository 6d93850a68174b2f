"""Memory per rank and throughput of one model trained four ways on 2 CPU ranks: DDP, FSDP,
FSDP with activation checkpointing, and FSDP keeping gathered parameters to the backward.

    python bench/memory.py [--rounds 2] [--steps 24] [--batch 8] [--mmap-threshold BYTES]

The model is torchvision's ViT-B/16 at 32-px inputs (86 M parameters, 12 EncoderBlocks: what
FSDP shards one by one), trained with AdamW in fp32 by real `ddpflow launch` stages on
generated data; everything is read back from each stage's summary.json: `memory_per_rank`
(parameters, gradients and optimizer state as the rank holds them, the activations one
micro-batch kept, the peak resident set and what the process held before the model and data
came) and the steady-state samples/s. The variants alternate in each round (these machines are
noisy); medians. Ratios are against DDP in the same run.

`held` is what a GPU allocator would hold at the step's peak, counted tensor by tensor:
parameters + gradients + optimizer state + activations. `above start` is the resident set's
peak less what the process held before the model and data came: on a CPU it also holds what
glibc's malloc keeps after a free. --mmap-threshold sets MALLOC_MMAP_THRESHOLD_ for the
ranks (freed large buffers go back to the system at once, at a cost in page faults).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {"ddp": {"strategy": "ddp"},
            "fsdp": {"strategy": "fsdp"},
            "fsdp+ac": {"strategy": "fsdp", "activation_checkpointing": True},
            "fsdp-keep": {"strategy": "fsdp", "reshard_after_forward": False}}
KINDS = ["params_mib", "grads_mib", "optimizer_mib", "activations_mib", "peak_mib",
         "process_start_mib"]


def config(root: Path, name: str, steps: int, batch: int, data: Path) -> Path:
    import yaml

    root.mkdir(parents=True, exist_ok=True)
    cfg = {"run": name.replace("+", "-"), "results_dir": str(root / "results"), "seed": 0,
           "log_every_steps": 4,
           "data": {"source": "synthetic", "train_size": 512, "val_size": 16, "test_size": 0,
                    "image_size": 32, "loader": "device", "prepared_dir": str(data)},
           "model": {"name": "vit_b_16", "kwargs": {"image_size": 32}},
           "hardware": {"nproc_per_node": 2, "threads_per_rank": 1},
           "checkpoint": {"every_steps": 0, "every_epochs": 0},
           "container": {"engine": "none"}, "tracking": {"tensorboard": False},
           "stages": [{"name": "s", "max_steps": steps, "batch_size": batch, "lr": 1e-4,
                       "optimizer": "adamw", "precision": "fp32", "channels_last": False,
                       "warmup_epochs": 0, **VARIANTS[name]}]}
    path = root / f"{cfg['run']}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def ddpflow(*args) -> None:
    proc = subprocess.run([sys.executable, "-m", "ddpflow", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=1800, env=ENV)
    if proc.returncode:
        sys.exit(f"ddpflow {' '.join(map(str, args))} failed:\n{proc.stderr[-3000:]}")


def one(root: Path, name: str, steps: int, batch: int, data: Path) -> dict:
    path = config(root, name, steps, batch, data)
    ddpflow("launch", "--config", path, "--stage", "s")
    s = json.loads((root / "results" / name.replace("+", "-") / "stages/s/summary.json")
                   .read_text())
    worst = {k: max(m[k] or 0 for m in s["memory_per_rank"]) for k in KINDS}
    worst["above_start_mib"] = max(m["peak_mib"] - m["process_start_mib"]
                                   for m in s["memory_per_rank"])
    worst["held_mib"] = max(sum(m[k] or 0 for k in KINDS[:4]) for m in s["memory_per_rank"])
    worst["samples_per_s"] = s["mean_samples_per_s"]
    worst["params"] = s["params"]
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--batch", type=int, default=8, help="samples per rank per step")
    ap.add_argument("--mmap-threshold", type=int, help="MALLOC_MMAP_THRESHOLD_ of the ranks")
    args = ap.parse_args()
    if args.mmap_threshold:
        ENV["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    results: dict[str, list[dict]] = {n: [] for n in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = root / "data"  # prepared once, read by every run
        ddpflow("prepare", "--config", config(root, "ddp", args.steps, args.batch, data))
        for r in range(args.rounds):
            for name in VARIANTS:
                results[name].append(one(root / f"r{r}", name, args.steps, args.batch, data))
                print(f"round {r + 1} {name}: {results[name][-1]}", file=sys.stderr)
    med = {n: {k: statistics.median(x[k] for x in runs) for k in runs[0]}
           for n, runs in results.items()}
    params = med["ddp"]["params"]
    print(f"bench/memory.py: vit_b_16 at 32 px ({params / 1e6:.1f} M parameters), AdamW, fp32, "
          f"{args.batch}/rank x 2 gloo ranks on CPU, {args.steps} steps, {args.rounds} rounds, "
          f"medians; MiB per rank (the larger rank's); MALLOC_MMAP_THRESHOLD_="
          f"{args.mmap_threshold or 'unset'}")
    cols = {"params_mib": "params", "grads_mib": "grads", "optimizer_mib": "optimizer",
            "activations_mib": "activations", "held_mib": "held", "peak_mib": "peak RSS",
            "above_start_mib": "above start", "samples_per_s": "samples/s"}
    print(f"{'variant':10}" + "".join(f"{c:>12}" for c in cols.values())
          + "".join(f"{c:>13}" for c in ("held/ddp", "above/ddp", "speed/ddp")))
    base = med["ddp"]
    for n, m in med.items():
        print(f"{n:10}" + "".join(f"{m[c]:>12.1f}" for c in cols)
              + "".join(f"{m[k] / base[k]:>13.2f}" for k in ("held_mib", "above_start_mib",
                                                             "samples_per_s")))


if __name__ == "__main__":
    main()
