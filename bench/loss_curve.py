"""The numbers do not move: the default config's loss at every logged step, bit for bit,
against the curve recorded before a refactor (TorchTitan's rule for refactors).

    python bench/loss_curve.py            # train, compare with bench/loss_curve.json
    python bench/loss_curve.py --record   # train, write bench/loss_curve.json (before a
                                          # refactor, at the commit it starts from)

config/config.yaml as shipped, with what would make it vary between machines pinned:
deterministic: true, fp32 (`auto` picks bf16 on a CPU with native bf16), channels_last off
(`auto` times a probe), one rank, one thread. Both stages run through the real `ddpflow
prepare` and `ddpflow launch`; every `train` line of metrics.jsonl gives (step, loss). The
comparison is exact (float equality of the logged values): any change to what the loop
computes, or in which order, shows. Minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "loss_curve.json"
PINNED = ["deterministic=true", "hardware.nproc_per_node=1", "hardware.threads_per_rank=1",
          "data.loader=device"]
PER_STAGE = ["precision=fp32", "channels_last=false"]


def curve(results: Path) -> dict:
    config = REPO / "config" / "config.yaml"
    stages = ["warmup", "finetune"]
    sets = [f"results_dir={results}", *PINNED,
            *(f"stages.{i}.{kv}" for i in range(len(stages)) for kv in PER_STAGE)]
    args = [a for kv in sets for a in ("--set", kv)]
    run = lambda *cmd: subprocess.run([sys.executable, "-m", "ddpflow", *cmd, "--config",  # noqa: E731
                                       str(config), *args], check=True, capture_output=True,
                                      text=True)
    run("prepare")
    out = {}
    for stage in stages:
        run("launch", "--stage", stage)
        lines = (results / "default" / "stages" / stage / "metrics.jsonl").read_text()
        out[stage] = [[r["step"], r["loss"]] for r in map(json.loads, lines.splitlines())
                      if r.get("kind") == "train"]
        print(f"{stage}: {len(out[stage])} logged steps, last loss {out[stage][-1][1]!r}",
              flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", action="store_true", help=f"write {OUT.relative_to(REPO)}")
    a = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        got = curve(Path(tmp) / "results")
    if a.record:
        OUT.write_text(json.dumps({"commit": commit, "pinned": PINNED + PER_STAGE,
                                   "curves": got}, indent=1) + "\n")
        print(f"recorded at {commit}: {OUT.relative_to(REPO)}")
        return 0
    ref = json.loads(OUT.read_text())
    same = True
    for stage, points in ref["curves"].items():
        mine = got.get(stage, [])
        diff = next((i for i, (p, q) in enumerate(zip(points, mine)) if p != q), None)
        if diff is None and len(points) == len(mine):
            print(f"{stage}: {len(points)} logged losses bit-identical to {ref['commit']}")
            continue
        same = False
        where = diff if diff is not None else min(len(points), len(mine))
        print(f"{stage}: differs from {ref['commit']} at logged point {where}: "
              f"{points[where] if where < len(points) else None} (recorded) vs "
              f"{mine[where] if where < len(mine) else None} (now)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
