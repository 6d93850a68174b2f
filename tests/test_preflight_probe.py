"""The launcher's probe of the model on the meta device (launch/launcher._model_on_meta): one
forward at the data's image size before any rank starts, so a model that cannot run on the
data is one message naming what to change, never a traceback from every rank."""

from __future__ import annotations

import sys
import textwrap

import pytest

from conftest import tiny_config
from ddpflow.config import from_dict
from ddpflow.core.errors import UserError
from ddpflow.launch.launcher import _model_on_meta

META = {"image_shape": [16, 16, 3], "num_classes": 10}


def _probe(tmp_path, model, image_size=16):
    cfg = from_dict(tiny_config(tmp_path, model=model, data={"image_size": image_size}))
    return _model_on_meta(cfg, {**META, "image_shape": [image_size, image_size, 3]})


def test_a_model_that_runs_at_the_data_s_size_is_returned(tmp_path):
    model = _probe(tmp_path, {"name": "smallcnn", "kwargs": {"width": 8}})
    assert next(model.parameters()).device.type == "meta"


def test_a_built_in_s_kwargs_value_that_breaks_its_forward_names_model_kwargs(tmp_path):
    # smallcnn width 0 builds, then fails in its forward (an IndexError, not a RuntimeError)
    with pytest.raises(UserError) as e:
        _probe(tmp_path, {"name": "smallcnn", "kwargs": {"width": 0}})
    text = str(e.value)
    assert text.startswith("model.name 'smallcnn' with model.kwargs {'width': 0} fails on a "
                           "probe batch of 3 x 16 x 16 (IndexError: "), text
    assert text.endswith("check the values of model.kwargs (or data.image_size)")
    assert "\n" not in text


def test_images_too_small_for_the_model_name_data_image_size(tmp_path):
    with pytest.raises(UserError) as e:
        _probe(tmp_path, {"name": "smallcnn"}, image_size=2)
    text = str(e.value)
    assert text.startswith("data.image_size 2 is too small for model.name 'smallcnn' (")
    assert text.endswith("); use larger images or another model") and "RuntimeError" not in text


def _user_model(tmp_path, monkeypatch, name, forward):
    code = tmp_path / "code"
    code.mkdir(exist_ok=True)
    (code / f"{name}.py").write_text(textwrap.dedent(f"""
        import torch
        from torch import nn

        def build(num_classes, in_channels):
            class Net(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.fc = nn.Linear(in_channels, num_classes)

                def forward(self, x):
        {textwrap.indent(textwrap.dedent(forward), ' ' * 20)}
            return Net()
    """))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return {"name": f"{name}:build", "code_dir": str(code)}


def test_the_probe_s_output_keeps_the_seam_contract(tmp_path, monkeypatch):
    # one output per image but 3 classes for the data's 10: the contract's message, by name
    model = _user_model(tmp_path, monkeypatch, "narrow_head",
                        "return self.fc(x.mean((2, 3)))[:, :3]")
    with pytest.raises(UserError) as e:
        _probe(tmp_path, model)
    assert str(e.value).startswith("model.name narrow_head:build returned a Tensor of shape "
                                   "(2, 3)"), str(e.value)


def test_an_op_without_a_meta_kernel_skips_the_probe_and_keeps_the_model(tmp_path,
                                                                          monkeypatch):
    model = _user_model(tmp_path, monkeypatch, "no_meta_kernel",
                        "raise NotImplementedError('no meta kernel for this op')")
    assert next(_probe(tmp_path, model).parameters()).device.type == "meta"


def test_a_user_dataset_s_model_is_only_built(tmp_path):
    cfg = from_dict(tiny_config(tmp_path))
    model = _model_on_meta(cfg, {"kind": "python", "num_classes": 10, "in_channels": 3,
                                 "input_shape": [3, 16, 16]})
    assert next(model.parameters()).device.type == "meta"


def test_a_user_model_whose_forward_fails_otherwise_is_named_with_the_size(tmp_path,
                                                                         monkeypatch):
    model = _user_model(tmp_path, monkeypatch, "probe_breaks", """
        if x.shape[-1] != 32:  # a model made for one size
            raise ValueError(f"expects 32 x 32 images, not {x.shape[-1]}")
        return self.fc(x.mean((2, 3)))""")
    with pytest.raises(UserError) as e:
        _probe(tmp_path, model)
    text = str(e.value)
    assert text.startswith("model.name 'probe_breaks:build' fails on a probe batch of 3 x 16 "
                           "x 16 (ValueError: expects 32 x 32 images, not 16); "), text
    assert text.endswith("check its forward() with images of that size")
