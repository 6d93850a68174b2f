"""inference/export.py beyond tests/test_inference_unit.py: the images each format is checked
on (the validation split, the training split when a source has no validation split, at
most CHECK_IMAGES); a model whose Python-level forward changes from one call to the next (a
counter, a cache) traces to another graph on each call, which tracing's own sanity check
would refuse while the file gives the model's outputs (what the format's check compares);
the ONNX file's batch dimension on its output; and, where torch reports a GPU, the
TorchScript file run there too (a file that fails there is that format's failure).
Fast: tiny models on the CPU, one small prepared data set.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import tiny_config, write_config
from ddpflow import cli
from ddpflow.config import load_config
from ddpflow.data import crops, prepared
from ddpflow.inference import export
from ddpflow.inference.common import preprocess


class _Counting(torch.nn.Module):
    """The same outputs on every call, by another graph on every other call."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 3)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        y = self.fc(x.flatten(1))
        return y if self.calls % 2 else y * 1.0


def test_a_model_traced_to_another_graph_each_call_is_written_by_its_outputs(tmp_path):
    model = _Counting().eval()
    x = torch.randn(5, 1, 2, 2)
    with torch.no_grad():
        ref = model(x)
    c = export._write_format("torchscript", model, x, ref, tmp_path / "m.ts")
    assert c["ok"] is True and c["error"] is None and c["images"] == 5, c
    loaded = torch.jit.load(str(tmp_path / "m.ts"))
    assert torch.allclose(loaded(x), ref, atol=1e-6)


def test_the_onnx_files_logits_have_the_dynamic_batch_and_fixed_classes(tmp_path):
    import onnx

    model = _Counting().eval()
    x = torch.randn(5, 1, 2, 2)
    with torch.no_grad():
        ref = model(x)
    assert export._write_format("onnx", model, x, ref, tmp_path / "m.onnx")["ok"]
    out = onnx.load(str(tmp_path / "m.onnx")).graph.output
    dims = out[0].type.tensor_type.shape.dim
    assert [(d.dim_param, d.dim_value) for d in dims] == [("batch", 0), ("", 3)]


def test_the_check_images_are_validations_or_the_training_ones_without_it(tmp_path):
    raw = tiny_config(tmp_path, data={"train_size": 40, "val_size": 6, "test_size": 3,
                                      "num_classes": 3, "image_size": 8})
    cfg = load_config(write_config(tmp_path, raw))
    assert cli.main(["prepare", "--config", str(tmp_path / "config.yaml")]) == 0
    meta, arrays = prepared.load(cfg.data_dir)
    pre = preprocess(meta["mean"], meta["std"], 8, 3, torch.device("cpu"),
                     crops.eval_sizes(cfg.data))

    def expected(split, n):
        return pre(torch.from_numpy(np.array(arrays[split][0][:n])))

    x = export._check_batch(cfg, meta, 3)
    assert x.shape == (6, 3, 8, 8) and torch.equal(x, expected("val", 6))


def test_without_validation_images_the_check_images_are_training_ones(tmp_path):
    """An image folder whose val/ images are all unreadable (within data.max_bad_fraction):
    the prepared val split is empty."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in "ab":
        (tmp_path / "imgs" / "train" / c).mkdir(parents=True)
        (tmp_path / "imgs" / "val" / c).mkdir(parents=True)
        for i in range(20):
            Image.fromarray(rng.integers(0, 255, (10, 10, 3), dtype=np.uint8)).save(
                tmp_path / "imgs" / "train" / c / f"{i}.png")
        (tmp_path / "imgs" / "val" / c / "x.png").write_bytes(b"not a png")
    raw = tiny_config(tmp_path, data={"source": "imagefolder", "path": str(tmp_path / "imgs"),
                                      "image_size": 8, "max_bad_fraction": 0.1})
    for k in ("train_size", "val_size", "test_size", "difficulty"):
        raw["data"].pop(k)
    cfg = load_config(write_config(tmp_path, raw))
    assert cli.main(["prepare", "--config", str(tmp_path / "config.yaml")]) == 0
    meta, arrays = prepared.load(cfg.data_dir)
    assert len(arrays["val"][0]) == 0 and len(arrays["train"][0]) > export.CHECK_IMAGES
    pre = preprocess(meta["mean"], meta["std"], 8, 3, torch.device("cpu"),
                     crops.eval_sizes(cfg.data))
    x = export._check_batch(cfg, meta, 3)
    assert torch.equal(x, pre(torch.from_numpy(np.array(
        arrays["train"][0][:export.CHECK_IMAGES]))))


def test_where_torch_reports_a_gpu_the_torchscript_file_is_run_there_too(tmp_path,
                                                                           monkeypatch):
    """On a machine without one, a reported GPU is one the file cannot be loaded on: the
    TorchScript format fails naming it, and says where it was run."""
    if torch.cuda.is_available():
        pytest.skip("a real GPU: tests/test_gpu_paths.py runs the file there")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert export.checked_on("torchscript") == ["cpu", "cuda"]
    assert export.checked_on("onnx") == export.checked_on("safetensors") == ["cpu"]
    model = _Counting().eval()
    x = torch.randn(3, 1, 2, 2)
    with torch.no_grad():
        ref = model(x)
    c = export._write_format("torchscript", model, x, ref, tmp_path / "m.ts")
    assert c["ok"] is False and c["checked_on"] == ["cpu", "cuda"]
    assert c["error"].startswith("the TorchScript file fails on cuda (traced on the CPU; a "
                                 "tensor made in forward keeps the CPU device?): "), c
    assert not (tmp_path / "m.ts").exists()
