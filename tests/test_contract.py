"""The seam contract (seams/contract.py): one checker for the model builder, the dataset
factory's items and the task, for the built-ins and the user's callables alike. A row per
class of mistake: a UserError naming the callable, what it returned and what was expected."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from torch import nn

from conftest import ddpflow, tiny_config, write_config
from ddpflow.core.errors import UserError
from ddpflow.seams import contract
from ddpflow.seams.contract import Probe, check_item, check_items, check_model, check_task

NAME = "model.name mypkg.nets:build"


class Net(nn.Module):
    """A small classifier whose forward's result is `shape(logits)`."""

    def __init__(self, shape=lambda z: z, width=4):
        super().__init__()
        self.body = nn.Sequential(nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(12, width))
        self.shape = shape

    def forward(self, x):
        return self.shape(self.body(x))


MODELS = [  # (model, expected in the message)
    (Net(lambda z: (z, z.mean())), "returned a tuple of 2: (a Tensor of shape (2, 4)"),
    (Net(lambda z: {"logits": z}), "returned a dict with keys logits from forward(), not a "
                                   "tensor; the classification task expects a tensor of "
                                   "logits [batch, 4]"),
    (Net(width=1000), "returned a Tensor of shape (2, 1000) (float32) for a batch of 2; "
                      "expected [2, 4]"),
    (Net(lambda z: z * float("nan")), "returned NaN/inf outputs"),
    (Net(lambda z: z[:, :, None, None]), "returned a Tensor of shape (2, 4, 1, 1) (float32) "
                                         "for a batch of 2; expected a tensor of logits"),
    (Net(lambda z: z.sum()), "returned a Tensor of shape () (float32)"),
]


@pytest.mark.parametrize("model,expected", MODELS)
def test_a_model_that_breaks_the_contract_is_one_message_naming_it(model, expected):
    model.train()
    with pytest.raises(UserError, match=re.escape(expected)) as e:
        check_model(model, 4, 3, 16, NAME)
    assert str(e.value).startswith(NAME)
    assert model.training  # the probe leaves the mode as it was


def test_the_builders_check_on_the_meta_device_too_and_the_builtins_pass():
    from ddpflow.seams.models import build_model

    for name in ("smallcnn", "mlp"):
        model = build_model(name, 4, 3, Probe((16, 16), "classification", 4))
        build_model(name, 4, 1, Probe((16, 16), "classification", 4))
        with torch.device("meta"):
            build_model(name, 4, 3, Probe((16, 16), "classification", 4))
        rng = torch.random.get_rng_state()
        check_model(model, 4, 3, 16, f"model.name {name}")
        assert torch.equal(torch.random.get_rng_state(), rng)  # the seeded stream untouched
    with pytest.raises(UserError, match=re.escape(
            "model.name smallcnn returned a Tensor of shape (2, 4) (float32) for a batch of 2; "
            "expected [2, 5]")):
        build_model("smallcnn", 4, 3, Probe((16, 16), "classification", 5))
    with torch.device("meta"), pytest.raises(UserError, match=re.escape("(2, 1000)")):
        check_model(Net(width=1000), 4, 3, 16, NAME)
    check_model(Net(width=7), 4, 3, (16, 12), NAME, width=None)  # classes unknown
    # a user task takes any outputs (finite); regression one value per (prepared) label
    check_model(Net(lambda z: {"logits": z[:, :, None]}), 4, 3, 16, NAME, task=None)
    with pytest.raises(UserError, match=re.escape(f"{NAME} returned NaN/inf outputs")):
        check_model(Net(lambda z: (z / 0, z)), 4, 3, 16, NAME, task=None)
    check_model(Net(lambda z: z[:, 0], width=1), None, 3, 16, NAME, "regression", 1)
    check_model(Net(width=1), None, 3, 16, NAME, "regression", 1)
    with pytest.raises(UserError, match=re.escape(
            "returned a Tensor of shape (2, 4) (float32) for a batch of 2; the regression task "
            "expects a tensor of outputs [batch, 1]: one output per target value")):
        check_model(Net(), None, 3, 16, NAME, "regression", 1)


# ------------------------------------------------------------------ dataset items
IMAGE = torch.rand(3, 16, 16)
ITEMS = [  # (item, keyword arguments, expected in the message)
    ((IMAGE, 1, 2), {}, "item 5 of the 'train' dataset is a tuple of 3"),
    ({"x": IMAGE}, {}, "item 5 of the 'train' dataset is a dict with keys x; expected an "
                       "(input, target) pair"),
    ((IMAGE.permute(1, 2, 0), 1), {}, "shape (16, 16, 3) (float32): H x W x C (channels last)"),
    ((torch.rand(16, 16, 3), 1), {"in_channels": None}, "H x W x C"),
    ((IMAGE * 255, 1), {"materialize": True}, "expected float in [0, 1] or uint8"),
    (((IMAGE * 255).round(), 1), {}, "0..255 pixels; expected float in [0, 1]"),
    ((torch.rand(1, 16, 16), 1), {}, "1 channels; expected 3"),
    ((IMAGE, 7), {}, "its target is label 7, out of range; expected a class index in [0, 4)"),
    ((IMAGE, -1), {}, "label -1, out of range"),
    ((IMAGE, 1.0), {}, "a float label 1.0; expected an integer class index"),
    ((IMAGE, torch.tensor(1.0)), {}, "a float32 label; expected an integer class index"),
    ((IMAGE, torch.tensor([0, 1])), {}, "a label of shape (2,)"),
    ((torch.full((3, 16, 16), float("nan")), 1), {}, "has NaN/inf in its input"),
    (({"a": torch.tensor([1.0, float("inf")])}, 0.5), {"classify": False}, "NaN/inf"),
    ((IMAGE, torch.tensor([float("nan")])), {"classify": False}, "NaN/inf in its target"),
    (("text", 1), {}, "holds str, not tensors"),
    ((np.zeros((2, 2)), [0.5, "b"]), {"classify": False}, "holds str"),
    (((), 1), {}, "an empty input or target"),
    ((torch.rand(8), 1.5), {"materialize": True}, "data.materialize needs C x H x W images"),
]


@pytest.mark.parametrize("item,kw,expected", ITEMS)
def test_an_item_that_breaks_the_contract_is_one_message_naming_it(item, kw, expected):
    kw = {"in_channels": 3, **kw}
    with pytest.raises(UserError, match=re.escape(expected)) as e:
        check_item(item, 5, "data.factory mypkg.data:make", "train", kw.pop("in_channels"), 4,
                   **kw)
    assert str(e.value).startswith("data.factory mypkg.data:make: item 5 of the 'train'")


GOOD_ITEMS = [
    ((IMAGE, 3), {}),
    ((torch.randint(0, 256, (3, 16, 16), dtype=torch.uint8), np.int64(2)), {}),
    ((np.random.rand(3, 16, 16).astype(np.float32), torch.tensor(0)), {}),
    (((IMAGE - 0.5) / 0.25, torch.tensor([1])), {}),  # normalised images, read as they are
    (({"features": torch.randn(6)}, torch.randn(1)), {"classify": False}),  # not images
    (((torch.randn(4), torch.randn(2, 2)), (1.5, 2)), {"classify": False}),
]


@pytest.mark.parametrize("item,kw", GOOD_ITEMS)
def test_items_that_keep_the_contract_pass(item, kw):
    check_item(item, 0, "data.factory m:f", "train", None, 4, **kw)


class Items(torch.utils.data.Dataset):
    def __init__(self, make, n=9):
        self.make, self.n = make, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i >= 60 and self.n == 99:  # len() says 99, there are 60
            raise IndexError(i)
        return self.make(i)


def _broken(i):
    raise ValueError("no such file: 3.png")


PROBED = [  # (dataset, expected): the first, a middle and the last item probed
    (Items(lambda i: (torch.zeros(3, 8, 8 + (i == 8)), 0)),
     "item 8 of the 'val' dataset has shapes ((3, 8, 9), ()), item 0 has ((3, 8, 8), ()); "
     "expected items of one shape (images must be one size"),
    (Items(lambda i: (IMAGE, 9 if i == 4 else 0)),  # the middle item's label
     "item 4 of the 'val' dataset: its target is label 9"),
    (Items(lambda i: (IMAGE, 0), n=99), "reading item 98 of the 'val' dataset failed "
                                        "(len() says 99)"),
    (Items(_broken), "reading item 0 of the 'val' dataset failed (ValueError: no such file"),
]


@pytest.mark.parametrize("ds,expected", PROBED)
def test_items_are_probed_first_middle_and_last(ds, expected):
    name = "data.factory mypkg.data:make"
    with pytest.raises(UserError, match=re.escape(expected)) as e:
        check_items(ds, name, "val", None, 4)
    assert str(e.value).startswith(f"{name}: "), e.value
    assert check_items(Items(lambda i: (IMAGE, i % 4)), name, "val", 3, 4)[1] == 0


@pytest.mark.parametrize("ds,index,expected", [
    (Items(_broken), 3, "reading item 3 of the 'train' dataset failed (ValueError: no such file"),
    (Items(lambda i: (IMAGE, 0), n=99), 70, "reading item 70 of the 'train' dataset failed "
                                            "(len() says 99) (IndexError: 70"),
])
def test_an_item_that_cannot_be_read_is_one_message_naming_the_factory(ds, index, expected):
    name = "data.factory mypkg.data:other"
    with pytest.raises(UserError, match=re.escape(expected)) as e:
        contract.read_item(ds, index, name, "train")
    assert str(e.value).startswith(f"{name}: "), e.value


def test_the_builtin_synthetic_set_passes_the_same_item_check():
    from ddpflow.data import synthetic

    for channels in (1, 3):
        x, y = synthetic.generate(64, 10, 16, channels, 0, "train")
        ds = Items(lambda i, x=x, y=y: (torch.from_numpy(x[i]).permute(2, 0, 1), int(y[i])),
                   n=64)
        first = check_items(ds, "data.source synthetic", "train", channels, 10,
                            materialize=True)
        assert first[0].shape == (channels, 16, 16)


# ------------------------------------------------------------------ task
class Task:
    def loss(self, outputs, batch):
        return nn.functional.cross_entropy(outputs, batch[1])

    def metrics(self, outputs, batch):
        n = torch.tensor(float(len(batch[1])))
        return {"acc": ((outputs.argmax(1) == batch[1]).sum(), n)}


def task(loss=None, metrics=None):
    t = Task()
    t.loss = loss or t.loss
    t.metrics = metrics or t.metrics
    return t


BATCH = (torch.rand(4, 3, 8, 8), torch.tensor([0, 1, 2, 3]))
TASK = "task.name mypkg.tasks:Task"
TASKS = [  # (task, builtin rules, outputs, batch, the name it begins with, expected)
    (task(loss=lambda o, b: (o - 1).square().mean(1)), None, None, BATCH, TASK,
     "task.name mypkg.tasks:Task: loss(outputs, batch) returned a tensor of shape (4,), not "
     "a scalar tensor"),
    (task(loss=lambda o, b: 1.5), None, None, BATCH, TASK, "returned float 1.5, not a scalar"),
    (task(loss=lambda o, b: torch.tensor(0.5)), None, None, BATCH, TASK,
     "does not depend on the model's outputs"),
    (task(loss=lambda o, b: o.sum() * float("nan")), None, None, BATCH, TASK,
     "loss(outputs, batch) is nan on the first batch of this run, before any update (so not "
     "the learning rate): the outputs and inputs are finite: the loss itself"),
    (task(), None, torch.full((4, 4), float("nan"), requires_grad=True),
     (torch.full((4, 3, 8, 8), float("inf")), BATCH[1]), TASK, "the batch's inputs hold NaN/inf"),
    (task(), None, torch.full((4, 4), float("nan"), requires_grad=True), BATCH, TASK,
     "model.name mypkg.nets:build returned NaN/inf for finite inputs"),
    (task(metrics=lambda o, b: {"acc": (torch.tensor(0.0), 0)}), None, None, BATCH, TASK,
     "metrics(outputs, batch) returned a count of 0 for every metric (acc)"),
    (task(metrics=lambda o, b: [1, 2]), None, None, BATCH, TASK,
     "metrics(outputs, batch) returned a list of 2"),
    (task(metrics=lambda o, b: {"acc": 3.0}), None, None, BATCH, TASK,
     "item 'acc' must be a name -> (sum, count) pair; it is float 3.0"),
    # the built-in tasks' rules for outputs and targets (_fits): they name the model
    (task(), "classification", None, (BATCH[0], torch.tensor([0, 1, 2, 7])), NAME,
     "model.name mypkg.nets:build: the batch's targets hold class 7, but it returned a Tensor "
     "of shape (4, 4) (float32): 4 outputs per sample; expected class indices in [0, 4)"),
    (task(), "classification", None, (BATCH[0], torch.tensor([-1, 1, 2, 3])), NAME,
     "the batch's targets hold class -1"),
    (task(), "classification", torch.randn(4, 4, 2, requires_grad=True), BATCH, NAME,
     "returned a Tensor of shape (4, 4, 2) (float32) for a batch of 4"),
    (task(), "classification", None, (BATCH[0], torch.rand(4, 3)), NAME,
     "the batch's targets are a Tensor of shape (4, 3) (float32); the classification task "
     "expects integer class indices [4] (or soft targets [4, 4]) for its 4 outputs"),
    (task(), "classification", None, (BATCH[0], torch.tensor([[0], [1], [2], [3]])), NAME,
     "the batch's targets are a Tensor of shape (4, 1) (int64); the classification task "
     "expects one integer class index per sample"),
    (task(), "regression", None, (BATCH[0], torch.rand(4, 1)), NAME,
     "returned a Tensor of shape (4, 4) (float32) for targets of shape (4, 1); the "
     "regression task expects one output per target value"),
]


@pytest.mark.parametrize("t,builtin,outputs,batch,who,expected", TASKS)
def test_a_task_that_breaks_the_contract_is_one_message_naming_it(t, builtin, outputs, batch,
                                                                 who, expected):
    outputs = torch.randn(4, 4, requires_grad=True) if outputs is None else outputs
    with pytest.raises(UserError, match=re.escape(expected)) as e:
        check_task(t, outputs, batch, TASK, builtin, NAME)
    assert str(e.value).startswith(f"{who} ") or str(e.value).startswith(f"{who}:"), e.value


LOSSES_AND_METRICS = [  # (check, value, expected): called directly, each with its own name
    (contract.check_loss, torch.ones(2), "loss(outputs, batch) returned a tensor of shape (2,)"),
    (contract.check_loss, "0.5", "loss(outputs, batch) returned str '0.5', not a scalar tensor"),
    (contract.check_loss, torch.tensor(0.5), "does not depend on the model's outputs"),
    (contract.metric_pairs, (1, 2), "metrics(outputs, batch) returned a tuple of 2"),
    (contract.metric_pairs, {"a b": (1, 2)}, "item 'a b' must be a name -> (sum, count) pair"),
    (contract.check_metrics, {"acc": (1.0, 0), "n": (2.0, torch.zeros(3))},
     "returned a count of 0 for every metric (acc, n)"),
    (contract.check_metrics, {"acc": (1.0,)}, "item 'acc' must be a name -> (sum, count) pair"),
]


@pytest.mark.parametrize("check,value,expected", LOSSES_AND_METRICS)
def test_a_loss_or_metrics_that_break_the_contract_name_the_task(check, value, expected):
    with pytest.raises(UserError, match=re.escape(expected)) as e:
        check(value, "task.name other.tasks:T")
    assert str(e.value).startswith("task.name other.tasks:T: "), e.value


def test_the_builtin_tasks_pass_and_go_through_the_same_check_once():
    from ddpflow.seams.tasks import build_task

    st = SimpleNamespace(label_smoothing=0.1)
    outputs = torch.randn(4, 4, requires_grad=True)
    mixed = (BATCH[0], torch.rand(4, 4).softmax(1))  # mixup's soft targets: training only
    for name, batch in (("classification", BATCH), ("regression", (BATCH[0], torch.rand(4, 4))),
                        ("classification", mixed)):
        cfg = SimpleNamespace(task=SimpleNamespace(name=name, kwargs={}),
                              model=SimpleNamespace(name="smallcnn"))
        t = build_task(cfg, st, 4)
        assert t.loss(outputs, batch).requires_grad and t.monitor and "maximize" in dir(t.task)
        loss = check_task(t.task, outputs.detach(), batch, f"task.name {name}", name,
                          metrics=batch is not mixed)  # no gradient
        assert torch.equal(loss, t.task.loss(outputs.detach(), batch))  # the loss it checked
        assert t.metrics(outputs, (BATCH[0], batch[1].argmax(1) if batch is mixed else batch[1]))
    # the wrapper checks the first batch only: a later one is the task's own business
    cfg = SimpleNamespace(task=SimpleNamespace(name="classification", kwargs={}),
                          model=SimpleNamespace(name="mypkg.nets:build"))
    t = build_task(cfg, st, 4)
    bad = (BATCH[0], torch.tensor([0, 1, 2, 9]))
    with pytest.raises(UserError, match="model.name mypkg.nets:build: the batch's targets hold "
                                        "class 9, but it returned a Tensor"):
        t.loss(outputs, bad)
    assert t.loss(outputs, BATCH).ndim == 0
    t = build_task(cfg, st, 4)
    t.task.metrics = lambda o, b: {"acc": (torch.tensor(0.0), torch.tensor(0.0))}
    with pytest.raises(UserError, match="task.name classification: metrics.*count of 0"):
        t.metrics(outputs, BATCH)  # the first validation batch
    assert t.metrics(outputs, BATCH)  # later ones: the task's own business
    assert contract.check_metrics({"n": (torch.tensor(1.0), torch.tensor(0.0)),
                                   "m": (1.0, 2)}, "t")


# ------------------------------------------------------------------ the real command
BUILDER = '''
from torch import nn


def build(num_classes, in_channels):
    # the head ignores num_classes: 1000 outputs (an ImageNet head) for the data's 4 classes
    return nn.Sequential(nn.Conv2d(in_channels, 8, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 1000))
'''


def test_a_builder_with_1000_outputs_for_4_classes_stops_launch_before_any_rank(tmp_path):
    code = tmp_path / "usercode"
    code.mkdir()
    (code / "nets.py").write_text(BUILDER)
    cfg = tiny_config(tmp_path, data={"num_classes": 4, "train_size": 64, "val_size": 16,
                                      "test_size": 16},
                      model={"name": "nets:build", "code_dir": str(code)},
                      stages=[{"name": "s", "max_steps": 1, "batch_size": 8}])
    p = write_config(tmp_path, cfg)
    ddpflow("prepare", "--config", p, check=True)
    proc = ddpflow("launch", "--config", p, "--stage", "s")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if "nets:build" in line]
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "model.name nets:build returned a Tensor of shape (2, 1000)" in lines[0]
    assert "expected [2, 4]: one output per class of the data (4)" in lines[0]
    stage = tmp_path / "results/t/stages/s"
    assert not list(stage.rglob("*.pt")) and not (stage / "summary.json").exists()


DATASETS = '''
import torch


class Images(torch.utils.data.Dataset):
    classes = ["a", "b", "c", "d"]

    def __init__(self, item):
        self.item = item

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return self.item(i)


def hwc(split):
    return Images(lambda i: (torch.rand(8, 8, 3), i % 4))


def pixels(split):  # 0..255 floats where [0, 1] belongs (ToTensor skipped)
    return Images(lambda i: (torch.arange(192.0).reshape(3, 8, 8), i % 4))


def labels(split):
    return Images(lambda i: (torch.rand(3, 8, 8), i))  # 12 labels for 4 classes
'''


@pytest.mark.parametrize("factory,materialize,expected", [
    ("hwc", False, "data.factory sets:hwc: item 0 of the 'train' dataset: its image is a "
                   "Tensor of shape (8, 8, 3) (float32): H x W x C (channels last)"),
    ("pixels", True, "data.materialize sets:pixels: item 0 of the 'train' dataset: its image "
                     "is a Tensor of shape (3, 8, 8) (float32): values in [0, 191]; expected "
                     "float in [0, 1] or uint8"),
    ("labels", False, "data.factory sets:labels: item 6 of the 'train' dataset: its target is "
                      "label 6, out of range; expected a class index in [0, 4)"),
])
def test_prepare_refuses_items_that_break_the_contract(tmp_path, factory, materialize,
                                                       expected):
    (tmp_path / "code").mkdir()
    (tmp_path / "code/sets.py").write_text(DATASETS)
    cfg = tiny_config(tmp_path, data={"source": "python", "factory": f"sets:{factory}",
                                      "code_dir": str(tmp_path / "code"),
                                      "materialize": materialize, "image_size": 8})
    proc = ddpflow("prepare", "--config", write_config(tmp_path, cfg))
    assert proc.returncode == 2 and expected in proc.stderr, proc.stderr[-1500:]
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "results/t/data/meta.json").exists()


# --------------------------------------------------------------------------- properties

_DTYPES = st.sampled_from(["uint8", "int64", "float32", "float64", "bool", "int16"])
_ARRAYS = hnp.arrays(_DTYPES, hnp.array_shapes(min_dims=0, max_dims=4, max_side=5))
_LEAVES = st.one_of(_ARRAYS, _ARRAYS.map(torch.from_numpy), st.integers(-3, 12),
                    st.floats(allow_nan=True, allow_infinity=True), st.none(), st.text(max_size=3),
                    st.booleans())
_ITEMS = st.one_of(_LEAVES, st.tuples(_LEAVES, _LEAVES), st.tuples(_LEAVES, _LEAVES, _LEAVES),
                   st.lists(_LEAVES, max_size=3), st.dictionaries(st.text(max_size=2), _LEAVES,
                                                                  max_size=2))


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(item=_ITEMS, channels=st.sampled_from([None, 1, 3]), classes=st.sampled_from([None, 4]),
       materialize=st.booleans())
def test_property_any_item_is_accepted_or_one_message(item, channels, classes, materialize):
    """Whatever a dataset factory's item is, the seam checker accepts it or refuses it with
    one UserError naming the factory: never another exception type."""
    from ddpflow.seams import contract

    try:
        contract.check_item(item, 0, "data.factory mine:make", "train", channels, classes,
                            materialize=materialize)
    except UserError as e:
        assert str(e).startswith("data.factory mine:make: ") and "\n" not in str(e)


# --------------------------------------------------------------------------- model.kwargs
USER_BUILDER = '''
from torch import nn


def build(num_classes, depth=2):
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, num_classes))
'''

KWARGS_ROWS = [  # (model.name, model.kwargs, the message; None: built)
    ("smallcnn", {"num_classes": 3}, "model.kwargs.num_classes: ddpflow passes num_classes to "
                                     "smallcnn itself, from the prepared data; remove it"),
    ("smallcnn", {"in_channels": 1}, "model.kwargs.in_channels: ddpflow passes in_channels"),
    ("smallcnn", {"bogus": 3}, "model.kwargs.bogus: smallcnn takes no argument bogus; it "
                               "takes width"),
    ("smallcnn", {"widht": 8}, "smallcnn takes no argument widht (did you mean 'width'?)"),
    ("smallcnn", {"weights": "x.pt"}, "model.kwargs.weights: pretrained weights come through "
                                      "model.weights"),
    ("mlp", {"width": 8}, "model.kwargs.width: mlp takes no argument width; it takes hidden"),
    ("resnet18", {"weights": "DEFAULT"}, "model.kwargs.weights: pretrained weights come "
                                         "through model.weights (a file, or a torchvision "
                                         "weights name such as DEFAULT from the local torch "
                                         "hub cache), never through the builder, which would "
                                         "download them; remove model.kwargs.weights"),
    ("resnet18", {"pretrained": True}, "model.kwargs.pretrained: pretrained weights come"),
    ("resnet18", {"num_classes": 10}, "model.kwargs.num_classes: ddpflow passes num_classes"),
    ("resnet18", {"bogus": 1}, "model.kwargs.bogus: resnet18 takes no argument bogus (its "
                               "builder passes model.kwargs on, and unexpected keyword "
                               "argument 'bogus' was raised)"),
    ("timm:resnet18", {"pretrained": True}, "model.kwargs.pretrained: pretrained weights"),
    ("timm:resnet18", {"in_chans": 1}, "model.kwargs.in_chans: ddpflow passes in_chans"),
    ("mine:build", {"dept": 3}, "model.kwargs.dept: mine:build takes no argument dept (did "
                                "you mean 'depth'?); it takes depth"),
    ("smallcnn", {"width": "wide"}, "model.kwargs {'width': 'wide'}: smallcnn could not be "
                                    "built with them (TypeError: "),
    ("resnet18", {"norm_layer": "BatchNorm2d"}, "model.kwargs {'norm_layer': 'BatchNorm2d'}: "
                                                "resnet18 could not be built with them"),
    ("smallcnn", {"width": 8}, None),
    ("resnet18", {"zero_init_residual": True}, None),
    ("mine:build", {"depth": 3}, None),
]


@pytest.mark.parametrize("name, kwargs, words", KWARGS_ROWS,
                         ids=[f"{r[0]}-{'-'.join(r[1])}" for r in KWARGS_ROWS])
def test_model_kwargs_are_checked_against_the_builder_built_ins_too(tmp_path, name, kwargs,
                                                                     words):
    """`kwargs: {num_classes: 3}` or `{bogus: 3}` on smallcnn ended in a TypeError traceback,
    `resnet18` with `weights: DEFAULT` made torchvision try to download: the built-ins'
    kwargs go through the same contract as a user builder's, on the meta device here."""
    from ddpflow.seams.models import build_model

    if name.startswith("timm:"):  # an optional extra, not installed here: its keys are
        from ddpflow.seams.kwargs import check_kwargs  # checked before timm is imported

        with pytest.raises(UserError) as e:
            check_kwargs(kwargs, "timm", name)
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
        return
    (tmp_path / "mine.py").write_text(USER_BUILDER)
    mc = SimpleNamespace(name=name, kwargs=kwargs, code_dir=str(tmp_path))
    with torch.device("meta"):
        if words is None:
            assert isinstance(build_model(mc, 4, 3), nn.Module)
            return
        with pytest.raises(UserError) as e:
            build_model(mc, 4, 3)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("over, words", [
    ({"model.kwargs.bogus": "3"}, "model.kwargs.bogus: smallcnn takes no argument bogus"),
    ({"model.name": "resnet18", "model.kwargs.weights": "DEFAULT"},
     "model.kwargs.weights: pretrained weights come through model.weights"),
])
def test_model_kwargs_are_refused_at_validation(tmp_path, over, words):
    """What launch would refuse is refused when the config is read (`ddpflow validate`, the
    Snakefile's parse): nothing prepared, nothing downloaded."""
    p = write_config(tmp_path, tiny_config(tmp_path))
    sets = [a for k, v in over.items() for a in ("--set", f"{k}={v}")]
    proc = ddpflow("validate", "--config", p, *sets)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr == f"ddpflow: error: {proc.stderr[16:]}" and words in proc.stderr
    assert proc.stderr.count("\n") == 1 and not (tmp_path / "results").exists()


# --------------------------------------------------------------------------- NaN metrics
def _one_rank():
    return SimpleNamespace(backend=None, rank=0, world=1, device=torch.device("cpu"))


@pytest.mark.parametrize("totals, words", [
    ({"val_acc": (3.0, 4.0), "val_f1": (0.0, 0.0)},
     "the metric val_f1 is nan, and the weights are finite (not a divergence): no sample was "
     "counted for it over the whole split (its count is 0): metrics(outputs, batch) returns a "
     "count of 0 for f1 on every batch"),
    ({"val_acc": (float("nan"), 4.0)},
     "the metric val_acc is nan, and the weights are finite (not a divergence): what "
     "metrics(outputs, batch) adds up for acc holds NaN/inf (sum nan over a count of 4)"),
    ({"val_loss": (float("inf"), 8.0)}, "the metric val_loss is inf"),
])
def test_a_nan_metric_is_named(totals, words):
    """A task metric that is NaN gave `val_acc nan`, exit 0, nothing said."""
    from ddpflow.engine.validation import check_finite

    values = {k: (t / c if c else float("nan")) for k, (t, c) in totals.items()}
    with pytest.raises(UserError) as e:
        check_finite(values, totals, "mytask:make", nn.Linear(2, 2), _one_rank())
    assert str(e.value).startswith("task.name mytask:make: ") and words in str(e.value), \
        str(e.value)


def test_nan_metrics_of_nan_weights_are_left_to_the_divergence_check():
    from ddpflow.engine.validation import check_finite

    net = nn.Linear(2, 2)
    check_finite({"val_acc": 0.5}, {"val_acc": (2.0, 4.0)}, "t", net, _one_rank())
    with torch.no_grad():
        net.weight[0, 0] = float("nan")
    check_finite({"val_acc": float("nan")}, {"val_acc": (float("nan"), 4.0)}, "t", net,
                 _one_rank())  # no UserError: the diverged loss names the cause (exit 3)
