"""`ddpflow launch`: check everything a stage needs, then run one torchrun for it.

One torchrun with N ranks per stage (never N copies of the job). A static rendezvous
on 127.0.0.1 with a free port is used: it survives `--max-restarts` where the
standalone store does not (stale addresses, pytorch issue 135712).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import torch

from .config import Config
from .data import prepared
from .data.prepared import write_json_atomic
from .errors import UserError
from .summary import read_summary

EXIT_STOPPED = 75  # stopped at a checkpoint before the end (preempted): run again to resume


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    cores = os.cpu_count() or 1
    threads = (max(1, cores // n) if hw.threads_per_rank == "auto" else int(hw.threads_per_rank))
    env.update(OMP_NUM_THREADS=str(threads), DDPFLOW_THREADS=str(threads),
               PYTHONUNBUFFERED="1", TORCH_NCCL_ASYNC_ERROR_HANDLING="1")
    if cfg.deterministic:
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    return n, device, env


def preflight(cfg: Config, stage: str) -> None:
    """Everything a stage needs that can be checked before any rank starts."""
    st = cfg.stage(stage)
    if cfg.hardware.nodes > 1:
        raise UserError("hardware.nodes > 1 is not supported by `ddpflow launch` yet; "
                        "use one node")
    if prepared.read_meta(cfg.data_dir) is None:
        raise UserError(f"no prepared data at {cfg.data_dir}; run `ddpflow prepare --config ...`"
                        f" first (or the workflow's data rule)")
    if st.init_from == "previous":
        prev = cfg.stages[cfg.stage_index(stage) - 1].name
        if read_summary(cfg.stage_dir(prev) / "summary.json") is None:
            raise UserError(f"stage '{stage}' starts from stage '{prev}', which has not "
                            f"finished; run '{prev}' first")
    elif st.init_from and not Path(st.init_from).is_file():
        raise UserError(f"init_from of stage '{stage}': {st.init_from} does not exist")


def plan(cfg: Config, stage: str, resolved: Path, extra_args: list[str] = ()) -> tuple[list, dict]:
    """The torchrun command line and environment for one stage."""
    n, _device, env = resolve_ranks(cfg)
    if cfg.stage(stage).strategy == "dp":
        n = 1  # DataParallel: one process drives every visible GPU
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
           f"--nproc-per-node={n}", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
           f"--max-restarts={cfg.hardware.max_restarts}", "--module", "ddpflow", "train",
           "--resolved", str(resolved), "--stage", stage, *extra_args]
    return cmd, env


def _ignore_usr1() -> None:
    # torchrun has no SIGUSR1 handler and would die of it; its ranks install their own
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def _torchrun(cmd: list, env: dict) -> int:
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, preexec_fn=_ignore_usr1)

    def forward(signum, _frame):  # preemption: torchrun relays SIGTERM to every rank
        proc.send_signal(signal.SIGTERM)

    for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(s, forward)
    return proc.wait()


def launch(cfg: Config, stage: str, dry_run: bool = False, extra_args: list[str] = ()) -> int:
    from . import container

    st = cfg.stage(stage)
    out = cfg.stage_dir(st.name)
    resolved = out / "config.json"
    in_image = cfg.container.engine != "none" and not os.environ.get(container.IN_CONTAINER)
    if in_image:
        print(f"ddpflow: stage '{stage}' runs in the {cfg.container.engine} image "
              f"{cfg.container.image}", file=sys.stderr)
    else:
        n, device, _ = resolve_ranks(cfg)
        cmd, env = plan(cfg, stage, resolved, list(extra_args))
        shown = " ".join(f"{k}={v}" for k, v in env.items() if k == "CUDA_VISIBLE_DEVICES")
        print(f"ddpflow: stage '{stage}': {n} rank(s) on {device}", file=sys.stderr)
        print(f"ddpflow: {shown + ' ' if shown else ''}{' '.join(cmd)}", file=sys.stderr)
    if dry_run:
        return 0
    preflight(cfg, stage)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(resolved, cfg.to_dict())
    if in_image:
        rc = container.run_stage(cfg, resolved, stage, list(extra_args))
    else:
        write_json_atomic(out / "command.json", {"argv": cmd, "env": env})
        rc = _torchrun(cmd, env)
    summary = read_summary(out / "summary.json")
    if rc == 0 and summary:
        print(f"ddpflow: stage '{stage}' finished: val_acc {summary['final_val_acc']:.4f} "
              f"(best {summary['best_val_acc']:.4f}), {summary['steps']} steps, "
              f"{summary['wall_time_s']:.1f} s -> {out / 'summary.json'}", file=sys.stderr)
        return 0
    if rc in (0, EXIT_STOPPED):
        if not in_image:
            print(f"ddpflow: stage '{stage}' stopped at a checkpoint before its end "
                  f"(preempted); run the same command again to resume from "
                  f"{out / 'checkpoints'}", file=sys.stderr)
        return EXIT_STOPPED
    if not in_image:
        print(f"ddpflow: error: stage '{stage}' failed: torchrun exited with {rc} after up to "
              f"{cfg.hardware.max_restarts} restart(s); completed checkpoints are kept in "
              f"{out / 'checkpoints'} and a rerun resumes from the newest valid one",
              file=sys.stderr)
    return rc if rc > 0 else 1
