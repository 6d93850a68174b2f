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


def _boundaries(ax, series, by_time: bool):
    for name, s0, t0, *_ in series:
        x = t0 if by_time else s0
        ax.axvline(x, color="0.75", lw=0.8, ls="--")
        ax.text(x, 1.0, f" {name}", transform=ax.get_xaxis_transform(), va="top", fontsize=8,
                color="0.35")


def _two_panels(series, path: Path, title: str, xlabel: str, by_time: bool,
                top: tuple[str, str], bottom: tuple[str, str], kinds=("train", "train"),
                scale: tuple[float, float] = (1.0, 1.0), markers=(None, None)) -> Path:
    """Two stacked panels sharing x (step or time across stages); one line per stage."""
    fig, axes = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for ax, (key, label), kind, k, marker in zip(axes, (top, bottom), kinds, scale, markers):
        for name, s0, t0, train, val in series:
            recs = [r for r in (train if kind == "train" else val) if r.get(key) is not None]
            xs = [(t0 + r["time_s"]) if by_time else (s0 + r["step"]) for r in recs]
            ax.plot(xs, [k * r[key] for r in recs], marker=marker, label=name)
        ax.set_ylabel(label)
        _boundaries(ax, series, by_time)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[1].set_xlabel(xlabel)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def loss_accuracy(stages, path: Path, metric: str = "val_acc") -> Path:
    """Training loss and the monitored validation metric (val_acc for classification)."""
    label = "validation accuracy" if metric == "val_acc" else metric.replace("_", " ")
    return _two_panels(_stage_series(stages), path, f"Loss and {label}",
                       "optimizer step (all stages)", False, ("loss", "training loss"),
                       (metric, label), kinds=("train", "val"), markers=(None, "o"))


def throughput(stages, path: Path) -> Path:
    return _two_panels(_stage_series(stages), path, "Throughput and data wait",
                       "training time (s, all stages)", True,
                       ("samples_per_s", "samples/s (all ranks)"),
                       ("data_wait_fraction", "waiting for data (% of step time)"),
                       scale=(1.0, 100.0))


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
    _boundaries(ax, series, False)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=4)
    fig.suptitle("Step time per rank")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def confusion(matrix, classes: list[str], path: Path, title: str) -> Path:
    """Row-normalised confusion matrix (true class down, predicted across), counts written in
    the cells of small matrices; class names shown up to 40 classes."""
    import numpy as np

    m = np.asarray(matrix, dtype=float)
    share = m / np.maximum(m.sum(1, keepdims=True), 1)
    n = len(classes)
    side = min(max(4.0, 0.45 * n + 2), 14.0)
    fig, ax = plt.subplots(figsize=(side + 1.5, side))
    im = ax.imshow(share, cmap="Blues", vmin=0, vmax=1)
    fig.colorbar(im, ax=ax, label="share of the true class")
    if n <= 40:
        ax.set_xticks(range(n), classes, rotation=90, fontsize=7)
        ax.set_yticks(range(n), classes, fontsize=7)
    if n <= 15:
        for i in range(n):
            for j in range(n):
                ax.text(j, i, int(m[i, j]), ha="center", va="center", fontsize=7,
                        color="white" if share[i, j] > 0.5 else "black")
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
