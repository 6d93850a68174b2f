"""Config validation: clear messages, non-zero exit, no traceback, nothing written."""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from conftest import REPO, ddpflow, tiny_config, write_config
from ddpflow.config import apply_overrides, from_dict, load_config
from ddpflow.core.errors import UserError


def assert_clean_failure(proc, *needles, results: Path | None = None, code: int = 2):
    """The documented outcome of a user mistake: exit code 2 (UserError), one message."""
    assert proc.returncode == code, (proc.returncode, proc.stdout + proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    for n in needles:
        assert n in proc.stderr, f"{n!r} not in: {proc.stderr}"
    if results is not None:
        assert not results.exists(), f"{results} was written"


def test_the_built_wheel_carries_the_workflow_schema(tmp_path):
    """The packaged schema is a symlink in the source tree: the wheel must hold a real file
    with the workflow schema's bytes, and the package installed from it (outside the source
    tree) must read that file."""
    src = tmp_path / "src-copy"
    shutil.copytree(REPO / "src", src / "src", symlinks=True,
                    ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    shutil.copytree(REPO / "workflow/schemas", src / "workflow/schemas")
    for f in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / f, src / f)
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(wheels), str(src)], check=True,
                   capture_output=True, timeout=300)
    wheel, = wheels.glob("ddpflow-*.whl")
    want = (REPO / "workflow/schemas/config.schema.yaml").read_bytes()
    with zipfile.ZipFile(wheel) as z:
        info = z.getinfo("ddpflow/schema/config.schema.yaml")
        assert (info.external_attr >> 16) & 0o170000 != 0o120000, "a symlink in the wheel"
        assert z.read(info) == want
        z.extractall(tmp_path / "site")
    probe = ("import ddpflow.config as c, sys; print(c.SCHEMA_PATH); "
             "sys.stdout.write(str(c.SCHEMA_PATH.read_bytes() == open(sys.argv[1], 'rb').read()))")
    out = subprocess.run([sys.executable, "-S", "-c", probe,
                          str(REPO / "workflow/schemas/config.schema.yaml")],
                         env={**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}:"
                              + ":".join(p for p in sys.path if "site-packages" in p)},
                         cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    path, same = out.splitlines()
    assert path.startswith(str(tmp_path / "site")) and same == "True", out


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


def test_stage_hash_ignores_how_often_checkpoints_are_saved():
    """Checkpoint cadence and the background writer change when state is saved, not what is
    computed: a preempted stage resumes after they changed. Validation cadence does count."""
    base = tiny_config(Path("/unused"))
    saved = copy.deepcopy(base)
    saved["checkpoint"] = {"every_steps": 0, "every_epochs": 0, "background": False,
                           "keep_last": 1}
    assert from_dict(base).stage_hash("s1") == from_dict(saved).stage_hash("s1")
    val = copy.deepcopy(base)
    val["stages"][0]["validate_every_epochs"] = 2
    assert from_dict(base).stage_hash("s1") != from_dict(val).stage_hash("s1")


@pytest.mark.parametrize("mutate, needles", [
    (lambda c: c["data"].update(colour="red"), ["unknown key data.colour", "allowed keys"]),
    (lambda c: c.update(bogus=1), ["unknown key bogus"]),
    (lambda c: c["stages"][0].update(batch_size="big"), ["stages.0.batch_size", "integer"]),
    (lambda c: c["stages"][0].update(epochs=-1), ["stages.0.epochs", "minimum"]),
    (lambda c: c["stages"][0].update(precision="fp8"), ["stages.0.precision", "'bf16'"]),
    (lambda c: c["stages"][0].update(channels_last="on"),  # YAML's words, not Python's
     ["stages.0.channels_last: 'on' is not one of 'auto', true, false"]),
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


def test_integral_floats_are_taken_as_integers():
    cfg = from_dict({"stages": [{"name": "a", "batch_size": 32.0, "epochs": 2.0}]})
    assert cfg.stages[0].batch_size == 32 and type(cfg.stages[0].batch_size) is int
    assert type(cfg.stages[0].epochs) is int
    with pytest.raises(UserError, match=r"stages.0.batch_size: 32.5 is not"):
        from_dict({"stages": [{"name": "a", "batch_size": 32.5}]})


BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8))


@pytest.mark.parametrize("content, needles", [
    (b"stages:\n  - name: a\n\xff\xfe\n", ["not UTF-8 text", "offset"]),
    (b"stages:\n  - name: a\n    lr: 0.1\n    lr: 0.2\n", ["duplicate key 'lr' at line 4",
                                                           "first at line 3"]),
    (b"stages:\n  - name: a\n    lr: 1e-3\n", ["stages.0.lr", "1.0e-3"]),
    (b"stages:\n  - name: no\n", ["stages.0.name", "quote it"]),
    (b"run: a/b\nstages: [{name: a}]\n", ["run", "not a valid name"]),
    (b"run: my run\nstages: [{name: a}]\n", ["run", "not a valid name"]),
    (b"stages: [{name: " + b"a" * 100 + b"}]\n", ["stages.0.name", "longer than 64"]),
    (BOMB.encode() + b"stages: [{name: a}]\n", ["expands to more than", "aliases"]),
    (b"stages: [{name: a, lr: '" + b"9" * 5000 + b"'}]\n", ["stages.0.lr", "..."]),
])
def test_yaml_pitfalls_are_one_clear_message(tmp_path, content, needles):
    p = tmp_path / "c.yaml"
    p.write_bytes(content)
    proc = ddpflow("validate", "--config", p, timeout=60)
    assert_clean_failure(proc, *needles, results=tmp_path / "results")
    assert len(proc.stderr) < 1500, "a message must not print a whole huge value"


def test_a_directory_as_config(tmp_path):
    assert_clean_failure(ddpflow("validate", "--config", tmp_path), "is a directory")


def test_validate_prints_the_resolved_config(tmp_path):
    p = write_config(tmp_path, tiny_config(tmp_path))
    proc = ddpflow("validate", "--config", p, "--set", "stages.0.lr=0.2", check=True)
    resolved = yaml.safe_load(proc.stdout)
    assert resolved["stages"][0]["lr"] == 0.2 and resolved["data"]["train_size"] == 1024
    assert resolved["checkpoint"]["resume"] == "auto"  # defaults filled in
    assert "# config hash " + from_dict(resolved).hash in proc.stderr


def test_results_dir_that_is_a_file(tmp_path):
    (tmp_path / "results").write_text("not a folder")
    p = write_config(tmp_path, tiny_config(tmp_path))
    assert_clean_failure(ddpflow("prepare", "--config", p), "cannot write",
                         "results_dir")
    assert_clean_failure(ddpflow("collect", "--config", p), "no readable results folder")


def test_rank_command_outside_torchrun(tmp_path):
    assert_clean_failure(ddpflow("train", "--resolved", tmp_path / "nope.json", "--stage", "s1"),
                         "(the resolved config) does not exist")
    p = tmp_path / "r.json"
    p.write_text("{}")
    proc = ddpflow("train", "--resolved", p, "--stage", "s1",
                   env={"RANK": "0", "WORLD_SIZE": "2"})
    assert_clean_failure(proc, "not started by torchrun")


def test_gpu_counts_and_ids_on_a_gpu_node(tmp_path, monkeypatch):
    """The GPU arithmetic of a node, with the visible GPU count patched (no GPU here)."""
    from ddpflow.launch import launcher as launch

    monkeypatch.setattr(launch, "visible_gpus", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")  # an outer selection
    cfg = from_dict(tiny_config(tmp_path, hardware={"nproc_per_node": 8}))
    with pytest.raises(UserError, match="nproc_per_node is 8 but only 4 GPU"):
        launch.resolve_ranks(cfg)
    n, device, env = launch.resolve_ranks(from_dict(tiny_config(
        tmp_path, hardware={"nproc_per_node": "auto", "threads_per_rank": "auto"})))
    assert (n, device) == (4, "cuda") and "CUDA_VISIBLE_DEVICES" not in env
    n, _, env = launch.resolve_ranks(from_dict(tiny_config(
        tmp_path, hardware={"nproc_per_node": "auto", "devices": [1, 3]})))
    assert n == 2 and env["CUDA_VISIBLE_DEVICES"] == "5,7"  # ids index the visible GPUs
    monkeypatch.setattr(launch, "visible_gpus", lambda: 0)
    n, device, _ = launch.resolve_ranks(from_dict(tiny_config(
        tmp_path, hardware={"nproc_per_node": "auto"})))
    assert (n, device) == (1, "cpu")
    dp = from_dict(tiny_config(tmp_path, stages=[{"name": "s1", "strategy": "dp"}]))
    assert launch.stage_ranks(dp, "s1")[0] == 1  # DataParallel: one process


def test_lr_scaling_rules():
    from ddpflow.engine.runtime import lr_factor

    assert lr_factor("sqrt", 64, 256) == pytest.approx(0.5)
    assert lr_factor("linear", 512, 256) == 2.0 and lr_factor("none", 512, 256) == 1.0


def test_the_library_never_imports_snakemake():
    """workflow -> CLI -> library: no module under src/ddpflow imports snakemake."""
    import ast

    for f in (REPO / "src/ddpflow").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] == "snakemake" for n in names), f


def test_json_configs_read_as_json(tmp_path):
    """The workflow hands ddpflow a JSON config: 1e-05 there is a number (YAML 1.1 would
    read it as text)."""
    p = tmp_path / "c.json"
    p.write_text('{"stages": [{"name": "a", "lr": 1e-05, "weight_decay": 5E-4}]}')
    cfg = load_config(p)
    assert cfg.stages[0].lr == 1e-05 and cfg.stages[0].weight_decay == 5e-4
    p.write_text('{"stages": [')
    assert_clean_failure(ddpflow("validate", "--config", p), "not valid JSON")


def _schema_keys(node: dict, path: str = ""):
    """(dotted key, its schema) of every key of the schema's sections, stages as stages.0."""
    from ddpflow.config.types import is_section

    target = node.get("items") if node.get("type") == "array" else node
    if not isinstance(target, dict) or not is_section(target):
        return
    for key, sub in target["properties"].items():
        dotted = f"{path}.{key}" if path else key
        dotted = dotted + ".0" if sub.get("type") == "array" and is_section(
            sub.get("items") or {}) else dotted
        if not is_section(sub) and "[" not in dotted and not dotted.endswith(".0"):
            yield dotted, sub  # a setting (a section is a heading: its keys are checked)
        yield from _schema_keys(sub, dotted)


# config/config.yaml's values that are not the schema's default, and why
RECIPE = "the default run's recipe: a stage (or data size) that trains in minutes on a CPU"
NOT_DEFAULT = {"stages.0.name": "a stage's name has no default", "stages.0.lr": RECIPE,
               "stages.0.epochs": RECIPE, "stages.0.nesterov": RECIPE,
               "stages.0.lr_scaling": RECIPE, "stages.0.warmup_epochs": RECIPE,
               "data.train_size": RECIPE, "data.val_size": RECIPE}


def test_the_commented_config_is_the_schema():
    """The keys are written twice: the schema (their one typed source: config/types.py is
    derived from it) and config/config.yaml, commented key by key for users. This holds the
    two together: every schema key is in the commented file with a comment on its line, at
    the schema's default (or a named exception), and the file holds no other key."""
    from ddpflow.config.types import schema

    text = (REPO / "config" / "config.yaml").read_text()
    shipped = yaml.safe_load(text)
    lines = text.splitlines()
    problems = []
    for dotted, sub in _schema_keys(schema()):
        node = shipped
        for part in dotted.split("."):
            if isinstance(node, list) and not node:  # sweep.variants: [] (no item to look at)
                node = None
                break
            node = node[int(part)] if isinstance(node, list) else (node or {}).get(part, KeyError)
            if node is KeyError:
                break
        if node is None and ".0" in dotted:
            continue
        if node is KeyError:
            problems.append(f"{dotted}: in the schema, not in config/config.yaml")
            continue
        last = dotted.split(".")[-1] if not dotted.endswith(".0") else dotted.split(".")[-2]
        commented = [ln for ln in lines if re.match(rf"\s*(- )?{last}:", ln) and "#" in ln]
        if not commented:
            problems.append(f"{dotted}: no comment on its line in config/config.yaml")
        if "default" in sub and node != sub["default"] and dotted not in NOT_DEFAULT:
            problems.append(f"{dotted}: {node!r} in config/config.yaml, {sub['default']!r} "
                            f"in the schema")
    assert not problems, "\n".join(problems)
