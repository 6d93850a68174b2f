"""Starting weights, freezing and diagnoses (hardening.md classes 1, 3, 4 and 7).

Function-level rows for the function that decides (a tiny model, weights files in each shape
written to tmp_path), then two real `ddpflow launch` runs: weights that mostly do not fit are
one message before any rank starts, and NaN inputs are named as the data, not the learning
rate."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import ddpflow, tiny_config, write_config
from ddpflow.config import from_dict
from ddpflow.core.errors import UserError
from ddpflow.core.reading import existing
from ddpflow.engine.checkpoint import check_fits
from ddpflow.engine.step import StepCounters, divergence
from ddpflow.engine.weights import (
    freeze,
    load_pretrained,
    read_init_from,
    read_state_dict,
    start_weights,
)


class Tiny(nn.Module):
    def __init__(self, classes=3, width=4, in_channels=3):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(in_channels, width, 3), nn.BatchNorm2d(width),
                                      nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.backbone(x))


class Wide(nn.Module):  # 12 layers whose widths differ from Tiny's: more than 8 misfits
    def __init__(self, width):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(12)])
        self.head = nn.Linear(width, 3)


def _sd(model: nn.Module) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _nan(sd: dict) -> dict:
    sd["backbone.1.weight"][0] = float("nan")
    return sd


def _save(obj, path: Path) -> Path:
    if obj == "FOLDER":
        path.mkdir()
    elif obj == "EMPTY":
        path.write_bytes(b"")
    elif obj == "TEXT":
        path.write_text("not weights at all\n")
    elif obj != "MISSING":
        torch.save(obj, path)
    return path


HEAD_NAMES = ["head.weight", "head.bias"]
# (file contents, weights_partial, expected: a report's parts, or the message's parts)
LOAD_ROWS = {
    "all fit": (lambda: _sd(Tiny()), False, {"loaded": 9, "reinitialised": []}),
    "only the head differs": (lambda: _sd(Tiny(classes=5)), False,
                              {"loaded": 7, "skipped": 2, "reinitialised": HEAD_NAMES}),
    "the head is missing (a backbone save)": (
        lambda: {k: v for k, v in _sd(Tiny()).items() if not k.startswith("head")}, False,
        {"loaded": 7, "reinitialised": HEAD_NAMES}),
    "a DDP-wrapped save": (lambda: {f"module.{k}": v for k, v in _sd(Tiny()).items()}, False,
                           {"loaded": 9}),
    "a ddpflow checkpoint": (lambda: {"model": _sd(Tiny()), "step": 3}, False, {"loaded": 9}),
    "the backbone differs": (lambda: _sd(Tiny(width=8)), False, UserError(
        "does not fit model.name beyond its final layer (6 tensors; the model has 9, the "
        "file 9): 'backbone.0.weight' (8, 3, 3, 3) in the file, (4, 3, 3, 3) in the model; ",
        "'backbone.1.running_var' (8) in the file, (4) in the model; is it another",
        "model.weights_partial: true to load the 2 tensors that fit")),
    "the backbone differs, allowed": (lambda: _sd(Tiny(width=8)), True, {
        "loaded": 2, "partial": True, "reinitialised": [
            "backbone.0.weight", "backbone.0.bias", "backbone.1.weight", "backbone.1.bias",
            "backbone.1.running_mean", "backbone.1.running_var", "head.weight"]}),
    "another architecture, more than 8 misfits": (lambda: _sd(Wide(6)), False, UserError(
        "(31 tensors; the model has 9, the file 26)", "'backbone.0.weight' (4, 3, 3, 3) is "
        "not in the file", "'layers.0.weight' (6, 6) is not in the model", "; and 23 more;")),
    "another architecture, allowed": (lambda: _sd(Wide(6)), True, {
        "loaded": 1, "skipped": 25, "partial": True}),
    "nothing fits, allowed": (lambda: {"other.weight": torch.zeros(2)}, True, UserError(
        "no tensor of the file has the model's name and shape")),
    "NaN in a tensor": (lambda: _nan(_sd(Tiny())), False, UserError(
        "w.pt: tensor 'backbone.1.weight' holds 1 NaN/inf of its 4 values",
        "not a learning-rate problem")),
    "a folder": ("FOLDER", False, UserError("w.pt is a folder, not a file")),
    "missing": ("MISSING", False, UserError("w.pt does not exist")),
    "empty": ("EMPTY", False, UserError("w.pt is empty")),
    "not a torch file": ("TEXT", False, UserError("cannot be loaded as weights")),
    "a pickled nn.Module": (lambda: Tiny(), False, UserError(
        "holds pickled Python objects", "Tiny", "save model.state_dict() instead")),
    "a list": (lambda: [1, 2, 3], False, UserError("holds a list of 3 items, not a state dict")),
    "a tensor": (lambda: torch.zeros(2, 3), False, UserError(
        "holds a single tensor of shape (2, 3), not a state dict")),
    "another tool's checkpoint": (lambda: {"state_dict": _sd(Tiny()), "epoch": 2}, False,
                                  UserError("a dict whose 'state_dict' is a dict, not a tensor")),
}


@pytest.mark.parametrize("row", list(LOAD_ROWS))
def test_model_weights_load_or_one_message(tmp_path, row):
    """model.weights through the path every rank and the launcher's check take: the right
    result (a report of what was loaded and re-initialised) or one UserError naming the file
    and what does not fit; the model is never half-loaded when refused."""
    contents, partial, expected = LOAD_ROWS[row]
    path = _save(contents if isinstance(contents, str) else contents(), tmp_path / "w.pt")
    model = Tiny()
    before = _sd(model)
    setting = f"model.weights {path}"
    if isinstance(expected, UserError):
        with pytest.raises(UserError) as err:
            load_pretrained(model, read_state_dict(path, "model.weights"), setting, partial)
        msg = str(err.value)
        assert "\n" not in msg and all(part in msg for part in expected.args), msg
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        return
    sd = read_state_dict(path, "model.weights")
    report = load_pretrained(model, sd, setting, partial)
    assert {k: report[k] for k in expected} == expected, report
    assert report.get("partial", False) is partial
    loaded = model.state_dict()
    for k, t in loaded.items():  # loaded from the file, or still the fresh initialisation
        assert torch.equal(t, before[k] if k in report["reinitialised"] else sd[k]), k


def test_the_report_reaches_summary_init_and_the_log(tmp_path):
    """start_weights: model.weights_partial from the config, what was loaded and
    re-initialised in the report (summary.json `init`) and the stage log."""
    torch.save(_sd(Tiny(width=8)), tmp_path / "w.pt")
    said = []
    for partial in (False, True):
        cfg = from_dict({"stages": [{"name": "a", "freeze": ["backbone.0"]}],
                         "model": {"weights": str(tmp_path / "w.pt"),
                                   "weights_partial": partial}})
        model = Tiny()
        if not partial:
            with pytest.raises(UserError, match="model.weights_partial: true"):
                start_weights(cfg, cfg.stage("a"), model, tmp_path / "w.pt", said.append)
            continue
        report = start_weights(cfg, cfg.stage("a"), model, tmp_path / "w.pt", said.append)
        assert report["partial"] and report["loaded"] == 2 and report["frozen"] == 2
        assert report["from"] == str(tmp_path / "w.pt") and len(report["reinitialised"]) == 7
    assert "2 tensors loaded" in said[0] and "(model.weights_partial)" in said[0], said


FREEZE_ROWS = [
    (["backbone.0"], 2),
    (["backbone"], 4),
    (["bakbone", "haed"], "no parameter name starts with 'bakbone', 'haed'"),
    (["backbone", "nope"], "no parameter name starts with 'nope'"),
    (["backbone", "head"], "freezes every parameter"),
    ([""], "freezes every parameter"),  # "" is a prefix of every name
]


@pytest.mark.parametrize("prefixes, expected", FREEZE_ROWS)
def test_freeze_prefixes(prefixes, expected):
    model = Tiny()
    if isinstance(expected, int):
        assert freeze(model, prefixes, "model.freeze") == expected
        assert sum(not p.requires_grad for p in model.parameters()) == expected
        return
    with pytest.raises(UserError, match="^model.freeze") as err:
        freeze(model, prefixes, "model.freeze")
    assert expected in str(err.value), str(err.value)


def test_init_from_keeps_the_strict_rule(tmp_path):
    """init_from: every tensor must fit (even the head); a folder, NaN: one message."""
    torch.save({"model": _sd(Tiny(classes=5))}, tmp_path / "prev.pt")
    with pytest.raises(UserError, match="'head.weight' is \\(5, 4\\) there, \\(3, 4\\)"):
        check_fits(Tiny(), read_init_from(tmp_path / "prev.pt", "stages.1.init_from"),
                   "stages.1.init_from")
    (tmp_path / "dir.pt").mkdir()
    with pytest.raises(UserError, match="dir.pt is a folder, not a file; run the earlier"):
        read_init_from(tmp_path / "dir.pt", "stages.1.init_from")
    torch.save(_nan(_sd(Tiny())), tmp_path / "nan.pt")
    with pytest.raises(UserError, match="nan.pt: tensor 'backbone.1.weight' holds 1 NaN"):
        read_init_from(tmp_path / "nan.pt", "stages.1.init_from")


@pytest.mark.parametrize("make, folder, expected", [
    (lambda p: p.mkdir(), False, "is a folder, not a file"),
    (lambda p: p.write_text("x"), True, "is a file, not a folder"),
    (lambda p: None, False, "does not exist"),
    (lambda p: p.symlink_to(p.parent / "gone"), True, "is a broken symlink"),
    (lambda p: p.mkdir(), True, None),
    (lambda p: p.write_text("x"), False, None),
])
def test_a_path_says_what_it_is(tmp_path, make, folder, expected):
    make(tmp_path / "p")
    if expected is None:
        assert existing(tmp_path / "p", "x", "fix", folder=folder) == tmp_path / "p"
        return
    with pytest.raises(UserError, match=f"^x: .*p {expected}; fix$"):
        existing(tmp_path / "p", "x", "fix", folder=folder)


def test_folders_and_files_where_the_other_belongs(tmp_path):
    """model.code_dir that is a file; data.path of an image folder source that is a file."""
    from ddpflow.data.prepare import _build_arrays
    from ddpflow.seams.userimport import add_code_dirs

    (tmp_path / "code.py").write_text("")
    cfg = from_dict({"stages": [{"name": "s"}], "model": {"code_dir": str(tmp_path / "code.py")},
                     "data": {"source": "imagefolder", "path": str(tmp_path / "code.py")}})
    with pytest.raises(UserError, match="^model.code_dir: .*code.py is a file, not a folder"):
        add_code_dirs(cfg)
    with pytest.raises(UserError, match=r"^data.path \(source imagefolder\): .*code.py is a "
                                        r"file, not a folder; point data.path at the folder"):
        _build_arrays(cfg, tmp_path / "out", {})
    assert not (tmp_path / "out").exists()


def _counters(inputs_per_step, losses):
    from ddpflow.engine.state import TrainState

    c = StepCounters(TrainState(), torch.device("cpu"))
    for x, loss in zip(inputs_per_step, losses):
        c.add_loss(torch.tensor(loss), x)
        c.step_dev += 1
    return c.bad_steps()


NAN, OK = torch.tensor([[1.0, math.nan]]), torch.ones(1, 2)
DIAGNOSIS_ROWS = [  # (inputs of steps 1.., losses, the message names)
    ([OK, NAN, NAN], [1.0, math.nan, math.nan], "the inputs of step 2"),
    ([OK, {"f": NAN}, OK], [1.0, math.nan, 1.0], "the inputs of step 2"),  # dict inputs
    ([OK, (OK, torch.tensor([math.inf]))], [1.0, math.inf], "the inputs of step 2"),
    ([OK, OK, OK], [1.0, math.nan, math.nan], "lower stages.0.lr"),
    ([OK, OK, NAN], [1.0, math.nan, math.nan], "lower stages.0.lr"),  # inputs bad later
    ([torch.ones(2, dtype=torch.uint8)] * 2, [1.0, math.nan], "lower stages.0.lr"),
]


@pytest.mark.parametrize("inputs, losses, expected", DIAGNOSIS_ROWS)
def test_a_nan_loss_names_its_cause(inputs, losses, expected):
    """NaN/inf inputs are the data (named), not the learning rate; a loss that goes bad on
    finite inputs is the run diverging."""
    bad = _counters(inputs, losses)
    cfg = from_dict({"stages": [{"name": "s"}],
                     "data": {"source": "python", "factory": "mydata:make"}})
    msg = divergence(cfg, "s", [bad], "nan", 0)
    assert expected in msg, msg
    if "inputs" in expected:
        assert "data.factory mydata:make" in msg and "not the learning rate" in msg


# ------------------------------------------------------------------ two real runs
NETLIB = '''
from torch import nn


def build(num_classes, in_channels=3, width=8):
    return nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(width, width, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes))
'''

NANDATA = '''
import torch
from torch.utils.data import Dataset


class Images(Dataset):
    """Finite for the first 24 reads of this process (the probe and the first batch), then
    NaN: what a broken decoder or a division by a zero std gives mid-epoch."""

    def __init__(self, split):
        self.split, self.reads = split, 0

    def __len__(self):
        return 64

    def __getitem__(self, i):
        self.reads += 1
        x = torch.full((3, 8, 8), 0.1 * (i % 4))
        if self.split == "train" and self.reads > 24:
            x[0, 0, 0] = float("nan")
        return x, i % 4


def make(split):
    return Images(split)


def model(num_classes=4, in_channels=3):
    from netlib import build

    return build(num_classes, in_channels)
'''


def _run_files(stage: Path) -> list[str]:
    return sorted(str(p.relative_to(stage)) for p in stage.rglob("*")
                  if p.suffix == ".pt") if stage.exists() else []


def test_launch_refuses_weights_that_mostly_do_not_fit(tmp_path):
    """`ddpflow launch`: weights of another width are one line, exit 2, no traceback, no
    rank started, no checkpoint or final.pt."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "netlib.py").write_text(NETLIB)
    import importlib.util

    # loaded from this very file: another test file's `netlib` may sit in sys.modules of this
    # worker process (pytest-xdist runs several files in one)
    spec = importlib.util.spec_from_file_location("netlib_of_this_test", code / "netlib.py")
    netlib = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(netlib)
    torch.save(netlib.build(4, 3, width=16).state_dict(), tmp_path / "pre.pt")
    cfg = tiny_config(tmp_path, data={"train_size": 64, "val_size": 32, "test_size": 32},
                      model={"name": "netlib:build", "code_dir": str(code),
                             "weights": str(tmp_path / "pre.pt")},
                      stages=[{"name": "s", "max_steps": 2, "batch_size": 8,
                               "precision": "fp32", "channels_last": False}])
    p = write_config(tmp_path, cfg)
    ddpflow("prepare", "--config", p, check=True)
    proc = ddpflow("launch", "--config", p, "--stage", "s")
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "does not fit model.name beyond its final layer (4 tensors; the model has 6" \
        in lines[-1]
    assert "'0.weight' (16, 3, 3, 3) in the file, (8, 3, 3, 3) in the model" in lines[-1]
    assert sum("does not fit" in x for x in lines) == 1, proc.stderr
    stage = tmp_path / "results/t/stages/s"
    assert _run_files(stage) == [] and not (stage / "command.json").exists()


@pytest.mark.slow
def test_nan_inputs_are_named_as_the_data(tmp_path):
    """A user dataset whose items turn NaN mid-epoch: the run stops with a message naming
    the inputs and the factory, not the learning rate, and saves no checkpoint after it."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "nandata.py").write_text(NANDATA)
    (code / "netlib.py").write_text(NETLIB)
    cfg = tiny_config(tmp_path, data={"source": "python", "factory": "nandata:make",
                                      "code_dir": str(code), "num_workers": 0},
                      model={"name": "nandata:model", "code_dir": str(code)},
                      hardware={"nproc_per_node": 1, "threads_per_rank": 1, "max_restarts": 0},
                      log_every_steps=2, checkpoint={"every_steps": 0},
                      stages=[{"name": "s", "epochs": 1, "batch_size": 8,
                               "precision": "fp32", "channels_last": False}])
    p = write_config(tmp_path, cfg)
    ddpflow("prepare", "--config", p, check=True)
    proc = ddpflow("launch", "--config", p, "--stage", "s")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    # a later step's inputs: past the seam's first-batch check, so the loss counters decide
    step = re.search(r"the inputs of step (\d+) \(epoch 0\) hold NaN/inf", proc.stderr)
    assert step and int(step.group(1)) > 1, proc.stderr[-3000:]
    assert "data.factory nandata:make" in proc.stderr
    assert "lower stages" not in proc.stderr and "learning rate" in proc.stderr
    stage = tmp_path / "results/t/stages/s"
    assert _run_files(stage) == []  # no final.pt, no checkpoint after the bad step
    failed = stage / "failed.json"
    if failed.exists():
        assert "NaN/inf" in json.dumps(json.loads(failed.read_text()))
