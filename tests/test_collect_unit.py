"""results/report.py and results/collect.py on their own: the numbers report.html shows and
how (small differences not rounded to zero, thousands separated, a wait as a percentage),
its headline table with a column per figure in a fixed order, an unfinished stage with its
reason, the plots embedded whole under their captions, the recall per class and memory
tables with the lowest class marked, the test split and the export bundle; and `ddpflow
collect` over a run folder of real files: each stage's row, the checkpoints gathered, the
manifest, the headline, and no part of a collect left behind when it stops. Fast: no
training, real files in tmp_path.
"""

from __future__ import annotations

import base64
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

import ddpflow
from conftest import tiny_config
from ddpflow.config import from_dict
from ddpflow.core.checksum import sha256_of
from ddpflow.core.errors import UserError
from ddpflow.results import collect, provenance, report
from ddpflow.results.summary import write_summary

# ------------------------------------------------------------------ report.html: numbers

@pytest.mark.parametrize("value, text", [
    (None, "–"), (0.0, "0.0000"), (2.86e-06, "2.86e-06"), (-2.86e-06, "-2.86e-06"),
    (0.001, "0.0010"), (0.5, "0.5000"), (9.5, "9.5000"), (-9.5, "-9.5000"), (10.0, "10.0"),
    (-12.25, "-12.2"), (1234.56, "1,234.6"), (3, "3"), (True, "True"), ("a<b", "a&lt;b"),
])
def test_a_number_is_shown_to_its_size_and_text_is_escaped(value, text):
    assert report._fmt(value) == text


# ------------------------------------------------------------------ report.html: the page

def _finished(stage: str, **extra) -> dict:
    return {"stage": stage, "finished": True, "final_val_acc": 0.5, "best_value": 0.75,
            "test_acc": 0.625, "steps": 10, "wall_time_s": 12.5, "startup_s": 1.25,
            "wall_samples_per_s": 1234.5, "mean_samples_per_s": 2000.0,
            "samples_per_s_per_rank": 1000.0, "data_wait_fraction": 0.125, "world_size": 2,
            "precision": "bf16", "global_batch": 64, **extra}


def _page(rows, finished=False, figures=None, metric="val_acc", classes=None, **summary):
    return report.render(SimpleNamespace(run="r<1>"),
                         {"finished": finished, "config_hash": "abc", "stages": rows,
                          **summary},
                         {"torch": "2.5", "git_revision": "deadbeef", "config": {
                             "seed": 1, "data_dir": Path("/d")}}, figures or {},
                         metric, classes)


HEAD = ("<th>stage</th><th>val acc</th><th>best val acc</th><th>test acc (test split)</th>"
        "<th>steps</th><th>wall time (s)</th><th>start-up (s)</th><th>samples/s overall</th>"
        "<th>samples/s steady state</th><th>per rank</th><th>data wait</th><th>ranks</th>"
        "<th>precision</th><th>global batch</th>")
ROW = ("<tr><td>s1</td><td>0.5000</td><td>0.7500</td><td>0.6250</td><td>10</td><td>12.5</td>"
       "<td>1.2500</td><td>1,234.5</td><td>2,000.0</td><td>1,000.0</td><td>12.5 %</td>"
       "<td>2</td><td>bf16</td><td>64</td></tr>")


def test_the_headline_table_has_one_row_per_stage_and_an_unfinished_stage_says_why():
    rows = [_finished("s1"), {"stage": "s2", "finished": False, "note": "no <summary>",
                              "steps": 3}]
    page = _page(rows)
    assert "<title>ddpflow report: r&lt;1&gt;</title>" in page
    assert '<h1>ddpflow run <code>r&lt;1&gt;</code>: <span class="bad">NOT FINISHED</span>' \
        in page
    assert ("<p>config hash <code>abc</code>, 2 stage(s),\ngit revision <code>deadbeef</code>,"
            "\ntorch 2.5</p>") in page
    assert (f'<table id="headline"><tr>{HEAD}</tr>{ROW}<tr><td>s2</td><td><span class="bad">'
            f'not finished</span>: no &lt;summary&gt;</td>' + "<td></td>" * 12 + "</tr></table>"
            ) in page
    assert "<h2>Plots</h2><p>No metrics recorded yet.</p>" in page
    # every field of each stage, as it was recorded (the fraction unscaled)
    assert ("<h3>s1</h3><table><tr><th>stage</th><td>s1</td></tr><tr><th>finished</th>"
            "<td>True</td></tr><tr><th>final_val_acc</th><td>0.5000</td></tr>") in page
    assert "<tr><th>data_wait_fraction</th><td>0.1250</td></tr>" in page
    assert ("<h3>s2</h3><table><tr><th>stage</th><td>s2</td></tr><tr><th>finished</th>"
            "<td>False</td></tr><tr><th>note</th><td>no &lt;summary&gt;</td></tr><tr><th>steps"
            "</th><td>3</td></tr></table>") in page
    # the manifest whole, keys sorted (two runs' manifests compare line by line)
    assert ('<h2>Manifest</h2><pre id="manifest">{\n  &quot;config&quot;: {\n    &quot;data_dir'
            '&quot;: &quot;/d&quot;,\n    &quot;seed&quot;: 1\n  },\n  &quot;git_revision&quot;: '
            '&quot;deadbeef&quot;,\n  &quot;torch&quot;: &quot;2.5&quot;\n}</pre>') in page
    assert '<span class="ok">finished</span>' in _page([_finished("s1")], finished=True)


def test_a_classification_run_shows_its_balanced_accuracy_beside_the_metric():
    page = _page([_finished("s1", final_val_balanced_acc=0.4, data_wait_fraction=None),
                  _finished("s2")])
    assert ("<tr><th>stage</th><th>val acc</th><th>val balanced acc</th><th>best val acc</th>"
            "<th>test acc (test split)</th>") in page
    assert ("<tr><td>s1</td><td>0.5000</td><td>0.4000</td><td>0.7500</td><td>0.6250</td>"
            ) in page
    assert "<td>1,000.0</td><td>–</td><td>2</td>" in page  # no wait recorded
    assert "<tr><td>s2</td><td>0.5000</td><td>–</td><td>0.7500</td>" in page
    # judged by the balanced accuracy: it is the metric's column, not a second one
    page = _page([_finished("s1", final_val_balanced_acc=0.4, test_balanced_acc=0.3)],
                 metric="val_balanced_acc")
    assert ("<tr><th>stage</th><th>val balanced acc</th><th>best val balanced acc</th>"
            "<th>test balanced acc (test split)</th><th>steps</th>") in page
    assert "<tr><td>s1</td><td>0.4000</td><td>0.7500</td><td>0.3000</td><td>10</td>" in page


def test_the_plots_are_embedded_whole_under_their_captions(tmp_path):
    figures = {}
    for name in ("loss_accuracy", "confusion_test", "throughput", "rank_step_time", "x<y"):
        figures[name] = tmp_path / f"{name}.png"
        figures[name].write_bytes(name.encode() + bytes(range(256)))
    page = _page([_finished("s1")], figures=figures, metric="val_loss")
    data = [base64.b64encode(p.read_bytes()).decode() for p in figures.values()]
    assert "No metrics recorded yet" not in page
    assert (f'<h2>Plots</h2><figure><img alt="Training loss and val_loss across all stages" '
            f'src="data:image/png;base64,{data[0]}"><figcaption>Training loss and val_loss '
            f'across all stages</figcaption></figure>'
            f'<figure><img alt="Confusion matrix of the last stage on the test split" '
            f'src="data:image/png;base64,{data[1]}"><figcaption>Confusion matrix of the last '
            f'stage on the test split</figcaption></figure>') in page
    assert ('<figcaption>Throughput (all ranks) and the share of step time spent waiting for '
            'data</figcaption>') in page
    assert f'<img alt="Step time of each rank" src="data:image/png;base64,{data[3]}">' in page
    assert (f'<figure><img alt="x&lt;y" src="data:image/png;base64,{data[4]}"><figcaption>'
            f'x&lt;y</figcaption></figure>') in page


def test_recall_per_class_per_finished_stage_with_the_lowest_of_each_column_marked():
    rows = [_finished("a", final_val_recall=[0.5, None, 0.25], test_recall=[0.75, 1.0]),
            _finished("b", final_val_recall=[1.0, 0.5, 0.5, 0.75], test_recall=None),
            {"stage": "c", "finished": False, "note": "", "final_val_recall": [0.0]},
            _finished("d", final_val_recall=0.5)]
    html = report._per_class(rows, ["cat", "dog<"])
    assert html == (
        '<h2>Recall per class</h2><p>Per class: the share of its images classified right (a '
        'class the split lacks: –); their mean is the balanced accuracy, the lowest of each '
        'column in red</p><table id="recall"><tr><th>class</th><th>a (val)</th><th>a (test)'
        '</th><th>b (val)</th></tr>'
        '<tr><td>cat</td><td>0.5000</td><td class="bad">0.7500</td><td>1.0000</td></tr>'
        '<tr><td>dog&lt;</td><td>–</td><td>1.0000</td><td class="bad">0.5000</td></tr>'
        '<tr><td>2</td><td class="bad">0.2500</td><td>–</td><td class="bad">0.5000</td></tr>'
        '<tr><td>3</td><td>–</td><td>–</td><td>0.7500</td></tr></table>')
    assert html in _page(rows, classes=["cat", "dog<"])
    many = report._per_class([_finished("a", final_val_recall=[None] + [0.5] * 150)], None)
    assert many.count("<tr>") == 101 and "<tr><td>99</td>" in many
    assert "<tr><td>0</td><td>–</td></tr>" in many and '<td class="bad">0.5000</td>' in many
    assert report._per_class([_finished("a", final_val_recall=[None, None])], None).endswith(
        "<tr><td>0</td><td>–</td></tr><tr><td>1</td><td>–</td></tr></table>")
    assert report._per_class([_finished("a")], ["cat"]) == ""


def test_memory_per_rank_of_each_finished_stage_that_measured_it():
    mem = {"mem_params_mib": 1.5, "mem_grads_mib": 2.5, "mem_optimizer_mib": 3.0,
           "mem_activations_mib": 0.25, "mem_activations_without_checkpointing_mib": 12.0,
           "mem_peak_mib": 100.0}
    rows = [_finished("a", strategy="fsdp", **mem), _finished("b", mem_peak_mib=None),
            {"stage": "c", "finished": False, "note": "", **mem}]
    html = report._memory(rows)
    assert html == (
        '<h2>Memory per rank (MiB)</h2><p>Parameters, gradients and optimizer state as each '
        'rank holds them (a shard under fsdp); activations: what one micro-batch kept for the '
        'backward; peak: the GPU allocator\'s (a CPU: the process\'s resident set)</p>'
        '<table id="memory"><tr><th>stage</th><th>strategy</th><th>ranks</th>'
        '<th>parameters</th><th>gradients</th><th>optimizer state</th><th>activations</th>'
        '<th>activations without checkpointing</th><th>peak</th></tr>'
        '<tr><td>a</td><td>fsdp</td><td>2</td><td>1.5000</td><td>2.5000</td><td>3.0000</td>'
        '<td>0.2500</td><td>12.0</td><td>100.0</td></tr></table>')
    assert html in _page(rows)
    assert report._memory(rows[1:]) == ""


EVALUATION = {"samples": 20, "stage": "s2", "weights": {"holds": "ema"}, "acc": 0.85,
              "top5": 1.0, "loss": 0.375, "classes": ["cat", "dog"],
              "per_class": {"precision": [0.5, 1.0], "recall": [0.75, 0.25],
                            "f1": [0.6, 0.4], "support": [12, 8]}}


def test_the_test_split_section_shows_the_evaluation_per_class():
    html = report._held_out({"evaluation": EVALUATION, "export": None})
    assert html == (
        '<h2>Test split</h2><p id="test">stage s2, ema weights: <b>test acc 0.8500</b>, top-5 '
        '1.0000, loss 0.3750 over 20 held-out images (model selection used the val split '
        'only)</p><table><tr><th>class</th><th>precision</th><th>recall</th><th>F1</th>'
        '<th>support</th></tr><tr><td>cat</td><td>0.5000</td><td>0.7500</td><td>0.6000</td>'
        '<td>12</td></tr><tr><td>dog</td><td>1.0000</td><td>0.2500</td><td>0.4000</td>'
        '<td>8</td></tr></table>')
    assert html in _page([_finished("s1")], evaluation=EVALUATION)
    many = {**EVALUATION, "classes": list(range(150)),
            "per_class": {k: [1] * 150 for k in ("precision", "recall", "f1", "support")}}
    assert report._held_out({"evaluation": many}).count("<tr>") == 101
    assert report._held_out({"evaluation": {"samples": 0, "note": "no test <split>"}}) == \
        "<h2>Test split</h2><p>no test &lt;split&gt;</p>"
    assert report._held_out({"evaluation": None, "export": None}) == ""


def test_the_export_section_shows_each_format_and_its_check():
    ex = {"folder": "/r/export", "files": {"onnx": {"file": "model.onnx"}},
          "check_rule": "top class equal", "checks": {
              "onnx": {"ok": True, "max_abs_diff": 2.5e-07},
              "torchscript": {"ok": False, "error": "<differs>", "max_abs_diff": 0.5}}}
    html = report._held_out({"evaluation": None, "export": ex})
    assert html == (
        '<h2>Export</h2><p>bundle <code>/r/export</code> (<code>ddpflow predict --bundle ...'
        '</code>); top class equal</p><table id="export"><tr><th>format</th><th>file</th>'
        '<th>check</th><th>max |diff|</th></tr><tr><td>onnx</td><td>model.onnx</td><td>ok'
        '</td><td>2.50e-07</td></tr><tr><td>torchscript</td><td>–</td><td><span class=bad>'
        '&lt;differs&gt;</span></td><td>0.5000</td></tr></table>')
    both = report._held_out({"evaluation": EVALUATION, "export": {**ex, "files": None,
                                                                  "checks": None}})
    assert both.startswith('<h2>Test split</h2><p id="test">stage s2,')
    assert both.endswith('<th>max |diff|</th></tr></table>')
    assert html in _page([_finished("s1")], export=ex)


# ------------------------------------------------------------------ collect: a stage's row

TWO = [{"name": "s1", "epochs": 1, "batch_size": 32, "lr": 0.05},
       {"name": "s2", "epochs": 1, "batch_size": 32, "lr": 0.01, "init_from": "previous"}]
NONE = {"final_checkpoint": None, "final_sha256": None, "final_bytes": None,
        "best_checkpoint": None, "best_sha256": None, "best_bytes": None}


def _cfg(tmp_path: Path, **top):
    return from_dict(tiny_config(tmp_path, stages=TWO, **top))


def _finish(cfg, stage: str, final: bytes | None = b"weights", best: bytes | None = None,
            **summary) -> Path:
    """A finished stage's files as the trainer leaves them: final.pt (and best.pt) and a
    summary that records what it was made from and final.pt's SHA-256."""
    folder = cfg.stage_dir(stage)
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in (("final.pt", final), ("best.pt", best)):
        if data is not None:
            (folder / name).write_bytes(data)
    write_summary(folder / "summary.json", {
        "finished": True, "steps": 4, "wall_time_s": 1.0, "world_size": 2,
        "record": provenance.expected_record(cfg, stage),
        "final_sha256": sha256_of(folder / "final.pt") if final is not None else None,
        **summary})
    return folder


def _sums(folder: Path, kind: str, data: bytes) -> dict:
    p = folder / f"{kind}.pt"
    return {f"{kind}_checkpoint": str(p), f"{kind}_sha256": sha256_of(p),
            f"{kind}_bytes": len(data)}


def test_a_stage_not_started_or_not_finished_says_what_is_missing(tmp_path):
    cfg = _cfg(tmp_path)
    assert collect.stage_row(cfg, "s1") == ({
        "stage": "s1", "finished": False, "steps": 0, **NONE,
        "note": "not started: no stage folder"}, [])
    folder = cfg.stage_dir("s1")
    folder.mkdir(parents=True)
    (folder / "best.pt").write_bytes(b"best!")
    (folder / "metrics.jsonl").write_text(
        '{"kind": "train", "step": 3}\n{"kind": "val", "step": 7}\n{"kind": "note"}\n'
        '{"kind": "train", "st\n{"kind": "train", "step": 5}\n')
    row, records = collect.stage_row(cfg, "s1")
    assert records == [{"kind": "train", "step": 3}, {"kind": "val", "step": 7},
                       {"kind": "note"}, {"kind": "train", "step": 5}]
    assert row == {"stage": "s1", "finished": False, "steps": 7, **NONE,
                   **_sums(folder, "best", b"best!"),
                   "note": "metrics.jsonl line 4 is truncated or malformed; not finished: no "
                           "summary.json"}
    (folder / "summary.json").write_text('{"finished": true, "steps": "four"}')
    row, _ = collect.stage_row(cfg, "s1")
    assert row["finished"] is False and row["note"].startswith(
        f"metrics.jsonl line 4 is truncated or malformed; not finished: {folder / 'summary.json'}"
        f" (stage summary)")
    assert row["note"].endswith("delete it and run the stage again (it is written by the "
                                "stage's last step)")


def test_a_finished_stage_row_holds_its_figures_memory_and_checkpoints(tmp_path):
    cfg = _cfg(tmp_path)
    folder = _finish(
        cfg, "s1", best=b"best!", monitor="val_acc", best_value=0.75, epochs=1,
        precision="fp32", mean_samples_per_s=300.0, unknown_key=1,
        final_metrics={"val_acc": 0.5, "val_loss": 1.25, "val_recall": [0.5, None]},
        best_metrics={"val_acc": 0.75}, test_metrics={"test_acc": 0.625},
        wall={"split_s": {"startup": 2.0, "train": 5.5}},
        memory_per_rank=[{"params_mib": 1.0, "grads_mib": 4.0, "peak_mib": None},
                         {"params_mib": 3.0, "grads_mib": 2.0}],
        early_stop={"step": 12, "reason": "val_acc reached 0.9"})
    (folder / "profile").mkdir()
    for rank in (1, 0):
        (folder / "profile" / f"trace-rank{rank}.json").write_text("{}")
    row, records = collect.stage_row(cfg, "s1")
    assert records == []
    assert row == {
        "stage": "s1", "finished": True, "steps": 4, "wall_time_s": 1.0, "world_size": 2,
        "monitor": "val_acc", "best_value": 0.75, "epochs": 1, "precision": "fp32",
        "mean_samples_per_s": 300.0, "samples_per_s_per_rank": 150.0,
        "final_val_acc": 0.5, "final_val_loss": 1.25, "final_val_recall": [0.5, None],
        "best_val_acc": 0.75, "test_acc": 0.625, "startup_s": 2.0, "train_s": 5.5,
        "mem_params_mib": 3.0, "mem_grads_mib": 4.0, "mem_optimizer_mib": None,
        "mem_activations_mib": None, "mem_activations_without_checkpointing_mib": None,
        "mem_peak_mib": None, "early_stop": "step 12: val_acc reached 0.9",
        **_sums(folder, "final", b"weights"), **_sums(folder, "best", b"best!"),
        "profile_trace": f"{folder / 'profile' / 'trace-rank0.json'}, "
                         f"{folder / 'profile' / 'trace-rank1.json'}",
        "note": ""}


def test_a_stale_stage_is_shown_with_its_reason_never_as_finished(tmp_path):
    cfg = _cfg(tmp_path)
    folder = _finish(cfg, "s1")
    (folder / "final.pt").write_bytes(b"other weights")
    row, _ = collect.stage_row(cfg, "s1")
    assert row["finished"] is False and row["stale"] == \
        "stale: final.pt was replaced after the stage finished"
    assert row["note"] == ("stale: final.pt was replaced after the stage finished; run the "
                           "stage (or the workflow) again; best.pt is missing")
    assert "samples_per_s_per_rank" not in row and "early_stop" not in row
    (folder / "final.pt").unlink()
    row, _ = collect.stage_row(cfg, "s1")
    assert row["note"] == ("stale: final.pt is missing; run the stage (or the workflow) again; "
                           "final.pt is missing; best.pt is missing")


# ------------------------------------------------------------------ collect: checkpoints

def test_the_checkpoints_are_gathered_under_their_stage_with_an_index(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path)
    one = _finish(cfg, "s1", best=b"best!", monitor="val_loss", best_value=0.25,
                  final_metrics={"val_loss": 0.5})
    _finish(cfg, "s2", final=b"two", best=None)
    rows = [collect.stage_row(cfg, s)[0] for s in ("s1", "s2")]
    out = tmp_path / "gathered"
    out.mkdir()
    (out / "s1-final.pt").write_bytes(b"an older collect's")
    index = collect.gather_checkpoints(rows, out)
    assert index == [
        {"stage": "s1", "kind": "final", "file": "s1-final.pt", "source": str(one / "final.pt"),
         "sha256": sha256_of(one / "final.pt"), "bytes": 7, "stored_as": "hard link",
         "monitor": "val_loss", "value": 0.5},
        {"stage": "s1", "kind": "best", "file": "s1-best.pt", "source": str(one / "best.pt"),
         "sha256": sha256_of(one / "best.pt"), "bytes": 5, "stored_as": "hard link",
         "monitor": "val_loss", "value": 0.25},
        {"stage": "s2", "kind": "final", "file": "s2-final.pt",
         "source": str(cfg.stage_dir("s2") / "final.pt"), "sha256": sha256_of(
             cfg.stage_dir("s2") / "final.pt"), "bytes": 3, "stored_as": "hard link",
         "monitor": None, "value": None}]
    assert json.loads((out / "index.json").read_text()) == {"checkpoints": index}
    assert (out / "s1-final.pt").samefile(one / "final.pt")
    assert sorted(p.name for p in out.iterdir()) == ["index.json", "s1-best.pt", "s1-final.pt",
                                                     "s2-final.pt"]

    def no_links(src, dst):  # another filesystem: no hard link across it
        raise OSError(18, "Invalid cross-device link")
    monkeypatch.setattr(collect.os, "link", no_links)
    index = collect.gather_checkpoints(rows[:1], tmp_path / "copies" / "checkpoints")
    copy = tmp_path / "copies" / "checkpoints" / "s1-best.pt"
    assert [i["stored_as"] for i in index] == ["copy", "copy"]
    assert copy.read_bytes() == b"best!" and not copy.samefile(one / "best.pt")


# ------------------------------------------------------------------ collect: the manifest

def test_the_manifest_holds_what_reproduces_the_run(tmp_path):
    cfg = _cfg(tmp_path)
    env1 = {"torch": "2.5", "cuda": "12.4", "cudnn": 9, "nccl": "2.21", "gpus": ["H100"],
            "driver": "550", "python": "3.12", "host": "n1"}
    _finish(cfg, "s1", environment=None, container={"image": "x"}, config_hash="h1")
    _finish(cfg, "s2", environment=env1, config_hash="h2")
    (cfg.stage_dir("s2") / "command.json").write_text('{"argv": ["ddpflow", "launch"]}')
    (cfg.stage_dir("s1") / "command.json").write_text('["not an object"]')
    (cfg.run_dir / "image.json").write_text('{"image": "ddpflow:latest"}')
    repo = tmp_path / "repo"
    repo.mkdir()
    man = collect.manifest(cfg, repo)
    assert man == {
        "run": "t", "config_hash": cfg.hash, "seed": 0, "deterministic": False,
        "ddpflow_version": ddpflow.__version__, "git_revision": "unknown", **env1,
        "image": {"image": "ddpflow:latest"},
        "workflow_commands": ["snakemake --cores all  (or --profile profiles/slurm)",
                              "ddpflow launch --config <config> --stage s1",
                              "ddpflow launch --config <config> --stage s2"],
        "stages": {"s1": {"command": None, "environment": None, "container": {"image": "x"},
                          "config_hash": "h1"},
                   "s2": {"command": {"argv": ["ddpflow", "launch"]}, "environment": env1,
                          "container": None, "config_hash": "h2"}},
        "config": cfg.to_dict()}
    # the first stage's environment where two differ; a damaged summary: nothing of it
    _finish(cfg, "s1", environment={**env1, "torch": "2.4"})
    assert collect.manifest(cfg, repo)["torch"] == "2.4"
    (cfg.stage_dir("s1") / "summary.json").write_text("{")
    assert collect.manifest(cfg, repo)["stages"]["s1"] == {
        "command": None, "environment": None, "container": None, "config_hash": None}


# ------------------------------------------------------------------ collect: the whole run

def _git_repo(path: Path) -> str:
    path.mkdir()
    git = ["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "c"], check=True)
    return subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()


def _train(step: int, t: float) -> dict:
    return {"kind": "train", "step": step, "time_s": t, "loss": 1.0 / step,
            "samples_per_s": 100.0, "data_wait_fraction": 0.1,
            "step_time_s_per_rank": [0.01, 0.02]}


def test_collect_writes_every_output_of_a_run(tmp_path):
    cfg = _cfg(tmp_path)
    one = _finish(cfg, "s1", monitor="val_acc", best_value=0.75, precision="fp32",
                  mean_samples_per_s=300.0, final_metrics={"val_acc": 0.5, "val_top5": 0.9,
                                                           "val_recall": [0.25, 1.0]})
    (one / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        _train(2, 1.0), _train(4, 2.0), {"kind": "val", "step": 4, "time_s": 2.5,
                                         "val_acc": 0.5}]))
    evaluated = cfg.run_dir / "evaluate" / "s2" / "test-final"
    evaluated.mkdir(parents=True)
    (evaluated / "metrics.json").write_text(json.dumps({**EVALUATION, "balanced_acc": 0.5}))
    (evaluated / "confusion.png").write_bytes(b"confusion")
    (cfg.run_dir / "export").mkdir()
    (cfg.run_dir / "export" / "model.json").write_text(json.dumps({
        "files": {"onnx": {"file": "model.onnx"}}, "checks": {}, "source": "s2",
        "check_rule": "top class", "other": 1}))
    cfg.data_dir.mkdir(parents=True)
    (cfg.data_dir / "meta.json").write_text('{"classes": ["cat", "dog"]}')
    out = cfg.run_dir / "summary"
    out.mkdir()
    (out / "stale.png").write_bytes(b"from an older collect")
    revision = _git_repo(tmp_path / "repo")

    summary = collect.collect(cfg, tmp_path / "repo")
    assert sorted(p.name for p in out.iterdir()) == [
        "checkpoints", "confusion_test.png", "headline.txt", "loss_accuracy.png",
        "manifest.json", "rank_step_time.png", "report.html", "summary.csv", "summary.json",
        "throughput.png"]
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary))
    rows = [collect.stage_row(cfg, s)[0] for s in ("s1", "s2")]
    bundle = {"folder": str(cfg.run_dir / "export"), "files": {"onnx": {"file": "model.onnx"}},
              "checks": {}, "source": "s2", "check_rule": "top class"}
    assert summary == {
        "run": "t", "config_hash": cfg.hash, "finished": False, "stages": rows,
        "checkpoints": json.loads((out / "checkpoints" / "index.json").read_text())[
            "checkpoints"],
        "figures": ["confusion_test", "loss_accuracy", "rank_step_time", "throughput"],
        "evaluation": {**EVALUATION, "balanced_acc": 0.5}, "export": bundle,
        "config": cfg.to_dict()}
    assert [c["file"] for c in summary["checkpoints"]] == ["s1-final.pt"]
    assert (out / "confusion_test.png").read_bytes() == b"confusion"
    assert json.loads((out / "manifest.json").read_text())["git_revision"] == revision
    csv = (out / "summary.csv").read_text().splitlines()
    assert csv[0] == ",".join(collect.COLUMNS + ["final_val_top5"])
    assert csv[1].startswith("s1,True,,4,val_acc,0.75,0.5,,")
    assert csv[2].startswith("s2,False,,0,") and len(csv) == 3
    assert (out / "headline.txt").read_text() == collect.headline(
        cfg, rows, summary["evaluation"], ["cat", "dog"])
    html = (out / "report.html").read_text()
    assert "<tr><td>dog</td><td>1.0000</td></tr>" in html and 'id="export"' in html
    assert html.count("<img ") == 4


def test_collect_without_a_results_folder_says_where_it_looked(tmp_path):
    cfg = _cfg(tmp_path)
    message = (f"no readable results folder at {cfg.run_dir}: check results_dir and run in the "
               f"config, or run the workflow first")
    with pytest.raises(UserError) as e:
        collect.collect(cfg, tmp_path)
    assert str(e.value) == message
    cfg.run_dir.parent.mkdir(parents=True)
    cfg.run_dir.write_text("")
    cfg.run_dir.chmod(0o755)  # a file, even one anyone may read and run
    with pytest.raises(UserError) as e:
        collect.collect(cfg, tmp_path)
    assert str(e.value) == message


def test_a_collect_stopped_part_way_leaves_no_part_of_its_outputs(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path)
    _finish(cfg, "s1", precision="fp32", mean_samples_per_s=None)
    write = collect.write_text_atomic

    def full_disk(path, text, *a):
        if Path(path).name == "headline.txt":
            raise OSError(28, "No space left on device")
        write(path, text, *a)
    monkeypatch.setattr(collect, "write_text_atomic", full_disk)
    with pytest.raises(OSError, match="No space left"):
        collect.collect(cfg, tmp_path)
    assert sorted(p.name for p in (cfg.run_dir / "summary").iterdir()) == ["checkpoints"]


# ------------------------------------------------------------------ collect: what it prints

def test_the_headline_has_a_line_per_stage_and_the_test_split(tmp_path):
    cfg = _cfg(tmp_path)
    done = {"stage": "s1", "finished": True, "monitor": "val_loss", "final_val_loss": 0.5,
            "best_value": 0.25, "test_loss": 0.75, "steps": 40, "wall_time_s": 61.6,
            "startup_s": 2.4, "wall_samples_per_s": 99.6, "mean_samples_per_s": 120.4,
            "world_size": 2, "precision": "bf16", "time_to_target_s": 30.5}
    plain = {"stage": "s2", "finished": True, "final_val_acc": 0.5, "best_val_acc": 0.75,
             "steps": 8, "wall_time_s": 3.0, "mean_samples_per_s": None, "world_size": 1,
             "precision": "fp32", "final_val_balanced_acc": 0.5,
             "final_val_recall": [None, 0.75, 0.25]}
    balanced = {"stage": "s5", "finished": True, "monitor": "val_balanced_acc",
                "final_val_balanced_acc": 0.5, "best_value": 0.5, "test_balanced_acc": 0.25,
                "test_acc": 0.75, "steps": 1, "wall_time_s": 1.0, "mean_samples_per_s": 1.0,
                "world_size": 1, "precision": "fp32"}
    assert collect.headline(cfg, [balanced]).endswith(
        "  s5           val_balanced_acc 0.5000 (best 0.5000), test_balanced_acc 0.2500  1 "
        "steps  1 s (0 s start-up)  0 samples/s overall, 1 in steady state on 1 rank(s), "
        "fp32\n               val balanced acc 0.5000\n")
    stale = {"stage": "s3", "finished": False, "stale": "stale: x", "note": "stale: x; run"}
    todo = {"stage": "s4", "finished": False, "note": "not started: no stage folder"}
    ev = {**EVALUATION, "weights": {"holds": "ema", "file": "/r/s2/best.pt"}}
    text = collect.headline(cfg, [done, plain, stale, todo], ev, ["cat", "dog", "eel"])
    assert text == (
        f"ddpflow run 't': {cfg.run_dir / 'summary' / 'report.html'}\n"
        "  s1           val_loss 0.5000 (best 0.2500), test_loss 0.7500  40 steps  62 s (2 s "
        "start-up)  100 samples/s overall, 120 in steady state on 2 rank(s), bf16  (target "
        "reached after 30 s)\n"
        "  s2           val_acc 0.5000 (best 0.7500)  8 steps  3 s (0 s start-up)  0 samples/s "
        "overall, 0 in steady state on 1 rank(s), fp32\n"
        "               val balanced acc 0.5000, lowest class recall 0.2500 (eel)\n"
        "  s3           STALE (stale: x; run)\n"
        "  s4           NOT FINISHED (not started: no stage folder)\n"
        "  test split   acc 0.8500, top-5 1.0000 on 20 held-out images: `ddpflow evaluate` of "
        "s2's best.pt (ema weights) in fp32\n")
    ev = {**EVALUATION, "balanced_acc": 0.625, "weights": {"holds": "final", "file": None}}
    assert collect.headline(cfg, [], ev).endswith(
        "'t': " + str(cfg.run_dir / "summary" / "report.html") + "\n  test split   acc "
        "0.8500, top-5 1.0000, balanced acc 0.6250 on 20 held-out images: `ddpflow evaluate` "
        "of s2's final.pt (final weights) in fp32\n")
    assert collect.headline(cfg, [], {"samples": 0, "note": "no test split"}).count("\n") == 1
    assert collect.headline(cfg, [plain]).endswith("lowest class recall 0.2500 (class 2)\n")


def test_imbalance_is_the_balanced_accuracy_and_the_lowest_class():
    row = {"final_val_balanced_acc": 0.5, "final_val_recall": [0.75, None, 0.25, 0.25]}
    assert collect.imbalance_text(row, ["a", "b", "c"]) == \
        "balanced acc 0.5000, lowest class recall 0.2500 (c)"
    assert collect.imbalance_text(row, ["a", "b"]) == \
        "balanced acc 0.5000, lowest class recall 0.2500 (class 2)"
    assert collect.imbalance_text({"final_val_balanced_acc": 0.0, "final_val_recall": [None]},
                                  None) == "balanced acc 0.0000"
    assert collect.imbalance_text({"final_val_recall": [0.5]}, None) is None


def test_the_runs_figures_for_mlflow_are_the_last_stages_and_the_test_split():
    first = {"stage": "s1", "final_val_acc": 0.1}
    last = {"stage": "s2", "finished": True, "final_val_acc": 0.5, "best_val_loss": 2,
            "test_acc": 0.25, "final_val_recall": [0.5], "test_flag": True, "steps": 3,
            "final_val_note": "x"}
    assert collect.headline_metrics([first, last], {"acc": 0.75}) == {
        "final_val_acc": 0.5, "best_val_loss": 2, "test_acc": 0.25, "test_split_acc": 0.75}
    assert collect.headline_metrics([], {"acc": None}) == {}
    assert collect.headline_metrics([last], None) == {
        "final_val_acc": 0.5, "best_val_loss": 2, "test_acc": 0.25}


def test_the_monitored_metric_is_the_recorded_one_then_the_configs(tmp_path):
    cfg = _cfg(tmp_path)
    assert collect.monitored(cfg, [{"monitor": None}, {"monitor": "val_top5"},
                                   {"monitor": "val_loss"}]) == "val_top5"
    assert collect.monitored(cfg, [{}]) == "val_acc"
    assert collect.monitored(_cfg(tmp_path, task={"monitor": "val_loss"}), []) == "val_loss"
    regression = _cfg(tmp_path, task={"name": "regression"})
    assert collect.monitored(regression, []) == "val_loss"


def test_held_out_results_are_the_last_stages_evaluation_and_the_export(tmp_path):
    cfg = _cfg(tmp_path)
    figures = {}
    assert collect.held_out_results(cfg, tmp_path, figures) == (None, None, [])
    first = cfg.run_dir / "evaluate" / "s1" / "test-final"  # not the last stage: not shown
    first.mkdir(parents=True)
    (first / "metrics.json").write_text('{"acc": 1}')
    folder = cfg.run_dir / "evaluate" / "s2" / "test-final"
    folder.mkdir(parents=True)
    (folder / "confusion.png").write_bytes(b"png")
    (folder / "metrics.json").write_text("{")  # damaged: the report goes on without it
    assert collect.held_out_results(cfg, tmp_path, figures) == (None, None, [folder])
    assert figures == {} and not (tmp_path / "confusion_test.png").exists()
    (folder / "metrics.json").write_text('{"acc": 0.5}')
    (folder / "confusion.png").unlink()
    assert collect.held_out_results(cfg, tmp_path, figures) == ({"acc": 0.5}, None, [folder])
    assert figures == {}


def test_collect_logs_the_report_to_the_runs_mlflow_run(tmp_path, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)  # where MLflow puts the artifacts of a sqlite store
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = _cfg(tmp_path, tracking={"mlflow": {"uri": uri}})
    cfg.run_dir.mkdir(parents=True)
    collect.collect(cfg, tmp_path)
    said = capsys.readouterr().err
    assert said.endswith(f" at {uri}\n")
    run = said.split("ddpflow: MLflow: logged to run ")[1].split()[0]
    logged = sorted(a.path for a in MlflowClient(uri).list_artifacts(run))
    assert logged == ["headline.txt", "manifest.json", "report.html", "summary.csv",
                      "summary.json"]
