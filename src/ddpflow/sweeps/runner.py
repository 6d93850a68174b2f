"""How the sweep's scheduler runs one `ddpflow` command of a trial: on this node, or as a
Slurm job.

On one node each command is a child process; `ddpflow launch` takes the first free slot of
the sweep's pool itself (launch/slots.py), so `sweep.parallel` commands at once share the
node's GPUs (or cores) without two on one. Under Slurm each command is `sbatch --wait` with
the trial's `slurm:` sizes, as the Slurm profile would submit a training job; the scheduler
(a local job of the workflow) waits for it. `stop()` stops everything running: SIGTERM to a
child (the launcher stops its ranks at a checkpoint), `scancel` of a job (Slurm signals the
job, which checkpoints the same way).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from ddpflow.config import Config
from ddpflow.core.errors import UserError
from ddpflow.core.quoting import shell_line

SLURM_PARALLEL = 4  # sweep.parallel auto under Slurm: jobs in the queue at once


def ddpflow_words(log: Path, words: list[str]) -> list[str]:
    """The command line of `ddpflow --log=LOG <words>` with this Python."""
    return [sys.executable, "-m", "ddpflow", f"--log={log}", *map(str, words)]


class LocalRunner:
    """Child processes of the scheduler (every one in its process group: a Ctrl-C reaches
    them all, and `stop` signals each)."""

    where = "this node"

    def __init__(self):
        self.running: dict[int, subprocess.Popen] = {}
        self.lock = threading.Lock()
        self.stopping = False

    def run(self, cfg: Config, words: list[str], log: Path, gpus: bool = True) -> int:
        log.parent.mkdir(parents=True, exist_ok=True)
        with self.lock:
            if self.stopping:
                return 128 + signal.SIGTERM
            proc = subprocess.Popen(ddpflow_words(log, words), stdin=subprocess.DEVNULL)
            self.running[proc.pid] = proc
        try:
            return proc.wait()
        finally:
            with self.lock:
                self.running.pop(proc.pid, None)

    def preflight(self, cfg: Config, log: Path) -> None:
        """Nothing to ask of this node beforehand: the slots were checked when planning."""

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            for proc in self.running.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)


class SlurmRunner:
    """`sbatch --wait` per command; the job's exit code is the command's. Each distinct
    request is put to `sbatch --test-only` first: one Slurm can never run stops the sweep
    with sbatch's reason, instead of a job pending forever (as common.smk's pre-flight)."""

    where = "Slurm"

    def __init__(self):
        self.jobs: dict[str, subprocess.Popen] = {}
        self.lock = threading.Lock()
        self.stopping = False
        self.tested: set[tuple] = set()

    def run(self, cfg: Config, words: list[str], log: Path, gpus: bool = True) -> int:
        log.parent.mkdir(parents=True, exist_ok=True)
        opts = sbatch_options(cfg, log, gpus)
        self._test(opts)
        cmd = sbatch_command(opts, log, words)
        with self.lock:
            if self.stopping:
                return 128 + signal.SIGTERM
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    stdin=subprocess.DEVNULL, text=True)
        job = proc.stdout.readline().strip().split(";")[0]  # printed at submission
        with self.lock:
            self.jobs[job] = proc
        try:
            _, err = proc.communicate()
        finally:
            with self.lock:
                self.jobs.pop(job, None)
        if proc.returncode and not job and not self.stopping:
            raise UserError(f"sbatch refused a job of the sweep: {err.strip()[:300]}; check "
                            f"the slurm: section of the config (docs/slurm.md)")
        return proc.returncode

    def preflight(self, cfg: Config, log: Path) -> None:
        """Both kinds of job a trial submits (preparing data, training), tested before any."""
        for gpus in (False, True):
            self._test(sbatch_options(cfg, log, gpus))

    def _test(self, opts: list[str]) -> None:
        asked = tuple(o for o in opts if not o.startswith(("--job-name=", "--output=")))
        if asked in self.tested:
            return
        try:
            r = subprocess.run(["sbatch", "--test-only", *opts, "--wrap", "true"],
                               capture_output=True, text=True, timeout=60)
        except FileNotFoundError:
            raise UserError("the sweep's scheduler runs its trials with sbatch under Slurm, "
                            "but sbatch is not on PATH here; run the workflow where Slurm's "
                            "commands are, or without the Slurm profile") from None
        if r.returncode:
            why = "; ".join(ln.strip() for ln in r.stderr.splitlines() if ln.strip())
            raise UserError(f"Slurm refuses a job of the sweep: {why or r.returncode}; it was "
                            f"not submitted. It asks for: {' '.join(asked)}. Check the "
                            f"partition, the account and the sizes in the config's slurm: "
                            f"section (docs/slurm.md)")
        self.tested.add(asked)

    def stop(self) -> None:
        """scancel every job (Slurm signals it: it stops at a checkpoint), then end the
        waiting sbatch processes (they poll a cancelled job slowly)."""
        with self.lock:
            self.stopping = True
            jobs = dict(self.jobs)
        if [j for j in jobs if j]:
            subprocess.run(["scancel", *[j for j in jobs if j]], capture_output=True)
        for proc in jobs.values():
            if proc.poll() is None:
                proc.terminate()


def sbatch_command(opts: list[str], log: Path, words: list[str]) -> list[str]:
    """`sbatch --wait` of one command: the batch shell execs ddpflow (so Slurm's signal
    reaches the launcher), every word quoted for that shell (core/quoting.py)."""
    return ["sbatch", "--parsable", "--wait", *opts,
            "--wrap", "exec " + shell_line(ddpflow_words(log, words))]


def sbatch_options(cfg: Config, log: Path, gpus: bool = True) -> list[str]:
    """sbatch's options for a trial's command, from its `slurm:` section (as common.smk's
    slurm_resources asks the executor for a training job): its GPUs (gpus False: a CPU job,
    e.g. preparing data), CPUs, memory, time and the signal before the time limit (to the
    batch shell, which execs ddpflow: the launcher relays it to the ranks)."""
    s = cfg.slurm
    opts = [f"--job-name=ddpflow-{cfg.run}", f"--output={log}.slurm",
            f"--time={s.runtime_min}", f"--signal=B:USR1@{s.signal_before_end_s}"]
    if gpus and s.gpus > 0:
        if s.gres:
            opts.append(f"--gres={s.gres}")
        else:
            opts.append(f"--gpus={s.gpu_model + ':' if s.gpu_model else ''}{s.gpus}")
        if s.cpus_per_gpu:
            opts.append(f"--cpus-per-gpu={s.cpus_per_gpu}")
    else:  # preparing data gets what the workflow's prepare rule gets: one CPU
        opts.append(f"--cpus-per-task={s.cpus if gpus else 1}")
    if s.mem_mb:
        opts.append(f"--mem={s.mem_mb}")
    if cfg.hardware.nodes > 1 and gpus:
        opts += [f"--nodes={cfg.hardware.nodes}", f"--ntasks={cfg.hardware.nodes}"]
    opts += [f"--partition={s.partition}"] if s.partition else []
    opts += [f"--account={s.account}"] if s.account else []
    return opts + s.extra.split()


def runner_for(via: str):
    return SlurmRunner() if via == "slurm" else LocalRunner()


def parallel(cfg: Config, via: str) -> int:
    """sweep.parallel resolved (auto): SLURM_PARALLEL jobs; inside one Slurm job, one (the
    job's allocation is one slot: launch takes no slot there); else this node's slots."""
    p = cfg.sweep.parallel
    if p != "auto":
        return int(p)
    if via == "slurm":
        return SLURM_PARALLEL
    if os.environ.get("SLURM_JOB_ID"):
        return 1
    from ddpflow.launch.slots import layout

    return len(layout(cfg.hardware.device, cfg.sweep.gpus_per_trial,
                      cfg.sweep.threads_per_trial))
