"""`ddpflow launch`: check everything a stage needs, then run one torchrun for it.

One torchrun with N ranks per stage (never N copies of the job). The rendezvous is c10d
on 127.0.0.1 with a free port and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: it survives
`--max-restarts`, where a shared or static store can hand a restarted rank the address
of a dead peer (stale addresses, pytorch issue 135712).
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from ddpflow.config import Config
from ddpflow.core import lazydynamo, locks, quoting, reading
from ddpflow.core.errors import UserError, short
from ddpflow.core.writing import remove_scratch, write_json_atomic
from ddpflow.data import prepared
from ddpflow.data.prepare import check_settings
from ddpflow.engine import checkpoint, weights
from ddpflow.engine.heartbeat import RANKS
from ddpflow.launch import hangreport, rankerror
from ddpflow.launch.procs import TORCHRUN, WarmAgent, run_torchrun
from ddpflow.launch.slurmnodes import (
    check_slurm_gpus,
    free_port,
    missing_nodes_text,
    roll_call_dir,
    srun_command,
)
from ddpflow.results.provenance import expected_record, stage_result
from ddpflow.results.summary import result_text, summary_problem, write_summary
from ddpflow.results.wallclock import LAUNCH_T0, complete
from ddpflow.seams import contract
from ddpflow.seams.userimport import add_code_dirs

EXIT_STOPPED = 75  # stopped at a checkpoint before the end (preempted): run again to resume
EXIT_DIVERGED = 3  # loss became NaN/inf: rerunning the same settings will not help


def visible_gpus() -> int:
    return torch.cuda.device_count()  # respects the caller's CUDA_VISIBLE_DEVICES


def resolve_ranks(cfg: Config) -> tuple[int, str, dict[str, str]]:
    """(ranks, device type, extra environment) for this node, or a UserError."""
    hw = cfg.hardware
    env: dict[str, str] = {}
    n_gpu = visible_gpus()
    if hw.devices is not None:
        bad = [i for i in hw.devices if i >= n_gpu]
        if bad:
            have = f"ids 0..{n_gpu - 1}" if n_gpu else "none"
            raise UserError(f"hardware.devices lists GPU {', '.join(map(str, bad))}, but this "
                            f"machine has {n_gpu} visible GPU(s) ({have}); fix hardware.devices "
                            f"or leave it null to use all")
        # ids index the GPUs visible now; map them through an existing CUDA_VISIBLE_DEVICES
        outer = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = outer.split(",") if outer else [str(i) for i in range(n_gpu)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[i] for i in hw.devices)
        n_gpu = len(hw.devices)
    if hw.device == "cuda" and n_gpu == 0:
        raise UserError("hardware.device is 'cuda' but no GPU is visible; use hardware.device: "
                        "auto or cpu, or check CUDA_VISIBLE_DEVICES and the driver")
    device = "cuda" if hw.device != "cpu" and n_gpu > 0 else "cpu"
    if hw.nproc_per_node == "auto":
        n = n_gpu if device == "cuda" else 1
    else:
        n = int(hw.nproc_per_node)
        if device == "cuda" and n > n_gpu:
            raise UserError(f"hardware.nproc_per_node is {n} but only {n_gpu} GPU(s) are "
                            f"visible; one rank per GPU, so use at most {n_gpu} (or auto)")
    env.update(_threads(hw, n), PYTHONUNBUFFERED="1", TORCH_NCCL_ASYNC_ERROR_HANDLING="1",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    if cfg.deterministic:
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    return n, device, env


def _threads(hw, n: int) -> dict[str, str]:
    """CPU threads per rank process: the usable cores shared by n ranks (or as set)."""
    cores = len(os.sched_getaffinity(0))  # a slot (slots.py) narrows the usable cores
    threads = (max(1, cores // n) if hw.threads_per_rank == "auto" else int(hw.threads_per_rank))
    return {"OMP_NUM_THREADS": str(threads), "DDPFLOW_THREADS": str(threads)}


def stage_ranks(cfg: Config, stage: str) -> tuple[int, str, dict[str, str]]:
    """resolve_ranks for one stage: DataParallel runs one process that drives every GPU,
    and that one process gets the cores that n ranks would have shared."""
    n, device, env = resolve_ranks(cfg)
    if cfg.stage(stage).strategy == "dp":
        return 1, device, {**env, **_threads(cfg.hardware, 1)}
    return n, device, env


def preflight(cfg: Config, stage: str, world: int = 1) -> None:
    """Everything a stage needs that can be checked before any rank starts: a mistake found
    here costs no rank start-up and no torchrun restart."""
    from ddpflow.tracking.trackers import check as check_tracking

    st = cfg.stage(stage)
    i = cfg.stage_index(stage)
    check_tracking(cfg)
    lazydynamo.defer()  # the launcher never compiles: seconds saved in the meta-model check
    if st.batch_size == "auto":
        from ddpflow.engine.settings import load_choice

        choice, mismatch = load_choice(cfg, st)
        if choice is None:
            raise UserError(f"stages.{i}.batch_size is auto but " + (mismatch or (
                f"{cfg.run_dir / 'tune.json'} does not exist: run `ddpflow tune --config ...` "
                f"(or set tune.enabled: true in the workflow), or give a number")))
    meta = prepared.read_meta(cfg.data_dir)
    if meta is None:
        raise UserError(f"no prepared data at {cfg.data_dir}; run `ddpflow prepare --config ...`"
                        f" first (or the workflow's data rule)")
    check_settings(cfg, meta)
    changed = prepared.changed_files(cfg.data_dir, meta)
    if changed:
        raise UserError(f"the prepared data at {cfg.data_dir} changed after it was prepared "
                        f"({', '.join(changed)}); run `ddpflow prepare --config ...`: it "
                        f"checks the files and prepares them again if they differ")
    if st.batch_size != "auto":
        need = st.batch_size * world * st.grad_accum_steps
        have = meta["counts"]["train"]["total"]
        if need > have:
            raise UserError(f"stages.{i}.batch_size {st.batch_size} x {world} rank(s) x "
                            f"{st.grad_accum_steps} accumulation = {need} samples per step, "
                            f"but the training split has {have}; lower the batch size")
    add_code_dirs(cfg)
    model = _model_on_meta(cfg, meta)
    _check_seams(cfg, st, meta, model)
    from ddpflow.data.pipeline import check_sampling

    check_sampling(cfg, meta)  # data.sample_weights' result, every class for balanced
    if model is not None:  # model.shard_blocks / activation_checkpointing name its blocks
        from ddpflow.engine.build import model_blocks

        model_blocks(cfg, st, model)
    if st.init_from == "previous":
        prev = cfg.stages[i - 1].name
        summary, stale = stage_result(cfg, prev)
        if summary is None:
            problem = summary_problem(cfg.stage_dir(prev) / "summary.json")
            raise UserError(f"stage '{stage}' starts from stage '{prev}', which has not "
                            f"finished; run '{prev}' first" + (f" ({problem})" if problem
                                                              else ""))
        if stale:
            raise UserError(f"stage '{stage}' starts from stage '{prev}', whose result is "
                            f"{stale}; run '{prev}' again first (the workflow does)")
    elif st.init_from:  # a file (not a folder), a state dict, finite, that fits the model
        weights.check_init_from(model, Path(st.init_from), f"stages.{i}.init_from")


def _check_seams(cfg: Config, stage, meta: dict, model) -> None:
    """The task builds, model.weights fit the model and the freeze prefixes name
    parameters: each mistake is one message here instead of one per rank."""
    from ddpflow.engine.weights import freeze, load_pretrained, pretrained_file, read_state_dict
    from ddpflow.seams.tasks import build_task, monitor

    monitor(cfg, build_task(cfg, stage, meta.get("num_classes")))
    if model is None:
        return
    if not stage.init_from and cfg.model.weights:
        src = pretrained_file(cfg)
        sd = read_state_dict(src, "model.weights")
        load_pretrained(_ShapesOnly(model), sd, f"model.weights {src}",
                        cfg.model.weights_partial)
    prefixes = stage.freeze if stage.freeze is not None else cfg.model.freeze
    freeze(model, prefixes, f"stages.{cfg.stage_index(stage.name)}.freeze"
           if stage.freeze is not None else "model.freeze")


class _ShapesOnly:
    """A meta-device model seen by load_pretrained: shapes are checked, nothing is copied."""

    def __init__(self, model):
        self.model = model

    def state_dict(self):
        return self.model.state_dict()

    def load_state_dict(self, *args, **kwargs):
        return None


def _model_on_meta(cfg: Config, meta: dict):
    """The stage's model on the meta device (no memory), after one forward at the data's
    image size: an image too small for the model fails here, not in every rank."""
    import torch

    from ddpflow.seams.models import build_model, input_channels

    if meta.get("kind") == "python":  # a user dataset: any input; only build the model
        with torch.device("meta"):
            return build_model(cfg.model, meta.get("num_classes"), meta.get("in_channels"),
                               contract.probe(cfg, meta))
    c = meta["image_shape"][2]
    h = w = cfg.data.image_size  # what the model sees: the crop of the stored image
    in_ch = input_channels(cfg.model.name, c)
    with torch.device("meta"):
        model = build_model(cfg.model, meta["num_classes"], in_ch)
        try:
            out = model.eval()(torch.zeros(2, in_ch, h, w))
        except (NotImplementedError, TypeError):  # an op without a meta kernel: skip the probe
            out = None
        except Exception as e:  # the model's forward at the data's size, before any rank
            cause = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
            if cfg.model.kwargs:  # (smallcnn width 0: an IndexError in its batch norm)
                raise UserError(f"model.name '{cfg.model.name}' with model.kwargs "
                                f"{short(cfg.model.kwargs)} fails on a probe batch of {in_ch} x "
                                f"{h} x {w} ({cause}); check the values of model.kwargs (or "
                                f"data.image_size)") \
                    from None
            if isinstance(e, RuntimeError):
                raise UserError(f"data.image_size {h} is too small for model.name "
                                f"'{cfg.model.name}' ({cause.partition(': ')[2]}); use "
                                f"larger images or another model") from None
            raise UserError(f"model.name '{cfg.model.name}' fails on a probe batch of {in_ch} "
                            f"x {h} x {w} ({cause}); check its forward() with images of that "
                            f"size") from None
    if out is not None:  # the seam contract's output rules (shapes: meta has no values)
        expected = contract.probe(cfg, meta)
        contract.check_outputs(out, f"model.name {cfg.model.name}", expected.task,
                               expected.width)
    return model


def plan(cfg: Config, stage: str, resolved: Path, extra_args: list[str] = (),
         command: str = "train", ranks: tuple | None = None) -> tuple[list, dict]:
    """The torchrun command line and environment for one stage (or its tuning);
    `ranks` is stage_ranks(cfg, stage) where the caller has it already."""
    n, device, env = ranks or stage_ranks(cfg, stage)
    if device == "cuda":  # the flight recorder's dump names the rank a collective waited for
        env = {**env, **hangreport.flight_recorder(Path(resolved).parent, torch.__version__)}
    train = ["--module", "ddpflow", command, "--resolved", quoting.path_arg(resolved),
             "--stage", stage, *extra_args]
    restarts = f"--max-restarts={cfg.hardware.max_restarts}"
    if cfg.hardware.nodes == 1:
        # a c10d rendezvous on this machine: every restart round gets fresh store keys, so a
        # restarted rank never dials a dead peer's address (pytorch issue 135712)
        cmd = [*TORCHRUN, "--nnodes=1",
               f"--nproc-per-node={n}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-id={stage}-{os.getpid()}",
               restarts, *train]
        return cmd, env
    return srun_command(cfg, n, resolved, restarts, train), env


# a rank's failed.json and error.json as read here (missing or damaged: none left)
_TEXT = {"type": "string"}
FAILED_SCHEMA = {"type": "object", "required": ["reason"], "properties": {"reason": _TEXT}}


def _read_json(path: Path, schema: dict) -> dict | None:
    return reading.read_json_or_none(path, schema, "a rank's report")


def _read_failure(out: Path) -> dict | None:
    return _read_json(out / "failed.json", FAILED_SCHEMA)


def launch(cfg: Config, stage: str, dry_run: bool = False, extra_args: list[str] = (),
           t0: float | None = None, agent: WarmAgent | None = None) -> int:
    """Run one stage; t0 (epoch seconds) is when its command started, for the wall-time
    split; `agent` a torchrun agent warmed up by the caller (procs.warm_agent), or None:
    torchrun is started here (a dry run, several nodes, a container)."""
    t0 = time.time() if t0 is None else t0
    try:
        return _launch(cfg, stage, dry_run, extra_args, t0, agent)
    finally:
        if agent is not None:
            agent.cancel()  # unused (a mistake, nothing to do): it ends having started nothing


def _launch(cfg: Config, stage: str, dry_run: bool, extra_args: list[str], t0: float,
            agent: WarmAgent | None) -> int:
    from ddpflow.launch import container

    st = cfg.stage(stage)
    out = cfg.stage_dir(st.name)
    in_image = cfg.container.engine != "none" and not os.environ.get(container.IN_CONTAINER)
    n = 1
    if in_image:
        print(f"ddpflow: stage '{stage}' runs in the {cfg.container.engine} image "
              f"{cfg.container.image}", file=sys.stderr)
    else:
        check_slurm_gpus(cfg)
        ranks = stage_ranks(cfg, stage)
        n, device, _ = ranks
        cmd, env = plan(cfg, stage, out / "config.json", list(extra_args), ranks=ranks)
        shown = " ".join(f"{k}={v}" for k, v in env.items() if k == "CUDA_VISIBLE_DEVICES")
        per = f"{cfg.hardware.nodes} node(s) x " if cfg.hardware.nodes > 1 else ""
        print(f"ddpflow: stage '{stage}': {per}{n} rank(s) on {device}", file=sys.stderr)
        print(f"ddpflow: {shown + ' ' if shown else ''}{quoting.shell_line(cmd)}", file=sys.stderr)
    if dry_run:
        return 0
    # one writer per stage; inside the container the launcher outside already holds it
    held = (nullcontext() if os.environ.get(container.IN_CONTAINER)
            else locks.exclusive(out / ".lock", f"stage '{stage}' ({out})"))
    preflight(cfg, stage, n)  # read-only: a mistake writes nothing, not even the lock
    with held, rankerror.Reports(out) as reports:  # a mistake inside a rank: error.json
        summary, stale = stage_result(cfg, stage)
        if summary is not None and not stale:
            print(f"ddpflow: stage '{stage}' already finished with these settings, code and "
                  f"data (nothing to do): {out / 'summary.json'}", file=sys.stderr)
            return 0
        refuse_repeated_divergence(cfg, stage)
        out.mkdir(parents=True, exist_ok=True)
        (out / hangreport.REPORT).unlink(missing_ok=True)
        remove_scratch(out / RANKS)  # the last launch's heartbeats, stacks and hang reports
        write_json_atomic(out / "config.json", cfg.to_dict())
        if in_image:
            rc, stop_signal = container.run_stage(cfg, out / "config.json", stage,
                                                  list(extra_args), t0), None
        else:
            write_json_atomic(out / "command.json", {"argv": cmd, "env": env})
            remove_scratch(roll_call_dir(out / "config.json"))
            rc, stop_signal = run_torchrun(cmd, {**env, **reports.env,  # ranks count from t0
                                                 LAUNCH_T0: f"{t0:.6f}"}, watch=reports,
                                           agent=agent, hang=hangreport.HangWatch(out))
        complete_wall(cfg, stage, t0)
        return _outcome(cfg, stage, rc, stop_signal, in_image, reports.message())


def complete_wall(cfg: Config, stage: str, t0: float) -> None:
    """Add the time until now (process exit, teardown) to the wall split of a summary that
    this launch's ranks wrote."""
    summary, stale = stage_result(cfg, stage)
    wall = (summary or {}).get("wall")
    if stale or not wall or wall.get("rank_end", 0) < t0:
        return
    wall = complete(wall)
    write_summary(cfg.stage_dir(stage) / "summary.json", {
        **summary, "wall": wall, "wall_time_s": wall["total_s"],
        "wall_samples_per_s": wall["samples_per_s"]})


def refuse_repeated_divergence(cfg: Config, stage: str) -> None:
    """A stage that diverged with exactly these inputs diverges again: a retry (Snakemake's
    `retries`) stops at once instead of resuming into the same NaN."""
    failed = _read_failure(cfg.stage_dir(stage))
    if failed and failed.get("record") == expected_record(cfg, stage):
        raise DivergedBefore(f"stage '{stage}' diverged with these settings before: "
                             f"{failed['reason']}; change the settings (or delete "
                             f"{cfg.stage_dir(stage) / 'failed.json'} to try them again)")


class DivergedBefore(UserError):
    exit_code = EXIT_DIVERGED


def _outcome(cfg: Config, stage: str, rc: int, stop_signal: str | None, quiet: bool,
             rank_error: str | None = None) -> int:
    """The launcher's one message and exit code, from what the ranks left behind (a rank's
    mistake: `rank_error`, rankerror.py)."""
    out = cfg.stage_dir(stage)
    said = (lambda *a, **k: None) if quiet else print
    if rank_error:
        raise UserError(rank_error)
    summary, stale = stage_result(cfg, stage)
    failed = _read_failure(out)
    if failed and failed.get("record") == expected_record(cfg, stage):
        said(f"ddpflow: error: stage '{stage}' stopped: {failed['reason']}; the last good "
             f"checkpoint is kept in {out / 'checkpoints'}", file=sys.stderr)
        return EXIT_DIVERGED
    if rc == 0 and summary and not stale:
        said(f"ddpflow: stage '{stage}' finished: {result_text(summary)}, "
             f"{summary['steps']} steps, "
             f"{summary['wall_time_s']:.1f} s -> {out / 'summary.json'}", file=sys.stderr)
        return 0
    has_ckpt = bool(checkpoint.list_checkpoints(out / "checkpoints"))
    if rc in (0, EXIT_STOPPED) or stop_signal:
        if not has_ckpt:
            said(f"ddpflow: stage '{stage}' was stopped ({stop_signal or 'signal'}) before its "
                 f"first checkpoint: nothing to resume; run the same command again to start "
                 f"it", file=sys.stderr)
        else:
            said(f"ddpflow: stage '{stage}' stopped at a checkpoint before its end "
                 f"(preempted); run the same command again to resume from "
                 f"{out / 'checkpoints'}", file=sys.stderr)
        return EXIT_STOPPED
    gone = missing_nodes_text(cfg, out)
    kept = (f"completed checkpoints are kept in {out / 'checkpoints'} and a rerun resumes "
            f"from the newest valid one" if has_ckpt else "no checkpoint was written yet")
    why = gone or hangreport.report(out, cfg.hardware.timeout_s, said) or (
        f"torchrun exited with {rc} after up to {cfg.hardware.max_restarts} restart(s)")
    said(f"ddpflow: error: stage '{stage}' failed: {why}; {kept}", file=sys.stderr)
    return rc if rc > 0 else 1
