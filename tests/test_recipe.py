"""The training recipe's options: random erasing, mixup and cutmix (batched on the device),
early stopping and time-to-target (`stages[].stop`)."""

from __future__ import annotations

import csv
import json
from types import SimpleNamespace

import pytest
import torch

from conftest import ddpflow, tiny_config, write_config
from ddpflow.config import from_dict
from ddpflow.core.errors import UserError
from ddpflow.data.mixing import Recipe, mix, progressive_sizes, random_erase, resize
from ddpflow.engine import earlystop


def test_erasing_mixup_and_cutmix_on_a_batch():
    x = torch.randn(8, 3, 16, 16) + 5.0  # no value is 0 before erasing
    g = torch.Generator().manual_seed(0)
    erased = random_erase(x, 1.0, g)
    holes = erased == 0
    assert all(holes[i].any() for i in range(8))  # p = 1: one box in every image
    assert all(holes[i].float().mean() <= 0.34 for i in range(8))  # at most a third
    assert torch.equal(random_erase(x, 0.0, g), x)
    y = torch.arange(8) % 4
    mixed, soft = mix(x, y, Recipe(mixup_alpha=0.4, num_classes=4), (0, 1, 2, 3))
    lam = float(soft[0, y[0]]) if y[0] != y[7] else None
    assert torch.allclose(soft.sum(1), torch.ones(8))
    if lam is not None:
        torch.testing.assert_close(mixed[0], x[0] * lam + x[7] * (1 - lam))
    again, soft2 = mix(x, y, Recipe(mixup_alpha=0.4, num_classes=4), (0, 1, 2, 3))
    assert torch.equal(again, mixed) and torch.equal(soft2, soft)  # seeded by position
    cut, soft = mix(x, y, Recipe(cutmix_alpha=1.0, num_classes=4), (0, 1, 2, 4))
    pasted = (cut != x).any(1).float().mean(dim=(1, 2))  # share of pixels from the partner
    kept = float(soft[0, y[0]])  # y[0] = 0 and y[7] = 3 differ
    assert abs((1 - pasted[0].item()) - kept) < 1e-6


def test_progressive_sizes_grow_linearly_to_the_end_size():
    size_at = progressive_sizes({"start_size": 12, "end_size": 16}, 5)
    assert [size_at(e) for e in range(6)] == [12, 13, 14, 15, 16, 16]
    assert progressive_sizes({"start_size": 24, "end_size": 32}, 1)(0) == 24
    x = torch.randn(2, 3, 16, 16)
    assert resize(x, 12).shape == (2, 3, 12, 12) and resize(x, 16) is x


def test_recipe_options_that_cannot_apply_are_one_message():
    base = {"stages": [{"name": "a", "mixup_alpha": 0.2}]}
    with pytest.raises(UserError, match="stages.0.mixup_alpha mixes labels, which only task "
                                        "classification takes"):
        from_dict({**base, "task": "regression"})
    with pytest.raises(UserError, match="stages.0.random_erasing acts on prepared arrays"):
        from_dict({"data": {"source": "python", "factory": "m:f"},
                   "stages": [{"name": "a", "random_erasing": 0.5}]})
    rrc = {"random_resized_crop": {"scale": [0.2, 1.0]}}
    with pytest.raises(UserError, match="data.store_size 24 is smaller than data.image_size "
                                        "32; the augment.random_resized_crop crops from"):
        from_dict({"data": {"store_size": 24, "augment": rrc}, "stages": [{"name": "a"}]})
    with pytest.raises(UserError, match=r"random_resized_crop.scale \[0.9, 0.5\] must be"):
        from_dict({"data": {"store_size": 40, "augment": {"random_resized_crop": {
            "scale": [0.9, 0.5]}}}, "stages": [{"name": "a"}]})
    # resolved: store_size from the source, the crop's defaults, pad-and-crop replaced
    cfg = from_dict({"data": {"source": "imagefolder", "path": "x", "image_size": 64,
                              "augment": {"random_resized_crop": {}}}, "stages": [{"name": "a"}]})
    assert cfg.data.store_size == 74 and cfg.data.augment.crop_padding == 0
    assert cfg.data.augment.random_resized_crop == {"scale": [0.08, 1.0], "ratio": [0.75, 4 / 3]}
    assert from_dict({"stages": [{"name": "a"}]}).data.store_size == 32


def _trainer(stop: dict, monitor=("val_acc", "max")):
    """A stage's stop rule and the TrainState its record lives in (what earlystop.check is
    given by the trainer)."""
    state = SimpleNamespace(stop={}, step=0, epoch=0)
    from ddpflow.config.types import StopCfg

    stop = StopCfg(**{"monitor": None, "patience": None, "target": None, **stop})
    rule = earlystop.stop_rule(stop, "stages.0", SimpleNamespace(maximize=("acc",)),
                               "classification", monitor[0], monitor[1])
    return SimpleNamespace(rule=rule, state=state), []


def _feed(t, values, key="val_acc"):
    for i, v in enumerate(values):
        t.state.step, t.state.epoch = 10 * (i + 1), i
        at = {"step": t.state.step, "epoch": i + 1, "train_time_s": 0.0, "wall_time_s": 0.0}
        t.state.stop = earlystop.check(t.rule, t.state.stop, {key: v, "val_loss": 1 - v}, at)
        if "stopped" in t.state.stop:
            return i + 1
    return None


def test_patience_counts_validations_without_a_new_best():
    t, said = _trainer({"monitor": None, "patience": 2, "target": None})
    assert _feed(t, [0.5, 0.6, 0.6, 0.55, 0.9]) == 4  # 0.6 and 0.55 do not beat 0.6
    assert t.state.stop["stopped"]["step"] == 40
    assert "patience 2" in t.state.stop["stopped"]["reason"]
    # a minimized monitor of the user's choice: val_loss must fall
    t, _ = _trainer({"monitor": "val_loss", "patience": 1, "target": None})
    assert _feed(t, [0.5, 0.6, 0.7]) is None and t.state.stop["bad_validations"] == 0
    assert _feed(t, [0.7]) == 1  # loss 0.3 again: no new best
    # a target that is reached: recorded once, with its step
    t, _ = _trainer({"monitor": None, "patience": None, "target": 0.7})
    assert _feed(t, [0.5, 0.71, 0.9]) == 2
    assert t.state.stop["target"]["step"] == 20 and t.state.stop["target"]["value"] == 0.71
    # off: never stops, keeps no state
    t, _ = _trainer({"monitor": None, "patience": None, "target": None})
    assert _feed(t, [0.5, 0.4, 0.3]) is None and t.state.stop == {}
    t, _ = _trainer({"monitor": "val_f1", "patience": 1, "target": None})
    with pytest.raises(UserError, match="stop.monitor val_f1 is not a validation metric"):
        _feed(t, [0.5])


@pytest.mark.slow
def test_a_stage_stops_at_its_target_and_records_the_time(tmp_path):
    cfg = tiny_config(tmp_path, stages=[
        {"name": "s1", "epochs": 8, "batch_size": 32, "lr": 0.05,
         "stop": {"target": 0.5}, "progressive_resize": {"start_size": 12, "end_size": 16}},
        # the next stage trains with soft targets: erasing, mixup and cutmix
        {"name": "s2", "epochs": 1, "batch_size": 32, "lr": 0.01, "init_from": "previous",
         "random_erasing": 0.25, "mixup_alpha": 0.2, "cutmix_alpha": 1.0}])
    p = write_config(tmp_path, cfg)
    ddpflow("prepare", "--config", p, check=True)
    proc = ddpflow("launch", "--config", p, "--stage", "s1", check=True)
    assert "stopping early" in proc.stderr
    assert "epoch 0: training images at 12 px" in proc.stderr  # progressive resizing
    s = json.loads((tmp_path / "results/t/stages/s1/summary.json").read_text())
    assert s["finished"] and s["epochs"] < 8 and s["steps"] == 16 * s["epochs"]
    assert s["early_stop"]["step"] == s["steps"] and "reached the target 0.5" in s[
        "early_stop"]["reason"]
    assert s["target"]["value"] >= 0.5 and s["final_val_acc"] == s["target"]["value"]
    assert 0 < s["target"]["train_time_s"] <= s["time_to_target_s"] <= s["wall_time_s"]
    assert (tmp_path / "results/t/stages/s1/final.pt").is_file()
    # a relaunch has nothing to do; the next stage starts from the stopped weights
    again = ddpflow("launch", "--config", p, "--stage", "s1", check=True)
    assert "nothing to do" in again.stderr + again.stdout
    ddpflow("launch", "--config", p, "--stage", "s2", check=True)
    out = ddpflow("collect", "--config", p, check=True)
    assert "target reached after" in out.stdout
    rows = list(csv.DictReader(open(tmp_path / "results/t/summary/summary.csv")))
    assert float(rows[0]["time_to_target_s"]) == s["time_to_target_s"]
    assert "reached the target" in rows[0]["early_stop"] and rows[1]["early_stop"] == ""
