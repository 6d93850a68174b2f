"""The `ddpflow` command line: every subcommand and its options (cli/__init__.py runs them)."""

from __future__ import annotations

import argparse

from ddpflow import __version__

DESCRIPTION = "The `ddpflow` command: workflow rules call it, it calls the library."


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", default="config/config.yaml", help="YAML config file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key, e.g. --set stages.0.epochs=1 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ddpflow", description=DESCRIPTION)
    ap.add_argument("--version", action="version", version=f"ddpflow {__version__}")
    ap.add_argument("--log", metavar="FILE", default=None,
                    help="write all output to FILE and show only ddpflow's own lines (what "
                         "the workflow's rules use)")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("validate", help="validate a config and print it resolved")
    _config_args(p)
    p.add_argument("--json", action="store_true", help="print {config, hashes} as JSON: the "
                   "resolved config and what each result depends on (the workflow's rerun "
                   "rule: config/rerun.py)")

    p = sub.add_parser("prepare", help="turn the data source into the prepared format")
    _config_args(p)
    p.add_argument("--force", action="store_true", help="rebuild even if up to date")
    p.add_argument("--verify", action="store_true", help="also re-check the arrays' SHA-256")

    p = sub.add_parser("launch", help="run one stage with torchrun across this node's ranks")
    _config_args(p)
    p.add_argument("--stage", required=True, help="stage name from the config's stages list")
    p.add_argument("--dry-run", action="store_true", help="print the torchrun line only")
    p.add_argument("--halt-after-steps", type=int, default=None,
                   help="checkpoint and stop after this many optimizer steps (resumable)")
    p.add_argument("--halt-after-epochs", type=int, default=None,
                   help="validate, checkpoint and stop at the end of this epoch, before the "
                        "stage's last (resumable: what a sweep's scheduler pauses a trial at)")

    p = sub.add_parser("run", help="prepare the data and run every stage in order")
    _config_args(p)

    p = sub.add_parser("image", help="build the container image; write image.json")
    _config_args(p)
    p.add_argument("--context", default=".", help="folder with the Dockerfile")
    p.add_argument("--out", default=None, help="record (default <run>/image.json)")

    p = sub.add_parser("collect", help="summaries, checkpoints, plots and report of a run")
    _config_args(p)

    p = sub.add_parser("tune", help="measure this node; choose batch size, loader, precision")
    _config_args(p)
    p.add_argument("--stage", default=None, help="stage to tune for (default: tune.stage, "
                   "else the first)")
    p.add_argument("--memory-cap-mb", default=None, metavar="MB[,MB...]",
                   help="pretend each device has only this much memory (one value, or one "
                        "per rank): for shared GPUs, and for tests without a GPU")

    p = sub.add_parser("sweep", help="a sweep's trials: plan, schedule, list, leaderboard")
    p.add_argument("action", choices=["plan", "collect", "list", "schedule"],
                   help="plan: check every trial and write its config; collect: leaderboard; "
                        "list: print the trials; schedule: run them with sweep.scheduler / "
                        "sweep.search (asha, tpe)")
    _config_args(p)
    p.add_argument("--logs", default=None, help="folder of the trials' logs (default "
                   "results/<run>/logs/trials), where a failed trial's reason is read")
    p.add_argument("--via", choices=["node", "slurm"], default="node", help="schedule: "
                   "run the trials on this node's slots, or as Slurm jobs (sbatch)")

    p = sub.add_parser("doctor", help="what this machine offers for training, and advice")
    _config_args(p)

    _inference_commands(sub)
    _rank_commands(sub)
    return ap


def _inference_commands(sub) -> None:
    """evaluate, export and predict: what a finished stage's weights are used for."""
    p = sub.add_parser("evaluate", help="a finished stage's weights on a split or an "
                       "image folder: accuracy, per-class scores, confusion matrix")
    _config_args(p)
    _evaluate_args(p)
    p.add_argument("--allow-empty", action="store_true",
                   help="a split the data does not have is noted, not an error (workflow)")

    p = sub.add_parser("export", help="a stage's weights as safetensors, TorchScript and ONNX "
                       "with model.json, each checked against the model")
    _config_args(p)
    p.add_argument("--stage", default=None, help="stage (default: the last)")
    p.add_argument("--out", default=None, help="bundle folder (default results/<run>/export)")
    _weights_arg(p)

    p = sub.add_parser("predict", help="an export bundle on image files or folders -> CSV")
    p.add_argument("--bundle", required=True, help="folder written by `ddpflow export`")
    p.add_argument("--out", default="predictions.csv", help="CSV file to write")
    p.add_argument("--top-k", type=int, default=None,
                   help="classes per image in the CSV (default 5, or all when fewer)")
    p.add_argument("--format", choices=["auto", "torchscript", "onnx"], default="auto",
                   help="which model file runs (auto: TorchScript, else ONNX)")
    p.add_argument("--device", default="auto", help="auto (GPU when there is one) | cpu | cuda")
    p.add_argument("inputs", nargs="+", metavar="IMAGE_OR_FOLDER")


def _rank_commands(sub) -> None:
    """What torchrun starts on each rank (train, tune-rank, evaluate-rank)."""
    p = sub.add_parser("tune-rank", help="one rank's tuning (started by torchrun)")
    p.add_argument("--resolved", required=True)
    p.add_argument("--stage", required=True)
    p.add_argument("--memory-cap-mb", default=None)

    p = sub.add_parser("evaluate-rank", help="one rank's evaluation (started by torchrun)")
    p.add_argument("--resolved", required=True)
    _evaluate_args(p)

    p = sub.add_parser("train", help="one rank's training (started by torchrun)")
    p.add_argument("--resolved", required=True, help="resolved config JSON written by launch")
    p.add_argument("--stage", required=True)
    p.add_argument("--halt-after-steps", type=int, default=None)
    p.add_argument("--halt-after-epochs", type=int, default=None)


def _weights_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", choices=["final", "best", "ema", "raw"], default="final",
                   help="final: what the stage hands on (its EMA's when it kept one); best: "
                        "best.pt; ema: the EMA's; raw: the trained weights beside an EMA")


def _evaluate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stage", default=None, help="stage (default: the last)")
    p.add_argument("--split", choices=["test", "val"], default="test")
    p.add_argument("--images", default=None, metavar="DIR",
                   help="a labelled folder DIR/<class>/<image> instead of a split")
    _weights_arg(p)
    p.add_argument("--out", default=None,
                   help="folder (default results/<run>/evaluate/<stage>/<split>-<weights>)")
