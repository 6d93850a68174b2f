"""The leaderboard of a scheduled sweep (`sweep.scheduler: asha`, `sweep.search: tpe`): each
trial's last rung and status (finished, paused at a rung, pruned with its reason), the epochs
of the last stage it trained, the total against running every trial to its end (what the
plain sweep would have spent), and the monitored value against epochs, a line per trial with
the rungs marked. Read from the scheduler's state (schedstate.py) and the trials' own files.
"""

from __future__ import annotations

import math
from pathlib import Path

from ddpflow.config import Config
from ddpflow.config.sweepchecks import schedule_rungs
from ddpflow.sweeps import asha, schedstate
from ddpflow.sweeps.asha import TrialState

COLUMNS = ["rung", "rung_value", "resource_epochs"]  # after the leaderboard's own columns


def _entries(cfg: Config, plan: dict, state: dict | None) -> list[tuple[dict, TrialState]]:
    """(plan-like entry, record) per trial: the plan's trials (grid, random) with their
    records, or the recorded draws (tpe)."""
    recorded = schedstate.trials_of(state)
    by_id = {t.id: t for t in recorded}
    if cfg.sweep.search == "tpe":
        return [({"id": t.id, "variant": None, "overrides": t.overrides}, t) for t in recorded]
    return [(e, by_id.get(e["id"]) or TrialState(e["id"], e["overrides"], e.get("variant"), i))
            for i, e in enumerate(plan["trials"])]


def scheduled_rows(cfg: Config, plan: dict, logs: Path, trial_row) -> tuple[list, dict]:
    """(rows ranked, the schedule's summary for leaderboard.json)."""
    rungs = schedule_rungs(cfg.to_dict())
    state = schedstate.read_state(cfg) or {}
    rows = []
    for entry, t in _entries(cfg, plan, state):
        row = trial_row(cfg, entry, logs)
        status = asha.status(t, rungs)
        if row["status"] != "stale":  # a result made with other settings is never finished
            row["status"] = status
            row["reason"] = _reason(t, status, rungs)
        row["monitor"] = row.get("monitor") or state.get("monitor")
        row["mode"] = row.get("mode") or state.get("mode")
        row["rung"] = asha.rung_of(t, rungs)
        row["rung_value"] = t.values.get(row["rung"]) if row["rung"] else None
        row["resource_epochs"] = t.epochs
        row["rung_values"] = {str(r): t.values[r] for r in rungs if t.reached(r)}
        row["curve"] = sorted([e, v] for e, v in t.values.items() if e <= t.epochs)
        rows.append(row)
    spent = sum(r["resource_epochs"] for r in rows)
    full = len(rows) * rungs[-1]
    summary = {"scheduler": cfg.sweep.scheduler, "search": cfg.sweep.search,
               "eta": cfg.sweep.asha.eta, "rungs": rungs,
               "resource": f"epochs of stage {cfg.stages[-1].name}",
               "spent_epochs": spent, "full_epochs": full,
               "fraction": round(spent / full, 4) if full else None}
    return rank(rows), summary


def _reason(t: TrialState, status: str, rungs: list[int]) -> str:
    if status == "pruned":
        return t.pruned or ""
    if status == "paused":
        k = rungs.index(t.epochs) + 1 if t.epochs in rungs else None
        where = f"rung {k} of {len(rungs)}" if k else "between rungs"
        return (f"paused at epoch {t.epochs} ({where}): not in the top of its rung; its "
                f"checkpoint resumes it if it is promoted")
    if status == "stopped":
        return f"stopped on its way to epoch {t.target}: the next run resumes it"
    return "" if status == "finished" else "not started"


def rank(rows: list[dict]) -> list[dict]:
    """Finished trials by their best value, then paused ones by the highest rung reached and
    their value there, then the rest; the best finished trial marked."""
    def value_key(r, v):
        ok = isinstance(v, (int, float)) and math.isfinite(v)
        return (0, -v if r.get("mode") == "max" else v) if ok else (1, 0)

    def key(r):
        if r["status"] == "finished":
            return (0, 0, value_key(r, r.get("best_value")))
        if r["status"] == "paused" and r["rung"]:
            return (1, -r["rung"], value_key(r, r["rung_value"]))
        return (2, 0, (1, 0))

    rows = sorted(rows, key=lambda r: (key(r), r["trial"]))
    for i, r in enumerate(rows):
        r["rank"] = i + 1
        r["best"] = i == 0 and key(r)[0] == 0 and key(r)[2][0] == 0
    return rows


def resource_plot(rows: list[dict], summary: dict, metric: str, out: Path) -> Path | None:
    """metric_vs_epochs.png: the monitored value against epochs of the last stage, one line
    per trial (finished: solid, best: red; paused and pruned: grey), rungs as dotted lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    curves = [r for r in rows if r.get("curve")]
    if not curves:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in sorted(curves, key=lambda r: (r["best"], r["status"] == "finished")):
        xs, ys = zip(*[(e, v) for e, v in r["curve"] if v is not None] or [(None, None)])
        if xs[0] is None:
            continue
        colour = ("tab:red" if r["best"] else "tab:blue" if r["status"] == "finished"
                  else "0.6")
        ax.plot(xs, ys, color=colour, lw=1.8 if r["best"] else 1.0, alpha=0.9)
        marks = [(int(e), v) for e, v in r["rung_values"].items() if v is not None]
        if marks:
            ax.scatter(*zip(*marks), color=colour, s=14, zorder=3)
    for rung in summary["rungs"]:
        ax.axvline(rung, color="0.8", ls=":", lw=1)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(handles=[Line2D([], [], color=c, label=n) for c, n in (
        ("tab:red", "best"), ("tab:blue", "finished"), ("0.6", "paused or pruned"))],
        fontsize=8, loc="best")
    ax.set_xlabel(f"{summary['resource']} (dotted: rungs)")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} per trial: {summary['spent_epochs']} of {summary['full_epochs']} "
                 f"epochs spent ({summary['fraction']})")
    fig.tight_layout()
    path = out / "metric_vs_epochs.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
