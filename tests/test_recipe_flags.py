"""torchvision's recipe flags as stage and data keys (lr_min, step and multistep schedules,
norm_weight_decay), the config checks of every new key (one row per class of bad input,
through the real CLI), and the metrics that show imbalance: per-class recall and balanced
accuracy, from the task through the ranks' reduction to the headline and the report."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from conftest import tiny_config, write_config
from ddpflow.cli import main
from ddpflow.config import from_dict
from ddpflow.core.errors import UserError
from ddpflow.engine.runtime import build_optimizer, decay_boundaries, schedule
from ddpflow.engine.validation import MetricSums, metrics_text
from ddpflow.results.collect import headline, imbalance_text
from ddpflow.results.report import _per_class
from ddpflow.seams.tasks import Classification, improves


# --------------------------------------------------------------------------- schedules
def test_cosine_and_linear_end_at_lr_min():
    for kind in ("cosine", "linear"):
        f = schedule(kind, 2, 12, floor=0.1)
        assert f(0) == 0.5 and f(1) == 1.0 and f(2) == pytest.approx(1.0)
        assert f(12) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)
    assert schedule("cosine", 0, 10, 0.2)(5) == pytest.approx(0.2 + 0.8 * 0.5)
    assert schedule("linear", 0, 10, 0.2)(5) == pytest.approx(0.2 + 0.8 * 0.5)
    assert schedule("linear", 0, 10, 0.2)(7) == pytest.approx(0.2 + 0.8 * 0.3)
    # without lr_min, the values it always gave (bit for bit)
    assert schedule("cosine", 0, 10)(3) == 0.5 * (1 + math.cos(math.pi * 0.3))
    assert schedule("linear", 0, 10)(3) == 1 - 0.3


def test_step_and_multistep_multiply_by_gamma_at_their_epochs():
    st = SimpleNamespace(schedule="step", lr_step_epochs=2, lr_milestones=())
    assert decay_boundaries(st, 5, 40) == (10, 20, 30)
    st = SimpleNamespace(schedule="multistep", lr_step_epochs=None, lr_milestones=(1, 3))
    assert decay_boundaries(st, 5, 40) == (5, 15)
    f = schedule("multistep", 2, 40, boundaries=(5, 15), gamma=0.5)
    assert [f(s) for s in (0, 1, 2, 4, 5, 14, 15, 39)] == [0.5, 1.0, 1.0, 1.0, 0.5, 0.5, 0.25,
                                                          0.25]


def test_norm_weight_decay_sets_the_norms_and_biases_apart():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    st = SimpleNamespace(optimizer="sgd", weight_decay=0.01, momentum=0.9, nesterov=True,
                         norm_weight_decay=None)
    groups = build_optimizer(model, st, 0.1, torch.device("cpu")).param_groups
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0]
    assert [len(g["params"]) for g in groups] == [1, 3]  # the weight; a bias and the norm's
    st.norm_weight_decay = 0.001
    groups = build_optimizer(model, st, 0.1, torch.device("cpu")).param_groups
    assert [g["weight_decay"] for g in groups] == [0.01, 0.001]


def test_a_stage_trains_with_the_schedule_it_names(tmp_path):
    """The stage's LR at each logged step follows multistep's milestones (a real run)."""
    stage = {"name": "s1", "epochs": 3, "batch_size": 64, "lr": 0.1, "schedule": "multistep",
             "lr_milestones": [1, 2], "lr_gamma": 0.5, "norm_weight_decay": 0.0001}
    cfg = tiny_config(tmp_path, stages=[stage], hardware={"nproc_per_node": 1},
                      log_every_steps=8)
    p = write_config(tmp_path, cfg)
    assert main(["prepare", "--config", str(p)]) == 0
    from conftest import ddpflow

    ddpflow("launch", "--config", p, "--stage", "s1", check=True)
    lines = (tmp_path / "results/t/stages/s1/metrics.jsonl").read_text().splitlines()
    lr = {r["step"]: r["lr"] for r in map(json.loads, lines) if r["kind"] == "train"}
    # 16 steps an epoch; the LR logged is the one after the interval's last step
    assert lr == {8: 0.1, 16: 0.05, 24: 0.05, 32: 0.025, 40: 0.025, 48: 0.025}


# --------------------------------------------------------------------------- config rows
def _d(**data):
    return {"stages": [{"name": "a"}], "data": data}


def _st(**stage):
    return {"stages": [{"name": "a", **stage}]}


CONFIG_ROWS = [
    # class of bad input, config, words of the one message
    ("unknown policy", _d(augment={"policy": "autoaugment"}),
     "data.augment.policy: 'autoaugment' is not one of null, 'trivialaugment', "
     "'randaugment', 'augmix'"),
    ("magnitude out of range (randaugment)",
     _d(augment={"policy": "randaugment", "magnitude": 31}), "data.augment.magnitude: 31"),
    ("magnitude out of range (augmix)", _d(augment={"policy": "augmix", "magnitude": 11}),
     "data.augment.magnitude 11 is AugMix's severity, from 1 to 10"),
    ("severity 0 (augmix)", _d(augment={"policy": "augmix", "magnitude": 0}),
     "data.augment.magnitude 0 is AugMix's severity, from 1 to 10"),
    ("a key of another policy", _d(augment={"policy": "trivialaugment", "num_ops": 2}),
     "data.augment.num_ops is a setting of policy randaugment, and data.augment.policy is "
     "trivialaugment; drop it"),
    ("a policy's key without a policy", _d(augment={"magnitude": 5}),
     "data.augment.magnitude is a setting of policy randaugment and augmix, and "
     "data.augment.policy is null"),
    ("unknown sampling", _d(sampling="oversample"),
     "data.sampling: 'oversample' is not one of 'uniform', 'balanced', 'weights'"),
    ("weights without a callable", _d(sampling="weights"),
     "data.sampling weights draws each sample by its weight, and data.sample_weights is null"),
    ("a callable that is not an import path", _d(sampling="weights", sample_weights="w.py"),
     "data.sample_weights"),
    ("weights set, another sampling", _d(sample_weights="w:f"),
     "data.sample_weights is read by data.sampling weights only, and data.sampling is "
     "uniform"),
    ("balanced on a regression task", {**_d(sampling="balanced"), "task": "regression"},
     "data.sampling balanced draws each class equally often, and task regression has no "
     "classes"),
    ("no repeats", _d(repeated_augment=0), "data.repeated_augment: 0"),
    ("a policy on a user dataset",
     _d(source="python", factory="m:f", augment={"policy": "augmix"}),
     "data.augment.policy acts on prepared images; a data.source python dataset does its "
     "own transforms"),
    ("an evaluation resize below its crop", _d(eval_resize_size=20, eval_crop_size=24),
     "data.eval_resize_size 20 is smaller than the centre crop it is cut from (24"),
    ("unknown interpolation", _d(interpolation="lanczos"),
     "data.interpolation: 'lanczos' is not one of 'bilinear', 'bicubic'"),
    ("step without its epochs", _st(schedule="step"),
     "stages.0.lr_step_epochs: schedule step multiplies the learning rate by lr_gamma"),
    ("a schedule's key under another", _st(lr_step_epochs=3),
     "stages.0.lr_step_epochs is a setting of schedule step, and this stage's schedule is "
     "cosine"),
    ("multistep without milestones", _st(schedule="multistep"),
     "stages.0.lr_milestones: schedule multistep multiplies the learning rate by lr_gamma"),
    ("milestones under another schedule", _st(lr_milestones=[1]),
     "stages.0.lr_milestones is a setting of schedule multistep"),
    ("duplicate milestones", _st(epochs=9, schedule="multistep", lr_milestones=[2, 2, 5]),
     "stages.0.lr_milestones [2, 2, 5]: each epoch once, in increasing order"),
    ("milestones out of order", _st(epochs=9, schedule="multistep", lr_milestones=[5, 2]),
     "stages.0.lr_milestones [5, 2]: each epoch once, in increasing order"),
    ("a milestone after the stage", _st(epochs=3, schedule="multistep", lr_milestones=[3]),
     "stages.0.lr_milestones: epoch 3 is not inside the stage's 3 epoch(s)"),
    ("lr_min without a decay", _st(schedule="constant", lr_min=0.01),
     "stages.0.lr_min is where a cosine or linear schedule ends, and this stage's schedule "
     "is constant"),
    ("lr_min above lr", _st(lr=0.1, lr_min=0.1),
     "stages.0.lr_min 0.1 is not below lr 0.1"),
    ("gamma out of range", _st(schedule="step", lr_step_epochs=1, lr_gamma=1),
     "stages.0.lr_gamma: 1"),
    ("negative norm decay", _st(norm_weight_decay=-1), "stages.0.norm_weight_decay: -1"),
]


@pytest.mark.parametrize("cls,raw,words", CONFIG_ROWS, ids=[r[0] for r in CONFIG_ROWS])
def test_each_new_key_refuses_bad_input_with_one_message(tmp_path, capsys, cls, raw, words):
    """`ddpflow validate` (the CLI, in this process): exit 2, one line naming the key and
    what to do, nothing written."""
    raw = {**raw, "results_dir": str(tmp_path / "results")}
    p = write_config(tmp_path, raw)
    assert main(["validate", "--config", str(p)]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert sorted(x.name for x in tmp_path.iterdir()) == ["config.yaml"]


def test_the_new_keys_resolve_as_documented():
    cfg = from_dict({**_d(sampling="balanced", augment={"policy": "augmix", "magnitude": 10}),
                     **_st(schedule="multistep", epochs=4, lr_milestones=[1, 3])})
    assert cfg.data.sampling_replacement is None and cfg.stages[0].lr_milestones == (1, 3)
    from_dict({**_d(augment={"policy": "augmix", "magnitude": 1}), "task": "classification",
               **_st(schedule="step", lr_step_epochs=1)})
    from_dict({**_st(max_steps=100, epochs=1, schedule="multistep", lr_milestones=[5])})


# --------------------------------------------------------------------------- metrics
def test_the_classification_task_counts_each_classs_recall():
    task = Classification()
    logits = torch.tensor([[9.0, 0, 0], [9.0, 0, 0], [0, 9.0, 0], [9.0, 0, 0]])
    y = torch.tensor([0, 1, 1, 0])
    m = task.metrics(logits, (None, y))
    hits, n = m["recall"]
    assert hits.tolist() == [2, 1, 0] and n.tolist() == [2, 2, 0]
    assert task.summarize({"recall": [1.0, 0.5, None]}) == {"balanced_acc": 0.75}
    assert task.summarize({"acc": 1.0}) == {}
    assert "balanced_acc" in task.maximize


def test_vector_metrics_reduce_to_lists_and_the_balanced_accuracy():
    d = SimpleNamespace(backend=None, world=1, rank=0, device=torch.device("cpu"))
    sums = MetricSums(Classification(), "classification", torch.device("cpu"))
    logits = torch.tensor([[9.0, 0, 0], [9.0, 0, 0], [0, 9.0, 0], [9.0, 0, 0]])
    for y in ([0, 1, 1, 0], [1, 1, 0, 0]):
        sums.add(logits, (None, torch.tensor(y)))
    out = sums.reduce(d)
    # class 0: 3 of 4 right; class 1: 1 of 4; class 2: none in the split
    assert out["val_recall"] == [0.75, 0.25, None]
    assert out["val_balanced_acc"] == pytest.approx(0.5) and out["val_acc"] == 4 / 8
    assert metrics_text({"val_acc": 0.5, "val_recall": [0.25, None, 1.0]}) == \
        "val_acc 0.5000, val_recall min 0.2500 max 1.0000 of 3 classes"
    assert metrics_text({"val_recall": [None]}) == "val_recall -"


def test_a_per_class_metric_cannot_choose_best_pt():
    assert improves({"val_balanced_acc": 0.6}, "val_balanced_acc", "max", 0.5, "c")
    with pytest.raises(UserError, match="task.monitor val_recall is one value per class"):
        improves({"val_recall": [0.5]}, "val_recall", "max", None, "classification")


def test_the_headline_and_the_report_show_the_lowest_class():
    row = {"stage": "s1", "finished": True, "monitor": "val_acc", "final_val_acc": 0.9,
           "best_value": 0.9, "steps": 10, "wall_time_s": 5.0, "mean_samples_per_s": 1.0,
           "world_size": 1, "precision": "fp32", "final_val_balanced_acc": 0.6,
           "final_val_recall": [0.95, 0.25, None], "test_recall": [0.5, 0.75, 1.0]}
    assert imbalance_text(row, ["cat", "dog", "eel"]) == \
        "balanced acc 0.6000, lowest class recall 0.2500 (dog)"
    assert imbalance_text(row, None).endswith("(class 1)")
    assert imbalance_text({"final_val_acc": 0.9}, None) is None
    cfg = SimpleNamespace(run="r", run_dir=Path("r"))
    text = headline(cfg, [row], None, ["cat", "dog", "eel"])
    assert "val balanced acc 0.6000, lowest class recall 0.2500 (dog)" in text
    html = _per_class([row], ["cat", "dog", "eel"])
    assert html.count("<tr>") == 4 and "s1 (val)</th><th>s1 (test)" in html
    assert '<td class="bad">0.2500</td>' in html and '<td class="bad">0.5000</td>' in html
    assert _per_class([{"stage": "s", "finished": True, "final_val_acc": 1}], None) == ""
