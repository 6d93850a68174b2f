"""Fast from the first second, measured honestly: the wall-time split of a real stage adds up
to a stopwatch around the command; validation and checkpoints come as often as asked; the
deferred torch._dynamo import changes nothing but the start-up time."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from conftest import REPO, ddpflow, tiny_config, write_config
from ddpflow.engine import checkpoint


def test_wall_split_adds_up_and_epoch_cadence(tmp_path):
    """3 epochs of 8 steps, validation every 2nd epoch (and the last), a checkpoint every 2nd
    epoch and none between: the split covers the stopwatch within 5%."""
    cfg = tiny_config(tmp_path, checkpoint={"every_steps": 0, "every_epochs": 2},
                      stages=[{"name": "s1", "epochs": 3, "batch_size": 64, "lr": 0.05,
                               "validate_every_epochs": 2}], log_every_steps=4)
    p = write_config(tmp_path, cfg)
    ddpflow("prepare", "--config", p, check=True)
    t0 = time.time()
    # a value left in the environment by some other command must not be taken as this start
    ddpflow("launch", "--config", p, "--stage", "s1", check=True,
            env={"DDPFLOW_LAUNCH_T0": "1000.0"})
    stopwatch = time.time() - t0
    out = tmp_path / "results/t/stages/s1"
    s = json.loads((out / "summary.json").read_text())
    wall = s["wall"]
    split = wall["split_s"]
    assert set(split) == {"startup", "train", "data_wait", "validation", "checkpoint",
                          "teardown"}
    assert all(v >= 0 for v in split.values()), split
    assert split["startup"] > 1.0 and split["train"] > 0 and split["validation"] > 0
    assert abs(sum(split.values()) - wall["total_s"]) < 1e-6
    assert abs(wall["total_s"] - stopwatch) <= 0.05 * stopwatch, (wall, stopwatch)
    assert s["wall_time_s"] == wall["total_s"]
    steps = 3 * (1024 // (64 * 2))
    assert s["steps"] == steps and wall["samples"] == steps * 128
    assert abs(s["wall_samples_per_s"] - wall["samples"] / wall["total_s"]) < 1e-6
    marks = wall["startup_marks_s"]
    assert 0 < marks["rank_process"] < marks["process_group"] < marks["first_step"]
    assert marks["first_step"] >= split["startup"]
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if r["kind"] == "val"] == [1, 2]
    ckpts = checkpoint.list_checkpoints(out / "checkpoints")
    assert [step for step, _ in ckpts] == [2 * steps // 3]  # epoch 2's end, none between
    assert all(checkpoint.verify(path) is None for _, path in ckpts)
    assert (out / "best.pt").is_file() and checkpoint.verify(out / "best.pt") is None


PROBE = r'''
import sys
from ddpflow.core import lazydynamo
assert lazydynamo.defer()
import torch
from torch import nn
net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.LazyLinear(2))
opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, fused=True)
net(torch.randn(2, 3, 8, 8)).sum().backward()
opt.step(); opt.zero_grad(); opt.state_dict()
with torch.device("meta"):
    nn.Linear(4, 4)(torch.empty(2, 4))
print("deferred after training", lazydynamo.deferred())
import torchvision.models  # imports torch._dynamo.utils.is_compile_supported
torchvision.models.resnet18()
print("deferred after torchvision", lazydynamo.deferred())
from torchvision.ops.roi_align import is_compile_supported
print("compile supported on cpu", is_compile_supported("cpu"))  # asks the real one
from torch._dynamo import config
import torch._dynamo.utils as u
print("deferred after use", lazydynamo.deferred(), config.optimize_ddp)
print("one module", u is sys.modules["torch._dynamo.utils"] is torch._dynamo.utils)
print("real disable", torch._dynamo.disable.__module__)
'''


def test_deferred_dynamo_import_trains_and_hands_over():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "deferred after training True" in lines
    assert "deferred after torchvision True" in lines
    assert "compile supported on cpu True" in lines
    assert "deferred after use False True" in lines
    assert "one module True" in lines
    assert "real disable torch._dynamo.decorators" in lines


def _python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_jobs_that_only_read_files_do_not_import_torch(tmp_path):
    """collect, a sweep's leaderboard, the image job and preparing a built-in source only read
    and write files: each would pay `import torch` (4-5 s here) per workflow job."""
    assert _python("import sys\n"
                   "import ddpflow.cli, ddpflow.results.collect, ddpflow.sweeps.leaderboard\n"
                   "import ddpflow.launch.container, ddpflow.results.provenance\n"
                   "import ddpflow.data.prepare, ddpflow.core.reading, ddpflow.core.writing\n"
                   "import ddpflow.core.quoting\n"
                   "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n") == "[]"
    # and for real: preparing the synthetic source stays torch-free
    cfg = write_config(tmp_path, tiny_config(tmp_path))
    assert _python("import sys, runpy\n"
                   f"sys.argv = ['ddpflow', 'prepare', '--config', {str(cfg)!r}]\n"
                   "try:\n    runpy.run_module('ddpflow', run_name='__main__')\n"
                   "except SystemExit as e:\n    assert not e.code, e.code\n"
                   "print('torch' in sys.modules)\n") == "False"
    assert (tmp_path / "results/t/data/meta.json").is_file()
