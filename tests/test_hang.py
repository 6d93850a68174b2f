"""A run that goes wrong on several ranks says who and where (issue 48): the rank that did
not arrive at a collective, its host and every rank's last step, every rank's stack in the
log; the straggler that holds every step back, with its host and the reason. Real torchrun,
2 gloo ranks, a user dataset and model that block or slow one rank on purpose."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import REPO, ddpflow, tiny_config, write_config

pytestmark = pytest.mark.slow

BATCH = 8
# a user dataset: rank 1 blocks in __getitem__ on its call `block_at` (in batch 5: the
# probes of the seam contract read a few items first), in a function of the user's own;
# `slow_rank` sleeps `item_s` per item (a data straggler); Model sleeps `forward_s` per
# forward on `slow_rank` (a compute straggler)
USERCODE = '''
import os
import threading
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset


def stuck_in_user_getitem(mark):
    Path(mark).write_text(repr(time.time()))
    threading.Event().wait()  # never set: blocked in user code


class Items(Dataset):
    def __init__(self, n, seed, block_at, mark, slow_rank, item_s):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.rand(n, 3, 8, 8, generator=g)
        self.y = torch.randint(0, 4, (n,), generator=g)
        self.block_at, self.mark, self.calls = block_at, mark, 0
        self.slow = os.environ.get("RANK") == str(slow_rank)
        self.item_s = item_s
        self.num_classes = 4

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        self.calls += 1
        if self.block_at and os.environ.get("RANK") == "1" and self.calls == self.block_at:
            stuck_in_user_getitem(self.mark)
        if self.slow and self.item_s:
            time.sleep(self.item_s)
        return self.x[i], self.y[i]


def make(split, n=512, block_at=0, mark="", slow_rank=-1, item_s=0.0):
    if split == "test":
        return None
    return Items(n if split == "train" else 64, 0 if split == "train" else 1,
                 block_at if split == "train" else 0, mark, slow_rank, item_s)


class Model(nn.Module):
    def __init__(self, num_classes, in_channels=3, slow_rank=-1, forward_s=0.0):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, num_classes))
        self.sleep = forward_s if os.environ.get("RANK") == str(slow_rank) else 0.0

    def forward(self, x):
        if self.sleep:
            time.sleep(self.sleep)
        return self.net(x)
'''


def user_run(root: Path, data_kwargs: dict, model_kwargs: dict | None = None,
             hardware: dict | None = None, **extra) -> Path:
    code = root / "code"
    code.mkdir(parents=True)
    (code / "usercode.py").write_text(USERCODE)
    cfg = tiny_config(
        root, log_every_steps=2,
        data={"source": "python", "factory": "usercode:make", "kwargs": data_kwargs,
              "code_dir": str(code), "num_workers": 0},
        model={"name": "usercode:Model", "code_dir": str(code), "kwargs": model_kwargs or {}},
        checkpoint={"every_steps": 0},
        hardware={"nproc_per_node": 2, "threads_per_rank": 1, "max_restarts": 0,
                  **(hardware or {})},
        stages=[{"name": "s1", "max_steps": 40, "batch_size": BATCH, "lr": 0.05}], **extra)
    p = write_config(root, cfg)
    ddpflow("prepare", "--config", p, check=True)
    return p


def stage(root: Path) -> Path:
    return root / "results" / "t" / "stages" / "s1"


def test_a_rank_blocked_in_user_code_is_named_with_its_step_and_stack(tmp_path):
    """Rank 1 blocks in the user's __getitem__ for step 5: the job ends non-zero before the
    launcher's own deadline (timeout_s + HANG_MARGIN_S after the hang began, from the run's
    own events), the error line names rank 1, its host and step 4, and rank 1's stack in
    the log shows the user's function."""
    from ddpflow.launch.hangreport import HANG_MARGIN_S

    mark = tmp_path / "blocked_at"
    timeout_s = 10
    p = user_run(tmp_path, {"block_at": 4 * BATCH + 5, "mark": str(mark)},
                 hardware={"timeout_s": timeout_s})
    proc = ddpflow("launch", "--config", p, "--stage", "s1")
    err = proc.stderr
    assert proc.returncode not in (0, 75), err[-3000:]
    line = [x for x in err.splitlines() if x.startswith("ddpflow: error: stage 's1' failed")]
    assert line, err[-3000:]
    host = os.uname().nodename
    assert f"rank 1 (host {host}: alive, stuck where its stack shows) did not arrive" in line[0]
    assert "rank 0 at step 4, rank 1 at step 4" in line[0], line[0]
    assert f"hardware.timeout_s ({timeout_s} s)" in line[0]
    # every rank's stack is in the log; rank 1's shows the user's function
    rank1 = err.split("== stack of rank 1 ")[1].split("== stack of rank")[0]
    assert "stuck_in_user_getitem" in rank1 and "__getitem__" in rank1, rank1[:3000]
    assert "== stack of rank 0 " in err
    report = json.loads((stage(tmp_path) / "hang.json").read_text())
    assert report["missing"] == [1] and report["found_by"] == "monitored_barrier"
    blocked = float(mark.read_text())
    # the collective's own timeout found it (not sooner), and the launcher ended it in time
    assert report["detected_at"] - blocked >= timeout_s - 0.5, report
    assert report["ended_at"] - report["ranks"][1]["step_at"] <= timeout_s + HANG_MARGIN_S
    assert report["ended_at"] - blocked <= timeout_s + HANG_MARGIN_S
