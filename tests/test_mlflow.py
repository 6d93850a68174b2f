"""MLflow for real: a `mlflow server` on 127.0.0.1, a 2-stage workflow logging to it, and the
runs, params, metrics and artifacts read back through MLflow's own client; then the same
workflow with the server stopped finishes, says it could not log, and the next collect (with
the server back) sends what waited."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import ddpflow
from test_workflow import TINY, snakemake, write

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`mlflow server` with a SQLite store and proxied artifacts under one folder."""

    def __init__(self, folder: Path):
        self.folder, self.port = folder, _free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self) -> None:
        log = open(self.folder / "server.log", "a")
        self.proc = subprocess.Popen(
            [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--workers", "1", "--backend-store-uri", f"sqlite:///{self.folder}/mlflow.db",
             "--artifacts-destination", str(self.folder / "artifacts")],
            stdout=log, stderr=log)
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(self.uri + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                assert self.proc.poll() is None, (self.folder / "server.log").read_text()[-2000:]
                time.sleep(1)
        raise AssertionError("mlflow server did not start in 180 s")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


@pytest.fixture
def server(tmp_path):
    (tmp_path / "mlflow").mkdir()
    s = Server(tmp_path / "mlflow")
    s.start()
    yield s
    if s.proc.poll() is None:
        s.stop()


def _runs(c, exp_id):
    runs = c.search_runs([exp_id], order_by=["attributes.start_time ASC"])
    return {r.info.run_name: r for r in runs}, runs


def test_workflow_logs_to_a_real_mlflow_server_and_survives_its_absence(tmp_path, server):
    from mlflow.tracking import MlflowClient

    wd = tmp_path / "wd"
    wd.mkdir()
    cfg = {**TINY, "tracking": {"tensorboard": False,
                                "mlflow": {"uri": server.uri, "experiment": "ddpflow-test"}}}
    write(wd, cfg)
    proc = snakemake(wd)
    assert proc.returncode == 0, proc.stderr[-3000:]

    c = MlflowClient(tracking_uri=server.uri)
    exp = c.get_experiment_by_name("ddpflow-test")
    named, runs = _runs(c, exp.experiment_id)
    assert sorted(named) == ["a", "b", "wf"], sorted(named)
    parent = named["wf"].info.run_id
    # the workflow's own run: the resolved config and the headline, to compare runs by
    top = named["wf"].data
    assert top.params["stages.1.lr"] == "0.02" and top.params["run"] == "wf"
    assert {"final_val_acc", "best_val_acc", "test_acc", "test_split_acc"} <= set(top.metrics)
    assert top.tags["ddpflow.config_hash"]
    for stage, lr in (("a", "0.1"), ("b", "0.02")):
        run = named[stage]
        assert run.data.tags["mlflow.parentRunId"] == parent  # nested under the workflow run
        assert run.info.status == "FINISHED"
        assert run.data.params["stages.0.lr"] == "0.1" and run.data.params["run"] == "wf"
        assert run.data.params[f"stages.{'ab'.index(stage)}.lr"] == lr
        assert {"train/loss", "train/lr", "perf/samples_per_s", "val/acc",
                "val/loss", "test/acc"} <= set(run.data.metrics)
        assert {a.path for a in c.list_artifacts(run.info.run_id)} >= {"summary.json",
                                                                        "metrics.jsonl"}
    steps = {s: [m.step for m in c.get_metric_history(named[s].info.run_id, "train/loss")]
             for s in "ab"}
    assert steps["a"] == sorted(set(steps["a"])) and min(steps["b"]) > max(steps["a"])
    assert named["wf"].info.status == "FINISHED"  # collect finished it, with the report
    # the report, the export bundle and the test split's evaluation, as artifacts
    assert {"report.html", "export", "test-final"} <= {a.path for a in c.list_artifacts(parent)}
    assert "export/model.onnx" in {a.path for a in c.list_artifacts(parent, "export")}

    # the server goes away: training is not failed by it, the log says so, nothing is lost
    server.stop()
    cfg["stages"] = [cfg["stages"][0], {**cfg["stages"][1], "lr": 0.05}]
    write(wd, cfg)  # a changed lr of stage b: b trains again, from scratch (a is done)
    proc = snakemake(wd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = "".join(p.read_text(errors="replace") for p in (wd / "results/wf/logs").rglob("*")
                   if p.is_file())
    assert "could not log stage b" in logs and "could not log the report" in proc.stderr + logs
    unsent = wd / "results/wf/stages/b/mlflow_unsent.jsonl"
    assert unsent.is_file() and unsent.stat().st_size > 0

    # back: collect sends what waited, into new runs (a fresh start, not a resume)
    server.start()
    done = ddpflow("collect", "--config", wd / "results/wf/workflow_config.json", cwd=wd)
    assert done.returncode == 0, done.stderr
    assert not unsent.exists()
    _, runs = _runs(c, exp.experiment_id)
    b_runs = [r for r in runs if r.info.run_name == "b"]
    assert len(b_runs) == 2 and b_runs[1].info.status == "FINISHED"
    assert len(c.get_metric_history(b_runs[1].info.run_id, "train/loss")) == len(steps["b"])
    assert len([r for r in runs if r.info.run_name == "a"]) == 1  # a was not trained again


def test_mlflow_settings_checked_before_any_job(tmp_path):
    for extra, words in (({"tracking": {"mlflow": {"uri": "localhost:5000"}}},
                          "tracking.mlflow.uri 'localhost:5000' has scheme"),
                         ({"tracking": {"mlflow": {"url": "http://x"}}},
                          "unknown key tracking.mlflow.url"),
                         ({"container": {"uri": "ddpflow:latest"}},
                          "container.uri 'ddpflow:latest' is not docker://"),
                         ({"slurm": {"gres": "gpu:a100:2", "gpus": 1}},
                          "slurm.gres 'gpu:a100:2' asks for 2 GPU(s) and slurm.gpus for 1")):
        write(tmp_path, {**TINY, **extra})
        proc = snakemake(tmp_path, "-n")
        assert proc.returncode != 0 and words in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
        assert not (tmp_path / "results").exists()  # nothing written


def test_sweep_trials_nest_under_the_sweeps_run(tmp_path, monkeypatch):
    """sweep run -> trial run -> stage run, each id kept in its folder; parallel trials
    share the sweep's one run; the leaderboard finishes it."""
    from mlflow.tracking import MlflowClient

    from ddpflow.config import from_dict
    from ddpflow.tracking import mlflowrun

    monkeypatch.chdir(tmp_path)  # a SQLite store keeps artifacts in ./mlruns
    db = f"sqlite:///{tmp_path}/mlflow.db"
    root = tmp_path / "results/sw"
    (root / "sweep").mkdir(parents=True)
    (root / "sweep/plan.json").write_text("{}")
    base = {**TINY, "results_dir": str(tmp_path / "results"), "run": "sw",
            "tracking": {"mlflow": {"uri": db}}}
    trials = [from_dict({**base, "results_dir": str(root / "trials"), "run": t})
              for t in ("lr-0.1-aaaaaa", "lr-0.2-bbbbbb")]
    for cfg in trials:
        sink = mlflowrun.StageSink(cfg, "a", tmp_path / "unsent.jsonl")
        for op in (["open", {"key": "k", "resume": False, "params": {"run": cfg.run}}],
                   ["metrics", {"step": 1, "ts": 0, "values": {"train/loss": 2.0}}],
                   ["end", {"artifacts": [], "status": "FINISHED"}]):
            sink.apply(op)
        assert sink.failed is None, sink.failed
    mlflowrun.finish_workflow_run(from_dict(base), [], sweep=True)

    c = MlflowClient(tracking_uri=db)
    runs = {r.info.run_id: r for r in c.search_runs(
        [c.get_experiment_by_name("ddpflow").experiment_id])}
    by_name = {}
    for r in runs.values():
        by_name.setdefault(r.info.run_name, []).append(r)
    # a trial's stage run is named trial/stage: every trial has a stage "a"
    assert sorted((k, len(v)) for k, v in by_name.items()) == [
        ("lr-0.1-aaaaaa", 1), ("lr-0.1-aaaaaa/a", 1), ("lr-0.2-bbbbbb", 1),
        ("lr-0.2-bbbbbb/a", 1), ("sw", 1)]
    sweep_id = by_name["sw"][0].info.run_id
    assert by_name["sw"][0].info.status == "FINISHED"
    for stage_run in by_name["lr-0.1-aaaaaa/a"] + by_name["lr-0.2-bbbbbb/a"]:
        trial = runs[stage_run.data.tags["mlflow.parentRunId"]]
        assert stage_run.info.run_name == trial.info.run_name + "/a"
        assert trial.data.tags["mlflow.parentRunId"] == sweep_id
    assert not (tmp_path / "unsent.jsonl").exists()

    # what a stage kept while the server was away, its last line cut short by a kill: the
    # next collect sends the readable part, says what it skipped, and logs the report
    trial = trials[0]
    unsent = trial.stage_dir("a") / mlflowrun.UNSENT
    unsent.write_text('["metrics", {"step": 5, "ts": 0, "values": {"train/loss": 1.5}}]\n'
                      '["metrics", {"step": 6, "ts"')
    report = tmp_path / "report.html"
    report.write_text("<html></html>")
    mlflowrun.finish_workflow_run(trial, [report])
    assert not unsent.exists()
    trial_run = [r for r in c.search_runs([c.get_experiment_by_name("ddpflow").experiment_id])
                 if r.info.run_name == trial.run][0]
    assert "report.html" in {a.path for a in c.list_artifacts(trial_run.info.run_id)}
    stage_a = json.loads((trial.stage_dir("a") / mlflowrun.RUN_FILE).read_text())["run_id"]
    assert [m.step for m in c.get_metric_history(stage_a, "train/loss")] == [1, 5]
