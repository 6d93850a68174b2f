"""Containers the Snakemake way: `container.uri` is the `container:` directive of every rule
that runs ddpflow's work, `--sdm apptainer` (profiles/slurm-apptainer) plans to run them in
it, and the apptainer engine builds its .sif from the uri without Docker.

Apptainer cannot be installed on these machines, so a stand-in `apptainer` on PATH answers
`--version` (Snakemake asks before a dry run) and, for the engine test, `build` by writing
the output file; anything else fails. Snakemake itself, the workflow and ddpflow are real.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, ddpflow
from test_workflow import TINY, snakemake, write

pytestmark = pytest.mark.slow
URI = "docker://example.org/ddpflow:1.0"
STUB = """#!/bin/sh
echo "$@" >> "$(dirname "$0")/calls.log"
[ "$1" = --version ] && { echo "apptainer version 1.3.4"; exit 0; }
[ "$1" = build ] && { printf 'SIF' > "$3"; exit 0; }
echo "stand-in apptainer cannot run: $*" >&2; exit 3
"""
# the containers Snakemake resolved for each rule, read through its own API
RULES = """import sys
from pathlib import Path
from snakemake.api import SnakemakeApi
from snakemake.settings.types import ConfigSettings, OutputSettings, ResourceSettings
with SnakemakeApi(OutputSettings()) as api:
    wf = api.workflow(resource_settings=ResourceSettings(cores=2),
                      config_settings=ConfigSettings(configfiles=[Path(sys.argv[2])]),
                      snakefile=Path(sys.argv[1]), workdir=Path.cwd())
    for r in wf._workflow.rules:
        print("RULE", r.name, r.container_img or "-")
"""


@pytest.fixture
def stub_path(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "apptainer").write_text(STUB)
    (bin_dir / "apptainer").chmod(0o755)
    old = os.environ["PATH"]
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{old}"
    yield bin_dir
    os.environ["PATH"] = old


def _containers(wd: Path, config: str = "tiny.yaml") -> dict[str, str]:
    (wd / "rules.py").write_text(RULES)
    proc = subprocess.run([sys.executable, "rules.py", str(REPO / "Snakefile"), config],
                          cwd=wd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {line.split()[1]: line.split()[2] for line in proc.stdout.splitlines()
            if line.startswith("RULE ")}


def test_sdm_apptainer_runs_every_ddpflow_rule_in_the_uri(tmp_path, stub_path):
    wd = tmp_path / "wd"
    wd.mkdir()
    write(wd, {**TINY, "container": {"uri": URI}})
    proc = snakemake(wd, "-n", "--profile", str(REPO / "profiles/slurm-apptainer"),
                     "--verbose")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"Singularity image {URI} will be pulled" in proc.stdout + proc.stderr
    rules = _containers(wd)
    assert {r: rules[r] for r in ("prepare_data", "tune", "train")} == {
        "prepare_data": URI, "tune": URI, "train": URI}
    # the image record and the light collect run where Snakemake runs (no ddpflow image)
    assert rules["image"] == "-" and rules["collect"] == "-"
    lint = snakemake(wd, "--lint")
    assert lint.returncode == 0 and "good condition" in lint.stdout + lint.stderr, lint.stdout

    # a sweep's trials run in it too
    write(wd, {**TINY, "container": {"uri": URI}, "sweep": {"grid": {"seed": [0, 1]}}},
          "sweep.yaml")
    rules = _containers(wd, "sweep.yaml")
    for r in ("sweep_prepare_data", "sweep_tune", "sweep_train"):
        assert rules[r] == URI, rules
    # the docker/podman engines start their own container: no directive there
    write(wd, {**TINY, "container": {"engine": "docker"}}, "docker.yaml")
    assert _containers(wd, "docker.yaml")["train"] == "-"


def test_apptainer_engine_builds_the_sif_from_the_uri_without_docker(tmp_path, stub_path):
    out = tmp_path / "results/t/image.json"
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({**TINY, "results_dir": str(tmp_path / "results"), "run": "t",
                               "container": {"engine": "apptainer", "uri": URI}}))
    # no Docker engine reachable: the build must not need one
    proc = ddpflow("image", "--config", cfg, "--context", REPO, "--out", out,
                   env={"DOCKER_HOST": f"unix://{tmp_path}/no-docker.sock"})
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text())
    sif = tmp_path / "results/t/image.sif"
    assert record["engine"] == "apptainer" and record["source"] == URI
    assert record["sif"] == str(sif) and sif.read_text() == "SIF"
    calls = (stub_path / "calls.log").read_text().splitlines()
    assert calls == [f"build --force {sif}.tmp {URI}"], calls
    assert not Path(f"{sif}.tmp").exists()
    # a .sif that does not exist: one message
    cfg.write_text(json.dumps({**TINY, "results_dir": str(tmp_path / "results"), "run": "t",
                               "container": {"engine": "apptainer",
                                             "uri": str(tmp_path / "no.sif")}}))
    proc = ddpflow("image", "--config", cfg, "--context", REPO, "--out", out)
    assert proc.returncode != 0 and "no.sif does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr
