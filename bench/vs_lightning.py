"""ddpflow against a plain PyTorch Lightning script, end to end, in one run.

    python bench/vs_lightning.py [--epochs 3] [--train 1280] [--rounds 2]

The same job both ways: ResNet-18 (torchvision), 3 epochs over an image folder of 32 px PNGs
(10 classes), 2 ranks with gloo on this CPU (one thread each), global batch 128, SGD
(nesterov, weight decay) with a cosine schedule, validation and a checkpoint at every epoch
end. Lightning 2.x runs from the benchmark's own folder (bench/.lightning, installed here
with pip --target on first use; it is not a ddpflow dependency), with ImageFolder,
per-sample transforms and 2 DataLoader workers per rank, as its docs write it.

Reported per side: wall time from the command to the result (ddpflow: `ddpflow launch`;
its one-off `ddpflow prepare` of the folder is reported apart) and steady-state samples/s
(samples over time between consecutive training batches of an epoch, the first log
interval left out; ddpflow's from metrics.jsonl). Rounds alternate the two; the best round
of each counts. Each round also times the ceiling (bench/bare_ddp.py: the same DDP step on
a batch in memory, nothing around it), which bounds any trainer's steady state here.
Also `ddpflow launch` on the default config with 1 epoch: its wall-time split and start-up
milestones.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml
from PIL import Image

HERE = Path(__file__).resolve().parent
SITE = HERE / ".lightning"
BATCH, LR, WORKERS, LOG_EVERY = 64, 0.1, 2, 5  # per rank; lr for the global batch 128


def lightning_site() -> Path:
    if not (SITE / "lightning").is_dir():
        print("installing Lightning into bench/.lightning (once) ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                        str(SITE), "lightning>=2.4,<3", "lightning-utilities", "torchmetrics",
                        "fsspec", "aiohttp"], check=True)
    return SITE


def image_folder(root: Path, n_train: int, n_val: int) -> None:
    """10 classes of 32 px PNGs: a class colour plus noise."""
    rng = np.random.default_rng(0)
    colours = rng.integers(0, 256, (10, 3))
    for split, n in (("train", n_train), ("val", n_val)):
        for i in range(n):
            c = i % 10
            img = np.clip(colours[c] + rng.normal(0, 40, (32, 32, 3)), 0, 255).astype(np.uint8)
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(img).save(folder / f"{i:05d}.png")


def run(cmd: list, env: dict | None = None) -> tuple[float, str]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    dt = time.perf_counter() - t0
    if p.returncode:
        sys.exit(f"failed: {' '.join(map(str, cmd))}\n{p.stderr[-3000:]}")
    return dt, p.stdout


def steady(metrics: Path) -> float:
    recs = [json.loads(x) for x in metrics.read_text().splitlines()]
    train = [r for r in recs if r.get("kind") == "train" and not r.get("warmup")]
    samples = sum(r["samples_per_s"] * r["step_time_s"] * LOG_EVERY for r in train)
    return samples / sum(r["step_time_s"] * LOG_EVERY for r in train)


def ddpflow_config(tmp: Path, root: Path, epochs: int) -> Path:
    cfg = {"run": "bench", "results_dir": str(tmp / "results"), "log_every_steps": LOG_EVERY,
           "data": {"source": "imagefolder", "path": str(root), "image_size": 32,
                    "loader": "device"},
           "model": {"name": "resnet18"},
           "hardware": {"device": "cpu", "nproc_per_node": 2},
           "checkpoint": {"every_steps": 0, "every_epochs": 1},
           "stages": [{"name": "s", "epochs": epochs, "batch_size": BATCH, "lr": LR,
                       "lr_scaling": "none", "warmup_epochs": 0, "precision": "fp32"}]}
    path = tmp / "ddpflow.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def ddpflow_round(tmp: Path, cfg: Path) -> dict:
    subprocess.run(["rm", "-rf", str(tmp / "results" / "bench" / "stages")], check=True)
    wall, _ = run([sys.executable, "-m", "ddpflow", "launch", "-c", str(cfg), "--stage", "s"])
    out = tmp / "results" / "bench" / "stages" / "s"
    s = json.loads((out / "summary.json").read_text())
    return {"wall_s": wall, "steady": steady(out / "metrics.jsonl"), "summary": s}


def lightning_round(root: Path, epochs: int, site: Path) -> dict:
    subprocess.run(["rm", "-rf", str(root / "lightning")], check=True)
    wall, out = run([sys.executable, str(HERE / "lightning_resnet.py"), str(root), str(epochs),
                     str(BATCH), str(LR), str(WORKERS), str(LOG_EVERY)],
                    env={"PYTHONPATH": str(site)})
    line = [x for x in out.splitlines() if x.startswith("{")][-1]
    return {"wall_s": wall, "steady": json.loads(line)["samples_per_s"]}


def bare_round(epochs: int, n_train: int) -> float:
    """The ceiling: bench/bare_ddp.py, the same steps with nothing around them."""
    steps = epochs * (n_train // (2 * BATCH))
    _, out = run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                  "--master_port", "29787", str(HERE / "bare_ddp.py"), str(steps), str(BATCH),
                  str(LR), str(LOG_EVERY)], env={"OMP_NUM_THREADS": "1"})
    return json.loads([x for x in out.splitlines() if x.startswith("{")][-1])["samples_per_s"]


def default_split(tmp: Path) -> dict:
    cfg = yaml.safe_load((HERE.parent / "config/config.yaml").read_text())
    cfg["results_dir"] = str(tmp / "default")
    cfg["stages"] = cfg["stages"][:1]
    cfg["stages"][0]["epochs"] = 1
    path = tmp / "default.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run([sys.executable, "-m", "ddpflow", "prepare", "-c", str(path)])
    wall, _ = run([sys.executable, "-m", "ddpflow", "launch", "-c", str(path), "--stage",
                   cfg["stages"][0]["name"]])
    s = json.loads((tmp / "default" / cfg["run"] / "stages" / cfg["stages"][0]["name"]
                    / "summary.json").read_text())
    torch_s, _ = run([sys.executable, "-c", "import torch"])
    return {"stopwatch_s": wall, "wall": s["wall"], "torch_import_s": torch_s,
            "steady": s["mean_samples_per_s"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--train", type=int, default=1280)
    ap.add_argument("--val", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    site = lightning_site()
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        root = tmp / "images"
        image_folder(root, args.train, args.val)
        cfg = ddpflow_config(tmp, root, args.epochs)
        prep_s, _ = run([sys.executable, "-m", "ddpflow", "prepare", "-c", str(cfg)])
        rounds = []
        for r in range(args.rounds):
            d, lt = ddpflow_round(tmp, cfg), lightning_round(root, args.epochs, site)
            rounds.append((d, lt, bare_round(args.epochs, args.train)))
            print(f"round {r}: ddpflow {d['wall_s']:.1f} s, {d['steady']:.1f} samples/s | "
                  f"lightning {lt['wall_s']:.1f} s, {lt['steady']:.1f} samples/s | "
                  f"bare DDP step {rounds[-1][2]:.1f} samples/s")
        d = min((x[0] for x in rounds), key=lambda x: x["wall_s"])
        lt = min((x[1] for x in rounds), key=lambda x: x["wall_s"])
        d_steady = max(x[0]["steady"] for x in rounds)
        lt_steady = max(x[1]["steady"] for x in rounds)
        ceiling = max(x[2] for x in rounds)
        split = {k: round(v, 2) for k, v in d["summary"]["wall"]["split_s"].items()}
        print(f"resnet18, {args.epochs} epochs x {args.train} images (32 px PNG), 2 ranks "
              f"x 1 thread, global batch {2 * BATCH}, best of {args.rounds} rounds")
        print(f"  wall time:  ddpflow {d['wall_s']:.1f} s   lightning {lt['wall_s']:.1f} s   "
              f"ratio {d['wall_s'] / lt['wall_s']:.2f} (ddpflow prepare, once: {prep_s:.1f} s)")
        print(f"  steady state: ddpflow {d_steady:.1f} samples/s   lightning "
              f"{lt_steady:.1f} samples/s   speed-up {d_steady / lt_steady:.2f}x")
        print(f"  ceiling (bench/bare_ddp.py: the same DDP step, nothing around it): "
              f"{ceiling:.1f} samples/s = ddpflow x{ceiling / d_steady:.2f}, lightning "
              f"x{ceiling / lt_steady:.2f}")
        print(f"  ddpflow wall split (s): {split}")
        ds = default_split(tmp)
        marks = ds["wall"]["startup_marks_s"]
        print(f"default config, 1 epoch: stopwatch {ds['stopwatch_s']:.2f} s, split total "
              f"{ds['wall']['total_s']:.2f} s, start-up {ds['wall']['split_s']['startup']:.2f} "
              f"s (first step done at {marks.get('first_step', 0):.2f} s); "
              f"`import torch` alone {ds['torch_import_s']:.2f} s")
        print(f"  start-up milestones (s since the command): {marks}")


if __name__ == "__main__":
    main()
