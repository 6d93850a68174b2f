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

import errno
import json
import os
import signal
import sys
from pathlib import Path

import yaml

from ddpflow.cli.parser import build_parser
from ddpflow.config import from_dict, load_config
from ddpflow.core import reading
from ddpflow.core.errors import Stopped, UserError, stop_raises


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
    from ddpflow.launch.rankerror import report as report_rank_error

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
    return _stage(cfg, args.stage, args.dry_run, args.halt_after_steps, args.halt_after_epochs)


def _stage(cfg, stage: str, dry_run: bool = False, halt_after_steps: int | None = None,
           halt_after_epochs: int | None = None) -> int:
    """One stage through the launcher: a slot of a shared node held, torchrun's agent started
    ahead (its torch import overlaps the launcher's checks; procs.warm_agent decides), the
    stage's wall time counted from this process's start."""
    from contextlib import nullcontext

    from ddpflow.launch.container import IN_CONTAINER
    from ddpflow.launch.halting import rank_args
    from ddpflow.launch.procs import warm_agent
    from ddpflow.launch.slots import hold
    from ddpflow.results.wallclock import launch_t0

    t0 = launch_t0()
    # an unknown stage or a halt it cannot make fails before anything runs
    extra = rank_args(cfg.stage(stage), halt_after_steps, halt_after_epochs)
    # a shared node: take a slot (GPUs/cores) first, so the agent and ranks inherit it (a
    # container gets the slot's GPUs from CUDA_VISIBLE_DEVICES, see container.py)
    pooled = not dry_run and not os.environ.get(IN_CONTAINER)
    with (hold(cfg, cfg.stage_dir(stage) / "slot.json", f"{cfg.run}/{stage}")
          if pooled else nullcontext()), warm_agent(cfg, dry_run) as agent:
        from ddpflow.launch.launcher import launch

        return launch(cfg, stage, dry_run=dry_run, extra_args=extra, t0=t0, agent=agent)


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
    return COMMANDS[args.command](cfg, args)


def _validate(cfg, args) -> int:
    if cfg.sweep.enabled:  # every trial's config too, as `sweep plan` would (nothing written)
        from ddpflow.sweeps.plan import plan

        n = len(plan(cfg)) or (cfg.sweep.random or {}).get("samples", 0)  # tpe: draws
        print(f"# sweep of {n} trial(s), each valid", file=sys.stderr)
    from ddpflow.engine.modelcheck import check_model  # model.kwargs, shard_blocks
    from ddpflow.launch.slurmsizes import resolved  # Slurm sizes left open: from sinfo

    check_model(cfg)
    cfg = resolved(cfg)
    if args.json:
        from ddpflow.config.rerun import hashes

        print(json.dumps({"config": cfg.to_dict(), "hashes": hashes(cfg.to_dict())}))
    else:
        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    print(f"# config hash {cfg.hash}", file=sys.stderr)
    return 0


def _collect(cfg, args) -> int:
    from ddpflow.results.collect import collect

    with stop_raises():  # a stopped collect keeps none of its part-written report
        collect(cfg)
    print((cfg.run_dir / "summary" / "headline.txt").read_text(), end="")
    return 0


def _image(cfg, args) -> int:
    from ddpflow.launch.container import build

    out = Path(args.out) if args.out else cfg.run_dir / "image.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    rec = build(cfg, Path(args.context), out)
    print(f"ddpflow: image record {out}: engine {rec['engine']}, "
          f"id {str(rec.get('image_id'))[:19]}")
    return 0


def _run_all(cfg, args) -> int:
    _prepare(cfg)
    for stage in cfg.stages:
        rc = _stage(cfg, stage.name)
        if rc:
            return rc
    print(f"ddpflow: all {len(cfg.stages)} stage(s) finished; results in {cfg.run_dir}")
    return 0


def _tune(cfg, args) -> int:
    from ddpflow.launch.slots import hold
    from ddpflow.launch.tuning import tune

    with hold(cfg, cfg.run_dir / "tune" / "slot.json", f"{cfg.run}/tune"):
        return tune(cfg, args.stage, args.memory_cap_mb)


def _sweep(cfg, args) -> int:
    from ddpflow.sweeps.commands import command

    return command(cfg, args)


def _doctor(cfg, args) -> int:
    from ddpflow.launch.doctor import report

    print(report(cfg))
    return 0


def _evaluate(cfg, args) -> int:
    from ddpflow.inference.evaluate import launch as evaluate

    return evaluate(cfg, args.stage, args.split, args.images, args.weights, args.out,
                    args.allow_empty)


def _export(cfg, args) -> int:
    from ddpflow.inference.export import export

    return export(cfg, args.stage, args.out, args.weights)


# the commands that take a config, once it is loaded and validated: one dispatch table
COMMANDS = {"validate": _validate, "collect": _collect, "image": _image, "launch": _launch,
            "run": _run_all, "tune": _tune, "sweep": _sweep, "doctor": _doctor,
            "evaluate": _evaluate, "export": _export,
            "prepare": lambda cfg, args: _prepare(cfg, args.force, args.verify) or 0}


# errors of the machine or of a path the user chose, not of ddpflow: one line, no traceback
USER_ERRNOS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
               errno.EACCES: "permission denied", errno.EROFS: "read-only file system",
               errno.ENOTDIR: "a path component is a file, not a folder",
               errno.EEXIST: "a file is in the way", errno.EISDIR: "is a folder",
               errno.ENAMETOOLONG: "file name too long", errno.EPERM: "not permitted"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    asked = any(a == "--log" or a.startswith("--log=") for a in argv)
    args = build_parser().parse_known_args(argv)[0] if asked else None
    if not (args and args.log):
        return _main(argv)
    from ddpflow.config.inputs import checked_log
    from ddpflow.core.teelog import run_logged

    try:  # the log checked first (never an input of the command), then truncated
        return run_logged(checked_log(args.log, args), lambda: _main(argv))
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
