"""The GPU code paths, where their mechanism can run on a CPU: FLOP counting with
torch.compile and with DataParallel's threads, the order of clock and sync at a log line, the
peak-FLOPs table, the device loader's upload, and DataParallel's threads per process.
What only a GPU can show is checked by bench/gpu.sh."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from conftest import REPO, ddpflow, tiny_config, write_config
from ddpflow.engine.efficiency import FlopCount, peak_for_name, replica_flops


@pytest.mark.parametrize("name, precision, peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989e12),
    ("NVIDIA H100 NVL", "bf16", 835e12),
    ("NVIDIA H200 NVL", "fp16", 835e12),
    ("NVIDIA H200", "bf16", 989e12),
    ("NVIDIA H100 PCIe", "fp32", 378e12),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
    ("NVIDIA RTX A1000", "bf16", None),  # not an A100
    ("NVIDIA A10", "bf16", 125e12),
    ("NVIDIA L40S", "bf16", 362e12),
    ("NVIDIA L4", "bf16", 121e12),
    ("Tesla V100-SXM2-16GB", "fp16", 125e12),
    ("NVIDIA GeForce RTX 4090", "bf16", 165e12),
    ("Some Future GPU", "bf16", None),
])
def test_the_peak_table_matches_whole_words_and_the_most_specific_name(name, precision, peak):
    assert peak_for_name(name, precision) == peak


class _SlowScalar:
    """A loss sum whose .item() blocks, as a CUDA tensor's does until queued kernels finish."""

    def __init__(self, wait_s: float):
        self.wait_s = wait_s

    def item(self) -> float:
        time.sleep(self.wait_s)
        return 2.0

    def zero_(self):
        return self


def test_a_log_interval_reads_the_clock_after_the_sync(monkeypatch):
    from ddpflow.engine.distributed import Dist
    from ddpflow.engine.intervals import IntervalLogger
    from ddpflow.engine.state import TrainState

    seen = {}
    setup = SimpleNamespace(devices=[torch.device("cpu")], total_steps=100)
    log = type("Log", (), {"write": lambda self, r: r})()
    logger = IntervalLogger(setup, every=5, start_step=10, name="s", log=log, is_master=True)
    line = {"step": 10, "epoch": 0, "loss": 0.3, "lr": 0.1, "samples_per_s": 1.0,
            "data_wait_fraction": 0.0, "stragglers": []}
    monkeypatch.setattr(logger, "record",
                        lambda s, per_rank, dt, **k: seen.setdefault("dt", dt) and line)
    logger.restart()
    logger.steps = 5
    # the interval's work "still queued" when the line starts
    counters = SimpleNamespace(loss_sum=_SlowScalar(0.3), bad_steps=lambda: (-1, -1),
                               skipped=torch.tensor(0))
    said = logger.write(TrainState(step=10, loss_count=5), counters,
                        Dist(0, 0, 1, torch.device("cpu"), None),
                        SimpleNamespace(get_last_lr=lambda: [0.1]),
                        SimpleNamespace(is_enabled=lambda: False), 1.0, 0.0)
    logger.close()
    assert not said.stop_asked and not said.bad_steps
    assert seen["dt"] >= 0.3  # the wait for the queued work is inside the interval


def _thread_forward(model, x):
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("y", model(x)))
    th.start()
    th.join()
    return out["y"]


def test_dataparallel_flops_are_counted_outside_its_threads():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Flatten(),
                          nn.Linear(8 * 14 * 14, 10))
    x = torch.randn(8, 3, 16, 16)
    with FlopCount() as direct:
        model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    # the mechanism: a replica's forward in another thread is invisible to the counter
    with FlopCount() as threaded:
        _thread_forward(model, x).sum().backward()
    assert threaded.total < direct.total
    model.zero_grad(set_to_none=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    counted = replica_flops(model, (x, torch.zeros(8)), 8, 2,
                            lambda m, b: m(b[0]).sum().backward())
    assert counted == direct.total  # half the batch counted, scaled to all of it
    # nothing of the counting pass stays: statistics, random stream, gradients
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters())


def test_compile_compiles_and_its_flops_are_counted(tmp_path):
    """The FLOP-counted first step runs eagerly; every other step runs the compiled model.
    (torch 2.14 compiles on the next call after a frame skipped under the counter; the
    trainer no longer relies on that.)"""
    stage = {"name": "c", "max_steps": 6, "batch_size": 16, "lr": 0.05}
    cfg = tiny_config(tmp_path, log_every_steps=3,
                      hardware={"nproc_per_node": 1, "threads_per_rank": 2},
                      checkpoint={"every_steps": 0, "every_epochs": 0},
                      stages=[{**stage, "compile": True}, {**stage, "name": "e"}])
    p = write_config(tmp_path, cfg)
    ddpflow("prepare", "--config", p, check=True)
    for name in ("c", "e"):
        ddpflow("launch", "--config", p, "--stage", name, check=True, timeout=900)
    s = {n: json.loads((tmp_path / f"results/t/stages/{n}/summary.json").read_text())
         for n in ("c", "e")}
    assert s["c"]["compile"] is True and s["c"]["compiled_graphs"] >= 1
    assert s["e"]["compiled_graphs"] is None
    assert s["c"]["flops_per_sample"] == s["e"]["flops_per_sample"] > 0


_UPLOAD = r"""
import sys, threading, time
import numpy as np, torch
from ddpflow.data.loaders import BadSamples, upload

def anon_mib():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024

images = np.memmap(sys.argv[1], dtype=np.uint8, mode="r").reshape(-1, 64, 64, 3)
labels = np.arange(len(images)) % 10
peak, done = [anon_mib()], threading.Event()
def sample():
    while not done.is_set():
        peak.append(anon_mib())
        time.sleep(0.002)
threading.Thread(target=sample, daemon=True).start()
x, y = upload(images, labels, np.arange(len(images)), torch.device(sys.argv[2]),
              BadSamples("train", len(images), 0.0, 0))
done.set()
print(len(x), int(y[-1]) if y.device.type == "cpu" else -1, max(peak) - peak[0])
"""


def test_the_device_upload_holds_one_chunk_of_host_memory_not_the_split(tmp_path):
    """A 2 GiB split goes to the "device" chunk by chunk: the meta device stands in for a
    GPU (it keeps no bytes), so the process's anonymous memory is what the upload itself
    holds on the host. Reading the whole split first (np.array) held all 2 GiB."""
    n = 2 * 2**30 // (64 * 64 * 3)
    np_file = tmp_path / "train_images.u8"
    np.memmap(np_file, dtype=np.uint8, mode="w+", shape=(n, 64, 64, 3)).flush()  # sparse
    script = tmp_path / "upload.py"
    script.write_text(_UPLOAD)
    out = subprocess.run([sys.executable, str(script), str(np_file), "meta"], check=True,
                         capture_output=True, text=True).stdout.split()
    rows, _, growth_mib = int(out[0]), int(out[1]), float(out[2])
    assert rows == n
    assert growth_mib < 300, f"the upload held {growth_mib:.0f} MiB of host memory"


def test_the_device_upload_keeps_every_row_in_order(tmp_path):
    from ddpflow.data.loaders import BadSamples, upload

    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, (1000, 8, 8, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, 1000)
    idx = np.arange(3, 1000, 4)  # a rank's strided share, as validation reads it
    x, y = upload(images, labels, idx, torch.device("cpu"),
                  BadSamples("val", 1000, 0.0, 0), chunk_bytes=5000)  # 26 rows a chunk
    assert torch.equal(x, torch.from_numpy(images[idx])) and y.tolist() == labels[idx].tolist()


def test_dataparallel_gets_the_cores_its_ranks_would_have_shared(tmp_path, monkeypatch):
    import os

    from ddpflow.config import from_dict
    from ddpflow.launch import launcher as launch

    monkeypatch.setattr(launch, "visible_gpus", lambda: 4)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)))
    cfg = from_dict(tiny_config(tmp_path, hardware={"nproc_per_node": "auto",
                                                    "threads_per_rank": "auto"},
                                stages=[{"name": "ddp"}, {"name": "dp", "strategy": "dp"}]))
    n, _, env = launch.stage_ranks(cfg, "ddp")
    assert n == 4 and env["DDPFLOW_THREADS"] == "4"  # 16 cores shared by 4 ranks
    n, _, env = launch.stage_ranks(cfg, "dp")
    assert n == 1 and env["DDPFLOW_THREADS"] == env["OMP_NUM_THREADS"] == "16"


NONDET_MODEL = '''
import torch
from torch import nn
from torch._prims_common import alert_not_deterministic


class Net(nn.Module):
    """What a CUDA kernel without a deterministic version does under deterministic mode
    (bilinear interpolate's backward, say): it asks torch to alert (the same message as the
    C++ kernels' alert), and torch raises."""

    def __init__(self, num_classes, in_channels):
        super().__init__()
        self.fc = nn.Linear(in_channels * 16 * 16, num_classes)

    def forward(self, x):
        alert_not_deterministic("my_pool_backward_cuda")
        return self.fc(x.flatten(1))


def build(num_classes, in_channels):
    return Net(num_classes, in_channels)
'''


def test_a_kernel_without_a_deterministic_version_is_one_message(tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    (code / "nondet.py").write_text(NONDET_MODEL)
    cfg = tiny_config(tmp_path, deterministic=True,
                      model={"name": "nondet:build", "code_dir": str(code)},
                      hardware={"nproc_per_node": 2, "threads_per_rank": 1, "max_restarts": 2},
                      stages=[{"name": "s", "max_steps": 4, "batch_size": 16}])
    p = write_config(tmp_path, cfg)
    ddpflow("prepare", "--config", p, check=True)
    proc = ddpflow("launch", "--config", p, "--stage", "s")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert ("deterministic: true, but model nondet:build runs my_pool_backward_cuda, which has "
            "no deterministic kernel") in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("no deterministic kernel") == 1  # no restarts of the ranks
    assert not (tmp_path / "results/t/stages/s/summary.json").exists()


def test_doctor_matches_other_processes_to_gpus_by_uuid(monkeypatch):
    """CUDA_VISIBLE_DEVICES=3,1: torch's GPU 0 is NVML's 3. Only the UUID ties them; the
    NVML and torch calls are stand-ins (no GPU here), the matching is doctor's own."""
    import types

    from ddpflow.launch import doctor

    uuids = {0: "aaaa", 1: "bbbb", 2: "cccc", 3: "dddd"}  # NVML (physical) order
    visible = [3, 1]
    nvml = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: 4,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUUID=lambda h: f"GPU-{uuids[h]}",
        nvmlDeviceGetComputeRunningProcesses=lambda h: (
            [types.SimpleNamespace(usedGpuMemory=2**30)] if h == 3 else []),
        nvmlSystemGetDriverVersion=lambda: "999.1")
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    props = [types.SimpleNamespace(name="NVIDIA H200", uuid=uuids[i], major=9, minor=0,
                                   multi_processor_count=132) for i in visible]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (100 * 2**30, 140 * 2**30))
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 3))
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    text = doctor.report()
    assert "GPU 0 is shared with 1 process(es)" in text
    assert "GPU 1 is shared" not in text and "driver 999.1" in text


def test_the_gpu_table_prints_missing_figures_as_dashes(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    from gpu_table import table

    p = tmp_path / "summary.json"
    p.write_text(json.dumps({"stage": "s", "config": {"run": "r", "model": {"name": "resnet18"},
                                                      "data": {"image_size": 32}},
                             "batch_size_per_rank": 64, "precision": "bf16", "mfu": None,
                             "mean_samples_per_s": 1234.5, "wall_samples_per_s": None,
                             "gpu_util": None, "data_wait_fraction": None}))
    out = table([p]).splitlines()
    assert out[2].startswith("| r/s | resnet18 | 32 | 64 | bf16 |")
    assert "| 1234 | - | - |" in out[2] and out[2].endswith("| - | - |")


def test_a_resumed_fused_optimizer_keeps_each_parameters_layout():
    """Found with channels_last on by default: checkpoints copied to the host contiguous,
    and fused SGD then read a contiguous momentum buffer beside a channels_last weight.
    Saved in its own layout, restored into the parameter's, a resumed step is exact."""
    from ddpflow.engine.checkpoint import HostCopy
    from ddpflow.engine.resume import _match_layouts

    def run(resume_via_host: bool, contiguous_state: bool):
        torch.manual_seed(0)
        p = nn.Parameter(torch.randn(4, 3, 3, 3).contiguous(memory_format=torch.channels_last))
        g = torch.randn(4, 3, 3, 3).contiguous(memory_format=torch.channels_last)
        opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, fused=True)
        p.grad = g.clone()
        opt.step()
        if resume_via_host:
            saved = HostCopy()(opt.state_dict())
            assert saved["state"][0]["momentum_buffer"].stride() == p.stride()
            if contiguous_state:  # a checkpoint of another layout
                saved["state"][0]["momentum_buffer"] = \
                    saved["state"][0]["momentum_buffer"].contiguous()
            opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, fused=True)
            opt.load_state_dict(saved)
            _match_layouts(opt)
        p.grad = g.clone()
        opt.step()
        return p.detach()

    straight = run(False, False)
    assert torch.equal(straight, run(True, False))
    assert torch.equal(straight, run(True, True))


# --------------------------------------------------------------- two gloo ranks, one script
_RANK_PREAMBLE = """
import json, os, sys
import torch
from ddpflow.config import from_dict
from ddpflow.engine import distributed
cfg = from_dict(json.loads(os.environ["DDPFLOW_TEST_CFG"]))
d = distributed.setup(cfg.hardware)
"""


def two_ranks(tmp_path, body: str, cfg: dict | None = None, name: str = "ranks") -> list:
    """Runs `body` (after _RANK_PREAMBLE: cfg, d) on 2 gloo ranks, started as torchrun
    would start them (its environment, without its agent process); returns each rank's
    last stdout line, parsed as JSON, in rank order."""
    import socket

    script = tmp_path / f"{name}.py"
    script.write_text(_RANK_PREAMBLE + body)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "DDPFLOW_TEST_CFG": json.dumps(cfg or tiny_config(tmp_path)),
           "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    procs = [subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


_DROPOUT_BODY = """
from types import SimpleNamespace
from ddpflow.engine.build import model_parts
from ddpflow.seams.models import unwrap
out = []
for run in range(2):  # the setup, then a rerun of it
    distributed.seed_everything(cfg.seed, d.rank, cfg.deterministic)
    data = SimpleNamespace(in_channels=3, num_classes=10, use_channels_last=lambda on: None)
    parts = model_parts(cfg, cfg.stages[0], d, data, 8, "fp32", False, False, lambda m: None)
    init = [float(p.detach().double().sum()) for p in unwrap(parts.model).parameters()]
    mask = torch.nn.functional.dropout(torch.ones(256), 0.5).ne(0).int().tolist()
    out.append({"init": init, "mask": mask})
print(json.dumps(out), flush=True)
distributed.teardown(d)
"""


def test_ranks_share_the_model_init_but_draw_their_own_dropout_masks(tmp_path):
    """Every rank seeded torch with the same seed: dropout and drop-path masks were the same
    on all ranks. The init stays shared; after it each rank has its own, repeatable, stream."""
    (first, again), (first1, again1) = two_ranks(tmp_path, _DROPOUT_BODY, name="dropout")
    assert first["init"] == first1["init"]  # the model is built on the shared seed
    assert first["mask"] != first1["mask"]  # ... and the ranks' streams differ after it
    assert (again["mask"], again1["mask"]) == (first["mask"], first1["mask"])  # repeatable


def test_augmentation_streams_do_not_collide_across_many_ranks():
    """The step's seed was seed*1_000_003 + epoch*10_007 + step*101 + rank: rank 101 at step
    0 drew rank 0's step-1 crops and flips. Now the tuple is hashed (core/seeds.py)."""
    from ddpflow.data.loaders import step_generator

    cpu = torch.device("cpu")
    seeds = {step_generator(cpu, 7, epoch, step, rank).initial_seed()
             for epoch in range(3) for step in range(50) for rank in range(512)}
    assert len(seeds) == 3 * 50 * 512
    a, b = (torch.rand(8, generator=step_generator(cpu, 7, 2, 49, 511)) for _ in range(2))
    assert torch.equal(a, b)  # a resume redraws the same augmentation at the same position


@pytest.mark.parametrize("where", ["stage", "tune"])
def test_compile_with_deterministic_is_one_message(tmp_path, where):
    """Inductor's autotuned kernels are outside use_deterministic_algorithms: the pair is
    refused when the config is read, naming the key, before anything trains."""
    from ddpflow.config import from_dict
    from ddpflow.core.errors import UserError

    cfg = tiny_config(tmp_path, deterministic=True)
    if where == "stage":
        cfg["stages"][0]["compile"] = True
    else:
        cfg["tune"] = {"compile": True}
    key = "stages.0.compile" if where == "stage" else "tune.compile"
    with pytest.raises(UserError, match=rf"{key} is true with deterministic: true"):
        from_dict(cfg)
    cfg["deterministic"] = False
    from_dict(cfg)  # either alone is fine


_RESTORE_BODY = """
from types import SimpleNamespace
from ddpflow.core.errors import UserError
from ddpflow.engine import checkpoint, resume
from ddpflow.engine.checkpointer import Parts
files = SimpleNamespace(ckpt_dir=__import__("pathlib").Path(sys.argv[1]), resume_key="k")
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
scaler = torch.amp.GradScaler("cpu", enabled=False)
parts = Parts(model, model, opt, sched, scaler, None, False)
if d.rank == 1:  # this rank's listing missed the newest checkpoint (a write landing between)
    listing = checkpoint.list_checkpoints
    checkpoint.list_checkpoints = lambda folder: listing(folder)[:-1]
chosen = resume.choose(files, d)
saved = resume.restore(chosen, files, d, parts, 1)
out = {"step": saved["step"], "bias": float(model.bias), "file": chosen.path.name}
if d.rank == 1:  # the file rank 0 chose cannot be read here: every rank stops, one message
    checkpoint.load = lambda p, map_location="cpu": open("/nonexistent/" + p.name, "rb")
try:
    resume.restore(resume.choose(files, d), files, d, parts, 1)
except UserError as e:
    out["error"] = str(e)
print(json.dumps(out), flush=True)
distributed.teardown(d)
"""


def test_every_rank_resumes_from_the_checkpoint_rank_0_chose(tmp_path):
    """Each rank picked "the newest valid checkpoint" by its own listing: a rank that missed
    the newest trained on from an older step. Rank 0 chooses; a rank that cannot load its
    choice is an error on every rank, not a silent divergence."""
    from ddpflow.engine import checkpoint

    folder = tmp_path / "ckpt"
    for step in (4, 8):
        model = nn.Linear(2, 1)
        nn.init.constant_(model.bias, float(step))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        checkpoint.save(folder, step, {
            "model": model.state_dict(), "optimizer": opt.state_dict(),
            "scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0).state_dict(),
            "scaler": torch.amp.GradScaler("cpu", enabled=False).state_dict(), "step": step,
            "resume_key": "k", "rng": []}, keep_last=3)
    ranks = two_ranks(tmp_path, _RESTORE_BODY.replace("sys.argv[1]", repr(str(folder))),
                      name="restore")
    assert [(r["step"], r["bias"]) for r in ranks] == [(8, 8.0), (8, 8.0)]
    for r in ranks:
        assert r["error"].startswith("rank 1 cannot resume from ckpt-000000008.pt, the "
                                     "checkpoint rank 0 chose (step 8): it cannot be read")


_LOADER_BODY = """
from ddpflow.data.loaders import choose_loader
from ddpflow.engine import build
GiB = 2**30
build.free_memory = lambda device: (8 if d.rank == 0 else 1) * GiB  # rank 1 has less free
meta = {"num_classes": 10, "image_shape": [16, 16, 3]}
free, note = build.loader_budget(cfg, d, meta)
kind, reason = choose_loader("auto", NBYTES, d.device, 1.0, free, note)
print(json.dumps({"free": free, "kind": kind, "reason": reason}), flush=True)
distributed.teardown(d)
"""


def test_the_ranks_agree_on_the_loader_and_count_the_model(tmp_path):
    """Each rank chose the device loader or DataLoader workers from its own free memory: one
    rank could hold the dataset while another streamed it. The ranks take the least free
    memory of any, less the model's weights, gradients and optimizer state."""
    from ddpflow.config import from_dict
    from ddpflow.seams.models import build_model

    cfg = tiny_config(tmp_path, data={"loader": "auto"})  # what this test is about
    model = build_model(from_dict(cfg).model, 10, 3)
    state = 4 * sum(p.numel() * p.element_size() for p in model.parameters())
    # fits in rank 0's 8 GiB, and in rank 1's 1 GiB only if the model were not counted
    nbytes = 2**30 - state // 2
    ranks = two_ranks(tmp_path, _LOADER_BODY.replace("NBYTES", str(nbytes)), cfg,
                      name="loader")
    assert [r["free"] for r in ranks] == [2**30 - state] * 2
    assert [r["kind"] for r in ranks] == ["dataloader", "dataloader"]
    assert "of 2 ranks, after the model's" in ranks[0]["reason"]


def _bn_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 2))


def test_the_ema_matches_averaged_model_without_a_sync_per_update(monkeypatch):
    """torch's AveragedModel kept its count as a tensor (compared on the host at every
    update: a device sync on a GPU) and looped over the buffers; the EMA keeps an int and
    lerps every float tensor in one fused call, with the same result, and resumes exactly."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    from ddpflow.engine.ema import Ema

    torch.manual_seed(0)
    model = _bn_net()
    ref = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    ema, resumed = Ema(model, 0.9, 1), None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    syncs = []

    def counting(name):
        real = getattr(torch.Tensor, name)
        return lambda *a: syncs.append(name) or real(*a)

    for step in range(1, 21):
        model(torch.randn(4, 3, 8, 8)).square().mean().backward()  # BN statistics move too
        opt.step()
        opt.zero_grad()
        ref.update_parameters(model)
        with monkeypatch.context() as m:  # a host read of a tensor, or a new one, per update
            for name in ("item", "__bool__", "tolist"):
                m.setattr(torch.Tensor, name, counting(name))
            m.setattr(torch, "tensor", lambda *a, **k: syncs.append("tensor"))
            ema.update(model, step)
            if resumed:
                resumed.update(model, step)
        if step == 10:  # a checkpoint's "ema" and "ema_updates", into a fresh EMA
            resumed = Ema(_bn_net(), 0.9, 1)
            resumed.load(ema.weights(), ema.updates())
    assert syncs == []
    assert ema.updates() == int(ref.n_averaged) == 20
    want = ref.module.state_dict()
    for name, t in ema.weights().items():
        if t.is_floating_point():
            torch.testing.assert_close(t, want[name], rtol=1e-6, atol=1e-7)
        else:  # num_batches_tracked: copied (AveragedModel averaged the integer)
            assert torch.equal(t, model.state_dict()[name])
    assert all(torch.equal(t, resumed.weights()[k]) for k, t in ema.weights().items())


def test_a_damaged_checkpoint_sidecar_is_skipped_not_raised(tmp_path):
    """Rank 0 alone chooses the checkpoint now: whatever it meets in the folder must be a
    reason to skip a file, never an exception that leaves the other ranks waiting in the
    broadcast. A sidecar that is not text and a checkpoint that is a folder are skipped."""
    from ddpflow.engine import checkpoint

    for step in (4, 8, 12):
        checkpoint.save(tmp_path, step, {"step": step, "resume_key": "k"}, keep_last=5)
    (tmp_path / "ckpt-000000012.pt.sha256").write_bytes(b"\xff\xfe\x00 not utf-8")
    (tmp_path / "ckpt-000000008.pt").unlink()
    (tmp_path / "ckpt-000000008.pt").mkdir()
    warned = []
    found = checkpoint.latest_valid(tmp_path, "k", warn=lambda *a, **k: warned.append(a[0]))
    assert found is not None and found[1]["step"] == 4
    assert len(warned) == 2 and "ckpt-000000012.pt" in warned[0]


def test_no_checkpoint_folder_yet_is_no_checkpoint_not_an_error(tmp_path):
    from ddpflow.engine import checkpoint

    assert checkpoint.list_checkpoints(tmp_path / "checkpoints") == []
    assert checkpoint.latest_valid(tmp_path / "checkpoints", "k", warn=None) is None


# ------------------------------------------- issue 36: copies, counts, evaluate, lazydynamo
class _FakeEvent:
    """torch.cuda.Event's stand-in: records how often a staging slot was waited for."""

    waits = 0

    def record(self):
        pass

    def synchronize(self):
        _FakeEvent.waits += 1


def test_the_device_upload_copies_images_and_labels_from_pinned_memory_without_blocking(
        monkeypatch):
    """The labels went from pageable memory with a blocking copy, so the two pinned image
    buffers never overlapped anything. On a stand-in GPU (the CUDA calls replaced; the
    buffers are host memory), every copy to the device is from a pinned buffer and
    non-blocking, images and labels alike, and the rows arrive in order."""
    from ddpflow.data.loaders import BadSamples, upload

    real_empty, real_copy = torch.empty, torch.Tensor.copy_
    pinned, copies = set(), []

    def empty(*shape, pin_memory=False, device=None, **kw):
        t = real_empty(*shape, device="cpu" if str(device).startswith("cuda") else device,
                       **kw)
        if pin_memory:
            pinned.add(t.untyped_storage().data_ptr())
        return t

    def copy_(dst, src, non_blocking=False):
        copies.append((src.dtype, src.untyped_storage().data_ptr() in pinned, non_blocking))
        return real_copy(dst, src, non_blocking)

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: SimpleNamespace(synchronize=lambda: None))
    _FakeEvent.waits = 0
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, (100, 4, 4, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, 100).astype(np.int32)
    idx = np.arange(1, 100, 2)
    x, y = upload(images, labels, idx, torch.device("cuda"), BadSamples("val", 100, 0.0, 0),
                  chunk_bytes=10 * 48)  # 10 rows a chunk: 5 chunks
    assert torch.equal(x, torch.from_numpy(images[idx])) and y.tolist() == labels[idx].tolist()
    assert [c[0] for c in copies] == [torch.uint8, torch.int64] * 5
    assert all(is_pinned and non_blocking for _, is_pinned, non_blocking in copies), copies
    assert _FakeEvent.waits == 3  # chunks 3-5 wait for their slot's copies of two chunks ago


class _LoggedRows:
    """uint8 images whose batch reads are announced (an Event per batch's first row)."""

    def __init__(self, images, batch):
        self.images, self.batch, self.shape = images, batch, images.shape
        self.read = [threading.Event() for _ in range(0, len(images), batch)]

    def __getitem__(self, idx):
        self.read[int(idx[0]) // self.batch].set()
        return self.images[idx]


def test_streamed_validation_reads_ahead_and_copies_from_pinned_memory(monkeypatch):
    """Streamed validation read and decoded each batch on the main thread, then copied it
    "non_blocking" from pageable memory (a blocking copy). Now a thread reads the next
    batch while this one is used, into pinned memory on a GPU (stand-ins for pin_memory
    and the copy: no GPU here)."""
    from ddpflow.data.loaders import Normalize, val_batches

    moved = []
    real_to = torch.Tensor.to

    def pin_memory(t, *a, **k):
        out = t.clone()
        out.pinned_stand_in = True
        return out

    def to(t, *args, **kw):
        if args and isinstance(args[0], torch.device) and args[0].type == "cuda":
            moved.append((getattr(t, "pinned_stand_in", False), kw.get("non_blocking", False)))
            return t
        return real_to(t, *args, **kw)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 255, (20, 4, 4, 3), dtype=np.uint8)
    labels = np.arange(20) % 3
    images = _LoggedRows(raw, 4)  # one rank of one: batches of rows 0-3, 4-7, ...
    norm = Normalize([0.5] * 3, [0.25] * 3, torch.device("cpu"), 3, channels_last=False)
    batches = val_batches(images, labels, torch.device("cuda"), 1, 0, norm)(4)
    seen = []
    for k, (x, y) in enumerate(batches):
        if k + 1 < len(images.read):  # the next batch is read while this one is in use
            assert images.read[k + 1].wait(10), f"batch {k + 1} was not read ahead"
        seen.append((x, y))
    assert len(seen) == 5
    torch.testing.assert_close(torch.cat([x for x, _ in seen]),
                               norm(torch.from_numpy(raw)))
    assert torch.cat([y for _, y in seen]).tolist() == labels.tolist()
    assert moved == [(True, True)] * 10  # images and labels of 5 batches


def test_validation_counts_make_no_tensor_per_batch(monkeypatch):
    """A validation batch made a tensor of its sample count from a Python number (on a GPU
    a blocking copy to the device, every batch). The tensors made from host numbers are
    now as many for 8 batches as for 2: the reductions' few, once per validation."""
    import contextlib

    from ddpflow.engine.distributed import Dist
    from ddpflow.engine.validation import Validator
    from ddpflow.seams.tasks import Classification

    torch.manual_seed(0)
    net = nn.Linear(6, 3)
    x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))
    d = Dist(0, 0, 1, torch.device("cpu"), None)
    made = []

    def counting(real):
        def make(data, *a, **k):
            if not isinstance(data, torch.Tensor):
                made.append(data)
            return real(data, *a, **k)
        return make

    def validate(batch):
        v = Validator(d, Classification(), "classification", contextlib.nullcontext(),
                      batch, lambda text: None)
        v.batch = batch
        split = lambda b: ((x[i:i + b], y[i:i + b]) for i in range(0, 64, b))  # noqa: E731
        made.clear()
        with monkeypatch.context() as m:
            for name in ("tensor", "as_tensor", "scalar_tensor"):
                m.setattr(torch, name, counting(getattr(torch, name)))
            out = v.metrics(net, split)
        return out, len(made)

    (few, n_few), (many, n_many) = validate(32), validate(8)
    assert n_few == n_many <= 3
    with torch.no_grad():
        logits = net(x)
    assert few["val_acc"] == many["val_acc"] == (logits.argmax(1) == y).double().mean().item()
    assert few["val_loss"] == pytest.approx(
        torch.nn.functional.cross_entropy(logits, y).item(), rel=1e-6)


_EVALUATE_BODY = """
import numpy as np
import torch.distributed as dist
from ddpflow.inference import evaluate
from ddpflow.inference.common import scores

def all_to_all(*a, **k):
    raise AssertionError("every rank received every rank's objects")

dist.all_gather_object = distributed.gather_objects = all_to_all
torch.manual_seed(0)
model = torch.nn.Linear(12, 5)
rng = np.random.default_rng(0)
x_all = rng.integers(0, 255, (9, 2, 2, 3), dtype=np.uint8)  # 9 images on 2 ranks
y_all = rng.integers(0, 5, 9)
pre = lambda x: x.float().flatten(1) / 255
idx = evaluate.share(9, d.rank, d.world)
tally = evaluate.run_share(model, pre, lambda a, b: x_all[idx[a:b]], y_all[idx], 5,
                           d.device, batch=2)
held = evaluate.combine(d, tally, idx, [("f%d" % d.rank, "unreadable")])
out = {"held": None}
if held is not None:
    total, every, skipped = held
    evaluate.each_once(every, 9 + 2, len(skipped))  # (the two 'skipped' count as images)
    with torch.no_grad():
        want = scores(model(pre(torch.from_numpy(x_all))), torch.from_numpy(y_all), 5)
    out = {"held": sorted(every.tolist()), "skipped": skipped, "got": total.scores(),
           "want": want}
print(json.dumps(out), flush=True)
distributed.teardown(d)
"""


def test_evaluate_scores_on_each_rank_and_only_rank_0_receives_the_sums(tmp_path):
    """evaluate gathered every rank's logits onto every rank. Each rank now scores its share
    on its device (confusion matrix, loss and top-5 sums), the sums are reduced to rank 0,
    and only rank 0 receives the image numbers (for the each-image-once check): the same
    figures as scoring all outputs at once, on a split not a multiple of the ranks."""
    rank0, rank1 = two_ranks(tmp_path, _EVALUATE_BODY, name="evaluate")
    assert rank1 == {"held": None}
    assert rank0["held"] == list(range(9))
    assert rank0["skipped"] == [["f0", "unreadable"], ["f1", "unreadable"]]
    got, want = rank0["got"], rank0["want"]
    assert got["samples"] == 9 and got["confusion"] == want["confusion"]
    assert (got["acc"], got["top5"], got["per_class"]) == (
        want["acc"], want["top5"], want["per_class"])
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)


_FALLBACK = """
import sys
import torch
from ddpflow.core import lazydynamo as lz

assert lz.defer() and lz.deferred()  # the installed torch: the stand-in fits
lz._uninstall()
real_install = lz._install

def broken(standin):
    sys.modules[lz.NAME] = standin
    raise RuntimeError("simulated")

lz._install = broken
print("install fails:", lz.defer(), lz.NAME in sys.modules, file=sys.stderr)
lz._install, lz._said[:] = real_install, []
lz.SERVED += (("newtorch", "optim.py"),)  # a torch that uses more than the stand-in has
print("mismatch:", lz.defer(), lz.defer(), lz.NAME in sys.modules, file=sys.stderr)
torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1).step()  # torch imports it
print("real:", type(sys.modules[lz.NAME]) is type(sys), not lz.deferred(), file=sys.stderr)
"""


def test_the_dynamo_stand_in_fits_the_installed_torch_or_is_not_used(tmp_path, monkeypatch):
    """The stand-in answers what torch asks of torch._dynamo where it is used untraced; that
    is torch's internals. Checked against the installed torch's files at each served point;
    a torch that uses more (a name it lacks, an argument its function does not take) or an
    install that fails leaves the real import in place and says so, once."""
    from ddpflow.core import lazydynamo as lz

    assert lz.mismatches() == []
    used = {chain for package, rel in lz.SERVED if package == "torch"
            for chain, _ in lz.uses((Path(torch.__file__).parent / rel).read_text())}
    assert {"disable", "graph_break", "utils.get_optimize_ddp_mode",
            "trace_rules.clear_lru_cache"} <= used
    pkg = tmp_path / "newtorch"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "optim.py").write_text(
        "import torch._dynamo\n"
        "torch._dynamo.graph_break()\n"
        "torch._dynamo.mark_static_address(p)\n"
        "f = torch._dynamo.disable(fn, recursive, wrapping=False, cache=True)\n"
        "from torch._dynamo.utils import (is_compile_supported,\n    counters)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    problems = lz.mismatches(served=(("newtorch", "optim.py"),))
    assert [p.split(" uses ")[1] for p in problems] == [
        "torch._dynamo.mark_static_address, which the stand-in lacks",
        "torch._dynamo.disable(fn, recursive, wrapping=False, cache=True), which the stand-in "
        "does not accept",
        "torch._dynamo.utils.counters, which the stand-in lacks"]
    script = tmp_path / "fallback.py"
    script.write_text(_FALLBACK)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)},
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    warned = [line for line in lines if line.startswith("ddpflow: warning: torch._dynamo")]
    assert len(warned) == 2, proc.stderr  # once for each cause (the record was reset)
    assert "installing it failed (RuntimeError: simulated)" in warned[0]
    assert "mark_static_address, which the stand-in lacks (and 2 more)" in warned[1]
    assert "install fails: False False" in lines
    assert "mismatch: False False False" in lines
    assert "real: True True" in lines


# ------------------------------------------------ channels_last: auto probes on every device
class _ViewNet(nn.Module):
    """Calls `.view` on a feature map: fine in NCHW, raises once channels_last makes the
    map non-contiguous (the model that used to fail only on the GPU)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, 5)

    def forward(self, x):
        h = self.conv(x)
        return self.fc(h.view(h.shape[0], -1))


def _decide(tmp_path, monkeypatch, model, device_type: str, deterministic=False):
    """layout.decide() for `model` as on a `device_type` rank 0 (a CUDA rank is a stand-in:
    its probe runs on the CPU); returns ((on, why), [shapes the probe ran])."""
    from ddpflow.engine import distributed, layout

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    shapes, real = [], getattr(layout.probe, "real", layout.probe)

    def spy(m, shape, autocast, device, reps=3):
        shapes.append(tuple(shape))
        assert device.type == device_type
        return real(m, shape, autocast, torch.device("cpu"), reps)

    spy.real = real
    monkeypatch.setattr(layout, "probe", spy)
    monkeypatch.setattr(layout, "device_name", lambda dev: f"stand-in {dev.type}")
    d = distributed.Dist(0, 0, 1, torch.device(device_type), None)
    got = layout.decide("auto", model, d, (6, 3, 8, 8), torch.autocast("cpu", enabled=False),
                        deterministic, tmp_path / "layout.json", {"model": "view"})
    return got, shapes


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_auto_layout_keeps_a_model_that_fails_in_channels_last_in_nchw(
        tmp_path, monkeypatch, device_type):
    """No "CUDA => NHWC" branch: a GPU rank probes like a CPU rank, at the stage's own batch
    size, and a model whose `.view` fails in channels_last trains in NCHW (no crash)."""
    model = _ViewNet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    (on, why), shapes = _decide(tmp_path, monkeypatch, model, device_type)
    assert on is False and shapes == [(6, 3, 8, 8)], (why, shapes)
    assert "fails in channels_last" in why and "at batch 6" in why and "view" in why, why
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.conv.weight.is_contiguous()  # left in NCHW, no gradient
    assert model.conv.weight.grad is None
    kept = next(iter(json.loads((tmp_path / "layout.json").read_text()).values()))
    assert kept["batch"] == 6 and kept["channels_last_s"] is None
    # the kept answer is reused (no second probe), on rank 0 as on a resume
    (on2, why2), shapes2 = _decide(tmp_path, monkeypatch, model, device_type)
    assert (on2, why2, shapes2) == (False, why, [])
    # deterministic mode times nothing, but still runs one pass in channels_last
    (on3, why3), shapes3 = _decide(tmp_path, monkeypatch, model, device_type, True)
    assert on3 is False and shapes3 == [(6, 3, 8, 8)] and "fails in channels_last" in why3


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_auto_layout_probes_a_convnet_on_every_device(tmp_path, monkeypatch, device_type):
    from ddpflow.seams.models import SmallCNN

    (on, why), shapes = _decide(tmp_path, monkeypatch, SmallCNN(10, 3), device_type)
    assert shapes == [(6, 3, 8, 8)] and "at batch 6" in why and "speed of NCHW" in why, why
    kept = next(iter(json.loads((tmp_path / "layout.json").read_text()).values()))
    assert on == (kept["nchw_s"] / kept["channels_last_s"] >= 1.05)
    (on_d, why_d), _ = _decide(tmp_path / "det", monkeypatch, SmallCNN(10, 3), device_type,
                               True)
    assert on_d is True and "deterministic" in why_d


def test_the_stage_probe_runs_at_the_stage_batch_size(tmp_path, monkeypatch):
    from ddpflow.engine import layout

    seen = []
    monkeypatch.setattr(layout, "decide", lambda setting, model, d, shape, *a: seen.append(
        shape) or (False, ""))
    cfg = SimpleNamespace(data=SimpleNamespace(image_size=8), deterministic=False,
                          run_dir=tmp_path, model=SimpleNamespace(name="m", kwargs={}))
    d = SimpleNamespace(device=torch.device("cpu"))
    layout.for_stage("auto", cfg, _ViewNet(), d, 48, 3, "fp32")
    assert seen == [(48, 3, 8, 8)]  # not capped at 16: the batch the stage's steps run


def _tune_probe(tmp_path, monkeypatch):
    """A `ddpflow tune` rank's Probe on one CPU process over a small in-memory split, with
    each candidate's timed steps stubbed out (what is counted here is built before them)."""
    from ddpflow.config import from_dict
    from ddpflow.engine import throughput, tune
    from ddpflow.engine.distributed import Dist
    from ddpflow.seams.models import build_model

    cfg = from_dict(tiny_config(tmp_path, tune={"steps": 1}))
    d = Dist(0, 0, 1, torch.device("cpu"), None)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, (64, 16, 16, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, 64)
    meta = {"mean": [0.5] * 3, "std": [0.25] * 3, "image_shape": [16, 16, 3],
            "num_classes": 10}
    base = build_model(cfg.model, 10, 3)
    monkeypatch.setattr(throughput, "micro_step", lambda *a, **k: torch.tensor(1.0))
    monkeypatch.setattr(throughput, "update", lambda *a, **k: None)
    return tune.Probe(cfg, cfg.stages[0], d, meta, images, labels, 3, base, 2**40, 0,
                      tune.Pace(d, 600, climb_by_throughput=False))


def test_one_tune_uploads_the_device_dataset_once_and_empties_the_cache_between_candidates(
        tmp_path, monkeypatch):
    """Every candidate built its own TrainBatches, and the device loader's each uploaded
    (decoded) the whole split again: 11-16 uploads per tune, with no cache release between
    candidates. Now the split goes to the device once, every device-loader candidate
    indexes the same tensors, and after each candidate its garbage is collected and the
    allocator's cache emptied (torch.cuda.empty_cache and gc.collect are stand-ins here:
    release() is given a "cuda" device)."""
    from ddpflow.data import loaders, resident
    from ddpflow.engine import throughput, tune

    p = _tune_probe(tmp_path, monkeypatch)
    events, held = [], []
    real_upload, real_release, real_measure = (resident.upload, throughput.release,
                                               tune.Probe.measure)
    real_init = loaders.TrainBatches.__init__

    def init(tb, *a, **k):
        real_init(tb, *a, **k)
        if tb.kind == "device":
            held.append(tb.images.data_ptr())

    def upload(*a, **k):
        events.append("upload")
        return real_upload(*a, **k)

    def measure(self, batch, loader, *a):
        events.append(f"measure {loader}")
        return real_measure(self, batch, loader, *a)

    monkeypatch.setattr(loaders.TrainBatches, "__init__", init)
    monkeypatch.setattr(resident, "upload", upload)
    monkeypatch.setattr(tune.Probe, "measure", measure)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    monkeypatch.setattr(throughput.gc, "collect", lambda: events.append("collect"))
    monkeypatch.setattr(throughput, "release",
                        lambda device: real_release(SimpleNamespace(type="cuda")))
    tune.choose(p, 16, "fp32", True)
    measured = [e for e in events if e.startswith("measure")]
    assert len(measured) >= 10 and "measure device" in measured
    assert events.count("upload") == 1 and p.uploads == 1
    assert len(held) > 1 and len(set(held)) == 1  # every device candidate: the same tensors
    # each candidate is followed by a cache release before the next one starts
    assert [e for e in events if e != "upload"] == [
        e for m in measured for e in (m, "collect", "empty_cache")]


@pytest.mark.parametrize("fp16, bf16, chosen", [
    (1000.0, 950.0, "bf16"),  # 5% faster: noise, bf16
    (1000.0, 910.0, "bf16"),  # 9.9%: still bf16
    (1100.0, 1000.0, "bf16"),  # exactly 10%: not more than the margin
    (1000.0, 900.0, "fp16"),  # 11.1%: clearly faster
    (900.0, 1000.0, "bf16"),
])
def test_fp16_is_chosen_over_bf16_only_when_more_than_10_percent_faster(fp16, bf16, chosen):
    from ddpflow.engine.tune import FP16_MARGIN, pick_precision_row

    assert FP16_MARGIN == 1.10
    rows = [{"precision": "fp32", "channels_last": False, "samples_per_s": 500.0},
            {"precision": "bf16", "channels_last": False, "samples_per_s": bf16 * 0.9},
            {"precision": "bf16", "channels_last": True, "samples_per_s": bf16},
            {"precision": "fp16", "channels_last": True, "samples_per_s": fp16}]
    best = pick_precision_row(rows)
    assert best["precision"] == chosen
    if chosen == "bf16":
        assert best["channels_last"]  # bf16's fastest row, not any bf16 row
    assert pick_precision_row(rows[:1] + rows[3:])["precision"] == "fp16"  # no bf16 measured


def _batches(aug, size_at, monkeypatch):
    """One progressive-resizing epoch of stored 24 px images trained at 16 px, on the
    epoch's size_at; the crops and every resampling call are recorded."""
    from ddpflow.data import crops, loaders

    calls = []
    real_rrc, real_interp = loaders.random_resized_crop, torch.nn.functional.interpolate
    monkeypatch.setattr(loaders, "random_resized_crop",
                        lambda x, size, *a: calls.append(("crop", size)) or real_rrc(x, size,
                                                                                      *a))
    monkeypatch.setattr(torch.nn.functional, "interpolate",
                        lambda x, *a, **k: calls.append(("interpolate", k.get("size")))
                        or real_interp(x, *a, **k))
    monkeypatch.setattr(torch.nn.functional, "grid_sample",
                        lambda *a, **k: calls.append(("grid_sample",)))
    assert crops.F is torch.nn.functional
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, (16, 24, 24, 3), dtype=np.uint8)
    cpu = torch.device("cpu")
    tb = loaders.TrainBatches("device", images, np.arange(16) % 10, 8, cpu, 1, 0, 0, aug,
                              loaders.Normalize([0.5] * 3, [0.25] * 3, cpu, 3, False),
                              image_size=16)
    tb.size_at = size_at
    return [x for x, _ in tb.epoch(1)], calls


def test_progressive_resizing_crops_once_at_the_epochs_size(monkeypatch):
    """The random resized crop went to image_size and mixing.resize then resampled that
    again to the epoch's size (two resamplings, double blur). Now the crop is asked for the
    epoch's size itself, and nothing resamples after it."""
    from ddpflow.config.types import AugmentCfg

    rrc = AugmentCfg(0, True, 0, {"scale": [0.3, 1.0], "ratio": [0.75, 1.33]}, None, None, None)
    xs, calls = _batches(rrc, lambda epoch: 12, monkeypatch)
    assert [tuple(x.shape) for x in xs] == [(8, 3, 12, 12)] * 2
    assert calls == [("crop", 12)] * 2  # one resampling a batch: no interpolate after it
    # pad-and-crop then the centre crop: one antialiased resampling, to the epoch's size
    pad = AugmentCfg(2, True, 0, None, None, None, None)
    xs, calls = _batches(pad, lambda epoch: 12, monkeypatch)
    assert [tuple(x.shape) for x in xs] == [(8, 3, 12, 12)] * 2
    assert calls == [("interpolate", (round(12 / 0.875),) * 2)] * 2


def test_the_random_resized_crop_resamples_as_torchvision_with_antialiasing():
    """grid_sample's bilinear taps read 4 pixels whatever the box's size: a box 3x larger
    than the output aliased. Each box now resamples as torchvision's
    resize(antialias=True) of the cut-out box (shrinking and enlarging), mirrored or not."""
    from torchvision.transforms.v2 import functional as TF

    from ddpflow.data.crops import center_crop, crop_resize

    x = torch.rand(4, 3, 40, 36, generator=torch.Generator().manual_seed(0))
    boxes = torch.tensor([[2., 5., 30., 20.], [0., 0., 36., 40.], [10., 3., 7., 9.],
                          [4., 4., 32., 33.]])
    mirror = torch.tensor([False, True, False, True])
    for size in (8, 16, 24):
        out = crop_resize(x, boxes, size, mirror)
        for i, (left, top, bw, bh) in enumerate(boxes.long().tolist()):
            ref = TF.resize(x[i:i + 1, :, top:top + bh, left:left + bw], [size, size],
                            antialias=True)[0]
            ref = ref.flip(-1) if mirror[i] else ref
            assert torch.allclose(out[i], ref, atol=1e-5), (size, i)
        plain = torch.nn.functional.interpolate(  # without antialiasing: visibly different
            x[:1, :, 5:25, 2:32], size=(size, size), mode="bilinear", align_corners=False)
        assert size == 24 or (out[0] - plain[0]).abs().max() > 0.05
    # the centre crop at a smaller (progressive) size: the same antialiased resize
    y = torch.rand(2, 3, 16, 16)
    assert torch.allclose(center_crop(y, 16, 12), TF.resize(y, [12, 12], antialias=True))


_SHARED_DECODE = """
from pathlib import Path
import numpy as np
from ddpflow.data import resident, shards
from ddpflow.data.loaders import BadSamples

decoded = []
real = shards.decode_many
shards.decode_many = lambda bufs: decoded.extend(len(b) for b in bufs) or real(bufs)
folder = Path(FOLDER)
images = shards.JpegImages(folder, "train", (8, 8, 3),
                           json.loads((folder / "recorded.json").read_text()))
labels = np.load(folder / "train_labels.npy")
bad = BadSamples("train", len(labels), 0.2, d.rank)
x, y = resident.resident_split(images, labels, d.device, bad)
print(json.dumps({"decoded": len(decoded), "x": x.flatten().tolist(), "y": y.tolist(),
                  "bad": sorted(bad.seen)}), flush=True)
distributed.teardown(d)
"""


def test_jpeg_shards_are_decoded_once_per_node_and_shared_by_its_ranks(tmp_path):
    """With JPEG shards and the device loader every rank decoded the whole training split
    (eight times the work on an 8-GPU node). Now each of 2 gloo ranks decodes its half and
    the halves are exchanged: both ranks hold the full split, equal to one rank's decode,
    with the damaged sample (a flipped byte: its CRC fails) left out and known to both."""
    from ddpflow.data import shards
    from ddpflow.data.loaders import BadSamples, upload

    folder = tmp_path / "jpeg"
    folder.mkdir()
    rng = np.random.default_rng(0)
    n = 37  # odd: the shares differ in length
    shards.write_split(folder, "train", rng.integers(0, 255, (n, 8, 8, 3), dtype=np.uint8),
                       np.arange(n) % 10, quality=90, shard_bytes=4000)
    index = np.load(folder / "train_index.npy")
    k, off = int(index[5][0]), int(index[5][1])  # damage sample 5 (rank 0's half)
    shard = folder / shards.shard_name("train", k)
    data = bytearray(shard.read_bytes())
    data[off + 20] ^= 0xFF
    shard.write_bytes(bytes(data))
    recorded = {p.name: p.stat().st_size for p in folder.glob("*.jpgs")}
    (folder / "recorded.json").write_text(json.dumps(recorded))
    body = _SHARED_DECODE.replace("FOLDER", repr(str(folder)))
    r0, r1 = two_ranks(tmp_path, body, name="shared_decode")
    images = shards.JpegImages(folder, "train", (8, 8, 3), recorded)
    x, y = upload(images, np.load(folder / "train_labels.npy"), np.arange(n),
                  torch.device("cpu"), BadSamples("train", n, 0.2, 0))
    assert len(y) == n - 1
    assert (r0["decoded"], r1["decoded"]) == (18, 18)  # 19 and 18 read, one of 19 damaged
    for r in (r0, r1):
        assert r["x"] == x.flatten().tolist() and r["y"] == y.tolist()
        assert r["bad"] == [5]


# ------------------------------------------ predict --device cuda: what actually ran the model
def _onnx_bundle(tmp_path) -> Path:
    """A minimal 3-class bundle holding only model.onnx (no training needed)."""
    from ddpflow.core.checksum import sha256_of
    from ddpflow.core.writing import write_json_atomic

    bundle = tmp_path / "bundle"
    bundle.mkdir()
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(4, 3)).eval()
    torch.onnx.export(model, (torch.randn(2, 3, 16, 16),), str(bundle / "model.onnx"),
                      dynamo=False, opset_version=17, input_names=["input"],
                      output_names=["logits"], dynamic_axes={"input": {0: "batch"}})
    write_json_atomic(bundle / "model.json", {
        "format_version": 1, "task": "classification", "num_classes": 3,
        "classes": ["cat", "dog", "fish"], "input": {"channels": 3}, "image_size": 16,
        "store_size": 18, "grayscale": False, "mean": [0.5] * 3, "std": [0.25] * 3,
        "files": {"onnx": {"file": "model.onnx", "sha256": sha256_of(bundle / "model.onnx")}}})
    return bundle


def test_predict_onnx_names_the_provider_that_ran_and_refuses_cuda_it_cannot_take(
        tmp_path, monkeypatch, capsys):
    """This machine's onnxruntime has no CUDA provider. With a GPU (a stand-in: CUDA said to
    be available), --device cuda --format onnx is refused in one line naming the provider;
    --device auto runs it on the CPU and says CPUExecutionProvider, never "cuda"."""
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has a CUDA provider")
    from ddpflow.core.errors import UserError
    from ddpflow.inference.predict import predict
    from fixtures import image_tree

    bundle, photos = _onnx_bundle(tmp_path), image_tree(tmp_path / "photos", per_class=2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(UserError, match="runs on CPUExecutionProvider only") as e:
        predict(str(bundle), [str(photos)], str(tmp_path / "p.csv"), fmt="onnx",
                device="cuda")
    assert "\n" not in str(e.value) and not (tmp_path / "p.csv").exists()
    capsys.readouterr()
    assert predict(str(bundle), [str(photos)], str(tmp_path / "p.csv"), fmt="onnx",
                   device="auto") == 0
    out, err = capsys.readouterr()
    assert "6 image(s) predicted" in out and "(onnx on CPUExecutionProvider)" in out, out
    assert "cuda" not in out.lower() and "runs on CPUExecutionProvider" in err, err
    assert len((tmp_path / "p.csv").read_text().splitlines()) == 7


class _MakesATensor(nn.Module):
    """Creates a tensor inside forward: a trace bakes its device (the CPU) into the file."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(x.mean((2, 3))) + torch.ones(2)


def test_export_records_where_the_torchscript_file_ran(tmp_path, monkeypatch):
    from ddpflow.inference import export

    model, x = _MakesATensor().eval(), torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        ref = model(x)
    check = export._write_format("torchscript", model, x, ref, tmp_path / "model.ts")
    want = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    assert check["ok"] and check["checked_on"] == want, check
    # the GPU check's mechanism (a stand-in device for CUDA): a file that fails there is a
    # failed check naming the device, not a pass
    with pytest.raises(export.DeviceCheckError, match="fails on meta"):
        export._on_cuda(tmp_path / "model.ts", x, ref, device="meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real = export._on_cuda
    monkeypatch.setattr(export, "_on_cuda", lambda path, x, ref: real(path, x, ref, "meta"))
    check = export._write_format("torchscript", model, x, ref, tmp_path / "again.ts")
    assert not check["ok"] and check["checked_on"] == ["cpu", "cuda"], check
    assert check["error"].startswith("the TorchScript file fails on meta"), check
    assert not (tmp_path / "again.ts").exists()


# ------------------------------------------------ GPU JPEG decode: a batch ahead, in a thread
class _Decoder:
    """work() for Ahead: records which batch started and finished decoding (Events)."""

    def __init__(self, n):
        self.started = [threading.Event() for _ in range(n)]
        self.done = [threading.Event() for _ in range(n)]
        self.threads = set()

    def __call__(self, k):
        self.started[k].set()
        self.threads.add(threading.get_ident())
        out = (torch.full((2, 3), float(k)), torch.tensor([k, k + 1]))
        self.done[k].set()
        return out


@pytest.mark.parametrize("depth", [1, 2])
def test_the_next_batch_is_decoded_while_the_current_one_is_consumed(depth):
    from ddpflow.data.prefetch import Ahead

    dec = _Decoder(8)
    it = iter(Ahead(range(8), dec, torch.device("cpu"), depth))
    x, y = next(it)
    # the caller holds batch 0 (its step runs): batch 1 .. depth are decoded meanwhile, in
    # another thread, and no further (the bound: at most `depth` batches ahead)
    for k in range(1, depth + 1):
        assert dec.done[k].wait(30), f"batch {k} was not decoded while batch 0 was held"
    assert not dec.started[depth + 1].is_set()
    assert threading.get_ident() not in dec.threads
    got = [(x, y)] + list(it)
    assert [int(g[0][0, 0]) for g in got] == list(range(8))  # the order kept
    for k, (x, y) in enumerate(got):  # the content kept
        assert torch.equal(x, torch.full((2, 3), float(k))) and y.tolist() == [k, k + 1]


def test_prefetch_raises_at_the_failing_batch_and_stops_when_closed():
    from ddpflow.data.prefetch import Ahead

    def work(k):
        if k == 3:
            raise ValueError("damaged batch 3")
        return k

    seen = []
    with pytest.raises(ValueError, match="damaged batch 3"):
        for k in Ahead(range(10), work, torch.device("cpu"), 2):
            seen.append(k)
    assert seen == [0, 1, 2]
    ahead = Ahead(range(1000), lambda k: k, torch.device("cpu"), 1)
    gen = iter(ahead)
    assert next(gen) == 0
    gen.close()  # a break: the thread ends after its batch, not after 1000
    ahead.thread.join(30)
    assert not ahead.thread.is_alive()
    assert list(Ahead(range(5), lambda k: k * 2, torch.device("cpu"), 0)) == [0, 2, 4, 6, 8]


def test_on_cuda_the_decode_runs_on_a_side_stream_the_step_waits_for(monkeypatch):
    """The CUDA calls stood in: each batch's work runs inside the side stream's context
    (in the thread), an event is recorded after it, and the caller's stream waits for that
    event before the batch is handed over."""
    from ddpflow.data import prefetch

    log = []
    monkeypatch.setattr(prefetch, "side_stream", lambda dev: log.append("stream") or "side")

    class Ctx:
        def __enter__(self):
            log.append("enter")

        def __exit__(self, *a):
            log.append("exit")

    monkeypatch.setattr(prefetch, "stream_context", lambda s: Ctx())
    monkeypatch.setattr(prefetch, "mark_ready", lambda s: log.append(f"event {s}") or s)
    monkeypatch.setattr(prefetch, "wait_ready",
                        lambda out, ev, dev: log.append(f"wait {ev} {out} {dev.type}"))
    work = lambda k: log.append(f"decode {k}") or k  # noqa: E731
    got = []
    for k in prefetch.Ahead(range(2), work, torch.device("cuda"), 1):
        log.append(f"step {k}")
        got.append(k)
    assert got == [0, 1] and log[0] == "stream"
    for k in range(2):
        i = log.index(f"decode {k}")
        assert log[i - 1:i + 2] == ["enter", f"decode {k}", "event side"], log
        assert log.index(f"wait side {k} cuda") < log.index(f"step {k}"), log
        assert log.index("event side") < log.index("wait side 0 cuda")


def test_the_first_conv_gets_channels_last_input_after_a_device_crop():
    """center_crop resamples into a new NCHW tensor; a channels_last model's first conv
    still sees channels_last (the forward pre-hook build.py registers)."""
    from ddpflow.data.crops import center_crop
    from ddpflow.engine import layout
    from ddpflow.seams.models import SmallCNN

    model = SmallCNN(10, 3).to(memory_format=torch.channels_last)
    layout.channels_last_inputs(model)
    seen = []
    first = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    first.register_forward_pre_hook(lambda m, a: seen.append(
        a[0].is_contiguous(memory_format=torch.channels_last)))
    x = center_crop(torch.rand(2, 3, 40, 40).contiguous(memory_format=torch.channels_last), 32)
    assert not x.is_contiguous(memory_format=torch.channels_last)  # what the crop hands on
    out = model(x)
    assert seen == [True] and out.shape == (2, 10)
    plain = SmallCNN(10, 3)
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(plain(x.contiguous()), out, rtol=1e-4, atol=1e-5)  # layout only
