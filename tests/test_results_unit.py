"""results/ on its own: what a stage's result was made from and whether it is still fresh
(results/provenance.py): each input of the record that changes makes the result stale with
its own reason, final.pt missing or replaced too; the weights a stage starts from; the git
revision of a project. Real files in tmp_path, no training."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from conftest import tiny_config
from ddpflow.config import from_dict
from ddpflow.core.checksum import sha256_of
from ddpflow.results import provenance
from ddpflow.results.summary import write_summary

TWO = [{"name": "s1", "epochs": 1, "batch_size": 32, "lr": 0.05},
       {"name": "s2", "epochs": 1, "batch_size": 32, "lr": 0.01, "init_from": "previous"}]


def _cfg(tmp_path: Path, **top):
    return from_dict(tiny_config(tmp_path, stages=TWO, **top))


def _finish(cfg, stage: str, record: dict | None = None, final: bytes = b"weights") -> Path:
    """A finished stage's files as the trainer leaves them: final.pt and a summary that
    records what it was made from and final.pt's SHA-256."""
    folder = cfg.stage_dir(stage)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "final.pt").write_bytes(final)
    rec = provenance.expected_record(cfg, stage) if record is None else record
    write_summary(folder / "summary.json", {
        "finished": True, "steps": 4, "wall_time_s": 1.0, "world_size": 2, "record": rec,
        "final_sha256": sha256_of(folder / "final.pt")})
    return folder


def test_the_weights_a_stage_starts_from(tmp_path):
    cfg = _cfg(tmp_path)
    assert provenance.init_source(cfg, "s1") is None  # no model.weights
    assert provenance.init_source(cfg, "s2") == cfg.stage_dir("s1") / "final.pt"
    weights = tmp_path / "w.pt"
    stages = [TWO[0], {**TWO[1], "init_from": str(weights)}]
    cfg = from_dict(tiny_config(tmp_path, stages=stages, model={"weights": str(weights)}))
    assert provenance.init_source(cfg, "s2") == weights
    assert provenance.init_source(cfg, "s1") == weights  # model.weights, a file


def test_a_fresh_result_is_fresh_and_the_next_stage_records_its_weights(tmp_path):
    cfg = _cfg(tmp_path)
    folder = _finish(cfg, "s1")
    s, reason = provenance.stage_result(cfg, "s1")
    assert reason is None and s["steps"] == 4
    rec = provenance.expected_record(cfg, "s2")
    assert rec["init_sha256"] == sha256_of(folder / "final.pt")
    assert rec["stage_hash"] == cfg.stage_hash("s2") and rec["user_code"] is None
    assert provenance.expected_record(cfg, "s1")["init_sha256"] is None


@pytest.mark.parametrize("key, why", [
    ("stage_hash", "stale: made with another config"),
    ("code", "stale: made by other ddpflow code"),
    ("user_code", "stale: made by other code of yours (model.code_dir)"),
    ("data", "stale: made from other prepared data"),
    ("init_sha256", "stale: started from other weights"),
])
def test_each_input_that_changed_makes_the_result_stale_with_its_reason(tmp_path, key, why):
    cfg = _cfg(tmp_path)
    rec = provenance.expected_record(cfg, "s1")
    _finish(cfg, "s1", {**rec, key: "something else"})
    assert provenance.stage_result(cfg, "s1")[1] == why
    assert provenance.stale_reason({**rec, key: "x"}, rec) == why


def test_a_result_without_a_record_or_summary(tmp_path):
    cfg = _cfg(tmp_path)
    assert provenance.stage_result(cfg, "s1") == (None, None)  # not run
    assert provenance.stale_reason(None, {}) == (
        "stale: no record of what it was made from (an older ddpflow)")
    folder = _finish(cfg, "s1")
    (folder / "summary.json").write_text('{"finished": true, "steps": "x"}')
    assert provenance.stage_result(cfg, "s1") == (None, None)  # damaged: run it again


def test_final_pt_missing_or_replaced_makes_the_result_stale(tmp_path):
    cfg = _cfg(tmp_path)
    folder = _finish(cfg, "s1")
    (folder / "final.pt").write_bytes(b"other weights")
    assert provenance.stage_result(cfg, "s1")[1] == (
        "stale: final.pt was replaced after the stage finished")
    (folder / "final.pt").unlink()
    assert provenance.stage_result(cfg, "s1")[1] == "stale: final.pt is missing"


def test_the_git_revision_of_a_project(tmp_path):
    assert provenance.git_revision(tmp_path) == "unknown"  # not a repository
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    assert provenance.git_revision(tmp_path) == "unknown"  # no commit yet
    subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t",
                    "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    assert provenance.git_revision(tmp_path) == head and len(head) == 40


# ------------------------------------------------------------------ metrics.jsonl

def test_a_resumed_metrics_log_keeps_the_records_up_to_its_checkpoint(tmp_path):
    from ddpflow.results.metrics import MetricsLog, read_records

    path = tmp_path / "stage" / "metrics.jsonl"
    log = MetricsLog(path, None)  # a new stage: its folder made, the file started empty
    assert log.write({"kind": "train", "step": 4}) == {"kind": "train", "step": 4}
    for step in (8, 12):
        log.write({"kind": "train", "step": step})
    log.close()
    log = MetricsLog(path, 8)  # resumed from the checkpoint at step 8
    log.write({"kind": "val", "step": 10})
    log.close()
    assert read_records(path) == ([{"kind": "train", "step": 4}, {"kind": "train", "step": 8},
                                   {"kind": "val", "step": 10}], [])
    MetricsLog(path, None).close()  # a fresh start: nothing of the old run is kept
    assert path.read_text() == ""


def test_a_metrics_record_is_also_sent_to_the_tracker(tmp_path):
    from ddpflow.results.metrics import MetricsLog

    class Tracker:  # the tracking seam: anything with record(dict)
        def __init__(self):
            self.seen = []

        def record(self, r):
            self.seen.append(r)

    t = Tracker()
    log = MetricsLog(tmp_path / "m.jsonl", None, tracker=t)
    log.write({"step": 1})
    log.close()
    assert t.seen == [{"step": 1}]


def test_a_metrics_log_that_cannot_be_written_is_one_ranks_error(tmp_path):
    from ddpflow.core.errors import OneRankError
    from ddpflow.results.metrics import MetricsLog

    log = MetricsLog(tmp_path / "m.jsonl", None)
    log.f.close()
    log.f = open("/dev/full", "a", buffering=1)  # a full disk, for real
    with pytest.raises(OneRankError) as e:
        log.write({"step": 1})
    assert str(e.value).startswith(f"cannot write the stage's metrics log at "
                                   f"{tmp_path / 'm.jsonl'}: no space left"), e.value


def test_a_bad_metrics_line_is_reported_by_number(tmp_path):
    from ddpflow.results.metrics import read_records

    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1}\n[1]\n{"step": 2\n')
    assert read_records(p) == ([{"step": 1}], ["metrics.jsonl line 2 is truncated or malformed",
                                               "metrics.jsonl line 3 is truncated or malformed"])


def test_efficiency_means_leave_out_warmup_and_validation():
    from ddpflow.results.metrics import efficiency_means

    rows = [{"kind": "train", "warmup": True, "samples_per_s": 1.0, "peak_mem_mib": 900},
            {"kind": "train", "samples_per_s": 10.0, "mfu": 0.5, "peak_mem_mib": 100,
             "gpu_util": None},
            {"kind": "train", "samples_per_s": 20.0, "mfu": None, "peak_mem_mib": 300},
            {"kind": "val", "samples_per_s": 99.0}]
    m = efficiency_means(rows)
    assert (m["mean_samples_per_s"], m["mfu"], m["gpu_util"], m["peak_mem_mib"]) == (
        15.0, 0.5, None, 300)
    assert efficiency_means([])["peak_mem_mib"] is None


# ------------------------------------------------------------------ wall clock

class _Clock:
    """time.time() that moves only when told (the arithmetic, not the machine's pace)."""

    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_process_start_is_when_it_was_started():
    """Between the parent's clock just before it started the child and the child's own
    clock (a 0.05 s allowance: /proc counts in ticks of 0.01 s)."""
    import sys
    import time

    before = time.time()
    out = subprocess.run([sys.executable, "-c", "import time; now = time.time(); from "
                          "ddpflow.results.wallclock import process_start; "
                          "print(process_start(), now)"], capture_output=True, text=True,
                         check=True).stdout.split()
    start, now = map(float, out)
    assert before - 0.05 <= start <= now, (before, start, now)


@pytest.mark.parametrize("env, passed", [
    ({"TORCHELASTIC_RUN_ID": "r", "DDPFLOW_LAUNCH_T0": "123.5"}, True),  # a rank
    ({"DDPFLOW_IN_CONTAINER": "1", "DDPFLOW_LAUNCH_T0": "123.5"}, True),  # in a container
    ({"DDPFLOW_LAUNCH_T0": "123.5"}, False),  # inherited by some other command
    ({"TORCHELASTIC_RUN_ID": "r", "DDPFLOW_LAUNCH_T0": "soon"}, False),
    ({"TORCHELASTIC_RUN_ID": "r"}, False),
])
def test_the_launch_time_is_passed_down_only_to_the_commands_own_processes(monkeypatch, env,
                                                                           passed):
    from ddpflow.results import wallclock

    for k in ("TORCHELASTIC_RUN_ID", "DDPFLOW_IN_CONTAINER", "DDPFLOW_LAUNCH_T0"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert (wallclock.launch_t0() == 123.5) is passed
    if not passed:
        assert wallclock.launch_t0() == pytest.approx(wallclock.process_start())


def test_laps_are_contiguous_and_earlier_runs_add_up(monkeypatch):
    from ddpflow.results import wallclock

    clock = _Clock(1000.0)
    monkeypatch.setattr(wallclock.time, "time", clock)
    w = wallclock.WallClock(t0=990.0)
    assert w.lap("startup") == 10.0
    clock.now = 1003.0
    w.mark("first_step")
    assert w.lap("train") == 3.0
    clock.now = 1004.5
    assert w.lap("train") == 1.5
    assert w.marks == {"first_step": 13.0}
    assert w.total({"train": 100.0, "validation": 2.0}) == {
        "startup": 10.0, "train": 104.5, "data_wait": 0.0, "validation": 2.0,
        "checkpoint": 0.0, "teardown": 0.0}
    block = wallclock.summary_block(w, {"train": 100.0}, runs=2, samples=1290)
    assert block["split_s"]["train"] == 104.5 and block["runs"] == 2
    assert block["rank_end"] == 1004.5 and block["total_s"] == 114.5
    assert block["samples_per_s"] == 1290 / 114.5
    # the launcher returns 2 s after the rank: teardown; twice the same (container, host)
    done = wallclock.complete(block, end=1006.5)
    assert done["split_s"]["teardown"] == 2.0 and done["total_s"] == 116.5
    assert wallclock.complete(done, end=1006.5) == done
    clock.now = 1010.0
    assert wallclock.complete(block)["split_s"]["teardown"] == 5.5  # its end: now
    early = wallclock.complete(block, end=1000.0)  # clocks a little apart: never negative
    assert early["split_s"]["teardown"] == 0.0


def test_a_stage_of_no_time_has_no_throughput():
    from ddpflow.results.wallclock import PHASES, complete

    wall = {"split_s": dict.fromkeys(PHASES, 0.0), "samples": 10, "rank_end": 5.0,
            "rank_teardown_s": 0.0}
    assert complete(wall, end=5.0)["samples_per_s"] is None


def test_a_lap_on_a_cpu_device_waits_for_nothing():
    import torch

    from ddpflow.results.wallclock import WallClock

    w = WallClock(t0=0.0)
    assert w.lap("train", sync=torch.device("cpu")) > 0


def test_a_metrics_log_is_line_buffered_nested_and_closed(tmp_path):
    from ddpflow.results.metrics import MetricsLog, read_records

    path = tmp_path / "a" / "b" / "metrics.jsonl"  # the stage folder made with its parents
    log = MetricsLog(path, None)
    log.write({"step": 1})
    assert path.read_text() == '{"step": 1}\n'  # on disk at once, before any close
    log.close()
    assert log.f.closed
    path.write_text('{"note": "a record without a step"}\n{"step": 5}\n')
    MetricsLog(path, 0).close()  # resumed at step 0: a stepless record is kept
    assert read_records(path)[0] == [{"note": "a record without a step"}]
    path.write_text('{"step": 1}\n{"step": 2')  # the last line cut short
    assert read_records(path)[1] == ["metrics.jsonl line 2 is truncated or malformed"]


def test_a_stage_is_judged_with_damaged_prepared_data_or_missing_pretrained_weights(
        tmp_path, monkeypatch):
    cfg = _cfg(tmp_path)
    cfg.data_dir.mkdir(parents=True, exist_ok=True)
    (cfg.data_dir / "meta.json").write_text("{ damaged")
    assert provenance.expected_record(cfg, "s1")["data"] is None  # stale, not a traceback
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "empty-hub"))
    cfg = from_dict(tiny_config(tmp_path, stages=TWO, model={"name": "resnet18",
                                                             "weights": "DEFAULT"}))
    assert provenance.expected_record(cfg, "s1")["init_sha256"] is None


def test_without_git_the_revision_is_unknown(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "no-git"))
    assert provenance.git_revision(tmp_path) == "unknown"


def test_startup_marks_are_to_the_tenth_of_a_millisecond(monkeypatch):
    from ddpflow.results import wallclock

    clock = _Clock(1003.123456)
    monkeypatch.setattr(wallclock.time, "time", clock)
    w = wallclock.WallClock(t0=990.0)
    w.mark("first_step")
    assert w.marks == {"first_step": 13.1235}


def test_a_stage_under_a_second_has_a_throughput():
    from ddpflow.results.wallclock import PHASES, complete

    split = {**dict.fromkeys(PHASES, 0.0), "train": 0.5}
    wall = {"split_s": split, "samples": 10, "rank_end": 5.0, "rank_teardown_s": 0.0}
    assert complete(wall, end=5.0)["samples_per_s"] == 20.0


def test_a_process_whose_name_holds_a_parenthesis_starts_when_it_started():
    """/proc/self/stat's second field is the name in parentheses, and a name may hold ')':
    the fields after it are counted from the last ')'."""
    import sys
    import time

    probe = ("import ctypes, time; ctypes.CDLL(None).prctl(15, b'a) b c', 0, 0, 0); "
             "now = time.time(); from ddpflow.results.wallclock import process_start; "
             "print(open('/proc/self/comm').read().strip(), '|', process_start(), now)")
    before = time.time()
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout
    name, times = out.split(" | ")
    start, now = map(float, times.split())
    assert name == "a) b c" and before - 0.05 <= start <= now, out


def test_without_proc_the_process_start_is_now(monkeypatch):
    """(/proc is missing on some systems; its absence is injected.)"""
    import time

    from ddpflow.results import wallclock

    def no_proc(*_a, **_k):
        raise FileNotFoundError("/proc/self/stat")

    monkeypatch.setattr(wallclock, "open", no_proc, raising=False)
    before = time.time()
    assert before <= wallclock.process_start() <= time.time()


def test_a_lap_on_a_gpu_waits_for_its_queued_work_first(monkeypatch):
    """(No GPU here: torch.cuda.synchronize is a recorder standing in for the GPU.)"""
    import torch

    from ddpflow.results.wallclock import WallClock

    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", waited.append)
    WallClock(t0=0.0).lap("train", sync=torch.device("cuda", 1))
    assert waited == [torch.device("cuda", 1)]
