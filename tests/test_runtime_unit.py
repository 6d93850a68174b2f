"""engine/runtime.py's rules, value by value: the LR scaling rule, every schedule's
multiplier (warm-up, cosine and linear to a floor, constant, step and multistep), the decay
boundaries in optimizer steps, the optimizer's groups, weight decay and fused kernel (and
foreach for FSDP's sharded parameters), the weights' hash, and the sample trace file. Fast:
tiny modules on a CPU, no training.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import tiny_config
from ddpflow.config import from_dict
from ddpflow.engine import distributed, runtime


def stage(**kw):
    st = {"name": "a", "epochs": 3, "batch_size": 8, "lr": 0.1, **kw}
    return from_dict(tiny_config(Path("/nonexistent"), stages=[st])).stage("a")


# ------------------------------------------------------------------ the LR

def test_the_lr_is_rescaled_from_its_reference_batch_by_the_rule():
    assert runtime.lr_factor("none", 512, 256) == 1.0
    assert runtime.lr_factor("linear", 512, 256) == 2.0
    assert runtime.lr_factor("linear", 64, 256) == 0.25
    assert runtime.lr_factor("sqrt", 512, 256) == math.sqrt(2.0)


def values(f, steps):
    return [f(s) for s in steps]


def test_warm_up_climbs_linearly_to_the_full_lr():
    f = runtime.schedule("cosine", 4, 12)
    assert values(f, range(5)) == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert runtime.schedule("step", 2, 12, boundaries=(5,))(0) == 0.5


def test_cosine_and_linear_decay_to_the_floor_and_stay_there():
    cos = runtime.schedule("cosine", 2, 10)
    assert values(cos, [2, 6, 10, 14]) == pytest.approx([1.0, 0.5, 0.0, 0.0])
    assert cos(4) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    lin = runtime.schedule("linear", 2, 10)
    assert values(lin, [2, 4, 6, 10, 14]) == pytest.approx([1.0, 0.75, 0.5, 0.0, 0.0])
    floored = runtime.schedule("cosine", 2, 10, floor=0.1)
    assert values(floored, [2, 6, 10, 14]) == pytest.approx([1.0, 0.55, 0.1, 0.1])
    assert runtime.schedule("linear", 0, 10, floor=0.2)(5) == pytest.approx(0.6)


def test_a_constant_schedule_or_one_all_warm_up_keeps_the_full_lr():
    assert values(runtime.schedule("constant", 2, 10), [1, 2, 9, 20]) == [1.0, 1.0, 1.0, 1.0]
    assert values(runtime.schedule("cosine", 4, 4), [3, 4, 5]) == [1.0, 1.0, 1.0]
    assert runtime.schedule("linear", 4, 3)(4) == 1.0


def test_step_schedules_multiply_by_gamma_at_each_boundary():
    f = runtime.schedule("step", 0, 100, boundaries=(3, 6), gamma=0.5)
    assert values(f, [0, 2, 3, 5, 6, 99]) == [1.0, 1.0, 0.5, 0.5, 0.25, 0.25]
    g = runtime.schedule("multistep", 1, 100, boundaries=(4,))
    assert values(g, [1, 3, 4, 50]) == pytest.approx([1.0, 1.0, 0.1, 0.1])


def test_decay_boundaries_are_counted_in_optimizer_steps():
    st = stage(schedule="step", lr_step_epochs=2, lr_gamma=0.5, epochs=5)
    assert runtime.decay_boundaries(st, 5, 23) == (10, 20)
    assert runtime.decay_boundaries(st, 5, 20) == (10,)
    ms = stage(schedule="multistep", lr_milestones=[1, 2])
    assert runtime.decay_boundaries(ms, 5, 15) == (5, 10)


# ------------------------------------------------------------------ the optimizer

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)
        self.frozen = nn.Linear(2, 2)
        self.frozen.requires_grad_(False)


def groups(opt):
    return [({id(p) for p in g["params"]}, g["weight_decay"]) for g in opt.param_groups]


def test_weights_decay_norms_and_biases_apart_and_frozen_ones_stay_out():
    m = Net()
    opt = runtime.build_optimizer(m, stage(optimizer="sgd", momentum=0.9, weight_decay=1e-4),
                                  0.05, torch.device("cpu"))
    weights = {id(m.conv.weight), id(m.fc.weight)}
    rest = {id(m.conv.bias), id(m.bn.weight), id(m.bn.bias), id(m.fc.bias)}
    assert groups(opt) == [(weights, 1e-4), (rest, 0.0)]  # norm_weight_decay null: none
    assert isinstance(opt, torch.optim.SGD) and opt.defaults["lr"] == 0.05
    assert opt.defaults["momentum"] == 0.9 and opt.defaults["fused"] is True
    opt = runtime.build_optimizer(m, stage(weight_decay=1e-4, norm_weight_decay=0.01), 0.05,
                                  torch.device("cpu"))
    assert groups(opt) == [(weights, 1e-4), (rest, 0.01)]


def test_nesterov_only_with_momentum():
    cpu = torch.device("cpu")
    on = runtime.build_optimizer(Net(), stage(momentum=0.9, nesterov=True), 0.1, cpu)
    assert on.defaults["nesterov"] is True
    assert runtime.build_optimizer(Net(), stage(momentum=0.9, nesterov=False), 0.1,
                                   cpu).defaults["nesterov"] is False
    assert runtime.build_optimizer(Net(), stage(momentum=0.0, nesterov=True), 0.1,
                                   cpu).defaults["nesterov"] is False


def test_adamw_takes_the_fused_kernel_on_a_cpu():
    opt = runtime.build_optimizer(Net(), stage(optimizer="adamw", weight_decay=0.05), 1e-3,
                                  torch.device("cpu"))
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["lr"] == 1e-3
    assert opt.defaults["fused"] is True and not opt.defaults["foreach"]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]
    meta = runtime.build_optimizer(Net(), stage(optimizer="adamw"), 1e-3, torch.device("meta"))
    assert not meta.defaults["fused"]  # no fused kernel for that device


def test_sgd_over_sharded_parameters_runs_foreach_not_fused():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    cfg = from_dict(tiny_config(Path("/nonexistent")))
    d = distributed.setup(cfg.hardware, "always")
    try:
        m = nn.Linear(4, 4)
        mesh = init_device_mesh("cpu", (1,))
        m.weight = nn.Parameter(distribute_tensor(m.weight.detach(), mesh, [Shard(0)]))
        opt = runtime.build_optimizer(m, stage(optimizer="sgd", momentum=0.9), 0.1,
                                      torch.device("cpu"))
        assert opt.defaults["foreach"] is True and not opt.defaults["fused"]
        adamw = runtime.build_optimizer(m, stage(optimizer="adamw"), 0.1, torch.device("cpu"))
        assert adamw.defaults["fused"] is True
    finally:
        distributed.teardown(d)


# ------------------------------------------------------------------ hashes and traces

def test_the_weights_hash_covers_names_and_bytes_and_a_module_hashes_as_its_state():
    zero = {"w": torch.zeros(1)}
    assert runtime.weights_sha256(zero) == hashlib.sha256(b"w" + bytes(4)).hexdigest()
    m = nn.Linear(3, 2)
    assert runtime.weights_sha256(m) == runtime.weights_sha256(m.state_dict())
    renamed = {"v": torch.zeros(1)}
    assert runtime.weights_sha256(renamed) != runtime.weights_sha256(zero)
    assert runtime.weights_sha256({"w": torch.ones(1)}) != runtime.weights_sha256(zero)
    two_d = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    assert runtime.weights_sha256(two_d) == hashlib.sha256(
        b"w" + torch.arange(6, dtype=torch.float32).numpy().tobytes()).hexdigest()


def test_the_sample_trace_appends_each_line_at_once_to_the_ranks_file(tmp_path, monkeypatch):
    monkeypatch.delenv("DDPFLOW_SAMPLE_TRACE", raising=False)
    assert runtime.trace_file(0) is None
    monkeypatch.setenv("DDPFLOW_SAMPLE_TRACE", str(tmp_path))
    (tmp_path / "rank3.txt").write_text("1\n")
    f = runtime.trace_file(3)
    try:
        f.write("5\n")
        assert (tmp_path / "rank3.txt").read_text() == "1\n5\n"  # line-buffered
    finally:
        f.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank3.txt"]



# ------------------------------------------------------------------ engine/distributed.py

def hardware():
    return from_dict(tiny_config(Path("/nonexistent"))).hardware


@pytest.fixture
def global_state(monkeypatch):
    """seed_everything's global switches, put back afterwards."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    saved = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark, torch.get_rng_state())
    yield
    torch.use_deterministic_algorithms(saved[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[1:3]
    torch.set_rng_state(saved[3])


def test_seeds_give_every_rank_the_same_model_init_and_its_own_python_and_numpy_streams(
        global_state):
    import random

    import numpy as np

    from ddpflow.core.seeds import seed_sequence

    for rank in (3, 1):  # numpy takes the 32 low bits of the 63-bit seed (both high ones)
        distributed.seed_everything(7, rank, deterministic=False)
        assert random.random() == random.Random(seed_sequence(7, rank)).random()
        assert np.random.random() == np.random.RandomState(
            seed_sequence(7, rank) % 2**32).random()
    assert torch.equal(torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(7)))
    assert torch.backends.cudnn.benchmark is True
    assert not torch.are_deterministic_algorithms_enabled()
    distributed.seed_rank_stream(7, 1)
    assert torch.equal(torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(
        seed_sequence(7, 1))))


def test_deterministic_mode_turns_on_every_switch(global_state):
    import os

    distributed.seed_everything(0, 0, deterministic=True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic is True and torch.backends.cudnn.benchmark is False


def test_the_rng_state_saved_replays_the_same_draws():
    import random

    state = distributed.rng_state(torch.device("cpu"))
    assert sorted(state) == ["python", "torch"]
    first = (torch.rand(2), random.random())
    distributed.set_rng_state(state, torch.device("cpu"))
    again = (torch.rand(2), random.random())
    assert torch.equal(first[0], again[0]) and first[1] == again[1]


def test_one_process_without_a_group_is_rank_0_and_every_collective_hands_back_its_own():
    cpu = torch.device("cpu")
    d = distributed.Dist(0, 0, 1, cpu, None)
    assert d.is_master and not distributed.Dist(1, 1, 2, cpu, None).is_master
    t = torch.tensor([2.0])
    assert distributed.all_sum(d, t) is t and t.item() == 2.0
    assert distributed.all_min(d, 5) == 5 and distributed.all_min(d, 5, "MAX") == 5
    assert distributed.gather_objects(d, {"a": 1}) == [{"a": 1}]
    assert distributed.all_gather_floats(d, [1.5, 2.0]) == [[1.5, 2.0]]
    assert distributed.broadcast_object(d, "x") == "x"
    bn = nn.BatchNorm1d(2)
    distributed.broadcast_buffers(d, bn)
    assert bn.running_mean.tolist() == [0.0, 0.0]


def test_one_rank_is_not_wrapped_and_dp_is_dataparallel():
    cpu = torch.device("cpu")
    m = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    t, bn = torch.tensor([2.0]), nn.BatchNorm1d(2)
    alone = distributed.Dist(0, 0, 1, cpu, None)
    assert distributed.wrap(m, alone, "ddp", sync_bn=True) is m  # no group: no SyncBatchNorm
    assert isinstance(m[1], nn.BatchNorm1d) and not isinstance(m[1], nn.SyncBatchNorm)
    dp = distributed.wrap(m, alone, "dp", sync_bn=False)
    assert isinstance(dp, nn.DataParallel) and dp.module is m
    d = distributed.setup(hardware(), "always")  # a group of one rank: nothing to all-reduce
    try:
        assert (d.backend, d.world, d.rank) == ("gloo", 1, 0)
        assert distributed.all_min(d, 5) == 5 and distributed.all_sum(d, t).tolist() == [2.0]
        assert distributed.gather_objects(d, {"a": 1}) == [{"a": 1}]
        assert distributed.all_gather_floats(d, [1.5, 2.0]) == [[1.5, 2.0]]
        assert distributed.broadcast_object(d, "x") == "x"
        bn.running_mean.fill_(3.0)
        distributed.broadcast_buffers(d, bn)
        assert bn.running_mean.tolist() == [3.0, 3.0]
        assert distributed.wrap_ddp(m, d, deterministic=True) is m
        kept = distributed.wrap(nn.Sequential(nn.BatchNorm1d(2)), d, "ddp", sync_bn=False)
        synced = distributed.wrap(nn.Sequential(nn.BatchNorm1d(2)), d, "ddp", sync_bn=True)
        assert type(kept[0]) is nn.BatchNorm1d and type(synced[0]) is nn.SyncBatchNorm
        distributed.teardown(distributed.Dist(0, 0, 1, torch.device("cpu"), None))
        assert torch.distributed.is_initialized()  # not this Dist's group
    finally:
        distributed.teardown(d)
    assert not torch.distributed.is_initialized()


RANK_SCRIPT = r"""
import json, sys
import torch
from torch import nn
from ddpflow.config import from_dict
from ddpflow.engine import distributed

d = distributed.setup(from_dict(json.loads(sys.argv[1])).hardware)
out = {"rank": d.rank, "world": d.world, "backend": d.backend}
out["sum"] = distributed.all_sum(d, torch.tensor([d.rank + 1.0])).tolist()
out["min"] = distributed.all_min(d, 10 + d.rank)
out["max"] = distributed.all_min(d, 10 + d.rank, "MAX")
out["gathered"] = distributed.gather_objects(d, {"r": d.rank})
out["floats"] = distributed.all_gather_floats(d, [d.rank, 0.5])
out["object"] = distributed.broadcast_object(d, "from %d" % d.rank)
bn = nn.BatchNorm1d(2)
bn.running_mean.fill_(d.rank + 1.0)
distributed.broadcast_buffers(d, bn)
out["buffers"] = bn.running_mean.tolist()

torch.manual_seed(0)
m = nn.Linear(3, 2)
plain = nn.Linear(3, 2)
plain.load_state_dict(m.state_dict())
ddp = distributed.wrap_ddp(m, d, deterministic=True)
out["ddp"] = [type(ddp).__name__, ddp.gradient_as_bucket_view,
              [h.__name__ for h, _ in ddp._comm_hooks]]
two = distributed.Dist(d.rank, d.local_rank, 2, d.device, d.backend)
out["hooks_of_two"] = [h.__name__ for h, _ in distributed.wrap_ddp(
    nn.Linear(3, 2), two, deterministic=True)._comm_hooks]
out["hooks_nondeterministic"] = [h.__name__ for h, _ in distributed.wrap_ddp(
    nn.Linear(3, 2), d)._comm_hooks]
# (dp: SyncBatchNorm under DDP needs GPU modules)
synced = distributed.wrap(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), d, "dp", True)
kept = distributed.wrap(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), d, "ddp", False)
out["sync_bn"] = [type(synced.module[1]).__name__, type(kept.module[1]).__name__]

# this rank's own gradient, then the ordered mean of every rank's, summed in rank order
x = torch.arange(12.0).reshape(4, 3) * (d.rank + 1) / 7
plain(x).pow(2).sum().backward()
own = torch.cat([plain.weight.grad.flatten(), plain.bias.grad.flatten()])
parts = [torch.empty_like(own) for _ in range(d.world)]
torch.distributed.all_gather(parts, own)
expected = parts[0].clone()
for p in parts[1:]:
    expected.add_(p)
expected.div_(d.world)
ddp(x).pow(2).sum().backward()
got = torch.cat([m.weight.grad.flatten(), m.bias.grad.flatten()])
out["mean_exact"] = torch.equal(got, expected)
out["differs_per_rank"] = not torch.equal(parts[0], parts[1])
distributed.teardown(d)
out["after_teardown"] = torch.distributed.is_initialized()
print(json.dumps(out))
"""


def test_three_ranks_agree_through_every_collective_and_sum_gradients_in_rank_order(
        tmp_path):
    """Three ranks as torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR): rank 0's object
    and buffers everywhere, the minimum and maximum, every rank's list in rank order, DDP
    with its ordered-mean hook in deterministic mode (from three ranks on, and only there),
    and each rank's gradient the rank-ordered mean to the last bit."""
    import json
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = json.dumps(tiny_config(tmp_path))
    procs = [subprocess.Popen(
        [sys.executable, "-c", RANK_SCRIPT, cfg], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "3",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                        "DDPFLOW_THREADS": "1"}) for r in range(3)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    for r, o in enumerate(outs):
        assert (o["rank"], o["world"], o["backend"]) == (r, 3, "gloo")
        assert o["sum"] == [6.0] and (o["min"], o["max"]) == (10, 12)
        assert o["gathered"] == [{"r": 0}, {"r": 1}, {"r": 2}]
        assert o["floats"] == [[0.0, 0.5], [1.0, 0.5], [2.0, 0.5]]
        assert o["object"] == "from 0" and o["buffers"] == [1.0, 1.0]
        assert o["ddp"] == ["DistributedDataParallel", True, ["ordered_mean_hook"]]
        assert o["hooks_of_two"] == [] and o["hooks_nondeterministic"] == []
        assert o["sync_bn"] == ["SyncBatchNorm", "BatchNorm1d"]
        assert o["mean_exact"] is True and o["differs_per_rank"] is True
        assert o["after_teardown"] is False
