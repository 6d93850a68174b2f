"""The open engine for real: a user's model, dataset, task and pretrained weights, trained
by torchrun with 2 gloo ranks; their mistakes stopped with one clear message."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest
import torch

from conftest import ddpflow, tiny_config, write_config

NETLIB = '''
from torch import nn


class Net(nn.Module):
    def __init__(self, num_classes, in_channels=3, width=8):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(4), nn.Flatten())
        self.head = nn.Linear(16 * width, num_classes)

    def forward(self, x):
        return self.head(self.backbone(x))


def build(num_classes, in_channels, width=8):
    return Net(num_classes, in_channels, width)


def not_a_module(num_classes):
    return {"num_classes": num_classes}


def raises(width=8):
    raise ValueError("width must be even")
'''

# a user dataset (non-image features), its model and its task
USERDATA = '''
import torch
from torch import nn
from torch.utils.data import Dataset


class Points(Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 6, generator=g)
        self.y = self.x[:, :3].sum(1, keepdim=True) - self.x[:, 3:].prod(1, keepdim=True)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"features": self.x[i]}, self.y[i]


def make(split, n=512):
    return Points(n if split == "train" else 160, 0 if split == "train" else 1)


def strings(split):
    return [("a", 1)] * 8


def number(split):
    return 3


def three():
    return 3


class Model(nn.Module):
    def __init__(self, hidden=32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, features):
        return self.net(features)


class Task:
    monitor = "val_mae"

    def loss(self, outputs, batch):
        return ((outputs - batch[1]) ** 2).mean()

    def metrics(self, outputs, batch):
        err = (outputs.float() - batch[1]).abs()
        n = torch.tensor(float(err.numel()))
        return {"mae": (err.sum(), n), "worst": (err.max() * n, n)}


class PerSampleLoss(Task):
    def loss(self, outputs, batch):
        return (outputs - batch[1]) ** 2  # not reduced: a mistake


class SlowRankLoss(Task):
    def loss(self, outputs, batch):
        import os, time
        if os.environ["RANK"] != "0":  # the other rank lags far behind rank 0's mistake:
            while not os.path.exists(os.environ["LAG_AFTER"]):  # until rank 0 reported it,
                time.sleep(0.1)
            time.sleep(60)  # then a minute more, and it says it got through
            open(os.environ["LAG_DONE"], "w").close()
        return (outputs - batch[1]) ** 2
'''


def stage_dir(root: Path, stage: str, run: str = "t") -> Path:
    return root / "results" / run / "stages" / stage


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def user_project(root: Path) -> Path:
    code = root / "usercode"
    code.mkdir()
    (code / "netlib.py").write_text(NETLIB)
    (code / "userdata.py").write_text(USERDATA)
    return code


def processes_naming(text: str) -> list[int]:
    """Live processes whose command line contains text."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if text in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                found.append(int(pid))
        except OSError:  # ended meanwhile
            pass
    return found


def prepared(root: Path, cfg: dict) -> Path:
    p = write_config(root, cfg)
    ddpflow("prepare", "--config", p, check=True)
    return p


@pytest.mark.slow
def test_user_model_fine_tunes_from_weights_with_a_frozen_backbone(tmp_path):
    """A model file outside the package, 2 ranks: pretrained weights of another class
    count (head re-initialised, said in the log and summary), a linear probe with the
    backbone frozen, then a stage that unfreezes it. DDP keeps the ranks identical."""
    code = user_project(tmp_path)
    import sys

    sys.path.insert(0, str(code))
    import netlib

    torch.manual_seed(1)
    pre = netlib.build(num_classes=4, in_channels=3)
    torch.save(pre.state_dict(), tmp_path / "pre.pt")
    sys.path.remove(str(code))
    sys.modules.pop("netlib")  # this worker process runs other test files after this one
    cfg = tiny_config(tmp_path, model={"name": "netlib:build", "code_dir": str(code),
                                       "kwargs": {"width": 8},
                                       "weights": str(tmp_path / "pre.pt")},
                      stages=[{"name": "probe", "epochs": 1, "batch_size": 32, "lr": 0.1,
                               "freeze": ["backbone"]},
                              {"name": "all", "epochs": 1, "batch_size": 32, "lr": 0.05,
                               "init_from": "previous", "freeze": []}])
    p = prepared(tmp_path, cfg)
    proc = ddpflow("launch", "--config", p, "--stage", "probe", check=True)
    assert "2 re-initialised (head.weight, head.bias)" in proc.stderr, proc.stderr[-2000:]
    s = read(stage_dir(tmp_path, "probe") / "summary.json")
    assert s["world_size"] == 2 and s["weights_in_sync"]
    assert len(set(s["rank_weight_sha256"])) == 1
    assert s["init"]["reinitialised"] == ["head.weight", "head.bias"]
    assert s["init"]["loaded"] == 2 and s["init"]["frozen"] == 2
    assert s["trainable_params"] == 10 * 128 + 10  # the new head alone
    probe = torch.load(stage_dir(tmp_path, "probe") / "final.pt", weights_only=True)["model"]
    for name, t in pre.state_dict().items():
        if name.startswith("backbone"):
            assert torch.equal(probe[name], t), f"{name} trained although frozen"
    assert probe["head.weight"].shape == (10, 128)

    ddpflow("launch", "--config", p, "--stage", "all", check=True)
    final = torch.load(stage_dir(tmp_path, "all") / "final.pt", weights_only=True)["model"]
    assert not torch.equal(final["backbone.0.weight"], probe["backbone.0.weight"])
    assert read(stage_dir(tmp_path, "all") / "summary.json")["weights_in_sync"]


@pytest.mark.slow
def test_torchvision_default_weights_come_from_the_hub_cache_only(tmp_path):
    """model.weights: DEFAULT reads the published file from the local torch hub cache; not
    there, one error names the file and the folder. A 1000-class head meets 10 classes."""
    import torchvision

    home = tmp_path / "torchhome"
    cfg = tiny_config(tmp_path, model={"name": "resnet18", "weights": "DEFAULT"},
                      hardware={"nproc_per_node": 1},
                      stages=[{"name": "ft", "max_steps": 2, "batch_size": 8, "lr": 0.01}])
    p = prepared(tmp_path, cfg)
    env = {"TORCH_HOME": str(home)}
    proc = ddpflow("launch", "--config", p, "--stage", "ft", env=env)
    w = torchvision.models.ResNet18_Weights.DEFAULT
    file = Path(w.url).name
    assert proc.returncode == 2 and file in proc.stderr and "Traceback" not in proc.stderr
    assert str(home / "hub" / "checkpoints") in proc.stderr
    assert not stage_dir(tmp_path, "ft").joinpath("summary.json").exists()

    (home / "hub" / "checkpoints").mkdir(parents=True)
    torch.manual_seed(0)  # a stand-in for the published file: same names, 1000 classes
    torch.save(torchvision.models.resnet18(num_classes=1000).state_dict(),
               home / "hub" / "checkpoints" / file)
    proc = ddpflow("launch", "--config", p, "--stage", "ft", env=env, check=True)
    assert "2 re-initialised (fc.weight, fc.bias)" in proc.stderr
    s = read(stage_dir(tmp_path, "ft") / "summary.json")
    assert s["init"]["from"].endswith(file) and s["init"]["loaded"] == 120
    assert s["record"]["init_sha256"] is not None


def dataset_config(root: Path, code: Path, **extra) -> dict:
    return tiny_config(
        root, deterministic=True, log_every_steps=4,
        data={"source": "python", "factory": "userdata:make", "kwargs": {"n": 512},
              "code_dir": str(code), "num_workers": 2},
        model={"name": "userdata:Model", "code_dir": str(code), "kwargs": {"hidden": 32}},
        task={"name": "userdata:Task", "monitor": "val_worst", "mode": "max"},
        checkpoint={"every_steps": 0},
        stages=[{"name": "fit", "epochs": 3, "batch_size": 16, "lr": 0.05,
                 "optimizer": "adamw", "weight_decay": 0.0}], **extra)


@pytest.mark.slow
def test_user_dataset_and_task_train_resume_exactly_and_choose_best(tmp_path):
    """A user dataset (dict inputs, non-image) through DataLoader workers on 2 ranks; a
    stop mid-epoch resumes bit-identically; the task's metrics reach metrics.jsonl,
    summary.json and the collected table; best.pt follows task.monitor and its mode."""
    code = user_project(tmp_path)
    runs = {}
    for name in ("straight", "resumed"):
        root = tmp_path / name
        root.mkdir()
        runs[name] = prepared(root, dataset_config(root, code))
    ddpflow("launch", "--config", runs["straight"], "--stage", "fit", check=True)
    # 16 steps per epoch: stop inside the second epoch, between log lines
    proc = ddpflow("launch", "--config", runs["resumed"], "--stage", "fit",
                   "--halt-after-steps", "21")
    assert proc.returncode == 75, proc.stderr[-2000:]
    proc = ddpflow("launch", "--config", runs["resumed"], "--stage", "fit", check=True)
    assert "resumed from ckpt-000000021.pt" in proc.stderr
    a, b = (torch.load(stage_dir(tmp_path / n, "fit") / "final.pt", weights_only=True)["model"]
            for n in ("straight", "resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    lines = [read_lines(stage_dir(tmp_path / n, "fit") / "metrics.jsonl")
             for n in ("straight", "resumed")]
    keys = ("kind", "step", "loss", "val_loss", "val_mae", "val_worst")
    assert [{k: r.get(k) for k in keys} for r in lines[0]] == \
        [{k: r.get(k) for k in keys} for r in lines[1]]

    root = tmp_path / "straight"
    s = read(stage_dir(root, "fit") / "summary.json")
    val = [r for r in lines[0] if r["kind"] == "val"]
    assert len(val) == 3 and s["loader"] == "dataloader" and s["weights_in_sync"]
    assert set(s["final_metrics"]) == {"val_loss", "val_mae", "val_worst"}
    assert s["final_metrics"]["val_mae"] == val[-1]["val_mae"]
    top = max(val, key=lambda r: r["val_worst"])  # mode max: the largest, not the last
    assert s["monitor"] == "val_worst" and s["best_value"] == top["val_worst"]
    assert s["best_step"] == top["step"]
    best = torch.load(stage_dir(root, "fit") / "best.pt", weights_only=True)
    assert best["step"] == top["step"] and best["monitor"] == "val_worst"

    ddpflow("collect", "--config", runs["straight"], check=True)
    rows = list(csv.DictReader(open(root / "results/t/summary/summary.csv")))
    assert float(rows[0]["final_val_mae"]) == pytest.approx(val[-1]["val_mae"])
    assert "val_worst" in (root / "results/t/summary/headline.txt").read_text()


def read_lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_weights_files_of_every_kind_read_the_same(tmp_path):
    """.pt, .safetensors, a DDP-wrapped save ('module.' names) and a ddpflow final.pt give
    the same state dict; shapes that differ are re-initialised, not loaded."""
    from safetensors.torch import save_file

    from ddpflow.engine.weights import load_pretrained, read_state_dict

    torch.manual_seed(0)
    src = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    sd = src.state_dict()
    torch.save(sd, tmp_path / "a.pt")
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "a.safetensors"))
    torch.save({f"module.{k}": v for k, v in sd.items()}, tmp_path / "ddp.pth")
    torch.save({"model": sd, "step": 3}, tmp_path / "final.pt")
    for name in ("a.pt", "a.safetensors", "ddp.pth", "final.pt"):
        got = read_state_dict(tmp_path / name, "model.weights")
        assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd), name
    dst = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 5))
    fresh = dst[1].weight.detach().clone()
    report = load_pretrained(dst, sd, "model.weights")
    assert report == {"loaded": 2, "skipped": 2, "reinitialised": ["1.weight", "1.bias"]}
    assert torch.equal(dst[0].weight, sd["0.weight"]) and torch.equal(dst[1].weight, fresh)
    (tmp_path / "bad.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(Exception, match="cannot be read as safetensors"):
        read_state_dict(tmp_path / "bad.safetensors", "model.weights")


def test_builtin_tasks_score_what_they_say():
    from types import SimpleNamespace

    from ddpflow.seams.tasks import Classification, Regression, build_task, monitor

    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0], [1.0, 0.0, 2.0]])
    y = torch.tensor([0, 2, 1])
    m = Classification().metrics(logits, (None, y))
    assert m["acc"][0].item() == 1 and m["acc"][1].item() == 3
    assert m["top5"][0].item() == 3  # 3 classes: top-5 is every class
    ce = torch.nn.functional.cross_entropy(logits, y, reduction="sum")
    assert torch.isclose(m["loss"][0], ce)
    out, target = torch.tensor([[1.0], [3.0]]), torch.tensor([[0.0], [1.0]])
    r = Regression().metrics(out, (None, target))
    assert r["mse"][0].item() == 5 and r["mae"][0].item() == 3 and r["mae"][1].item() == 2
    assert Regression().loss(out, (None, target)).item() == 2.5
    cfg = SimpleNamespace(task=SimpleNamespace(name="regression", kwargs={}, monitor=None,
                                               mode="auto"))
    assert monitor(cfg, build_task(cfg, SimpleNamespace(label_smoothing=0.0), None)) == \
        ("val_loss", "min")
    cfg.task.name, cfg.task.monitor = "classification", "val_top5"
    assert monitor(cfg, build_task(cfg, SimpleNamespace(label_smoothing=0.1), 3)) == \
        ("val_top5", "max")


MISTAKES = [
    ({"model": {"name": "nosuch_module:build"}}, "model.name: module 'nosuch_module' was not"),
    ({"model": {"name": "netlib:missing"}}, "'netlib' has no attribute 'missing'"),
    ({"model": {"name": "netlib:not_a_module"}}, "returned dict, not a torch.nn.Module"),
    ({"model": {"name": "netlib:raises"}}, "ValueError: width must be even at netlib.py:"),
    ({"model": {"name": "timm:resnet18"}}, "pip install 'ddpflow[timm]'"),
    ({"model": {"name": "netlib:build", "freeze": ["bakbone"]}},
     "model.freeze: no parameter name starts with 'bakbone'"),
    ({"model": {"name": "netlib:build", "freeze": ["backbone", "head"]}},
     "freezes every parameter"),
    ({"model": {"name": "netlib:build", "weights": "LIST"}}, "holds a list of 3 items, not a"),
    ({"model": {"name": "netlib:build", "weights": "OTHER"}},
     "does not fit model.name beyond its final layer (2 tensors; the model has 4, the file "
     "1): 'backbone.0.weight' (8, 3, 3, 3) is not in the file"),
    ({"task": {"name": "userdata:three"}}, "returned int, which has no loss(outputs, batch)"),
    ({"task": {"name": "userdata:number"}},
     "task.name: calling number failed (TypeError: number() missing 1 required"),
    ({"task": {"name": "fit"}}, "task.name 'fit' is not one of classification, regression"),
]


def test_user_mistakes_are_one_message_before_any_rank(tmp_path, capsys):
    """Import paths, builders and weights are checked in preflight: exit 2, one message
    naming the setting, no traceback, no rank started, nothing written. (`ddpflow launch`
    in this process: cli.main is what the command runs.)"""
    from ddpflow.cli import main

    code = user_project(tmp_path)
    torch.save([1, 2, 3], tmp_path / "list.pt")
    torch.save({"conv.weight": torch.zeros(3)}, tmp_path / "other.pt")
    base = tiny_config(tmp_path, stages=[{"name": "s", "max_steps": 1, "batch_size": 8}])
    p = prepared(tmp_path, base)
    for change, expected in MISTAKES:
        cfg = json.loads(json.dumps(base))
        for key, value in change.items():
            cfg[key] = {**cfg.get(key, {}), **value}
        cfg.setdefault("model", {})["code_dir"] = str(code)
        weights = cfg["model"].get("weights")
        if weights in ("LIST", "OTHER"):
            cfg["model"]["weights"] = str(tmp_path / f"{weights.lower()}.pt")
        write_config(tmp_path, cfg)
        rc = main(["launch", "--config", str(p), "--stage", "s"])
        err = capsys.readouterr().err
        assert rc == 2 and expected in err, (change, err[-1500:])
        assert not stage_dir(tmp_path, "s").joinpath("command.json").exists()  # no torchrun


def test_user_dataset_mistakes_stop_prepare(tmp_path):
    code = user_project(tmp_path)
    cases = [("userdata:number", "returned int for split 'train', not a map-style Dataset"),
             ("userdata:strings", "item 0 of the 'train' dataset holds str, not tensors"),
             ("userdata:nothing", "'userdata' has no attribute 'nothing'")]
    for factory, expected in cases:
        cfg = tiny_config(tmp_path, data={"source": "python", "factory": factory,
                                          "code_dir": str(code)})
        p = write_config(tmp_path, cfg)
        proc = ddpflow("prepare", "--config", p)
        assert proc.returncode == 2 and expected in proc.stderr, (factory, proc.stderr)
        assert "Traceback" not in proc.stderr
        assert not (tmp_path / "results/t/data/meta.json").exists()


@pytest.mark.slow
def test_a_loss_that_is_not_a_scalar_stops_the_rank_without_restarts(tmp_path):
    code = user_project(tmp_path)
    cfg = dataset_config(tmp_path, code, hardware={"nproc_per_node": 2, "max_restarts": 2})
    cfg["task"] = {"name": "userdata:PerSampleLoss"}
    p = prepared(tmp_path, cfg)
    proc = ddpflow("launch", "--config", p, "--stage", "fit")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "loss(outputs, batch) returned a tensor of shape (16, 1), not a scalar" \
        in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not stage_dir(tmp_path, "fit").joinpath("summary.json").exists()

    # one rank's mistake while another lags (busy machine, stuck in a collective): the
    # launcher stops every rank (torchrun starts each in a session of its own), so none
    # outlives it holding the job's output open
    cfg["task"] = {"name": "userdata:SlowRankLoss"}
    write_config(tmp_path, cfg)
    lagged = tmp_path / "lagging-rank-got-through"
    proc = ddpflow("launch", "--config", p, "--stage", "fit", timeout=400,
                   env={"LAG_AFTER": str(stage_dir(tmp_path, "fit") / "error.json"),
                        "LAG_DONE": str(lagged)})
    assert proc.returncode == 2 and "not a scalar" in proc.stderr, proc.stderr[-2000:]
    assert not lagged.exists()  # stopped in its lag, not waited for
    resolved = str(stage_dir(tmp_path, "fit") / "config.json")
    assert not processes_naming(resolved)

    # the built-in regression task on the same data: MSE/MAE, best by val_loss (min)
    cfg["task"] = "regression"
    write_config(tmp_path, cfg)
    ddpflow("launch", "--config", p, "--stage", "fit", check=True)
    s = read(stage_dir(tmp_path, "fit") / "summary.json")
    assert set(s["final_metrics"]) == {"val_loss", "val_mse", "val_mae"}
    assert s["final_metrics"]["val_loss"] == pytest.approx(s["final_metrics"]["val_mse"])
    assert s["monitor"] == "val_loss" and s["monitor_mode"] == "min"
    assert s["best_value"] == min(r["val_loss"] for r in read_lines(
        stage_dir(tmp_path, "fit") / "metrics.jsonl") if r["kind"] == "val")



IMAGES = '''
import torch
from torch.utils.data import Dataset


class Squares(Dataset):
    """8 x 8 RGB float images in [0, 1]: class k is brightness k / 3."""
    classes = ["dark", "dim", "light", "bright"]

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        k = i % 4
        return torch.full((3, 8, 8), k / 3), k


def make(split):
    return Squares(40 if split == "train" else 12)


def ragged(split):
    class Ragged(Squares):
        def __getitem__(self, i):
            return torch.zeros(3, 8, 8 + i % 2), 0
    return Ragged(10)
'''


def test_materialize_copies_a_user_image_dataset_into_the_prepared_format(tmp_path, capsys):
    import numpy as np

    from ddpflow.cli import main

    (tmp_path / "code").mkdir()
    (tmp_path / "code/imagesets.py").write_text(IMAGES)
    cfg = tiny_config(tmp_path, data={"source": "python", "factory": "imagesets:make",
                                      "code_dir": str(tmp_path / "code"), "materialize": True,
                                      "image_size": 8})
    assert main(["prepare", "--config", str(write_config(tmp_path, cfg))]) == 0
    data = tmp_path / "results/t/data"
    meta = read(data / "meta.json")
    assert meta["classes"] == ["dark", "dim", "light", "bright"]
    assert meta["counts"]["train"]["per_class"] == [10, 10, 10, 10]
    x = np.load(data / "train_images.npy")
    y = np.load(data / "train_labels.npy")
    assert x.shape == (40, 8, 8, 3) and x.dtype == np.uint8
    assert (x[y == 3] == 255).all() and (x[y == 0] == 0).all() and (x[y == 1] == 85).all()

    cfg["data"]["factory"] = "imagesets:ragged"
    capsys.readouterr()
    assert main(["prepare", "--config", str(write_config(tmp_path, cfg))]) == 2
    assert "images must be one size" in capsys.readouterr().err
    assert read(data / "meta.json")["settings"]["data.factory"] == "imagesets:make"  # kept


def test_seam_settings_are_checked_by_the_schema():
    from ddpflow.config import from_dict
    from ddpflow.core.errors import UserError

    cases = [({"task": {"monitor": "acc"}}, "task.monitor: 'acc' is not a validation metric"),
             ({"data": {"source": "python", "factory": "mydata"}},
              "data.factory: 'mydata' is not an import path"),
             ({"data": {"source": "python"}}, "data.source python needs data.factory"),
             ({"data": {"factory": "a:b"}}, "data.factory is set but data.source is"),
             ({"model": {"freeze": "backbone"}}, "model.freeze: 'backbone' is not of type")]
    for extra, expected in cases:
        with pytest.raises(UserError, match=None) as err:
            from_dict({"stages": [{"name": "s"}], **extra})
        assert expected in str(err.value), (extra, str(err.value))


def test_a_code_dir_that_is_not_a_folder_names_its_setting(tmp_path):
    from ddpflow.config import from_dict
    from ddpflow.core.errors import UserError
    from ddpflow.seams.userimport import add_code_dirs

    cfg = from_dict({"stages": [{"name": "s"}], "data": {"code_dir": str(tmp_path / "nope")}})
    with pytest.raises(UserError, match=r"^data.code_dir: .*nope does not exist"):
        add_code_dirs(cfg)
