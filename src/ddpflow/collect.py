"""`ddpflow collect`: every stage's summary and checkpoints into one place.

Writes under <run>/summary/: summary.json and summary.csv (one row per stage),
headline.txt (what `make run` prints at the end). Works on an interrupted run: stages
without a finished summary are listed as not finished, with what is missing.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from .checkpoint import sha256_of
from .config import Config
from .data.prepared import write_json_atomic
from .metrics import read_records
from .summary import read_summary

COLUMNS = ["stage", "finished", "epochs", "steps", "final_val_acc", "best_val_acc",
           "final_val_loss", "best_val_loss", "wall_time_s", "mean_samples_per_s",
           "samples_per_s_per_rank", "data_wait_fraction", "peak_mem_mib", "world_size",
           "precision", "global_batch", "loader", "final_checkpoint", "final_sha256",
           "final_bytes", "best_checkpoint", "best_sha256", "best_bytes", "note"]


def _file_info(path: Path) -> tuple[str | None, str | None, int | None]:
    if not path.is_file():
        return None, None, None
    return str(path), sha256_of(path), path.stat().st_size


def stage_row(cfg: Config, name: str) -> dict:
    folder = cfg.stage_dir(name)
    row: dict = {"stage": name, "finished": False}
    notes = []
    records: list[dict] = []
    if (folder / "metrics.jsonl").is_file():
        records, problems = read_records(folder / "metrics.jsonl")
        notes += problems
    s = read_summary(folder / "summary.json")
    if s is None:
        notes.append("not finished: no summary.json" if folder.is_dir()
                     else "not started: no stage folder")
        steps = [r["step"] for r in records if "step" in r]
        row["steps"] = max(steps) if steps else 0
    else:
        row.update({k: s.get(k) for k in COLUMNS if k in s})
        row["finished"] = True
        train = [r for r in records if r.get("kind") == "train" and not r.get("warmup")]
        if train:
            row["data_wait_fraction"] = sum(r["data_wait_fraction"] for r in train) / len(train)
            row["peak_mem_mib"] = max(r["peak_mem_mib"] for r in train)
            row["samples_per_s_per_rank"] = (row["mean_samples_per_s"] or 0) / s["world_size"]
        notes += s.get("metrics_problems", [])
    for kind in ("final", "best"):
        path, digest, size = _file_info(folder / f"{kind}.pt")
        row[f"{kind}_checkpoint"], row[f"{kind}_sha256"], row[f"{kind}_bytes"] = path, digest, size
    row["note"] = "; ".join(notes)
    return row


def collect(cfg: Config) -> dict:
    out = cfg.run_dir / "summary"
    out.mkdir(parents=True, exist_ok=True)
    rows = [stage_row(cfg, st.name) for st in cfg.stages]
    summary = {"run": cfg.run, "config_hash": cfg.hash, "config": cfg.to_dict(),
               "stages": rows, "finished": all(r["finished"] for r in rows)}
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow(r)
    (out / "summary.csv").write_text(buf.getvalue())
    write_json_atomic(out / "summary.json", summary)
    (out / "headline.txt").write_text(headline(cfg, rows))
    return summary


def headline(cfg: Config, rows: list[dict]) -> str:
    lines = [f"ddpflow run '{cfg.run}': {cfg.run_dir / 'summary' / 'summary.json'}"]
    for r in rows:
        if r["finished"]:
            lines.append(f"  {r['stage']:12s} val_acc {r['final_val_acc']:.4f} "
                         f"(best {r['best_val_acc']:.4f})  {r['steps']} steps  "
                         f"{r['wall_time_s']:.0f} s  {r['mean_samples_per_s'] or 0:.0f} samples/s "
                         f"on {r['world_size']} rank(s), {r['precision']}")
        else:
            lines.append(f"  {r['stage']:12s} NOT FINISHED ({r['note']})")
    return "\n".join(lines) + "\n"


