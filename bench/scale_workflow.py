"""How the workflow's own overhead grows with a sweep: Snakemake's DAG build (a dry run,
which includes `ddpflow sweep plan` checking every trial's config) against the number of
trials and stages, and a no-op rerun (everything up to date) of a real sweep.

    python bench/scale_workflow.py [--trials 10,100,1000] [--stages 1,3] [--real 4]

Dry runs: `snakemake -n` of a grid sweep over stages.0.lr with N trials of S stages, in a
fresh folder (nothing done yet: the plan of every job). No-op rerun: a real sweep of
`--real` trials (1 stage, 2 steps each) run to the end, then the same command again and a
dry run of it, each timed; per job, the no-op rerun costs (noop - dry) / jobs more than the
dry run, which extrapolates it to the larger sweeps.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def config(trials: int, stages: int, steps: int = 2) -> dict:
    return {
        "run": "bench", "log_every_steps": 1,
        "data": {"train_size": 256, "val_size": 64, "test_size": 64, "image_size": 16,
                 "difficulty": 0},
        "hardware": {"device": "cpu"},
        "stages": [{"name": f"s{i}", "max_steps": steps, "batch_size": 32, "lr": 0.1,
                    **({"init_from": "previous"} if i else {})} for i in range(stages)],
        "sweep": {"grid": {"stages.0.lr": [round(1e-3 * (i + 1), 6) for i in range(trials)]},
                  "threads_per_trial": 1, "max_trials": max(1000, trials)},
    }


def snakemake(folder: Path, cfg: dict, *extra: str) -> tuple[float, str]:
    (folder / "c.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    cmd = [str(BIN / "snakemake"), "-s", str(REPO / "Snakefile"), "-d", str(folder),
           "--configfile", str(folder / "c.yaml"), "--cores", "2", *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"snakemake {' '.join(extra)} failed:\n{proc.stderr[-3000:]}")
    return wall, proc.stdout + proc.stderr


def jobs_in(log: str) -> int:
    m = re.search(r"^total\s+(\d+)", log, re.M)
    return int(m.group(1)) if m else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", default="10,100,1000")
    ap.add_argument("--stages", default="1,3")
    ap.add_argument("--real", type=int, default=4)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="ddpflow-dag-") as tmp:
        for s in map(int, args.stages.split(",")):
            for n in map(int, args.trials.split(",")):
                folder = Path(tmp) / f"dry-{n}-{s}"
                folder.mkdir()
                wall, log = snakemake(folder, config(n, s), "-n")
                rows.append({"trials": n, "stages": s, "jobs": jobs_in(log), "dry_s": wall})
                print(rows[-1], flush=True)
        real = Path(tmp) / "real"
        real.mkdir()
        cfg = config(args.real, 1)
        snakemake(real, cfg)  # the real sweep, to the end (not timed)
        noop, log = snakemake(real, cfg)
        if "Nothing to be done" not in log:
            sys.exit(f"the rerun was not a no-op:\n{log[-2000:]}")
        dry_done, _ = snakemake(real, cfg, "-n")
        _, plan = snakemake(Path(tempfile.mkdtemp(dir=tmp)), cfg, "-n")
    jobs = jobs_in(plan)
    per_job = max(0.0, (noop - dry_done) / max(jobs, 1))
    print(f"\nsnakemake dry run (DAG build + `ddpflow sweep plan`), 2 cores, "
          f"python {sys.version.split()[0]}")
    print("trials  stages  jobs  dry run s  per job ms  no-op rerun s (extrapolated)")
    for r in rows:
        print(f"{r['trials']:>6}  {r['stages']:>6}  {r['jobs']:>4}  {r['dry_s']:9.1f}  "
              f"{r['dry_s'] / max(r['jobs'], 1) * 1e3:10.1f}  "
              f"{r['dry_s'] + per_job * r['jobs']:8.1f}")
    print(f"real sweep of {args.real} trials x 1 stage ({jobs} jobs): no-op rerun {noop:.1f} s, "
          f"its dry run {dry_done:.1f} s, extra per job {per_job * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
