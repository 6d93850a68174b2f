"""Config validation: clear messages, non-zero exit, no traceback, nothing written."""

from __future__ import annotations

import filecmp
from pathlib import Path

import pytest

from conftest import REPO, ddpflow, tiny_config, write_config
from ddpflow.config import SCHEMA_PATH, apply_overrides, from_dict, load_config
from ddpflow.errors import UserError


def assert_clean_failure(proc, *needles, results: Path | None = None):
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    for n in needles:
        assert n in proc.stderr, f"{n!r} not in: {proc.stderr}"
    if results is not None:
        assert not results.exists(), f"{results} was written"


def test_schema_is_the_workflow_schema():
    assert filecmp.cmp(SCHEMA_PATH, REPO / "workflow/schemas/config.schema.yaml", shallow=False)


def test_default_config_is_valid_and_filled():
    cfg = load_config(REPO / "config/config.yaml")
    assert cfg.stages[1].init_from == "previous"
    assert cfg.data.augment.crop_padding == 4
    assert cfg.to_dict()["stages"][0]["name"] == "warmup"
    assert len(cfg.hash) == 16


def test_defaults_fill_missing_keys(tmp_path):
    cfg = from_dict({"stages": [{"name": "a"}]})
    assert cfg.run == "default" and cfg.stages[0].precision == "auto"
    assert cfg.hardware.nproc_per_node == "auto" and cfg.data.source == "synthetic"


def test_overrides_are_typed_and_validated():
    d = apply_overrides({"stages": [{"name": "a"}]},
                        ["stages.0.epochs=3", "deterministic=true", "hardware.devices=[0,1]"])
    assert d["stages"][0]["epochs"] == 3 and d["deterministic"] is True
    assert d["hardware"]["devices"] == [0, 1]
    with pytest.raises(UserError, match="stages.0.epochs"):
        from_dict(apply_overrides({"stages": [{"name": "a"}]}, ["stages.0.epochs=-1"]))
    with pytest.raises(UserError, match="not an index"):
        apply_overrides({"stages": [{"name": "a"}]}, ["stages.3.epochs=1"])


def test_stage_hash_ignores_later_stages():
    two = {"stages": [{"name": "a"}, {"name": "b", "lr": 0.5}]}
    other = {"stages": [{"name": "a"}, {"name": "b", "lr": 0.1}]}
    assert from_dict(two).stage_hash("a") == from_dict(other).stage_hash("a")
    assert from_dict(two).stage_hash("b") != from_dict(other).stage_hash("b")


@pytest.mark.parametrize("mutate, needles", [
    (lambda c: c["data"].update(colour="red"), ["unknown key data.colour", "allowed keys"]),
    (lambda c: c.update(bogus=1), ["unknown key bogus"]),
    (lambda c: c["stages"][0].update(batch_size="big"), ["stages.0.batch_size", "integer"]),
    (lambda c: c["stages"][0].update(epochs=-1), ["stages.0.epochs", "minimum"]),
    (lambda c: c["stages"][0].update(precision="fp8"), ["stages.0.precision", "'bf16'"]),
    (lambda c: c["hardware"].update(nproc_per_node=0), ["hardware.nproc_per_node"]),
    (lambda c: c["data"].update(image_size=0), ["data.image_size"]),
    (lambda c: c["stages"][0].update(init_from="previous"), ["first stage has no previous"]),
    (lambda c: c["stages"].append({"name": "s1"}), ["unique", "s1"]),
    (lambda c: c["data"].update(source="cifar10"), ["data.path is required"]),
])
def test_bad_config_fails_cleanly(tmp_path, mutate, needles):
    cfg = tiny_config(tmp_path)
    mutate(cfg)
    proc = ddpflow("launch", "--config", write_config(tmp_path, cfg), "--stage", "s1")
    assert_clean_failure(proc, "invalid config", *needles, results=tmp_path / "results")


def test_malformed_yaml(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("stages:\n  - name: a\n   epochs: [1\n")
    assert_clean_failure(ddpflow("prepare", "--config", p), "not valid YAML", "line",
                         results=tmp_path / "results")


def test_missing_config_file(tmp_path):
    assert_clean_failure(ddpflow("validate", "--config", tmp_path / "nope.yaml"),
                         "config file not found")


def test_bad_override_on_command_line(tmp_path):
    p = write_config(tmp_path, tiny_config(tmp_path))
    proc = ddpflow("prepare", "--config", p, "--set", "stages.0.epochs=-1")
    assert_clean_failure(proc, "stages.0.epochs", results=tmp_path / "results")


def test_missing_and_unknown_stage_name(tmp_path):
    p = write_config(tmp_path, tiny_config(tmp_path))
    assert_clean_failure(ddpflow("launch", "--config", p), "--stage",
                         results=tmp_path / "results")
    assert_clean_failure(ddpflow("launch", "--config", p, "--stage", "nope"),
                         "no stage named 'nope'", "s1", results=tmp_path / "results")


def test_more_gpu_ids_than_exist(tmp_path):
    import torch

    cfg = tiny_config(tmp_path, hardware={"devices": [torch.cuda.device_count() + 3]})
    proc = ddpflow("launch", "--config", write_config(tmp_path, cfg), "--stage", "s1")
    assert_clean_failure(proc, "hardware.devices lists GPU", "visible GPU",
                         results=tmp_path / "results")


def test_launch_without_prepared_data(tmp_path):
    proc = ddpflow("launch", "--config", write_config(tmp_path, tiny_config(tmp_path)),
                   "--stage", "s1")
    assert_clean_failure(proc, "no prepared data", "ddpflow prepare")
    assert not (tmp_path / "results/t/stages").exists()


def test_dry_run_prints_one_torchrun_line(tmp_path):
    proc = ddpflow("launch", "--config", write_config(tmp_path, tiny_config(tmp_path)),
                   "--stage", "s1", "--dry-run", check=True)
    assert proc.stderr.count("torch.distributed.run") == 1
    assert "--nproc-per-node=2" in proc.stderr and "--max-restarts=2" in proc.stderr
    assert "--rdzv-backend=c10d" in proc.stderr and "--rdzv-endpoint=127.0.0.1:" in proc.stderr


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "config").glob("*.yaml")))
def test_shipped_configs_validate(name):
    cfg = load_config(REPO / "config" / name)
    assert cfg.stages


def test_cuda_requested_without_a_gpu(tmp_path):
    cfg = tiny_config(tmp_path, hardware={"device": "cuda"})
    proc = ddpflow("launch", "--config", write_config(tmp_path, cfg), "--stage", "s1",
                   env={"CUDA_VISIBLE_DEVICES": ""})  # no GPU visible, also on a GPU machine
    assert_clean_failure(proc, "hardware.device is 'cuda' but no GPU is visible",
                         results=tmp_path / "results")


def test_collect_without_results_folder(tmp_path):
    proc = ddpflow("collect", "--config", write_config(tmp_path, tiny_config(tmp_path)))
    assert_clean_failure(proc, "no readable results folder", results=tmp_path / "results")
