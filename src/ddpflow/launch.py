"""`ddpflow launch`: check everything a stage needs, then run one torchrun for it.

One torchrun with N ranks per stage (never N copies of the job). The rendezvous is c10d
on 127.0.0.1 with a free port and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: it survives
`--max-restarts`, where a shared or static store can hand a restarted rank the address
of a dead peer (stale addresses, pytorch issue 135712).
"""

from __future__ import annotations

import json
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
EXIT_DIVERGED = 3  # loss became NaN/inf: rerunning the same settings will not help


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
               PYTHONUNBUFFERED="1", TORCH_NCCL_ASYNC_ERROR_HANDLING="1",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    if cfg.deterministic:
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    return n, device, env


def stage_ranks(cfg: Config, stage: str) -> tuple[int, str, dict[str, str]]:
    """resolve_ranks for one stage: DataParallel runs one process that drives every GPU."""
    n, device, env = resolve_ranks(cfg)
    return (1 if cfg.stage(stage).strategy == "dp" else n), device, env


def preflight(cfg: Config, stage: str) -> None:
    """Everything a stage needs that can be checked before any rank starts."""
    st = cfg.stage(stage)
    if st.batch_size == "auto" and not (cfg.run_dir / "tune.json").is_file():
        raise UserError(f"stages.{cfg.stage_index(stage)}.batch_size is auto but "
                        f"{cfg.run_dir / 'tune.json'} does not exist: run `ddpflow tune "
                        f"--config ...` (or set tune.enabled: true in the workflow), or give "
                        f"a number")
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


def plan(cfg: Config, stage: str, resolved: Path, extra_args: list[str] = (),
         command: str = "train", ranks: tuple | None = None) -> tuple[list, dict]:
    """The torchrun command line and environment for one stage (or its tuning);
    `ranks` is stage_ranks(cfg, stage) where the caller has it already."""
    n, _device, env = ranks or stage_ranks(cfg, stage)
    train = ["--module", "ddpflow", command, "--resolved", str(resolved), "--stage", stage,
             *extra_args]
    restarts = f"--max-restarts={cfg.hardware.max_restarts}"
    if cfg.hardware.nodes == 1:
        # a c10d rendezvous on this machine: every restart round gets fresh store keys, so a
        # restarted rank never dials a dead peer's address (pytorch issue 135712)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
               f"--nproc-per-node={n}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-id={stage}-{os.getpid()}",
               restarts, *train]
        return cmd, env
    # several nodes: one torchrun per node through srun, meeting at a c10d rendezvous
    # on the first node of the Slurm allocation (where this launcher runs)
    nodes = cfg.hardware.nodes
    hosts = slurm_hosts()
    if len(hosts) < nodes:
        raise UserError(f"hardware.nodes is {nodes} but the Slurm allocation has "
                        f"{len(hosts)} node(s); submit with --nodes={nodes} "
                        f"(slurm resource nodes) or lower hardware.nodes")
    job = os.environ.get("SLURM_JOB_ID", "ddpflow")
    cmd = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1",
           "--kill-on-bad-exit=1", sys.executable, "-m", "torch.distributed.run",
           f"--nnodes={nodes}", f"--nproc-per-node={n}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint={hosts[0]}:{free_port()}", f"--rdzv-id={job}", restarts, *train]
    return cmd, env


def slurm_hosts() -> list[str]:
    """Host names of the current Slurm allocation, first = rendezvous host."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        raise UserError("hardware.nodes > 1 runs inside a Slurm allocation of that many "
                        "nodes (no SLURM_JOB_NODELIST here); use --profile profiles/slurm "
                        "or sbatch --nodes=N, see docs/slurm.md")
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise UserError(f"cannot expand the Slurm node list '{nodelist}' with scontrol ({e})"
                        ) from None
    return out.split()


def _child_setup() -> None:
    # runs in the torchrun process before exec: its own process group (so one killpg reaches
    # torchrun and every rank), no death from SIGUSR1 (torchrun has no handler for it; the
    # ranks install their own), and SIGTERM if this launcher dies (no orphaned ranks)
    os.setpgid(0, 0)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _torchrun(cmd: list, env: dict) -> tuple[int, str | None]:
    """Run torchrun; relay stop signals to its process group. Returns (exit code, signal)."""
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, preexec_fn=_child_setup)
    got: dict = {"signal": None}

    def forward(signum, _frame):
        # SIGUSR1 goes to the ranks as it is (torchrun ignores it); SIGTERM/SIGINT become
        # SIGTERM, which torchrun relays too. Either way every rank checkpoints and stops.
        got["signal"] = signal.Signals(signum).name
        sig = signal.SIGUSR1 if signum == signal.SIGUSR1 else signal.SIGTERM
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass

    for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(s, forward)
    return proc.wait(), got["signal"]


def _read_failure(out: Path) -> dict | None:
    try:
        return json.loads((out / "failed.json").read_text())
    except (OSError, ValueError):
        return None


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
        ranks = stage_ranks(cfg, stage)
        n, device, _ = ranks
        cmd, env = plan(cfg, stage, resolved, list(extra_args), ranks=ranks)
        shown = " ".join(f"{k}={v}" for k, v in env.items() if k == "CUDA_VISIBLE_DEVICES")
        print(f"ddpflow: stage '{stage}': {n} rank(s) on {device}", file=sys.stderr)
        print(f"ddpflow: {shown + ' ' if shown else ''}{' '.join(cmd)}", file=sys.stderr)
    if dry_run:
        return 0
    preflight(cfg, stage)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(resolved, cfg.to_dict())
    if in_image:
        rc, stop_signal = container.run_stage(cfg, resolved, stage, list(extra_args)), None
    else:
        write_json_atomic(out / "command.json", {"argv": cmd, "env": env})
        rc, stop_signal = _torchrun(cmd, env)
    summary = read_summary(out / "summary.json")
    failed = _read_failure(out)
    if failed and not summary:
        print(f"ddpflow: error: stage '{stage}' stopped: {failed['reason']}; the last good "
              f"checkpoint is kept in {out / 'checkpoints'}", file=sys.stderr)
        return EXIT_DIVERGED
    if rc == 0 and summary:
        print(f"ddpflow: stage '{stage}' finished: val_acc {summary['final_val_acc']:.4f} "
              f"(best {summary['best_val_acc']:.4f}), {summary['steps']} steps, "
              f"{summary['wall_time_s']:.1f} s -> {out / 'summary.json'}", file=sys.stderr)
        return 0
    if rc in (0, EXIT_STOPPED) or stop_signal:
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


def tune(cfg: Config, stage: str | None, memory_cap_mb: str | None) -> int:
    """`ddpflow tune`: one torchrun whose ranks measure together; writes <run>/tune.json."""
    stage = stage or cfg.tune.stage or cfg.stages[0].name
    cfg.stage(stage)
    if prepared.read_meta(cfg.data_dir) is None:
        raise UserError(f"no prepared data at {cfg.data_dir}; run `ddpflow prepare` first")
    out = cfg.run_dir / "tune"
    resolved = out / "config.json"
    extra = [f"--memory-cap-mb={memory_cap_mb}"] if memory_cap_mb else []
    cmd, env = plan(cfg, stage, resolved, extra, command="tune-rank")
    print(f"ddpflow: tuning for stage '{stage}': {' '.join(cmd)}", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(resolved, cfg.to_dict())
    rc, _ = _torchrun(cmd, env)
    result = cfg.run_dir / "tune.json"
    if rc != 0 or not result.is_file():
        print(f"ddpflow: error: tuning failed (torchrun exited with {rc})", file=sys.stderr)
        return rc or 1
    choice = json.loads(result.read_text())["choice"]
    print(f"ddpflow: tuned -> {result}: " + ", ".join(f"{k} {v}" for k, v in choice.items()),
          file=sys.stderr)
    return 0
