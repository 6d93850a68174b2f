"""engine/memory.py's measurements on a CPU, in this process: a micro-batch's activations
(what autograd keeps, each storage once; with checkpointed blocks their inputs, and what
they would have kept without checkpointing) and `ddpflow tune`'s memory trial of one step
(its precision, layout, crop, input pipeline and wrapper's extra, the rank's budget, the
errors that are not an answer). Then the readings engine/runtime.py records (the peak, the
environment) and tunebudget's warm-up clock; their CUDA branches with stand-ins for the
device's calls, as tests/test_gpu_paths.py does. Fast: tiny models, no training run.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import platform
import resource
import socket
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from conftest import tiny_config
from ddpflow.config import from_dict
from ddpflow.data.crops import center_crop
from ddpflow.data.loaders import Normalize
from ddpflow.engine import distributed, memory, runtime, sharding, tune, tunebudget
from ddpflow.engine.settings import AMP_DTYPE
from ddpflow.seams.models import build_model

CPU = torch.device("cpu")


# ------------------------------------------------------------------ activations

def _net() -> nn.Sequential:
    """Linear 4->8, a block (Linear 8->8, Tanh, Linear 8->8), ReLU, Linear 8->2."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh(),
                                                        nn.Linear(8, 8)),
                         nn.ReLU(), nn.Linear(8, 2))


def _idle():
    """Nothing of a meter is left behind: no measuring, no notes, no hooks."""
    return sharding.Measure.on is False and sharding.Measure.kept == {}


def test_a_micro_batch_s_activations_are_what_autograd_keeps_each_storage_once():
    model, x = _net(), torch.randn(3, 4)
    with memory.activation_meter([]) as out:
        loss = model(x).sum()
    # x (48 bytes), the first Linear's output (96), Tanh's output, kept by it and the next
    # Linear (96 once), ReLU's output, kept by it and the last Linear (96 once); weights not
    assert out == {"activations": 48 + 3 * 96}
    assert _idle()
    loss.backward()  # the graph is whole
    assert model[0].weight.grad is not None


def test_with_checkpointed_blocks_their_inputs_count_and_what_they_would_have_kept():
    plain = _net()
    x = torch.randn(3, 4)
    with memory.activation_meter([]) as without:
        plain(x).sum().backward()
    model = copy.deepcopy(plain)
    block = model[1]
    sharding.checkpoint_blocks([block])
    with memory.activation_meter([block]) as out:
        loss = model(x).sum()
    # x, the block's input (the first Linear's output), ReLU's output: the block's inner
    # tensors are recomputed in the backward
    assert out == {"activations": 48 + 96 + 96,
                   "without_checkpointing": without["activations"]}
    assert without["activations"] == 48 + 3 * 96
    assert _idle() and not block._forward_pre_hooks
    loss.backward()
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.allclose(a.grad, b.grad)
    # the meter is over: a later forward of the checkpointed block is not measured
    model(x)
    assert _idle()


def test_a_failing_micro_batch_leaves_no_measuring_behind():
    model = _net()
    block = model[1]
    sharding.checkpoint_blocks([block])
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
        with memory.activation_meter([block]):
            model(torch.randn(3, 5))
    assert sharding.Measure.on is False and not block._forward_pre_hooks
    sharding.Measure.kept = {}
    with memory.activation_meter([]) as out:  # a meter after it counts afresh
        _net()(torch.randn(3, 4))
    assert out == {"activations": 48 + 3 * 96}


# ------------------------------------------------------------------ tune's memory trial

@pytest.fixture
def probe(tmp_path):
    """A one-rank Probe on 64 random 16x16 images, trained at a 12-pixel crop, a SmallCNN of
    4 classes, no budget limit, and an extra of 1000 bytes (the wrapper's)."""
    cfg = from_dict(tiny_config(tmp_path, tune={"steps": 1, "start_batch": 4, "max_batch": 64},
                                stages=[{"name": "s1", "max_steps": 6, "batch_size": "auto"}],
                                data={"image_size": 12}))
    assert cfg.data.image_size == 12
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (64, 16, 16, 3), dtype=np.uint8)
    labels = rng.integers(0, 4, 64).astype(np.int64)
    meta = {"num_classes": 4, "mean": [0.5] * 3, "std": [0.25] * 3, "image_shape": [16, 16, 3]}
    d = distributed.Dist(0, 0, 1, CPU, None)
    base = build_model(cfg.model, 4, 3)
    pace = tune.Pace(d, 600.0, False)
    pace.say = lambda msg: None
    return tune.Probe(cfg, cfg.stage("s1"), d, meta, images, labels, 3, base, 10**12, 1000,
                      pace)


def _step(p, b: int, precision: str, channels_last: bool) -> int:
    """What one step of b needs, built here as a training step's batch is: normalised, the
    training crop, the model in the layout."""
    norm = Normalize(p.meta["mean"], p.meta["std"], CPU, p.in_ch, channels_last)
    x = center_crop(norm(torch.from_numpy(p.images[:b])), p.cfg.data.image_size)
    y = torch.from_numpy(p.labels[:b])
    model = p.base.to(memory_format=torch.channels_last if channels_last
                      else torch.contiguous_format)
    return memory.step_memory(model, x, y, AMP_DTYPE[precision], CPU)


def _conv_weights(model):
    return [m.weight for m in model.modules() if isinstance(m, nn.Conv2d)]


def test_a_trial_is_the_step_at_the_training_crop_plus_the_pipeline_and_the_wrapper(probe):
    pipeline = memory.input_bytes(8, (16, 16, 3), 3, 12)
    assert pipeline == 8 * (16 * 16 * 3 + 2 * 4 * 3 * 12 * 12)
    step = _step(probe, 8, "fp32", False)
    before = time.perf_counter()
    need = probe.step_bytes(8, "fp32", False)
    elapsed = time.perf_counter() - before
    assert need == step + 1000 + pipeline
    assert 0 < probe.last_step_s <= elapsed  # the step's own seconds
    # the crop is what the model sees: a 16-pixel step needs more
    probe.cfg = dataclasses.replace(probe.cfg, data=dataclasses.replace(probe.cfg.data,
                                                                        image_size=16))
    assert probe.step_bytes(8, "fp32", False) > need


def test_a_trial_measures_at_the_precision_it_is_asked(probe):
    fp32 = probe.step_bytes(8, "fp32", False)
    bf16 = probe.step_bytes(8, "bf16", False)
    assert bf16 == _step(probe, 8, "bf16", False) + 1000 + memory.input_bytes(8, (16, 16, 3),
                                                                              3, 12)
    assert bf16 < fp32  # autocast keeps half-size activations


def test_a_trial_puts_the_model_in_the_layout_it_is_asked(probe):
    need = probe.step_bytes(8, "fp32", True)
    assert all(w.is_contiguous(memory_format=torch.channels_last)
               and not w.is_contiguous() for w in _conv_weights(probe.base))
    assert need == _step(probe, 8, "fp32", True) + 1000 + memory.input_bytes(8, (16, 16, 3),
                                                                             3, 12)
    probe.step_bytes(8, "fp32", False)
    assert all(w.is_contiguous() for w in _conv_weights(probe.base))


def test_a_trial_fits_up_to_exactly_the_rank_s_budget(probe):
    need = probe.step_bytes(8, "fp32", False)
    probe.budget = need
    assert probe.step_bytes(8, "fp32", False) == need
    probe.budget = need - 1
    assert probe.step_bytes(8, "fp32", False) is None


def test_a_split_of_one_sample_is_tried_at_any_batch(probe):
    probe.images, probe.labels = probe.images[:1], probe.labels[:1]
    need = probe.step_bytes(4, "fp32", False)  # the one sample, 4 times
    probe.images = np.repeat(probe.images, 4, axis=0)
    probe.labels = np.repeat(probe.labels, 4)
    assert need == _step(probe, 4, "fp32", False) + 1000 + memory.input_bytes(
        4, (16, 16, 3), 3, 12)


def test_an_error_that_is_not_out_of_memory_is_raised_not_taken_for_a_miss(probe):
    probe.labels = np.full(64, 7, dtype=np.int64)  # a 4-class model: class 7 does not exist
    with pytest.raises(IndexError, match="Target 7 is out of bounds"):
        probe.step_bytes(8, "fp32", False)


def test_after_every_trial_on_a_gpu_the_allocator_s_cache_is_emptied(probe, monkeypatch):
    """torch.cuda.empty_cache is a stand-in, and the trial's upload fails as an allocation
    would (no GPU here): the release comes after a miss too, and never on a CPU."""
    released = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: released.append(True))
    assert probe.step_bytes(4, "fp32", False) > 0 and released == []

    def oom(*a, **k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
    monkeypatch.setattr(memory, "Normalize", oom)
    probe.dist = distributed.Dist(0, 0, 1, torch.device("cuda"), None)
    assert probe.step_bytes(4, "fp32", False) is None
    assert released == [True]


# ------------------------------------------------------------------ engine/runtime.py

def _peak_rss_mib() -> float:
    """The kernel's high-water mark of this process's resident set (VmHWM, KiB), in MiB."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines()
                if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def test_a_cpu_s_peak_is_the_process_s_resident_high_water_mark_in_mib():
    got = runtime.peak_memory_mib(CPU)
    assert got == resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    hwm = _peak_rss_mib()  # updated at other moments than ru_maxrss: close, not equal
    assert abs(got - hwm) < 0.02 * hwm, (got, hwm)


def test_a_gpu_s_peak_is_the_allocator_s_for_that_device_in_mib(monkeypatch):
    """torch.cuda.max_memory_allocated is a stand-in (no GPU here)."""
    asked = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated",
                        lambda device: asked.append(device) or 3 * 2**29)
    gpu = torch.device("cuda", 1)
    assert runtime.peak_memory_mib(gpu) == 1536.0 and asked == [gpu]


def test_the_environment_names_the_versions_and_the_machine_a_cpu_stage_ran_on(monkeypatch):
    from ddpflow import __version__

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    assert runtime.environment(CPU) == {
        "ddpflow": __version__, "python": platform.python_version(),
        "torch": torch.__version__, "host": socket.gethostname(), "cpu_count": os.cpu_count(),
        "cuda": torch.version.cuda, "cpu_affinity": sorted(os.sched_getaffinity(0)),
        "cudnn": cudnn, "nccl": None, "gpus": [], "driver": None,
        "cuda_visible_devices": "2,3", "slurm_job_id": "4242"}
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.delenv("SLURM_JOB_ID")
    env = runtime.environment(CPU)
    assert env["cuda_visible_devices"] is None and env["slurm_job_id"] is None


def test_the_cudnn_version_is_none_where_cudnn_is_not_available(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 90100)
    assert runtime.environment(CPU)["cudnn"] is None
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    assert runtime.environment(CPU)["cudnn"] == 90100


@pytest.fixture
def two_gpus(monkeypatch):
    """Stand-ins for what torch and NVML read of a node with two GPUs (no GPU here)."""
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"NVIDIA H100 #{i}")
    nvml = SimpleNamespace(nvmlInit=lambda: None, nvmlSystemGetDriverVersion=lambda: "550.54")
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return nvml


def test_on_a_gpu_the_environment_names_nccl_every_gpu_and_the_driver(two_gpus):
    env = runtime.environment(torch.device("cuda", 0))
    assert (env["nccl"], env["gpus"], env["driver"]) == (
        "2.21.5", ["NVIDIA H100 #0", "NVIDIA H100 #1"], "550.54")
    cpu = runtime.environment(CPU)  # a CPU stage on the same node: no GPU facts
    assert (cpu["nccl"], cpu["gpus"], cpu["driver"]) == (None, [], None)


def test_without_nvml_the_driver_stays_unknown_and_the_rest_is_recorded(two_gpus):
    def no_driver():
        raise RuntimeError("NVML Shared Library Not Found")
    two_gpus.nvmlInit = no_driver
    env = runtime.environment(torch.device("cuda", 0))
    assert (env["nccl"], env["gpus"], env["driver"]) == (
        "2.21.5", ["NVIDIA H100 #0", "NVIDIA H100 #1"], None)


# ------------------------------------------------------------------ tunebudget's clock

def test_on_a_gpu_the_warm_up_clock_reads_after_the_queued_work_is_done(monkeypatch):
    """torch.cuda.synchronize is a stand-in: the queued work takes 2 s of the test's clock."""
    now = [100.0]
    synced = []

    def synchronize(device):
        synced.append(device)
        now[0] += 2.0
    monkeypatch.setattr(tunebudget, "clock", lambda: now[0])
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    gpu = torch.device("cuda", 0)
    assert tunebudget._now(gpu) == 102.0 and synced == [gpu]
    assert tunebudget._now(CPU) == 102.0 and synced == [gpu]  # a CPU has nothing queued
