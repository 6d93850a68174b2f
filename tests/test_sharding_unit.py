"""engine/sharding.py on the CPU: FSDP's mixed precision (bf16 gathered, except beside
BatchNorm's fp32 statistics), each block and the root sharded on a one-rank gloo group, the
checkpointed blocks' buffers as the forward left them, block class names, and the blocks a
message lists. Fast: tiny models, no training.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ddpflow.engine import sharding


def test_fsdp_gathers_bf16_parameters_unless_batchnorm_needs_fp32():
    plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    bn = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    policy, how = sharding.fsdp_policy(plain, "bf16")
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert how == "bf16 parameters gathered, fp32 gradient reduction and master weights"
    policy, how = sharding.fsdp_policy(bn, "bf16")
    assert (policy.param_dtype, policy.reduce_dtype) == (None, torch.float32)
    assert how == "fp32 parameters gathered (BatchNorm), bf16 autocast"
    policy, how = sharding.fsdp_policy(bn, "fp32")
    assert (policy.param_dtype, policy.reduce_dtype) == (None, torch.float32)
    assert how == "fp32 parameters gathered, fp32 gradient reduction and master weights"
    policy, _ = sharding.fsdp_policy(bn, "fp16")
    assert policy.param_dtype is None
    assert sharding.fsdp_policy(plain, "fp16")[0].param_dtype == torch.float16


@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def test_each_block_then_the_root_is_sharded(one_rank):
    from torch.distributed.fsdp import FSDPModule

    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()),
                          nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 2))
    x = torch.randn(2, 4)
    want = model(x)
    blocks = sharding.find_blocks(model, None, "m")
    assert sharding.shard(model, blocks, "fp32", True) == (
        "2 Sequential blocks + root sharded, fp32 parameters gathered, fp32 gradient "
        "reduction and master weights")
    assert isinstance(model, FSDPModule) and all(isinstance(b, FSDPModule) for b in blocks)
    assert not isinstance(model[2], FSDPModule)  # the head: in the root's unit
    assert [sharding.class_name(b) for b in blocks] == ["Sequential"] * 2
    assert sharding.class_name(model) == "Sequential"
    torch.testing.assert_close(model(x), want)


def test_a_recomputed_block_leaves_batchnorms_statistics_as_the_forward_did():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()),
                          nn.Sequential(nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4), nn.ReLU()))
    ckpt = copy.deepcopy(plain)
    blocks = list(ckpt)
    sharding.checkpoint_blocks(blocks)
    assert [type(b).__name__ for b in blocks] == ["CheckpointedSequential"] * 2
    assert [sharding.class_name(b) for b in blocks] == ["Sequential"] * 2
    x = torch.randn(2, 3, 8, 8)
    plain(x).sum().backward()
    ckpt(x).sum().backward()  # the backward recomputes each block's forward
    for a, b in zip(plain.buffers(), ckpt.buffers()):
        assert torch.equal(a, b)  # running mean, var and the batch count: updated once
    for a, b in zip(plain.parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
