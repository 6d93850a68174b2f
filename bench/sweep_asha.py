"""A full grid vs successive halving (ASHA) on the same trials, on sklearn's digits.

    pip install 'ddpflow[bench]'        # scikit-learn: the digits ship inside it
    python bench/sweep_asha.py [--epochs 9] [--seeds 4]

The data is sklearn's 1797 handwritten digits (8 x 8 px, 10 classes) through the real data
seam (`data.source: python`, `data.factory: digits_data:make`, bench/digits/), the
model the built-in mlp. 16 trials: learning rate (4) x weight decay (2) x width (2), seed 0,
deterministic. Both sides are one real `snakemake --cores N` run of the same sweep, side by
side in one temporary folder:
  grid:  every trial to its last epoch (`sweep.scheduler: none`)
  asha3: `sweep.scheduler: asha`, eta 3 (the default): rungs at 1, 3 and 9 epochs
  asha4: eta 4: rungs at 1, 4 and 9 epochs
The grid's seed-to-seed noise: its best trial's settings trained again with `--seeds` other
seeds (one more real sweep over `seed`). Prints the best trial of each side with its best
validation accuracy, the noise (standard deviation and range over the seeds), and the
trial-epochs each side trained with their ratio to the grid's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
GRID = {"stages.0.lr": [0.003, 0.01, 0.05, 0.3], "stages.0.weight_decay": [0.0, 0.01],
        "model.kwargs.hidden": [16, 128]}


def config(run: str, epochs: int, sweep: dict) -> dict:
    return {
        "run": run, "seed": 0, "deterministic": True, "log_every_steps": 20,
        "data": {"source": "python", "factory": "digits_data:make",
                 "code_dir": str(REPO / "bench" / "digits"), "materialize": True,
                 "image_size": 8, "num_workers": 0,
                 "augment": {"crop_padding": 0, "flip": False}},
        "model": {"name": "mlp", "kwargs": {"hidden": 64}},
        "hardware": {"device": "cpu", "nproc_per_node": 1, "threads_per_rank": 1},
        "checkpoint": {"every_steps": 0},
        "stages": [{"name": "fit", "epochs": epochs, "batch_size": 32, "lr": 0.05,
                    "optimizer": "sgd", "momentum": 0.9, "warmup_epochs": 0,
                    "schedule": "cosine", "precision": "fp32", "channels_last": False}],
        "sweep": {"threads_per_trial": 1, **sweep},
    }


def run(folder: Path, cfg: dict, cores: int) -> tuple[dict, float]:
    """One real snakemake run of the sweep; (leaderboard.json, wall seconds)."""
    (folder / f"{cfg['run']}.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    t0 = time.perf_counter()
    proc = subprocess.run([str(BIN / "snakemake"), "-s", str(REPO / "Snakefile"), "-d",
                           str(folder), "--configfile", str(folder / f"{cfg['run']}.yaml"),
                           "--cores", str(cores)], cwd=folder, env=env, capture_output=True,
                          text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"{cfg['run']}: snakemake failed:\n{proc.stderr[-3000:]}")
    board = json.loads((folder / "results" / cfg["run"] / "sweep/leaderboard.json").read_text())
    return board, wall


def best(board: dict) -> dict:
    return next(r for r in board["trials"] if r["best"])


def settings(row: dict) -> str:
    return ", ".join(f"{k.split('.')[-1]} {row[f'param:{k}']}" for k in GRID)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=9)
    ap.add_argument("--seeds", type=int, default=4)
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        grid, t_grid = run(folder, config("grid", args.epochs, {"grid": GRID}), cores)
        ashas = {eta: run(folder, config(f"asha{eta}", args.epochs, {
            "grid": GRID, "scheduler": "asha", "asha": {"eta": eta, "min_epochs": 1}}), cores)
            for eta in (3, 4)}
        g = best(grid)
        noise_cfg = config("noise", args.epochs, {"grid": {
            "seed": list(range(1, args.seeds + 1))}})
        for key in GRID:
            stage_key = key.split(".", 2)[-1] if key.startswith("stages.0.") else None
            if stage_key:
                noise_cfg["stages"][0][stage_key] = g[f"param:{key}"]
            else:
                noise_cfg["model"]["kwargs"]["hidden"] = g[f"param:{key}"]
        noise, _ = run(folder, noise_cfg, cores)
    values = [g["best_value"]] + [r["best_value"] for r in noise["trials"]]
    sd, spread = statistics.stdev(values), max(values) - min(values)
    n = len(grid["trials"])
    grid_epochs = n * args.epochs
    print(f"digits (sklearn, 1257 train / 270 val), mlp, {n} trials (lr x weight decay x "
          f"width), {args.epochs} epochs, seed 0, {cores} cores, 1 trial per core")
    print(f"  grid: best {g['trial']} ({settings(g)}): val_acc {g['best_value']:.4f}; "
          f"{grid_epochs} trial-epochs, {t_grid:.0f} s")
    print(f"  seed-to-seed noise of the grid's best settings ({len(values)} seeds): "
          f"val_acc {min(values):.4f}..{max(values):.4f}, sd {sd:.4f}, range {spread:.4f}")
    for eta, (board, wall) in ashas.items():
        a = best(board)
        spent, diff = board["schedule"]["spent_epochs"], g["best_value"] - a["best_value"]
        print(f"  asha eta {eta}: best {a['trial']} ({settings(a)}): val_acc "
              f"{a['best_value']:.4f}; rungs {board['schedule']['rungs']}")
        where = "within" if abs(diff) <= spread else "outside"
        print(f"    grid best - asha best: {diff:.4f} ({where} the seeds' range); "
              f"trial-epochs asha/grid: {spent}/{grid_epochs} = "
              f"{spent / grid_epochs:.3f}; wall time asha/grid: {wall:.0f}/{t_grid:.0f} s = "
              f"{wall / t_grid:.2f}")


if __name__ == "__main__":
    main()
