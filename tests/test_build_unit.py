"""engine/build.py's parts of a stage, in this process on a CPU: the data pipeline a stage
opens and the steps it counts from it (and the one message when the global batch exceeds the
training split), the device memory data.loader auto may give the dataset, the model's
parameter bytes counted on the meta device, the blocks a stage shards or recomputes (and the
messages when it cannot), and the optimizer's learning rate over the steps (data_parts,
loader_budget, _param_bytes, model_blocks, optimizer_parts). Fast: a prepared set of 64
images, tiny models, no training step.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from conftest import tiny_config
from ddpflow.config import from_dict
from ddpflow.core.errors import UserError
from ddpflow.data.prepare import prepare
from ddpflow.engine import build, distributed
from ddpflow.seams.models import SmallCNN, build_model

CPU = torch.device("cpu")
MiB = 2**20
META = {"num_classes": 4, "image_shape": [12, 12, 3], "mean": [0.5] * 3, "std": [0.25] * 3}


def one_rank(world=1):
    return distributed.Dist(0, 0, world, CPU, None)


def param_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


# ------------------------------------------------------------------ the data

@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """A prepared synthetic set: 64 training images of 12 x 12, two stages."""
    tmp = tmp_path_factory.mktemp("build_synthetic")
    raw = tiny_config(tmp, data={"train_size": 64, "val_size": 16, "test_size": 8,
                                 "image_size": 12, "loader": "dataloader", "num_workers": 0},
                      stages=[{"name": "s1", "epochs": 2, "batch_size": 8, "lr": 0.05},
                              {"name": "s2", "epochs": 3, "batch_size": 8, "lr": 0.05}])
    prepare(from_dict(raw))
    return raw


def _parts(raw, stage="s2", batch=8, accum=1, channels_last=False, **over):
    raw = copy.deepcopy(raw)
    raw["stages"][1].update(over)
    cfg = from_dict(raw)
    lines = []
    settings = SimpleNamespace(tuned=None, channels_last=channels_last)
    out = build.data_parts(cfg, cfg.stage(stage), one_rank(), META, settings, batch, accum,
                           None, lines.append)
    return out, lines


def test_the_pipeline_counts_whole_steps_of_the_global_batch(synthetic):
    (data, per_epoch, total), lines = _parts(synthetic, batch=8, accum=3)
    assert data.kind == "dataloader" and len(data.train) == 6  # 8 batches: 2 steps of 3
    assert per_epoch == 2 and type(per_epoch) is int
    assert total == 3 * 2  # the stage's 3 epochs
    assert lines == [f"loader: dataloader ({data.reason})"]


def test_max_steps_sets_the_total_and_a_single_step_epoch_is_enough(synthetic):
    (_, per_epoch, total), _ = _parts(synthetic, batch=32, accum=2, max_steps=5)
    assert (per_epoch, total) == (1, 5)


def test_a_global_batch_larger_than_the_training_split_is_one_message(synthetic):
    with pytest.raises(UserError) as e:
        _parts(synthetic, batch=32, accum=3)
    assert str(e.value) == ("stages.1.batch_size 32 x 1 ranks x 3 accumulation exceeds the 64 "
                            "training samples; lower the batch size")


def test_progressive_resizing_spreads_its_sizes_over_the_stages_epochs(synthetic):
    """10 steps of 4 a epoch: 3 epochs (the last one short), 8 -> 10 -> 12 pixels."""
    (data, per_epoch, total), _ = _parts(synthetic, batch=16, max_steps=10,
                                         progressive_resize={"start_size": 8, "end_size": 12})
    assert (per_epoch, total) == (4, 10)
    assert [data.train.size_at(e) for e in range(4)] == [8, 10, 12, 12]


@pytest.mark.parametrize("setting, on", [(True, True), ("auto", False), (False, False)])
def test_the_inputs_are_channels_last_only_when_the_stage_says_so(synthetic, setting, on):
    """auto decides after the model is built (model_parts): NCHW until then."""
    (data, _, _), _ = _parts(synthetic, channels_last=setting)
    assert data.normalize.channels_last is on


# ------------------------------------------------------------------ the loader's budget

@pytest.fixture
def free(monkeypatch):
    """This node's free device memory as the test sets it (a real one moves between calls)."""
    def set_to(n):
        monkeypatch.setattr(build, "free_memory", lambda device: n)
    return set_to


def _cfg(tmp_path, loader="auto", name="smallcnn", **model):
    raw = tiny_config(tmp_path, data={"loader": loader})
    raw["model"] = {"name": name, **model}
    return from_dict(raw)


def test_the_dataset_may_take_what_is_free_after_four_times_the_models_weights(tmp_path,
                                                                             free):
    cfg = _cfg(tmp_path)
    model = 4 * param_bytes(build_model(cfg.model, 4, 3))
    free(64 * MiB)
    assert build.loader_budget(cfg, one_rank(), META) == (
        64 * MiB - model, f" (after the model's {model / MiB:.0f} MiB)")
    assert build.loader_budget(cfg, one_rank(world=2), META) == (
        64 * MiB - model, f" (the least of 2 ranks, after the model's {model / MiB:.0f} MiB)")


def test_a_model_larger_than_the_free_memory_leaves_the_dataset_nothing(tmp_path, free):
    cfg = _cfg(tmp_path, kwargs={"width": 128})
    model = 4 * param_bytes(SmallCNN(4, 3, width=128))
    assert model > 2 * MiB
    free(model // 2)
    assert build.loader_budget(cfg, one_rank(), META) == (
        0, f" (after the model's {model / MiB:.0f} MiB)")
    free(0)
    assert build.loader_budget(cfg, one_rank(), META)[0] == 0


def test_memory_chooses_the_loader_only_under_auto_for_prepared_images(tmp_path, free):
    free(64 * MiB)
    assert build.loader_budget(_cfg(tmp_path, loader="device"), one_rank(), META) is None
    assert build.loader_budget(_cfg(tmp_path, loader="dataloader"), one_rank(), META) is None
    assert build.loader_budget(_cfg(tmp_path), one_rank(), {**META, "kind": "python"}) is None


# ------------------------------------------------------------------ parameter bytes

FRAGILE = '''
import torch
from torch import nn


class Fragile(nn.Module):
    """Reads a tensor's value while it is built: not possible on the meta device."""

    def __init__(self, num_classes, in_channels):
        super().__init__()
        self.fc = nn.Linear(in_channels, num_classes)
        if float(self.fc.weight.detach().abs().sum()) < 0:
            raise ValueError("never")

    def forward(self, x):
        return self.fc(x.mean((2, 3)))
'''


def test_the_parameter_bytes_are_the_models_own_for_the_datas_channels(tmp_path):
    cfg = _cfg(tmp_path)
    assert build._param_bytes(cfg, META) == param_bytes(SmallCNN(4, 3)) > 0
    grey = {**META, "image_shape": [12, 12, 1]}
    assert build._param_bytes(cfg, grey) == param_bytes(SmallCNN(4, 1))
    half = _cfg(tmp_path, kwargs={"width": 8})
    assert build._param_bytes(half, META) == param_bytes(SmallCNN(4, 3, width=8))


def test_a_model_that_cannot_be_built_on_the_meta_device_counts_nothing(tmp_path, free):
    (tmp_path / "test_build_unit_models.py").write_text(FRAGILE)
    cfg = _cfg(tmp_path, name="test_build_unit_models:Fragile", code_dir=str(tmp_path))
    assert build_model(cfg.model, 4, 3) is not None  # it builds on a real device
    assert build._param_bytes(cfg, META) == 0
    free(64 * MiB)
    assert build.loader_budget(cfg, one_rank(), META) == (64 * MiB,
                                                         " (after the model's 0 MiB)")


# ------------------------------------------------------------------ the model's blocks

class Block(nn.Module):
    def __init__(self, width=4):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return self.fc(x).relu()


class Tower(nn.Module):
    """Three Blocks and a head; `tied`: the head uses the first block's weight."""

    def __init__(self, tied=False):
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block(), Block())
        self.head = nn.Linear(4, 4)
        if tied:
            self.head.weight = self.blocks[0].fc.weight

    def forward(self, x):
        return self.head(self.blocks(x))


def _stage_cfg(tmp_path, **stage):
    raw = tiny_config(tmp_path, stages=[{"name": "s1", "epochs": 1, "batch_size": 8},
                                        {"name": "s2", "epochs": 1, "batch_size": 8, **stage}])
    cfg = from_dict(raw)
    return cfg, cfg.stage("s2")


def test_a_ddp_stage_without_checkpointing_has_no_blocks(tmp_path):
    assert build.model_blocks(*_stage_cfg(tmp_path), Tower()) == ([], [])


def test_activation_checkpointing_recomputes_the_models_blocks(tmp_path):
    m = Tower()
    ac, blocks = build.model_blocks(*_stage_cfg(tmp_path, activation_checkpointing=True), m)
    assert ac == blocks == list(m.blocks)


def test_checkpointing_named_classes_and_sharding_found_blocks(tmp_path):
    m = Tower()
    cfg, st = _stage_cfg(tmp_path, activation_checkpointing=["Linear"])
    ac, blocks = build.model_blocks(cfg, st, m)
    assert ac == [b.fc for b in m.blocks] + [m.head] and blocks == list(m.blocks)
    cfg, st = _stage_cfg(tmp_path, strategy="fsdp")
    assert build.model_blocks(cfg, st, m) == ([], list(m.blocks))
    cfg, st = _stage_cfg(tmp_path, activation_checkpointing=["Blok"])
    with pytest.raises(UserError, match=r"^stages\.1\.activation_checkpointing: 'Blok' is "
                                        r"not the class of any module of the model"):
        build.model_blocks(cfg, st, m)


def test_tied_weights_are_refused_by_fsdp_alone(tmp_path):
    m = Tower(tied=True)
    cfg, st = _stage_cfg(tmp_path, activation_checkpointing=True)
    assert build.model_blocks(cfg, st, m) == (list(m.blocks), list(m.blocks))
    cfg, st = _stage_cfg(tmp_path, strategy="fsdp")
    with pytest.raises(UserError) as e:
        build.model_blocks(cfg, st, m)
    assert str(e.value) == (
        "stages.1.strategy fsdp: model smallcnn uses parameter 'head.weight' in two of its "
        "blocks, or in a block and outside them (tied weights), and FSDP shards each block "
        "apart; name larger blocks in model.shard_blocks that hold every use of it, or use "
        "strategy ddp")


@pytest.mark.parametrize("stage, why", [({"strategy": "fsdp"}, "strategy fsdp"),
                                        ({"activation_checkpointing": True},
                                         "activation_checkpointing")])
def test_a_model_without_blocks_is_one_message(tmp_path, stage, why):
    cfg, st = _stage_cfg(tmp_path, **stage)
    with pytest.raises(UserError) as e:
        build.model_blocks(cfg, st, nn.Linear(3, 2))
    assert str(e.value) == (
        f"stages.1.{why}: model smallcnn has no repeated blocks (8 parameters) to shard or "
        f"recompute one by one; use strategy ddp without activation checkpointing, or name "
        f"its block classes in model.shard_blocks")


# ------------------------------------------------------------------ the optimizer

def test_the_learning_rate_is_scaled_warmed_up_and_decayed_to_lr_min(tmp_path):
    """lr 0.1 for 128 samples, linear scaling at 256: 0.2; half an epoch of 4 steps of
    warm-up (2 steps), then linear decay to lr_min 0.02, scaled like lr (0.04), at step 10."""
    cfg, st = _stage_cfg(tmp_path, lr=0.1, lr_scaling="linear", lr_reference_batch=128,
                         warmup_epochs=0.5, schedule="linear", lr_min=0.02)
    model = nn.Linear(2, 2)
    lr, opt, sched, *precision = build.optimizer_parts(model, st, 256, 4, 10, "fp32", CPU)
    assert lr == pytest.approx(0.2) and len(precision) == 2
    seen = []
    for _ in range(11):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.1, 0.2] + [0.2 - 0.16 * s / 8 for s in range(9)])
    assert seen[-1] == pytest.approx(0.04)
