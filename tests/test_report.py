"""collect on a real (tiny) workflow run: tables, checksums, manifest, plots, HTML, report."""

from __future__ import annotations

import csv
import hashlib
import json
import platform
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import ddpflow
from test_workflow import TINY, snakemake, write

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    wd = tmp_path_factory.mktemp("report")
    write(wd, TINY)
    proc = snakemake(wd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return wd


def test_tables_checksums_and_manifest(run):
    out = run / "results/wf/summary"
    for name in ("summary.json", "summary.csv", "manifest.json", "report.html",
                 "loss_accuracy.png", "throughput.png", "rank_step_time.png",
                 "checkpoints/index.json"):
        assert (out / name).is_file(), name
    rows = list(csv.DictReader((out / "summary.csv").open()))
    assert [r["stage"] for r in rows] == ["a", "b"]
    for r in rows:
        stage = json.loads((run / f"results/wf/stages/{r['stage']}/summary.json").read_text())
        for key in ("final_val_acc", "best_val_acc", "wall_time_s", "mean_samples_per_s"):
            assert float(r[key]) == pytest.approx(stage[key], rel=1e-12), key
        for key in ("steps", "world_size", "global_batch"):
            assert int(r[key]) == stage[key]
        assert r["precision"] == stage["precision"] and r["finished"] == "True"
    index = json.loads((out / "checkpoints/index.json").read_text())["checkpoints"]
    assert {(c["stage"], c["kind"]) for c in index} == {("a", "final"), ("a", "best"),
                                                        ("b", "final"), ("b", "best")}
    for c in index:
        blob = (out / "checkpoints" / c["file"]).read_bytes()
        assert hashlib.sha256(blob).hexdigest() == c["sha256"] and len(blob) == c["bytes"]
    man = json.loads((out / "manifest.json").read_text())
    assert man["torch"] == torch.__version__ and man["python"] == platform.python_version()
    assert man["config_hash"] and man["seed"] == 0 and len(man["git_revision"]) >= 7
    assert man["stages"]["a"]["command"]["argv"][1:3] == ["-m", "torch.distributed.run"]
    assert man["image"]["engine"] == "none"
    summary = json.loads((out / "summary.json").read_text())
    ev = summary["evaluation"]
    stage_b = json.loads((run / "results/wf/stages/b/summary.json").read_text())
    assert ev["stage"] == "b" and ev["split"] == "test" and ev["samples"] > 0
    assert ev["acc"] == pytest.approx(stage_b["test_acc"])  # evaluate == the stage's own
    assert float(rows[1]["test_acc"]) == pytest.approx(stage_b["test_acc"])
    assert all(c["ok"] for c in summary["export"]["checks"].values())
    assert "test split   acc" in (out / "headline.txt").read_text()


def test_report_renders_in_headless_chromium(run, tmp_path):
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is needed (tests/setup/system.sh installs it)"
    page = (run / "results/wf/summary/report.html").resolve().as_uri()
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run",
             f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1100,1400"]
    dom = subprocess.run([chromium, *flags, "--virtual-time-budget=5000", "--dump-dom", page],
                         capture_output=True, text=True, timeout=120).stdout
    body = re.search(r"<body[^>]*>", dom).group(0)
    # loss/accuracy, throughput, rank step times and the test split's confusion matrix
    assert 'data-images-loaded="4"' in body and 'data-images-total="4"' in body, body
    assert 'data-page-overflow="false"' in body, body  # wide tables scroll in place
    headline = dom.split('id="headline"')[1].split("</table>")[0]
    assert "<td>a</td>" in headline and "<td>b</td>" in headline
    assert "test acc (test split)" in headline
    # the workflow evaluated the last stage on the test split and exported it
    assert 'id="test"' in dom and "held-out images" in dom and 'id="export"' in dom
    shot = tmp_path / "shot.png"
    subprocess.run([chromium, *flags, f"--screenshot={shot}", page], capture_output=True,
                   timeout=120, check=True)
    img = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    assert img.shape == (1400, 1100, 3)
    # matplotlib's first line colour (#1f77b4) on screen: the plots were drawn, not just linked
    blue = (np.abs(img - np.array([31, 119, 180])) < 25).all(axis=2).sum()
    assert blue > 200, blue


def test_snakemake_report_includes_the_plots(run, tmp_path):
    out = tmp_path / "smk-report.html"
    proc = snakemake(run, "--report", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = out.read_text()
    for name in ("loss_accuracy.png", "throughput.png", "rank_step_time.png", "summary.csv"):
        assert name in text, name
    assert "Training loss (mean per log interval)" in text  # a caption


def test_interrupted_run_is_summarised_with_notes(run, tmp_path):
    res = tmp_path / "results"
    shutil.copytree(run / "results", res)
    shutil.rmtree(res / "wf/stages/b")
    metrics = res / "wf/stages/a/metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"kind": "train", "step": 9')  # cut mid-line
    cfg = json.loads((run / "results/wf/workflow_config.json").read_text())
    cfg["results_dir"] = str(res)
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    proc = ddpflow("collect", "--config", tmp_path / "c.json", check=True)
    assert "NOT FINISHED" in proc.stdout
    s = json.loads((res / "wf/summary/summary.json").read_text())
    a, b = s["stages"]
    assert a["finished"] and "line" in a["note"] and "truncated" in a["note"]
    assert not b["finished"] and "not started" in b["note"] and not s["finished"]
    assert "NOT FINISHED" in (res / "wf/summary/report.html").read_text()




def test_sigterm_during_collect_keeps_no_stale_report(run, tmp_path):
    """A collect stopped part-way (scancel, Snakemake stopping its jobs, `kill`) leaves no
    report from the last collect beside half of the new one; the same command then writes
    all of it."""
    res = tmp_path / "results"
    shutil.copytree(run / "results", res)
    cfg = json.loads((run / "results/wf/workflow_config.json").read_text())
    cfg["results_dir"] = str(res)
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    out = res / "wf/summary"
    proc = subprocess.Popen([sys.executable, "-m", "ddpflow", "collect", "--config",
                             str(tmp_path / "c.json")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120  # until the old report is gone and the first plot is new
    while ((out / "summary.json").exists() or not (out / "loss_accuracy.png").exists()) \
            and time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "stopped by SIGTERM" in err and "Traceback" not in err, err
    assert not [p.name for p in out.iterdir() if p.is_file()]  # no part of either report
    ddpflow("collect", "--config", tmp_path / "c.json", check=True)
    for name in ("summary.json", "summary.csv", "report.html", "headline.txt",
                 "manifest.json", "loss_accuracy.png", "throughput.png"):
        assert (out / name).is_file(), name


def test_a_small_difference_is_not_printed_as_zero():
    from ddpflow.results.report import _fmt

    assert _fmt(2.86e-06) == "2.86e-06" and _fmt(-4e-4) == "-4.00e-04"
    assert _fmt(0.0) == "0.0000" and _fmt(0.75291) == "0.7529" and _fmt(1234.5) == "1,234.5"
