"""`ddpflow collect`: every stage's summary and checkpoints into one place.

Writes under <run>/summary/:
    summary.json, summary.csv   one row per stage (numbers copied from each stage's summary)
    checkpoints/                final and best weights of each stage (hard links where the
                                filesystem allows, else copies) and index.json
    loss_accuracy.png, throughput.png, rank_step_time.png
    manifest.json               what reproduces the run: config, versions, image, commands
    report.html                 one self-contained page: headline, stages, plots, manifest
    headline.txt                what `make run` prints at the end
Works on an interrupted run: stages without a finished summary are listed as not
finished, with what is missing; malformed metrics lines are counted and named.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ddpflow import __version__
from ddpflow.config import Config
from ddpflow.core import reading
from ddpflow.core.checksum import sha256_of
from ddpflow.core.errors import UserError
from ddpflow.core.quoting import write_csv
from ddpflow.core.writing import write_json_atomic, write_text_atomic
from ddpflow.results import plots
from ddpflow.results.metrics import read_records
from ddpflow.results.provenance import git_revision, stage_result
from ddpflow.results.report import render
from ddpflow.results.summary import read_summary, result_text, summary_problem
from ddpflow.tracking.mlflowrun import finish_workflow_run
from ddpflow.tracking.records import flat

COLUMNS = ["stage", "finished", "epochs", "steps", "monitor", "best_value",
           "final_val_acc", "best_val_acc",
           "final_val_loss", "best_val_loss", "test_acc", "test_loss",
           "final_val_balanced_acc", "test_balanced_acc",
           "time_to_target_s", "early_stop",
           "wall_time_s", "wall_samples_per_s",
           "startup_s", "train_s", "data_wait_s", "validation_s", "checkpoint_s", "teardown_s",
           "mean_samples_per_s", "samples_per_s_per_rank", "data_wait_fraction", "mfu",
           "peak_mem_mib", "world_size", "strategy",
           # the largest rank's memory by kind, MiB (summary.json memory_per_rank)
           "mem_params_mib", "mem_grads_mib", "mem_optimizer_mib", "mem_activations_mib",
           "mem_activations_without_checkpointing_mib", "mem_peak_mib",
           "precision", "global_batch", "loader", "final_checkpoint", "final_sha256",
           "final_bytes", "best_checkpoint", "best_sha256", "best_bytes", "note"]


MEMORY_KINDS = ("params_mib", "grads_mib", "optimizer_mib", "activations_mib",
                "activations_without_checkpointing_mib", "peak_mib")


def _read_json(path: Path) -> dict | None:
    """command.json, image.json, an evaluation's metrics.json, a bundle's model.json: shown
    in the report when they are there and whole; missing or damaged, the report goes on
    without them (the command that reads each for real refuses it with its reason)."""
    return reading.read_json_or_none(path, {"type": "object"}, "report input")


def stage_row(cfg: Config, name: str) -> tuple[dict, list[dict]]:
    """(row, metrics records) for one stage, finished or not."""
    folder = cfg.stage_dir(name)
    row: dict = {"stage": name, "finished": False}
    notes: list[str] = []
    records: list[dict] = []
    if (folder / "metrics.jsonl").is_file():
        records, problems = read_records(folder / "metrics.jsonl")
        notes += problems
    s, stale = stage_result(cfg, name)
    if s is None:
        problem = summary_problem(folder / "summary.json")
        if problem:  # the report still comes out: the stage shows as not finished
            notes.append(f"not finished: {problem}")
        else:
            notes.append("not finished: no summary.json" if folder.is_dir()
                         else "not started: no stage folder")
        row["steps"] = max((r["step"] for r in records if "step" in r), default=0)
    else:
        row.update({k: s.get(k) for k in COLUMNS if k in s})
        # every validation metric of the task under its own name: final_val_x, best_val_x
        row.update({f"final_{k}": v for k, v in (s.get("final_metrics") or {}).items()})
        row.update({f"best_{k}": v for k, v in (s.get("best_metrics") or {}).items()})
        row.update(s.get("test_metrics") or {})  # test_<metric>: once, at the stage's end
        row["finished"] = stale is None  # a stale result is shown, never called finished
        if stale:
            row["stale"] = stale
            notes.append(f"{stale}; run the stage (or the workflow) again")
        # where the wall time went (summary "wall": from the command to the result)
        row.update({f"{k}_s": v for k, v in ((s.get("wall") or {}).get("split_s") or {}).items()})
        if row.get("mean_samples_per_s") is not None:
            row["samples_per_s_per_rank"] = row["mean_samples_per_s"] / s["world_size"]
        for k in MEMORY_KINDS:  # the largest rank's (FSDP's ranks hold different shards)
            row[f"mem_{k}"] = max((m[k] for m in s.get("memory_per_rank") or []
                                   if m.get(k) is not None), default=None)
        if s.get("early_stop"):  # stages[].stop: why it ended before its last epoch
            row["early_stop"] = f"step {s['early_stop']['step']}: {s['early_stop']['reason']}"
    for kind in ("final", "best"):
        p = folder / f"{kind}.pt"
        row[f"{kind}_checkpoint"] = str(p) if p.is_file() else None
        row[f"{kind}_sha256"] = sha256_of(p) if p.is_file() else None
        row[f"{kind}_bytes"] = p.stat().st_size if p.is_file() else None
        if s is not None and not p.is_file():
            notes.append(f"{kind}.pt is missing")
    traces = sorted((folder / "profile").glob("trace-rank*.json"))
    if traces:  # `profile:` asked for this stage
        row["profile_trace"] = ", ".join(str(p) for p in traces)
    row["note"] = "; ".join(notes)
    return row, records


def gather_checkpoints(rows: list[dict], out: Path) -> list[dict]:
    """Hard-link (or copy) each stage's final and best weights into out; return the index."""
    out.mkdir(parents=True, exist_ok=True)
    index = []
    for r in rows:
        for kind in ("final", "best"):
            src = r.get(f"{kind}_checkpoint")
            if not src:
                continue
            dst = out / f"{r['stage']}-{kind}.pt"
            dst.unlink(missing_ok=True)
            try:
                os.link(src, dst)
                how = "hard link"
            except OSError:
                shutil.copy2(src, dst)
                how = "copy"
            index.append({"stage": r["stage"], "kind": kind, "file": dst.name, "source": src,
                          "sha256": r[f"{kind}_sha256"], "bytes": r[f"{kind}_bytes"],
                          "stored_as": how,
                          "monitor": r.get("monitor"),
                          "value": r.get(f"final_{r.get('monitor')}" if kind == "final"
                                         else "best_value")})
    write_json_atomic(out / "index.json", {"checkpoints": index})
    return index


def manifest(cfg: Config, repo: Path) -> dict:
    """What is needed to reproduce the run, from the stages' own records."""
    stages = {}
    for stage in cfg.stages:
        folder = cfg.stage_dir(stage.name)
        s = read_summary(folder / "summary.json", damaged_ok=True) or {}
        stages[stage.name] = {"command": _read_json(folder / "command.json"),
                           "environment": s.get("environment"),
                           "container": s.get("container"), "config_hash": s.get("config_hash")}
    envs = [v["environment"] for v in stages.values() if v["environment"]]
    first = envs[0] if envs else {}
    return {
        "run": cfg.run, "config_hash": cfg.hash, "seed": cfg.seed,
        "deterministic": cfg.deterministic, "ddpflow_version": __version__,
        "git_revision": git_revision(repo),
        "torch": first.get("torch"), "cuda": first.get("cuda"), "cudnn": first.get("cudnn"),
        "nccl": first.get("nccl"), "gpus": first.get("gpus"), "driver": first.get("driver"),
        "python": first.get("python"), "host": first.get("host"),
        "image": _read_json(cfg.run_dir / "image.json"),
        "workflow_commands": ["snakemake --cores all  (or --profile profiles/slurm)",
                              *[f"ddpflow launch --config <config> --stage {stage.name}"
                                for stage in cfg.stages]],
        "stages": stages, "config": cfg.to_dict(),
    }


def collect(cfg: Config, repo: Path | None = None) -> dict:
    if not cfg.run_dir.is_dir() or not os.access(cfg.run_dir, os.R_OK | os.X_OK):
        raise UserError(f"no readable results folder at {cfg.run_dir}: check results_dir and "
                        f"run in the config, or run the workflow first")
    out = cfg.run_dir / "summary"
    out.mkdir(parents=True, exist_ok=True)
    # the last collect's report goes first: a collect stopped part-way (a signal, a full
    # disk) leaves files missing, never a stale report beside fresh tables
    _remove_outputs(out)
    try:
        return _collect(cfg, out, repo)
    except BaseException:  # SIGTERM (cli raises Stopped), Ctrl-C, an error: keep no part
        _remove_outputs(out)
        raise


OUTPUTS = ("summary.json", "summary.csv", "report.html", "headline.txt", "manifest.json")


def _remove_outputs(out: Path) -> None:
    for path in [*(out / n for n in OUTPUTS), *out.glob("*.png")]:
        path.unlink(missing_ok=True)


def _collect(cfg: Config, out: Path, repo: Path | None) -> dict:
    pairs = [stage_row(cfg, stage.name) for stage in cfg.stages]
    rows = [r for r, _ in pairs]
    stage_records = [(stage.name, recs) for stage, (_, recs) in zip(cfg.stages, pairs)]
    index = gather_checkpoints(rows, out / "checkpoints")
    figures = {}
    metric = monitored(cfg, rows)
    if any(recs for _, recs in stage_records):
        figures["loss_accuracy"] = plots.loss_accuracy(stage_records, out / "loss_accuracy.png",
                                                       metric)
        figures["throughput"] = plots.throughput(stage_records, out / "throughput.png")
        figures["rank_step_time"] = plots.rank_step_times(stage_records,
                                                          out / "rank_step_time.png")
    evaluation, bundle, folders = held_out_results(cfg, out, figures)
    man = manifest(cfg, Path(repo or Path.cwd()))
    write_json_atomic(out / "manifest.json", man)
    summary = {"run": cfg.run, "config_hash": cfg.hash,
               "finished": all(r["finished"] for r in rows), "stages": rows,
               "checkpoints": index, "figures": sorted(figures),
               "evaluation": evaluation, "export": bundle,
               "config": cfg.to_dict()}
    # a number per cell: per-class lists (val_recall) stay in summary.json and the report
    metric_columns = sorted({k for r in rows for k, v in r.items()
                             if k.startswith(("final_val_", "best_val_"))
                             and not isinstance(v, list)} - set(COLUMNS))
    write_csv(out / "summary.csv", COLUMNS + metric_columns, rows)
    classes = (_read_json(cfg.data_dir / "meta.json") or {}).get("classes")
    write_text_atomic(out / "report.html", render(cfg, summary, man, figures, metric, classes))
    write_text_atomic(out / "headline.txt", headline(cfg, rows, evaluation, classes))
    write_json_atomic(out / "summary.json", summary)  # last: it says the collect finished
    finish_workflow_run(cfg, [out / n for n in OUTPUTS]  # tracking.mlflow: the report
                        + sorted(out.glob("*.png")) + folders, params=flat(cfg.to_dict()),
                        metrics=headline_metrics(rows, evaluation))
    return summary


def headline_metrics(rows: list[dict], evaluation: dict | None) -> dict:
    """The run's figures as its MLflow run shows them: the last stage's final and best
    validation metrics, its test metrics, and `ddpflow evaluate`'s test split accuracy."""
    last = rows[-1] if rows else {}
    out = {k: v for k, v in last.items()
           if k.startswith(("final_val_", "best_val_", "test_")) and isinstance(v, (int, float))
           and not isinstance(v, bool)}
    if evaluation and isinstance(evaluation.get("acc"), (int, float)):
        out["test_split_acc"] = evaluation["acc"]
    return out


def held_out_results(cfg: Config, out: Path, figures: dict) -> tuple:
    """(evaluation, export, folders): `ddpflow evaluate`'s result for the last stage on the
    test split and the export bundle's model.json, when the workflow made them (None
    otherwise); the confusion matrix joins the figures."""
    last = cfg.stages[-1].name
    folder = cfg.run_dir / "evaluate" / last / "test-final"
    evaluation = _read_json(folder / "metrics.json")
    if evaluation is not None and (folder / "confusion.png").is_file():
        shutil.copyfile(folder / "confusion.png", out / "confusion_test.png")
        figures["confusion_test"] = out / "confusion_test.png"
    bundle = _read_json(cfg.run_dir / "export" / "model.json")
    if bundle is not None:
        bundle = {"folder": str(cfg.run_dir / "export"), "files": bundle.get("files"),
                  "checks": bundle.get("checks"), "source": bundle.get("source"),
                  "check_rule": bundle.get("check_rule")}
    folders = [p for p in (folder, cfg.run_dir / "export") if p.is_dir()]
    return evaluation, bundle, folders


def monitored(cfg: Config, rows: list[dict]) -> str:
    """The validation metric the run is judged by (what chose best.pt)."""
    recorded = [r["monitor"] for r in rows if r.get("monitor")]
    if recorded:
        return recorded[0]
    return cfg.task.monitor or ("val_acc" if cfg.task.name == "classification" else "val_loss")


def imbalance_text(r: dict, classes: list | None) -> str | None:
    """'balanced acc 0.8120, lowest class recall 0.4100 (cat)': a classification stage's
    figures that show imbalance (None for other tasks)."""
    bal, recall = r.get("final_val_balanced_acc"), r.get("final_val_recall")
    if bal is None:
        return None
    text = f"balanced acc {bal:.4f}"
    known = [(v, i) for i, v in enumerate(recall or []) if v is not None]
    if known:
        low, i = min(known)
        name = classes[i] if classes and i < len(classes) else f"class {i}"
        text += f", lowest class recall {low:.4f} ({name})"
    return text


def headline(cfg: Config, rows: list[dict], evaluation: dict | None = None,
             classes: list | None = None) -> str:
    lines = [f"ddpflow run '{cfg.run}': {cfg.run_dir / 'summary' / 'report.html'}"]
    for r in rows:
        if r["finished"]:
            m = r.get("monitor") or "val_acc"
            test = "test_" + m.split("_", 1)[-1]
            shown = result_text({"monitor": m, "final_metrics": {m: r.get(f"final_{m}")},
                                 "best_value": r.get("best_value", r.get("best_val_acc")),
                                 test: r.get(test)})
            lines.append(f"  {r['stage']:12s} {shown}  {r['steps']} steps  "
                         f"{r['wall_time_s']:.0f} s ({r.get('startup_s') or 0:.0f} s start-up)  "
                         f"{r.get('wall_samples_per_s') or 0:.0f} samples/s overall, "
                         f"{r['mean_samples_per_s'] or 0:.0f} in steady state "
                         f"on {r['world_size']} rank(s), {r['precision']}"
                         + (f"  (target reached after {r['time_to_target_s']:.0f} s)"
                            if r.get("time_to_target_s") is not None else ""))
            imbalance = imbalance_text(r, classes)
            if imbalance:  # on the validation split
                lines.append(f"  {'':12s} val {imbalance}")
        else:
            what = "STALE" if r.get("stale") else "NOT FINISHED"
            lines.append(f"  {r['stage']:12s} {what} ({r['note']})")
    if evaluation and evaluation.get("samples"):
        # the same weights as the stage's test_acc when it trained in fp32; in bf16 or fp16
        # the stage's own figure differs in the 4th digit: say which is which
        w = evaluation["weights"]
        bal = evaluation.get("balanced_acc")
        lines.append(f"  test split   acc {evaluation['acc']:.4f}, top-5 {evaluation['top5']:.4f}"
                     + (f", balanced acc {bal:.4f}" if bal is not None else "")
                     + f" on {evaluation['samples']} held-out images: `ddpflow evaluate` of "
                     f"{evaluation['stage']}'s {Path(w.get('file') or 'final.pt').name} "
                     f"({w['holds']} weights) in fp32")
    return "\n".join(lines) + "\n"
