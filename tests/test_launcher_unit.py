"""The launcher's side of a stage and of `ddpflow tune`, edge by edge: what `tune`
refuses before any rank starts, what it hands the ranks and the exit code and message it
makes of what they leave (launch/tuning.py); the ranks, threads and GPUs of a stage, the
checks before any rank (prepared data, batch size, init_from, model.weights, freeze,
trackers, sampling, blocks), a launch's folder, lock, dry run, container hand-over, outcome
and wall time (launch/launcher.py); the deadline and report of a hung collective
(launch/hangreport.py); torchrun's process group, stop signals and left-over ranks
(launch/procs.py); `ddpflow --log` (core/teelog.py).
Fast: real prepared data, files, locks and small subprocesses in tmp_path. Where a real
torchrun would train or tune for a minute, a function standing in for run_torchrun leaves
what the ranks leave; where a GPU count matters, launcher.visible_gpus answers as torch
would on such a machine; a clock stands in for hangreport's (its deadline is minutes away).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import tiny_config
from ddpflow.config import from_dict
from ddpflow.core.errors import UserError
from ddpflow.data.prepare import prepare
from ddpflow.launch import hangreport, launcher, procs, rankerror, tuning

CHOICE = {"batch_size": 8, "loader": "device", "num_workers": 0, "prefetch_factor": None,
          "precision": "fp32", "channels_last": False, "compile": False}


@pytest.fixture(scope="module")
def prepared_dir(tmp_path_factory):
    """One small synthetic dataset, prepared once (data.prepared_dir) for every test."""
    tmp = tmp_path_factory.mktemp("prepared")
    cfg = from_dict(tiny_config(tmp, data={"prepared_dir": str(tmp / "data"),
                                           "train_size": 64, "val_size": 16,
                                           "test_size": 16}))
    prepare(cfg)
    return cfg.data_dir


def _cfg(tmp_path, prepared_dir, **top):
    data = {"prepared_dir": str(prepared_dir), "train_size": 64, "val_size": 16,
            "test_size": 16, **top.pop("data", {})}
    stages = top.pop("stages", [{"name": "s1", "max_steps": 2, "batch_size": "auto"},
                                {"name": "s2", "max_steps": 2, "batch_size": "auto"}])
    return from_dict(tiny_config(tmp_path, data=data, stages=stages, **top))


class Ranks:
    """Stands in for run_torchrun: records what the launcher handed the ranks, checks what
    must hold while they run, and leaves what `leave` says (a real tuning's files)."""

    def __init__(self, cfg, rc=0, stop=None, leave=()):
        self.cfg, self.rc, self.stop, self.leave = cfg, rc, stop, leave
        self.calls = []

    def __call__(self, cmd, env, watch=None):
        out = self.cfg.run_dir / "tune"
        self.calls.append((cmd, env, watch))
        resolved = out / "config.json"
        assert json.loads(resolved.read_text()) == self.cfg.to_dict()
        assert not (out / "stopped.json").exists()  # an earlier tuning's never counts
        assert not (out / "nodes").exists()  # nor its roll call
        fd = os.open(out / ".lock", os.O_RDWR)
        try:  # the run's tune folder is held while its ranks run
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        assert watch.is_file() is False and env[rankerror.SPARE] == str(watch.paths[1])
        for what in self.leave:
            if what == "tune.json":
                (self.cfg.run_dir / "tune.json").write_text(json.dumps({"choice": CHOICE}))
            elif what == "stopped.json":
                (out / "stopped.json").write_text(json.dumps({"signal": "SIGINT"}))
            elif what == "error.json":
                (out / "error.json").write_text(json.dumps({"message": "rank 1: bad data"}))
            elif what == "spare":
                watch.paths[1].write_text(json.dumps({"message": "rank 0: no room"}))
        return self.rc, self.stop


def _tune(cfg, monkeypatch, capsys, ranks, stage=None, cap=None):
    monkeypatch.setattr(tuning, "run_torchrun", ranks)
    rc = tuning.tune(cfg, stage, cap)
    return rc, capsys.readouterr().err.splitlines()


@pytest.fixture(autouse=True)
def _no_slurm_job(monkeypatch):
    for k in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        monkeypatch.delenv(k, raising=False)


def test_a_tuning_hands_the_ranks_the_resolved_config_and_reports_the_choice(
        tmp_path, prepared_dir, monkeypatch, capsys):
    cfg = _cfg(tmp_path, prepared_dir)
    out = cfg.run_dir / "tune"
    (out / "nodes").mkdir(parents=True)
    (out / "stopped.json").write_text(json.dumps({"signal": "SIGTERM"}))  # a tuning before
    ranks = Ranks(cfg, leave=["tune.json"])
    rc, err = _tune(cfg, monkeypatch, capsys, ranks, cap="6")
    assert rc == 0
    cmd, env, _ = ranks.calls[0]
    assert cmd[-5:] == ["--resolved", str(out / "config.json"), "--stage", "s1",
                        "--memory-cap-mb=6"]
    assert "tune-rank" in cmd and env["PYTHONUNBUFFERED"] == "1"
    assert err[0] == "ddpflow: tuning for stage 's1': " + " ".join(cmd)
    assert err[1:] == [
        f"ddpflow: tuned -> {cfg.run_dir / 'tune.json'}: batch_size 8, loader device, "
        f"num_workers 0, prefetch_factor None, precision fp32, channels_last False, "
        f"compile False"]
    assert (out / ".lock").read_text() == ""  # released


def test_the_stage_tuned_is_the_one_asked_then_tune_stage_then_the_first(
        tmp_path, prepared_dir, monkeypatch, capsys):
    for asked, tune_stage, want in [(None, None, "s1"), (None, "s2", "s2"),
                                    ("s1", "s2", "s1")]:
        cfg = _cfg(tmp_path, prepared_dir, tune={"stage": tune_stage})
        ranks = Ranks(cfg, leave=["tune.json"])
        rc, err = _tune(cfg, monkeypatch, capsys, ranks, stage=asked)
        assert rc == 0
        cmd = ranks.calls[0][0]
        assert cmd[-2:] == ["--stage", want] and "--memory-cap-mb" not in " ".join(cmd)
        assert err[0].startswith(f"ddpflow: tuning for stage '{want}': ")
    with pytest.raises(UserError):
        tuning.tune(cfg, "nope", None)


def test_without_prepared_data_nothing_starts(tmp_path, monkeypatch, capsys):
    cfg = from_dict(tiny_config(tmp_path, stages=[{"name": "s1", "batch_size": "auto"}]))
    with pytest.raises(UserError) as e:
        _tune(cfg, monkeypatch, capsys, Ranks(cfg))
    assert str(e.value) == (f"no prepared data at {cfg.data_dir}; run `ddpflow prepare` "
                            f"first")
    assert not (cfg.run_dir / "tune").exists()


def test_an_unknown_stage_is_named_before_anything_else(tmp_path, monkeypatch, capsys):
    cfg = from_dict(tiny_config(tmp_path))  # (no prepared data either)
    with pytest.raises(UserError) as e:
        _tune(cfg, monkeypatch, capsys, Ranks(cfg), stage="nope")
    assert str(e.value) == "no stage named 'nope' in the config; stages are: s1"


def test_a_slurm_job_that_sees_other_gpus_than_it_asked_for_is_refused(tmp_path, prepared_dir,
                                                                      monkeypatch, capsys):
    cfg = _cfg(tmp_path, prepared_dir, slurm={"gpus": 2})
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(UserError) as e:
        _tune(cfg, monkeypatch, capsys, Ranks(cfg))
    assert str(e.value).startswith("this Slurm job sees 1 GPU(s) (CUDA_VISIBLE_DEVICES='0', "
                                   "job 77) but slurm.gpus asks for 2; ")


def test_a_tuning_of_the_run_already_going_on_is_refused(tmp_path, prepared_dir, monkeypatch,
                                                          capsys):
    cfg = _cfg(tmp_path, prepared_dir)
    out = cfg.run_dir / "tune"
    out.mkdir(parents=True)
    fd = os.open(out / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, b"pid 1 on host n1\n")
        ranks = Ranks(cfg)
        with pytest.raises(UserError) as e:
            _tune(cfg, monkeypatch, capsys, ranks)
        assert str(e.value) == (f"tuning of run 't' ({out}) is being written by another "
                                f"ddpflow process (pid 1 on host n1); wait for it to finish "
                                f"or stop it, then run again")
        assert not ranks.calls
    finally:
        os.close(fd)


def test_data_prepared_with_other_settings_is_refused(tmp_path, prepared_dir, monkeypatch,
                                                      capsys):
    cfg = _cfg(tmp_path, prepared_dir, data={"train_size": 32})
    with pytest.raises(UserError, match="was made with other data settings"):
        _tune(cfg, monkeypatch, capsys, Ranks(cfg))


REFUSED = ("ddpflow tune measures the prepared image data with the classification task; "
           "with data.source python (without data.materialize) or another task, set "
           "batch_size and precision in the stage instead of auto")


def test_another_task_is_refused_with_what_to_set_instead(tmp_path, prepared_dir,
                                                           monkeypatch, capsys):
    cfg = _cfg(tmp_path, prepared_dir, task={"name": "regression"})
    with pytest.raises(UserError) as e:
        _tune(cfg, monkeypatch, capsys, Ranks(cfg))
    assert str(e.value) == REFUSED
    assert not (cfg.run_dir / "tune").exists()


def test_a_python_dataset_not_materialized_is_refused(tmp_path, monkeypatch, capsys):
    code = tmp_path / "code"
    code.mkdir()
    (code / "tinyset.py").write_text(
        "import torch\n\n"
        "def make(split):\n"
        "    return [(torch.zeros(3, 8, 8), i % 2) for i in range(8)]\n")
    cfg = from_dict(tiny_config(tmp_path, data={"source": "python", "factory": "tinyset:make",
                                                "code_dir": str(code)},
                                stages=[{"name": "s1", "batch_size": "auto"}]))
    prepare(cfg)
    with pytest.raises(UserError) as e:
        _tune(cfg, monkeypatch, capsys, Ranks(cfg))
    assert str(e.value) == REFUSED


@pytest.mark.parametrize("sig,code", [("SIGINT", 130), ("SIGTERM", 143), ("SIGUSR1", 143)])
def test_a_stopped_tuning_keeps_the_earlier_result(tmp_path, prepared_dir, monkeypatch,
                                                    capsys, sig, code):
    cfg = _cfg(tmp_path, prepared_dir)
    result = cfg.run_dir / "tune.json"
    rc, err = _tune(cfg, monkeypatch, capsys, Ranks(cfg, rc=-15, stop=sig))
    assert rc == code and err[1:] == [
        f"ddpflow: tuning stopped by {sig}; no tune.json written: run `ddpflow tune` "
        f"again to measure"]
    result.write_text(json.dumps({"choice": CHOICE}))
    rc, err = _tune(cfg, monkeypatch, capsys, Ranks(cfg, rc=0, stop=sig))
    assert rc == code and err[1:] == [
        f"ddpflow: tuning stopped by {sig}; the earlier {result} is kept: run `ddpflow "
        f"tune` again to measure"]
    assert json.loads(result.read_text()) == {"choice": CHOICE}


def test_a_signal_to_a_rank_alone_stops_the_tuning_too(tmp_path, prepared_dir, monkeypatch,
                                                       capsys):
    """The ranks wrote stopped.json (a signal that never went through the launcher)."""
    cfg = _cfg(tmp_path, prepared_dir)
    rc, err = _tune(cfg, monkeypatch, capsys, Ranks(cfg, rc=0, leave=["stopped.json"]))
    assert rc == 130 and err[1].startswith("ddpflow: tuning stopped by SIGINT; ")
    (cfg.run_dir / "tune" / "stopped.json").write_text("{damaged")
    rc, err = _tune(cfg, monkeypatch, capsys, Ranks(cfg, rc=0, leave=["tune.json"]))
    assert rc == 0  # an earlier damaged one is removed before the ranks start


def test_a_failed_tuning_says_torchruns_exit_code(tmp_path, prepared_dir, monkeypatch,
                                                  capsys):
    cfg = _cfg(tmp_path, prepared_dir)
    rc, err = _tune(cfg, monkeypatch, capsys, Ranks(cfg, rc=3))
    assert rc == 3 and err[1:] == ["ddpflow: error: tuning failed (torchrun exited with 3)"]
    # a tune.json of an earlier run is no result of this one
    (cfg.run_dir / "tune.json").write_text(json.dumps({"choice": CHOICE}))
    rc, err = _tune(cfg, monkeypatch, capsys, Ranks(cfg, rc=2))
    assert rc == 2 and err[1:] == ["ddpflow: error: tuning failed (torchrun exited with 2)"]
    (cfg.run_dir / "tune.json").unlink()
    rc, err = _tune(cfg, monkeypatch, capsys, Ranks(cfg, rc=0))  # ended, wrote nothing
    assert rc == 1 and err[1:] == ["ddpflow: error: tuning failed (torchrun exited with 0)"]


@pytest.mark.parametrize("where,message", [("error.json", "rank 1: bad data"),
                                           ("spare", "rank 0: no room")])
def test_a_ranks_mistake_is_the_one_message(tmp_path, prepared_dir, monkeypatch, capsys,
                                            where, message):
    cfg = _cfg(tmp_path, prepared_dir)
    with pytest.raises(UserError) as e:
        _tune(cfg, monkeypatch, capsys, Ranks(cfg, rc=1, leave=[where, "tune.json"]))
    assert str(e.value) == message


def test_a_damaged_result_is_one_message(tmp_path, prepared_dir, monkeypatch, capsys):
    cfg = _cfg(tmp_path, prepared_dir)
    ranks = Ranks(cfg)
    ranks.leave = ()
    (cfg.run_dir).mkdir(parents=True)
    (cfg.run_dir / "tune.json").write_text(json.dumps({"choice": {"batch_size": 0}}))
    with pytest.raises(UserError) as e:
        _tune(cfg, monkeypatch, capsys, ranks)
    assert "ddpflow tune's result" in str(e.value) and "run `ddpflow tune` again" in str(e.value)


# ------------------------------------------------------- the launcher: ranks, threads, GPUs

@pytest.fixture
def two_cores():
    """This process narrowed to two of its cores (a slot does the same), put back after."""
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("needs two usable cores")
    os.sched_setaffinity(0, sorted(before)[:2])
    yield
    os.sched_setaffinity(0, before)


BASE_ENV = {"PYTHONUNBUFFERED": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _threads(n):
    return {"OMP_NUM_THREADS": str(n), "DDPFLOW_THREADS": str(n)}


def _hw(tmp_path, stages=None, top=None, **hardware):
    extra = {"stages": stages} if stages else {}
    return from_dict(tiny_config(tmp_path, hardware=hardware, **extra, **(top or {})))


def test_ranks_share_the_usable_cores_unless_threads_are_set(tmp_path, two_cores):
    auto = {"threads_per_rank": "auto", "device": "cpu"}
    assert launcher.resolve_ranks(_hw(tmp_path, nproc_per_node=1, **auto)) == (
        1, "cpu", {**_threads(2), **BASE_ENV})
    assert launcher.resolve_ranks(_hw(tmp_path, nproc_per_node=2, **auto)) == (
        2, "cpu", {**_threads(1), **BASE_ENV})
    assert launcher.resolve_ranks(_hw(tmp_path, nproc_per_node=3, **auto)) == (
        3, "cpu", {**_threads(1), **BASE_ENV})  # never 0 threads
    assert launcher.resolve_ranks(_hw(tmp_path, nproc_per_node=2, threads_per_rank=3,
                                      device="cpu")) == (2, "cpu", {**_threads(3), **BASE_ENV})
    det = _hw(tmp_path, nproc_per_node=2, top={"deterministic": True})
    assert launcher.resolve_ranks(det)[2] == {**_threads(1), **BASE_ENV,
                                              "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def test_dataparallel_runs_one_process_with_the_cores_of_all_ranks(tmp_path, two_cores):
    stages = [{"name": "dp", "strategy": "dp"}, {"name": "ddp"}]
    cfg = _hw(tmp_path, stages, nproc_per_node=2, threads_per_rank="auto", device="cpu")
    assert launcher.stage_ranks(cfg, "dp") == (1, "cpu", {**_threads(2), **BASE_ENV})
    assert launcher.stage_ranks(cfg, "ddp") == (2, "cpu", {**_threads(1), **BASE_ENV})


def test_the_visible_gpus_are_torchs_count():
    import torch

    assert launcher.visible_gpus() == torch.cuda.device_count()


def test_without_a_gpu_auto_is_one_cpu_rank_and_cuda_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(launcher, "visible_gpus", lambda: 0)
    assert launcher.resolve_ranks(_hw(tmp_path, nproc_per_node="auto"))[:2] == (1, "cpu")
    assert launcher.resolve_ranks(_hw(tmp_path, nproc_per_node=3))[:2] == (3, "cpu")
    with pytest.raises(UserError) as e:
        launcher.resolve_ranks(_hw(tmp_path, device="cuda"))
    assert str(e.value) == ("hardware.device is 'cuda' but no GPU is visible; use "
                            "hardware.device: auto or cpu, or check CUDA_VISIBLE_DEVICES and "
                            "the driver")
    with pytest.raises(UserError) as e:
        launcher.resolve_ranks(_hw(tmp_path, devices=[0]))
    assert str(e.value) == ("hardware.devices lists GPU 0, but this machine has 0 visible "
                            "GPU(s) (none); fix hardware.devices or leave it null to use all")


def test_the_gpus_named_in_hardware_devices_map_through_cuda_visible_devices(tmp_path,
                                                                          monkeypatch):
    """(two GPUs, as torch would count them: this machine may have none)"""
    monkeypatch.setattr(launcher, "visible_gpus", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert launcher.resolve_ranks(_hw(tmp_path, nproc_per_node="auto"))[:2] == (2, "cuda")
    assert launcher.resolve_ranks(_hw(tmp_path, device="cpu", nproc_per_node="auto"))[:2] == (
        1, "cpu")
    n, device, env = launcher.resolve_ranks(_hw(tmp_path, nproc_per_node="auto", devices=[1]))
    assert (n, device, env["CUDA_VISIBLE_DEVICES"]) == (1, "cuda", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    n, device, env = launcher.resolve_ranks(_hw(tmp_path, nproc_per_node="auto",
                                                devices=[1, 0]))
    assert (n, device, env["CUDA_VISIBLE_DEVICES"]) == (2, "cuda", "6,4")
    assert launcher.resolve_ranks(_hw(tmp_path, nproc_per_node=2))[:2] == (2, "cuda")
    assert "CUDA_VISIBLE_DEVICES" not in launcher.resolve_ranks(_hw(tmp_path))[2]
    with pytest.raises(UserError) as e:
        launcher.resolve_ranks(_hw(tmp_path, devices=[0, 2, 3]))
    assert str(e.value) == ("hardware.devices lists GPU 2, 3, but this machine has 2 visible "
                            "GPU(s) (ids 0..1); fix hardware.devices or leave it null to use all")
    with pytest.raises(UserError) as e:
        launcher.resolve_ranks(_hw(tmp_path, nproc_per_node=3))
    assert str(e.value) == ("hardware.nproc_per_node is 3 but only 2 GPU(s) are visible; one "
                            "rank per GPU, so use at most 2 (or auto)")
    with pytest.raises(UserError, match="nproc_per_node is 2 but only 1 GPU"):
        launcher.resolve_ranks(_hw(tmp_path, nproc_per_node=2, devices=[1]))


# ------------------------------------------------- the launcher: preflight, before any rank

def _stage_cfg(tmp_path, prepared_dir, stages=None, **top):
    stages = stages or [{"name": "s1", "max_steps": 2, "batch_size": 8}]
    return _cfg(tmp_path, prepared_dir, stages=stages, **top)


def _refusal(fn, *args):
    with pytest.raises(UserError) as e:
        fn(*args)
    return str(e.value)


def _weights(tmp_path, cfg, file="w.pt", **model):
    """A state dict of cfg's model (or of the model `model` names) in a file."""
    import torch

    from ddpflow.seams.models import build_model

    mc = from_dict({**cfg.to_dict(), "model": {**cfg.to_dict()["model"], **model}}).model
    path = tmp_path / file
    torch.save(build_model(mc, 10, 3).state_dict(), path)
    return path


def test_an_auto_batch_size_needs_a_tuning_measured_for_these_settings(tmp_path,
                                                                        prepared_dir):
    from ddpflow.engine.settings import tune_settings

    cfg = _stage_cfg(tmp_path, prepared_dir, [{"name": "s1", "batch_size": "auto"}])
    assert _refusal(launcher.preflight, cfg, "s1") == (
        f"stages.0.batch_size is auto but {cfg.run_dir / 'tune.json'} does not exist: run "
        f"`ddpflow tune --config ...` (or set tune.enabled: true in the workflow), or give a "
        f"number")
    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / "tune.json").write_text(json.dumps({"choice": CHOICE, "settings": {}}))
    assert _refusal(launcher.preflight, cfg, "s1").startswith(
        f"stages.0.batch_size is auto but {cfg.run_dir / 'tune.json'} was measured for other "
        f"settings (")
    settings = tune_settings(cfg, cfg.stage("s1"))
    (cfg.run_dir / "tune.json").write_text(json.dumps({"choice": CHOICE,
                                                       "settings": settings}))
    launcher.preflight(cfg, "s1")


def test_preflight_refuses_missing_or_changed_prepared_data(tmp_path):
    cfg = from_dict(tiny_config(tmp_path, data={"train_size": 64, "val_size": 16,
                                                "test_size": 16}))
    assert _refusal(launcher.preflight, cfg, "s1") == (
        f"no prepared data at {cfg.data_dir}; run `ddpflow prepare --config ...` first (or "
        f"the workflow's data rule)")
    meta, _ = prepare(cfg)
    launcher.preflight(cfg, "s1")
    name = sorted(meta["bytes"])[0]
    st = (cfg.data_dir / name).stat()
    os.utime(cfg.data_dir / name, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert _refusal(launcher.preflight, cfg, "s1") == (
        f"the prepared data at {cfg.data_dir} changed after it was prepared ({name}); run "
        f"`ddpflow prepare --config ...`: it checks the files and prepares them again if they "
        f"differ")
    bad = from_dict(tiny_config(tmp_path, data={"train_size": 32, "val_size": 16,
                                                "test_size": 16}))
    assert "was made with other data settings" in _refusal(launcher.preflight, bad, "s1")


def test_a_step_needs_no_more_samples_than_the_training_split(tmp_path, prepared_dir):
    def cfg(batch, accum=1):
        return _stage_cfg(tmp_path, prepared_dir, [{"name": "s1", "batch_size": batch,
                                                    "grad_accum_steps": accum}])
    launcher.preflight(cfg(64), "s1")  # one rank: the whole split
    assert _refusal(launcher.preflight, cfg(65), "s1") == (
        "stages.0.batch_size 65 x 1 rank(s) x 1 accumulation = 65 samples per step, but the "
        "training split has 64; lower the batch size")
    launcher.preflight(cfg(16, 2), "s1", 2)
    assert _refusal(launcher.preflight, cfg(17, 2), "s1", 2) == (
        "stages.0.batch_size 17 x 2 rank(s) x 2 accumulation = 68 samples per step, but the "
        "training split has 64; lower the batch size")
    assert "= 66 samples" in _refusal(launcher.preflight, cfg(33, 1), "s1", 2)


def _finish(cfg, stage, **summary):
    """A stage finished with these inputs: its summary, record and final.pt."""
    from ddpflow.core.checksum import sha256_of
    from ddpflow.results.provenance import expected_record
    from ddpflow.results.summary import write_summary

    out = cfg.stage_dir(stage)
    out.mkdir(parents=True, exist_ok=True)
    _weights(out, cfg, "final.pt")
    write_summary(out / "summary.json", {
        "finished": True, "steps": 12, "wall_time_s": 3.5, "world_size": 1, "monitor": "val_acc",
        "final_metrics": {"val_acc": 0.9}, "best_value": 0.95,
        "record": expected_record(cfg, stage), "final_sha256": sha256_of(out / "final.pt"),
        **summary})
    return out


def test_a_stage_starting_from_the_previous_one_needs_its_fresh_result(tmp_path,
                                                                       prepared_dir):
    stages = [{"name": "s1", "batch_size": 8}, {"name": "s2", "batch_size": 8,
                                                "init_from": "previous"}]
    cfg = _stage_cfg(tmp_path, prepared_dir, stages)
    assert _refusal(launcher.preflight, cfg, "s2") == (
        "stage 's2' starts from stage 's1', which has not finished; run 's1' first")
    out = cfg.stage_dir("s1")
    out.mkdir(parents=True)
    (out / "summary.json").write_text("{damaged")
    text = _refusal(launcher.preflight, cfg, "s2")
    assert text.startswith("stage 's2' starts from stage 's1', which has not finished; run "
                           "'s1' first (") and str(out / "summary.json") in text
    _finish(cfg, "s1")
    launcher.preflight(cfg, "s2")
    _weights(out, cfg, "final.pt", kwargs={"width": 8})  # replaced after it finished
    assert _refusal(launcher.preflight, cfg, "s2") == (
        "stage 's2' starts from stage 's1', whose result is stale: final.pt was replaced "
        "after the stage finished; run 's1' again first (the workflow does)")


def test_an_init_from_file_must_fit_the_model(tmp_path, prepared_dir):
    fits = _weights(tmp_path, _stage_cfg(tmp_path, prepared_dir))
    cfg = _stage_cfg(tmp_path, prepared_dir, [{"name": "s1", "batch_size": 8,
                                               "init_from": str(fits)}])
    launcher.preflight(cfg, "s1")
    other = _weights(tmp_path, cfg, "other.pt", kwargs={"width": 8})
    cfg = _stage_cfg(tmp_path, prepared_dir, [{"name": "s1", "batch_size": 8,
                                               "init_from": str(other)}])
    assert _refusal(launcher.preflight, cfg, "s1").startswith(f"stages.0.init_from {other}")
    cfg = _stage_cfg(tmp_path, prepared_dir, [{"name": "s1", "batch_size": 8,
                                               "init_from": str(tmp_path / "none.pt")}])
    assert _refusal(launcher.preflight, cfg, "s1").startswith("stages.0.init_from")


def test_pretrained_weights_are_checked_against_the_model_shapes_only(tmp_path,
                                                                     prepared_dir):
    import torch

    cfg = _stage_cfg(tmp_path, prepared_dir)
    fits = _weights(tmp_path, cfg)
    good = _stage_cfg(tmp_path, prepared_dir, model={"weights": str(fits)})
    launcher.preflight(good, "s1")
    assert torch.load(fits)  # (read, never written)
    other = _weights(tmp_path, cfg, "other.pt", kwargs={"width": 8})
    bad = _stage_cfg(tmp_path, prepared_dir, model={"weights": str(other)})
    text = _refusal(launcher.preflight, bad, "s1")
    assert text.startswith(f"model.weights {other} ") and "model.name" in text
    # a stage that starts from init_from does not load model.weights
    skip = _stage_cfg(tmp_path, prepared_dir, [{"name": "s1", "batch_size": 8,
                                                "init_from": str(fits)}],
                      model={"weights": str(other)})
    launcher.preflight(skip, "s1")


def test_freeze_prefixes_must_name_parameters_the_stages_own_first(tmp_path, prepared_dir):
    cfg = _stage_cfg(tmp_path, prepared_dir, model={"freeze": ["nope"]})
    text = _refusal(launcher.preflight, cfg, "s1")
    assert text.startswith("model.freeze: no parameter name starts with 'nope'"), text
    stages = [{"name": "s1", "batch_size": 8, "freeze": ["typo"]}]
    text = _refusal(launcher.preflight, _stage_cfg(tmp_path, prepared_dir, stages), "s1")
    assert text.startswith("stages.0.freeze: no parameter name starts with 'typo'"), text
    stages = [{"name": "s1", "batch_size": 8, "freeze": []}]  # the stage's own: none
    launcher.preflight(_stage_cfg(tmp_path, prepared_dir, stages,
                                  model={"freeze": ["nope"]}), "s1")


# ----------------------------------- the launcher: a divergence, the outcome, the wall time

def test_a_stage_that_diverged_with_these_inputs_is_not_run_again(tmp_path, prepared_dir):
    from ddpflow.results.provenance import expected_record

    cfg = _stage_cfg(tmp_path, prepared_dir)
    launcher.refuse_repeated_divergence(cfg, "s1")  # nothing there
    out = cfg.stage_dir("s1")
    out.mkdir(parents=True)
    failed = out / "failed.json"
    failed.write_text(json.dumps({"reason": "loss became nan at step 3",
                                  "record": expected_record(cfg, "s1")}))
    with pytest.raises(launcher.DivergedBefore) as e:
        launcher.refuse_repeated_divergence(cfg, "s1")
    assert e.value.exit_code == 3 and str(e.value) == (
        f"stage 's1' diverged with these settings before: loss became nan at step 3; change "
        f"the settings (or delete {failed} to try them again)")
    other = _stage_cfg(tmp_path, prepared_dir, [{"name": "s1", "batch_size": 8,
                                                 "lr": 0.001}])
    launcher.refuse_repeated_divergence(other, "s1")  # other settings: tried
    failed.write_text(json.dumps({"record": expected_record(cfg, "s1")}))  # no reason
    launcher.refuse_repeated_divergence(cfg, "s1")
    failed.write_text("{damaged")
    launcher.refuse_repeated_divergence(cfg, "s1")


def _outcome(cfg, capsys, rc, stop=None, quiet=False, rank_error=None):
    code = launcher._outcome(cfg, "s1", rc, stop, quiet, rank_error)
    return code, capsys.readouterr().err.splitlines()


def test_a_finished_stage_says_its_result(tmp_path, prepared_dir, capsys):
    cfg = _stage_cfg(tmp_path, prepared_dir)
    out = _finish(cfg, "s1")
    assert _outcome(cfg, capsys, 0) == (0, [
        f"ddpflow: stage 's1' finished: val_acc 0.9000 (best 0.9500), 12 steps, 3.5 s -> "
        f"{out / 'summary.json'}"])
    assert _outcome(cfg, capsys, 0, quiet=True) == (0, [])  # (the container's launcher said it)
    with pytest.raises(UserError) as e:
        _outcome(cfg, capsys, 1, rank_error="rank 1: a mistake")
    assert str(e.value) == "rank 1: a mistake"


def test_a_stage_stopped_before_its_end_exits_75(tmp_path, prepared_dir, capsys):
    cfg = _stage_cfg(tmp_path, prepared_dir)
    out = cfg.stage_dir("s1")
    first = ("ddpflow: stage 's1' was stopped (SIGTERM) before its first checkpoint: nothing "
             "to resume; run the same command again to start it")
    assert _outcome(cfg, capsys, 0, "SIGTERM") == (75, [first])
    assert _outcome(cfg, capsys, 75) == (75, [first.replace("SIGTERM", "signal")])
    assert _outcome(cfg, capsys, 0) == (75, [first.replace("SIGTERM", "signal")])
    assert _outcome(cfg, capsys, -15, "SIGINT") == (75, [first.replace("SIGTERM", "SIGINT")])
    assert _outcome(cfg, capsys, 75, quiet=True) == (75, [])
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "ckpt-000000008.pt").write_bytes(b"x")
    assert _outcome(cfg, capsys, 75) == (75, [
        f"ddpflow: stage 's1' stopped at a checkpoint before its end (preempted); run the "
        f"same command again to resume from {out / 'checkpoints'}"])
    _finish(cfg, "s1")  # a summary of a run that was then stopped (rc 75) is not the end
    assert _outcome(cfg, capsys, 75)[0] == 75


def test_a_diverged_stage_keeps_its_last_good_checkpoint_and_exits_3(tmp_path, prepared_dir,
                                                                     capsys):
    from ddpflow.results.provenance import expected_record

    cfg = _stage_cfg(tmp_path, prepared_dir)
    out = cfg.stage_dir("s1")
    out.mkdir(parents=True)
    (out / "failed.json").write_text(json.dumps({"reason": "loss became inf at step 5",
                                                 "record": expected_record(cfg, "s1")}))
    assert _outcome(cfg, capsys, 1) == (3, [
        f"ddpflow: error: stage 's1' stopped: loss became inf at step 5; the last good "
        f"checkpoint is kept in {out / 'checkpoints'}"])
    assert _outcome(cfg, capsys, 1, quiet=True) == (3, [])
    (out / "failed.json").write_text(json.dumps({"reason": "an earlier run's", "record": {}}))
    assert _outcome(cfg, capsys, 1)[0] == 1


def test_a_failed_stage_says_why_and_what_is_kept(tmp_path, prepared_dir, capsys):
    cfg = _stage_cfg(tmp_path, prepared_dir, hardware={"max_restarts": 2})
    out = cfg.stage_dir("s1")
    assert _outcome(cfg, capsys, 1) == (1, [
        "ddpflow: error: stage 's1' failed: torchrun exited with 1 after up to 2 restart(s); "
        "no checkpoint was written yet"])
    assert _outcome(cfg, capsys, -9) == (1, [
        "ddpflow: error: stage 's1' failed: torchrun exited with -9 after up to 2 "
        "restart(s); no checkpoint was written yet"])
    assert _outcome(cfg, capsys, 4, quiet=True) == (4, [])
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "ckpt-000000008.pt").write_bytes(b"x")
    assert _outcome(cfg, capsys, 2)[1] == [
        f"ddpflow: error: stage 's1' failed: torchrun exited with 2 after up to 2 restart(s); "
        f"completed checkpoints are kept in {out / 'checkpoints'} and a rerun resumes from "
        f"the newest valid one"]
    # a collective that broke: the hang report is the reason
    (out / "ranks" / "0").mkdir(parents=True)
    (out / "ranks" / "0" / "hang-0.json").write_text(json.dumps({
        "rank": 0, "world": 1, "host": "n1", "error": "Timed out", "missing": [],
        "ended": [], "detected_at": 1.0}))
    code, err = _outcome(cfg, capsys, 1)
    assert code == 1 and err[-1].startswith(
        "ddpflow: error: stage 's1' failed: a collective did not complete: ")
    assert err[0].startswith("ddpflow: the Python stack of every rank")
    assert _outcome(cfg, capsys, 1, quiet=True) == (1, [])


def _wall(rank_end):
    return {"split_s": {"startup": 1.0, "train": 2.0}, "rank_teardown_s": 0.5,
            "rank_end": rank_end, "samples": 700}


def test_the_wall_time_adds_the_launchers_teardown_to_this_launchs_summary(tmp_path,
                                                                          prepared_dir):
    import time

    cfg = _stage_cfg(tmp_path, prepared_dir)
    future = time.time() + 10**6  # (no time of its own after the ranks' end)
    out = _finish(cfg, "s1", wall=_wall(future))
    launcher.complete_wall(cfg, "s1", future)
    s = json.loads((out / "summary.json").read_text())
    assert s["wall"] == {**_wall(future), "split_s": {"startup": 1.0, "train": 2.0,
                                                      "teardown": 0.5},
                         "total_s": 3.5, "samples_per_s": 200.0}
    assert s["wall_time_s"] == 3.5 and s["wall_samples_per_s"] == 200.0
    assert s["steps"] == 12 and s["final_metrics"] == {"val_acc": 0.9}  # the rest kept


@pytest.mark.parametrize("why", ["earlier launch", "no wall", "stale", "none"])
def test_the_wall_time_of_another_launchs_summary_is_left_alone(tmp_path, prepared_dir, why):
    import time

    cfg = _stage_cfg(tmp_path, prepared_dir)
    t0 = time.time() + 10**6
    out = _finish(cfg, "s1", wall=None if why == "no wall" else _wall(t0 - 1))
    if why == "stale":
        (out / "summary.json").write_text(json.dumps({
            **json.loads((out / "summary.json").read_text()), "wall": _wall(t0), "record": {}}))
    if why == "none":
        (out / "summary.json").unlink()
    before = (out / "summary.json").read_text() if why != "none" else None
    launcher.complete_wall(cfg, "s1", t0)
    assert (out / "summary.json").read_text() == before if before else \
        not (out / "summary.json").exists()


# ------------------------------------------------------------- the launcher: one launch

class Agent:
    """A warmed-up torchrun agent as launch sees it: cancelled at the end whatever happened."""

    def __init__(self):
        self.cancelled = 0

    def cancel(self):
        self.cancelled += 1


class StageRanks:
    """Stands in for run_torchrun in a launch: checks what the ranks are handed and what
    holds while they run, and finishes the stage (or not) as real ranks would."""

    def __init__(self, cfg, rc=0, finish=True, stop=None):
        self.cfg, self.rc, self.finish, self.stop = cfg, rc, finish, stop
        self.calls = []

    def __call__(self, cmd, env, watch=None, agent=None, hang=None):
        out = self.cfg.stage_dir("s1")
        self.calls.append((cmd, env, agent))
        assert json.loads((out / "config.json").read_text()) == self.cfg.to_dict()
        assert json.loads((out / "command.json").read_text()) == {
            "argv": cmd, "env": {k: v for k, v in env.items()
                                 if k not in (rankerror.SPARE, "DDPFLOW_LAUNCH_T0")}}
        assert not (out / "hang.json").exists() and not (out / "ranks").exists()
        assert not (out / "nodes").exists()
        assert env[rankerror.SPARE] == str(watch.paths[1])
        assert hang.out == out and hang.deadline is None
        if os.environ.get("DDPFLOW_IN_CONTAINER"):
            assert not (out / ".lock").exists()
        else:
            fd = os.open(out / ".lock", os.O_RDWR)
            try:
                with pytest.raises(BlockingIOError):
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            finally:
                os.close(fd)
        if self.finish:
            import time

            _finish(self.cfg, "s1", wall=_wall(time.time() + 10**6))
        return self.rc, self.stop


def _launch(cfg, monkeypatch, capsys, ranks, **kw):
    monkeypatch.setattr(launcher, "run_torchrun", ranks)
    rc = launcher.launch(cfg, "s1", **kw)
    return rc, capsys.readouterr().err.splitlines()


@pytest.fixture
def outside(monkeypatch):
    monkeypatch.delenv("DDPFLOW_IN_CONTAINER", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(launcher, "visible_gpus", lambda: 0)


def test_a_launch_hands_the_ranks_their_folder_and_says_how_it_ended(
        tmp_path, prepared_dir, monkeypatch, capsys, outside):
    cfg = _stage_cfg(tmp_path, prepared_dir, hardware={"device": "cpu"})
    out = cfg.stage_dir("s1")
    (out / "ranks" / "0").mkdir(parents=True)  # the last launch's
    (out / "nodes").mkdir()
    (out / "hang.json").write_text("{}")
    agent, ranks = Agent(), StageRanks(cfg)
    rc, err = _launch(cfg, monkeypatch, capsys, ranks, extra_args=["--halt-after-steps", "2"],
                      t0=1234.5, agent=agent)
    cmd, env, given = ranks.calls[0]
    assert rc == 0 and agent.cancelled == 1 and given is agent
    assert env["DDPFLOW_LAUNCH_T0"] == "1234.500000" and env["OMP_NUM_THREADS"] == "1"
    assert cmd[-6:] == ["--resolved", str(out / "config.json"), "--stage", "s1",
                        "--halt-after-steps", "2"]
    assert err == ["ddpflow: stage 's1': 2 rank(s) on cpu", "ddpflow: " + " ".join(cmd),
                   f"ddpflow: stage 's1' finished: val_acc 0.9000 (best 0.9500), 12 steps, "
                   f"3.5 s -> {out / 'summary.json'}"]
    s = json.loads((out / "summary.json").read_text())
    assert s["wall"]["split_s"]["teardown"] == 0.5 and s["wall_time_s"] == 3.5  # completed
    assert (out / ".lock").read_text() == ""


def test_a_finished_stage_is_not_run_again_and_a_diverged_one_is_refused(
        tmp_path, prepared_dir, monkeypatch, capsys, outside):
    from ddpflow.results.provenance import expected_record

    cfg = _stage_cfg(tmp_path, prepared_dir, hardware={"device": "cpu"})
    out = _finish(cfg, "s1")
    ranks, agent = StageRanks(cfg), Agent()
    rc, err = _launch(cfg, monkeypatch, capsys, ranks, agent=agent)
    assert rc == 0 and not ranks.calls and agent.cancelled == 1
    assert err[2:] == [f"ddpflow: stage 's1' already finished with these settings, code and "
                       f"data (nothing to do): {out / 'summary.json'}"]
    (out / "summary.json").unlink()
    (out / "failed.json").write_text(json.dumps({"reason": "nan",
                                                 "record": expected_record(cfg, "s1")}))
    with pytest.raises(launcher.DivergedBefore):
        _launch(cfg, monkeypatch, capsys, ranks, agent=agent)
    assert not ranks.calls and agent.cancelled == 2


def test_a_stage_that_fails_preflight_writes_nothing(tmp_path, prepared_dir, monkeypatch,
                                                     capsys, outside):
    cfg = _stage_cfg(tmp_path, prepared_dir, [{"name": "s1", "batch_size": 40}],
                     hardware={"device": "cpu", "nproc_per_node": 2})
    agent = Agent()
    with pytest.raises(UserError, match="= 80 samples per step"):
        _launch(cfg, monkeypatch, capsys, StageRanks(cfg), agent=agent)
    assert not cfg.stage_dir("s1").exists() and agent.cancelled == 1
    launcher.launch(cfg, "s1", dry_run=True)  # no agent: nothing to cancel


def test_a_dry_run_says_what_it_would_run_and_runs_nothing(tmp_path, prepared_dir,
                                                           monkeypatch, capsys, outside):
    cfg = _stage_cfg(tmp_path, prepared_dir, hardware={"device": "cpu", "nproc_per_node": 3})
    ranks = StageRanks(cfg)
    rc, err = _launch(cfg, monkeypatch, capsys, ranks, dry_run=True)
    assert rc == 0 and not ranks.calls and not cfg.stage_dir("s1").exists()
    assert err[0] == "ddpflow: stage 's1': 3 rank(s) on cpu"
    assert err[1].startswith("ddpflow: ") and "--nproc-per-node=3" in err[1]
    assert "CUDA_VISIBLE_DEVICES" not in err[1] and len(err) == 2
    monkeypatch.setattr(launcher, "visible_gpus", lambda: 2)  # (as torch would count them)
    gpu = _stage_cfg(tmp_path, prepared_dir, hardware={"devices": [1], "nproc_per_node": "auto"})
    rc, err = _launch(gpu, monkeypatch, capsys, ranks, dry_run=True)
    assert err[0] == "ddpflow: stage 's1': 1 rank(s) on cuda"
    assert err[1].startswith("ddpflow: CUDA_VISIBLE_DEVICES=1 ") and err[1].endswith(
        " --stage s1")


def test_in_the_container_the_stage_runs_here_without_a_second_lock(
        tmp_path, prepared_dir, monkeypatch, capsys, outside):
    cfg = _stage_cfg(tmp_path, prepared_dir, hardware={"device": "cpu"},
                     container={"engine": "docker", "image": "ddpflow:x"})
    rc, err = _launch(cfg, monkeypatch, capsys, StageRanks(cfg), dry_run=True)
    assert (rc, err) == (0, ["ddpflow: stage 's1' runs in the docker image ddpflow:x"])
    monkeypatch.setenv("DDPFLOW_IN_CONTAINER", "docker:sha256:abc")
    ranks = StageRanks(cfg)
    rc, err = _launch(cfg, monkeypatch, capsys, ranks)
    assert rc == 0 and len(ranks.calls) == 1 and err[0] == "ddpflow: stage 's1': 2 rank(s) on cpu"
    assert not (cfg.stage_dir("s1") / ".lock").exists()


def test_a_launch_stopped_or_failed_exits_with_the_launchers_code(
        tmp_path, prepared_dir, monkeypatch, capsys, outside):
    cfg = _stage_cfg(tmp_path, prepared_dir, hardware={"device": "cpu"})
    rc, err = _launch(cfg, monkeypatch, capsys, StageRanks(cfg, rc=0, finish=False,
                                                           stop="SIGUSR1"))
    assert rc == 75 and "was stopped (SIGUSR1) before its first checkpoint" in err[-1]
    rc, err = _launch(cfg, monkeypatch, capsys, StageRanks(cfg, rc=6, finish=False))
    assert rc == 6 and "failed: torchrun exited with 6" in err[-1]


# --------------------------------------------- a hung collective: the launcher's deadline

class Clock:
    """hangreport's clock, moved by the test (the deadline is minutes away for real)."""

    def __init__(self):
        import time

        self.now, self.time = 1000.0, time.time

    def monotonic(self):
        return self.now


def _beat(folder, rank, host, pid):
    (folder / f"rank-{rank}.json").write_text(json.dumps({
        "rank": rank, "host": host, "pid": pid, "step": 3, "step_at": 1.0, "beat_at": 2.0}))


def _view(folder, rank, world):
    (folder / f"hang-{rank}.json").write_text(json.dumps({
        "rank": rank, "world": world, "host": "h", "error": "Timed out", "missing": None,
        "ended": [], "detected_at": 1.0}))


def test_past_the_deadline_the_hung_attempts_ranks_on_this_node_are_killed(tmp_path,
                                                                          monkeypatch):
    import socket

    clock = Clock()
    monkeypatch.setattr(hangreport, "time", clock)
    here = socket.gethostname()
    watch, killed = hangreport.HangWatch(tmp_path), []
    assert (watch.out, watch.folder, watch.deadline, watch.done) == (tmp_path, None, None,
                                                                     False)
    watch.poll(killed.append)  # no ranks folder yet
    earlier, folder = tmp_path / "ranks" / "9", tmp_path / "ranks" / "10"
    earlier.mkdir(parents=True)
    folder.mkdir()
    _view(earlier, 0, 1)  # an earlier attempt's report is not this one's
    (tmp_path / "ranks" / "11").write_text("")  # (a file, not an attempt)
    watch.poll(killed.append)
    assert watch.deadline is None
    for rank, host, pid in [(0, here, 11), (1, "elsewhere", 12), (2, here, 13)]:
        _beat(folder, rank, host, pid)
    _view(folder, 1, 3)
    _view(folder, 0, 2)  # the largest world counts
    watch.poll(killed.append)
    assert watch.folder == folder and watch.deadline == 1000.0 + hangreport.KILL_AFTER_S
    assert killed == [] and not watch.done
    clock.now = watch.deadline - 0.01
    watch.poll(killed.append)
    assert killed == [] and not watch.done
    clock.now = watch.deadline
    watch.poll(killed.append)
    assert sorted(killed) == [11, 13] and watch.done
    clock.now += 100
    watch.poll(killed.append)  # once
    assert sorted(killed) == [11, 13]


def test_the_last_attempt_is_the_highest_restart_count(tmp_path):
    assert hangreport.last_attempt(tmp_path) is None
    for name in ("2", "10", "9", "x"):
        (tmp_path / "ranks" / name).mkdir(parents=True)
    (tmp_path / "ranks" / "11").write_text("")
    assert hangreport.last_attempt(tmp_path) == tmp_path / "ranks" / "10"


# ------------------------------------------------------ torchrun's processes (launch/procs.py)

def _state(pid: int) -> str:
    """A process's state letter in /proc (T: stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]


def test_torchrun_is_stopped_while_its_ranks_are_listed_then_killed(monkeypatch):
    """No restart while the ranks are listed: torchrun's group gets SIGSTOP first (the
    listing here waits for it to take effect: it is asynchronous), then SIGKILL."""
    import time

    torchrun = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                preexec_fn=procs._child_setup)
    listed, seen = procs._children, []

    def listing(pid):
        for _ in range(200):  # (at once normally; 10 s when it never stops)
            if _state(pid) == "T":
                break
            time.sleep(0.05)
        seen.append(_state(pid))
        return listed(pid)

    monkeypatch.setattr(procs, "_children", listing)
    try:
        procs._stop_all(torchrun)
        assert seen == ["T"] and torchrun.wait(timeout=60) == -signal.SIGKILL
    finally:
        if torchrun.poll() is None:
            torchrun.kill()
            torchrun.wait()


# ------------------------------------------------------ `ddpflow --log` (core/teelog.py)

def test_a_crash_names_its_last_exception_on_the_console(tmp_path, capfd):
    from ddpflow.core import teelog

    log = tmp_path / "x.log"

    def crash(code, rc):
        def command():
            subprocess.run([sys.executable, "-c", code])
            return rc
        return command

    assert teelog.run_logged(log, crash("raise ValueError('bad shape')", 1)) == 1
    assert capfd.readouterr().err.splitlines() == [
        f"ddpflow: the last exception in {log}: ValueError: bad shape"]
    assert "Traceback" in log.read_text()
    assert teelog.run_logged(log, crash("raise ValueError('bad shape')", 0)) == 0
    assert capfd.readouterr().err == ""  # it ended well after all: no cause to name
    assert teelog.run_logged(log, crash("print('no exception')", 2)) == 2
    assert capfd.readouterr().err == ""
    long = "x" * 500
    assert teelog.run_logged(log, crash(f"raise KeyError('{long}')", 1)) == 1
    line = capfd.readouterr().err.rstrip("\n")
    assert line == f"ddpflow: the last exception in {log}: KeyError: '{long}'"[:len(
        f"ddpflow: the last exception in {log}: ") + 400]


def test_the_log_is_written_as_the_output_comes_and_no_descriptor_is_left(tmp_path, capfd):
    import time

    from ddpflow.core.teelog import tee_log

    log = tmp_path / "x.log"
    before = sorted(os.listdir("/proc/self/fd"))
    with tee_log(log):
        os.write(1, b"first line\n")
        for _ in range(200):  # (at once normally: the pump thread copies it)
            if log.read_bytes():
                break
            time.sleep(0.05)
        assert log.read_bytes() == b"first line\n"  # someone tailing it sees it now
    assert log.read_bytes() == b"first line\n" and capfd.readouterr().err == ""
    assert sorted(os.listdir("/proc/self/fd")) == before


def test_torchrun_ignores_ctrl_c_even_where_the_launcher_does_not():
    """(a launcher started in the background inherits SIGINT ignored: here it is not)"""
    def setup():
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        procs._child_setup()

    code = "import signal; print(signal.getsignal(signal.SIGINT).name)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         preexec_fn=setup, timeout=60).stdout
    assert out == "SIG_IGN\n"


# run_torchrun in a launcher process of its own (it takes the stop signals), with
# `mode`: how the test sets it up
RUN = """
import json, os, signal, subprocess, sys, time
from ddpflow.launch import procs
cmd, mode = json.loads(sys.argv[1]), sys.argv[2]
polls, agent = [], None
class Hang:
    def poll(self, kill):
        polls.append(1)
class Early:  # a stop signal while torchrun starts (its agent ended already: pid gone)
    @property
    def pipe(self):
        os.kill(os.getpid(), signal.SIGTERM)
        return 1
    def start(self, cmd, env):
        p = subprocess.Popen(["true"])
        p.wait()
        return p
if mode == "agent_gone":
    agent = Early()
if mode == "bystander":  # another run's process, a child of this launcher
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)",
                              "--resolved", "/elsewhere/config.json"])
if mode == "rank_gone":  # a rank listed that ended before its signal
    procs._children = lambda pid: [2**22 + 1]
if mode == "srun_gone":  # srun ended (reaped) as the signal came
    real_kill = os.kill
    def kill(pid, sig):
        if sig == signal.SIGUSR1:
            raise ProcessLookupError(3, "No such process")
        return real_kill(pid, sig)
    os.kill = kill
if mode in ("rank_gone", "srun_gone"):
    signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
    signal.setitimer(signal.ITIMER_REAL, 0.3)
rc, sig = procs.run_torchrun(cmd, {}, hang=Hang(), agent=agent)
out = [rc, sig, bool(polls)]
if mode == "bystander":
    out.append(other.poll())
    other.kill()
print(json.dumps(out), flush=True)
"""


def _run(tmp_path, cmd, mode=""):
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    (bin_ / "srun").write_text("#!/bin/sh\nsleep ${1:-3}\n")  # (the steps of several nodes)
    (bin_ / "srun").chmod(0o755)
    proc = subprocess.run([sys.executable, "-c", RUN, json.dumps(cmd), mode],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}"})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_the_hang_deadline_is_watched_on_this_node_only(tmp_path):
    assert _run(tmp_path, ["sleep", "1.2"]) == [0, None, True]
    assert _run(tmp_path, ["srun", "1.2"]) == [0, None, False]  # each rank leaves itself


def test_only_this_runs_left_over_ranks_are_stopped(tmp_path):
    cmd = ["sh", "-c", "sleep 0.1", "--resolved", str(tmp_path / "c.json")]
    rc, sig, _, other = _run(tmp_path, cmd, "bystander")
    assert (rc, sig, other) == (0, None, None)  # another run's process lives on


@pytest.mark.parametrize("mode,cmd,want", [
    ("rank_gone", ["sleep", "3"], [0, "SIGTERM"]),
    ("srun_gone", ["srun"], [0, "SIGTERM"]),
    ("agent_gone", [*procs.TORCHRUN, "x"], [0, "SIGTERM"])])
def test_a_process_gone_before_its_signal_is_passed_over(tmp_path, mode, cmd, want):
    assert _run(tmp_path, cmd, mode)[:2] == want


def test_after_a_ranks_mistake_the_others_have_seconds_to_report_too(tmp_path):
    """The ranks are stopped 3 s after the first report: a torchrun ending 1 s after it
    ends by itself."""
    report = tmp_path / "error.json"
    code = ("import pathlib, sys, time; pathlib.Path(sys.argv[1]).write_text('{}'); "
            "time.sleep(1.0)")
    script = (f"import json, sys; from pathlib import Path; from ddpflow.launch import procs; "
              f"print(json.dumps(procs.run_torchrun({[sys.executable, '-c', code, str(report)]!r}"
              f", {{}}, watch=Path({str(report)!r}))))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert json.loads(out.stdout) == [0, None], out.stderr


def test_a_log_that_stops_taking_output_is_said_once_with_its_name(tmp_path):
    from ddpflow.core import teelog

    path = tmp_path / "x.log"
    path.write_bytes(b"")
    r, w = os.pipe()
    tee = teelog.Tee()
    with open(path, "rb") as log:  # a file that takes no writes: no errno a user can fix
        teelog._to_log(log, b"first\n", tee, w)
        teelog._to_log(log, b"second\n", tee, w)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        said = f.read().decode()
    assert tee.log_failed == f"cannot write the log {path}: write"
    assert said == (f"ddpflow: warning: cannot write the log {path}: write; the command goes "
                    f"on, its output from here on is not in the log\n")


def test_a_log_in_no_folder_is_one_message_naming_it(tmp_path):
    from ddpflow.core.teelog import tee_log

    (tmp_path / "a-file").write_text("")
    log = tmp_path / "a-file" / "x.log"
    with pytest.raises(UserError) as e:
        with tee_log(log):
            pass
    assert str(e.value) == (f"cannot write the log {log}: File exists; give --log a file in "
                            f"a folder you can write")


# a process that tees its output (`mode` says what it writes when), its own stdout and stderr
# captured apart
TEE = """
import os, subprocess, sys
from ddpflow.core import teelog
log, mode = sys.argv[1], sys.argv[2]
teelog.DRAIN_S = 0.2
print("out before", end="")
sys.stderr.write("err before")
with teelog.tee_log(log):
    print("out inside", end="")
    sys.stderr.write("err inside")
    if mode == "leftover":  # a child that outlives the block, holding the pipe
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        print(child.pid, file=open(log + ".pid", "w"))
    if mode == "unended":  # the last line, not ended and not ddpflow's: the log's only
        os.write(2, b"plain, no newline")
print("out after", flush=True)
sys.stderr.write("err after\\n")
"""


def _tee(tmp_path, mode=""):
    log = tmp_path / "t.log"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered, as
    proc = subprocess.run([sys.executable, "-c", TEE, str(log), mode], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL, env=env)  # usual
    return proc, log


def test_what_the_process_wrote_before_and_after_the_block_stays_on_its_console(tmp_path):
    proc, log = _tee(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "out beforeout after\n"
    assert proc.stderr == "err beforeerr after\n"
    assert log.read_text() == "out insideerr inside"


def test_an_unended_last_line_of_the_command_stays_in_the_log(tmp_path):
    proc, log = _tee(tmp_path, "unended")
    assert proc.stderr == "err beforeerr after\n", proc.stderr
    assert "plain, no newline" in log.read_text()


def test_a_child_left_running_does_not_keep_the_process_from_ending(tmp_path):
    proc, log = _tee(tmp_path, "leftover")
    pid = int((tmp_path / "t.log.pid").read_text())
    try:
        assert proc.returncode == 0 and _state(pid) != "Z"  # ended before it
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_at_the_deadline_without_a_readable_report_nothing_is_killed(tmp_path, monkeypatch):
    import socket

    clock = Clock()
    monkeypatch.setattr(hangreport, "time", clock)
    folder = tmp_path / "ranks" / "0"
    folder.mkdir(parents=True)
    _beat(folder, 0, socket.gethostname(), 11)
    _view(folder, 1, 2)
    watch, killed = hangreport.HangWatch(tmp_path), []
    watch.poll(killed.append)
    (folder / "hang-1.json").write_text("{damaged")  # (its world unknown: no rank named)
    clock.now = watch.deadline
    watch.poll(killed.append)
    assert killed == [] and watch.done


def test_the_hang_report_says_each_missing_ranks_state_and_every_stack(tmp_path):
    folder = tmp_path / "ranks" / "0"
    folder.mkdir(parents=True)
    for rank, answered in [(0, False), (1, True), (2, False)]:
        (folder / f"rank-{rank}.json").write_text(json.dumps({
            "rank": rank, "host": f"n{rank}", "pid": 10 + rank, "step": 5, "step_at": 1.0,
            "beat_at": 2.0, "answered": answered}))
    (folder / "stack-0.txt").write_text("== stack of rank 0\n")
    (folder / "stack-1.txt").mkdir()  # unreadable
    for rank, world, missing, ended in [(0, 2, [1], []), (3, 4, [2, 3], [2])]:
        (folder / f"hang-{rank}.json").write_text(json.dumps({
            "rank": rank, "world": world, "host": "n0", "error": "Timed out",
            "missing": missing, "ended": ended, "detected_at": float(rank)}))
    said = []
    line = hangreport.report(tmp_path, 30, lambda *a, **k: said.append(a[0]))
    assert line.startswith(
        "a collective did not complete: rank 1 (host n1: alive, stuck where its stack shows), "
        "rank 2 (host n2: its process had ended) did not arrive (found by torch's "
        "monitored_barrier and the heartbeats: its process had ended); last step completed: "
        "rank 0 at step 5, rank 1 at step 5, rank 2 at step 5, rank 3 unknown (no readable "
        "heartbeat); ")
    assert said[1] == "== stack of rank 0"
    assert said[2].startswith("== rank 1: its stack file is unreadable: ") and \
        str(folder / "stack-1.txt") in said[2]
    assert len(said) == 5  # the console line and the 4 ranks'


def test_the_flight_recorders_reason_lists_the_heartbeats_of_up_to_64_more_ranks(tmp_path):
    ranks = tmp_path / "ranks"
    (ranks / "0").mkdir(parents=True)
    (ranks / "nccl_trace_rank_0").write_text("")
    for rank in (0, 64, 65):
        _beat(ranks / "0", rank, "n", 10 + rank)
    assert hangreport.report(tmp_path, 30) == (
        f"a NCCL collective did not complete and its watchdog ended the ranks; last step "
        f"completed: rank 0 at step 3, rank 64 at step 3; the flight recorder's dumps in "
        f"{ranks} name the rank that did not arrive: torchfrtrace {ranks} -p nccl_trace_rank_ "
        f"--allow-incomplete-ranks")


# ------------------------------------------- the launcher: the seams checked before any rank

def test_preflight_checks_the_trackers_the_sampling_and_the_blocks(tmp_path, prepared_dir,
                                                                   monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "a-file"))
    (tmp_path / "a-file").write_text("")
    cfg = _stage_cfg(tmp_path, prepared_dir, tracking={"wandb": {"project": "p"}})
    assert _refusal(launcher.preflight, cfg, "s1").startswith(
        "tracking.wandb: W&B cannot write its run files in WANDB_DIR ")
    stages = [{"name": "s1", "batch_size": 8, "activation_checkpointing": ["Nope"]}]
    assert _refusal(launcher.preflight, _stage_cfg(tmp_path, prepared_dir, stages), "s1") \
        .startswith("stages.0.activation_checkpointing: 'Nope' is not the class of any module")
    few = from_dict(tiny_config(tmp_path / "few", data={
        "train_size": 64, "val_size": 16, "test_size": 16, "sampling": "balanced",
        "num_classes": 100}, stages=[{"name": "s1", "batch_size": 8}]))
    prepare(few)
    assert _refusal(launcher.preflight, few, "s1").startswith(
        "data.sampling balanced: class 64 has no sample in the training split")


def test_a_model_from_model_code_dir_is_found_by_preflight(tmp_path, prepared_dir):
    code = tmp_path / "code"
    code.mkdir()
    (code / "wt5net.py").write_text(
        "from ddpflow.seams.models import SmallCNN\n\n"
        "def build(num_classes, in_channels):\n"
        "    return SmallCNN(num_classes, in_channels=in_channels)\n")
    cfg = _stage_cfg(tmp_path, prepared_dir, model={"name": "wt5net:build",
                                                    "code_dir": str(code)})
    launcher.preflight(cfg, "s1")


def test_a_task_that_does_not_build_is_refused_before_any_rank(tmp_path, prepared_dir):
    cfg = _stage_cfg(tmp_path, prepared_dir, task={"name": "nosuchmodule:Task"})
    assert "nosuchmodule" in _refusal(launcher.preflight, cfg, "s1")


def test_a_stage_in_the_image_is_checked_as_one_process_and_run_there(
        tmp_path, prepared_dir, monkeypatch, capsys, outside):
    """(the container engine stands in: container.run_stage's own tests need one)"""
    from ddpflow.launch import container

    ran = []
    monkeypatch.setattr(container, "run_stage", lambda *a: ran.append(a) or 0)

    def cfg(batch):
        return _stage_cfg(tmp_path, prepared_dir, [{"name": "s1", "batch_size": batch}],
                          hardware={"device": "cpu", "nproc_per_node": 2},
                          container={"engine": "docker", "image": "ddpflow:x"})
    assert "= 65 samples per step" in _refusal(launcher.launch, cfg(65), "s1")
    capsys.readouterr()
    c = cfg(64)  # one launcher process outside; its ranks are counted inside the image
    rc, err = _launch(c, monkeypatch, capsys, StageRanks(c), t0=5.0)
    out = c.stage_dir("s1")
    assert rc == 75 and ran == [(c, out / "config.json", "s1", [], 5.0)]
    assert err == ["ddpflow: stage 's1' runs in the docker image ddpflow:x"]  # (quiet: said inside)
    assert not (out / "command.json").exists()


def test_a_stage_being_run_by_another_launcher_is_refused(tmp_path, prepared_dir,
                                                           monkeypatch, capsys, outside):
    cfg = _stage_cfg(tmp_path, prepared_dir, hardware={"device": "cpu"})
    out = cfg.stage_dir("s1")
    out.mkdir(parents=True)
    fd = os.open(out / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, b"pid 1 on host n1\n")
        text = _refusal(launcher.launch, cfg, "s1")
        assert text == (f"stage 's1' ({out}) is being written by another ddpflow process (pid "
                        f"1 on host n1); wait for it to finish or stop it, then run again")
    finally:
        os.close(fd)


def test_a_slurm_job_that_sees_other_gpus_is_refused_before_the_stage(
        tmp_path, prepared_dir, monkeypatch, outside):
    cfg = _stage_cfg(tmp_path, prepared_dir, slurm={"gpus": 2})
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert _refusal(launcher.launch, cfg, "s1").startswith("this Slurm job sees 1 GPU(s)")


def test_a_dry_run_of_several_nodes_says_how_many(tmp_path, prepared_dir, monkeypatch, capsys,
                                                  outside):
    from ddpflow.launch import slurmnodes

    monkeypatch.setattr(slurmnodes, "slurm_hosts", lambda: ["node-a", "node-b"])
    cfg = _stage_cfg(tmp_path, prepared_dir, hardware={"device": "cpu", "nodes": 2})
    rc, err = _launch(cfg, monkeypatch, capsys, StageRanks(cfg), dry_run=True)
    assert rc == 0 and err[0] == "ddpflow: stage 's1': 2 node(s) x 2 rank(s) on cpu"
    assert err[1].startswith("ddpflow: srun ")


def test_a_task_from_data_code_dir_is_found_by_preflight(tmp_path, prepared_dir):
    """(model.code_dir is put on sys.path by building the model; data.code_dir only by
    preflight itself)"""
    code = tmp_path / "datacode"
    code.mkdir()
    (code / "wt5task.py").write_text(
        "from ddpflow.seams.tasks import Classification\n\n"
        "def make(label_smoothing=0.0):\n"
        "    return Classification(label_smoothing)\n")
    cfg = _stage_cfg(tmp_path, prepared_dir, data={"code_dir": str(code)},
                     task={"name": "wt5task:make"})
    launcher.preflight(cfg, "s1")
