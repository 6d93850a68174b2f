"""One job of the sweep's scheduler on its own (sweeps/trialrun.py): the commands a trial's
job runs in order (its data once per prepared folder, its image record, its tuning, its
earlier stages unless finished, the last stage halted at its rung), what stops it on the way
and the reason it gives, the resume key it records (the trainer's own), and its result read
from the trial's files (the runner there a scripted stand-in that writes the log a real
command would and returns its exit code); and the runners (sweeps/runner.py): a command on
this node as a child process with its log and exit code, under Slurm tested once per size
then submitted with `sbatch --wait` (sbatch and scancel stand-ins on PATH that log
their words and play Slurm's refusals, a QOS limit or a partition down, which the test
cluster cannot be made to give; the real cluster runs these paths in test_slurm.py),
Slurm's refusals as one message, and a stop that signals or cancels what runs and starts
nothing more; and the scheduler (sweeps/scheduler.py) over a runner that leaves a trainer's
files: what it says as trials start, pause, get promoted and finish, the state and done.json
it writes, pruned trials that fail the sweep and are tried again next run, a record reset
when a trial's settings change, a stop part-way, TPE's draws, and the metric it ranks by.
Fast: no training.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import tiny_config
from ddpflow.config import from_dict
from ddpflow.core.checksum import sha256_of
from ddpflow.core.errors import UserError
from ddpflow.engine import resume
from ddpflow.launch.launcher import EXIT_DIVERGED, EXIT_STOPPED
from ddpflow.results import provenance
from ddpflow.results.summary import write_summary
from ddpflow.sweeps import runner as runner_mod
from ddpflow.sweeps import trialrun

TWO = [{"name": "s1", "epochs": 1, "batch_size": 32, "lr": 0.05},
       {"name": "s2", "epochs": 3, "batch_size": 32, "lr": 0.01, "init_from": "previous"}]


class Scripted:
    """A runner (sweeps/runner.py's interface) whose commands end as scripted: for the first
    word of a command, its exit code and the lines it logs (default: 0, none), or a list of
    them, one per command in turn."""

    def __init__(self, **script):
        self.script = script
        self.calls: list[tuple] = []

    def run(self, cfg, words, log, gpus=True):
        words = [str(w) for w in words]
        self.calls.append((words, log, gpus))
        end = self.script.get(words[0], (0, ""))
        rc, text = end.pop(0) if isinstance(end, list) else end
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(text)
        return rc


def _trial(tmp_path: Path, stages=TWO, **top) -> tuple:
    """A trial's config where the sweep's plan leaves it: in the trial's own run folder."""
    cfg = tiny_config(tmp_path, stages=stages, **top)
    path = from_dict(cfg).run_dir / "trial_config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg))
    return from_dict(cfg), path


def _job(runner, tmp_path: Path, monitor: str = "val_acc", locks=None):
    return trialrun.TrialJob(runner, tmp_path / "sweep", tmp_path / "logs", monitor,
                             {} if locks is None else locks, threading.Lock())


def _finish(cfg, stage: str) -> None:
    folder = cfg.stage_dir(stage)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "final.pt").write_bytes(b"weights")
    write_summary(folder / "summary.json", {
        "finished": True, "steps": 4, "wall_time_s": 1.0, "world_size": 2,
        "record": provenance.expected_record(cfg, stage),
        "final_sha256": sha256_of(folder / "final.pt")})


def _validated(cfg, stage: str, *values, monitor: str = "val_acc") -> None:
    folder = cfg.stage_dir(stage)
    folder.mkdir(parents=True, exist_ok=True)
    lines = [{"kind": "val", "epoch": e, monitor: v} for e, v in enumerate(values)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


# ------------------------------------------------------------------ the trial's config and key

def test_a_trials_config_is_read_whole_or_refused_with_what_to_do(tmp_path):
    cfg, path = _trial(tmp_path)
    assert trialrun.trial_config(path, "lr-0.1") == cfg
    path.write_text('{"run": ')
    with pytest.raises(UserError) as e:
        trialrun.trial_config(path, "lr-0.1")
    assert str(e.value).startswith(f"{path} (trial lr-0.1's config) is not valid JSON")
    assert str(e.value).endswith("run `ddpflow sweep plan --config ...` again")


def test_the_resume_key_is_the_trainers_for_the_last_stage(tmp_path):
    cfg, _ = _trial(tmp_path)
    _finish(cfg, "s1")  # the last stage starts from its final.pt
    init = cfg.stage_dir("s1") / "final.pt"
    trainer = resume.stage_files(cfg, "s2", {"fingerprint": None}, init).resume_key
    assert trialrun.resume_key(cfg) == trainer
    fewer, _ = _trial(tmp_path, hardware={"nproc_per_node": 1})
    assert trialrun.resume_key(fewer) == trainer  # placement left out: a requeue resumes
    init.write_bytes(b"other weights")
    assert trialrun.resume_key(cfg) != trainer


# ------------------------------------------------------------------ the commands of a job

def test_a_job_runs_the_trials_commands_in_order_and_halts_at_its_rung(tmp_path):
    cfg, path = _trial(tmp_path)
    runner = Scripted(launch=[(0, ""), (EXIT_STOPPED, "")])
    locks: dict = {}
    _validated(cfg, "s2", 0.5)
    out = _job(runner, tmp_path, locks=locks).run("lr-0.1", path, 1)
    logs = tmp_path / "logs" / "lr-0.1"
    assert runner.calls == [
        (["prepare", "--config", str(path)], logs / "prepare.log", False),
        (["launch", "--config", str(path), "--stage", "s1"], logs / "train_s1.log", True),
        (["launch", "--config", str(path), "--stage", "s2", "--halt-after-epochs", "1"],
         logs / "train_s2.log", True)]
    assert out == trialrun.Outcome(key=trialrun.resume_key(cfg), values={1: 0.5}, epochs=1)
    assert list(locks) == [str(cfg.data_dir)]
    # at the last rung the stage runs to its end; a finished earlier stage is not started
    _finish(cfg, "s1")
    runner = Scripted()
    _job(runner, tmp_path).run("lr-0.1", path, 3)
    assert [c[0][-2:] for c in runner.calls] == [["--config", str(path)], ["--stage", "s2"]]


def test_the_data_is_prepared_once_per_folder_and_run(tmp_path):
    cfg, path = _trial(tmp_path)
    runner = Scripted()
    job = _job(runner, tmp_path)
    job.run("a", path, 1)
    job.run("b", path, 1)
    assert [c[0][0] for c in runner.calls].count("prepare") == 1
    assert job.prepared == {str(cfg.data_dir)}


def test_a_failed_preparation_or_tuning_ends_the_job_with_the_commands_error(tmp_path):
    cfg, path = _trial(tmp_path)
    said = "ddpflow: error: data.path /x does not exist; set data.path\n"
    runner = Scripted(prepare=(2, f"starting\n{said}\nTraceback at the end\n"))
    job = _job(runner, tmp_path)
    assert job.run("a", path, 1) == trialrun.Outcome(
        pruned=f"preparing its data: {said.strip()}", kind="failed")
    assert [c[0][0] for c in runner.calls] == ["prepare"] and job.prepared == set()
    cfg, path = _trial(tmp_path, tune={"enabled": True, "stage": "s1"})
    runner = Scripted(tune=(1, "out of memory at batch 32\n"))
    assert _job(runner, tmp_path).run("a", path, 1) == trialrun.Outcome(
        pruned="tuning: out of memory at batch 32", kind="failed")
    assert runner.calls[1] == (["tune", "--config", str(path)],
                               tmp_path / "logs" / "a" / "tune.log", True)
    (cfg.run_dir / "tune.json").parent.mkdir(parents=True, exist_ok=True)
    (cfg.run_dir / "tune.json").write_text("{}")  # tuned already: not again
    runner = Scripted(tune=(1, ""))
    _job(runner, tmp_path).run("a", path, 1)
    assert "tune" not in [c[0][0] for c in runner.calls]


def test_the_sweeps_image_record_is_copied_into_a_trial_without_one(tmp_path):
    cfg, path = _trial(tmp_path)
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "image.json").write_text('{"image": "sweep"}')
    _job(Scripted(), tmp_path).run("a", path, 1)
    assert (cfg.run_dir / "image.json").read_text() == '{"image": "sweep"}'
    (cfg.run_dir / "image.json").write_text('{"image": "own"}')
    _job(Scripted(), tmp_path).run("a", path, 1)
    assert (cfg.run_dir / "image.json").read_text() == '{"image": "own"}'


@pytest.mark.parametrize("rc, kind", [(EXIT_DIVERGED, "diverged"), (1, "failed"),
                                      (EXIT_DIVERGED + 1, "failed")])
def test_an_earlier_stage_that_fails_ends_the_job_with_its_error(tmp_path, rc, kind):
    _, path = _trial(tmp_path)
    runner = Scripted(launch=(rc, "ddpflow: error: stage 's1': boom\n"))
    assert _job(runner, tmp_path).run("a", path, 1) == trialrun.Outcome(
        pruned="stage s1: ddpflow: error: stage 's1': boom", kind=kind)
    assert len(runner.calls) == 2  # the last stage never started


# ------------------------------------------------------------------ the job's result

ONE = [{"name": "a", "epochs": 3, "batch_size": 32, "lr": 0.1}]


def test_the_result_is_every_validated_epoch_of_the_last_stage(tmp_path):
    cfg, _ = _trial(tmp_path, stages=ONE)
    folder = cfg.stage_dir("a")
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in [
        {"kind": "train", "epoch": 4, "val_acc": 0.1}, {"kind": "val", "epoch": 1.0,
                                                        "val_acc": 0.2},
        {"kind": "val", "epoch": 0, "val_acc": 0.5}, {"kind": "val", "epoch": 1, "val_acc": 1}]))
    out = _job(None, tmp_path).outcome(cfg, "k", 2, 0, tmp_path / "none.log")
    assert out == trialrun.Outcome(key="k", values={1: 0.5, 2: 1.0}, epochs=2)
    assert _job(None, tmp_path).outcome(cfg, "k", 1, EXIT_STOPPED, tmp_path / "x") == out


def test_a_result_without_epochs_or_with_nans(tmp_path):
    cfg, _ = _trial(tmp_path, stages=ONE)
    log = tmp_path / "train.log"
    log.write_text("ddpflow: error: it broke\n")
    assert _job(None, tmp_path).outcome(cfg, "k", 1, 128, log) == trialrun.Outcome(
        key="k", values={}, epochs=0, pruned="stage a: ddpflow: error: it broke",
        kind="failed")
    _validated(cfg, "a", 0.5, float("nan"), float("-inf"))
    out = _job(None, tmp_path).outcome(cfg, "k", 3, 0, log)
    assert (out.values, out.pruned, out.kind) == (
        {1: 0.5, 2: None, 3: None}, "val_acc is NaN at epoch 2", "nan")


def test_a_monitor_the_stage_does_not_log_is_named_with_what_it_logs(tmp_path):
    cfg, _ = _trial(tmp_path, stages=ONE)
    folder = cfg.stage_dir("a")
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text(
        '{"kind": "val", "epoch": 0, "loss": 1}\n'
        '{"kind": "val", "epoch": 1, "val_top5": 1, "val_loss": 1}\n')
    out = _job(None, tmp_path, "val_acc").outcome(cfg, "k", 1, 0, tmp_path / "x")
    assert out == trialrun.Outcome(
        pruned="task.monitor val_acc is not among its validation metrics (none); set "
               "task.monitor to one of them", kind="failed")


def test_a_diverged_stage_without_its_record_is_a_nan_loss(tmp_path):
    cfg, _ = _trial(tmp_path, stages=ONE)
    _validated(cfg, "a", 0.5)
    out = _job(None, tmp_path).outcome(cfg, "k", 1, EXIT_DIVERGED, tmp_path / "x")
    assert (out.pruned, out.kind, out.values) == ("diverged: a NaN/inf loss", "diverged",
                                                  {1: 0.5})


@pytest.mark.parametrize("rc, stopped", [(0, True), (EXIT_STOPPED, True), (129, True),
                                         (128, False), (-1, True), (1, False)])
def test_a_job_stopped_before_its_rung_is_resumed_a_failed_one_pruned(tmp_path, rc, stopped):
    cfg, _ = _trial(tmp_path, stages=ONE)
    _validated(cfg, "a", 0.5)
    out = _job(None, tmp_path).outcome(cfg, "k", 2, rc, tmp_path / "none.log")
    assert out.stopped is stopped and (out.pruned is None) is stopped
    assert out.kind == (None if stopped else "failed")


def test_the_last_rung_is_reached_only_with_the_stage_finished(tmp_path):
    cfg, _ = _trial(tmp_path, stages=ONE)
    _validated(cfg, "a", 0.5, 0.6, 0.7)
    assert _job(None, tmp_path).outcome(cfg, "k", 3, 0, tmp_path / "x").stopped is True
    _finish(cfg, "a")
    out = _job(None, tmp_path).outcome(cfg, "k", 3, 0, tmp_path / "x")
    assert out == trialrun.Outcome(key="k", values={1: 0.5, 2: 0.6, 3: 0.7}, epochs=3)
    # a rung short of the last epoch is reached without a summary, whatever the exit
    assert _job(None, tmp_path).outcome(cfg, "k", 2, 1, tmp_path / "x").pruned is None


@pytest.mark.parametrize("value, number", [(1, 1.0), (0.25, 0.25), (float("nan"), None),
                                           (float("inf"), None), ("0.5", None), (None, None)])
def test_a_logged_value_is_a_finite_number_or_none(value, number):
    assert trialrun._number(value) == number


# ------------------------------------------------------------------ runner.py: on this node

def test_a_command_on_this_node_is_ddpflow_with_its_log_and_its_exit_code(tmp_path):
    cfg, _ = _trial(tmp_path)
    log = tmp_path / "logs" / "a" / "validate.log"
    runner = runner_mod.runner_for("node")
    assert type(runner) is runner_mod.LocalRunner and runner.where == "this node"
    missing = tmp_path / "none.yaml"
    assert runner.run(cfg, ["validate", "--config", missing], log, gpus=False) == 2
    assert f"ddpflow: error: config file not found: {missing}" in log.read_text()
    assert runner.running == {} and runner.preflight(cfg, log) is None
    again = log.parent / "again.log"  # its folder there already
    assert runner.run(cfg, ["validate", "--config", missing], again) == 2
    assert again.read_text() == log.read_text()


def test_a_stopped_node_runner_signals_its_commands_and_starts_no_more(tmp_path):
    cfg, _ = _trial(tmp_path)
    runner = runner_mod.LocalRunner()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    runner.running = {child.pid: child, done.pid: done}
    runner.stop()
    assert child.wait(timeout=30) == -signal.SIGTERM and runner.stopping is True
    log = tmp_path / "later" / "x.log"
    assert runner.run(cfg, ["validate"], log) == 128 + signal.SIGTERM
    assert not log.exists() and log.parent.is_dir()


# ------------------------------------------------------------------ runner.py: under Slurm

SBATCH = """#!/bin/sh
echo "$*" >> "$CALLS"
case " $* " in *" --test-only "*)
    [ -n "$REFUSE" ] && { printf '%b' "$REFUSE" >&2; exit 1; }; exit 0;; esac
[ -n "$SUBMIT_ERROR" ] && { echo "$SUBMIT_ERROR" >&2; exit 1; }
echo "4242;cluster1"
[ -n "$RUNNING" ] && { touch "$RUNNING"; exec sleep 600; }
exit "${JOB_RC:-0}"
"""


@pytest.fixture
def slurm(tmp_path, monkeypatch):
    """sbatch and scancel on PATH as stand-ins that log each call's words (the calls file,
    one line per call) and give the refusals a real cluster gives; test_slurm.py submits
    to the real one."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(SBATCH)
    (bin_dir / "scancel").write_text('#!/bin/sh\necho "scancel $*" >> "$CALLS"\n'
                                     'echo "scancel: error: Job/step already completing" >&2\n')
    for name in ("sbatch", "scancel"):
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls"
    calls.write_text("")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("CALLS", str(calls))
    for name in ("REFUSE", "SUBMIT_ERROR", "RUNNING", "JOB_RC"):
        monkeypatch.delenv(name, raising=False)
    return calls


def _slurm_cfg(tmp_path):
    return from_dict(tiny_config(tmp_path, slurm={"gpus": 2, "cpus_per_gpu": 3,
                                                  "runtime_min": 30, "partition": "p1"}))


def test_a_command_under_slurm_is_tested_once_then_submitted_and_waited_for(
        tmp_path, slurm, monkeypatch):
    cfg = _slurm_cfg(tmp_path)
    runner = runner_mod.runner_for("slurm")
    assert type(runner) is runner_mod.SlurmRunner and runner.where == "Slurm"
    log = tmp_path / "logs" / "a" / "train_s1.log"
    monkeypatch.setenv("JOB_RC", "3")
    assert runner.run(cfg, ["launch", "--stage", "s1"], log) == 3
    assert log.parent.is_dir() and runner.jobs == {}
    opts = runner_mod.sbatch_options(cfg, log, True)
    asked = [o for o in opts if not o.startswith(("--job-name=", "--output="))]
    submit = runner_mod.sbatch_command(opts, log, ["launch", "--stage", "s1"])[1:]
    assert slurm.read_text().splitlines() == [
        " ".join(["--test-only", *opts, "--wrap", "true"]), " ".join(submit)]
    other = tmp_path / "logs" / "b" / "prepare.log"  # the same sizes: not tested again
    monkeypatch.setenv("JOB_RC", "0")
    assert runner.run(cfg, ["prepare"], other) == 0
    assert runner.tested == {tuple(asked)} and len(slurm.read_text().splitlines()) == 3
    runner.run(cfg, ["prepare"], other, gpus=False)  # a CPU job: other sizes, tested first
    assert slurm.read_text().splitlines()[3].startswith(
        f"--test-only --job-name=ddpflow-t --output={other}.slurm --time=30")
    assert "--cpus-per-task=1" in slurm.read_text().splitlines()[3]


def test_a_slurm_preflight_tests_both_kinds_of_job_before_any(tmp_path, slurm):
    cfg = _slurm_cfg(tmp_path)
    runner = runner_mod.SlurmRunner()
    log = tmp_path / "x.log"
    assert runner.preflight(cfg, log) is None
    lines = slurm.read_text().splitlines()
    assert lines == [" ".join(["--test-only", *runner_mod.sbatch_options(cfg, log, gpus),
                               "--wrap", "true"]) for gpus in (False, True)]


def test_slurm_refusing_a_job_says_why_and_what_it_asked_for(tmp_path, slurm, monkeypatch):
    cfg = _slurm_cfg(tmp_path)
    log = tmp_path / "x.log"
    monkeypatch.setenv("REFUSE", "sbatch: error: invalid partition\\n\\n  p1 is down  \\n")
    with pytest.raises(UserError) as e:
        runner_mod.SlurmRunner().run(cfg, ["prepare"], log)
    assert str(e.value) == (
        "Slurm refuses a job of the sweep: sbatch: error: invalid partition; p1 is down; it "
        "was not submitted. It asks for: --time=30 --signal=B:USR1@180 --gpus=2 "
        "--cpus-per-gpu=3 --partition=p1. Check the partition, the account and the sizes in "
        "the config's slurm: section (docs/slurm.md)")
    assert len(slurm.read_text().splitlines()) == 1  # nothing submitted
    monkeypatch.setenv("REFUSE", "\\n")  # no reason given: its exit code
    with pytest.raises(UserError, match="^Slurm refuses a job of the sweep: 1; it was not"):
        runner_mod.SlurmRunner().preflight(cfg, log)
    monkeypatch.delenv("REFUSE")
    monkeypatch.setenv("SUBMIT_ERROR", "sbatch: error: QOSMaxSubmitJobPerUserLimit")
    with pytest.raises(UserError) as e:
        runner_mod.SlurmRunner().run(cfg, ["prepare"], log)
    assert str(e.value) == ("sbatch refused a job of the sweep: sbatch: error: "
                            "QOSMaxSubmitJobPerUserLimit; check the slurm: section of the "
                            "config (docs/slurm.md)")


def test_without_sbatch_the_sweep_says_where_to_run_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(UserError) as e:
        runner_mod.SlurmRunner().preflight(_slurm_cfg(tmp_path), tmp_path / "x.log")
    assert str(e.value) == (
        "the sweep's scheduler runs its trials with sbatch under Slurm, but sbatch is not on "
        "PATH here; run the workflow where Slurm's commands are, or without the Slurm profile")


def test_a_stopped_slurm_runner_cancels_its_jobs_and_submits_no_more(tmp_path, slurm,
                                                                     monkeypatch, capfd):
    cfg = _slurm_cfg(tmp_path)
    running = tmp_path / "running"
    monkeypatch.setenv("RUNNING", str(running))
    runner = runner_mod.SlurmRunner()
    result = []
    waiting = threading.Thread(target=lambda: result.append(
        runner.run(cfg, ["launch"], tmp_path / "x.log")), daemon=True)
    waiting.start()
    for _ in range(600):  # until the job is submitted and running (a hang: a failure)
        if running.exists() and runner.jobs:
            break
        time.sleep(0.05)
    assert runner.jobs
    runner.stop()
    waiting.join(timeout=30)  # sbatch ended at once, not when its job would have
    assert result == [-signal.SIGTERM] and runner.jobs == {}  # stopped: no refusal either
    assert slurm.read_text().splitlines()[-1] == "scancel 4242"
    assert "scancel" not in capfd.readouterr().err  # scancel's words are not the sweep's
    monkeypatch.delenv("RUNNING")
    assert runner.run(cfg, ["launch"], tmp_path / "x.log") == 128 + signal.SIGTERM
    assert len(slurm.read_text().splitlines()) == 3  # tested, submitted, cancelled


# ------------------------------------------------------------------ scheduler.py

class Trainer(Scripted):
    """A runner whose `launch` of a trial's last stage leaves what the trainer would: a
    validated epoch per epoch in metrics.jsonl up to its rung, and at the stage's end a
    summary and final.pt; a trial's values by its lr (VALUES); `fail`: lrs whose launch
    fails with a logged error."""

    where = "the test"

    def __init__(self, fail=()):
        super().__init__()
        self.fail = fail
        self.preflights: list = []
        self.stops = 0

    def preflight(self, cfg, log):
        self.preflights.append((cfg.run, log))

    def stop(self):
        self.stops += 1

    def run(self, cfg, words, log, gpus=True):
        super().run(cfg, words, log, gpus)
        if words[0] != "launch":
            return 0
        trial = trialrun.trial_config(Path(words[2]), "t")
        stage = trial.stages[-1]
        if stage.lr in self.fail:
            log.write_text(f"ddpflow: error: lr {stage.lr} broke\n")
            return 1
        halt = int(words[-1]) if "--halt-after-epochs" in words else stage.epochs
        _validated(trial, stage.name, *VALUES.get(stage.lr, [0.5, 0.5, 0.5])[:halt])
        if halt == stage.epochs:
            _finish(trial, stage.name)
        return 0


VALUES = {0.1: [0.5, 0.6, 0.7], 0.2: [0.6, 0.8, 0.9], 0.3: [0.1, 0.2, 0.3]}
NINE = [{"name": "s1", "epochs": 3, "batch_size": 32, "lr": 0.1}]


def _sweep(tmp_path, lrs=(0.1, 0.2, 0.3), **sweep):
    grid = {} if "random" in sweep else {"grid": {"stages.0.lr": list(lrs)}}
    return from_dict(tiny_config(tmp_path, stages=NINE, hardware={"device": "cpu"}, sweep={
        **grid, "scheduler": "asha", "parallel": 1, "asha": {"min_epochs": 1, "eta": 3},
        **sweep}))


def _scheduler(cfg, runner):
    from ddpflow.sweeps import plan as planning
    from ddpflow.sweeps.scheduler import Scheduler

    s = Scheduler(cfg, planning.plan(cfg), cfg.run_dir / "logs" / "trials", "node")
    s.runner = s.job.runner = runner
    return s


def _said(capsys) -> list[str]:
    return [ln.removeprefix("ddpflow: sweep 't': ") for ln in capsys.readouterr().err.splitlines()]


def test_a_scheduled_sweep_promotes_the_best_and_marks_itself_done(tmp_path, capsys):
    from ddpflow.sweeps import schedstate

    cfg = _sweep(tmp_path)
    runner = Trainer()
    s = _scheduler(cfg, runner)
    ids = {t.overrides["stages.0.lr"]: t.id for t in s.trials}
    assert s.run() == 0
    assert _said(capsys) == [
        "3 trial(s), rungs at epoch(s) 1, 3 of stage s1, eta 3, 1 at a time on this node; "
        "ranked by val_acc (max)",
        f"{ids[0.2]}: start -> epoch 1", f"{ids[0.2]}: epoch 1: val_acc 0.6000 (paused)",
        f"{ids[0.1]}: start -> epoch 1", f"{ids[0.1]}: epoch 1: val_acc 0.5000 (paused)",
        f"{ids[0.3]}: start -> epoch 1", f"{ids[0.3]}: epoch 1: val_acc 0.1000 (paused)",
        f"{ids[0.2]}: promote -> epoch 3", f"{ids[0.2]}: epoch 3: val_acc 0.9000 (finished)",
        "1 finished, 2 paused; 5 of 9 trial-epochs of stage s1 (0.56 of running every trial "
        "to its end)"]
    first = trialrun.trial_config(s.paths[ids[0.2]], "x")
    assert runner.preflights == [(first.run, cfg.run_dir / "logs" / "trials" / "preflight")]
    assert json.loads((schedstate.folder(cfg) / "done.json").read_text()) == {
        "run": "t", "trials": 3, "paused": 2, "finished": 1}
    state = schedstate.read_state(cfg)
    got = {t.id: (t.values, t.epochs, t.target, t.key) for t in schedstate.trials_of(state)}
    assert got[ids[0.2]] == ({1: 0.6, 2: 0.8, 3: 0.9}, 3, 3, trialrun.resume_key(first))
    assert got[ids[0.3]][:3] == ({1: 0.1}, 1, 1)
    # run again: nothing left to do, the same tally
    runner = Trainer()
    s = _scheduler(cfg, runner)
    assert s.run() == 0 and [c for c in runner.calls if c[0][0] == "launch"] == []
    assert _said(capsys)[-1].startswith("1 finished, 2 paused; 5 of 9 trial-epochs")


def test_a_pruned_trial_fails_the_sweep_after_the_others_went_on(tmp_path, capsys):
    from ddpflow.sweeps import schedstate

    cfg = _sweep(tmp_path, lrs=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7), parallel=2)
    s = _scheduler(cfg, Trainer(fail=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6)))
    assert s.run() == 1
    said = _said(capsys)
    assert said[0].endswith("2 at a time on this node; ranked by val_acc (max)")
    ids = {t.overrides["stages.0.lr"]: t.id for t in s.trials}
    assert f"{ids[0.3]}: pruned: stage s1: ddpflow: error: lr 0.3 broke" in said
    shown = "; ".join([f"{t.id}: stage s1: ddpflow: error: lr {t.overrides['stages.0.lr']} "
                       f"broke" for t in s.trials if t.id != ids[0.7]][:5])
    assert said[-1] == (f"ddpflow: error: sweep 't': 6 trial(s) pruned ({shown}); the others "
                        f"went on; `ddpflow sweep collect` lists them all")
    assert said[-2] == ("1 finished, 6 pruned; 3 of 21 trial-epochs of stage s1 (0.14 of "
                        "running every trial to its end)")
    assert not (schedstate.folder(cfg) / "done.json").exists()
    # the next run tries the failed trials again (a failure may have been the machine's)
    s = _scheduler(cfg, Trainer())
    assert [(t.pruned, t.kind, t.tries) for t in s.trials if t.id != ids[0.7]] == \
        [(None, None, 0)] * 6
    assert s.run() == 0


def test_a_trial_whose_settings_changed_starts_again(tmp_path, capsys):
    from ddpflow.sweeps import schedstate

    cfg = _sweep(tmp_path, lrs=(0.1,))
    assert _scheduler(cfg, Trainer()).run() == 0
    s = _scheduler(cfg, Trainer())  # the same: its record kept
    assert [(t.values, t.epochs) for t in s.trials] == [({1: 0.5, 2: 0.6, 3: 0.7}, 3)]
    trial = s.trials[0]
    trial.key = "another key"  # made with other settings, code or data
    schedstate.write_state(cfg, [trial], "val_acc", "max", [1, 3])
    s = _scheduler(cfg, Trainer())
    assert [(t.values, t.epochs, t.key) for t in s.trials] == [({}, 0, None)]


def test_a_stopped_scheduler_stops_its_trials_and_records_what_they_reached(tmp_path,
                                                                           capsys):
    from ddpflow.sweeps import schedstate

    class Interrupted(Trainer):
        """Ctrl-C in one job while another trains: that one ends at its checkpoint once the
        scheduler stops it."""

        def __init__(self):
            super().__init__()
            self.stopped = threading.Event()

        def stop(self):
            super().stop()
            self.stopped.set()

        def run(self, cfg, words, log, gpus=True):
            if words[0] == "launch" and "lr-0.1" in str(words[2]):
                raise KeyboardInterrupt
            if words[0] == "launch":
                assert self.stopped.wait(60)
            return super().run(cfg, words, log, gpus)

    cfg = _sweep(tmp_path, lrs=(0.1, 0.2), parallel=2)
    runner = Interrupted()
    s = _scheduler(cfg, runner)
    ids = {t.overrides["stages.0.lr"]: t.id for t in s.trials}
    with pytest.raises(KeyboardInterrupt):
        s.run()
    assert runner.stops == 1 and s.stopping is True
    assert f"{ids[0.2]}: epoch 1: val_acc 0.6000 (paused)" in _said(capsys)
    got = {t.id: (t.values, t.epochs, t.target)
           for t in schedstate.trials_of(schedstate.read_state(cfg))}
    assert got == {ids[0.2]: ({1: 0.6}, 1, 1), ids[0.1]: ({}, 0, 1)}


def test_a_sweep_without_a_scheduler_is_refused_and_one_with_it_runs(tmp_path, monkeypatch):
    from ddpflow.sweeps import scheduler

    cfg = from_dict(tiny_config(tmp_path, stages=NINE, sweep={
        "grid": {"stages.0.lr": [0.1, 0.2]}}))
    with pytest.raises(UserError) as e:
        scheduler.schedule(cfg, None)
    assert str(e.value) == (
        "this sweep has no scheduler: set sweep.scheduler: asha or sweep.search: tpe (without "
        "them the workflow runs every trial as its own job: snakemake --configfile ...)")
    made = []

    def trainer(via):  # the runner the scheduler asks for: one that leaves a trainer's files
        made.append(via)
        return Trainer(fail=(0.3,))
    monkeypatch.setattr(scheduler, "runner_for", trainer)
    cfg = _sweep(tmp_path, lrs=(0.1, 0.3))
    assert scheduler.schedule(cfg, str(tmp_path / "my logs"), "slurm") == 1
    assert made == ["slurm"] and (cfg.run_dir / "sweep" / "plan.json").is_file()
    assert (tmp_path / "my logs").is_dir()
    assert scheduler.schedule(cfg, None) == 1  # the sweep's lock was let go
    assert (cfg.run_dir / "logs" / "trials" / "preflight").parent.is_dir()


@pytest.mark.parametrize("task, expected", [
    ({"name": "classification"}, ("val_acc", "max")),
    ({"name": "regression"}, ("val_loss", "min")),
    ({"monitor": "val_loss", "mode": "auto"}, ("val_loss", "min")),
    ({"monitor": "val_top5", "mode": "min"}, ("val_top5", "min"))])
def test_the_rungs_rank_by_the_tasks_monitor_and_mode(tmp_path, task, expected):
    from ddpflow.sweeps.scheduler import _monitor

    assert _monitor(from_dict(tiny_config(tmp_path, task=task))) == expected


def test_tpe_draws_new_points_until_its_samples_and_records_each(tmp_path, capsys):
    pytest.importorskip("optuna")
    from ddpflow.sweeps import schedstate

    space = {"stages.0.lr": {"choice": [0.1, 0.2]}}
    cfg = _sweep(tmp_path, lrs=(0.1,), search="tpe", scheduler="none",
                 random={"samples": 3, "space": space, "seed": 1})
    s = _scheduler(cfg, Trainer())
    assert s.trials == []
    assert s.run() == 0
    said = _said(capsys)
    assert said[-2] == "TPE drew only points it had drawn before after 2 trial(s); no more"
    drawn = schedstate.trials_of(schedstate.read_state(cfg))
    assert sorted(t.overrides["stages.0.lr"] for t in drawn) == [0.1, 0.2]
    assert [t.number for t in drawn] == [0, 1]
    for t in drawn:
        assert trialrun.trial_config(s.paths[t.id], t.id).stages[0].lr == \
            t.overrides["stages.0.lr"]
    # the next run knows the draws it recorded
    s = _scheduler(cfg, Trainer())
    assert [t.id for t in s.trials] == [t.id for t in drawn]
