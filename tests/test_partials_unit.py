"""Functions of partly mutated modules, value by value: the resident split of two gloo ranks
(data/resident.py: the shares exchanged on one node, a rank alone on its node uploading the
split itself and stopping at the first chunk past data.max_bad_fraction); one rank's setup
(engine/distributed.py: torchrun's environment read, the threads per rank, the device chosen,
the GPU a rank binds to, an RNG state saved on a CPU restored on a GPU rank, with the CUDA
calls stood in); the efficiency instruments (engine/efficiency.py: the first step's FLOPs
under DataParallel, a GPU's peak, DataParallel's replicas); whether `ddpflow doctor` runs in a
container (launch/doctor.py); and a `ddpflow tune` candidate's model wrapped as trained and
released (engine/throughput.py). Fast: tiny tensors and modules on a CPU, no training.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from conftest import tiny_config
from ddpflow.config import from_dict
from ddpflow.core.errors import UserError
from ddpflow.engine import distributed

CPU = torch.device("cpu")
NOWHERE = Path("/nonexistent")  # results_dir of configs only resolved, never run


def hardware(**kw):
    return from_dict(tiny_config(NOWHERE, hardware=kw)).hardware


# ------------------------------------------------------------------ data/resident.py

def _jpeg_split(folder: Path, n: int, side: int, damaged=()) -> None:
    """A JPEG split of n side x side images (smooth: small files, quick to decode), the
    samples in `damaged` with a flipped byte (their CRC fails)."""
    from ddpflow.data import shards

    folder.mkdir()
    ramp = np.arange(n, dtype=np.uint8)[:, None, None, None] * 9
    images = np.broadcast_to(ramp + np.arange(side, dtype=np.uint8)[None, :, None, None],
                             (n, side, side, 3)).copy()
    shards.write_split(folder, "train", images, np.arange(n) % 10, quality=90,
                       shard_bytes=2**20)
    index = np.load(folder / "train_index.npy")
    for i in damaged:
        shard = folder / shards.shard_name("train", int(index[i][0]))
        data = bytearray(shard.read_bytes())
        data[int(index[i][1]) + 20] ^= 0xFF
        shard.write_bytes(bytes(data))
    (folder / "recorded.json").write_text(json.dumps(
        {p.name: p.stat().st_size for p in folder.glob("*.jpgs")}))


_RANKS = """
import numpy as np
from ddpflow.core.errors import UserError
from ddpflow.data import resident, shards
from ddpflow.data.loaders import BadSamples

def split(name, shape):
    folder = root / name
    recorded = json.loads((folder / "recorded.json").read_text())
    return (shards.JpegImages(folder, "train", shape, recorded),
            np.load(folder / "train_labels.npy"))

out = {}
# one node of both ranks: each decodes its share, the shares are exchanged
images, labels = split("small", (8, 8, 3))
bad = BadSamples("train", 23, 0.5, d.rank)
x, y = resident.resident_split(images, labels, d.device, bad)
out["x"], out["y"], out["bad"] = x.flatten().tolist(), y.tolist(), bad.seen
# two nodes of one rank each: nothing to share on a node
os.environ["LOCAL_WORLD_SIZE"] = "1"
decoded = []
real = shards.decode_many
shards.decode_many = lambda bufs: decoded.extend(len(b) for b in bufs) or real(bufs)
images, labels = split("big", (1024, 1024, 3))
try:
    resident.resident_split(images, labels, d.device, BadSamples("train", 24, 0.05, d.rank))
    out["error"] = None
except UserError as e:
    out["error"] = str(e)
out["decoded"] = len(decoded)
print(json.dumps(out), flush=True)
"""


def test_the_resident_split_of_two_ranks_is_the_whole_split_on_each_or_its_first_error(
        tmp_path):
    """Two gloo ranks. On one node (shares of 12 and 11 images, none damaged): every rank
    holds the whole split in order, as one rank's upload of it. On two nodes of one rank
    each: no exchange, each rank uploads the split itself, chunk by chunk (21 images of
    3 MiB a chunk), and a split past data.max_bad_fraction stops at the chunk that passes
    it (two damaged of the first 21): the rest is never decoded."""
    from ddpflow.data import shards
    from fixtures import gloo_ranks

    _jpeg_split(tmp_path / "small", 23, 8)
    _jpeg_split(tmp_path / "big", 24, 1024, damaged=[0, 1, 22])
    small = shards.JpegImages(tmp_path / "small", "train", (8, 8, 3), json.loads(
        (tmp_path / "small" / "recorded.json").read_text()))[np.arange(23)]
    ranks = gloo_ranks(tmp_path, _RANKS, 2, tiny_config(tmp_path, hardware={
        "device": "cpu", "timeout_s": 10}))  # a collective left hanging fails in 10 s
    for got, _err in ranks:
        assert got["x"] == small.flatten().tolist() and got["bad"] == {}
        assert got["y"] == (np.arange(23) % 10).tolist()
        assert got["error"].startswith("2 unreadable samples of the train split's 24, more "
                                       "than data.max_bad_fraction=0.05"), got
        assert got["decoded"] == 19, got  # the first chunk's 21, less its 2 damaged


# ------------------------------------------------------------------ engine/distributed.py

@pytest.fixture
def rank_env(monkeypatch):
    """A process outside torchrun, in a slot of 16 of a node's 64 cores (stood in), its torch
    threads put back afterwards."""
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "DDPFLOW_THREADS", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(
        16 if pid in (0, os.getpid()) else 64)))
    threads = torch.get_num_threads()
    yield monkeypatch
    torch.set_num_threads(threads)


@pytest.fixture
def gpus(rank_env):
    """Two GPUs visible, the CUDA calls stood in (this machine may have none): the GPUs a
    rank was bound to, in order."""
    bound = []
    rank_env.setattr(torch.cuda, "is_available", lambda: True)
    rank_env.setattr(torch.cuda, "device_count", lambda: 2)
    rank_env.setattr(torch.cuda, "set_device", bound.append)
    return bound


def test_a_process_outside_torchrun_is_rank_0_of_1_on_every_core_without_a_group(rank_env):
    d = distributed.setup(hardware(device="cpu"))
    assert (d.rank, d.local_rank, d.world, d.device, d.backend) == (0, 0, 1, CPU, None)
    assert torch.get_num_threads() == 16 and not torch.distributed.is_initialized()


def test_a_rank_reads_torchrun_s_environment_and_shares_the_cores(rank_env):
    rank_env.setenv("RANK", "5")
    rank_env.setenv("LOCAL_RANK", "1")
    rank_env.setenv("WORLD_SIZE", "4")
    d = distributed.setup(hardware(device="cpu"), process_group=False)
    assert (d.rank, d.local_rank, d.world, d.device, d.backend) == (5, 1, 1, CPU, None)
    assert torch.get_num_threads() == 4  # the slot's 16 cores / 4 ranks
    rank_env.setenv("DDPFLOW_THREADS", "3")
    distributed.setup(hardware(device="cpu"), process_group=False)
    assert torch.get_num_threads() == 3  # the launcher's share wins
    rank_env.delenv("DDPFLOW_THREADS")
    rank_env.setattr(os, "sched_getaffinity", lambda pid: {0, 1} if pid in (0, os.getpid())
                     else set(range(64)))
    distributed.setup(hardware(device="cpu"), process_group=False)
    assert torch.get_num_threads() == 1  # 2 cores for 4 ranks: one thread, never none


def test_the_device_is_the_one_asked_for_or_a_gpu_where_one_is_visible(rank_env):
    rank_env.setattr(torch.cuda, "is_available", lambda: False)  # (this machine may have one)
    assert distributed.pick_device(hardware(device="cpu")) == CPU
    assert distributed.pick_device(hardware(device="auto")) == CPU
    with pytest.raises(UserError) as e:
        distributed.pick_device(hardware(device="cuda"))
    assert str(e.value) == ("hardware.device is 'cuda' but no CUDA GPU is visible; "
                            "use hardware.device: cpu (or auto)")


def test_with_a_gpu_visible_auto_and_cuda_pick_it_and_cpu_stays(gpus):
    cuda = torch.device("cuda")
    assert distributed.pick_device(hardware(device="auto")) == cuda
    assert distributed.pick_device(hardware(device="cuda")) == cuda
    assert distributed.pick_device(hardware(device="cpu")) == CPU
    assert gpus == []


def test_each_rank_binds_the_gpu_of_its_local_rank_and_one_past_them_is_one_message(
        rank_env, gpus):
    rank_env.setenv("LOCAL_RANK", "1")
    d = distributed.setup(hardware(device="auto"), process_group=False)
    assert d.device == torch.device("cuda", 1) and d.local_rank == 1 and gpus == [1]
    rank_env.setenv("LOCAL_RANK", "2")
    with pytest.raises(UserError) as e:
        distributed.setup(hardware(device="cuda"), process_group=False)
    assert str(e.value) == "rank 2 has no GPU: 2 visible; lower hardware.nproc_per_node"
    assert gpus == [1]


def test_a_state_saved_on_a_cpu_is_restored_on_a_gpu_rank():
    """A state saved on a CPU (no "cuda" stream) restored on a GPU rank: the CPU streams
    come back and nothing asks for a CUDA stream that was never saved."""
    import random

    state = distributed.rng_state(CPU)
    first = (torch.rand(2), random.random())
    distributed.set_rng_state(state, torch.device("cuda"))
    assert torch.equal(torch.rand(2), first[0]) and random.random() == first[1]


# ------------------------------------------------------------------ engine/efficiency.py

class _Squared(nn.Module):
    """x @ (w @ w): a forward whose FLOPs are not proportional to the batch (w @ w once)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.rand(6, 6))

    def forward(self, x):
        return x @ (self.w @ self.w)


def _data_parallel(module, gpus):
    """DataParallel over `gpus` GPUs, as it is built on a GPU node (its device_ids stood in:
    this machine may have none)."""
    dp = nn.DataParallel(module)
    dp.device_ids = list(range(gpus))
    return dp


def test_dataparallel_splits_over_its_gpus_and_anything_else_is_one_replica():
    from ddpflow.engine.efficiency import replicas

    assert replicas(_data_parallel(nn.Linear(2, 2), 3)) == 3
    assert replicas(nn.Linear(2, 2)) == 1


def test_the_first_step_under_dataparallel_counts_one_replica_scaled_to_the_batch():
    """Two GPUs: the FLOPs are one replica's share (3 of 5 samples) counted on the plain
    module and scaled to the batch, never a count around DataParallel; then the first
    micro-batch trains on the wrapper, its loss checked once."""
    from ddpflow.engine.efficiency import FirstSteps, FlopCount, replica_flops

    module = _Squared()
    model = _data_parallel(module, 2)
    calls = []

    def micro(net, batch, check):
        calls.append((net, len(batch), check))
        loss = (net.module if isinstance(net, nn.DataParallel) else net)(batch).sum()
        loss.backward()
        return loss

    batch = torch.rand(5, 6)
    want = replica_flops(module, batch, 5, 2, lambda net, part: micro(net, part, False))
    with FlopCount() as around:
        micro(model, batch, True)
    assert want != around.total  # (the test tells them apart)
    calls.clear()
    hook = FirstSteps(model, model, [], 5, micro)
    assert torch.equal(hook(batch), module(batch).sum())
    assert hook.flops == want
    assert calls == [(module, 3, False), (model, 5, True)]


def test_a_cpu_has_no_peak_and_a_gpu_has_its_name_s_peak(monkeypatch):
    from ddpflow.engine.efficiency import peak_flops

    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_name",
                        lambda d: asked.append(d) or "NVIDIA H100 80GB HBM3")
    assert peak_flops(CPU, "bf16") is None and asked == []
    assert peak_flops(torch.device("cuda", 1), "bf16") == 989e12
    assert peak_flops(torch.device("cuda", 1), "fp32") == 494e12
    assert asked == [torch.device("cuda", 1)] * 2


# ------------------------------------------------------------------ launch/doctor.py

@pytest.mark.parametrize("files, inside", [
    ({}, False),  # no marker, no /proc/1/cgroup to read: outside
    ({".dockerenv": ""}, True),
    ({"run/.containerenv": ""}, True),  # podman
    ({"proc/1/cgroup": "0::/init.scope\n"}, False),
    ({"proc/1/cgroup": "12:pids:/kubepods/besteffort/pod1/abc\n"}, True),
    ({"proc/1/cgroup": "0::/system.slice/containerd.service\n"}, True),
])
def test_doctor_tells_a_container_by_its_marker_files_or_its_cgroup(tmp_path, monkeypatch,
                                                                     files, inside):
    """The machine's root stood in by a folder (this test may itself run in a container)."""
    from ddpflow.launch import doctor

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(doctor, "Path", lambda p: tmp_path / p.lstrip("/"))
    assert doctor._in_container() is inside


# ------------------------------------------------------------------ engine/throughput.py

def test_release_collects_a_candidate_s_garbage_and_empties_the_gpu_cache(monkeypatch):
    """On a GPU the cycles a candidate leaves (DDP's reducer) are collected, then the
    allocator's cache is emptied (stood in: this machine may have no GPU); a CPU has none."""
    import gc
    import weakref

    from ddpflow.engine.throughput import release

    emptied = []

    class Cycle:
        pass

    def garbage():
        a, b = Cycle(), Cycle()
        a.other, b.other = b, a
        return weakref.ref(a)

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(alive() is None))
    gc.disable()
    try:
        alive = garbage()
        release(CPU)
        assert emptied == [] and alive() is not None  # nothing to release on a CPU
        release(torch.device("cuda"))
        assert emptied == [True]  # the cache emptied after the garbage went
    finally:
        gc.enable()


def _tune_parts(tmp_path, **st):
    from ddpflow.seams.models import build_model

    cfg = from_dict(tiny_config(tmp_path, hardware={"timeout_s": 10}, stages=[
        {"name": "s1", "epochs": 1, "batch_size": 8, "lr": 0.1, **st}]))
    return cfg, cfg.stage("s1"), build_model(cfg.model, 10, 3)


def test_a_candidate_s_model_is_checkpointed_and_wrapped_as_the_trainer_runs_it(tmp_path):
    from ddpflow.engine.throughput import wrap_as_trained

    cfg, stage, model = _tune_parts(tmp_path, activation_checkpointing=True)
    plain = {type(m) for m in model.modules()}
    alone = distributed.Dist(0, 0, 1, CPU, None)
    assert wrap_as_trained(model, cfg, stage, alone, "fp32") is model  # one rank: no DDP
    changed = {type(m) for m in model.modules()} - plain
    assert changed and all(c.__name__ == "Checkpointed" + c.__mro__[1].__name__ for c in changed)
    cfg, stage, model = _tune_parts(tmp_path)
    plain = [type(m) for m in model.modules()]
    assert wrap_as_trained(model, cfg, stage, alone, "fp32") is model
    assert [type(m) for m in model.modules()] == plain  # no checkpointing asked: untouched


def test_an_fsdp_candidate_is_sharded_as_the_trainer_shards_it(tmp_path, rank_env):
    from torch.distributed.fsdp import FSDPModule

    from ddpflow.engine.throughput import wrap_as_trained

    cfg, stage, model = _tune_parts(tmp_path, strategy="fsdp")
    d = distributed.setup(cfg.hardware, "always")  # a group of one, outside torchrun
    try:
        assert (d.rank, d.world, d.backend) == (0, 1, "gloo")
        got = wrap_as_trained(model, cfg, stage, d, "fp32")
        assert got is model and isinstance(model, FSDPModule)
        cfg, stage, model = _tune_parts(tmp_path)
        assert not isinstance(wrap_as_trained(model, cfg, stage, d, "fp32"), FSDPModule)
    finally:
        distributed.teardown(d)
