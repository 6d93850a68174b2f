"""engine/settings.py: the settings a stage runs with, resolved once from its config and
`ddpflow tune`'s tune.json (used only when measured for these settings; damaged or foreign,
it is named), precision `auto` on a CPU, and what each precision turns on. Fast: no
training, tune.json written as tune writes it."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_config
from ddpflow.config import from_dict
from ddpflow.core.errors import UserError
from ddpflow.engine import settings

CPU = torch.device("cpu")
CHOICE = {"batch_size": 48, "loader": "device", "num_workers": 0, "prefetch_factor": None,
          "precision": "bf16", "channels_last": True, "compile": True}


def _cfg(tmp_path, **stage):
    cfg = tiny_config(tmp_path)
    cfg["stages"] = [{**cfg["stages"][0], **stage}]
    c = from_dict(cfg)
    return c, c.stages[0]


def _tuned(cfg, stage, choice=None, settings_=None):
    path = settings.tune_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    s = settings.tune_settings(cfg, stage) if settings_ is None else settings_
    path.write_text(json.dumps({"settings": s, "choice": choice or CHOICE}))
    return path


def test_batch_auto_without_tune_json_is_one_message(tmp_path):
    cfg, st = _cfg(tmp_path, batch_size="auto")
    with pytest.raises(UserError) as e:
        settings.resolve(cfg, st, CPU, print)
    assert str(e.value) == (f"stages.0.batch_size is auto but there is no "
                            f"{settings.tune_path(cfg)}; run `ddpflow tune` first")


def test_tunes_choice_is_taken_for_auto_when_measured_for_these_settings(tmp_path):
    cfg, st = _cfg(tmp_path, batch_size="auto", precision="auto", channels_last="auto")
    _tuned(cfg, st)
    said = []
    s = settings.resolve(cfg, st, CPU, said.append)
    assert (s.batch_size, s.precision, s.channels_last, s.compile) == (48, "bf16", True, True)
    assert s.tuned == CHOICE and said == []


def test_a_stage_of_its_own_settings_keeps_them_beside_a_tune_json(tmp_path):
    cfg, st = _cfg(tmp_path, batch_size=16, precision="fp32", channels_last="auto")
    _tuned(cfg, st)
    s = settings.resolve(cfg, st, CPU, print)
    assert (s.batch_size, s.precision, s.channels_last, s.compile) == (16, "fp32", True, False)
    cfg, st = _cfg(tmp_path, batch_size=16, precision="fp32", channels_last=False)
    assert settings.resolve(cfg, st, CPU, print).channels_last is False


def test_fsdp_takes_tunes_choice_uncompiled(tmp_path):
    cfg, st = _cfg(tmp_path, batch_size="auto", precision="auto", strategy="fsdp")
    _tuned(cfg, st)
    assert settings.resolve(cfg, st, CPU, print).compile is False


def test_a_tune_json_measured_for_other_settings_is_named_and_not_used(tmp_path):
    cfg, st = _cfg(tmp_path, batch_size=16, precision="fp32")
    other = {**settings.tune_settings(cfg, st), "model.name": "resnet50", "optimizer": "adamw"}
    path = _tuned(cfg, st, settings_=other)
    said = []
    s = settings.resolve(cfg, st, CPU, said.append)
    why = (f"{path} was measured for other settings (model.name, optimizer); run `ddpflow "
           f"tune` again")
    assert s.tuned is None and said == [f"not using tune.json: {why}"]
    cfg, st = _cfg(tmp_path, batch_size="auto")
    with pytest.raises(UserError) as e:
        settings.resolve(cfg, st, CPU, print)
    assert str(e.value).startswith(f"stages.0.batch_size is auto but {path} was measured")


def test_a_damaged_tune_json_is_named(tmp_path):
    cfg, st = _cfg(tmp_path)
    path = _tuned(cfg, st, choice={**CHOICE, "batch_size": 0})
    choice, why = settings.load_choice(cfg, st)
    assert choice is None and why.startswith(f"{path} (ddpflow tune's result): "
                                             f"choice.batch_size: 0 is below the minimum 1")
    assert why.endswith("run `ddpflow tune` again")
    path.unlink()
    assert settings.load_choice(cfg, st) == (None, None)


@pytest.mark.parametrize("forced, want", [("1", "bf16"), ("0", "fp32")])
def test_precision_auto_on_a_cpu_follows_its_bf16(monkeypatch, forced, want):
    monkeypatch.setenv("DDPFLOW_CPU_BF16", forced)
    assert settings.cpu_has_fast_bf16() is (forced == "1")
    assert settings.pick_precision("auto", CPU) == want
    assert settings.pick_precision("fp16", CPU) == "fp16"


def test_without_an_override_onednn_answers(monkeypatch):
    monkeypatch.setenv("DDPFLOW_CPU_BF16", "maybe")
    assert settings.cpu_has_fast_bf16() is bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@pytest.mark.parametrize("precision, scaled, dtype", [
    ("fp16", True, torch.float16), ("bf16", False, torch.bfloat16), ("fp32", False, None)])
def test_what_each_precision_turns_on(precision, scaled, dtype):
    scaler, autocast = settings.mixed_precision(precision, CPU)
    assert scaler.is_enabled() is scaled
    with autocast:
        assert torch.is_autocast_enabled("cpu") is (dtype is not None)
        if dtype is not None:
            assert torch.get_autocast_dtype("cpu") == dtype


def test_tf32_is_a_gpu_switch_only():
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    settings.set_backend_flags(CPU, "fp32")
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


# GPU-only branches, on this CPU machine: a torch.device("cuda") is only a name here; where
# the answer comes from the GPU itself (is it bf16-native?) that one call is faked
CUDA = torch.device("cuda")


def test_fsdp_with_precision_auto_on_a_gpu_without_bf16_is_refused_saying_auto_picked_it(
        tmp_path):
    assert torch.cuda.is_bf16_supported(including_emulation=False) is False  # no GPU here
    cfg, st = _cfg(tmp_path, precision="auto", strategy="fsdp")
    with pytest.raises(UserError) as e:
        settings.resolve(cfg, st, CUDA, print)
    assert str(e.value).startswith("stages.0.precision: ") and (
        "(what precision auto picks on a GPU without native bf16)" in str(e.value)), e.value


@pytest.mark.parametrize("native, emulated, want", [
    (True, True, "bf16"),  # Ampere and later
    (False, True, "fp16"),  # bf16 only emulated (a T4, a V100): fp16 and a GradScaler
    (False, False, "fp16")])
def test_precision_auto_on_a_gpu(monkeypatch, native, emulated, want):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: emulated if including_emulation
                        else native)
    assert settings.pick_precision("auto", CUDA) == want


def test_without_onednn_a_cpu_has_no_fast_bf16(monkeypatch):
    monkeypatch.delenv("DDPFLOW_CPU_BF16", raising=False)

    def absent():
        raise RuntimeError("mkldnn is not available in this build")

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", absent)
    assert settings.cpu_has_fast_bf16() is False


@pytest.mark.parametrize("precision, on", [("fp32", True), ("bf16", False)])
def test_fp32_on_a_gpu_runs_on_tf32_tensor_cores(precision, on):
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        settings.set_backend_flags(CUDA, precision)
        assert torch.backends.cuda.matmul.allow_tf32 is on
        assert torch.backends.cudnn.allow_tf32 is on
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
