"""Plots of a run across all its stages (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _stage_series(stages: list[tuple[str, list[dict]]]):
    """Per stage: its records with steps and seconds offset to one axis across stages."""
    step0 = time0 = 0.0
    out = []
    for name, recs in stages:
        train = [r for r in recs if r.get("kind") == "train"]
        val = [r for r in recs if r.get("kind") == "val"]
        out.append((name, step0, time0, train, val))
        steps = [r["step"] for r in recs if "step" in r]
        times = [r["time_s"] for r in recs if "time_s" in r]
        step0 += max(steps, default=0)
        time0 += max(times, default=0)
    return out


def _boundaries(ax, series, offset_index):
    for name, s0, t0, *_ in series:
        x = s0 if offset_index == 1 else t0
        ax.axvline(x, color="0.75", lw=0.8, ls="--")
        ax.text(x, 1.0, f" {name}", transform=ax.get_xaxis_transform(), va="top", fontsize=8,
                color="0.35")


def loss_accuracy(stages, path: Path) -> Path:
    series = _stage_series(stages)
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for name, s0, _, train, val in series:
        a1.plot([s0 + r["step"] for r in train], [r["loss"] for r in train], label=name)
        a2.plot([s0 + r["step"] for r in val], [r["val_acc"] for r in val], marker="o",
                label=name)
    a1.set_ylabel("training loss")
    a2.set_ylabel("validation accuracy")
    a2.set_xlabel("optimizer step (all stages)")
    for ax in (a1, a2):
        _boundaries(ax, series, 1)
        ax.grid(alpha=0.3)
    a1.legend(fontsize=8)
    fig.suptitle("Loss and accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def throughput(stages, path: Path) -> Path:
    series = _stage_series(stages)
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for name, _, t0, train, _ in series:
        t = [t0 + r["time_s"] for r in train]
        a1.plot(t, [r["samples_per_s"] for r in train], label=name)
        a2.plot(t, [100 * r["data_wait_fraction"] for r in train], label=name)
    a1.set_ylabel("samples/s (all ranks)")
    a2.set_ylabel("waiting for data (% of step time)")
    a2.set_xlabel("training time (s, all stages)")
    for ax in (a1, a2):
        _boundaries(ax, series, 2)
        ax.grid(alpha=0.3)
    a1.legend(fontsize=8)
    fig.suptitle("Throughput and data wait")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def rank_step_times(stages, path: Path) -> Path:
    series = _stage_series(stages)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for name, s0, _, train, _ in series:
        if not train:
            continue
        ranks = len(train[0]["step_time_s_per_rank"])
        for r in range(ranks):
            ax.plot([s0 + x["step"] for x in train],
                    [1000 * x["step_time_s_per_rank"][r] for x in train],
                    label=f"{name} rank {r}", lw=1)
    ax.set_ylabel("step time (ms)")
    ax.set_xlabel("optimizer step (all stages)")
    _boundaries(ax, series, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=4)
    fig.suptitle("Step time per rank")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
