"""TensorBoard: event files read back with TensorBoard's own reader hold every scalar of
every stage, with steps that continue across stages and no point drawn twice after a
resume; asking for TensorBoard without the package is one clear message."""

from __future__ import annotations

import json

import pytest

from conftest import ddpflow, tiny_config, write_config

pytestmark = pytest.mark.slow

TRAIN_TAGS = ["train/loss", "train/lr", "perf/samples_per_s", "perf/compute_samples_per_s",
              "perf/data_wait_fraction", "perf/tflops"]  # mfu, peak memory, grad scale: GPU


def _scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_and_mlflow_across_stages_and_a_resume(tmp_path):
    db = f"sqlite:///{tmp_path}/mlflow.db"  # MLflow's own store, no server needed here
    cfg = tiny_config(tmp_path, tracking={"tensorboard": True, "mlflow": {"uri": db}}, stages=[
        {"name": "s1", "epochs": 2, "batch_size": 32, "lr": 0.05},
        {"name": "s2", "epochs": 1, "batch_size": 32, "lr": 0.01, "init_from": "previous"}])
    p = write_config(tmp_path, cfg)
    ddpflow("prepare", "--config", p, check=True)
    # s1 stops at a checkpoint (step 24), then resumes to the end: points after step 24 of
    # the first run are purged, none is drawn twice
    # from tmp_path: MLflow's SQLite store keeps artifacts in ./mlruns of the working folder
    ddpflow("launch", "--config", p, "--stage", "s1", "--halt-after-steps", "26", cwd=tmp_path)
    ddpflow("launch", "--config", p, "--stage", "s1", check=True, cwd=tmp_path)
    ddpflow("launch", "--config", p, "--stage", "s2", check=True, cwd=tmp_path)
    tb = tmp_path / "results/t/tensorboard"
    s1, s2 = _scalars(tb / "s1"), _scalars(tb / "s2")
    for tags in (s1, s2):
        for tag in TRAIN_TAGS + ["val/acc", "val/loss"]:
            steps = tags.get(tag)
            assert steps, f"{tag} missing: {sorted(tags)}"
            assert steps == sorted(set(steps)), (tag, steps)  # increasing, no duplicates
    assert s1["val/acc"] == [16, 32]  # 1024 samples / (32 x 2 ranks) = 16 steps per epoch
    assert min(s2["train/loss"]) > max(s1["train/loss"]) and s2["val/acc"] == [32 + 16]
    # the resolved config as hparams, its metrics the series logged during the stage: no
    # single-point hparam/* charts
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(str(tb / "s2"))
    acc.Reload()
    assert not [t for t in acc.Tags()["scalars"] if t.startswith("hparam")], acc.Tags()
    content = acc.PluginTagToContent("hparams")
    exp = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"])
    # numbers only: the per-class list val_recall is no scalar of a tracker
    assert {m.name.tag for m in exp.experiment.metric_infos} == {"val/acc", "val/loss",
                                                                 "val/top5", "val/balanced_acc"}
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    assert start.session_start_info.hparams["stages.1.lr"].number_value == 0.01

    # MLflow: the resumed s1 continued its one run (id kept in the stage folder), its points
    # are those of TensorBoard, none twice
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=db)
    runs = c.search_runs([c.get_experiment_by_name("ddpflow").experiment_id])
    named = {}
    for r in runs:
        named.setdefault(r.info.run_name, []).append(r)
    assert sorted((k, len(v)) for k, v in named.items()) == [("s1", 1), ("s2", 1), ("t", 1)]
    s1_run = named["s1"][0]
    assert s1_run.info.status == "FINISHED"
    assert (tmp_path / "mlruns").is_dir()  # summary.json and metrics.jsonl as artifacts
    assert json.loads((tmp_path / "results/t/stages/s1/mlflow.json").read_text())[
        "run_id"] == s1_run.info.run_id
    for tag in ("train/loss", "val/acc"):
        steps = sorted(m.step for m in c.get_metric_history(s1_run.info.run_id, tag))
        assert steps == s1[tag], (tag, steps, s1[tag])


@pytest.mark.parametrize("package,tracking", [
    ("tensorboard", {"tensorboard": True}),
    ("mlflow", {"tensorboard": False, "mlflow": {"uri": "http://127.0.0.1:9"}})])
def test_tracker_requested_without_its_package(tmp_path, package, tracking):
    cfg = tiny_config(tmp_path, tracking=tracking)
    p = write_config(tmp_path, cfg)
    ddpflow("prepare", "--config", p, check=True)
    # a Python whose package is hidden: a module that cannot be found
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import sys\nclass _H:\n def find_spec(self, name, path=None, target=None):\n"
        f"  return None if name != {package!r} else (_ for _ in ()).throw(ImportError)\n"
        "sys.meta_path.insert(0, _H())\n")
    proc = ddpflow("launch", "--config", p, "--stage", "s1",
                   env={"PYTHONPATH": str(hide)})
    assert proc.returncode != 0
    assert f"ddpflow[{package}]" in proc.stderr and "Traceback" not in proc.stderr


def test_profiler_trace_of_a_two_rank_stage(tmp_path):

    cfg = tiny_config(tmp_path, tracking={"tensorboard": False},
                      profile={"stage": "s1", "wait": 1, "warmup": 1, "active": 2,
                               "all_ranks": True},
                      stages=[{"name": "s1", "max_steps": 8, "batch_size": 32}])
    p = write_config(tmp_path, cfg)
    ddpflow("prepare", "--config", p, check=True)
    proc = ddpflow("launch", "--config", p, "--stage", "s1", check=True)
    folder = tmp_path / "results/t/stages/s1/profile"
    for rank in (0, 1):
        trace = json.loads((folder / f"trace-rank{rank}.json").read_text())
        events = trace["traceEvents"]  # Chrome's trace event format
        assert any(e.get("ph") == "X" and "aten::" in e.get("name", "") for e in events)
        assert "Self CPU" in (folder / f"top_ops-rank{rank}.txt").read_text()
    assert "profiler trace" in proc.stderr  # the top ops went to the stage log
    ddpflow("collect", "--config", p, check=True)
    assert "trace-rank0.json" in (tmp_path / "results/t/summary/report.html").read_text()
    # a stage name that does not exist: one message before anything runs
    bad = write_config(tmp_path, {**cfg, "profile": {"stage": "nope"}}, "bad.yaml")
    proc = ddpflow("validate", "--config", bad)
    assert proc.returncode != 0 and "profile.stage 'nope' is not a stage" in proc.stderr
