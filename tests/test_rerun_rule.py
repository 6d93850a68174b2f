"""The rerun rule (config/rerun.py) and the checksum check (core/checksum.py) as functions:
what a hash depends on and what it does not, and what each refusal says."""

from __future__ import annotations

import argparse
import hashlib

import pytest

from ddpflow.config.rerun import config_hash, prepare_settings, stage_hash
from ddpflow.core.checksum import sha256_of, verify


def test_a_config_hash_does_not_depend_on_the_order_of_its_keys():
    """A YAML file with its keys in another order is the same config: nothing reruns."""
    a = {"seed": 1, "data": {"source": "synthetic", "image_size": 32}}
    b = {"data": {"image_size": 32, "source": "synthetic"}, "seed": 1}
    assert config_hash(a) == config_hash(b)
    assert config_hash(a) != config_hash({**a, "seed": 2})


def _data(source: str) -> dict:
    from ddpflow.config.rerun import PREPARE_KEYS

    return {"seed": 0, "data": {**{k: None for k in PREPARE_KEYS}, "source": source,
                                "image_size": 32, "factory": "m:make"}}


def test_the_prepared_data_depends_on_its_settings_and_the_factory_only_for_python():
    synthetic = prepare_settings(_data("synthetic"))
    assert synthetic["data.image_size"] == 32 and synthetic["seed"] == 0
    assert "data.factory" not in synthetic  # a factory a synthetic set never calls
    python = prepare_settings(_data("python"))
    assert python["data.factory"] == "m:make" and python["data.image_size"] == 32


def test_a_stage_hash_of_a_stage_the_config_lacks_is_a_key_error():
    d = {"stages": [{"name": "a", "lr": 0.1}]}
    assert stage_hash(d, "a") == stage_hash({"stages": [{"name": "a", "lr": 0.1}]}, "a")
    with pytest.raises(KeyError):
        stage_hash(d, "b")


def test_verify_says_why_a_file_is_not_to_be_trusted(tmp_path):
    f = tmp_path / "ckpt.pt"
    f.write_bytes(b"weights" * 1000)
    assert verify(f) == "no checksum file (the write did not finish)"
    (tmp_path / "ckpt.pt.sha256").write_text(f"{sha256_of(f)}  ckpt.pt\n")
    assert verify(f) is None
    assert sha256_of(f) == hashlib.sha256(b"weights" * 1000).hexdigest()
    (tmp_path / "ckpt.pt.sha256").write_text("")  # cut short
    assert verify(f) == "checksum mismatch (truncated or corrupt)"
    (tmp_path / "ckpt.pt.sha256").write_text(f"{sha256_of(f)}  ckpt.pt\n")
    f.unlink()
    f.mkdir()  # a folder in the file's place
    assert verify(f) == "cannot be read (Is a directory)"


def test_the_inputs_a_config_names_are_named_by_their_key(tmp_path):
    """`--log` is compared with every file the config names; the message names the key,
    list items by their index (stages.0.init_from)."""
    from ddpflow.config.inputs import command_inputs

    init = tmp_path / "init.pt"
    init.write_bytes(b"w")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"stages:\n  - name: a\n    init_from: {init}\n")
    found = command_inputs(argparse.Namespace(config=str(cfg), log="x.log"))
    assert found == {"the --config": str(cfg), "the file stages.0.init_from names": str(init)}


def test_a_resume_key_leaves_out_where_the_stage_runs_and_a_stage_hash_does_not():
    """Resuming on 4 GPUs what ran on 2 (or with activation checkpointing turned on) is the
    same training (placement=False, the resume key), but a result made elsewhere is not the
    same output (placement=True, the rerun rule)."""
    def cfg(nproc: int, ac: bool) -> dict:
        return {"seed": 0, "run": {"name": "x"},
                "hardware": {"nproc_per_node": nproc, "devices": "auto", "rdzv_port": 1},
                "stages": [{"name": "a", "epochs": 1, "activation_checkpointing": ac},
                           {"name": "b", "epochs": 2, "activation_checkpointing": ac}]}
    base = cfg(2, False)
    for moved in (cfg(4, False), cfg(2, True)):
        for stage in ("a", "b"):
            assert stage_hash(moved, stage, placement=False) == stage_hash(base, stage, False)
            assert stage_hash(moved, stage) != stage_hash(base, stage)
    # what the stage computes is never left out, and the dict given is not changed
    assert stage_hash({**base, "seed": 1}, "a", False) != stage_hash(base, "a", False)
    assert base["hardware"]["nproc_per_node"] == 2 and "run" in base
