"""Two surfaces met class by class (docs/RELIABILITY.md, docs/.../hardening):

- the recipe keys and the stage list of a config: each bad value is one
  `invalid config: <key>: ...` message from `from_dict` (function level, nothing written);
- the arguments of evaluate, export and predict: each bad one is the right result or one
  message with exit 2, no traceback and nothing written, run through the CLI's own `main`
  against ONE tiny trained and exported stage (1 rank, 2 steps, 8 px images).
"""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

import pytest
import torch

from conftest import ddpflow, tiny_config, write_config
from ddpflow import cli
from ddpflow.config import from_dict
from ddpflow.core.errors import UserError
from fixtures import image_tree


# --------------------------------------------------------------------------- recipe and stages
def _stage(**kw) -> dict:
    return {"name": "a", "epochs": 4, **kw}


def _pr(start, end) -> dict:
    return {"progressive_resize": {"start_size": start, "end_size": end}}


CONFIG_ROWS = [
    # class, stages (data.image_size 16), the key the message names, words it holds
    ("progressive_resize ends below data.image_size", [_stage(**_pr(8, 12))],
     "stages.0.progressive_resize.end_size", ["12 is not data.image_size 16", "end_size: 16"]),
    ("progressive_resize ends beyond data.image_size", [_stage(**_pr(8, 32))],
     "stages.0.progressive_resize.end_size", ["32 is not data.image_size 16"]),
    ("progressive_resize that shrinks", [_stage(**_pr(24, 16))],
     "stages.0.progressive_resize.start_size", ["larger than end_size 16", "start_size <= 16"]),
    ("progressive_resize starting at 0", [_stage(**_pr(0, 16))],
     "stages.0.progressive_resize.start_size", ["0 is less than the minimum of 4"]),
    ("progressive_resize over 1 epoch never grows", [_stage(epochs=1, **_pr(8, 16))],
     "stages.0.progressive_resize", ["1 epoch", "epochs >= 2"]),
    ("random_erasing above 1", [_stage(random_erasing=1.5)], "stages.0.random_erasing",
     ["greater than the maximum of 1"]),
    ("random_erasing below 0", [_stage(random_erasing=-0.1)], "stages.0.random_erasing",
     ["less than the minimum of 0"]),
    ("mixup_alpha negative", [_stage(mixup_alpha=-1)], "stages.0.mixup_alpha",
     ["less than the minimum of 0"]),
    ("cutmix_alpha negative", [_stage(cutmix_alpha=-0.5)], "stages.0.cutmix_alpha",
     ["less than the minimum of 0"]),
    ("label_smoothing 1 (uniform targets, nothing learnt)", [_stage(label_smoothing=1)],
     "stages.0.label_smoothing", ["greater than or equal to the maximum of 1"]),
    ("ema.decay 1 (the average never moves)", [_stage(ema={"decay": 1})],
     "stages.0.ema.decay", ["maximum of 1"]),
    ("ema.decay 0", [_stage(ema={"decay": 0})], "stages.0.ema.decay", ["minimum of 0"]),
    ("stop.patience 0", [_stage(stop={"patience": 0})], "stages.0.stop.patience",
     ["minimum of 1"]),
    ("warmup_epochs beyond the stage's epochs", [_stage(epochs=2, warmup_epochs=3)],
     "stages.0.warmup_epochs", ["more than the stage's 2 epoch", "warmup_epochs <= 2"]),
    ("grad_accum_steps 0", [_stage(grad_accum_steps=0)], "stages.0.grad_accum_steps",
     ["minimum of 1"]),
    ("max_steps 0", [_stage(max_steps=0)], "stages.0.max_steps", ["minimum of 1"]),
    ("validate_every_epochs 0", [_stage(validate_every_epochs=0)],
     "stages.0.validate_every_epochs", ["minimum of 1"]),
    ("empty stage list", [], "stages", ["is empty", "at least 1"]),
    ("duplicate stage names", [_stage(), _stage()], "stages", ["unique", "repeated: a"]),
    ("names equal after case-folding (one folder on macOS)", [_stage(), _stage(name="A")],
     "stages", ["'a' and 'A' differ only in case", "rename one"]),
    ("a name with /", [_stage(name="a/b")], "stages.0.name", ["not a valid name"]),
    ("a name '..'", [_stage(name="..")], "stages.0.name", ["not a valid name"]),
    ("a name with a space", [_stage(name="a b")], "stages.0.name", ["not a valid name"]),
    ("a name with a leading -", [_stage(name="-a")], "stages.0.name", ["not a valid name"]),
    ("init_from naming the stage itself", [_stage(), _stage(name="b", init_from="b")],
     "stages.1.init_from", ["this very stage", "use previous"]),
    ("init_from naming a later stage", [_stage(init_from="b"), _stage(name="b")],
     "stages.0.init_from", ["runs after this one", "move it before"]),
    ("init_from naming the stage just before", [_stage(), _stage(name="b", init_from="a")],
     "stages.1.init_from", ["write init_from: previous"]),
    ("init_from: Previous (another case, read as a file)",
     [_stage(), _stage(name="b", init_from="Previous")], "stages.1.init_from",
     ["'Previous' is read as a file name", "write previous"]),
    ("init_from: previous on the first stage", [_stage(init_from="previous")],
     "stages.0.init_from", ["first stage has no previous"]),
]


@pytest.mark.parametrize("what, stages, key, words", CONFIG_ROWS,
                         ids=[r[0] for r in CONFIG_ROWS])
def test_a_bad_recipe_or_stage_list_is_one_message(tmp_path, what, stages, key, words):
    raw = tiny_config(tmp_path, stages=stages)
    with pytest.raises(UserError) as e:
        from_dict(raw)
    text = str(e.value)
    assert text.startswith(f"invalid config: {key}"), text
    assert all(w in text for w in words), text
    assert "\n" not in text and not list(tmp_path.iterdir())  # one line; nothing written


ACCEPTED_ROWS = [
    # class, stages: the right result is a config
    ("validate_every_epochs beyond epochs (the last epoch is always validated)",
     [_stage(epochs=2, validate_every_epochs=5)]),
    ("warm-up over the whole stage", [_stage(epochs=2, warmup_epochs=2)]),
    ("progressive_resize that grows to data.image_size", [_stage(**_pr(8, 16))]),
    ("progressive_resize at one size over 1 epoch", [_stage(epochs=1, **_pr(16, 16))]),
    ("init_from a file named like an earlier stage (./a)",
     [_stage(), _stage(name="b"), _stage(name="c", init_from="./a")]),
    ("names that differ in more than case", [_stage(name="a.1"), _stage(name="a_1")]),
]


@pytest.mark.parametrize("what, stages", ACCEPTED_ROWS, ids=[r[0] for r in ACCEPTED_ROWS])
def test_unusual_but_meaningful_recipes_are_configs(tmp_path, what, stages):
    cfg = from_dict(tiny_config(tmp_path, stages=stages))
    assert [s.name for s in cfg.stages] == [s["name"] for s in stages]


# --------------------------------------------------------------------- evaluate, export, predict
@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    """A finished 1-rank stage of 2 steps on a 3-class folder of 8 px images, without a test
    split (data.test_fraction 0), and its export bundle."""
    tmp = tmp_path_factory.mktemp("hc")
    image_tree(tmp / "imgs", per_class=6, size=(12, 10))
    raw = tiny_config(tmp, hardware={"nproc_per_node": 1, "threads_per_rank": 1},
                      stages=[{"name": "s1", "max_steps": 2, "batch_size": 4, "lr": 0.05}])
    raw["data"] = {"source": "imagefolder", "path": str(tmp / "imgs"), "image_size": 8,
                   "train_size": None, "val_size": None, "val_fraction": 0.25,
                   "test_fraction": 0}
    p = write_config(tmp, raw)
    for cmd in (["prepare"], ["launch", "--stage", "s1"], ["export"]):
        assert cli.main([cmd[0], "--config", str(p), *cmd[1:]]) == 0
    image_tree(tmp / "photos", per_class=2, size=(15, 11), seed=1)
    image_tree(tmp / "splits" / "train", per_class=1, seed=2)
    image_tree(tmp / "splits" / "test", per_class=1, seed=3)
    image_tree(tmp / "other", classes=("cat", "owl"), per_class=1, seed=4)
    (tmp / "empty").mkdir()
    (tmp / "notes.txt").write_text("not an image\n")
    return tmp, p, tmp / "results/t/export"


def _tree(root: Path) -> dict:
    return {str(f.relative_to(root)): f.stat().st_mtime_ns for f in root.rglob("*")}


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible here")
EVAL, PRED = "evaluate", "predict"
CLI_ROWS = [
    # class, argv ({c}: config, {t}: the stage's folder, {b}: bundle), exit, words (!: absent)
    ("evaluate --stage unknown", [EVAL, "-c", "{c}", "--stage", "nope"], 2,
     ["no stage named 'nope'", "stages are: s1"]),
    ("export --stage unknown", ["export", "-c", "{c}", "--stage", "nope", "--out", "{t}/x"], 2,
     ["no stage named 'nope'"]),
    ("--weights a name that is not final/best/ema/raw", [EVAL, "-c", "{c}", "--weights", "last"],
     2, ["invalid choice: 'last'", "'final', 'best', 'ema', 'raw'"]),
    ("--weights a path (missing)", [EVAL, "-c", "{c}", "--weights", "{t}/gone.pt"], 2,
     ["invalid choice", "'final', 'best'"]),
    ("--weights a path (a folder)", [EVAL, "-c", "{c}", "--weights", "{t}/imgs"], 2,
     ["invalid choice"]),
    ("--weights ema of a stage without one", [EVAL, "-c", "{c}", "--weights", "ema",
                                              "--split", "val"], 2, ["kept no EMA"]),
    ("--split the data does not have", [EVAL, "-c", "{c}", "--split", "test"], 2,
     ["--split test: the prepared data has no test split", "data.test_fraction 0",
      "--split val", "--allow-empty"]),
    ("--split the data does not have, --allow-empty", [EVAL, "-c", "{c}", "--split", "test",
                                                       "--allow-empty"], 0,
     ["no test split to evaluate"]),
    ("--images missing", [EVAL, "-c", "{c}", "--images", "{t}/gone"], 2,
     ["--images", "does not exist"]),
    ("--images an empty folder", [EVAL, "-c", "{c}", "--images", "{t}/empty"], 2,
     ["has no class folders"]),
    ("--images a file that is not an image", [EVAL, "-c", "{c}", "--images", "{t}/notes.txt"],
     2, ["--images", "is a file, not a folder"]),
    ("--images a folder of split folders", [EVAL, "-c", "{c}", "--images", "{t}/splits"], 2,
     ["holds split folders (test, train)", "--images {t}/splits/test"]),
    ("--images a class the model does not know", [EVAL, "-c", "{c}", "--images", "{t}/other"],
     2, ["class folder(s) the model does not know: owl", "cat, dog, fish"]),
    ("evaluate --out under a file", [EVAL, "-c", "{c}", "--split", "val", "--out",
                                     "{t}/notes.txt/ev"], 2, ["notes.txt"]),
    ("export --out whose parent is missing: made", ["export", "-c", "{c}", "--out",
                                                    "{t}/new/deep/bundle"], 0,
     ["exported stage 's1'", "{t}/new/deep/bundle"]),
    ("export --out under a file", ["export", "-c", "{c}", "--out", "{t}/notes.txt/b"], 2,
     ["notes.txt"]),
    ("predict --top-k 0", [PRED, "--bundle", "{b}", "--top-k", "0", "--out", "{t}/p.csv",
                           "{t}/photos"], 2, ["--top-k 0", "1 or more"]),
    ("predict --top-k negative", [PRED, "--bundle", "{b}", "--top-k", "-3", "--out",
                                  "{t}/p.csv", "{t}/photos"], 2, ["--top-k -3"]),
    ("predict --top-k beyond the classes: clamped, with a note",
     [PRED, "--bundle", "{b}", "--top-k", "50", "--out", "{t}/k/p.csv", "{t}/photos"], 0,
     ["--top-k 50 is more than the model's 3 classes; writing 3"]),
    ("predict an empty folder", [PRED, "--bundle", "{b}", "--out", "{t}/p.csv", "{t}/empty"],
     2, ["no image files"]),
    ("predict a file that is not an image: listed with its reason",
     [PRED, "--bundle", "{b}", "--out", "{t}/n/p.csv", "{t}/notes.txt", "{t}/photos"], 0,
     ["1 unreadable", "!note"]),  # the default top-k (5) on 3 classes: all 3, no note
    pytest.param("predict --device cuda without CUDA",
                 [PRED, "--bundle", "{b}", "--device", "cuda", "--out", "{t}/p.csv",
                  "{t}/photos"], 2, ["--device cuda: no CUDA GPU", "--device cpu"],
                 marks=NO_CUDA),
    ("predict --device a name torch does not have",
     [PRED, "--bundle", "{b}", "--device", "tpu", "--out", "{t}/p.csv", "{t}/photos"], 2,
     ["--device tpu: use auto, cpu or cuda"]),
    ("predict --out whose parent is missing: made",
     [PRED, "--bundle", "{b}", "--out", "{t}/new/dir/p.csv", "{t}/photos"], 0,
     ["6 image(s) predicted"]),
    ("predict --out under a file", [PRED, "--bundle", "{b}", "--out", "{t}/notes.txt/p.csv",
                                    "{t}/photos"], 2, ["notes.txt is a file, not a folder"]),
]


def _main(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except SystemExit as e:  # argparse's refusals
        return int(e.code)


def _row_id(row) -> str:
    return row.values[0] if hasattr(row, "values") else row[0]


@pytest.mark.parametrize("what, argv, code, words", CLI_ROWS, ids=map(_row_id, CLI_ROWS))
def test_inference_arguments_are_the_result_or_one_message(stage, capsys, what, argv, code,
                                                            words):
    tmp, p, bundle = stage
    argv = [a.format(c=p, t=tmp, b=bundle) for a in argv]
    before = _tree(tmp)
    capsys.readouterr()
    rc = _main(argv)
    out, err = capsys.readouterr()
    text = out + err
    assert rc == code, text
    assert all(w.format(t=tmp) in text for w in words if not w.startswith("!")), text
    assert not any(w[1:] in text for w in words if w.startswith("!")), text
    assert "Traceback" not in text
    if code:
        assert _tree(tmp) == before, "a refused command wrote or changed files"
        assert len([ln for ln in err.splitlines() if "error" in ln]) == 1, err


def test_clamped_top_k_and_unreadable_files_in_the_csv(stage):
    tmp, _, bundle = stage
    out = tmp / "k2" / "p.csv"
    assert _main([PRED, "--bundle", str(bundle), "--top-k", "9", "--out", str(out),
                  str(tmp / "notes.txt"), str(tmp / "photos")]) == 0
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 7 and "class_3" in rows[0] and "class_4" not in rows[0]
    assert rows[0]["path"].endswith("notes.txt") and rows[0]["error"] and not rows[0]["class"]


def test_onnx_without_onnxruntime_is_one_message(stage, monkeypatch, capsys):
    tmp, _, bundle = stage
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # `import onnxruntime` fails
    out = tmp / "onnx.csv"
    rc = _main([PRED, "--bundle", str(bundle), "--format", "onnx", "--out", str(out),
                str(tmp / "photos")])
    err = capsys.readouterr().err
    assert rc == 2 and "--format onnx needs onnxruntime: pip install onnxruntime" in err
    assert not out.exists()


def test_split_folders_through_the_real_command(stage):
    """The real entry point: exit 2, one line, no traceback, no evaluate folder."""
    tmp, p, _ = stage
    before = _tree(tmp)
    proc = ddpflow(EVAL, "--config", p, "--images", tmp / "splits")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"ddpflow: error: --images {tmp / 'splits'} holds split folders (test, train), not "
        f"class folders: give one split's folder, e.g. --images {tmp / 'splits' / 'test'}"]
    assert _tree(tmp) == before


@pytest.mark.parametrize("kind, words", [
    ("full", "not enough free space for the export bundle at {out}: about"),
    ("ro", "cannot write the export bundle at {out}: the file system is read-only"),
])
def test_export_onto_a_full_or_read_only_place_is_one_message(stage, tmp_path, kind, words):
    """`ddpflow export --out` onto a full file system aborted with SIGABRT inside
    TorchScript's writer and left a partial folder. A real 256 KiB tmpfs (read-only: remounted
    so): exit 2, one line naming --out, nothing left there."""
    import subprocess

    _, p, _ = stage
    d = tmp_path / "mnt"
    d.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(d)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        if kind == "ro":
            subprocess.run(["mount", "-o", "remount,ro", str(d)], check=True)
        out = d / "bundle"
        proc = ddpflow("export", "--config", p, "--out", out)
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
        assert [ln for ln in lines if "error" in ln] == lines[-1:], proc.stderr[-2000:]
        assert lines[-1].startswith("ddpflow: error: " + words.format(out=out)), lines[-1]
        assert "Traceback" not in proc.stderr
        assert [f for f in os.listdir(d) if not f.endswith(".lock")] == []
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)
