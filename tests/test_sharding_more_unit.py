"""engine/sharding.py beyond test_sharding_unit.py: which children are a model's blocks
(found or named), the message for a name that is no block, the tied parameter FSDP refuses,
checkpointed blocks (same results, same RNG and statistics, and the memory they save as
activation_meter reports it), what autograd keeps and the blocks' inputs, and FSDP2 on a
one-rank gloo group (how each unit reshards). Fast: tiny models on the CPU, no training.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import test_sharding_unit
from ddpflow.core.errors import UserError
from ddpflow.engine import memory, sharding


class Block(nn.Module):
    """A real block: layers of its own, BatchNorm's statistics and dropout's RNG."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.a = nn.Linear(width, 2 * width)
        self.bn = nn.BatchNorm1d(2 * width)
        self.drop = nn.Dropout(0.5)
        self.b = nn.Linear(2 * width, width)

    def forward(self, x, scale: float = 1.0):
        return self.b(self.drop(torch.relu(self.bn(self.a(x))))) * scale


class Other(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.a = nn.Linear(width, width)

    def forward(self, x):
        return self.a(x)


class Net(nn.Module):
    """stem, two Blocks in a Sequential, a head: smallcnn's shape."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.features = nn.Sequential(Block(), Block())
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.features(self.stem(x)))


def _ids(modules) -> list[int]:
    return [id(m) for m in modules]


def _refusal(fn, *args) -> str:
    with pytest.raises(UserError) as e:
        fn(*args)
    return str(e.value)


# ------------------------------------------------------------------ finding the blocks

def test_repeated_children_are_same_class_siblings_with_parameters():
    inner = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.ReLU(), Other(2), Block(2), Block(2),
                          inner)
    found = sharding.repeated(model)
    assert set(found) == {nn.Linear, Block}  # ReLUs have no parameters; one Other, one inner
    assert _ids(found[Block]) == _ids(model[4:6])
    # the root's lone Linear is no sibling of inner's three: each parent apart
    b4, b5 = model[4:6]
    assert _ids(found[nn.Linear]) == _ids([b4.a, b4.b, b5.a, b5.b, *inner])
    pair = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert _ids(sharding.repeated(pair)[nn.Linear]) == _ids(pair)
    assert sharding.repeated(nn.Sequential(nn.Linear(2, 2), Other(2))) == {}


def test_tiers_rank_real_blocks_before_containers_before_layers():
    assert sharding._tier(Block, [Block()]) == 0
    for container in (nn.Sequential(nn.Linear(2, 2)), nn.ModuleList([nn.Linear(2, 2)]),
                      nn.ModuleDict({"a": nn.Linear(2, 2)})):
        assert sharding._tier(type(container), [container]) == 1
    assert sharding._tier(nn.Linear, [nn.Linear(2, 2)]) == 2
    assert sharding._tier(nn.Sequential, [nn.Sequential()]) == 2  # no children: a layer
    # a class is ranked by its first instance (the one the model's order meets first)
    leaf, parent = Gate(), Gate(nn.Linear(2, 2))
    assert sharding._tier(Gate, [leaf, parent]) == 2
    assert sharding._tier(Gate, [parent, leaf]) == 0


class Gate(nn.Module):
    """Parameters of its own, and a child only when given one."""

    def __init__(self, inner: nn.Module | None = None):
        super().__init__()
        self.w = nn.Parameter(torch.ones(2))
        if inner is not None:
            self.inner = inner


def test_outermost_keeps_the_model_order_and_drops_the_nested():
    net = Net()
    a, b = net.features
    assert _ids(sharding._outermost([a, a.a, net.stem, b.bn, b])) == _ids([a, net.stem, b])
    assert _ids(sharding._outermost([b.a, a])) == _ids([b.a, a])


def test_found_blocks_are_the_real_blocks_then_the_largest():
    net = Net()
    assert _ids(sharding.find_blocks(net, None, "net")) == _ids(net.features)
    assert _ids(sharding.find_blocks(net, (), "net")) == _ids(net.features)
    # two classes of real blocks: the one whose instances hold more parameters
    wide = nn.Sequential(Other(8), Other(8), Block(2), Block(2))
    assert _ids(sharding.find_blocks(wide, None, "w")) == _ids(wide[:2])
    narrow = nn.Sequential(Other(2), Other(2), Block(8), Block(8))
    assert _ids(sharding.find_blocks(narrow, None, "n")) == _ids(narrow[2:])
    # containers before single layers, even smaller ones
    seqs = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64),
                         nn.Sequential(nn.Linear(2, 2)), nn.Sequential(nn.Linear(2, 2)))
    assert _ids(sharding.find_blocks(seqs, None, "s")) == _ids(seqs[2:])
    layers = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert _ids(sharding.find_blocks(layers, None, "l")) == _ids(layers)
    assert sharding.find_blocks(nn.Sequential(nn.Linear(2, 2), Other(2)), None, "x") == []


def test_named_blocks_are_the_repeated_instances_else_the_outermost():
    net = Net()
    # the Sequential blocks, not the Sequential around them (smallcnn)
    model = nn.Sequential(nn.Sequential(nn.Sequential(nn.Linear(2, 2)),
                                        nn.Sequential(nn.Linear(2, 2))), nn.Linear(2, 2))
    assert _ids(sharding.find_blocks(model, ("Sequential",), "m")) == _ids(model[0])
    assert _ids(sharding.find_blocks(net, ("Block",), "net")) == _ids(net.features)
    # stem and head: repeated Linears of the root
    assert _ids(sharding.find_blocks(net, ("Block", "Linear"), "net")) == _ids(
        [net.stem, *net.features, net.head])
    # nothing named repeats: the outermost named, a parameterless instance left out
    lone = nn.Sequential(Block(2), nn.Sequential(Other(2)), nn.Sequential(nn.ReLU()),
                         Other(2))
    assert _ids(sharding.find_blocks(lone, ("Sequential",), "m")) == _ids([lone[1]])
    assert _ids(sharding.find_blocks(lone, ("Other",), "m")) == _ids([lone[1][0], lone[3]])
    nested = nn.Sequential(nn.Sequential(nn.Linear(2, 2)), nn.Sequential(nn.Linear(2, 2)))
    assert _ids(sharding.find_blocks(nested, ("Sequential",), "m")) == _ids(nested)


def test_a_name_that_is_no_block_is_one_message_naming_the_blocks_there_are():
    net = Net()
    has = "repeated blocks Block (2), Linear (6)"
    assert sharding.describe(net) == has
    assert _refusal(sharding.find_blocks, net, ("Blok",), "tiny") == (
        f"model.shard_blocks: 'Blok' is not the class of any module of the model; model tiny "
        f"has {has}; name one of those classes (or null: found in the model)")
    assert _refusal(sharding.find_blocks, net, ("block",), "tiny") == (
        f"model.shard_blocks: 'block' is not the class of any module of the model (did you "
        f"mean 'Block'?); model tiny has {has}; name one of those classes (or null: found in "
        f"the model)")
    assert _refusal(sharding.find_blocks, net, ("Block", "Dropout"), "tiny",
                    "stages.1.activation_checkpointing") == (
        f"stages.1.activation_checkpointing: 'Dropout' has no parameters: it is a layer, not a "
        f"block; model tiny has {has}; name one of those classes (or true: found in the "
        f"model)")
    assert _refusal(sharding.find_blocks, net, ("Net",), "tiny").startswith(
        "model.shard_blocks: 'Net' is the model itself, not one of its blocks; model tiny")
    # a class with parameters in one of its instances is a name of a block
    model = nn.Sequential(nn.Sequential(), nn.Sequential(nn.Linear(2, 2)))
    assert _ids(sharding.find_blocks(model, ("Sequential",), "m")) == _ids([model[1]])


def test_describe_ranks_the_five_likeliest_blocks_and_counts_the_outermost():
    assert sharding.describe(nn.Sequential(nn.Linear(100, 20), nn.ReLU())) == (
        "no repeated blocks (2.02 k parameters)")
    assert sharding.describe(nn.Linear(3, 1)) == "no repeated blocks (4 parameters)"

    def pair(cls, *a):
        return nn.Sequential(cls(*a), cls(*a))
    model = nn.Sequential(pair(Block, 2), pair(Other, 4), pair(nn.Conv1d, 2, 2, 1),
                          pair(nn.Linear, 9, 9), pair(nn.Embedding, 5, 2))
    assert sharding.describe(model) == (
        "repeated blocks Block (2), Other (2), Sequential (5), Linear (6), Embedding (2)")


# ------------------------------------------------------------------ tied parameters

def test_a_parameter_two_fsdp_units_share_is_named():
    net = Net()
    blocks = list(net.features)
    assert sharding.shared_parameter(net, blocks) is None
    net.features[1].a = net.features[0].a  # one layer in two blocks
    assert sharding.shared_parameter(net, blocks) == "features.1.a.weight"
    net = Net()
    net.features[0].b.weight = net.head.weight  # in a block and in the root's unit
    assert sharding.shared_parameter(net, list(net.features)) == "head.weight"
    net = Net()
    net.stem.bias = net.features[1].b.bias
    assert sharding.shared_parameter(net, list(net.features)) == "features.1.b.bias"
    # within one unit: no conflict (a block's layers tied, or the root's)
    net = Net()
    net.features[0].a.bias = net.features[0].bn.bias
    assert sharding.shared_parameter(net, list(net.features)) is None
    tied = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    tied[1].weight = tied[0].weight
    assert sharding.shared_parameter(tied, []) is None
    assert sharding.shared_parameter(tied, [tied[0]]) == "1.weight"
    assert sharding.shared_parameter(tied, list(tied)) == "1.weight"


def test_a_root_parameter_tied_into_a_block_is_named_by_its_block_path():
    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
            self.scale = self.blocks[1].weight

    model = Root()
    assert sharding.shared_parameter(model, list(model.blocks)) == "blocks.1.weight"
    assert sharding.shared_parameter(model, [model.blocks[0]]) is None


# ------------------------------------------------------------------ activation checkpointing

def test_checkpointed_blocks_give_the_same_results_gradients_rng_and_statistics():
    torch.manual_seed(0)
    plain = Net()
    ckpt = copy.deepcopy(plain)
    sharding.checkpoint_blocks(list(ckpt.features))
    assert type(ckpt.features[0]) is type(ckpt.features[1])
    assert type(ckpt.features[0]).__name__ == "CheckpointedBlock"
    assert isinstance(ckpt.features[0], Block)
    assert sharding._checkpointed_class(Block) is type(ckpt.features[0])
    assert ckpt.state_dict().keys() == plain.state_dict().keys()
    x = torch.randn(5, 4)  # an input without gradient: the blocks' weights still get theirs
    for model in (plain, ckpt):
        torch.manual_seed(1)
        model(x).sum().backward()
    for a, b in zip(plain.buffers(), ckpt.buffers()):
        assert torch.equal(a, b)
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        assert b.grad is not None, name
        torch.testing.assert_close(a.grad, b.grad, msg=name)
    # keyword arguments reach the block's forward
    torch.manual_seed(2)
    want = plain.features[0](torch.ones(5, 8), scale=3.0)
    torch.manual_seed(2)
    torch.testing.assert_close(ckpt.features[0](torch.ones(5, 8), scale=3.0), want)


def test_activation_meter_counts_what_checkpointing_saves():
    """The blocks' measure of what they would have kept is what the plain model keeps, and
    leaves the RNG, the statistics and the gradients as if it never ran."""
    torch.manual_seed(0)
    plain = Net()
    ckpt = copy.deepcopy(plain)
    unmeasured = copy.deepcopy(plain)
    sharding.checkpoint_blocks(list(ckpt.features))
    sharding.checkpoint_blocks(list(unmeasured.features))
    x = torch.randn(5, 4)
    torch.manual_seed(1)
    with memory.activation_meter([]) as base:
        plain(x).sum().backward()
    after_plain = torch.randn(4)
    torch.manual_seed(1)
    with memory.activation_meter(list(ckpt.features)) as meter:
        ckpt(x).sum().backward()
    after_measure = torch.randn(4)
    torch.manual_seed(1)
    unmeasured(x).sum().backward()
    assert torch.equal(after_measure, after_plain)
    assert meter["without_checkpointing"] == base["activations"]
    # checkpointed: each block keeps its input (5 x 8 floats) instead of its activations
    assert meter["activations"] < base["activations"]
    for a, b, c in zip(plain.buffers(), ckpt.buffers(), unmeasured.buffers()):
        assert torch.equal(a, b) and torch.equal(a, c)
    for a, b in zip(plain.parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    assert sharding.Measure.on is False and sharding.Measure.kept == {}


def test_the_measure_keys_inputs_and_outputs_by_the_real_storages():
    torch.manual_seed(0)
    block = Block()
    sharding.checkpoint_blocks([block])
    x = torch.randn(5, 8)
    sharding.Measure.on, sharding.Measure.kept = True, {}
    try:
        out = block(x, scale=2.0)
    finally:
        sharding.Measure.on = False
    kept, sharding.Measure.kept = sharding.Measure.kept, {}
    assert kept[sharding.storage_key(x)] == 5 * 8 * 4  # the input under its own key
    inner = [k for k in kept if k != sharding.storage_key(x)]
    assert sharding.storage_key(out) not in kept  # the output is not saved (times a float)
    assert len(inner) >= 4 and all(len(k) == 2 and isinstance(k[0], int) for k in inner)
    assert len({k[0] for k in inner}) == 1  # all of this measure's
    sharding.Measure.on = True
    try:
        block(x)
    finally:
        sharding.Measure.on = False
    second, sharding.Measure.kept = sharding.Measure.kept, {}
    assert {k[0] for k in second if k != sharding.storage_key(x)}.isdisjoint({inner[0][0]})


def test_a_measured_output_is_keyed_as_the_real_one():
    lin = nn.Linear(4, 4)

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return self.lin(x)

    block = Two()
    sharding.checkpoint_blocks([block])
    x = torch.randn(2, 4)
    sharding.Measure.on, sharding.Measure.kept = True, {}
    try:
        with torch.autograd.graph.saved_tensors_hooks(sharding._same, sharding._same):
            out = torch.relu(block(x))  # relu saves the block's output
    finally:
        sharding.Measure.on = False
    kept, sharding.Measure.kept = sharding.Measure.kept, {}
    assert kept == {sharding.storage_key(x): 32}  # Linear saves its input, not the output
    assert out.shape == (2, 4)

    class Relu(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.full((4,), 2.0))

        def forward(self, x):
            return torch.relu(self.w * x)

    block = Relu()
    sharding.checkpoint_blocks([block])
    x = torch.randn(2, 4, requires_grad=True)
    sharding.Measure.on, sharding.Measure.kept = True, {}
    try:
        out = block(x)
    finally:
        sharding.Measure.on = False
    kept, sharding.Measure.kept = sharding.Measure.kept, {}
    # w * x keeps x (w: a parameter), relu its result: the real input's and output's keys
    assert kept == {sharding.storage_key(x): 32, sharding.storage_key(out): 32}


def test_saved_bytes_counts_each_storage_once_and_leaves_the_weights_out():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    x = torch.randn(3, 4)
    saved = sharding.SavedBytes()
    with saved:
        out = model(x)
    # the input (3x4) for the first weight's gradient, relu's result (3x6) for relu's and
    # the second's: the weights (their transposes are views) left out
    assert saved.bytes == 3 * 4 * 4 + 3 * 6 * 4
    assert len(saved.kept) == 2 and saved.kept[sharding.storage_key(x)] == 48
    out.sum().backward()
    empty = sharding.SavedBytes()
    with empty:
        (torch.zeros(0, 4, requires_grad=True) * 2).sum()
    assert empty.kept == {} and empty.bytes == 0
    leaf = sharding.SavedBytes()
    w = torch.randn(4, 4, requires_grad=True)
    with leaf:
        torch.randn(2, 4) @ w.t()
    assert list(leaf.kept.values()) == [32]  # the input, not w nor its transpose


def test_storage_keys_tell_storages_apart_not_views():
    t = torch.arange(6.0)
    assert sharding.storage_key(t) == sharding.storage_key(t.view(2, 3)[1:])
    assert sharding.storage_key(t) == (t.untyped_storage().data_ptr(), torch.device("cpu"))
    assert sharding.storage_key(t) != sharding.storage_key(t.clone())


def test_block_inputs_notes_the_tensor_inputs_until_removed():
    blocks = [Block(2), Block(2)]
    kept, remove = sharding.block_inputs(blocks)
    x, y = torch.randn(3, 2), torch.randn(4, 2)
    blocks[0](x, scale=2.0)
    blocks[1](y, 1.0)
    assert kept == {sharding.storage_key(x): 24, sharding.storage_key(y): 32}
    remove()
    blocks[0](torch.randn(5, 2))
    assert len(kept) == 2
    kept, remove = sharding.block_inputs([blocks[0]])
    blocks[0](torch.zeros(0, 2))
    assert kept == {}
    remove()


# ------------------------------------------------------------------ FSDP on one gloo rank

one_rank = test_sharding_unit.one_rank  # the fixture: a gloo process group of one rank


def _sharded(weight) -> bool:
    """Whether a module holds its 1/world shard (a DTensor) or the gathered parameter."""
    from torch.distributed.tensor import DTensor

    return isinstance(weight, DTensor)


def test_blocks_reshard_after_forward_as_asked_and_the_root_never(one_rank):
    from torch.distributed.fsdp import FSDPModule

    for reshard in (True, False):
        torch.manual_seed(0)
        net = Net()
        blocks = list(net.features)
        sharding.checkpoint_blocks(blocks)
        assert sharding.shard(net, blocks, "bf16", reshard) == (
            "2 Block blocks + root sharded, fp32 parameters gathered (BatchNorm), bf16 "
            "autocast")
        net.train()
        net(torch.randn(3, 4))  # after a forward: the blocks resharded or kept gathered
        assert [_sharded(b.a.weight) for b in blocks] == [reshard, reshard]
        assert not _sharded(net.stem.weight) and not _sharded(net.head.weight)  # the root
        assert isinstance(net, FSDPModule) and not isinstance(net.stem, FSDPModule)
        assert [type(b).__name__ for b in blocks] == ["FSDPCheckpointedBlock"] * 2
        assert [sharding.class_name(b) for b in blocks] == ["Block"] * 2
    plain = nn.Sequential(Other(2), Other(2), nn.Sequential(nn.Linear(2, 2)))
    blocks = [plain[0], plain[1], plain[2]]
    assert sharding.shard(plain, blocks, "fp32", True).startswith(
        "3 Other/Sequential blocks + root sharded, fp32 parameters gathered, ")
