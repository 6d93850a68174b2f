"""The honest test split, evaluate, export and predict, and the crops they share.

One trained stage on an image folder (real PNG/JPEG/WebP files in several modes, stored
at store_size, random-resized-crop training) serves the evaluate/export/predict tests."""

from __future__ import annotations

import csv
import json
import shutil

import numpy as np
import pytest
import torch

from conftest import REPO, ddpflow, tiny_config, write_config
from ddpflow.data.crops import center_crop, random_resized_crop
from fixtures import image_tree


def test_random_resized_crop_is_a_batched_box_resample():
    x = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).view(2, 3, 8, 8)
    g = torch.Generator().manual_seed(0)
    # the whole image at its own size: every output pixel is its input pixel
    same = random_resized_crop(x, 8, (1.0, 1.0), (1.0, 1.0), False, g)
    torch.testing.assert_close(same, x)
    # mirrored (flip) samples are exact mirrors; the draw depends on the generator only
    a = random_resized_crop(x, 8, (1.0, 1.0), (1.0, 1.0), True,
                            torch.Generator().manual_seed(3))
    b = random_resized_crop(x, 8, (1.0, 1.0), (1.0, 1.0), True,
                            torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    assert all(torch.equal(a[i], x[i]) or torch.equal(a[i], x[i].flip(-1)) for i in range(2))
    # small boxes: values stay inside the image's range, size is the output size
    big = torch.rand(64, 3, 40, 40)
    out = random_resized_crop(big, 16, (0.08, 0.3), (0.75, 1.333), True, g)
    assert out.shape == (64, 3, 16, 16) and 0 <= out.min() and out.max() <= 1
    assert not torch.equal(out[0], out[1])  # per-sample boxes
    # the evaluation crop: resize to image_size / 0.875, keep the centre
    assert center_crop(big, 32).shape == (64, 3, 32, 32)
    assert center_crop(big[:, :, :32, :32], 32).data_ptr() == big.data_ptr()  # nothing to do


def _data(tmp, **extra):
    return {"source": "imagefolder", "path": str(tmp / "imgs"), "image_size": 16,
            "train_size": None, "val_size": None, "val_fraction": 0.2, "test_fraction": 0.2,
            "augment": {"random_resized_crop": {"scale": [0.35, 1.0]}}, **extra}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 2-rank stage (with EMA) on a 3-class image folder, plus a labelled folder
    of other images (other sizes, modes, one broken file)."""
    tmp = tmp_path_factory.mktemp("ev")
    image_tree(tmp / "imgs", per_class=20)
    photos = image_tree(tmp / "photos", per_class=5, size=(53, 41), broken=1)
    raw = tiny_config(tmp, data=_data(tmp), stages=[
        {"name": "s1", "epochs": 3, "batch_size": 8, "lr": 0.05,
         "ema": {"decay": 0.9, "every_steps": 1},
         # evaluate runs in fp32: a stage-end loss in bf16 differs from it by ~1e-3
         "precision": "fp32", "channels_last": False}])
    raw["data"] = _data(tmp)
    p = write_config(tmp, raw)
    ddpflow("prepare", "--config", p, check=True)
    ddpflow("launch", "--config", p, "--stage", "s1", check=True)
    return tmp, p, photos


@pytest.mark.slow
def test_stage_end_test_split_and_evaluate_agree(trained):
    tmp, p, _ = trained
    meta = json.loads((tmp / "results/t/data/meta.json").read_text())
    assert meta["image_shape"] == [18, 18, 3]  # stored at 1.15 x image_size for crops
    assert [meta["counts"][s]["total"] for s in ("train", "val", "test")] == [39, 9, 12]
    s = json.loads((tmp / "results/t/stages/s1/summary.json").read_text())
    assert s["weights"] == "ema" and set(s["test_metrics"]) == {
        "test_acc", "test_loss", "test_top5", "test_recall", "test_balanced_acc"}
    recs = [json.loads(x) for x in (tmp / "results/t/stages/s1/metrics.jsonl").open()]
    assert recs[-1]["kind"] == "test" and recs[-2]["kind"] == "val"  # once, after the last
    proc = ddpflow("evaluate", "--config", p, check=True)
    out = tmp / "results/t/evaluate/s1/test-final"
    m = json.loads((out / "metrics.json").read_text())
    # the same weights (the EMA's) on the same split: the same figures as the stage's end
    assert m["samples"] == 12 and m["weights"]["holds"] == "ema" and m["world_size"] == 2
    assert m["acc"] == pytest.approx(s["test_acc"]) and m["loss"] == pytest.approx(
        s["test_loss"], rel=1e-5)
    assert (out / "confusion.png").stat().st_size > 1000 and "acc" in proc.stdout
    rows = list(csv.DictReader((out / "per_class.csv").open()))
    assert [r["class"] for r in rows] == ["cat", "dog", "fish"]
    # each image counted once on 2 ranks: the split's own count in every class, not a total
    assert [int(r["support"]) for r in rows] == meta["counts"]["test"]["per_class"]
    assert np.array(m["confusion"]).sum(1).tolist() == meta["counts"]["test"]["per_class"]
    # 9 val images on 2 ranks (not a multiple): none counted twice or left out
    bad = ddpflow("evaluate", "--config", p, "--weights", "best", "--split", "val")
    assert bad.returncode == 0, bad.stderr
    mv = json.loads((tmp / "results/t/evaluate/s1/val-best/metrics.json").read_text())
    assert mv["samples"] == 9 and mv["split"] == "val"
    assert np.array(mv["confusion"]).sum(1).tolist() == meta["counts"]["val"]["per_class"]
    no_ema = ddpflow("evaluate", "--config", p, "--weights", "raw", "--out", str(tmp / "raw"))
    assert no_ema.returncode == 0 and json.loads((tmp / "raw/metrics.json").read_text())[
        "weights"]["holds"] == "raw"


@pytest.mark.slow
def test_export_formats_reproduce_the_model_and_predict_agrees_with_evaluate(trained):
    tmp, p, photos = trained
    proc = ddpflow("export", "--config", p, check=True)
    bundle = tmp / "results/t/export"
    spec = json.loads((bundle / "model.json").read_text())
    assert set(spec["files"]) == {"safetensors", "torchscript", "onnx"}, proc.stdout
    assert all(c["ok"] and c["checked"] for c in spec["checks"].values()), spec["checks"]
    assert spec["classes"] == ["cat", "dog", "fish"] and spec["store_size"] == 18
    # independently of export's own check: TorchScript and onnxruntime on other inputs give
    # the PyTorch model's outputs
    import onnxruntime as ort

    from ddpflow.config import load_config
    from ddpflow.data import prepared
    from ddpflow.inference.common import stage_model

    cfg = load_config(p)
    model, _ = stage_model(cfg, prepared.read_meta(cfg.data_dir), "s1")
    x = torch.randn(5, 3, 16, 16)
    with torch.no_grad():
        ref = model(x)
        ts = torch.jit.load(str(bundle / "model.ts"))(x)
    sess = ort.InferenceSession(str(bundle / "model.onnx"), providers=["CPUExecutionProvider"])
    onnx_out = torch.from_numpy(sess.run(None, {"input": x.numpy()})[0])
    torch.testing.assert_close(ts, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(onnx_out, ref, rtol=1e-4, atol=1e-4)

    # predict on a labelled folder (other sizes and modes, one broken file) == evaluate
    ev = ddpflow("evaluate", "--config", p, "--images", str(photos), check=True)
    m = json.loads((tmp / "results/t/evaluate/s1/images-final/metrics.json").read_text())
    assert m["samples"] == 15 and len(m["skipped"]) == 1, ev.stdout
    out = tmp / "pred.csv"
    pr = ddpflow("predict", "--bundle", bundle, "--out", out, "--top-k", "2", photos,
                 check=True)
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 16 and "1 unreadable" in pr.stdout
    broken = [r for r in rows if r["error"]]
    assert len(broken) == 1 and broken[0]["path"] == str(photos / "cat" / "broken0.jpg")
    ok = [r for r in rows if not r["error"]]
    assert all(r["path"].startswith(str(photos) + "/") for r in ok)
    assert set(rows[0]) == {"path", "class", "prob", "class_2", "prob_2", "error"}
    acc = np.mean([r["path"].split("/")[-2] == r["class"] for r in ok])
    assert acc == pytest.approx(m["acc"])  # the same images read the same way

    # a bundle with a changed or missing file is refused, no traceback
    bad = tmp / "bad"
    shutil.copytree(bundle, bad)
    with open(bad / "model.ts", "ab") as f:
        f.write(b"x")
    r = ddpflow("predict", "--bundle", bad, photos)
    assert r.returncode != 0 and "SHA-256" in r.stderr and "Traceback" not in r.stderr
    (bad / "model.ts").unlink()
    r = ddpflow("predict", "--bundle", bad, photos)
    assert r.returncode != 0 and "lacks model.ts" in r.stderr


MODEL = '''
import torch


class Odd(torch.nn.Module):
    """A model the ONNX exporter cannot translate (svdvals), TorchScript can."""

    def __init__(self, num_classes, in_channels):
        super().__init__()
        self.fc = torch.nn.Linear(in_channels * 16 * 16, num_classes)

    def forward(self, x):
        return self.fc(x.flatten(1)) + 0 * torch.linalg.svdvals(x[:, 0]).sum(1, keepdim=True)


def build(num_classes, in_channels):
    return Odd(num_classes, in_channels)
'''


@pytest.mark.slow
def test_a_format_that_fails_is_named_and_the_others_are_written(tmp_path):
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "oddmodel.py").write_text(MODEL)
    raw = tiny_config(tmp_path, model={"name": "oddmodel:build", "code_dir": str(
        tmp_path / "code")}, stages=[{"name": "s1", "max_steps": 2, "batch_size": 16}])
    raw["hardware"]["nproc_per_node"] = 1
    p = write_config(tmp_path, raw)
    ddpflow("prepare", "--config", p, check=True)
    ddpflow("launch", "--config", p, "--stage", "s1", check=True)
    r = ddpflow("export", "--config", p)
    assert r.returncode == 1 and "onnx was not exported" in r.stderr
    assert "linalg_svdvals" in r.stderr and "Traceback" not in r.stderr
    spec = json.loads((tmp_path / "results/t/export/model.json").read_text())
    assert set(spec["files"]) == {"safetensors", "torchscript"}
    assert not spec["checks"]["onnx"]["ok"] and spec["checks"]["torchscript"]["ok"]
    assert not (tmp_path / "results/t/export/model.onnx").exists()
    # the stage had no EMA: asking for its EMA weights is a clear error
    r = ddpflow("evaluate", "--config", p, "--weights", "ema")
    assert r.returncode != 0 and "kept no EMA" in r.stderr and "Traceback" not in r.stderr
    # a stage made from another config is exported as it is, never silently
    raw["stages"][0]["lr"] = 0.5
    r = ddpflow("export", "--config", write_config(tmp_path, raw), "--out", tmp_path / "b2")
    assert "stage 's1' is stale: made with another config" in r.stderr


@pytest.mark.slow
def test_model_selection_never_reads_the_test_split(tmp_path):
    """Two runs whose data differ only in the test split train, validate and choose best.pt
    identically; only their test figures differ."""
    results = {}
    for n in (32, 96):
        root = tmp_path / f"t{n}"
        root.mkdir()
        raw = tiny_config(root, data={"test_size": n}, stages=[
            {"name": "s1", "epochs": 2, "batch_size": 32, "lr": 0.05}])
        p = write_config(root, raw)
        ddpflow("prepare", "--config", p, check=True)
        ddpflow("launch", "--config", p, "--stage", "s1", check=True)
        stage = root / "results/t/stages/s1"
        recs = [json.loads(x) for x in (stage / "metrics.jsonl").open()]
        results[n] = ([r for r in recs if r["kind"] == "val"],
                      torch.load(stage / "best.pt", weights_only=True),
                      json.loads((stage / "summary.json").read_text()))
    (val_a, best_a, sum_a), (val_b, best_b, sum_b) = results[32], results[96]
    for a, b in zip(val_a, val_b):
        assert {k: v for k, v in a.items() if k.startswith("val_")} == {
            k: v for k, v in b.items() if k.startswith("val_")}
    assert best_a["step"] == best_b["step"]
    assert all(torch.equal(best_a["model"][k], best_b["model"][k]) for k in best_a["model"])
    meta = [json.loads((tmp_path / f"t{n}/results/t/data/meta.json").read_text())
            for n in (32, 96)]
    assert meta[0]["sha256"]["train_images.npy"] == meta[1]["sha256"]["train_images.npy"]
    assert sum_a["test_metrics"] != sum_b["test_metrics"]


def test_predict_refuses_a_bundle_that_is_not_a_classifier(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b/model.json").write_text(json.dumps(
        {"format_version": 1, "task": "regression", "files": {}}))
    r = ddpflow("predict", "--bundle", tmp_path / "b", tmp_path)
    assert r.returncode == 2 and "holds a regression model" in r.stderr
    assert "Traceback" not in r.stderr and not (REPO / "predictions.csv").exists()
