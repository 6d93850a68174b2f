"""inference/common.py, predict.py and export.py, edge by edge: which weights a finished
stage hands to evaluate, export and predict (the file, the entry, the record that names
them) and each refusal's words; image files found and decoded as given; the classification
figures of known outputs (top-1, top-5, loss, per-class precision, recall and F1, the
confusion matrix); predict's CSV (classes and probabilities of the model, --top-k, the
bundle's crop rule, unreadable files, its claims on --out) and its refusals of a bundle;
export's check of each format against the model (the tolerance at its bound, a format that
fails, a trace that keeps its batch size) and the bundle it writes. Fast: the stages here
are written as a finished stage writes them (final.pt, best.pt with their checksums,
summary.json with its record), on real prepared data, without training.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import tiny_config, write_config
from ddpflow import cli
from ddpflow.config import load_config
from ddpflow.core.errors import UserError
from ddpflow.data import crops, imagefolder, prepared
from ddpflow.engine import checkpoint
from ddpflow.inference import common
from ddpflow.results.provenance import expected_record
from ddpflow.results.summary import write_summary
from ddpflow.seams.contract import probe
from ddpflow.seams.models import build_model
from test_evaluate import MODEL as EVALUATE_MODEL


def _refusal(fn, *args, **kw) -> str:
    with pytest.raises(UserError) as e:
        fn(*args, **kw)
    return str(e.value)


def _weights(cfg, meta, seed: int) -> dict:
    torch.manual_seed(seed)
    model = build_model(cfg.model, meta["num_classes"], meta["image_shape"][2],
                        probe(cfg, meta))
    return {k: v.clone() for k, v in model.state_dict().items()}


def _finish(cfg, stage: str, final: dict, best: dict, ema: dict | None = None) -> None:
    """final.pt, best.pt and summary.json as a finished stage writes them (stagelog.py):
    "model" is the EMA's weights when there is one, the trained ones then "model_raw"."""
    out = cfg.stage_dir(stage)
    record = expected_record(cfg, stage)

    def handed(sd, avg):
        return {"model": sd, "weights": "raw"} if avg is None else \
            {"model": avg, "weights": "ema", "model_raw": sd}

    sha = checkpoint.save_file(out / "final.pt", {**handed(final, ema), "step": 12,
                                                  "record": record})
    checkpoint.save_file(out / "best.pt", {**handed(best, None if ema is None else best),
                                           "step": 8, "record": record})
    write_summary(out / "summary.json", {"finished": True, "steps": 12, "wall_time_s": 1.0,
                                         "world_size": 1, "final_sha256": sha,
                                         "record": record})


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Prepared synthetic data (3 classes, 16 px) and two finished stages: s1 without an
    EMA, s2 (from s1's weights) with one; each weight set its own draw."""
    tmp = tmp_path_factory.mktemp("inf")
    raw = tiny_config(tmp, data={"train_size": 48, "val_size": 24, "test_size": 24,
                                 "num_classes": 3},
                      hardware={"nproc_per_node": 1, "threads_per_rank": 1},
                      stages=[{"name": "s1", "epochs": 1, "batch_size": 16, "lr": 0.05},
                              {"name": "s2", "epochs": 1, "batch_size": 16, "lr": 0.05,
                               "ema": {"decay": 0.9, "every_steps": 1}}])
    p = write_config(tmp, raw)
    assert cli.main(["prepare", "--config", str(p)]) == 0
    cfg = load_config(p)
    meta = prepared.read_meta(cfg.data_dir)
    w = {n: _weights(cfg, meta, n) for n in range(5)}
    _finish(cfg, "s1", w[0], w[1])
    _finish(cfg, "s2", w[2], w[3], ema=w[4])
    return tmp, p, cfg, meta, w


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------ a stage's weights

def test_each_weights_choice_is_its_file_and_entry_with_a_record_naming_them(made):
    _, _, cfg, _, w = made
    for stage, kind, name, want, holds, step in [
            ("s1", "final", "final.pt", w[0], "raw", 12),
            ("s1", "best", "best.pt", w[1], "raw", 8),
            ("s1", "raw", "final.pt", w[0], "raw", 12),  # no EMA: the trained ones
            ("s2", "final", "final.pt", w[4], "ema", 12),  # what s2 hands on: its EMA
            ("s2", "ema", "final.pt", w[4], "ema", 12),
            ("s2", "raw", "final.pt", w[2], "raw", 12),  # the trained ones beside the EMA
            ("s2", "best", "best.pt", w[3], "ema", 8)]:
        sd, record = common.stage_weights(cfg, stage, kind)
        path = cfg.stage_dir(stage) / name
        assert _same(sd, want), (stage, kind)
        assert record == {"stage": stage, "file": str(path),
                          "sha256": checkpoint.sha256_of(path), "weights": kind,
                          "holds": holds, "step": step}, (stage, kind)


def test_weights_of_a_stage_that_is_not_there_or_not_finished_are_one_message(made, tmp_path):
    _, p, cfg, _, _ = made
    assert _refusal(common.stage_weights, cfg, "nope") == \
        "no stage named 'nope' in the config; stages are: s1, s2"
    other = load_config(p, [f"results_dir={tmp_path / 'r'}"])
    final = other.stage_dir("s1") / "final.pt"
    assert _refusal(common.stage_weights, other, "s1") == (
        f"stage 's1' has no final.pt: {final} does not exist; run the stage first "
        f"(`ddpflow launch --stage s1` or snakemake)")
    final.mkdir(parents=True)
    assert _refusal(common.stage_weights, other, "s1", "final") == (
        f"stage 's1' has no final.pt: {final} is a folder, not a file; run the stage first "
        f"(`ddpflow launch --stage s1` or snakemake)")


def test_a_damaged_weights_file_is_named_with_what_is_wrong(made, tmp_path):
    _, p, cfg, _, _ = made
    other = load_config(p, [f"results_dir={tmp_path / 'r'}"])
    shutil.copytree(cfg.stage_dir("s1"), other.stage_dir("s1"))
    best = other.stage_dir("s1") / "best.pt"
    data = bytearray(best.read_bytes())
    data[len(data) // 2] ^= 0xFF
    best.write_bytes(bytes(data))
    assert _refusal(common.stage_weights, other, "s1", "best") == (
        f"{best} checksum mismatch (truncated or corrupt); run the stage again")


def test_ema_weights_of_a_stage_without_an_ema_are_refused(made):
    _, _, cfg, _, _ = made
    assert _refusal(common.stage_weights, cfg, "s1", "ema") == (
        "stage 's1' kept no EMA of its weights (stages[].ema.decay is null); use --weights "
        "final or best")


def test_a_stage_model_is_the_stage_weights_in_eval_mode(made):
    _, _, cfg, meta, w = made
    model, record = common.stage_model(cfg, meta, "s2", "raw")
    assert not model.training and record["holds"] == "raw"
    assert _same(model.state_dict(), w[2])
    assert next(model.parameters()).shape[1] == 3  # the data's channels


def test_a_python_dataset_without_materialize_has_no_images_to_evaluate(made):
    _, _, cfg, meta, _ = made
    assert _refusal(common.stage_model, cfg, {**meta, "kind": "python"}, "s1") == (
        "evaluate, export and predict work on prepared images; a data.source python dataset "
        "without data.materialize has none")


def test_weights_that_do_not_fit_the_model_name_the_file_and_the_tensor(made, tmp_path):
    _, p, cfg, meta, w = made
    other = load_config(p, [f"results_dir={tmp_path / 'r'}"])
    shutil.copytree(cfg.stage_dir("s1"), other.stage_dir("s1"))
    final = other.stage_dir("s1") / "final.pt"
    bad = {k: v for k, v in w[0].items()}
    last = list(bad)[-1]
    bad[last] = torch.zeros(7)
    checkpoint.save_file(final, {"model": bad, "weights": "raw", "step": 1})
    text = _refusal(common.stage_model, other, meta, "s1")
    assert text.startswith(f"{final} (final) does not fit the model: '{last}' is (7,) there"), \
        text


def test_a_stale_stage_is_used_with_a_warning_a_fresh_one_silently(made, capsys):
    _, p, cfg, _, _ = made
    common.warn_if_stale(cfg, "s1")
    assert capsys.readouterr().err == ""
    changed = load_config(p, ["stages.0.lr=0.1"])
    common.warn_if_stale(changed, "s1")
    assert capsys.readouterr().err == (
        "ddpflow: warning: stage 's1' is stale: made with another config; its weights are "
        "used as they are (run the stage again for a fresh result)\n")


# ------------------------------------------------------------------ image files

def _png(path: Path, size=(20, 14), mode="RGB", seed=0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    shape = (size[1], size[0]) + ((3,) if mode == "RGB" else ())
    Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode).save(path)
    return path


def test_image_files_are_the_files_named_and_the_images_in_folders_as_given(tmp_path,
                                                                           monkeypatch):
    monkeypatch.chdir(tmp_path)
    _png(tmp_path / "d/b/z.png")
    _png(tmp_path / "d/a.JPG")
    _png(tmp_path / "d/c.webp")
    (tmp_path / "d/notes.txt").write_text("x")
    (tmp_path / "d/folder.png").mkdir()  # a folder named like an image: not a file
    single = _png(tmp_path / "one.png")
    other = tmp_path / "readme.md"  # named: taken as given (its decode says why not)
    other.write_text("x")
    assert common.image_files(["d", str(single), "readme.md"]) == [
        "d/a.JPG", "d/b/z.png", "d/c.webp", str(single), "readme.md"]


def test_image_files_missing_or_none_are_one_message(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty/notes.txt").write_text("x")
    gone = tmp_path / "gone.png"
    assert _refusal(common.image_files, [str(tmp_path / "empty"), str(gone)]) == (
        f"{gone} does not exist (give image files or folders of them)")
    exts = ", ".join(sorted(imagefolder.EXTENSIONS))
    assert _refusal(common.image_files, [str(tmp_path / "empty")]) == (
        f"no image files ({exts}) in {tmp_path / 'empty'}")


def test_decode_keeps_the_readable_images_and_says_why_the_others_are_not(tmp_path):
    a = _png(tmp_path / "a.png", size=(30, 20))
    broken = tmp_path / "b.png"
    broken.write_bytes(b"not a png")
    c = _png(tmp_path / "c.png", size=(12, 18), mode="L", seed=1)
    x, kept, bad = common.decode([str(a), str(broken), str(c)], 8, False)
    assert x.dtype == np.uint8 and x.shape == (2, 8, 8, 3)
    assert kept == [0, 2] and list(bad) == [1] and bad[1]
    assert np.array_equal(x[0], imagefolder.decode_file((str(a), 8, False))[0])
    assert np.array_equal(x[1], imagefolder.decode_file((str(c), 8, False))[0])
    for grayscale, c in ((False, 3), (True, 1)):  # none readable: an empty batch of the shape
        x, kept, bad = common.decode([str(broken)], 8, grayscale)
        assert x.shape == (0, 8, 8, c) and x.dtype == np.uint8 and kept == [] and list(bad) == [0]


def test_preprocess_is_validation_normalize_then_the_given_crop(tmp_path):
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.integers(0, 256, (2, 20, 20, 3), dtype=np.uint8))
    mean, std = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]
    ref = (x.permute(0, 3, 1, 2).float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) \
        / torch.tensor(std).view(1, 3, 1, 1)
    crop = crops.EvalCrop(12, 14, "bicubic")
    out = common.preprocess(mean, std, 16, 3, torch.device("cpu"), crop)(x)
    assert out.shape == (2, 3, 12, 12) and out.is_contiguous()
    torch.testing.assert_close(out, crop(ref), rtol=1e-5, atol=1e-5)
    default = common.preprocess(mean, std, 16, 3, torch.device("cpu"))(x)
    torch.testing.assert_close(default, crops.EvalCrop(16)(ref), rtol=1e-5, atol=1e-5)
    gray = common.preprocess([0.5], [0.2], 16, 3, "cpu")(x[..., :1])  # 1 -> 3 channels
    assert gray.shape == (2, 3, 16, 16) and torch.equal(gray[:, 0], gray[:, 2])


# ------------------------------------------------------------------ scores

def _logits(rows: list[list[int]], num_classes: int) -> torch.Tensor:
    """Each row: the classes from the most to the least likely (the rest after them)."""
    out = torch.zeros(len(rows), num_classes)
    for i, order in enumerate(rows):
        for rank, c in enumerate(order):
            out[i, c] = 10.0 - rank
    return out


def test_scores_of_known_outputs_are_exact():
    # 7 classes; labels and the predicted order (top-1 first)
    rows = [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5], [1, 0, 2, 3, 4, 5],
            [2, 0, 1, 3, 4, 5], [3, 2, 1, 0, 4, 5], [4, 3, 2, 1, 0, 5],
            [5, 4, 3, 1, 2, 0], [6, 5, 3, 2, 1, 4]]
    labels = torch.tensor([0, 0, 0, 1, 1, 1, 2, 4])
    logits = _logits(rows, 7)
    s = common.scores(logits, labels, 7)
    assert s["samples"] == 8
    assert s["acc"] == 2 / 8
    # label 0 in rows 0-2 (1st, 1st, 2nd), 1 in rows 3-5 (3rd, 3rd, 4th), 2 in row 6 (the
    # 5th: a hit), 4 in row 7 (the 6th: not in the top 5 of 7)
    assert s["top5"] == 7 / 8
    assert s["loss"] == pytest.approx(
        torch.nn.functional.cross_entropy(logits, labels).item(), rel=1e-6)
    conf = [[0] * 7 for _ in range(7)]
    for (first, *_), y in zip(rows, labels.tolist()):
        conf[y][first] += 1
    assert s["confusion"] == conf
    pc = s["per_class"]
    assert pc["support"] == [3, 3, 1, 0, 1, 0, 0]
    assert pc["precision"] == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]  # no prediction: 0
    assert pc["recall"] == [2 / 3, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert pc["f1"] == pytest.approx([2 * (2 / 3) / (1 + 2 / 3), 0, 0, 0, 0, 0, 0])
    assert s["balanced_acc"] == pytest.approx((2 / 3) / 4)  # classes 0, 1, 2, 4 held


def test_precision_recall_and_f1_of_classes_with_one_sample_or_prediction():
    # 3 classes (fewer than 5: top-5 is all of them)
    logits = _logits([[0, 1, 2], [1, 0, 2], [1, 2, 0], [2, 0, 1]], 3)
    labels = torch.tensor([0, 1, 2, 2])
    s = common.scores(logits, labels, 3)
    assert s["top5"] == 1.0 and s["acc"] == 3 / 4
    assert s["per_class"]["precision"] == [1.0, 0.5, 1.0]
    assert s["per_class"]["recall"] == [1.0, 1.0, 0.5]
    assert s["per_class"]["f1"] == pytest.approx([1.0, 2 / 3, 2 / 3])
    assert s["balanced_acc"] == pytest.approx(2.5 / 3)
    assert s["confusion"] == [[1, 0, 0], [0, 1, 0], [0, 1, 1]]


def test_a_tally_added_batch_by_batch_gives_the_scores_of_all_at_once():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 9, generator=g)
    labels = torch.randint(0, 9, (40,), generator=g)
    tally = common.Tally(9, "cpu")
    for a in range(0, 40, 16):
        tally.add(logits[a:a + 16], labels[a:a + 16])
    whole = common.scores(logits, labels, 9)
    part = tally.scores()
    assert part["confusion"] == whole["confusion"] and part["samples"] == 40
    assert part["loss"] == pytest.approx(whole["loss"], rel=1e-6)
    assert part["top5"] == whole["top5"] and part["acc"] == whole["acc"]
    top5 = (logits.topk(5, 1).indices == labels[:, None]).any(1).float().mean().item()
    assert whole["top5"] == pytest.approx(top5)


def test_scores_of_nothing_are_none_not_a_division_by_zero():
    s = common.Tally(4, "cpu").scores()
    assert s["samples"] == 0
    assert s["acc"] is s["top5"] is s["loss"] is s["balanced_acc"] is None
    assert s["confusion"] == [[0] * 4] * 4
    assert s["per_class"]["support"] == [0] * 4
    assert not any(math.isnan(v) for v in s["per_class"]["f1"])


def test_json_of_the_scores_is_plain():
    s = common.scores(torch.eye(3), torch.tensor([0, 1, 2]), 3)
    assert json.loads(json.dumps(s)) == s


# ------------------------------------------------------------------ predict

@pytest.fixture(scope="module")
def bundle(made):
    """s1's export bundle (every format), and a folder of photos: other sizes and modes, and
    a file that is no image."""
    from ddpflow.inference.export import export

    tmp, _, cfg, _, _ = made
    assert export(cfg, "s1", str(tmp / "bundle")) == 0
    for i, (size, mode) in enumerate([((30, 20), "RGB"), ((13, 17), "L"), ((16, 16), "RGB")]):
        _png(tmp / "photos" / f"p{i}.png", size, mode, seed=10 + i)
    (tmp / "photos" / "p9.png").write_bytes(b"not a png")
    return tmp / "bundle", tmp / "photos"


def _predict(bundle, inputs, out, **kw) -> int:
    from ddpflow.inference.predict import predict

    return predict(str(bundle), [str(i) for i in inputs], str(out), **kw)


def _rows(path: Path) -> list[list[str]]:
    import csv

    with open(path, newline="") as f:
        return list(csv.reader(f))


def _expected(made, files: list[Path], crop=None) -> torch.Tensor:
    """Class probabilities of s1's final weights (the eager model) on these files, read as
    validation reads them."""
    _, _, cfg, meta, _ = made
    model, _ = common.stage_model(cfg, meta, "s1")
    x, kept, _ = common.decode([str(f) for f in files], cfg.data.store_size, False)
    pre = common.preprocess(meta["mean"], meta["std"], cfg.data.image_size, 3, "cpu",
                            crop or crops.eval_sizes(cfg.data))
    with torch.no_grad():
        return torch.softmax(model(pre(torch.from_numpy(x))), 1)


def _check_rows(rows, probs, classes, k):
    for row, p in zip(rows, probs):
        top = p.topk(k)
        assert row[1:-1:2] == [classes[i] for i in top.indices.tolist()], (row, p)
        assert [float(v) for v in row[2:-1:2]] == pytest.approx(top.values.tolist(), abs=2e-6)
        assert row[-1] == ""


def test_predictions_are_the_models_top_k_classes_and_their_probabilities(made, bundle,
                                                                          tmp_path, capsys):
    folder, photos = bundle
    out = tmp_path / "new" / "deep" / "p.csv"  # a missing folder is made
    assert _predict(folder, [photos], out, top_k=2) == 0
    rows = _rows(out)
    assert rows[0] == ["path", "class", "prob", "class_2", "prob_2", "error"]
    assert [r[0] for r in rows[1:]] == [str(photos / f"p{i}.png") for i in (0, 1, 2, 9)]
    classes = made[3]["classes"]
    _check_rows(rows[1:4], _expected(made, [photos / f"p{i}.png" for i in range(3)]), classes, 2)
    assert rows[4][:5] == [str(photos / "p9.png"), "", "", "", ""] and rows[4][5]
    assert rows[4][5] == imagefolder.decode_file((str(photos / "p9.png"), 16, False))[1]
    cap = capsys.readouterr()
    assert cap.out == (f"ddpflow: 3 image(s) predicted, 1 unreadable (reason in the error "
                       f"column) with {folder} (torchscript on cpu) -> {out}\n")
    assert "note" not in cap.err


def test_top_k_is_the_classes_written_at_most_all_of_them(bundle, tmp_path, capsys):
    folder, photos = bundle
    good = [photos / "p0.png", photos / "p1.png"]
    for top_k, header, note in [
            (None, 3, ""), (1, 1, ""), (3, 3, ""),
            (50, 3, "ddpflow: note: --top-k 50 is more than the model's 3 classes; writing 3 "
                    "per image\n")]:
        out = tmp_path / f"k{top_k}.csv"
        assert _predict(folder, good, out, top_k=top_k) == 0
        rows = _rows(out)
        assert rows[0] == ["path", "class", "prob"] + [
            f"{c}_{i}" for i in range(2, header + 1) for c in ("class", "prob")] + ["error"]
        assert all(len(r) == 2 * header + 2 for r in rows)
        if header == 3:  # every class: the probabilities add up to 1
            assert [sum(float(v) for v in r[2:-1:2]) for r in rows[1:]] == \
                pytest.approx([1.0] * 2, abs=1e-5)
        cap = capsys.readouterr()
        assert cap.err.count("note") == bool(note) and note in cap.err, cap.err
        assert cap.out == (f"ddpflow: 2 image(s) predicted with {folder} (torchscript on cpu) "
                           f"-> {out}\n")


def test_predictions_of_many_images_are_in_the_order_given(made, bundle, tmp_path):
    from ddpflow.inference.predict import BATCH

    folder, photos = bundle
    many = [photos / f"p{i % 3}.png" for i in range(BATCH + 5)]
    out = tmp_path / "many.csv"
    assert _predict(folder, many, out, top_k=1) == 0
    rows = _rows(out)[1:]
    assert [r[0] for r in rows] == [str(m) for m in many]
    _check_rows(rows, _expected(made, many), made[3]["classes"], 1)


def _copy(bundle, tmp_path, edit=None, name="b") -> Path:
    folder = tmp_path / name
    shutil.copytree(bundle, folder)
    if edit:
        spec = json.loads((folder / "model.json").read_text())
        edit(spec)
        (folder / "model.json").write_text(json.dumps(spec))
    return folder


def test_the_bundles_crop_rule_is_the_one_predict_uses(made, bundle, tmp_path):
    folder, photos = bundle
    files = [photos / f"p{i}.png" for i in range(3)]

    def bicubic(spec):
        spec["eval_crop"] = {"crop": 16, "resize": 24, "interpolation": "bicubic"}

    def older(spec):  # before eval_crop: the default rule
        del spec["eval_crop"]

    for edit, crop in ((bicubic, crops.EvalCrop(16, 24, "bicubic")),
                       (older, crops.EvalCrop(16))):
        b = _copy(folder, tmp_path, edit, edit.__name__)
        out = tmp_path / f"{edit.__name__}.csv"
        assert _predict(b, files, out, top_k=3) == 0
        _check_rows(_rows(out)[1:], _expected(made, files, crop), made[3]["classes"], 3)


def test_a_bundle_that_is_not_one_is_one_message_naming_the_file(bundle, tmp_path):
    from ddpflow.inference.predict import load_bundle

    folder, _ = bundle
    manifest = "{b}/model.json (export bundle manifest)"
    fix = "make a bundle with `ddpflow export --config ...`"
    (tmp_path / "f").write_text("x")
    assert _refusal(load_bundle, tmp_path / "f") == (
        f"--bundle {tmp_path / 'f'} is a file; give the folder `ddpflow export` wrote (it "
        f"holds model.json)")
    assert load_bundle(folder)["classes"] == ["class0", "class1", "class2"]
    long = "a   very\tlong " + "x" * 60

    def task(spec):
        spec["task"] = long

    b = _copy(folder, tmp_path, task, "task")
    assert _refusal(load_bundle, b) == (
        f"{b} holds a a very long {'x' * 28} model; predict writes classes and probabilities, "
        f"which only a classification model gives (load model.ts or model.onnx yourself for "
        f"its raw outputs)")
    rows = [  # edit, the words of the refusal ({b}: the bundle)
        (lambda s: s.pop("classes"),
         f"{manifest}: classes: missing; it was not written by ddpflow (or was edited); "
         f"{fix}"),
        (lambda s: s["classes"].pop(),
         f"{manifest}: classes: 2 item(s), but num_classes says 3; it was not written by "
         f"ddpflow (or was edited); {fix}"),
        (lambda s: s["mean"].append(0.5),
         f"{manifest}: mean: 4 item(s), but the image channels says 3; it was not written by "
         f"ddpflow (or was edited); {fix}"),
        (lambda s: s.update(std=s["std"][:2]),
         f"{manifest}: std: 2 item(s), but the image channels says 3; it was not written by "
         f"ddpflow (or was edited); {fix}"),
        (lambda s: s.update(grayscale=True),
         f"{manifest}: mean: 3 item(s), but the image channels says 1; it was not written by "
         f"ddpflow (or was edited); {fix}"),
        (lambda s: s["files"]["onnx"].update(file="../model.onnx"),
         "{b}/model.json: files.onnx.file: '../model.onnx' goes up with '..', outside {b}"),
        (lambda s: s["files"]["onnx"].update(file="other.onnx"),
         "the bundle {b} lacks other.onnx (onnx) that model.json lists; export again"),
        (lambda s: s["files"]["torchscript"].update(sha256="0" * 64),
         "{b}/model.ts does not match its SHA-256 in model.json (changed or damaged since "
         "export); export again"),
    ]
    for i, (edit, words) in enumerate(rows):
        b = _copy(folder, tmp_path, edit, f"b{i}")
        text = _refusal(load_bundle, b)
        assert text.startswith(words.format(b=b)), (i, text)
    gray = _copy(folder, tmp_path, lambda s: s.update(grayscale=True, mean=[0.5], std=[0.2]),
                 "gray")
    assert load_bundle(gray)["grayscale"] is True


def test_a_format_is_the_one_asked_for_or_the_first_the_bundle_has(made, bundle, tmp_path,
                                                                   capsys):
    folder, photos = bundle
    files = [photos / "p0.png", photos / "p2.png"]
    want = _expected(made, files)

    def only_onnx(spec):
        del spec["files"]["torchscript"]

    onnx = _copy(folder, tmp_path, only_onnx, "onnx")
    for b, fmt, engine in ((folder, "onnx", "onnx on CPUExecutionProvider"),
                           (onnx, "auto", "onnx on CPUExecutionProvider"),
                           (folder, "torchscript", "torchscript on cpu")):
        out = tmp_path / f"{fmt}.csv"
        assert _predict(b, files, out, fmt=fmt, top_k=3) == 0
        _check_rows(_rows(out)[1:], want, made[3]["classes"], 3)
        cap = capsys.readouterr()
        assert cap.out.endswith(f" with {b} ({engine}) -> {out}\n")
        assert cap.err == ""  # on the CPU: no note about a GPU provider
    assert _refusal(_predict, onnx, files, tmp_path / "x.csv", fmt="torchscript") == (
        "the bundle has no torchscript model (it has: onnx, safetensors)")
    assert not (tmp_path / "x.csv").exists()


def test_torchscripts_deprecation_is_not_the_users_warning(bundle, tmp_path):
    import warnings

    from ddpflow.inference.predict import _runner, load_bundle

    folder, _ = bundle
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _runner(load_bundle(folder), folder, "torchscript", torch.device("cpu"), False)
    assert [str(w.message) for w in seen] == []


@pytest.mark.filterwarnings("ignore:Specified provider 'CUDAExecutionProvider'")
def test_onnx_for_the_gpu_without_a_gpu_onnxruntime_is_refused_or_said(made, bundle, capsys):
    import onnxruntime as ort

    from ddpflow.inference.predict import _runner, load_bundle

    folder, photos = bundle
    spec = load_bundle(folder)
    cuda = torch.device("cuda")
    assert _refusal(_runner, spec, folder, "onnx", cuda, True) == (
        f"--device cuda --format onnx: this onnxruntime runs on CPUExecutionProvider only (it "
        f"has {', '.join(ort.get_available_providers())}); install onnxruntime-gpu for the "
        f"GPU, or use --format torchscript or --device cpu")
    capsys.readouterr()
    run, on, engine = _runner(spec, folder, "onnx", cuda, False)  # auto: the CPU, said
    assert on == torch.device("cpu") and engine == "onnx on CPUExecutionProvider"
    assert capsys.readouterr().err.endswith(
        "ddpflow: note: onnxruntime has no usable CUDAExecutionProvider; the ONNX model runs "
        "on CPUExecutionProvider\n")
    _, _, cfg, meta, _ = made
    x, _, _ = common.decode([str(photos / "p0.png")], cfg.data.store_size, False)
    pre = common.preprocess(meta["mean"], meta["std"], 16, 3, "cpu", crops.eval_sizes(cfg.data))
    probs = torch.softmax(run(pre(torch.from_numpy(x))), 1)
    torch.testing.assert_close(probs, _expected(made, [photos / "p0.png"]), atol=2e-6, rtol=0)


def test_onnx_without_onnxruntime_is_one_message(bundle, tmp_path, monkeypatch):
    import sys

    folder, photos = bundle
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # `import onnxruntime` fails
    assert _refusal(_predict, folder, [photos], tmp_path / "p.csv", fmt="onnx") == \
        "--format onnx needs onnxruntime: pip install onnxruntime"


def test_arguments_are_checked_before_the_bundle_is_read(tmp_path):
    from ddpflow.inference.predict import _check_args

    gone = tmp_path / "no-bundle"  # never read: each refusal is about the argument
    (tmp_path / "file").write_text("x")
    for kw, words in [
            ({"top_k": 0}, "--top-k 0: give the number of classes per image to write, 1 or more"),
            ({"top_k": -2}, "--top-k -2: give the number of classes per image to write, 1 or "
                            "more"),
            ({"device": "tpu"}, "--device tpu: use auto, cpu or cuda"),
            ({"out": tmp_path / "file" / "deeper" / "p.csv"},
             f"--out {tmp_path / 'file' / 'deeper' / 'p.csv'}: {tmp_path / 'file'} is a file, "
             f"not a folder; give a CSV path in a folder")]:
        out = kw.pop("out", tmp_path / "p.csv")
        assert _refusal(_predict, gone, [tmp_path], out, **kw) == words
    for top_k in (None, 1, 2):  # then the bundle is read
        assert "export bundle manifest" in _refusal(_predict, gone, [tmp_path],
                                                   tmp_path / "p.csv", top_k=top_k)
    for device in ("auto", "cpu"):
        _check_args(None, device, tmp_path / "a" / "b.csv")
    if not torch.cuda.is_available():
        assert _refusal(_check_args, None, "cuda", tmp_path / "p.csv") == (
            "--device cuda: no CUDA GPU is visible to PyTorch here; use --device cpu (or "
            "auto, which takes a GPU when there is one)")


def test_predictions_replace_their_own_csv_and_nothing_else(bundle, tmp_path):
    import socket

    folder, photos = bundle
    out = tmp_path / "p.csv"
    assert _predict(folder, [photos / "p0.png"], out) == 0
    assert _predict(folder, [photos / "p1.png", photos / "p2.png"], out) == 0  # replaced
    assert [r[0] for r in _rows(out)[1:]] == [str(photos / "p1.png"), str(photos / "p2.png")]
    mine = tmp_path / "mine.csv"
    mine.write_text("name,score\n")
    sock = socket.socket(socket.AF_UNIX)  # a file that cannot even be opened to read
    sock.bind(str(tmp_path / "sock.csv"))
    try:
        for place in (mine, tmp_path / "sock.csv"):
            # refused before any work: not the missing image's message
            assert _refusal(_predict, folder, [tmp_path / "gone.png"], place) == (
                f"the predictions CSV: {place} already exists and was not written by ddpflow; "
                f"ddpflow never deletes or overwrites what it did not write, and nothing was "
                f"changed: choose another --out, or empty or remove it yourself")
    finally:
        sock.close()
    assert mine.read_text() == "name,score\n"


def test_the_csv_is_claimed_again_when_it_is_written(tmp_path):
    """A file put at --out while the images were read is not replaced."""
    from ddpflow.inference.predict import _write_csv

    late = tmp_path / "late.csv"
    late.write_text("mine\n")
    assert _refusal(_write_csv, late, ["path", "class", "prob", "error"], []).startswith(
        f"the predictions CSV: {late} already exists and was not written by ddpflow")
    assert late.read_text() == "mine\n"
    (tmp_path / "there").mkdir()
    for out in (tmp_path / "there" / "p.csv", tmp_path / "a" / "b" / "p.csv"):
        _write_csv(out, ["path", "class", "prob", "error"], [["x.png", "cat", "1.000000", ""]])
        assert out.read_text() == "path,class,prob,error\nx.png,cat,1.000000,\n"


def test_the_progress_bar_on_a_terminal_counts_the_images(bundle, tmp_path):
    """On a terminal (a real pseudo-terminal here) predict shows how many images are done."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios

    folder, photos = bundle
    main, side = pty.openpty()
    fcntl.ioctl(side, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 100 columns
    code = ("import sys; from ddpflow.inference.predict import predict; "
            "sys.exit(predict(sys.argv[1], sys.argv[2:-1], sys.argv[-1]))")
    proc = subprocess.run([sys.executable, "-c", code, str(folder), str(photos),
                           str(tmp_path / "p.csv")], stderr=side, stdout=subprocess.DEVNULL,
                          timeout=300)
    os.close(side)
    text = b""
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:
            break
        if not chunk:
            break
        text += chunk
    os.close(main)
    assert proc.returncode == 0
    assert "predict: 100%" in text.decode() and "4/4" in text.decode(), text


# ------------------------------------------------------------------ export

class _Identity(torch.nn.Module):
    """Logits = the input's first 3 values per image: outputs known exactly."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)
        with torch.no_grad():
            self.fc.weight.copy_(torch.eye(3))
            self.fc.bias.zero_()

    def forward(self, x):
        return self.fc(x.flatten(1)[:, :3])


class _Svd(_Identity):
    """A model the ONNX exporter cannot translate (svdvals); TorchScript can."""

    def forward(self, x):
        return super().forward(x) + 0 * torch.linalg.svdvals(x[:, :1, :2, :2]).sum(-1)


def _batch() -> torch.Tensor:
    x = torch.zeros(3, 1, 2, 2)  # the logits (first 3 values): max |logit| 1.5
    x.view(3, 4)[:, :3] = torch.tensor([[1.5, 0.2, 0.1], [0.1, 0.9, 0.9 - 1e-5],
                                        [0.3, -0.4, 0.2]])
    return x


def test_each_format_is_checked_against_the_models_outputs(tmp_path):
    from ddpflow.inference.export import RTOL, _write_format

    model, x = _Identity().eval(), _batch()
    ref = x.view(3, 4)[:, :3].clone()
    for fmt, name in (("safetensors", "m.safetensors"), ("torchscript", "m.ts"),
                      ("onnx", "m.onnx")):
        c = _write_format(fmt, model, x, ref, tmp_path / name)
        assert c == {"ok": True, "checked": True, "checked_on": ["cpu"], "images": 3,
                     "max_abs_diff": c["max_abs_diff"], "tolerance": RTOL * 1.5,
                     "same_top1": True, "error": None}, fmt
        assert c["max_abs_diff"] <= 1e-6 and (tmp_path / name).is_file()
    # outputs within the tolerance, but another top-1 class (row 1: 0.9 vs 0.90001)
    other = ref.clone()
    other[1, 2] = 0.9 + 1e-5
    c = _write_format("torchscript", model, x, other, tmp_path / "a.ts")
    assert c["ok"] is False and c["same_top1"] is False and c["max_abs_diff"] < RTOL
    assert c["error"] == (f"outputs differ from the PyTorch model's by {c['max_abs_diff']:.2e} "
                          f"(tolerance {RTOL * 1.5:.2e}, same top-1: False)")
    # the same top-1 classes, outputs beyond the tolerance
    far = ref.clone()
    far[2, 1] -= 0.01
    c = _write_format("safetensors", model, x, far, tmp_path / "b.safetensors")
    assert c["ok"] is False and c["same_top1"] is True
    assert c["max_abs_diff"] == pytest.approx(0.01, abs=1e-6)
    assert c["error"] == (f"outputs differ from the PyTorch model's by {c['max_abs_diff']:.2e} "
                          f"(tolerance {RTOL * 1.5:.2e}, same top-1: True)")


def test_a_format_that_cannot_be_written_is_reported_and_leaves_no_file(tmp_path):
    from ddpflow.inference.export import _write_format

    model, x = _Svd().eval(), _batch()
    ref = model(x).detach()
    c = _write_format("onnx", model, x, ref, tmp_path / "m.onnx")
    assert c["ok"] is False and c["checked_on"] == ["cpu"] and set(c) == {
        "ok", "checked_on", "error"}
    assert "svdvals" in c["error"] and "\n" not in c["error"], c["error"]
    assert c["error"].split(":")[0].endswith("Error"), c["error"]  # the exception's type
    assert not (tmp_path / "m.onnx").exists()
    assert _write_format("torchscript", model, x, ref, tmp_path / "m.ts")["ok"]


def test_a_place_that_cannot_be_written_is_the_users_error_not_the_formats(tmp_path,
                                                                         monkeypatch):
    import errno

    from ddpflow.inference import export

    model, x = _Identity().eval(), _batch()
    ref = model(x).detach()

    def refused(model, x, path):  # a writer's own refusal (a UserError): passed on
        raise UserError("no room for it")

    monkeypatch.setitem(export.WRITERS, "onnx", refused)
    assert _refusal(export._write_format, "onnx", model, x, ref, tmp_path / "m.onnx") == \
        "no room for it"

    def broken(model, x, path):  # an error of the disk (EIO): that format's failure
        path.write_bytes(b"half")
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setitem(export.WRITERS, "onnx", broken)
    c = export._write_format("onnx", model, x, ref, tmp_path / "m.onnx")
    assert c == {"ok": False, "checked_on": ["cpu"],
                 "error": "OSError: [Errno 5] Input/output error"}
    assert not (tmp_path / "m.onnx").exists()


def test_onnx_without_onnxruntime_is_written_and_said_unchecked(tmp_path, monkeypatch):
    import sys

    from ddpflow.inference.export import _write_format

    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    model, x = _Identity().eval(), _batch()
    c = _write_format("onnx", model, x, model(x).detach(), tmp_path / "m.onnx")
    assert c == {"ok": True, "checked": False, "checked_on": [],
                 "note": "onnxruntime is not installed: not run (pip install onnxruntime)"}
    assert (tmp_path / "m.onnx").stat().st_size > 0
    monkeypatch.setitem(sys.modules, "onnx", None)
    c = _write_format("onnx", model, x, model(x).detach(), tmp_path / "n.onnx")
    assert c == {"ok": False, "checked_on": ["cpu"], "error": "RuntimeError: the onnx package "
                 "is not installed (pip install onnx)"}


def test_the_torchscript_file_on_another_device_is_compared_with_the_cpu(tmp_path):
    from ddpflow.inference.export import DeviceCheckError, _on_cuda

    model, x = _Identity().eval(), _batch()
    path = tmp_path / "m.ts"
    torch.jit.trace(model, x[:2]).save(str(path))
    ref = x.view(3, 4)[:, :3].clone()  # max |logit| 1.5: outputs may differ by 1.5e-2
    for delta in (0, 0.0149, -0.0149):
        near = ref.clone()
        near[2, 2] += delta
        _on_cuda(path, x, near, "cpu")
    for delta in (0.0151, -0.0151, 0.019):
        far = ref.clone()
        far[2, 2] += delta
        with pytest.raises(DeviceCheckError) as e:
            _on_cuda(path, x, far, "cpu")
        assert str(e.value) == (f"the TorchScript file gives other outputs on cpu than on the "
                                f"CPU (max |diff| {abs(delta):.2e})")
    (tmp_path / "bad.ts").write_bytes(b"not torchscript")
    with pytest.raises(DeviceCheckError) as e:
        _on_cuda(tmp_path / "bad.ts", x, ref, "cpu")
    assert str(e.value).startswith(
        "the TorchScript file fails on cpu (traced on the CPU; a tensor made in forward keeps "
        "the CPU device?): RuntimeError: "), e.value
    assert "\n" not in str(e.value)


def test_export_of_the_last_stage_is_a_whole_readable_bundle_in_the_run(made, capsys):
    from safetensors.torch import load_file

    from ddpflow import __version__
    from ddpflow.inference.export import RTOL, UMASK, export

    tmp, p, cfg, meta, w = made
    target = cfg.run_dir / "export"
    target.mkdir()
    (target / "model.ts").write_bytes(b"old")  # an older bundle whose model.json is gone
    assert export(cfg) == 0  # the last stage, s2 (its EMA's weights), in <run>/export
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == f"ddpflow: exported stage 's2' (final: ema weights, step 12) -> {target}"
    spec = json.loads((target / "model.json").read_text())
    assert sorted(f.name for f in target.iterdir() if not f.name.startswith(".")) == [
        "model.json", "model.onnx", "model.safetensors", "model.ts"]
    for f in target.iterdir():
        assert f.stat().st_mode & 0o777 == 0o666 & ~UMASK, f
    assert target.stat().st_mode & 0o777 == 0o777 & ~UMASK
    assert _same(load_file(str(target / "model.safetensors")), w[4])
    assert spec["files"] == {
        fmt: {"file": name, "sha256": checkpoint.sha256_of(target / name),
              "bytes": (target / name).stat().st_size}
        for fmt, name in (("safetensors", "model.safetensors"), ("torchscript", "model.ts"),
                          ("onnx", "model.onnx"))}
    record = common.stage_weights(cfg, "s2")[1]
    checks = spec.pop("checks")
    assert out[:-1] == [f"  {f:12s} {n:18s} ok (max |diff| {checks[f]['max_abs_diff']:.2e}), "
                        f"run on cpu" for f, n in (("safetensors", "model.safetensors"),
                                                   ("torchscript", "model.ts"),
                                                   ("onnx", "model.onnx"))]
    assert {f: (c["ok"], c["checked"], c["checked_on"], c["images"]) for f, c in
            checks.items()} == {f: (True, True, ["cpu"], 24) for f in spec["files"]}
    assert spec == {
        "format_version": 1, "ddpflow": __version__, "torch": torch.__version__,
        "architecture": {"name": "smallcnn", "kwargs": {}, "code_dir": None},
        "task": "classification", "num_classes": 3, "classes": meta["classes"],
        "input": {"name": "input", "layout": "NCHW", "dtype": "float32", "channels": 3,
                  "data_channels": 3},
        "image_size": 16, "store_size": cfg.data.store_size, "grayscale": False,
        "mean": meta["mean"], "std": meta["std"],
        "crop": {"decode": f"RGB (or L when grayscale), short side resized to "
                           f"{cfg.data.store_size} (bilinear), centre square kept",
                 "normalize": "(x / 255 - mean) / std per channel",
                 "eval": crops.eval_sizes(cfg.data).describe()},
        "eval_crop": {"crop": 16, "resize": None, "interpolation": "bilinear"},
        "onnx_opset": 17, "files": spec["files"],
        "check_rule": f"max |logit difference| <= {RTOL:g} x max(1, max |logit|) and the same "
                      f"top-1 class, on 32 validation images",
        "source": record, "config_hash": cfg.hash, "stage_hash": cfg.stage_hash("s2")}


def test_the_onnx_file_takes_any_batch_and_names_its_input_and_output(bundle):
    import onnx

    folder, _ = bundle
    graph = onnx.load(str(folder / "model.onnx"))
    assert [o.version for o in graph.opset_import if o.domain in ("", "ai.onnx")] == [17]
    for value, name in ((graph.graph.input[0], "input"), (graph.graph.output[0], "logits")):
        assert value.name == name
        dims = value.type.tensor_type.shape.dim
        assert dims[0].dim_param == "batch" and not dims[1].dim_param, dims
    assert len(graph.graph.output) == 1


def test_export_of_chosen_weights_to_out_warns_of_a_stale_stage(made, tmp_path, capsys):
    from safetensors.torch import load_file

    from ddpflow.inference.export import export

    _, p, _, _, w = made
    changed = load_config(p, ["stages.0.lr=0.1"])
    out = tmp_path / "b"
    assert export(changed, "s1", str(out), "best") == 0
    cap = capsys.readouterr()
    assert cap.out.splitlines()[-1] == (
        f"ddpflow: exported stage 's1' (best: raw weights, step 8) -> {out}")
    assert "ddpflow: warning: stage 's1' is stale: made with another config" in cap.err
    assert _same(load_file(str(out / "model.safetensors")), w[1])


def test_export_refuses_before_any_work(made, tmp_path):
    from ddpflow.inference.export import export

    _, p, cfg, _, _ = made
    bare = load_config(p, [f"results_dir={tmp_path / 'r'}"])
    assert _refusal(export, bare) == (
        f"no prepared data at {bare.data_dir}; run `ddpflow prepare` first")
    other = load_config(p, ["data.val_size=30"])
    assert _refusal(export, other, "s1", str(tmp_path / "x")).startswith(
        f"the prepared data at {cfg.data_dir} was made with other data settings (data.val_size: "
        f"24 -> 30)")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("x")
    weightless = load_config(p, ["stages.1.name=s3"])  # a stage never run
    assert _refusal(export, weightless, "s3", str(mine)).startswith(
        f"the export bundle: {mine} already holds files ddpflow did")
    assert [f.name for f in mine.iterdir()] == ["notes.txt"]
    (mine / "notes.txt").unlink()
    (mine / "model.ts").write_bytes(b"x")  # at --out, a bundle has its model.json
    assert _refusal(export, cfg, "s1", str(mine)).startswith(
        f"the export bundle: {mine} already holds files ddpflow did")
    assert [f.name for f in mine.iterdir()] == ["model.ts"]
    assert not (tmp_path / "x").exists()


def test_a_bundle_of_an_older_version_is_recognised_by_its_files(tmp_path):
    from ddpflow.inference.export import is_bundle

    b = tmp_path / "b"
    b.mkdir()
    (b / "model.ts").write_bytes(b"x")
    assert is_bundle(b, strict=False) is True  # ddpflow's own place: model.json removed
    assert not is_bundle(b)
    for name in ("model.onnx", "model.safetensors"):
        (b / name).write_bytes(b"x")
    (b / "model.json").write_text(json.dumps({"ddpflow": "0.1", "files": {}}))
    assert is_bundle(b) is True and is_bundle(b, strict=False) is True
    (b / "model.json").write_text(json.dumps({"files": {}}))  # not ddpflow's
    assert not is_bundle(b)
    (b / "model.json").write_text(json.dumps({"ddpflow": "0.1", "files": {}}))
    (b / "notes.txt").write_text("mine")
    assert not is_bundle(b) and not is_bundle(b, strict=False)


def test_the_bytes_of_a_models_weights(tmp_path):
    from ddpflow.inference.export import weights_bytes

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    # 12 + 4 weights and bias, 4 + 4 affine, 4 + 4 running stats (fp32), 1 counter (int64)
    assert weights_bytes(model) == (12 + 4 + 8 + 8) * 4 + 8


ODD = EVALUATE_MODEL  # a model the ONNX exporter cannot translate, TorchScript can


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    """A finished stage of a user's model that ONNX cannot export, on grayscale images."""
    import sys

    from fixtures import image_tree

    tmp = tmp_path_factory.mktemp("odd")
    (tmp / "code").mkdir()
    (tmp / "code" / "oddmodel.py").write_text(ODD)
    image_tree(tmp / "imgs", per_class=6, size=(20, 16))
    raw = tiny_config(tmp, model={"name": "oddmodel:build", "code_dir": str(tmp / "code")},
                      stages=[{"name": "s1", "epochs": 1, "batch_size": 4}])
    raw["data"] = {"source": "imagefolder", "path": str(tmp / "imgs"), "image_size": 16,
                   "grayscale": True, "train_size": None, "val_size": None,
                   "val_fraction": 0.25, "test_fraction": 0}
    p = write_config(tmp, raw)
    assert cli.main(["prepare", "--config", str(p)]) == 0
    cfg = load_config(p)
    meta = prepared.read_meta(cfg.data_dir)
    w = _weights(cfg, meta, 0)
    _finish(cfg, "s1", w, w)
    yield tmp, cfg, meta
    sys.path[:] = [d for d in sys.path if d != str(tmp / "code")]
    sys.modules.pop("oddmodel", None)


def test_a_format_that_fails_is_named_and_the_others_are_written(odd, capsys):
    from ddpflow.inference.export import export

    tmp, cfg, meta = odd
    assert export(cfg, out=str(tmp / "b")) == 1
    cap = capsys.readouterr()
    spec = json.loads((tmp / "b" / "model.json").read_text())
    assert set(spec["files"]) == {"safetensors", "torchscript"}
    assert not (tmp / "b" / "model.onnx").exists()
    error = spec["checks"]["onnx"]["error"]
    assert spec["checks"]["onnx"] == {"ok": False, "checked_on": ["cpu"], "error": error}
    assert "svdvals" in error
    assert cap.out.splitlines()[2] == f"  {'onnx':12s} {'model.onnx':18s} FAILED: {error}, " \
                                      f"run on cpu"
    assert cap.out.splitlines()[3] == (
        f"ddpflow: exported stage 's1' (final: raw weights, step 12) -> {tmp / 'b'}")
    assert cap.err.splitlines()[-1] == f"ddpflow: error: onnx was not exported: {error}"
    assert spec["grayscale"] is True and spec["input"] == {
        "name": "input", "layout": "NCHW", "dtype": "float32", "channels": 1,
        "data_channels": 1}
    assert spec["checks"]["torchscript"]["images"] == meta["counts"]["val"]["total"]


def test_a_users_model_finds_the_users_data_code_as_in_training(made, tmp_path):
    """model.code_dir and data.code_dir are both on sys.path where the model is built: a
    model module may import the user's data module."""
    import sys

    _, p, _, meta, w = made
    (tmp_path / "models").mkdir()
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "sharedsizes.py").write_text("WIDTH = 'smallcnn'\n")
    (tmp_path / "models" / "usernet.py").write_text(
        "import sharedsizes\nfrom ddpflow.seams.models import build_model\n\n\n"
        "def build(num_classes, in_channels):\n"
        "    return build_model(sharedsizes.WIDTH, num_classes, in_channels)\n")
    cfg = load_config(p, ["model.name=usernet:build", f"model.code_dir={tmp_path / 'models'}",
                          f"data.code_dir={tmp_path / 'data'}"])
    try:
        model, _ = common.stage_model(cfg, meta, "s1")
        assert _same(model.state_dict(), w[0])
    finally:
        sys.path[:] = [d for d in sys.path if not d.startswith(str(tmp_path))]
        for name in ("usernet", "sharedsizes"):
            sys.modules.pop(name, None)


class _Baked(_Identity):
    """A forward whose trace keeps the batch size it was traced with (len(x) is a number
    to the tracer): the TorchScript file fails on any other batch size."""

    def forward(self, x):
        return super().forward(x).reshape(len(x), -1)


def test_a_torchscript_file_that_keeps_its_traced_batch_size_fails_its_check(tmp_path):
    from ddpflow.inference.export import _write_format

    model, x = _Baked().eval(), _batch()  # 3 images: traced on 2
    c = _write_format("torchscript", model, x, model(x).detach(), tmp_path / "m.ts")
    assert c["ok"] is False and c["error"].startswith("RuntimeError: "), c
    assert not (tmp_path / "m.ts").exists()


def test_an_onnx_file_that_keeps_its_traced_batch_size_fails_its_check(tmp_path):
    from ddpflow.inference.export import _write_format

    model, x = _Baked().eval(), _batch()
    c = _write_format("onnx", model, x, model(x).detach(), tmp_path / "m.onnx")
    assert c["ok"] is False, c
    assert not (tmp_path / "m.onnx").exists()


def test_a_bundle_that_cannot_fit_is_refused_before_any_format_is_written(made, tmp_path):
    """A real tmpfs with room for one format's file, not for the three."""
    import subprocess

    from ddpflow.core.nativewrite import need_bytes
    from ddpflow.inference.export import export, weights_bytes

    _, _, cfg, meta, _ = made
    model, _ = common.stage_model(cfg, meta, "s1")
    one = weights_bytes(model)
    d = tmp_path / "mnt"
    d.mkdir()
    size = need_bytes(2 * one) // 4096 * 4096
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        free = shutil.disk_usage(d).free
        assert need_bytes(one) < free < need_bytes(3 * one)
        out = d / "bundle"
        assert _refusal(export, cfg, "s1", str(out)) == (
            f"not enough free space for the export bundle at {out}: about "
            f"{need_bytes(3 * one) / 1e6:.1f} MB needed, {free / 1e6:.1f} MB free; free space "
            f"there or choose another place")
        assert [f for f in os.listdir(d) if not f.endswith(".lock")] == []
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def _at_the_bound(scale: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(images, reference logits, bound): the identity model's outputs differ from the
    reference by exactly RTOL x max |logit| x scale (a max |logit| near 1.5 for which that
    product is a float32 number, so that the difference can be it exactly)."""
    from ddpflow.inference.export import RTOL

    m = np.float32(1.5)
    while float(np.float32(RTOL * float(m) * scale)) != RTOL * float(m) * scale:
        m = np.nextafter(m, np.float32(2))
    x = torch.zeros(3, 1, 2, 2)
    x.view(3, 4)[:, :3] = torch.tensor([[float(m), 0.2, 0.1], [0.1, 0.9, 0.3],
                                        [0.3, -0.4, 0.0]])
    ref = x.view(3, 4)[:, :3].clone()
    bound = RTOL * float(m) * scale
    ref[2, 2] = bound
    assert float(ref.abs().max()) == float(m) and float(ref[2, 2]) == bound
    return x, ref, bound


def test_outputs_that_differ_by_exactly_the_tolerance_pass(tmp_path):
    import warnings

    from ddpflow.inference.export import _on_cuda, _write_format

    model = _Identity().eval()
    x, ref, bound = _at_the_bound(1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        c = _write_format("torchscript", model, x, ref, tmp_path / "m.ts")
    assert c["ok"] is True and c["max_abs_diff"] == c["tolerance"] == bound
    assert [str(w.message) for w in seen] == []  # the tracer's chatter is not the user's
    x, ref, bound = _at_the_bound(100)  # on the GPU: 100 x the tolerance
    _on_cuda(tmp_path / "m.ts", x, ref, "cpu")
