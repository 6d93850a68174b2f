"""The engine for real: torchrun with 2 gloo ranks on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import ddpflow, tiny_config, write_config

pytestmark = pytest.mark.slow


def prepare(tmp_path, cfg) -> Path:
    p = write_config(tmp_path, cfg)
    ddpflow("prepare", "--config", p, check=True)
    return p


def stage_dir(tmp_path, stage, run="t") -> Path:
    return tmp_path / "results" / run / "stages" / stage


def summary(tmp_path, stage, run="t") -> dict:
    return json.loads((stage_dir(tmp_path, stage, run) / "summary.json").read_text())


def records(tmp_path, stage, run="t") -> list[dict]:
    lines = (stage_dir(tmp_path, stage, run) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


def weights(path: Path) -> dict:
    return torch.load(path, weights_only=True)["model"]


def test_two_ranks_train_in_sync_on_disjoint_halves(tmp_path):
    cfg = tiny_config(tmp_path, stages=[{"name": "s1", "epochs": 3, "batch_size": 32,
                                         "lr": 0.1, "precision": "auto"}])
    p = prepare(tmp_path, cfg)
    trace = tmp_path / "trace"
    trace.mkdir()
    ddpflow("launch", "--config", p, "--stage", "s1", check=True,
            env={"DDPFLOW_SAMPLE_TRACE": str(trace)})
    s = summary(tmp_path, "s1")
    from ddpflow.engine.settings import cpu_has_fast_bf16

    assert s["world_size"] == 2 and s["backend"] == "gloo"
    assert s["precision"] == ("bf16" if cpu_has_fast_bf16() else "fp32")  # precision: auto
    assert s["global_batch"] == 64 and s["steps"] == 3 * (512 // 32)
    # the weights of both ranks, hashed on each rank at the end, are identical
    assert len(s["rank_weight_sha256"]) == 2 and s["weights_in_sync"] is True
    # each rank saw a disjoint half of every epoch
    seen = {}
    for rank in (0, 1):
        for line in (trace / f"rank{rank}.txt").read_text().splitlines():
            epoch, _step, *idx = map(int, line.split())
            seen.setdefault((epoch, rank), []).extend(idx)
    for epoch in range(3):
        a, b = seen[(epoch, 0)], seen[(epoch, 1)]
        assert len(a) == len(b) == 512 and len(set(a)) == 512
        assert not set(a) & set(b)
        assert set(a) | set(b) == set(range(1024))
    assert seen[(0, 0)] != seen[(1, 0)], "epochs must be reshuffled (set_epoch)"
    # learns the synthetic set (10 classes: chance is 0.1; 3 epochs reach 0.86-0.92 over seeds)
    assert s["final_val_acc"] >= 0.8, s["final_val_acc"]
    recs = records(tmp_path, "s1")
    train = [r for r in recs if r["kind"] == "train"]
    assert train and all(len(r["samples_per_s_per_rank"]) == 2 for r in train)
    assert all(0 <= r["data_wait_fraction"] <= 1 for r in train)
    assert [r["epoch"] for r in recs if r["kind"] == "val"] == [0, 1, 2]
    assert s["config"]["stages"][0]["lr"] == 0.1 and s["mean_samples_per_s"] > 0
    assert s["wrapper"] == "DistributedDataParallel"
    # efficiency fields: counted FLOPs, compute-only at least the overall rate, real memory
    assert s["flops_per_sample"] > 0 and s["mfu"] is None  # no known peak on a CPU
    for r in train:
        assert r["tflops"] > 0 and r["peak_mem_mib"] > 10
        assert r["compute_samples_per_s"] >= r["samples_per_s"] > 0
    ck = torch.load(stage_dir(tmp_path, "s1") / "final.pt", weights_only=True)
    assert ck["config"]["run"] == "t"


def test_two_stages_chain(tmp_path):
    cfg = tiny_config(tmp_path, stages=[
        {"name": "s1", "epochs": 1, "batch_size": 32, "lr": 0.1, "channels_last": "auto"},
        # a step with a negligible lr and no decay/momentum: weights stay where s1 left them
        {"name": "s2", "max_steps": 1, "batch_size": 32, "lr": 1e-12, "weight_decay": 0,
         "momentum": 0, "init_from": "previous", "channels_last": "auto"}])
    p = prepare(tmp_path, cfg)
    proc = ddpflow("launch", "--config", p, "--stage", "s2")
    assert proc.returncode != 0 and "has not finished" in proc.stderr
    ddpflow("launch", "--config", p, "--stage", "s1", check=True)
    proc = ddpflow("launch", "--config", p, "--stage", "s2", check=True)
    assert "initialised from" in proc.stderr
    w1 = weights(stage_dir(tmp_path, "s1") / "final.pt")
    w2 = weights(stage_dir(tmp_path, "s2") / "final.pt")
    params = [k for k in w1 if "running" not in k and "num_batches" not in k]
    for k in params:
        torch.testing.assert_close(w1[k], w2[k], rtol=0, atol=1e-9)
    assert summary(tmp_path, "s2")["final_val_acc"] > 0.5  # far above chance (0.1)
    # channels_last: auto on a CPU: one probe, kept in the run folder; s2 took its answer
    s1, s2 = summary(tmp_path, "s1"), summary(tmp_path, "s2")
    layouts = json.loads((tmp_path / "results/t/layout.json").read_text())
    assert len(layouts) == 1 and s1["layout_reason"].startswith("auto: a probe on this CPU")
    (kept,) = layouts.values()
    assert s1["channels_last"] == (kept["nchw_s"] / kept["channels_last_s"] >= 1.05)
    assert (s2["channels_last"], s2["layout_reason"]) == (s1["channels_last"],
                                                          s1["layout_reason"])


def test_exact_resume_is_bit_identical(tmp_path):
    # with the recipe on: erasing, mixup, cutmix and the EMA of the weights resume exactly too
    stage = {"name": "s1", "max_steps": 24, "batch_size": 32, "lr": 0.05, "warmup_epochs": 0.5,
             "random_erasing": 0.25, "mixup_alpha": 0.2, "cutmix_alpha": 1.0,
             "ema": {"decay": 0.9, "every_steps": 2}, "channels_last": "auto"}
    base = dict(deterministic=True, stages=[stage], checkpoint={"every_steps": 0})
    straight = tmp_path / "straight"
    resumed = tmp_path / "resumed"
    for d in (straight, resumed):
        d.mkdir()
        prepare(d, tiny_config(d, **base))
    ddpflow("launch", "--config", straight / "config.yaml", "--stage", "s1", check=True)
    # stop mid-epoch (16 steps per epoch) and mid-log-interval (4), then resume
    proc = ddpflow("launch", "--config", resumed / "config.yaml", "--stage", "s1",
                   "--halt-after-steps", "10")
    assert proc.returncode == 75 and "run the same command again" in proc.stderr
    assert not (stage_dir(resumed, "s1") / "final.pt").exists()
    proc = ddpflow("launch", "--config", resumed / "config.yaml", "--stage", "s1", check=True)
    assert "resumed from ckpt-000000010.pt" in proc.stderr
    fa = torch.load(stage_dir(straight, "s1") / "final.pt", weights_only=True)
    fb = torch.load(stage_dir(resumed, "s1") / "final.pt", weights_only=True)
    assert fa["weights"] == fb["weights"] == "ema"  # the average is handed on
    for part in ("model", "model_raw"):
        a, b = fa[part], fb[part]
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (part, k)
    ra, rb = records(straight, "s1"), records(resumed, "s1")
    key = ("kind", "step", "epoch", "loss", "lr", "val_loss", "val_acc", "val_raw_acc")
    assert all("val_raw_acc" in r for r in ra if r["kind"] == "val")
    assert [{k: r.get(k) for k in key} for r in ra] == [{k: r.get(k) for k in key} for r in rb]
    assert summary(straight, "s1")["final_val_acc"] == summary(resumed, "s1")["final_val_acc"]
    # deterministic mode: channels_last: auto is decided without a timing probe
    assert summary(resumed, "s1")["layout_reason"] == \
        "auto: 2-D convolutions (deterministic mode: no timing probe)"
    assert summary(resumed, "s1")["channels_last"] is True


def test_fp16_overflow_skips_the_steps_and_leaves_the_weights(tmp_path, monkeypatch):
    """A huge initial loss scale: every fp16 step overflows, the scaler skips it, the count
    is recorded, and the parameters stay exactly the starting weights (in-process, 1 rank)."""
    import functools

    from ddpflow.config import load_config
    from ddpflow.engine import train
    from ddpflow.seams.models import build_model

    init = tmp_path / "init.pt"
    torch.manual_seed(3)
    model = build_model("smallcnn", 10, 3)
    torch.save(model.state_dict(), init)
    cfg = tiny_config(tmp_path, log_every_steps=1, hardware={"nproc_per_node": 1}, stages=[
        {"name": "s1", "max_steps": 5, "batch_size": 32, "lr": 0.1, "precision": "fp16",
         "init_from": str(init)}])
    p = prepare(tmp_path, cfg)
    monkeypatch.setattr(torch.amp, "GradScaler",
                        functools.partial(torch.amp.GradScaler, init_scale=2.0 ** 120))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert train.train_stage(load_config(p), "s1") == 0
    s = summary(tmp_path, "s1")
    assert s["precision"] == "fp16" and s["skipped_steps"] == 5
    train_recs = [r for r in records(tmp_path, "s1") if r["kind"] == "train"]
    assert [r["skipped_steps"] for r in train_recs] == [1, 2, 3, 4, 5]
    assert [r["grad_scale"] for r in train_recs] == [2.0 ** (120 - k) for k in range(1, 6)]
    final = weights(stage_dir(tmp_path, "s1") / "final.pt")
    for name, param in model.named_parameters():
        assert torch.equal(final[name], param.detach()), name


def test_grad_accumulation_on_two_ranks_equals_the_larger_batch(tmp_path):
    """2 ranks x 16 x 2 accumulation (DDP's no_sync on the first micro-batch) against
    2 ranks x 32: the same samples, the same update. mlp has no batch statistics."""
    finals = {}
    for batch, accum in ((16, 2), (32, 1)):
        d = tmp_path / f"b{batch}"
        d.mkdir()
        cfg = tiny_config(d, deterministic=True, model={"name": "mlp"},
                          data={"augment": {"crop_padding": 0, "flip": False}},
                          stages=[{"name": "s1", "max_steps": 4, "batch_size": batch,
                                   "grad_accum_steps": accum, "lr": 0.05,
                                   "precision": "fp32"}])
        ddpflow("launch", "--config", prepare(d, cfg), "--stage", "s1", check=True)
        s = summary(d, "s1")
        assert s["global_batch"] == 64 and s["world_size"] == 2 and s["weights_in_sync"]
        finals[accum] = weights(stage_dir(d, "s1") / "final.pt")
    for k in finals[1]:
        torch.testing.assert_close(finals[2][k], finals[1][k], rtol=1e-5, atol=1e-6)


def test_fp16_gradscaler_and_grad_accumulation_on_one_rank(tmp_path):
    cfg = tiny_config(tmp_path, hardware={"nproc_per_node": 1}, stages=[
        {"name": "s1", "max_steps": 8, "batch_size": 32, "lr": 0.05, "precision": "fp16",
         "grad_accum_steps": 2, "lr_scaling": "linear", "lr_reference_batch": 32}])
    p = prepare(tmp_path, cfg)
    ddpflow("launch", "--config", p, "--stage", "s1", check=True)
    s = summary(tmp_path, "s1")
    assert s["precision"] == "fp16" and s["global_batch"] == 64 and s["world_size"] == 1
    assert s["lr_effective"] == pytest.approx(0.1)
    train = [r for r in records(tmp_path, "s1") if r["kind"] == "train"]
    assert all(r["grad_scale"] and r["grad_scale"] > 0 for r in train)


def test_dataparallel_baseline_and_fp32(tmp_path):
    cfg = tiny_config(tmp_path, stages=[
        {"name": "s1", "max_steps": 4, "batch_size": 32, "strategy": "dp", "precision": "fp32",
         "channels_last": True}])
    p = prepare(tmp_path, cfg)
    proc = ddpflow("launch", "--config", p, "--stage", "s1", check=True)
    assert "--nproc-per-node=1" in proc.stderr  # one process, whatever nproc_per_node says
    s = summary(tmp_path, "s1")
    assert s["strategy"] == "dp" and s["world_size"] == 1 and s["precision"] == "fp32"
    # the model is wrapped in DataParallel (without GPUs it calls the module directly;
    # scattering over several GPUs needs a GPU node: bench/gpu.sh)
    assert s["wrapper"] == "DataParallel" and s["backend"] is None


@pytest.mark.parametrize("forced, want", [("1", "bf16"), ("0", "fp32")])
def test_precision_auto_on_a_cpu_follows_the_bf16_override(monkeypatch, forced, want):
    """DDPFLOW_CPU_BF16 runs the suite as on the other kind of CPU (native bf16 or not)."""
    import torch

    from ddpflow.engine.settings import pick_precision

    monkeypatch.setenv("DDPFLOW_CPU_BF16", forced)
    assert pick_precision("auto", torch.device("cpu")) == want
    assert pick_precision("fp32", torch.device("cpu")) == "fp32"  # an explicit choice stays
