"""A sweep through the slot pool vs the same trials one after the other.

    python bench/sweep_pool.py [--trials 4] [--epochs 2]

Both sides are real `snakemake --cores N` runs of the same sweep (a grid over the learning
rate, smallcnn on synthetic 32 px data, 1 rank per trial) in a temporary folder:
  pool:       sweep.threads_per_trial 1 -> one slot per core, trials side by side
  sequential: sweep.threads_per_trial = all cores -> one slot, one trial at a time with
              every core
Prints each side's wall time (the whole snakemake command), the ratio, and the pool's slot
occupancy: the share of the trials' span (first slot taken to last released) during which
every slot was held, from the trials' own slot records (slot.json).
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

import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def config(trials: int, epochs: int, threads: int) -> dict:
    return {
        "run": "bench", "log_every_steps": 8,
        "data": {"train_size": 2048, "val_size": 512, "image_size": 32},
        "hardware": {"device": "cpu"},
        "stages": [{"name": "a", "epochs": epochs, "batch_size": 64, "lr": 0.1}],
        "sweep": {"grid": {"stages.0.lr": [round(0.02 * (i + 1), 2) for i in range(trials)]},
                  "threads_per_trial": threads},
    }


def run(folder: Path, cfg: dict, cores: int) -> float:
    folder.mkdir(parents=True)
    (folder / "c.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    # the image and data jobs first (not timed: the same for both sides)
    base = [str(BIN / "snakemake"), "-s", str(REPO / "Snakefile"), "-d", str(folder),
            "--configfile", str(folder / "c.yaml"), "--cores", str(cores)]
    prep = subprocess.run([*base, "--until", "sweep_prepare_data", "image"], cwd=folder,
                          env=env, capture_output=True, text=True)
    assert prep.returncode == 0, prep.stderr[-2000:]
    t0 = time.perf_counter()
    proc = subprocess.run(base, cwd=folder, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    return wall


def occupancy(folder: Path) -> tuple[float, float, int]:
    """(share of the span with every slot held, span seconds, slots)."""
    holds = [json.loads(p.read_text()) for p in folder.glob("results/bench/trials/*/stages/"
                                                              "a/slot.json")]
    slots = holds[0]["slots"]
    events = sorted([(h["acquired_at"], 1) for h in holds] + [(h["released_at"], -1)
                                                              for h in holds])
    start, end = events[0][0], events[-1][0]
    full, busy, last = 0.0, 0, start
    for t, d in events:
        if busy >= slots:
            full += t - last
        busy, last = busy + d, t
    return full / (end - start), end - start, slots


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as d:
        seq = run(Path(d) / "seq", config(args.trials, args.epochs, cores), cores)
        pool = run(Path(d) / "pool", config(args.trials, args.epochs, 1), cores)
        occ, span, slots = occupancy(Path(d) / "pool")
    print(f"{args.trials} trials (smallcnn, {args.epochs} epochs x 2048 samples, 1 rank each) "
          f"on {cores} cores")
    print(f"  sequential, 1 slot x {cores} threads: {seq:.1f} s")
    print(f"  pool, {slots} slots x 1 thread:       {pool:.1f} s")
    print(f"  wall-time ratio pool/sequential: {pool / seq:.2f}")
    print(f"  slot occupancy (every slot held, over the trials' span of {span:.1f} s): "
          f"{occ:.2f}")


if __name__ == "__main__":
    main()
