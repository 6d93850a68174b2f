"""`ddpflow sweep collect`: every trial of a sweep in one leaderboard.

Writes under <run>/sweep/:
    leaderboard.csv, leaderboard.json   one row per trial (failed and unfinished ones too,
                                        with their reason), best trial marked
    metric_vs_<key>.png                 the monitored metric against each swept key
    metric_vs_wall_time.png             ... and against each trial's wall time
    report.html                         the table, the plots, links to every trial's report
A trial's numbers come from its last stage (the weights the run hands on); its wall time
and GPU-hours add up all its stages. Results that are stale (made with other settings,
code or data) are shown as stale, never as finished.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from ddpflow.config import Config, from_dict
from ddpflow.core import reading
from ddpflow.core.quoting import html_text, shell_line, write_csv
from ddpflow.core.writing import output_lock, write_json_atomic, write_text_atomic
from ddpflow.launch.slots import read_record
from ddpflow.results.collect import stage_row
from ddpflow.results.report import CSS, ONLOAD, _fmt, _img
from ddpflow.sweeps import scheduleboard
from ddpflow.sweeps.plan import PLAN_FIX, read_plan, trial_config_path
from ddpflow.tracking.mlflowrun import finish_workflow_run

COLUMNS = ["rank", "trial", "best", "status", "reason", "monitor", "mode", "final_value",
           "best_value", "test_value", "wall_time_s", "wall_samples_per_s", "gpu_hours",
           "steps", "weights", "report"]


def reason_from_log(log: Path) -> str | None:
    """The launcher's last error line, else the log's last line (a traceback's end)."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return None
    errors = [ln for ln in lines if "error:" in ln]
    text = (errors or lines or [None])[-1]
    return text[:300] if text else None


def trial_row(cfg: Config, entry: dict, logs: Path) -> dict:
    """One trial's row from its stages' summaries (stage_row: freshness included); `cfg`
    is the sweep's, `entry` the trial's row of the validated plan."""
    config_path = trial_config_path(cfg, entry)
    cfg = from_dict(reading.read_json(config_path, {"type": "object"},
                                      f"trial {entry['id']}'s config", PLAN_FIX))
    rows = [stage_row(cfg, stage.name)[0] for stage in cfg.stages]
    last = rows[-1]
    row = {"trial": entry["id"], "variant": entry.get("variant"),
           "overrides": entry["overrides"], **{
        f"param:{k}": v for k, v in entry["overrides"].items()}}
    wall = [r.get("wall_time_s") for r in rows if r.get("finished")]
    row["wall_time_s"] = round(sum(wall), 2) if wall else None
    gpus = 0
    slots = []
    for stage in cfg.stages:
        rec = read_record(cfg.stage_dir(stage.name) / "slot.json")
        if rec:
            slots.append({"stage": stage.name, **rec})
            gpus = max(gpus, len(rec.get("gpus") or []))
    row["slots"] = slots
    row["gpu_hours"] = round(row["wall_time_s"] * gpus / 3600, 4) if wall and gpus else 0.0
    row.update(monitor=last.get("monitor"), mode=_mode(cfg), steps=sum(
        r.get("steps") or 0 for r in rows), wall_samples_per_s=last.get("wall_samples_per_s"))
    m = last.get("monitor")
    row["final_value"] = last.get(f"final_{m}") if m else None
    row["best_value"] = last.get("best_value")
    row["test_value"] = last.get("test_" + m.split("_", 1)[-1]) if m else None
    row["weights"] = last.get("best_checkpoint") or last.get("final_checkpoint")
    row["report"] = str(cfg.run_dir / "summary" / "report.html")
    row["config"] = str(config_path)  # what export and evaluate of this trial take
    row["status"], row["reason"] = _status(cfg, rows, logs / entry["id"])
    return row


def _mode(cfg: Config) -> str | None:
    """min | max of the monitored metric, as the last stage recorded it (only finished
    trials, which have a summary, are ranked by it)."""
    summary = _read(cfg.stage_dir(cfg.stages[-1].name) / "summary.json") or {}
    return summary.get("monitor_mode")


def _read(path: Path) -> dict | None:
    """A stage's summary.json or failed.json, or None (missing or damaged: collect's row for
    the stage already says what is wrong with it)."""
    return reading.read_json_or_none(path, {"type": "object"}, "stage record")


def _status(cfg: Config, rows: list[dict], logs: Path) -> tuple[str, str]:
    """finished | stale | diverged | failed | not finished, and why (first bad stage)."""
    for stage, r in zip(cfg.stages, rows):
        if r.get("finished"):
            continue
        if r.get("stale"):
            return "stale", f"stage {stage.name}: {r['stale']}"
        failed = _read(cfg.stage_dir(stage.name) / "failed.json")
        if failed:
            return "diverged", f"stage {stage.name}: {failed.get('reason')}"
        reason = reason_from_log(logs / f"train_{stage.name}.log")
        if reason:
            return "failed", f"stage {stage.name}: {reason}"
        return "not finished", f"stage {stage.name}: {r.get('note') or 'not run'}"
    return "finished", ""


def rank(rows: list[dict]) -> list[dict]:
    """Order by the monitored value (best value of the last stage), finished trials first;
    mark the best one."""
    def key(r):
        v = r.get("best_value")
        ok = r["status"] == "finished" and isinstance(v, (int, float)) and math.isfinite(v)
        return (0, -v if r.get("mode") == "max" else v) if ok else (1, 0)

    rows = sorted(rows, key=lambda r: (key(r), r["trial"]))
    for i, r in enumerate(rows):
        r["rank"] = i + 1
        r["best"] = i == 0 and key(r)[0] == 0
    return rows


def collect(cfg: Config, logs: Path | None = None) -> str:
    """Write the leaderboard files; return the headline text."""
    plan = read_plan(cfg)
    logs = Path(logs or cfg.run_dir / "logs" / "trials")
    schedule = None
    if cfg.sweep.scheduled:  # each trial's rung, status and epochs from the scheduler's state
        rows, schedule = scheduleboard.scheduled_rows(cfg, plan, logs, trial_row)
    else:
        rows = rank([trial_row(cfg, e, logs) for e in plan["trials"]])
    out = cfg.run_dir / "sweep"
    swept = plan["swept"]
    fields = COLUMNS[:3] + ["variant"] + [f"param:{k}" for k in swept] + COLUMNS[3:] + (
        scheduleboard.COLUMNS if schedule else [])
    best = next((r for r in rows if r["best"]), None)
    # one writer at a time; the last leaderboard goes first and headline.txt (the file that
    # says the set is complete) comes last: a collect killed part-way (even by SIGKILL)
    # leaves no headline and no stale file beside new ones, and the next collect rewrites all
    with output_lock(out, "the sweep leaderboard"):
        out.mkdir(parents=True, exist_ok=True)
        _remove_outputs(out)
        try:
            figures = _plots(rows, swept, out, schedule)
            board = {"run": cfg.run, "swept": swept, "trials": rows, "best": best and {
                "trial": best["trial"], "value": best["best_value"], "monitor":
                best["monitor"], "weights": best["weights"]},
                "figures": sorted(p.name for p in figures.values()), "schedule": schedule}
            write_csv(out / "leaderboard.csv", fields, rows)
            write_json_atomic(out / "leaderboard.json", board)
            write_text_atomic(out / "report.html", render(cfg, board, figures, out))
            text = headline(cfg, rows, best, out, schedule)
            write_text_atomic(out / "headline.txt", text)
        except BaseException:  # SIGTERM (cli raises Stopped), Ctrl-C, an error: no part kept
            _remove_outputs(out)
            raise
    finish_workflow_run(cfg, [out / n for n in ("leaderboard.csv", "leaderboard.json",
                                                "report.html", "headline.txt")]
                        + sorted(figures.values()), sweep=True)
    return text


OUTPUTS = ("headline.txt", "leaderboard.csv", "leaderboard.json", "report.html")


def _remove_outputs(out: Path) -> None:
    """The leaderboard's files, headline.txt (the mark of a complete set) first."""
    for path in [*(out / n for n in OUTPUTS), *out.glob("metric_vs_*.png")]:
        path.unlink(missing_ok=True)


def headline(cfg: Config, rows: list[dict], best: dict | None, out: Path,
             schedule: dict | None = None) -> str:
    done = sum(r["status"] == "finished" for r in rows)
    lines = [f"ddpflow sweep '{cfg.run}': {done}/{len(rows)} trial(s) finished: "
             f"{out / 'report.html'}"]
    if schedule:
        lines.append(f"  {schedule_text(schedule)}")
    if best:
        lines.append(f"  best {best['trial']}: {best['monitor']} {best['best_value']:.4f} "
                     f"-> {best['weights']}")
        bundle = out / f"best-{best['trial']}"
        lines.append("  export it: " + shell_line(
            ["ddpflow", "export", "--config", best["config"], "--weights", "best", "--out",
             str(bundle)]))
        lines.append("  then:      " + shell_line(
            ["ddpflow", "predict", "--bundle", str(bundle)]) + " IMAGE_OR_FOLDER...")
    lines += [f"  {r['trial']}: {r['status']} ({r['reason']})" for r in rows
              if r["status"] not in ("finished", "paused")]
    return "\n".join(lines) + "\n"


def schedule_text(schedule: dict) -> str:
    return (f"{schedule['scheduler'] if schedule['scheduler'] != 'none' else 'tpe'}: "
            f"{schedule['spent_epochs']} of {schedule['full_epochs']} trial-epochs of "
            f"{schedule['resource'].split(' of ', 1)[1]} ({schedule['fraction']} of running "
            f"every trial to its end), rungs at epoch(s) "
            f"{', '.join(map(str, schedule['rungs']))}")


def _plots(rows: list[dict], swept: list[str], out: Path,
           schedule: dict | None = None) -> dict[str, Path]:
    """The monitored value against each swept key (numbers on their axis, others as
    categories; a log axis for keys spanning a decade or more) and against wall time; for a
    scheduled sweep also against epochs, a line per trial (scheduleboard.py)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if r["status"] == "finished" and r.get("best_value") is not None]
    figures = {}
    metric = next((r["monitor"] for r in rows if r.get("monitor")), None) or "value"
    if schedule and (path := scheduleboard.resource_plot(rows, schedule, metric, out)):
        figures["epochs"] = path
    if not done:
        return figures
    metric = done[0]["monitor"] or "value"
    for key in [*swept, "wall_time_s"]:
        col = key if key == "wall_time_s" else f"param:{key}"
        xs = [r.get(col) for r in done]
        numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs)
        fig, ax = plt.subplots(figsize=(6, 4))
        ticks = sorted({json.dumps(x) for x in xs}) if not numeric else None
        pos = xs if numeric else [ticks.index(json.dumps(x)) for x in xs]
        ax.scatter(pos, [r["best_value"] for r in done], c=["tab:red" if r["best"] else
                                                           "tab:blue" for r in done])
        if not numeric:
            ax.set_xticks(range(len(ticks)), ticks, rotation=30, fontsize=8)
        elif min(xs) > 0 and max(xs) / min(xs) >= 10:
            ax.set_xscale("log")
        ax.set_xlabel("wall time (s)" if key == "wall_time_s" else key)
        ax.set_ylabel(f"best {metric}")
        ax.set_title(f"{metric} per trial (red: best)")
        fig.tight_layout()
        name = "metric_vs_wall_time.png" if key == "wall_time_s" else \
            f"metric_vs_{key.replace('.', '_')}.png"
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        figures[key] = out / name
    return figures


def render(cfg: Config, board: dict, figures: dict[str, Path], out: Path) -> str:
    sched = board.get("schedule")
    head = ["rank", "trial", *[f"{k}" for k in board["swept"]], "status",
            *(["rung (epoch)", "epochs trained"] if sched else []), "best value",
            "final value", "wall time (s)", "samples/s", "GPU-hours", "report"]
    trs = []
    for r in board["trials"]:
        link = os.path.relpath(r["report"], out)
        cells = [html_text(r["rank"]), ("&#9733; " if r["best"] else "") + html_text(r["trial"]),
                 *[_fmt(r.get(f"param:{k}")) for k in board["swept"]],
                 _fmt(r["status"]) + (f": {_fmt(r['reason'])}" if r["reason"] else ""),
                 *([_fmt(r["rung"]), _fmt(r["resource_epochs"])] if sched else []),
                 _fmt(r["best_value"]), _fmt(r["final_value"]), _fmt(r["wall_time_s"]),
                 _fmt(r["wall_samples_per_s"]), _fmt(r["gpu_hours"]),
                 f'<a href="{html_text(link)}">report</a>'
                 if Path(r["report"]).is_file() else "–"]
        cls = ' class="ok"' if r["best"] else ""
        trs.append(f"<tr{cls}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    table = (f'<table id="leaderboard"><tr>{"".join(f"<th>{html_text(h)}</th>" for h in head)}'
             f'</tr>{"".join(trs)}</table>')
    best = board["best"]
    best_html = (f"<p>Best trial <b>{html_text(best['trial'])}</b>: {html_text(best['monitor'])} "
                 f"{_fmt(best['value'])}, weights <code>{html_text(str(best['weights']))}"
                 f"</code></p>" if best else '<p class="bad">No trial finished.</p>')
    imgs = "".join(f"<figure>{_img(p, k)}<figcaption>{html_text(k)}</figcaption></figure>"
                   for k, p in figures.items())
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>ddpflow sweep: {html_text(cfg.run)}</title>
<style>{CSS}</style><script>{ONLOAD}</script></head>
<body data-images-loaded="0">
<h1>ddpflow sweep <code>{html_text(cfg.run)}</code>: {len(board['trials'])} trial(s)</h1>
{best_html}{f"<p>{html_text(schedule_text(sched))}</p>" if sched else ""}
<h2>Leaderboard</h2>{table}
<h2>Plots</h2>{imgs or '<p>No trial finished yet.</p>'}
</body></html>
"""
