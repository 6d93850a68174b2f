"""data.sampling on real torchrun runs: balanced and weighted draws resumed exactly mid-epoch,
on the same number of ranks and on another (2 gloo ranks -> 1, 1 -> 2, the global batch
kept), with the device loader and DataLoader workers, repeated augmentation and a policy;
a long-tailed image set trained uniform and balanced; the weights seam's bad results as one
message before any rank starts (DDPFLOW_SAMPLE_TRACE lists what each rank trained)."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from test_fsdp import run, same_weights, seen, stage_dir, summary

from conftest import ddpflow, tiny_config, write_config

WEIGHTS = '''
import numpy as np

def heavy(labels):
    return np.where(labels % 3 == 0, 5.0, 1.0) * (np.arange(len(labels)) % 7 != 0)

def negative(labels):
    return [-1.0] + [1.0] * (len(labels) - 1)

def nan(labels):
    return np.where(np.arange(len(labels)) == 5, np.nan, 1.0)

def zero(labels):
    return np.zeros(len(labels))

def short(labels):
    return [1.0] * (len(labels) - 1)

def text(labels):
    return "uniform"

def raises(labels):
    raise ValueError("no weights file")

def random(labels):
    return np.random.rand(len(labels)) + 0.1
'''

LONG_TAIL = '''
import torch
from torch.utils.data import Dataset

COUNTS = {"train": [400, 100, 20, 4], "val": [10, 10, 10, 10], "test": [10, 10, 10, 10]}


class LongTail(Dataset):
    """8 x 8 RGB images, class k a brightness and a noisy texture; 100:1 in training."""
    classes = ["many", "some", "few", "rare"]

    def __init__(self, counts, seed, absent=()):
        self.y = [k for k, c in enumerate(counts) for _ in range(c) if k not in absent]
        self.seed = seed

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        k = self.y[i]
        g = torch.Generator().manual_seed(self.seed * 100003 + i)
        x = (k / 4 + 0.15 * torch.rand(3, 8, 8, generator=g)).clamp(0, 1)
        return x, k


def make(split):
    return LongTail(COUNTS[split], hash(split) % 1000)


def gap(split):
    return LongTail(COUNTS[split], 1, absent=(2,) if split == "train" else ())
'''


def code_dir(root: Path) -> Path:
    code = root / "code"
    code.mkdir(parents=True, exist_ok=True)
    (code / "w.py").write_text(WEIGHTS)
    (code / "longtail.py").write_text(LONG_TAIL)
    return code


def setup(root: Path, stage: dict, ranks: int, **data) -> Path:
    root.mkdir(parents=True)
    cfg = tiny_config(root, stages=[stage], data={"code_dir": str(code_dir(root)), **data})
    cfg["hardware"]["nproc_per_node"] = ranks
    p = write_config(root, cfg)
    ddpflow("prepare", "--config", p, check=True)
    return p


def requeued(src: Path, dst: Path) -> Path:
    """The halted run's folder copied, as a requeue onto another node would find it."""
    shutil.copytree(src, dst)
    cfg = yaml.safe_load((dst / "config.yaml").read_text())
    cfg["results_dir"] = str(dst / "results")  # (data.code_dir: the same code, where it was)
    (dst / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return dst


STAGE = {"name": "s1", "epochs": 2, "batch_size": 32, "lr": 0.05}
CASES = {  # loader, data settings
    "device-balanced-ra-trivialaugment": dict(
        loader="device", sampling="balanced", repeated_augment=2,
        augment={"policy": "trivialaugment"}),
    "dataloader-weights-without-replacement-randaugment": dict(
        loader="dataloader", num_workers=1, sampling="weights", sample_weights="w:heavy",
        sampling_replacement=False, augment={"policy": "randaugment", "num_ops": 1}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_drawn_epochs_resume_exactly_on_the_same_fewer_and_more_ranks(tmp_path, case):
    """Halted at step 12 of 32 (16 steps an epoch, global batch 64): resumed on 2 ranks it
    is the uninterrupted run bit for bit; requeued onto 1 rank (2 accumulation steps) it
    trains every epoch on the same draws, none lost or repeated, to the same weights. A
    1-rank run halted and resumed on 2 ranks does the same."""
    data = CASES[case]
    ref = tmp_path / "ref"
    setup(ref, STAGE, 2, **data)
    proc = run(ref, trace=ref / "trace")
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = seen(ref / "trace")
    draws = Counter(want[0])
    if data["sampling"] == "balanced":  # with replacement: some samples drawn twice
        assert max(draws.values()) >= 2 and len(want[0]) == 1024
    else:  # weight 0 (every 7th sample) never drawn, each other one once at most
        assert not any(i % 7 == 0 for i in draws) and max(draws.values()) == 1
    halted = tmp_path / "halted"
    setup(halted, STAGE, 2, **data)
    assert run(halted, "--halt-after-steps", "12", trace=halted / "trace").returncode == 75
    fewer = requeued(halted, tmp_path / "fewer")
    proc = run(halted, trace=halted / "trace")
    assert proc.returncode == 0 and "resumed from ckpt-000000012.pt" in proc.stderr
    same_weights(torch.load(stage_dir(ref) / "final.pt", weights_only=True)["model"],
                 torch.load(stage_dir(halted) / "final.pt", weights_only=True)["model"], True)
    assert all(sorted(seen(halted / "trace")[e]) == sorted(want[e]) for e in (0, 1))
    proc = run(fewer, ranks=1, trace=fewer / "trace")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "on 1 rank(s) it stays 64: 32/rank x 1 x 2 accumulation" in proc.stderr
    got = seen(fewer / "trace")
    assert all(sorted(got[e]) == sorted(want[e]) for e in (0, 1))  # as multisets
    same_weights(torch.load(stage_dir(ref) / "final.pt", weights_only=True)["model"],
                 torch.load(stage_dir(fewer) / "final.pt", weights_only=True)["model"], False)
    if data["loader"] != "device":
        return
    more = tmp_path / "more"
    setup(more, {**STAGE, "grad_accum_steps": 2}, 1, **data)
    assert run(more, "--halt-after-steps", "12", trace=more / "trace").returncode == 75
    proc = run(more, ranks=2, trace=more / "trace")
    assert proc.returncode == 0 and "on 2 rank(s) it stays 64" in proc.stderr
    got = seen(more / "trace")
    assert all(sorted(got[e]) == sorted(want[e]) for e in (0, 1))
    same_weights(torch.load(stage_dir(ref) / "final.pt", weights_only=True)["model"],
                 torch.load(stage_dir(more) / "final.pt", weights_only=True)["model"], False)


@pytest.mark.slow
def test_a_long_tailed_set_trains_balanced_and_reports_each_class(tmp_path):
    """100:1 between the largest and the smallest class: uniform sampling draws the classes
    as they are, balanced about equally; both stages report per-class recall and the
    balanced accuracy in summary.json, the headline and the report."""
    classes = {}
    for mode in ("uniform", "balanced"):
        root = tmp_path / mode
        setup(root, {"name": "s1", "epochs": 2, "batch_size": 16, "lr": 0.05}, 1,
              source="python", factory="longtail:make", materialize=True, image_size=8,
              train_size=None, val_size=None, test_size=None, sampling=mode)
        assert run(root, trace=root / "trace").returncode == 0
        labels = np.load(root / "results/t/data/train_labels.npy")
        drawn = np.bincount(labels[seen(root / "trace")[0]], minlength=4)
        classes[mode] = drawn / drawn.sum()
        s = summary(root)
        recall = s["final_metrics"]["val_recall"]
        assert len(recall) == 4 and all(0 <= r <= 1 for r in recall)
        assert s["final_metrics"]["val_balanced_acc"] == pytest.approx(sum(recall) / 4)
        assert len(s["test_recall"]) == 4 and "test_balanced_acc" in s
        assert ddpflow("collect", "--config", root / "config.yaml").returncode == 0
        out = root / "results/t/summary"
        low = min(range(4), key=lambda k: recall[k])
        assert (f"lowest class recall {recall[low]:.4f} ({['many', 'some', 'few', 'rare'][low]})"
                in (out / "headline.txt").read_text())
        assert 'id="recall"' in (out / "report.html").read_text()
        collected = json.loads((out / "summary.json").read_text())["stages"][0]
        assert collected["final_val_balanced_acc"] == s["final_metrics"]["val_balanced_acc"]
    assert classes["uniform"][0] > 0.75 and classes["uniform"][3] < 0.02
    assert all(abs(share - 0.25) < 0.06 for share in classes["balanced"]), classes


@pytest.fixture(scope="module")
def prepared_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("weights") / "run"
    setup(root, STAGE, 2)
    return root


WEIGHT_ROWS = [
    # class, data settings, words of the one message
    ("negative", {"sample_weights": "w:negative"},
     "data.sample_weights w:negative returned weight 0 = -1.0; expected one finite weight "
     ">= 0 per training sample"),
    ("NaN", {"sample_weights": "w:nan"}, "data.sample_weights w:nan returned weight 5 = nan"),
    ("all zero", {"sample_weights": "w:zero"},
     "data.sample_weights w:zero returned all 1024 weights 0"),
    ("wrong length", {"sample_weights": "w:short"},
     "data.sample_weights w:short returned a list of 1023"),
    ("wrong type", {"sample_weights": "w:text"},
     "data.sample_weights w:text returned str 'uniform'; expected 1024 weights"),
    ("it raises", {"sample_weights": "w:raises"},
     "data.sample_weights: calling raises failed (ValueError: no weights file"),
    ("not importable", {"sample_weights": "nowhere:w"}, "data.sample_weights"),
]


@pytest.mark.parametrize("cls,data,words", WEIGHT_ROWS, ids=[r[0] for r in WEIGHT_ROWS])
def test_bad_weights_are_one_message_before_any_rank_starts(prepared_run, cls, data, words):
    cfg = yaml.safe_load((prepared_run / "config.yaml").read_text())
    cfg["data"].update(sampling="weights", **data)
    p = write_config(prepared_run, cfg, f"{cls.replace(' ', '-')}.yaml")
    proc = ddpflow("launch", "--config", p, "--stage", "s1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert words in proc.stderr, proc.stderr[-2000:]
    assert "[s1]" not in proc.stderr  # no rank said a word: none was started
    assert not (prepared_run / "results/t/stages").exists()


@pytest.mark.slow
def test_weights_that_differ_between_ranks_and_a_class_without_samples(tmp_path):
    """A callable that draws at random gives each rank other weights: one message from the
    ranks; balanced sampling over a split that lacks a class: one message before them."""
    root = tmp_path / "random"
    setup(root, STAGE, 2, sampling="weights", sample_weights="w:random")
    proc = run(root)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert ("data.sample_weights w:random returned other weights on rank 1 than on rank 0; "
            "it must give the same weights every time it is called" in proc.stderr)
    gap = tmp_path / "gap"
    setup(gap, STAGE, 1, source="python", factory="longtail:gap", materialize=True,
          image_size=8, train_size=None, val_size=None, test_size=None, sampling="balanced")
    proc = run(gap)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert ("data.sampling balanced: class 2 has no sample in the training split (1 of the 4 "
            "classes have none)" in proc.stderr)
    assert not (gap / "results/t/stages/s1/summary.json").exists()
