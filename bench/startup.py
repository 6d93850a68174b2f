"""Where a short stage's seconds before its first step go, this code against an earlier commit,
with and without MLflow; and the `image` rule with `container.engine: none`.

    python bench/startup.py [--before REV] [--rounds 3]

Each round runs every variant once, alternating (these machines are noisy): a 2-rank CPU stage
of one small epoch, read back from its summary.json (`wall.startup_marks_s`: seconds from the
`ddpflow launch` command's start to each milestone, and `wall.split_s.startup`). MLflow logs to
a SQLite store in the scratch folder. The earlier commit is extracted with `git archive` and
put first on PYTHONPATH (launcher and ranks). Prints medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARKS = ["rank_process", "rank_imports", "process_group", "data", "model", "resume",
         "first_step"]


def config(root: Path, run: str, mlflow: bool) -> Path:
    import yaml

    cfg = {"run": run, "results_dir": str(root / "results"), "seed": 0, "log_every_steps": 4,
           "data": {"source": "synthetic", "train_size": 512, "val_size": 128,
                    "test_size": 128, "image_size": 16, "loader": "device"},
           "hardware": {"nproc_per_node": 2, "threads_per_rank": 1},
           "container": {"engine": "none"},
           "tracking": {"tensorboard": False,
                        "mlflow": {"uri": f"sqlite:///{root}/mlflow.db" if mlflow else None}},
           "stages": [{"name": "s", "epochs": 1, "batch_size": 32, "lr": 0.05,
                       "precision": "fp32", "channels_last": False}]}
    path = root / f"{run}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def ddpflow(src: Path, *args, cwd: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(src)}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "ddpflow", *map(str, args)], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode:
        sys.exit(f"ddpflow {' '.join(map(str, args))} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def extract(rev: str, into: Path) -> Path:
    archive = into / "src.tar"
    with open(archive, "wb") as f:
        subprocess.run(["git", "archive", rev, "src", "workflow"], cwd=REPO, stdout=f, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", default="ae1125b", help="the earlier commit")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                         capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "old").mkdir()
        codes = {"before": extract(args.before, root / "old"), "now": REPO / "src"}
        marks: dict = {}
        image_s: dict = {c: [] for c in codes}
        for r in range(args.rounds):
            for code, src in codes.items():
                for mlflow in (False, True):
                    name = f"{code}-{'mlflow' if mlflow else 'plain'}"
                    cfg = config(root, f"{name}-{r}", mlflow)
                    ddpflow(src, "prepare", "--config", cfg, cwd=root)
                    ddpflow(src, "launch", "--config", cfg, "--stage", "s", cwd=root)
                    s = json.loads((root / f"results/{name}-{r}/stages/s/summary.json")
                                   .read_text())
                    m = {**s["wall"]["startup_marks_s"],
                         "startup_s": s["wall"]["split_s"]["startup"],
                         "total_s": s["wall"]["total_s"]}
                    for k, v in m.items():
                        marks.setdefault(name, {}).setdefault(k, []).append(v)
                image_s[code].append(ddpflow(src, "image", "--config", cfg, "--out",
                                             root / "image.json", cwd=root))
        print(f"bench/startup.py at commit {rev} (before = {args.before}), "
              f"{args.rounds} rounds, medians, seconds from `ddpflow launch`'s start")
        cols = MARKS + ["startup_s", "total_s"]
        print(f"{'variant':16}" + "".join(f"{c:>15}" for c in cols))
        med = {n: {k: statistics.median(v) for k, v in d.items()} for n, d in marks.items()}
        for name, d in med.items():
            print(f"{name:16}" + "".join(f"{d.get(c, float('nan')):>15.2f}" for c in cols))
        for code in codes:
            added = med[f"{code}-mlflow"]["first_step"] - med[f"{code}-plain"]["first_step"]
            print(f"{code}: MLflow adds {added:.2f} s before the first step; `ddpflow image` "
                  f"(engine none) {statistics.median(image_s[code]):.2f} s")


if __name__ == "__main__":
    main()
