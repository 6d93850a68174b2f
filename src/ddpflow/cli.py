"""The `ddpflow` command: workflow rules call it, it calls the library.

    ddpflow validate --config config/config.yaml [--set stages.0.epochs=1]
    ddpflow prepare  --config config/config.yaml
    ddpflow launch   --config config/config.yaml --stage warmup
    ddpflow run      --config config/config.yaml        # prepare + every stage, in order
    ddpflow image    --config config/config.yaml        # build the container image
    ddpflow evaluate --config config/config.yaml [--split test]  # a stage's weights on a split
    ddpflow export   --config config/config.yaml        # safetensors, TorchScript, ONNX bundle
    ddpflow predict  --bundle results/<run>/export images/ --out predictions.csv
    ddpflow train    --resolved <stage>/config.json --stage S   (what each torchrun rank runs)
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
from pathlib import Path

import yaml

from ddpflow import __version__
from ddpflow.config import from_dict, load_config
from ddpflow.core import reading
from ddpflow.core.errors import Stopped, UserError, stop_raises


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", default="config/config.yaml", help="YAML config file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key, e.g. --set stages.0.epochs=1 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ddpflow", description=__doc__.split("\n")[0])
    ap.add_argument("--version", action="version", version=f"ddpflow {__version__}")
    ap.add_argument("--log", metavar="FILE", default=None,
                    help="write all output to FILE and show only ddpflow's own lines (what "
                         "the workflow's rules use)")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("validate", help="validate a config and print it resolved")
    _config_args(p)

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


def _prepare(cfg, force=False, verify=False) -> None:
    from ddpflow.data.prepare import describe, prepare

    with stop_raises():  # a stopped build removes its partial folder, as on Ctrl-C
        meta, did = prepare(cfg, force=force, verify=verify)
    print(describe(meta, cfg.data_dir, did))


def _resolved(path: str):
    """The resolved config that `ddpflow launch` wrote for the ranks."""
    if "RANK" in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ:
        raise UserError("RANK/WORLD_SIZE are set but this process was not started by torchrun; "
                        "start stages with `ddpflow launch` (it runs torchrun), or unset them")
    return from_dict(reading.read_json(path, {"type": "object"}, "the resolved config",
                                       "it is written by `ddpflow launch`, which starts this "
                                       "command: run that"))


def _rank(args) -> int:
    """One rank's work under torchrun. A user mistake found here is reported to the
    launcher (error.json) and the rank exits 0: torchrun restarts crashes, not mistakes."""
    from ddpflow.engine import stopflag

    stopflag.install()  # before the heavy imports: a stop signal in start-up is not lost
    from ddpflow.launch.launcher import report_rank_error

    cfg = _resolved(args.resolved)
    folder = (cfg.stage_dir(args.stage) if args.command == "train" else
              Path(args.out) if args.command == "evaluate-rank" else cfg.run_dir / "tune")
    try:
        if args.command == "evaluate-rank":
            from ddpflow.inference.evaluate import rank_main

            rank_main(cfg, args.stage, args.split, args.images, args.weights, Path(args.out))
            return 0
        if args.command == "train":
            from ddpflow.engine.train import main as train_main

            return train_main(cfg, args.stage, args.halt_after_steps, args.halt_after_epochs)
        from ddpflow.engine.tune import run as tune_run

        tune_run(cfg, args.stage, _caps(args.memory_cap_mb))
        return 0
    except UserError as e:
        report_rank_error(folder, e)
        return 0


def _launch(cfg, args) -> int:
    """`ddpflow launch`: torchrun's agent starts first (its torch import overlaps the
    launcher's), the stage's wall time counts from this process's start."""
    from contextlib import nullcontext

    from ddpflow.launch.container import IN_CONTAINER
    from ddpflow.launch.halting import rank_args
    from ddpflow.launch.procs import WarmAgent
    from ddpflow.launch.slots import hold
    from ddpflow.results.wallclock import launch_t0

    t0 = launch_t0()
    # an unknown stage or a halt it cannot make fails before anything runs
    extra = rank_args(cfg.stage(args.stage), args.halt_after_steps, args.halt_after_epochs)
    local = cfg.container.engine == "none" or os.environ.get(IN_CONTAINER)
    warm = local and not args.dry_run and cfg.hardware.nodes == 1
    # a shared node: take a slot (GPUs/cores) first, so the agent and ranks inherit it (a
    # container gets the slot's GPUs from CUDA_VISIBLE_DEVICES, see container.py)
    pooled = not args.dry_run and not os.environ.get(IN_CONTAINER)
    with (hold(cfg, cfg.stage_dir(args.stage) / "slot.json", f"{cfg.run}/{args.stage}")
          if pooled else nullcontext()), WarmAgent() if warm else nullcontext() as agent:
        from ddpflow.launch.launcher import launch

        return launch(cfg, args.stage, dry_run=args.dry_run, extra_args=extra, t0=t0,
                      agent=agent)


def _caps(text: str | None) -> list[float] | None:
    if not text:
        return None
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise UserError(f"--memory-cap-mb expects MB or MB,MB,..., got '{text}'") from None


def run(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("train", "tune-rank", "evaluate-rank"):
        return _rank(args)
    if args.command == "predict":
        from ddpflow.inference.predict import predict

        return predict(args.bundle, args.inputs, args.out, args.top_k, args.format,
                       args.device)

    cfg = load_config(args.config, args.overrides)
    if cfg.sweep.enabled and args.command in ("launch", "run", "tune"):
        print(f"ddpflow: note: this config has a sweep; `ddpflow {args.command}` runs the base "
              f"config without it (run the trials with snakemake; `ddpflow sweep list` names "
              f"them, each trial's config is results/<run>/trials/<id>/trial_config.json)",
              file=sys.stderr)
    if args.command == "doctor":
        from ddpflow.launch.doctor import report

        print(report(cfg))
        return 0
    if args.command == "tune":
        from ddpflow.launch.slots import hold
        from ddpflow.launch.tuning import tune

        with hold(cfg, cfg.run_dir / "tune" / "slot.json", f"{cfg.run}/tune"):
            return tune(cfg, args.stage, args.memory_cap_mb)
    if args.command == "sweep":
        from ddpflow.sweeps.commands import command

        return command(cfg, args)
    return _command(cfg, args)


def _command(cfg, args) -> int:
    """The commands that take a config, once it is loaded and validated."""
    if args.command == "validate":
        if cfg.sweep.enabled:  # every trial's config too, as `sweep plan` would (nothing written)
            from ddpflow.sweeps.plan import plan

            n = len(plan(cfg)) or (cfg.sweep.random or {}).get("samples", 0)  # tpe: draws
            print(f"# sweep of {n} trial(s), each valid", file=sys.stderr)
        from ddpflow.launch.slurmsizes import resolved  # Slurm sizes left open: from sinfo
        cfg = resolved(cfg)
        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
        print(f"# config hash {cfg.hash}", file=sys.stderr)
        return 0
    if args.command == "prepare":
        _prepare(cfg, args.force, args.verify)
        return 0
    if args.command == "collect":
        from ddpflow.results.collect import collect

        with stop_raises():  # a stopped collect keeps none of its part-written report
            collect(cfg)
        print((cfg.run_dir / "summary" / "headline.txt").read_text(), end="")
        return 0
    if args.command == "image":
        from pathlib import Path

        from ddpflow.launch.container import build

        out = Path(args.out) if args.out else cfg.run_dir / "image.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        rec = build(cfg, Path(args.context), out)
        print(f"ddpflow: image record {out}: engine {rec['engine']}, "
              f"id {str(rec.get('image_id'))[:19]}")
        return 0
    if args.command == "evaluate":
        from ddpflow.inference.evaluate import launch as evaluate

        return evaluate(cfg, args.stage, args.split, args.images, args.weights, args.out,
                        args.allow_empty)
    if args.command == "export":
        from ddpflow.inference.export import export

        return export(cfg, args.stage, args.out, args.weights)
    if args.command == "launch":
        return _launch(cfg, args)
    from ddpflow.launch.launcher import launch

    if args.command == "run":
        _prepare(cfg)
        for st in cfg.stages:
            rc = launch(cfg, st.name)
            if rc:
                return rc
        print(f"ddpflow: all {len(cfg.stages)} stage(s) finished; results in {cfg.run_dir}")
        return 0
    raise AssertionError(args.command)


# errors of the machine or of a path the user chose, not of ddpflow: one line, no traceback
USER_ERRNOS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
               errno.EACCES: "permission denied", errno.EROFS: "read-only file system",
               errno.ENOTDIR: "a path component is a file, not a folder",
               errno.EEXIST: "a file is in the way", errno.EISDIR: "is a folder",
               errno.ENAMETOOLONG: "file name too long", errno.EPERM: "not permitted"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    asked = any(a == "--log" or a.startswith("--log=") for a in argv)
    log = build_parser().parse_known_args(argv)[0].log if asked else None
    if not log:
        return _main(argv)
    from ddpflow.core.teelog import run_logged

    try:
        return run_logged(Path(log), lambda: _main(argv))  # one-line errors: log and console
    except UserError as e:  # the log itself (_main reports every other mistake)
        print(f"ddpflow: error: {e}", file=sys.stderr)
        return e.exit_code


def _main(argv: list[str]) -> int:
    try:
        return run(argv)
    except UserError as e:
        print(f"ddpflow: error: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:
        if e.errno not in USER_ERRNOS:
            raise
        where = f" at {e.filename}" if e.filename else ""
        print(f"ddpflow: error: cannot write{where}: {USER_ERRNOS[e.errno]}; check "
              f"results_dir in the config and the free space there", file=sys.stderr)
        return UserError.exit_code
    except KeyboardInterrupt:
        print("ddpflow: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except Stopped as e:
        print(f"ddpflow: stopped by {signal.Signals(e.signum).name}; nothing half-written was "
              f"kept: run the same command again", file=sys.stderr)
        return 128 + e.signum


def entry() -> int:
    """The `ddpflow` command (and `python -m ddpflow`). A process that imported torch spends
    about a second tearing its modules down at exit; launcher, agent and ranks exit one after
    another, so that second is paid three times per stage. Everything is written and
    flushed by now: leave at once."""
    rc = main()
    if "torch" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


if __name__ == "__main__":
    sys.exit(entry())
