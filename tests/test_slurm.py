"""A real Slurm cluster (tests/setup/slurm.sh): the workflow through the Slurm executor,
fake GPUs requested and seen, SIGUSR1 from scancel mid-training, a missing account, and one
job across two hosts (network namespaces with their own slurmd) that survives a killed node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, ddpflow
from test_workflow import TINY, write

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
FAST_POLL = ["--slurm-init-seconds-before-status-checks", "1",
             "--seconds-between-status-checks", "1"]


@pytest.fixture(scope="module", autouse=True)
def cluster():
    state = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True,
                           text=True)
    nodes = dict(line.split() for line in state.stdout.splitlines())
    assert state.returncode == 0 and len(nodes) == 3 and all(
        s in ("idle", "mixed", "allocated") for s in nodes.values()), (
        f"no Slurm cluster of three nodes ({nodes}): run `bash tests/setup/slurm.sh` "
        f"(make test does)")


def slurm_snakemake(workdir: Path, *args, background=False):
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    cmd = [sys.executable, str(REPO / "tests/snakemake_every_second.py"),
           "-s", str(REPO / "Snakefile"), "-d", str(workdir),
           "--configfile", str(workdir / "tiny.yaml"), "--profile",
           str(REPO / "profiles/slurm"), *FAST_POLL, *args]
    if background:
        return subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=900)


def sacct(job: str) -> list[tuple[str, str]]:
    """(state, allocated resources) of a job, e.g. ('COMPLETED', 'cpu=2,gres/gpu=2,...')."""
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job, "-o", "State,AllocTRES"],
                         capture_output=True, text=True).stdout
    return [tuple(line.split("|", 1)) for line in out.strip().splitlines()]


def test_workflow_on_slurm_with_fake_gpus(tmp_path):
    cfg = {**TINY, "slurm": {"gpus": 2, "cpus_per_gpu": 1, "mem_mb": 1000, "runtime_min": 10}}
    write(tmp_path, cfg)
    proc = slurm_snakemake(tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    for stage in ("a", "b"):
        s = json.loads((tmp_path / f"results/wf/stages/{stage}/summary.json").read_text())
        env = s["environment"]
        assert env["slurm_job_id"], "the stage did not run as a Slurm job"
        assert sorted(env["cuda_visible_devices"].split(",")) == ["0", "1"]
        assert s["world_size"] == 2 and s["device"] == "cpu"  # no CUDA here: trains on CPU
        (state, tres), = sacct(env["slurm_job_id"])
        assert state == "COMPLETED" and "gres/gpu=2" in tres, tres
        steps = subprocess.run(["sacct", "-n", "-P", "-j", env["slurm_job_id"], "-o",
                                "JobID,NTasks"], capture_output=True, text=True).stdout
        tasks = [line.split("|") for line in steps.split() if line.split("|")[1]]
        assert tasks and all(n == "1" for _, n in tasks), steps  # ONE task with both GPUs
    assert (tmp_path / "results/wf/summary/report.html").is_file()

    # a job that gets other GPUs than the stage asks for stops with both counts named
    proc = slurm_snakemake(tmp_path, "--forcerun", "train", "--set-resources", "train:gpu=1",
                           "--retries", "0")
    assert proc.returncode != 0
    log = (tmp_path / "results/wf/logs/train_a.log").read_text()
    assert "sees 1 GPU(s)" in log and "slurm.gpus asks for 2" in log, log[-2000:]
    assert "Traceback" not in log


def test_scancel_usr1_mid_training_then_retry(tmp_path):
    stage = {"name": "a", "max_steps": 300, "batch_size": 32, "lr": 0.05}
    cfg = {**TINY, "deterministic": True, "log_every_steps": 5,
           "data": {"train_size": 1024, "val_size": 64, "test_size": 64, "image_size": 16},
           "checkpoint": {"every_steps": 10, "keep_last": 3}, "stages": [stage],
           "slurm": {"gpus": 1, "cpus_per_gpu": 2, "mem_mb": 1000, "runtime_min": 10}}
    # the uninterrupted reference, outside Slurm
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "c.yaml").write_text(json.dumps({**cfg, "results_dir": str(ref / "results")}))
    ddpflow("prepare", "--config", ref / "c.yaml", check=True)
    ddpflow("launch", "--config", ref / "c.yaml", "--stage", "a", check=True)

    wd = tmp_path / "wd"
    wd.mkdir()
    write(wd, cfg)
    proc = slurm_snakemake(wd, "results/wf/stages/a/final.pt", background=True)
    ckdir = wd / "results/wf/stages/a/checkpoints"
    job = None
    t0 = time.time()
    while time.time() - t0 < 300:
        steps = sorted(int(p.name[5:14]) for p in ckdir.glob("ckpt-*.pt")) \
            if ckdir.is_dir() else []
        if steps and steps[-1] >= 30:
            jobs = subprocess.run(["squeue", "-h", "-o", "%i %k"], capture_output=True,
                                  text=True).stdout.splitlines()
            job = next((j.split()[0] for j in jobs if "train" in j), None)
            break
        time.sleep(0.2)
    assert job, "the training job never got going"
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    states = [state for state, _ in sacct(job)]
    assert states and states[0] != "COMPLETED", states  # the signalled attempt stopped early
    log = (wd / "results/wf/logs/train_a.log").read_text()  # the retry's log
    resumed = int(log.split("resumed from ckpt-")[1][:9])
    # the signalled ranks wrote a new checkpoint at a log boundary after the signal
    assert resumed > steps[-1] and resumed % 5 == 0, (resumed, steps)
    a = torch.load(wd / "results/wf/stages/a/final.pt", weights_only=True)["model"]
    b = torch.load(ref / "results/wf/stages/a/final.pt", weights_only=True)["model"]
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _node(partition: str) -> tuple[int, int, int]:
    """(CPUs, MiB, GPUs) of the (one) node of a partition of the test cluster."""
    line = subprocess.run(["sinfo", "-h", "-N", "-p", partition, "-o", "%c %m %G"],
                          capture_output=True, text=True, check=True).stdout.split()
    return int(line[0]), int(line[1]), int(line[2].split(":")[-1]) if "gpu" in line[2] else 0


def test_the_default_slurm_section_submits_and_runs(tmp_path):
    """No slurm: keys at all (issue 34: 64000 MiB and 8 cores a GPU did not fit a node): the
    job asks for a GPU's share of the debug node, as sinfo gives it, and trains."""
    cfg = {**TINY, "hardware": {"nproc_per_node": 1, "threads_per_rank": 1},
           "stages": [{**TINY["stages"][0], "epochs": 1}]}
    write(tmp_path, cfg)
    proc = slurm_snakemake(tmp_path, "results/wf/stages/a/final.pt")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    cpus, mem, gpus = _node("debug")
    used = json.loads((tmp_path / "results/wf/workflow_config.json").read_text())["slurm"]
    assert used["partition"] == "debug"  # the profile's, which the sizes are a share of
    assert (used["cpus_per_gpu"], used["mem_mb"]) == (min(8, cpus // gpus), mem // gpus)
    s = json.loads((tmp_path / "results/wf/stages/a/summary.json").read_text())
    (state, tres), = sacct(s["environment"]["slurm_job_id"])
    assert state == "COMPLETED", state
    assert f"mem={mem // gpus}M" in tres and "gres/gpu=1" in tres, tres


def _run_id(out: str) -> str:
    return out.split("SLURM run ID: ")[1].split()[0]


def test_a_refused_request_is_one_message_and_nothing_is_submitted(tmp_path):
    """An account Slurm does not know: sbatch --test-only says so once, before anything is
    submitted (not a failed job, then three retries of the same refusal)."""
    cfg = {**TINY, "slurm": {"runtime_min": 5, "account": "no-such-account"},
           "stages": [TINY["stages"][0]]}
    write(tmp_path, cfg)
    proc = slurm_snakemake(tmp_path)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    refused = "Slurm refuses the jobs of rule "
    assert out.count(refused) == 1, out[-3000:]
    assert "Invalid account or account/partition combination specified" in out, out[-3000:]
    assert "-A no-such-account -p debug" in out and "Traceback" not in out, out[-3000:]
    assert "has been submitted" not in out and "sbatch failed" not in out, out[-3000:]
    jobs = subprocess.run(["sacct", "-n", "-X", "-P", "-S", "now-1hour", "--name",
                           _run_id(out), "-o", "JobID"], capture_output=True, text=True)
    assert jobs.returncode == 0 and jobs.stdout.strip() == "", jobs.stdout
    assert not (tmp_path / "results/wf/stages/a/final.pt").exists()
    # the workflow is not left locked: the next run gets as far as the same refusal
    again = slurm_snakemake(tmp_path)
    assert (again.stdout + again.stderr).count(refused) == 1, again.stderr[-3000:]

    # more memory than the node has: one message naming the key and the node's figure,
    # when the config is read (no job, no sbatch)
    _, mem, _ = _node("debug")
    write(tmp_path, {**cfg, "slurm": {"runtime_min": 5, "mem_mb": mem + 1000}})
    proc = slurm_snakemake(tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and out.count("invalid config: slurm.mem_mb") == 1, out[-3000:]
    assert f"{mem + 1000} MiB but the largest node of partition debug has {mem} MiB" in out
    assert "SLURM run ID" not in out and "Traceback" not in out, out[-3000:]


def test_sweep_on_slurm_one_job_and_one_gpu_per_trial(tmp_path):
    cfg = {**TINY, "hardware": {"nproc_per_node": 1, "threads_per_rank": 1},
           "stages": [{"name": "a", "epochs": 2, "batch_size": 32, "lr": 0.1}],
           "slurm": {"gpus": 2, "cpus_per_gpu": 1, "mem_mb": 1000, "runtime_min": 10},
           "sweep": {"grid": {"stages.0.lr": [0.05, 0.1]}, "gpus_per_trial": 1}}
    write(tmp_path, cfg)
    proc = slurm_snakemake(tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    board = json.loads((tmp_path / "results/wf/sweep/leaderboard.json").read_text())
    assert len(board["trials"]) == 2 and all(r["status"] == "finished" for r in board["trials"])
    seen, jobs = [], set()
    for trial in board["trials"]:
        s = json.loads((tmp_path / f"results/wf/trials/{trial['trial']}/stages/a/summary.json")
                       .read_text())
        env = s["environment"]
        jobs.add(env["slurm_job_id"])
        (state, tres), = sacct(env["slurm_job_id"])
        assert state == "COMPLETED" and "gres/gpu=1" in tres, tres  # gpus_per_trial, not 2
        seen.append(env["cuda_visible_devices"])
    assert len(jobs) == 2, "each trial is its own Slurm job"
    assert all(len(g.split(",")) == 1 for g in seen), seen
    # the two jobs ran side by side on the node's two GPUs: one each
    assert sorted(seen) == ["0", "1"], seen


def test_asha_sweep_on_slurm_one_job_per_rung(tmp_path):
    """sweep.scheduler asha under the Slurm profile: the scheduler is a local job that hands
    each rung of each trial to sbatch with the trial's GPUs; a paused trial's job exits 75
    (stopped at a checkpoint), the promoted one resumes in a job of its own."""
    cfg = {**TINY, "hardware": {"nproc_per_node": 1, "threads_per_rank": 1},
           "stages": [{"name": "a", "epochs": 2, "batch_size": 32, "lr": 0.1}],
           "slurm": {"gpus": 2, "cpus_per_gpu": 1, "mem_mb": 1000, "runtime_min": 10},
           "sweep": {"grid": {"stages.0.lr": [0.05, 0.1]}, "gpus_per_trial": 1,
                     "scheduler": "asha", "asha": {"eta": 2, "min_epochs": 1}}}
    write(tmp_path, cfg)
    proc = slurm_snakemake(tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    res = tmp_path / "results/wf"
    assert "on Slurm" in (res / "logs/sweep/schedule.log").read_text()
    rows = json.loads((res / "sweep/leaderboard.json").read_text())["trials"]
    assert sorted(r["status"] for r in rows) == ["finished", "paused"], rows
    segments = {}
    for r in rows:
        out = subprocess.run(["sacct", "-n", "-X", "-P", "--name", f"ddpflow-{r['trial']}",
                              "-S", "now-1hour", "-o", "JobID,State,ExitCode,AllocTRES,WorkDir"],
                             capture_output=True, text=True).stdout
        jobs = [line.split("|") for line in out.strip().splitlines()]
        # this test's training jobs only: another test's sweep names its trials the same
        segments[r["status"]] = [j for j in jobs if "gres/gpu=1" in j[3]
                                 and Path(j[4]).resolve().is_relative_to(tmp_path.resolve())]
    # the paused trial: one job, stopped at its rung's checkpoint (exit 75); the finished
    # one: that, then its promotion, resumed in a job of its own
    assert [j[2] for j in segments["paused"]] == ["75:0"], segments
    assert [j[2] for j in segments["finished"]] == ["75:0", "0:0"], segments
    finished = next(r for r in rows if r["status"] == "finished")
    s = json.loads((res / f"trials/{finished['trial']}/stages/a/summary.json").read_text())
    assert s["environment"]["slurm_job_id"] == segments["finished"][1][0]
    assert len(s["environment"]["cuda_visible_devices"].split(",")) == 1


def test_a_scheduled_sweep_slurm_refuses_is_one_message_and_nothing_submitted(tmp_path):
    cfg = {**TINY, "results_dir": str(tmp_path / "results"),
           "hardware": {"nproc_per_node": 1, "threads_per_rank": 1},
           "stages": [{"name": "a", "epochs": 2, "batch_size": 32, "lr": 0.1}],
           "slurm": {"gpus": 0, "cpus": 64, "mem_mb": 1000, "runtime_min": 10},
           "sweep": {"grid": {"stages.0.lr": [0.05, 0.1]}, "scheduler": "asha",
                     "asha": {"eta": 2, "min_epochs": 1}}}
    (tmp_path / "c.yaml").write_text(json.dumps(cfg))
    proc = ddpflow("sweep", "schedule", "--via", "slurm", "--config", tmp_path / "c.yaml")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "Slurm refuses a job of the sweep: allocation failure" in proc.stderr
    assert "--cpus-per-task=64" in proc.stderr
    assert not (tmp_path / "results/wf/sweep/schedule/state.json").exists()
    assert not list((tmp_path / "results/wf/trials").glob("*/stages"))  # nothing trained
    assert not list((tmp_path / "results/wf/sweep").glob("data/*/meta.json"))  # nor prepared


def _pair_ranks(node: str) -> list[int]:
    """PIDs of the training ranks running on a namespaced host."""
    pids = subprocess.run(["ip", "netns", "pids", node], capture_output=True,
                          text=True).stdout.split()
    found = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"ddpflow" in cmd and b"train" in cmd and b"--resolved" in cmd:
            found.append(int(pid))
    return found


def test_two_nodes_one_job_and_a_killed_node(tmp_path):
    """hardware.nodes 2 x 2 ranks through profiles/slurm on partition pair (two hosts, each
    its own network namespace and slurmd): one srun starts a torchrun on each host, they meet
    at the c10d rendezvous on the first and train as 4 gloo ranks. Node ddpn2's ranks are
    killed mid-run: the attempt fails within hardware.timeout_s, Snakemake's retry resumes
    from the newest checkpoint, and the final weights equal those of the same training run
    uninterrupted by 4 ranks on one machine (deterministic mode)."""
    stage = {"name": "a", "max_steps": 40, "batch_size": 8, "lr": 0.05}
    cfg = {**TINY, "deterministic": True, "log_every_steps": 5,
           "data": {"train_size": 1024, "val_size": 64, "test_size": 64, "image_size": 16},
           "hardware": {"nodes": 2, "nproc_per_node": 2, "threads_per_rank": 1,
                        "device": "cpu", "max_restarts": 0, "timeout_s": 60},
           "checkpoint": {"every_steps": 5, "keep_last": 3}, "stages": [stage],
           "slurm": {"partition": "pair", "gpus": 0, "cpus": 2, "mem_mb": 1000,
                     "runtime_min": 10}}
    ref = tmp_path / "ref"
    ref.mkdir()
    one_node = {**cfg, "results_dir": str(ref / "results"),
                "hardware": {**cfg["hardware"], "nodes": 1, "nproc_per_node": 4}}
    (ref / "c.yaml").write_text(json.dumps(one_node))
    ddpflow("prepare", "--config", ref / "c.yaml", check=True)
    ddpflow("launch", "--config", ref / "c.yaml", "--stage", "a", check=True)

    wd = tmp_path / "wd"
    wd.mkdir()
    write(wd, cfg)
    started = time.time()
    proc = slurm_snakemake(wd, "results/wf/stages/a/final.pt", background=True)
    ckdir = wd / "results/wf/stages/a/checkpoints"
    victims = []
    while time.time() - started < 300 and not victims and proc.poll() is None:
        if ckdir.is_dir() and list(ckdir.glob("ckpt-*.pt")):
            victims = _pair_ranks("ddpn2")
        time.sleep(0.2)
    assert victims, "the two-node job never got going"
    # this job's start on this machine now (submission, two torch imports, rendezvous, first
    # steps): the slack a busy machine adds to its end too
    overhead = time.time() - started
    # ddpflow's srun step asks for the job's CPUs on each node itself (issue 36: since Slurm
    # 22.05 srun does not take --cpus-per-task from the batch job, and Snakemake's job step
    # drops the job's SLURM_* variables): srun tells the ranks it starts their CPUs
    env = Path(f"/proc/{victims[0]}/environ").read_bytes().decode(errors="replace")
    assert "\0SLURM_CPUS_PER_TASK=2\0" in f"\0{env}", env.split("\0")
    for pid in victims:
        os.kill(pid, 9)
    killed_at = time.time()
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    s = json.loads((wd / "results/wf/stages/a/summary.json").read_text())
    assert s["world_size"] == 4 and s["weights_in_sync"] is True
    assert sorted(s["rank_hosts"]) == ["ddpn1", "ddpn1", "ddpn2", "ddpn2"], s["rank_hosts"]
    job = s["environment"]["slurm_job_id"]
    (state, tres), = sacct(job)
    assert state == "COMPLETED" and "node=2" in tres, tres
    # the attempt the kill hit failed, and soon: within hardware.timeout_s of the kill
    rows = subprocess.run(["sacct", "-n", "-X", "-P", "-r", "pair", "-S",
                           time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
                           "-o", "JobID,State,End"], capture_output=True, text=True).stdout
    failed = [r.split("|") for r in rows.splitlines() if "|FAILED|" in r]
    assert len(failed) == 1, rows
    ended = time.mktime(time.strptime(failed[0][2], "%Y-%m-%dT%H:%M:%S"))
    assert ended - killed_at < cfg["hardware"]["timeout_s"] + overhead, (ended - killed_at,
                                                                         overhead, rows)
    log = (wd / "results/wf/logs/train_a.log").read_text()  # the retry's log
    assert "resumed from ckpt-" in log, log[-3000:]
    a = torch.load(ref / "results/wf/stages/a/final.pt", weights_only=True)["model"]
    b = torch.load(wd / "results/wf/stages/a/final.pt", weights_only=True)["model"]
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_node_that_cannot_reach_the_rendezvous_is_named(tmp_path):
    """Node ddpn2 cannot reach the rendezvous port on ddpn1 (a firewall rule in its network
    namespace drops it): the job fails within hardware.timeout_s, naming 1 of 2 nodes and
    the node, and leaves no summary or checkpoint that looks complete."""
    port = 29431
    cfg = {**TINY, "data": {"train_size": 64, "val_size": 16, "test_size": 16,
                            "image_size": 16},
           "hardware": {"nodes": 2, "nproc_per_node": 1, "threads_per_rank": 1,
                        "device": "cpu", "max_restarts": 0, "timeout_s": 10,
                        "rdzv_port": port},
           "stages": [{"name": "a", "max_steps": 4, "batch_size": 8, "lr": 0.05}]}
    (tmp_path / "c.yaml").write_text(json.dumps(cfg))
    ddpflow("prepare", "--config", tmp_path / "c.yaml", check=True, cwd=tmp_path)
    rule = ["OUTPUT", "-p", "tcp", "--dport", str(port), "-j", "DROP"]
    firewall = ["nsenter", "--net=/run/netns/ddpn2", "iptables"]
    subprocess.run([*firewall, "-A", *rule], check=True)
    try:
        sub = subprocess.run(
            ["sbatch", "--wait", "-p", "pair", "--nodes=2", "-c", "1", "--mem=500",
             "-o", str(tmp_path / "job.log"), "--chdir", str(tmp_path),
             f"--export=ALL,PATH={BIN}:{os.environ['PATH']}",
             "--wrap", f"{BIN / 'ddpflow'} launch --config c.yaml --stage a"],
            capture_output=True, text=True, timeout=300)  # (only a hang guard)
    finally:
        subprocess.run([*firewall, "-D", *rule], check=True)
    log = (tmp_path / "job.log").read_text()
    assert sub.returncode != 0, log[-3000:]
    assert "1 of 2 node(s) never joined the rendezvous on ddpn1" in log, log[-3000:]
    assert "within hardware.timeout_s (10 s): ddpn2" in log, log[-3000:]
    # the node gave up after hardware.timeout_s, and the host's torchrun would have too
    # (its join timeout), not after their defaults (600 s): as each was told
    assert "node ddpn2 could not reach the rendezvous at ddpn1:29431 within 10 s" in log, \
        log[-3000:]
    assert "--rdzv-conf=join_timeout=10 " in log, log[-3000:]
    assert "Traceback" not in log.split("could not reach")[-1], log[-3000:]
    stage = tmp_path / "results/wf/stages/a"
    assert not (stage / "summary.json").exists() and not (stage / "final.pt").exists()


def _pair_job(tmp_path: Path, log: str) -> str:
    """Submit `ddpflow launch` of c.yaml as a 2-node job on partition pair; its job id."""
    return subprocess.run(
        ["sbatch", "--parsable", "-p", "pair", "--nodes=2", "-c", "1", "--mem=500",
         "-o", str(tmp_path / log), "--chdir", str(tmp_path),
         f"--export=ALL,PATH={BIN}:{os.environ['PATH']}",
         "--wrap", f"{BIN / 'ddpflow'} launch --config c.yaml --stage a"],
        capture_output=True, text=True, check=True).stdout.strip().split(";")[0]


def _trained_to(metrics: Path, step: int, timeout: float = 180) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if metrics.is_file() and sum(1 for _ in metrics.open()) >= step // 5:
            return
        time.sleep(0.2)
    raise AssertionError(f"the two-node job never reached step {step}")


def _ended(job: str, timeout: float = 180) -> str:
    """Wait for a job to end; its exit code as sacct says it ('75:0')."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job, "-o", "State,ExitCode"],
                             capture_output=True, text=True).stdout.strip()
        if out and out.split("|")[0] not in ("PENDING", "RUNNING", "COMPLETING"):
            return out.split("|")[1]
        time.sleep(0.5)
    raise AssertionError(f"job {job} did not end")


def _launcher_pid(folder: Path) -> int:
    """The pid of the `ddpflow launch` running in folder (under ddpn1's slurmstepd)."""
    for pid in os.listdir("/proc"):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"launch" in cmd and os.readlink(f"/proc/{pid}/cwd") == str(folder):
                return int(pid)
        except (OSError, ValueError):
            continue
    raise AssertionError("no ddpflow launch process found")


def test_two_nodes_stop_at_a_checkpoint_on_usr1(tmp_path):
    """Preemption of a 2-node job. SIGUSR1 to the launcher (a user's kill, a wrapper that
    passes on a signal) is relayed through srun to the ranks on both nodes; SIGUSR1 to the
    job's steps (what the profile's `--signal=USR1@T` does) reaches the ranks and the torchrun
    agents, which ignore it. Either way the ranks write a checkpoint, the launcher exits 75,
    and the next submission resumes from it."""
    cfg = {**TINY, "log_every_steps": 5, "stop_check_s": 2,
           "data": {"train_size": 512, "val_size": 16, "test_size": 16, "image_size": 16},
           "hardware": {"nodes": 2, "nproc_per_node": 1, "threads_per_rank": 1,
                        "device": "cpu", "max_restarts": 0, "timeout_s": 60},
           "checkpoint": {"every_steps": 0, "every_epochs": 0},
           "stages": [{"name": "a", "max_steps": 100000, "batch_size": 8, "lr": 0.05}]}
    (tmp_path / "c.yaml").write_text(json.dumps(cfg))
    ddpflow("prepare", "--config", tmp_path / "c.yaml", check=True, cwd=tmp_path)
    stage = tmp_path / "results/wf/stages/a"
    steps = []
    for attempt in (1, 2):
        job = _pair_job(tmp_path, f"job{attempt}.log")
        _trained_to(stage / "metrics.jsonl", 10 + (steps[-1] if steps else 0))
        if attempt == 1:
            os.kill(_launcher_pid(tmp_path), 10)  # SIGUSR1
        else:
            subprocess.run(["scancel", "--signal=USR1", job], check=True)
        code = _ended(job)
        log = (tmp_path / f"job{attempt}.log").read_text()
        assert code == "75:0", (code, log[-3000:])
        assert "stopped at a checkpoint before its end (preempted)" in log, log[-3000:]
        ckpts = sorted(int(p.name[5:14]) for p in (stage / "checkpoints").glob("ckpt-*.pt"))
        assert ckpts and (not steps or ckpts[-1] > steps[-1]), (ckpts, steps)
        steps.append(ckpts[-1])
        assert not (stage / "final.pt").exists() and not (stage / "summary.json").exists()
    assert f"resumed from ckpt-{steps[0]:09d}" in log, log[-3000:]


# --------------------------------------------------------------------------- slurm.extra
def _sbatch(*words: str) -> subprocess.CompletedProcess:
    """The real sbatch, test-only and verbose (it lists the options it took), on `true`."""
    return subprocess.run(["sbatch", "--test-only", "-v", "--wrap=true", *words],
                          capture_output=True, text=True, timeout=120)


def _taken(stderr: str) -> set[str]:
    """The options sbatch says it took ("defined options"), the test's own included."""
    lines = stderr.split("defined options", 1)[-1].split("end of defined options")[0]
    return {ln.split(":", 1)[1].split(":")[0].strip() for ln in lines.splitlines()
            if ln.startswith("sbatch: ") and " : " in ln}


OWN = {"test-only", "verbose", "wrap"}  # what _sbatch adds
ALIAS = {"tasks-per-node": "ntasks-per-node"}  # one option, two names (sbatch lists the first)


SAME_AS_SBATCH = ["--partiti=pair", "--mail-type=END --outp=x.log --chd=.", "-p pair",
                  "-ppair", "-OH", "-Ok", "--array=1-3", "--hold", "--test", "--mail-t=END",
                  "--exclusive -w vm --reservation r1 -Ok", "--nice=5 --requeue --tmp=100",
                  "--gpus-per-n=1", "--cpus-per-t 1", "-c1", "--mem-per-c=100", "--ti=5",
                  "--dependency=afterok:1", "--mail=END", "--exc", "--clus=x", "--bogus=1",
                  "-X", "--hold=yes", "--tasks-per-node=1", "--ntasks-per-n=1", "-Hv", "-koff"]


@pytest.mark.parametrize("extra", SAME_AS_SBATCH)
def test_slurm_extra_is_parsed_as_the_real_sbatch_parses_it(extra):
    """What ddpflow's parser reads in slurm.extra is what this machine's sbatch takes: the
    same options (prefixes, short forms, bundles, values), or a refusal where sbatch refuses
    to parse it (ambiguous, unknown, a value where none goes)."""
    from ddpflow.config.sbatchopts import options

    ours = options(extra)
    proc = _sbatch(*extra.split())
    if isinstance(ours, str):
        assert any(w in proc.stderr for w in ("ambiguous", "unrecognized option",
                                              "invalid option", "doesn't allow")), \
            (ours, proc.stderr[-600:])
        return
    assert "defined options" in proc.stderr, proc.stderr[-600:]
    assert {ALIAS.get(name, name) for _, name in ours} | OWN == _taken(proc.stderr), \
        proc.stderr[-800:]


def test_the_option_table_is_this_sbatchs():
    """Every long option ddpflow knows is one this sbatch takes, with a value where ddpflow
    expects one and none where it expects none; its shortest unique prefix is taken, one
    letter less (where that is another option's prefix too) is ambiguous to sbatch too."""
    from ddpflow.config import sbatchopts

    names = sorted(sbatchopts.LONG)
    for name, arg in sbatchopts.LONG.items():
        err = _sbatch(f"--{name}" if arg != sbatchopts.REQUIRED else f"--{name}").stderr
        assert "unrecognized option" not in err, name
        if arg == sbatchopts.REQUIRED:
            assert "requires an argument" in err, (name, err[-300:])
        if arg == sbatchopts.NONE:
            assert "doesn't allow an argument" in _sbatch(f"--{name}=x").stderr, name
        shortest = next(name[:k] for k in range(1, len(name) + 1)
                        if [n for n in names if n.startswith(name[:k])] == [name]
                        or name[:k] == name)
        if shortest != name and len(shortest) > 1:
            fewer = shortest[:-1]
            if fewer not in names and sum(n.startswith(fewer) for n in names) > 1:
                assert "ambiguous" in _sbatch(f"--{fewer}").stderr, fewer
    for letter, name in sbatchopts.SHORT.items():
        err = _sbatch(f"-{letter}" + ("x" if sbatchopts.LONG[name] else "")).stderr
        assert "invalid option" not in err, letter
