"""The seams, edge by edge (seams/userimport.py, pretrained.py, tasks.py, models.py,
contract.py): a user's `package.module:callable` imported and called with one message naming
the setting and where in their code it failed, the fingerprint of their code folder, where
model.weights points, the built-in tasks' exact loss and metrics and how best.pt is chosen,
the built-in models' shapes and sizes, and the contract's refusals word for word. Fast: real
modules written to tmp_path, real tensors and models on CPU, no training.
"""

from __future__ import annotations

import copy
import hashlib
import pickle
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ddpflow.core.errors import UserError
from ddpflow.seams import contract, models, pretrained, tasks, userimport
from ddpflow.seams.contract import Probe
from ddpflow.seams.userimport import call, dir_fingerprint, load_callable


def _refusal(fn, *args, **kw) -> str:
    with pytest.raises(UserError) as e:
        fn(*args, **kw)
    return str(e.value)


@pytest.fixture
def code(tmp_path, monkeypatch):
    """A folder of the user's code first on sys.path; write(rel, text) adds a module. The
    package is named after the test (a fresh import each time) and forgotten afterwards."""
    root = tmp_path / "code"
    root.mkdir()
    monkeypatch.setattr(sys, "path", [str(root), *sys.path])
    before = set(sys.modules)

    def write(rel: str, text: str) -> Path:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
        return path

    write.root = root
    yield write
    for name in set(sys.modules) - before:
        del sys.modules[name]


# ------------------------------------------------------------------ userimport

def test_an_import_path_has_a_colon_and_is_not_timm():
    assert userimport.is_import_path("pkg.mod:build")
    assert userimport.is_import_path(":")
    for text in ("timm:resnet50", "resnet18", None, 5, ""):
        assert not userimport.is_import_path(text), text


def test_code_dirs_go_first_on_sys_path_once_resolved(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["/elsewhere"])
    (tmp_path / "m").mkdir()
    (tmp_path / "d").mkdir()
    cfg = SimpleNamespace(model=SimpleNamespace(code_dir="m"), data=SimpleNamespace(code_dir="d"))
    userimport.add_code_dirs(cfg)
    assert sys.path == [str(tmp_path / "d"), str(tmp_path / "m"), "/elsewhere"]
    userimport.add_code_dirs(cfg)  # already there: not again
    assert sys.path == [str(tmp_path / "d"), str(tmp_path / "m"), "/elsewhere"]
    userimport.add_code_dir(None, "model.code_dir")
    userimport.add_code_dir("", "model.code_dir")
    assert sys.path == [str(tmp_path / "d"), str(tmp_path / "m"), "/elsewhere"]
    cfg.data.code_dir = "missing"
    assert _refusal(userimport.add_code_dirs, cfg) == (
        "data.code_dir: missing does not exist; point it at the folder that holds your Python "
        "modules (relative paths start where ddpflow or snakemake runs)")


def test_the_cause_is_the_type_the_first_line_and_the_user_s_innermost_line(code):
    code("c1/__init__.py", "")
    code("c1/outer.py", "import c1.inner\n")
    code("c1/inner.py", "x = 1\nraise ValueError('bad value\\nsecond line')\n")
    assert _refusal(load_callable, "c1.outer:f", "model.name") == (
        "model.name: importing 'c1.outer' failed (ValueError: bad value at inner.py:2)")
    code("c1/long.py", "raise RuntimeError('x' * 300)\n")
    assert _refusal(load_callable, "c1.long:f", "task.name") == (
        f"task.name: importing 'c1.long' failed (RuntimeError: {'x' * 200} at long.py:1)")
    code("c1/empty.py", "\n\nraise KeyError\n")
    assert _refusal(load_callable, "c1.empty:f", "task.name") == (
        "task.name: importing 'c1.empty' failed (KeyError:  at empty.py:3)")
    # raised in ddpflow only: no place in the user's code to name
    assert _refusal(call, models.count_text, "s", args=("many",)) == (
        "s: calling count_text failed (TypeError: unsupported operand type(s) for /: 'str' and "
        "'float')")


def test_an_import_path_that_names_nothing_is_one_message_naming_the_setting(code):
    help_ = "write it as package.module:callable (the module importable from a code_dir)"
    for spec, shown in (("resnet", "'resnet'"), ("pkg:", "'pkg:'"), (":build", "':build'"),
                        (None, "None")):
        assert _refusal(load_callable, spec, "data.factory") == (
            f"data.factory: {shown} is not an import path; {help_}")
    missing = ("model.name: module '{}' was not found; set model.code_dir (or data.code_dir) to "
               "the folder that holds it, or install it")
    assert _refusal(load_callable, "nosuchpkg.nets:build", "model.name") == \
        missing.format("nosuchpkg.nets")
    code("c2/__init__.py", "")
    assert _refusal(load_callable, "c2.nets:build", "model.name") == missing.format("c2.nets")
    code("c2/needs.py", "import numpyy\n")  # the user's module imports what is not there
    assert _refusal(load_callable, "c2.needs:build", "model.name") == (
        "model.name: importing 'c2.needs' failed (ModuleNotFoundError: No module named "
        "'numpyy' at needs.py:1)")
    code("c2/odd.py", "raise ModuleNotFoundError('made up')\n")  # no module name with it
    assert _refusal(load_callable, "c2.odd:build", "model.name") == (
        "model.name: importing 'c2.odd' failed (ModuleNotFoundError: made up at odd.py:1)")
    code("c2/nets.py", """\
        VALUE = 3


        class Net:
            @staticmethod
            def make():
                return 'made'
        """)
    assert load_callable("c2.nets:Net.make", "model.name")() == "made"
    assert _refusal(load_callable, "c2.nets:Net.nope", "model.name") == (
        "model.name: 'c2.nets' has no attribute 'Net.nope'")
    assert _refusal(load_callable, "c2.nets:build", "model.name") == (
        "model.name: 'c2.nets' has no attribute 'build'")
    assert _refusal(load_callable, "c2.nets:VALUE", "task.name") == (
        "task.name: 'c2.nets:VALUE' is not callable")


def test_call_offers_what_the_callable_takes_and_names_the_setting_when_it_fails(code):
    def fixed(a, num_classes=None):
        return a, num_classes

    def anything(**kw):
        return kw

    offer = {"num_classes": 4, "in_channels": 3, "unset": None}
    assert call(fixed, "s", args=(1,), optional=offer) == (1, 4)
    assert call(fixed, "s", args=(1,), optional=offer, kwargs={"num_classes": 9}) == (1, 9)
    assert call(anything, "s", optional=offer) == {"num_classes": 4, "in_channels": 3}
    assert call(anything, "s", optional=offer, kwargs={"in_channels": 1, "k": 2}) == {
        "in_channels": 1, "k": 2, "num_classes": 4}
    assert call(anything, "s") == {}
    assert call(max, "s", args=([1, 3],), optional=offer) == 3  # no signature: nothing offered
    code("c3/__init__.py", "")
    code("c3/nets.py", """\
        from ddpflow.core.errors import UserError


        def build(num_classes):
            return [0] * num_classes + 1


        def refuse():
            raise UserError('mine, as it is')
        """)
    build = load_callable("c3.nets:build", "model.name")
    assert _refusal(call, build, "model.name", optional=offer) == (
        "model.name: calling build failed (TypeError: can only concatenate list (not \"int\") "
        "to list at nets.py:5)")
    assert _refusal(call, load_callable("c3.nets:refuse", "x"), "model.name") == "mine, as it is"


def test_the_fingerprint_is_the_python_files_names_and_bytes_and_nothing_else(tmp_path):
    assert dir_fingerprint(None) is None and dir_fingerprint("") is None
    assert dir_fingerprint(str(tmp_path / "missing")) is None
    (tmp_path / "file.py").write_text("")
    assert dir_fingerprint(str(tmp_path / "file.py")) is None
    root = tmp_path / "code"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "b.py").write_text("B = 2\n")
    (root / "a.py").write_text("A = 1\n")
    want = hashlib.sha256(b"a.py\0A = 1\npkg/b.py\0B = 2\n").hexdigest()[:16]
    assert dir_fingerprint(str(root)) == want
    for skipped in ("pkg/__pycache__/b.py", ".git/x.py", "pkg/.hidden/y.py", "notes.txt"):
        (root / skipped).parent.mkdir(parents=True, exist_ok=True)
        (root / skipped).write_text("changed")
    assert dir_fingerprint(str(root)) == want
    (root / "a.py").write_text("A = 2\n")
    assert dir_fingerprint(str(root)) != want
    (root / "a.py").write_text("A = 1\n")
    (root / "a.py").rename(root / "c.py")
    assert dir_fingerprint(str(root)) == hashlib.sha256(
        b"c.py\0A = 1\npkg/b.py\0B = 2\n").hexdigest()[:16] != want


# ------------------------------------------------------------------ pretrained

def _weights_cfg(name, weights):
    return SimpleNamespace(model=SimpleNamespace(name=name, weights=weights))


def test_model_weights_is_a_file_or_a_torchvision_name_in_the_local_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "th"))
    assert pretrained.pretrained_file(_weights_cfg("resnet18", None)) is None
    assert pretrained.pretrained_file(_weights_cfg("resnet18", "")) is None
    for name, spec in (("resnet18", "w.pt"), ("resnet18", "runs/best"), ("smallcnn", "best"),
                       ("pkg.nets:build", "DEFAULT")):
        assert pretrained.pretrained_file(_weights_cfg(name, spec)) == Path(spec)
    cache = tmp_path / "th" / "hub" / "checkpoints"
    url = "https://download.pytorch.org/models/resnet18-f37072fd.pth"
    assert _refusal(pretrained.pretrained_file, _weights_cfg("resnet18", "DEFAULT")) == (
        f"model.weights DEFAULT: resnet18-f37072fd.pth is not in the local torch hub cache "
        f"{cache}; compute nodes often have no internet, so ddpflow never downloads: fetch "
        f"{url} elsewhere and copy it there (TORCH_HOME moves the cache)")
    cache.mkdir(parents=True)
    (cache / "resnet18-f37072fd.pth").write_bytes(b"")
    for spec in ("DEFAULT", "IMAGENET1K_V1"):
        assert pretrained.pretrained_file(_weights_cfg("resnet18", spec)) == \
            cache / "resnet18-f37072fd.pth"
    assert pretrained.hub_file("resnet18", "ResNet18_Weights.IMAGENET1K_V1") == \
        cache / "resnet18-f37072fd.pth"
    assert _refusal(pretrained.hub_file, "resnet18", "IMAGENET1K_V2") == (
        "model.weights 'IMAGENET1K_V2' is not a file nor a weights name of resnet18 (DEFAULT, "
        "IMAGENET1K_V1)")


# ------------------------------------------------------------------ tasks

def _ranked(orders):
    """Logits where row s ranks the classes as orders[s] (highest first)."""
    logits = torch.zeros(len(orders), len(orders[0]))
    for s, order in enumerate(orders):
        for place, c in enumerate(order):
            logits[s, c] = float(len(order) - place)
    return logits


def test_classification_scores_top_1_top_5_and_each_class_s_recall_exactly():
    logits = _ranked([[0, 1, 2, 3, 4, 5, 6],   # y 0: first
                      [1, 0, 3, 4, 2, 5, 6],   # y 2: fifth (in the top 5, not the top 4)
                      [0, 1, 2, 4, 5, 3, 6],   # y 3: sixth (out of the top 5)
                      [2, 0, 1, 3, 4, 5, 6]])  # y 2: first
    y = torch.tensor([0, 2, 3, 2])
    task = tasks.Classification(label_smoothing=0.1)
    assert torch.equal(task.loss(logits, (None, y)),
                       F.cross_entropy(logits, y, label_smoothing=0.1))
    m = task.metrics(logits.half(), (None, y))
    assert set(m) == {"loss", "acc", "top5", "recall"}
    assert torch.allclose(m["loss"][0], F.cross_entropy(logits, y, reduction="sum"))  # unsmoothed
    assert [float(v) for v in (m["acc"][0], m["acc"][1], m["top5"][0], m["top5"][1])] == \
        [2.0, 4.0, 3.0, 4.0]
    assert m["loss"][1].dtype == torch.float32 and float(m["loss"][1]) == 4.0
    assert m["recall"][0].tolist() == [1, 0, 1, 0, 0, 0, 0]
    assert m["recall"][1].tolist() == [1, 0, 2, 1, 0, 0, 0]
    few = task.metrics(_ranked([[2, 1, 0], [0, 2, 1]]), (None, torch.tensor([1, 1])))
    assert [float(few["acc"][0]), float(few["top5"][0])] == [0.0, 2.0]  # 3 classes: top 3
    assert tasks.Classification().label_smoothing == 0.0


def test_the_balanced_accuracy_is_the_mean_recall_over_the_classes_present():
    assert tasks.Classification.summarize({"recall": [1.0, None, 0.5, 0.0]}) == {
        "balanced_acc": 0.5}
    assert tasks.Classification.summarize({"recall": [None, None]}) == {}
    assert tasks.Classification.summarize({"recall": None}) == {}
    assert tasks.Classification.summarize({}) == {}


def test_regression_scores_squared_and_absolute_error_per_target_value():
    task = tasks.Regression()
    out = torch.tensor([[1.0], [2.0], [4.0]])
    y = torch.tensor([1.0, 4.0, 1.0], dtype=torch.float64)
    assert float(task.loss(out, (None, y))) == pytest.approx((0 + 4 + 9) / 3)
    m = task.metrics(out, (None, y))
    assert {k: (float(s), float(n)) for k, (s, n) in m.items()} == {
        "mse": (13.0, 3.0), "mae": (5.0, 3.0)}


def _task_cfg(name, kwargs=None, model="smallcnn", monitor=None, mode="auto"):
    cfg = SimpleNamespace(task=SimpleNamespace(name=name, kwargs=kwargs or {}, monitor=monitor,
                                               mode=mode))
    if model is not None:
        cfg.model = SimpleNamespace(name=model)
    return cfg


STAGE = SimpleNamespace(label_smoothing=0.2)


def test_the_task_name_builds_a_built_in_or_the_user_s_task(code):
    t = tasks.build_task(_task_cfg("classification"), STAGE, 4)
    assert isinstance(t.task, tasks.Classification) and t.task.label_smoothing == 0.2
    assert isinstance(tasks.build_task(_task_cfg("regression"), STAGE, None).task,
                      tasks.Regression)
    assert _refusal(tasks.build_task, _task_cfg("segmentation"), STAGE, 4) == (
        "task.name 'segmentation' is not one of classification, regression nor "
        "package.module:callable")
    code("c4/__init__.py", "")
    code("c4/t.py", """\
        class Scaled:
            def __init__(self, scale, num_classes, label_smoothing):
                self.got = (scale, num_classes, label_smoothing)

            def loss(self, outputs, batch):
                return outputs.sum() * self.got[0]

            def metrics(self, outputs, batch):
                return {"n": (outputs.sum(), 1)}


        class NoMetrics:
            metrics = 3

            def loss(self, outputs, batch):
                return outputs.sum()


        class NoLoss:
            def metrics(self, outputs, batch):
                return {}
        """)
    t = tasks.build_task(_task_cfg("c4.t:Scaled", {"scale": 2}), STAGE, 5)
    assert t.got == (2, 5, 0.2)
    assert _refusal(tasks.build_task, _task_cfg("c4.t:NoMetrics"), STAGE, 4) == (
        "task.name: c4.t:NoMetrics returned NoMetrics, which has no metrics(outputs, batch) "
        "method")
    assert _refusal(tasks.build_task, _task_cfg("c4.t:NoLoss"), STAGE, 4) == (
        "task.name: c4.t:NoLoss returned NoLoss, which has no loss(outputs, batch) method")


def test_the_first_batch_is_checked_once_with_the_built_in_s_rules_and_the_model_named(code):
    outputs = torch.randn(2, 4, requires_grad=True)
    bad = (None, torch.tensor([0, 9]))
    for model, who in (("smallcnn", "model.name smallcnn"), (None, "the model")):
        t = tasks.build_task(_task_cfg("classification", model=model), STAGE, 4)
        assert _refusal(t.loss, outputs, bad).startswith(
            f"{who}: the batch's targets hold class 9, but it returned a Tensor of shape (2, 4)")
    code("c5/__init__.py", "")
    code("c5/t.py", """\
        class Odd:
            def loss(self, outputs, batch):
                return outputs.sum() if outputs.ndim == 2 else outputs

            def metrics(self, outputs, batch):
                return {"n": (outputs.sum(), 0)}
        """)
    t = tasks.build_task(_task_cfg("c5.t:Odd"), STAGE, 4)
    assert t.loss(outputs, bad).ndim == 0  # a user task: no built-in rules; metrics unchecked
    assert torch.equal(t.loss(outputs[:, :, None], bad), outputs[:, :, None])  # later: as is
    assert _refusal(t.metrics, outputs, bad).startswith(
        "task.name c5.t:Odd: metrics(outputs, batch) returned a count of 0 for every metric (n)")
    assert t.metrics(outputs, bad)["n"][1] == 0
    t = tasks.build_task(_task_cfg("c5.t:Odd"), STAGE, 4)
    assert _refusal(t.loss, outputs[:, :, None], bad).startswith(
        "task.name c5.t:Odd: loss(outputs, batch) returned a tensor of shape (2, 4, 1)")
    t = tasks.build_task(_task_cfg("classification"), STAGE, 4)
    assert t.monitor == "val_acc" and copy.copy(t).monitor == "val_acc"
    assert pickle.loads(pickle.dumps(t)).maximize == tasks.Classification.maximize


def test_best_pt_is_chosen_by_the_monitored_metric_in_its_direction():
    c, r = tasks.Classification(), tasks.Regression()
    user = SimpleNamespace()
    assert tasks.monitor(_task_cfg("classification"), c) == ("val_acc", "max")
    assert tasks.monitor(_task_cfg("classification", monitor="val_top5"), c) == ("val_top5",
                                                                                 "max")
    assert tasks.monitor(_task_cfg("classification", monitor="val_loss"), c) == ("val_loss",
                                                                                 "min")
    assert tasks.monitor(_task_cfg("classification", mode="min"), c) == ("val_acc", "min")
    assert tasks.monitor(_task_cfg("regression"), r) == ("val_loss", "min")
    assert tasks.monitor(_task_cfg("m:t"), user) == ("val_loss", "min")
    assert tasks.metric_mode("val_balanced_acc", c) == "max"
    assert tasks.metric_mode("val_acc", user) == "min"
    assert tasks.metric_mode("val_loss", c, "max") == "max"
    for mode, best, wins in (("max", None, True), ("max", 0.4, True), ("max", 0.5, False),
                             ("max", 0.6, False), ("min", 0.4, False), ("min", 0.5, False),
                             ("min", 0.6, True), ("min", None, True)):
        assert tasks.improves({"val_acc": 0.5}, "val_acc", mode, best, "c") is wins, (mode, best)
    assert _refusal(tasks.improves, {"val_loss": 1.0, "val_acc": 0.5}, "val_top5", "max", None,
                    "classification") == (
        "task.monitor val_top5 is not a validation metric of task classification; it reports "
        "val_loss, val_acc")
    assert _refusal(tasks.improves, {"val_recall": [0.5, 1.0]}, "val_recall", "max", None,
                    "classification") == (
        "task.monitor val_recall is one value per class, and a stage is judged by one number; "
        "monitor val_balanced_acc (their mean) or val_acc")


def test_the_task_checks_name_the_task():
    assert _refusal(tasks.check_loss, torch.ones(2), "m:t") == (
        "task.name m:t: loss(outputs, batch) returned a tensor of shape (2,), not a scalar "
        "tensor; reduce it (e.g. .mean())")
    pairs = {"n": (1.0, 2)}
    assert tasks.metric_pairs(pairs, "m:t") is pairs
    assert _refusal(tasks.metric_pairs, [], "m:t").startswith("task.name m:t: metrics(")


# ------------------------------------------------------------------ models

def test_the_built_in_models_have_their_layers_and_sizes():
    cnn = models.SmallCNN(10)
    assert models.param_count(cnn) == 94762
    assert models.param_count(models.SmallCNN(10, in_channels=1, width=8)) == \
        8 * 9 + 16 + 8 * 16 * 9 + 32 + 16 * 32 * 9 + 64 + 32 * 10 + 10
    x = torch.rand(2, 3, 16, 12)
    assert cnn.features[0](x).shape == (2, 32, 16, 12)  # padding keeps the size
    assert cnn.features[:2](x).shape == (2, 32, 8, 6)
    assert cnn.features[:4](x).shape == (2, 64, 4, 3)
    assert cnn.features(x).shape == (2, 128)
    assert cnn(x).shape == (2, 10)
    mlp = models.MLP(10)
    assert models.param_count(mlp) == 192 * 64 + 64 + 64 * 10 + 10
    assert mlp.net[:2](torch.rand(2, 3, 9, 9)).shape == (2, 192)
    assert models.MLP(5, in_channels=1, hidden=7)(torch.rand(2, 1, 16, 16)).shape == (2, 5)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in mlp.modules())


def test_a_model_name_goes_to_its_kind_of_builder():
    assert [models.kind(n) for n in ("smallcnn", "mlp", "timm:vit_tiny", "a.b:c", "resnet18")] \
        == ["builtin", "builtin", "timm", "user", "torchvision"]
    assert [models.input_channels(n, 1) for n in ("resnet18", "smallcnn", "a.b:c")] == [3, 1, 1]


def test_build_model_builds_each_kind_and_probes_when_it_can(code):
    assert models.build_model("mlp", 5, 1).net[2].in_features == 64
    assert models.build_model("mlp", 5, None).net[2].in_features == 192
    wrong = Probe((16, 16), "classification", 9)
    models.build_model("smallcnn", 4, 3, Probe(None, "classification", 9))  # no image: built
    models.build_model("smallcnn", 4, None, wrong)  # channels unknown: built
    assert "expected [2, 9]" in _refusal(models.build_model, "smallcnn", 4, 3, wrong)
    root = code.root.parent / "elsewhere"
    code("../elsewhere/c6/__init__.py", "")
    code("../elsewhere/c6/nets.py", """\
        from torch import nn


        def build(num_classes, in_channels, depth=1):
            return nn.Sequential(nn.Flatten(), nn.LazyLinear(num_classes * depth))


        def other():
            return [1]


        def bad(num_classes):
            raise ValueError("no such layer")


        def passes(num_classes, **kw):
            return nn.Linear(4, num_classes, **kw)


        def fussy(num_classes, size):
            raise ValueError(f"size {size} too small")
        """)
    mc = SimpleNamespace(name="c6.nets:build", kwargs={"depth": 2}, code_dir=str(root))
    assert str(root) not in sys.path
    net = models.build_model(mc, 3, 1, Probe((4, 4), "classification", 6))
    assert sys.path[0] == str(root) and net[1].out_features == 6
    assert _refusal(models.build_model, SimpleNamespace(name="c6.nets:other", kwargs={}), 3,
                    1) == "model.name: c6.nets:other returned list, not a torch.nn.Module"
    assert _refusal(models.build_model, SimpleNamespace(name="c6.nets:build",
                                                        kwargs={"deep": 2}), 3, 1) == (
        "model.kwargs.deep: c6.nets:build takes no argument deep (did you mean 'depth'?); it "
        "takes depth")
    assert _refusal(models.build_model, SimpleNamespace(name="c6.nets:bad", kwargs={}), 3,
                    1) == "model.name: calling bad failed (ValueError: no such layer at nets.py:13)"
    assert _refusal(models.build_model, SimpleNamespace(name="c6.nets:fussy",
                                                        kwargs={"size": 1}), 3, 1) == (
        "model.name: calling fussy failed (ValueError: size 1 too small at nets.py:21)")
    assert _refusal(models.build_model, SimpleNamespace(name="c6.nets:passes",
                                                        kwargs={"wide": 1}), 3, 1) == (
        "model.kwargs.wide: c6.nets:passes takes no argument wide (its builder passes "
        "model.kwargs on, and unexpected keyword argument 'wide' was raised); remove it or "
        "check its spelling")


def test_a_built_in_that_cannot_be_built_names_model_kwargs_when_there_are_any():
    mc = SimpleNamespace(name="smallcnn", kwargs={"width": -1})
    text = _refusal(models.build_model, mc, 4, 3)
    assert text.startswith("model.kwargs {'width': -1}: smallcnn could not be built with them "
                           "(RuntimeError: Trying to create tensor with negative dimension -1: "
                           "[-1, 3, 3, 3] at "), text
    assert text.endswith("); check each value's type and range against smallcnn's arguments")
    assert ")" not in text.partition(" at ")[2].partition(";")[0][:-1]
    text = _refusal(models.build_model, "smallcnn", -1, 3)  # no kwargs to blame
    assert text.startswith("model.name: calling SmallCNN failed (RuntimeError: Trying to create "
                           "tensor with negative dimension -1: [-1, 128]"), text
    mc = SimpleNamespace(name="resnet18", kwargs={"groups": 0})
    assert _refusal(models.build_model, mc, 4, 3).startswith(
        "model.kwargs {'groups': 0}: resnet18 could not be built with them (")


def test_torchvision_and_timm_names(monkeypatch):
    import torchvision

    net = models.build_model(SimpleNamespace(name="resnet18",
                                             kwargs={"zero_init_residual": True}), 7, 1)
    assert net.fc.out_features == 7 and not net.layer1[0].bn2.weight.any()
    assert net.conv1.in_channels == 3
    available = torchvision.models.list_models(module=torchvision.models)
    close = [m for m in available if m.startswith("effi")]
    assert len(close) > 8
    no = ("model.name '{}' is not one of ['mlp', 'smallcnn'], a torchvision classification "
          "model, timm:NAME nor package.module:callable")
    assert _refusal(models.build_model, "effiX", 4, 3) == \
        no.format("effiX") + "; close: " + ", ".join(close[:8])
    assert _refusal(models.build_model, "regz", 4, 3) == no.format("regz")
    monkeypatch.setitem(sys.modules, "timm", None)  # timm not installed (the optional extra)
    assert _refusal(models.build_model, "timm:resnet18", 4, 3) == (
        "model.name timm:resnet18 needs timm, which is not installed: pip install "
        "'ddpflow[timm]'")


def test_forward_spreads_the_inputs_and_unwrap_finds_the_plain_module():
    class Echo(nn.Module):
        def forward(self, *args, **kw):
            return args, kw

    echo = Echo()
    assert models.forward(echo, {"a": 1}) == ((), {"a": 1})
    assert models.forward(echo, (1, 2)) == ((1, 2), {})
    assert models.forward(echo, [1, 2]) == ((1, 2), {})
    assert models.forward(echo, 3) == ((3,), {})
    assert models.unwrap(nn.DataParallel(torch.compile(nn.DataParallel(echo)))) is echo
    assert models.unwrap(echo) is echo


def test_a_count_reads_as_people_say_it():
    assert [models.count_text(n) for n in (0, 812, 999, 1000, 3800, 1_000_000, 11_200_000,
                                           999_400, 999_999, 999_999_999, 1_000_000_000,
                                           1_300_000_000)] == [
        "0", "812", "999", "1 k", "3.8 k", "1 M", "11.2 M", "999 k", "1 M", "1 G", "1 G",
        "1.3 G"]  # rounded up to 1000 is the next unit
    assert models.param_count(nn.Linear(3, 2)) == 8


# ------------------------------------------------------------------ contract: the model

def _probe_cfg(task="classification", image_size=24):
    return SimpleNamespace(data=SimpleNamespace(image_size=image_size),
                           task=SimpleNamespace(name=task))


def test_the_probe_is_the_data_s_image_size_and_the_task_s_width():
    py = {"kind": "python", "num_classes": 5}
    assert contract.probe(_probe_cfg(), {"kind": "prepared", "num_classes": 5}) == \
        Probe((24, 24), "classification", 5)
    assert contract.probe(_probe_cfg(), {**py, "input_shape": [3, 20, 28]}) == \
        Probe((20, 28), "classification", 5)
    for shape in ([6], [2, 3, 20, 28], None, []):
        assert contract.probe(_probe_cfg(), {**py, "input_shape": shape}).hw is None, shape
    assert contract.probe(_probe_cfg("regression"), {"num_classes": 5}) == \
        Probe((24, 24), "regression", 1)
    assert contract.probe(_probe_cfg("regression"), {**py, "input_shape": [1, 8, 8]}) == \
        Probe((8, 8), "regression", None)
    assert contract.probe(_probe_cfg("m.t:T"), {"num_classes": 5}) == Probe((24, 24), None, None)


def test_a_value_is_described_by_type_shape_and_dtype():
    d = contract.describe
    assert d(torch.zeros(2, 3)) == "a Tensor of shape (2, 3) (float32)"
    assert d(np.zeros(2, dtype=np.int64)) == "a ndarray of shape (2,) (int64)"
    assert d((1, 2, 3)) == "a tuple of 3: (int 1, int 2, int 3)"
    assert d([1, 2, 3, 4]) == "a list of 4: (int 1, int 2, int 3, ...)"
    assert d([]) == "a list of 0: ()"
    assert d(dict.fromkeys("abcdef", 1)) == "a dict with keys a, b, c, d, e"
    assert d({"a\nb": 1, 2: 1}) == "a dict with keys 'a\\nb', 2"
    assert d("x" * 50) == "str 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx ..."
    assert d(None) == "NoneType None"


@pytest.mark.parametrize("value,bad", [
    (torch.tensor([1.0, float("nan")]), True), (torch.tensor([1.0, 2.0]), False),
    (torch.tensor([1 + 1j, complex("inf")]), True), (torch.tensor([3]), False),
    (torch.empty(2, device="meta"), False),
    (np.array([1.0, np.inf]), True), (np.array([1.0]), False), (np.array([1]), False),
    (np.array([complex("nan")]), True),
    (float("inf"), True), (1.5, False), (3, False), (True, False), (complex("nan"), True),
    (np.float32("nan"), True), ("nan", False),
])
def test_non_finite_values_are_found_in_every_kind_of_number(value, bad):
    assert contract._nonfinite(value) is bad


CLS = "a tensor of logits [batch, 4]"
OUTPUTS = [  # (outputs, task, width, the message after the name)
    ((torch.zeros(2, 4),), "classification", 4,
     f" returned a tuple of 1: (a Tensor of shape (2, 4) (float32)) from forward(), not a "
     f"tensor; the classification task expects {CLS}: return only that (e.g. out[0] or "
     f"out['logits'])"),
    (np.zeros((2, 4)), "classification", 4,
     f" returned a ndarray of shape (2, 4) (float64) from forward(); the classification task "
     f"expects {CLS}"),
    (1.5, "regression", None, " returned float 1.5 from forward(); the regression task "
                              "expects a tensor of outputs [batch, outputs]"),
    (torch.zeros(3, 1), "regression", 1,
     " returned a Tensor of shape (3, 1) (float32) for a batch of 2; the regression task "
     "expects a tensor of outputs [batch, 1]: one output per target value"),
    (torch.zeros(2, 2), "regression", 1, " returned a Tensor of shape (2, 2) (float32) for a "
                                         "batch of 2; the regression task expects"),
    (torch.zeros(2), "classification", None,
     " returned a Tensor of shape (2,) (float32) for a batch of 2; expected a tensor of logits "
     "[batch, outputs] (flatten or pool the rest)"),
    (torch.zeros(3, 4), "classification", 4, " returned a Tensor of shape (3, 4) (float32) for "
                                             "a batch of 2; expected"),
    (torch.zeros(2, 5), "classification", 4,
     " returned a Tensor of shape (2, 5) (float32) for a batch of 2; expected [2, 4]: one "
     "output per class of the data (4); build the head with num_classes"),
    (torch.full((2, 4), float("nan")), "classification", 4,
     " returned NaN/inf outputs for a probe batch of finite images, before training: NaN/inf in "
     "its starting weights or forward(); check its initialisation"),
    ({"a": [torch.zeros(1), torch.tensor([float("inf")])]}, None, None, " returned NaN/inf"),
]


@pytest.mark.parametrize("out,task,width,expected", OUTPUTS)
def test_outputs_that_break_the_contract_are_one_message(out, task, width, expected):
    text = _refusal(contract.check_outputs, out, "model.name m:b", task, width)
    assert text.startswith("model.name m:b" + expected), text


def test_outputs_that_keep_the_contract_pass():
    check = contract.check_outputs
    check(torch.zeros(2, 7), "m", "classification", None)
    check(torch.zeros(2, 3), "m", "regression", None)
    check(torch.zeros(2), "m", "regression", 1)
    check(torch.zeros(2, 1, 1), "m", "regression", 1)
    check(torch.zeros(4, 2), "m", "regression", 2, batch=4)
    check(torch.full((2, 4), float("nan")), "m", "classification", 4, finite=False)
    check({"a": (torch.full((1,), float("nan")),)}, "m", None, finite=False)
    check({"a": (torch.zeros(1), "text", 3)}, "m", None)


class Recorder(nn.Module):
    """Keeps what its forward saw: the input, the mode and whether gradients were on."""

    def __init__(self, fail=None, width=4):
        super().__init__()
        self.lin = nn.Linear(1, width)
        self.fail, self.seen = fail, []

    def forward(self, x):
        self.seen.append((x.clone(), self.training, torch.is_grad_enabled()))
        if self.fail:
            raise self.fail
        return self.lin(x.mean((1, 2, 3))[:, None])


def test_the_model_probe_is_two_seeded_images_in_eval_mode_without_gradients():
    model = Recorder().eval()
    contract.check_model(model, 4, 1, (5, 3), "m")
    x, training, grad = model.seen[0]
    assert torch.equal(x, torch.rand(2, 1, 5, 3, generator=torch.Generator().manual_seed(0)))
    assert (training, grad, model.training) == (False, False, False)
    contract.check_model(model.train(), 4, 2, 6, "m")
    assert model.seen[1][0].shape == (2, 2, 6, 6) and model.training
    contract.check_model(Recorder(width=9), 4, 1, 4, "m", width=9)
    contract.check_model(Recorder(width=9), 4, 1, 4, "m", width=None)
    assert _refusal(contract.check_model, Recorder(width=9), 4, 1, 4, "m").startswith(
        "m returned a Tensor of shape (2, 9) (float32) for a batch of 2; expected [2, 4]")
    with torch.device("meta"):
        meta = Recorder()
    contract.check_model(meta, 4, 3, 4, "m")
    assert meta.seen[0][0].is_meta and meta.seen[0][0].shape == (2, 3, 4, 4)


@pytest.mark.parametrize("fail,on_meta", [
    (NotImplementedError("no meta kernel"), True), (TypeError("needs values"), True),
    (RuntimeError("Tensor.item() cannot be called on meta tensors"), True),
    (ValueError("too small"), False)])
def test_a_forward_that_fails_is_one_message_unless_it_only_lacks_meta_kernels(fail, on_meta):
    with torch.device("meta"):
        meta = Recorder(fail)
    if on_meta:
        contract.check_model(meta, 4, 3, 4, "m")
    else:
        assert _refusal(contract.check_model, meta, 4, 3, 4, "m").startswith(
            "m: forward() of a probe batch of shape (2, 3, 4, 4) failed (ValueError: too small")
    model = Recorder(fail).train()
    text = _refusal(contract.check_model, model, 4, 3, (4, 6), "model.name m:b")
    assert text.startswith(f"model.name m:b: forward() of a probe batch of shape (2, 3, 4, 6) "
                           f"failed ({type(fail).__name__}: {fail} at test_seams_unit.py:"), text
    assert text.endswith("); the data gives 3 x 4 x 6 images (data.image_size)")
    assert model.training


def test_a_model_without_parameters_is_probed_on_the_cpu():
    contract.check_model(nn.Sequential(nn.Flatten(), nn.LazyLinear(4)).to("cpu"), 4, 3, 4, "m")
    contract.check_model(nn.Sequential(nn.AdaptiveAvgPool2d(2), nn.Flatten()), 12, 3, 4, "m")


# ------------------------------------------------------------------ contract: items

def _image(values, dtype=torch.float32, shape=(3, 2, 2)):
    return torch.tensor(values, dtype=dtype).reshape(-1)[:1].expand(shape).clone() \
        if not isinstance(values, list) else torch.tensor(values, dtype=dtype).reshape(shape)


@pytest.mark.parametrize("x,in_channels,materialize,expected", [
    (torch.zeros(8, 8, 3), 3, False, "H x W x C (channels last); expected C x H x W: "
                                     "x.permute(2, 0, 1) (ToTensor does this for images)"),
    (torch.zeros(8, 8, 4), None, False, "H x W x C (channels last)"),
    (torch.zeros(3, 8, 3), 3, False, None),  # C x H x W with W 3
    (torch.zeros(4, 8, 4), None, False, None),
    (torch.zeros(8, 8, 2), None, False, None),
    (torch.zeros(2, 8, 8), 3, False, "2 channels; expected 3"),
    (torch.zeros(3, 2, 2, dtype=torch.uint8), 3, True, None),
    (torch.zeros(3, 2, 2, dtype=torch.int64), 3, True,
     "dtype torch.int64; expected uint8 or float in [0, 1]"),
    (torch.zeros(3, 2, 2, dtype=torch.bool), 3, True, "dtype torch.bool; expected uint8"),
    (torch.zeros(3, 2, 2, dtype=torch.int64), 3, False, None),
    (torch.tensor([0.0, 1.0, 0.5]).repeat(4).reshape(3, 2, 2), 3, True, None),
    (torch.tensor([-0.5, 1.0, 0.5]).repeat(4).reshape(3, 2, 2), 3, True,
     "values in [-0.5, 1]; expected float in [0, 1] or uint8 (divide 0..255 values by 255)"),
    (torch.tensor([0.0, 1.5, 0.5]).repeat(4).reshape(3, 2, 2), 3, True, "values in [0, 1.5]"),
    (torch.tensor([0.0, 255.0, 7.0]).repeat(4).reshape(3, 2, 2), 3, False,
     "whole-number float values in [0, 255]: 0..255 pixels; expected float in [0, 1] (divide "
     "by 255) or uint8"),
    (torch.tensor([2.0, 3.0, 7.0]).repeat(4).reshape(3, 2, 2), 3, False,
     "whole-number float values in [2, 7]"),
    (torch.tensor([0.0, 256.0, 7.0]).repeat(4).reshape(3, 2, 2), 3, False, None),
    (torch.tensor([0.0, 2.0, 1.0]).repeat(4).reshape(3, 2, 2), 3, False,
     "whole-number float values in [0, 2]"),
    (torch.tensor([0.0, 1.0, 1.0]).repeat(4).reshape(3, 2, 2), 3, False, None),  # a mask
    (torch.tensor([-1.0, 255.0, 7.0]).repeat(4).reshape(3, 2, 2), 3, False, None),
    (torch.tensor([0.0, 200.0, 7.5]).repeat(4).reshape(3, 2, 2), 3, False, None),
    (np.full((3, 2, 2), 3.0), 3, False, "whole-number float values in [3, 3]"),
])
def test_an_image_is_c_h_w_and_uint8_or_float_in_0_1(x, in_channels, materialize, expected):
    problem = contract._image_problem(x, in_channels, materialize)
    assert problem == expected if expected is None or problem is None else \
        problem.startswith(expected), problem


@pytest.mark.parametrize("y,classes,expected", [
    (torch.tensor(2), 4, None), (torch.tensor([3]), 4, None), (np.int64(0), 4, None),
    (np.array([3], dtype=np.uint8), 4, None), (7, None, None),
    (torch.tensor([[1]]), 4, "a label of shape (1, 1); expected one integer class index"),
    (torch.tensor([1, 2]), 4, "a label of shape (2,); expected one integer class index"),
    (np.zeros((1, 1), dtype=np.int64), 4, "a label of shape (1, 1)"),
    (torch.tensor(1.0), 4, "a float32 label; expected an integer class index (int(label), or "
                           "torch.long)"),
    (torch.tensor(1 + 0j), 4, "a complex64 label"),
    (torch.tensor(True), 4, "a bool label"),
    (np.array(1.0), 4, "a float64 label"),
    (np.array(True), 4, "a bool label"),
    (True, 4, "a bool label True; expected an integer class index"),
    (1.0, 4, "a float label 1.0; expected an integer class index"),
    ("cat", 4, "a str label 'cat'; expected an integer class index"),
    (4, 4, "label 4, out of range; expected a class index in [0, 4)"),
    (torch.tensor([4]), 4, "label 4, out of range; expected a class index in [0, 4)"),
    (-1, None, "label -1, out of range; expected a class index in 0 or more"),
    (0, 1, None), (3, 4, None),
])
def test_a_class_label_is_one_integer_in_range(y, classes, expected):
    problem = contract.label_problem(y, classes)
    assert problem == expected if expected is None or problem is None else \
        problem.startswith(expected), problem


class Image:  # what PIL gives without ToTensor: named like it
    pass


WHERE = "data.factory m:f: item 3 of the 'val' dataset"


@pytest.mark.parametrize("item,kw,expected", [
    ([torch.zeros(3, 2, 2)], {}, " is a list of 1: (a Tensor of shape (3, 2, 2) (float32)); "
                                 "expected an (input, target) pair"),
    ("ab", {}, " is str 'ab'; expected an (input, target) pair"),
    (({}, "x"), {}, " is a tuple of 2: (a dict with keys , str 'x'): an empty input or target"),
    ((torch.zeros(3, 2, 2), []), {}, " is a tuple of 2: (a Tensor of shape (3, 2, 2) (float32), "
                                     "a list of 0: ()): an empty input or target"),
    ((Image(), 1), {}, " holds Image (add a transform that makes a tensor, e.g. ToTensor), not "
                       "tensors; expected tensors, arrays or numbers"),
    ((torch.zeros(2), None), {"classify": False}, " holds NoneType, not tensors"),
    ((torch.zeros(2), float("nan")), {"classify": False},
     " has NaN/inf in its target; expected finite values"),
    (((torch.zeros(2), torch.tensor([float("inf")])), 1), {}, " has NaN/inf in its input"),
    ((torch.zeros(8), 1), {"materialize": True, "classify": False},
     ": its input is a Tensor of shape (8,) (float32); data.materialize needs C x H x W images"),
    ((torch.zeros(3, 2, 2, dtype=torch.int64), 1), {"materialize": True, "classify": False},
     ": its image is a Tensor of shape (3, 2, 2) (int64): dtype torch.int64; expected uint8"),
    ((torch.zeros(3, 2, 2), 1.5), {"materialize": True, "classify": False},
     ": its target is a float label 1.5; expected an integer class index"),
    ((np.zeros((2, 2, 3)), 0), {}, ": its image is a ndarray of shape (2, 2, 3) (float64): H x W"),
    ((torch.zeros(3, 2, 2), 9), {}, ": its target is label 9, out of range; expected a class "
                                    "index in [0, 4)"),
])
def test_an_item_is_refused_word_for_word(item, kw, expected):
    text = _refusal(contract.check_item, item, 3, "data.factory m:f", "val", 3, 4, **kw)
    assert text.startswith(WHERE + expected), text


def test_items_that_are_no_class_index_pass_when_nothing_classifies():
    contract.check_item((torch.zeros(3, 2, 2), 1.5), 0, "f", "train", 3, 4, classify=False)
    contract.check_item((torch.zeros(5), torch.zeros(2)), 0, "f", "train", None, None,
                        classify=False)
    contract.check_item((torch.zeros(5, 2, 2), 1), 0, "f", "train", None, 4)  # no image rules
    contract.check_item((torch.zeros(2, 2, 2), 1), 0, "f", "train", None, 4)
    contract.check_item(((torch.zeros(2), {"m": np.ones(2)}), 0), 0, "f", "train", 3, 4)


def test_shapes_are_nested_like_the_item():
    assert contract.shapes((torch.zeros(3, 2), {"a": np.zeros(4), "b": [1, 2.0]})) == \
        ((3, 2), {"a": (4,), "b": ((), ())})
    assert list(contract._leaves({"a": [1, (2, {"b": 3})], "c": 4})) == [1, 2, 3, 4]


class Logged(torch.utils.data.Dataset):
    def __init__(self, n, make=lambda i: (torch.zeros(3, 2, 2), i % 4)):
        self.n, self.make, self.read = n, make, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.read.append(i)
        return self.make(i)


@pytest.mark.parametrize("n,read", [(1, [0]), (2, [0, 1]), (3, [0, 1, 2]), (9, [0, 4, 8]),
                                    (10, [0, 5, 9])])
def test_the_first_middle_and_last_items_are_probed(n, read):
    ds = Logged(n)
    first = contract.check_items(ds, "f", "train", 3, 4)
    assert ds.read == read and torch.equal(first[0], torch.zeros(3, 2, 2)) and first[1] == 0


def test_items_of_two_shapes_and_unreadable_items_are_named():
    ds = Logged(5, lambda i: (torch.zeros(3, 2, 2 + (i == 2)), 0))
    assert _refusal(contract.check_items, ds, "data.factory m:f", "test", None, 4) == (
        "data.factory m:f: item 2 of the 'test' dataset has shapes ((3, 2, 3), ()), item 0 has "
        "((3, 2, 2), ()); expected items of one shape (images must be one size: resize or crop "
        "them)")

    def missing(i):
        raise KeyError(i)

    assert _refusal(contract.read_item, Logged(5, missing), 4, "data.factory m:f", "test") == (
        "data.factory m:f: reading item 4 of the 'test' dataset failed (len() says 5) "
        "(KeyError: 4 at test_seams_unit.py:" + str(missing.__code__.co_firstlineno + 1) + ")")

    def broken(i):
        raise OSError("disk")

    assert _refusal(contract.read_item, Logged(5, broken), 0, "f", "train").startswith(
        "f: reading item 0 of the 'train' dataset failed (OSError: disk at ")


# ------------------------------------------------------------------ contract: the task

def test_a_loss_is_a_scalar_tensor_with_a_gradient_when_the_outputs_have_one():
    contract.check_loss(torch.tensor(0.5), "t", grad=False)
    contract.check_loss(torch.tensor(0.5, requires_grad=True), "t")
    assert _refusal(contract.check_loss, torch.tensor(0.5), "t") == (
        "t: loss(outputs, batch) does not depend on the model's outputs (no gradient); compute "
        "it from `outputs`")
    assert _refusal(contract.check_loss, [0.5], "t", grad=False) == (
        "t: loss(outputs, batch) returned a list of 1: (float 0.5), not a scalar tensor; reduce "
        "it (e.g. .mean())")
    assert _refusal(contract.check_loss, torch.zeros(1, 1), "t", grad=False).startswith(
        "t: loss(outputs, batch) returned a tensor of shape (1, 1), not a scalar tensor")


def test_metrics_are_named_sum_count_pairs_with_some_count_above_0():
    good = {"acc": [torch.tensor(1.0), torch.tensor([0.0, 2.0])], "n": (1, -1)}
    assert contract.metric_pairs(good, "t") is good
    assert contract.check_metrics(good, "t") is good
    assert contract.check_metrics({}, "t") == {}
    assert contract.check_metrics({"a": (1.0, 0.5)}, "t")
    for bad, shown in (({1: (1, 2)}, "1"), ({"a": (1, 2, 3)}, "'a'"), ({"a": "12"}, "'a'"),
                       ({"a": (1, 2), "val-x": (1, 2)}, "'val-x'")):
        assert _refusal(contract.metric_pairs, bad, "t") == (
            f"t: metrics(outputs, batch) item {shown} must be a name -> (sum, count) pair; it "
            f"is {contract.describe(bad[next(k for k in bad if k != 'a' or len(bad) == 1)])}")
    assert _refusal(contract.metric_pairs, None, "t") == (
        "t: metrics(outputs, batch) returned NoneType None, not a dict of name -> (sum, count)")
    assert _refusal(contract.check_metrics, {"a": (1.0, 0), "b": (1.0, torch.tensor([1, -1]))},
                    "t") == (
        "t: metrics(outputs, batch) returned a count of 0 for every metric (a, b); expected "
        "(sum, count) pairs with count > 0 (e.g. the number of samples in the batch)")


class Scored:
    """A task that keeps what it was given."""

    def __init__(self, loss=lambda o, b: o.float().mean(), counts=1):
        self.fn, self.counts, self.seen = loss, counts, []

    def loss(self, outputs, batch):
        return self.fn(outputs, batch)

    def metrics(self, outputs, batch):
        self.seen.append((getattr(outputs, "requires_grad", None), torch.is_grad_enabled()))
        return {"n": (1.0, self.counts)}


def test_the_task_check_returns_the_loss_and_probes_metrics_without_gradients():
    out = torch.randn(2, 4, requires_grad=True)
    batch = (torch.zeros(2, 3), torch.tensor([0, 3]))
    t = Scored()
    loss = contract.check_task(t, out, batch, "t", "classification")
    assert loss.requires_grad and torch.equal(loss, out.mean()) and t.seen == [(False, False)]
    assert contract.check_task(t, out, batch, "t", metrics=False) is not None
    assert len(t.seen) == 1
    assert _refusal(contract.check_task, Scored(counts=0), out, batch, "t").startswith(
        "t: metrics(outputs, batch) returned a count of 0")
    contract.check_task(Scored(lambda o, b: torch.tensor(1.0)), [1.0], batch, "t")  # no grad
    contract.check_task(Scored(lambda o, b: torch.tensor(1.0)), out.detach(), batch, "t")
    assert _refusal(contract.check_task, Scored(lambda o, b: o.square().sum() * float("inf")), out,
                    batch, "t", None, "model.name m:b") == (
        "t: loss(outputs, batch) is inf on the first batch of this run, before any update (so "
        "not the learning rate): the outputs and inputs are finite: the loss itself")
    nan = torch.full((2, 4), float("nan"), requires_grad=True)
    assert _refusal(contract.check_task, Scored(), nan, batch, "t", None, "model.name m:b") \
        .endswith(": model.name m:b returned NaN/inf for finite inputs (its starting weights or "
                  "forward())")
    inputs = ((torch.zeros(2, 3), torch.full((2, 3), float("inf"))), batch[1])
    assert _refusal(contract.check_task, Scored(), nan, inputs, "t", None, "m").endswith(
        ": the batch's inputs hold NaN/inf (the data)")  # one of its inputs
    assert _refusal(contract.check_task, Scored(lambda o, b: torch.tensor(float("nan"))), [nan],
                    batch, "t", None, "m").endswith(
        ": the outputs and inputs are finite: the loss itself")


@pytest.mark.parametrize("builtin,out,y,expected", [
    ("regression", torch.zeros(2, 3), torch.zeros(2),
     "m returned a Tensor of shape (2, 3) (float32) for targets of shape (2,); the regression "
     "task expects one output per target value"),
    ("classification", torch.zeros(2, 3), torch.zeros(2, 4),
     "m: the batch's targets are a Tensor of shape (2, 4) (float32); the classification task "
     "expects integer class indices [2] (or soft targets [2, 3]) for its 3 outputs"),
    ("classification", torch.zeros(2, 3), torch.zeros(2, 1, dtype=torch.long),
     "m: the batch's targets are a Tensor of shape (2, 1) (int64); the classification task "
     "expects one integer class index per sample"),
    ("classification", torch.zeros(2, 3), torch.tensor([3, 0]),
     "m: the batch's targets hold class 3, but it returned a Tensor of shape (2, 3) (float32): "
     "3 outputs per sample; expected class indices in [0, 3) (set the model's num_classes to "
     "the data's class count)"),
    ("classification", torch.zeros(2, 3), torch.tensor([2, -1]), "m: the batch's targets hold "
                                                                 "class -1, but"),
    ("classification", torch.zeros(3, 3), torch.tensor([2, 0]),
     "m returned a Tensor of shape (3, 3) (float32) for a batch of 2; expected"),
])
def test_the_built_in_tasks_refuse_outputs_and_targets_that_do_not_fit(builtin, out, y,
                                                                       expected):
    assert _refusal(contract._fits, builtin, out, y, "m").startswith(expected)


def test_outputs_and_targets_that_fit_pass():
    fits = contract._fits
    fits("classification", torch.full((2, 3), float("nan")), torch.tensor([0, 2]), "m")
    fits("classification", torch.zeros(2, 3), torch.rand(2, 3), "m")  # soft targets
    fits("regression", torch.zeros(2, 1), torch.zeros(2), "m")
    fits("regression", [torch.zeros(5)], torch.zeros(2), "m")  # not a tensor: the task's own
    fits("classification", torch.zeros(2, 3), [7, 8], "m")
    fits(None, torch.zeros(5), torch.tensor([9]), "m")
    fits("m.t:T", torch.zeros(5), torch.tensor([9]), "m")


def test_a_timm_model_is_asked_of_timm_without_weights(code, monkeypatch):
    """What ddpflow hands timm.create_model (timm is an optional extra, absent here: a module
    of that name stands in for it and keeps the call)."""
    code("timm.py", """\
        from torch import nn

        calls = []


        def create_model(name, **kw):
            calls.append((name, kw))
            return nn.Linear(1, 1)
        """)
    monkeypatch.delitem(sys.modules, "timm", raising=False)
    models.build_model(SimpleNamespace(name="timm:vit_tiny", kwargs={"drop_rate": 0.1}), 5, 1)
    models.build_model("timm:resnet18", 4, None)
    import timm

    assert timm.calls == [
        ("vit_tiny", {"pretrained": False, "num_classes": 5, "in_chans": 1, "drop_rate": 0.1}),
        ("resnet18", {"pretrained": False, "num_classes": 4, "in_chans": 3})]
