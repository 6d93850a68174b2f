"""Every command in the docs is a test, and every shipped config validates.

The ```bash blocks of README.md, docs/*.md and examples/, and the indented command lines in
the header comments of the shipped configs, are split into commands (`\\` continuations
joined, trailing `# comments` dropped). Each must be in CHECKS, which says how it is checked:

  run        runs here, as written or (where the doc writes a placeholder: `<run>`, `[--x]`,
             `IMAGE_OR_FOLDER...`) as the concrete command given, on a tiny config written as
             my.yaml into a scratch copy of the project's layout; its output must show that
             it did its work
  dry-run    what it needs is not here (GPUs, a CIFAR archive, a Slurm cluster, a real
             Apptainer, the network) or it is too slow for this file: its dry run runs here
             instead (`snakemake -n`, `ddpflow launch --dry-run`, `make -n`), and `test`
             names the test that runs it for real where one does
  elsewhere  the test named in `test` runs it for real

A command the table does not know fails test_every_doc_command_has_a_check: a new command in
the docs needs a line here. The commands that run for real share two scratch projects (one
where they train, one where nothing has run, for dry runs) and each runs once.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import REPO, tiny_config

BIN = Path(sys.executable).parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
        *sorted((REPO / "examples").glob("**/*.md"))]
CONFIGS = [p.relative_to(REPO).as_posix() for p in
           [*sorted((REPO / "config").glob("*.yaml")),
            *sorted((REPO / "examples").glob("*/config.yaml"))]]
RUN = "doc"  # the tiny config's run name: results/<run>/ is results/doc/
PLACEHOLDER = re.compile(r"<[^>]*>|\[|\.\.\.|\$")


@dataclass(frozen=True)
class Check:
    how: str  # run | dry-run | elsewhere
    cmd: str | None = None  # what runs here; None: the doc's command as written
    expect: tuple[str, ...] = ()  # regexes (multi-line) its output must match
    where: str = "real"  # real: after the real commands before it | dry: nothing has run
    test: str | None = None  # file::test that runs the command for real
    why: str = ""  # why it is not run here as written

    def here(self, doc_command: str) -> str | None:
        return None if self.how == "elsewhere" else (self.cmd or doc_command)


def run(*expect: str, cmd: str | None = None, where: str = "real") -> Check:
    return Check("run", cmd, expect, where)


def dry(cmd: str, *expect: str, why: str, test: str | None = None) -> Check:
    return Check("dry-run", cmd, expect, "dry", test, why)


def elsewhere(test: str, why: str) -> Check:
    return Check("elsewhere", test=test, why=why)


TRAIN2 = r"^train\s+2$"  # my.yaml's two stages in a dry run's job table
FULL_RUN = "test_workflow.py::test_full_run_rerun_and_partial_rerun"
EXAMPLES = "test_workflow.py::test_examples_run_and_a_model_edit_reruns_only_training"
INSTALL = "installs packages from the network (CI's `make test` installs the same way)"
# {venv}: the environment running these tests; {repo}: this repository
CHECKS: dict[str, Check] = {
    # ---- README.md
    "make run": dry("make -n run && snakemake --cores all -n", r"^snakemake --cores all\s*$",
                    TRAIN2, why="trains config/config.yaml (minutes on 2 cores)",
                    test="test_workflow.py::test_make_run_trains_the_embedded_default"),
    "make test": dry("make -n test", r"pytest -n", why="runs this whole suite: what CI runs"),
    "make run CONFIG=my.yaml": dry(
        "make -n run CONFIG=my.yaml && snakemake --cores all --configfile my.yaml -n",
        r"^snakemake --cores all --configfile my\.yaml\s*$", TRAIN2,
        why="the whole workflow, as below", test=FULL_RUN),
    "snakemake --cores all --configfile my.yaml": dry(
        "snakemake --cores all --configfile my.yaml -n", r"^prepare_data\s+1$", TRAIN2,
        r"^evaluate\s+1$", r"^export\s+1$", r"^collect\s+1$",
        why="the whole workflow (a GPU node)", test=FULL_RUN),
    "snakemake --profile profiles/slurm --configfile my.yaml": dry(
        "snakemake --profile profiles/slurm --configfile my.yaml -n", TRAIN2,
        why="submits to a Slurm cluster",
        test="test_slurm.py::test_workflow_on_slurm_with_fake_gpus"),
    "snakemake --profile profiles/slurm-apptainer --configfile my.yaml": dry(
        "snakemake --profile profiles/slurm-apptainer --configfile my.yaml -n", TRAIN2,
        why="Slurm and a real Apptainer (the named test plans it with a stand-in)",
        test="test_apptainer.py::test_sdm_apptainer_runs_every_ddpflow_rule_in_the_uri"),
    "ddpflow validate --config my.yaml": run(rf"^run: {RUN}$", r"^# config hash [0-9a-f]+$"),
    "ddpflow prepare --config my.yaml": run(r"^  train: 256 images", r"MB written"),
    "ddpflow launch --config my.yaml --stage warmup": run(r"stage 'warmup' finished"),
    "ddpflow launch --config my.yaml --stage warmup --set stages.0.lr=0.05 --dry-run": run(
        r"torch\.distributed\.run .*--stage warmup$"),
    "ddpflow launch --config my.yaml --stage train": run(r"stage 'train' finished"),
    "ddpflow collect --config my.yaml": run(rf"results/{RUN}/summary/report\.html",
                                            r"^  warmup .*val_acc", r"^  train .*val_acc"),
    "ddpflow doctor --config my.yaml": run(r"^recommendations:"),
    "ddpflow tune --config my.yaml": elsewhere(
        "test_tune.py::test_tune_shows_each_candidate_ends_within_its_budget_and_stops_when_asked",
        why="a measuring run of its own, up to tune.budget_s"),
    "ddpflow evaluate --config my.yaml [--stage S] [--split test|val] [--images DIR] "
    "[--weights best|final|ema|raw]": run(
        r"warmup best\.pt .* on val: acc [01]\.\d+",
        cmd="ddpflow evaluate --config my.yaml --stage warmup --split val --weights best"),
    "ddpflow export --config my.yaml [--stage S] [--weights best|final|ema|raw] [--out DIR]":
        run(rf"exported stage 'train' \(best.*-> results/{RUN}/export$",
            cmd="ddpflow export --config my.yaml --stage train --weights best"),
    "ddpflow predict --bundle results/<run>/export [--out predictions.csv] [--top-k 5] "
    "IMAGE_OR_FOLDER...": run(
        r"3 image\(s\) predicted", r"^images/im0\.png,class\d,0\.\d+,class\d,",
        cmd=f"ddpflow predict --bundle results/{RUN}/export --out predictions.csv --top-k 5 "
            "images && cat predictions.csv"),
    "snakemake --cores all --configfile sweep.yaml": dry(
        "snakemake --cores all --configfile sweep.yaml -n", r"^sweep_train\s+\d+$",
        why="trains every trial", test="test_sweep.py::test_sweep_through_the_workflow"),
    "ddpflow sweep list --config sweep.yaml": run(
        r"^lr-0\.2_seed-1-[0-9a-f]{6}\tstages\.0\.lr=0\.2, seed=1$", where="dry"),
    "python examples/own_model/make_assets.py": elsewhere(
        EXAMPLES, why="trains its pretrained.pt (seconds, on the way to the example's run)"),
    "snakemake --cores all --configfile examples/own_model/config.yaml": dry(
        "snakemake --cores all --configfile examples/own_model/config.yaml -n", TRAIN2,
        why="needs make_assets.py's images; trains", test=EXAMPLES),
    "snakemake --cores all --configfile examples/tabular/config.yaml": dry(
        "snakemake --cores all --configfile examples/tabular/config.yaml -n", r"^train\s+1$",
        why="trains", test=EXAMPLES),
    # ---- docs/SWEEPS.md
    "snakemake --cores all --configfile config/sweep.yaml": dry(
        "snakemake --cores all --configfile config/sweep.yaml -n", r"^sweep_train\s+8$",
        why="trains 8 trials", test="test_sweep.py::test_sweep_through_the_workflow"),
    "snakemake --cores all --resources gpu=8 --configfile config/sweep.yaml": dry(
        "snakemake --cores all --resources gpu=8 --configfile config/sweep.yaml -n",
        r"^sweep_train\s+8$", why="trains 8 trials on 8 GPUs",
        test="test_sweep.py::test_sweep_through_the_workflow"),
    "snakemake --profile profiles/slurm --configfile config/sweep.yaml": dry(
        "snakemake --profile profiles/slurm --configfile config/sweep.yaml -n",
        r"^sweep_train\s+8$", why="submits to a Slurm cluster",
        test="test_slurm.py::test_sweep_on_slurm_one_job_and_one_gpu_per_trial"),
    "ddpflow sweep list --config config/sweep.yaml": run(
        r"^small_lr-0\.05_seed-0-[0-9a-f]{6}\tmodel\.kwargs\.width=16, ", where="dry"),
    "snakemake --cores all --configfile config/sweep_asha.yaml": dry(
        "snakemake --cores all --configfile config/sweep_asha.yaml -n",
        r"^sweep_schedule\s+1$", why="trains 9 trials (one scheduler job runs them)",
        test="test_sweep_asha.py::test_failing_nan_and_metricless_trials_are_pruned_and_named"),
    "snakemake --profile profiles/slurm --configfile config/sweep_asha.yaml": dry(
        "snakemake --profile profiles/slurm --configfile config/sweep_asha.yaml -n",
        r"^sweep_schedule\s+1$", why="submits to a Slurm cluster",
        test="test_slurm.py::test_asha_sweep_on_slurm_one_job_per_rung"),
    "ddpflow sweep schedule --config config/sweep_asha.yaml": elsewhere(
        "test_sweep_asha.py::test_asha_pauses_resumes_exactly_and_survives_sigterm_in_a_promotion",
        why="trains 9 trials"),
    "ddpflow sweep list --config config/sweep_asha.yaml": run(
        r"^lr-0\.02_weight_decay-0\.0-[0-9a-f]{6}\tstages\.0\.lr=0\.02, "
        r"stages\.0\.weight_decay=0\.0$", where="dry"),
    # ---- docs/gpu-node.md
    "git clone <this repository> ddpflow && cd ddpflow": run(
        r"^cifar10_resnet18_8gpu\.yaml$",
        cmd="git clone -q --depth 1 file://{repo} ddpflow && cd ddpflow && ls config",
        where="dry"),
    "make install": dry("make -n -B install", r"pip install -q -e '\.\[test\]'", why=INSTALL),
    ". .venv/bin/activate": run(r"/bin/ddpflow$", cmd=". {venv}/bin/activate && "
                                "command -v ddpflow", where="dry"),
    "ddpflow validate --config config/cifar10_resnet18_8gpu.yaml": run(
        r"^run: cifar10-resnet18$", where="dry"),
    "snakemake --cores all --configfile config/cifar10_resnet18_8gpu.yaml": dry(
        "snakemake --cores all --configfile config/cifar10_resnet18_8gpu.yaml -n", TRAIN2,
        why="8 GPUs (hardware.device: cuda), Docker and the CIFAR-10 archive"),
    # ---- docs/slurm.md
    "make install && . .venv/bin/activate": dry(
        "make -n -B install && . {venv}/bin/activate && command -v ddpflow",
        r"pip install -q -e", r"/bin/ddpflow$", why=INSTALL),
    "snakemake --profile profiles/slurm --configfile my.yaml -n": run(TRAIN2, where="dry"),
    'sbatch --nodes=2 --gpus-per-node=8 --cpus-per-gpu=8 --signal=USR1@180 --wrap '
    '"$PWD/.venv/bin/ddpflow launch --config my.yaml --stage train"': dry(
        "ddpflow launch --config my.yaml --stage train --dry-run",
        r"torch\.distributed\.run .*--stage train$", why="a Slurm cluster of 2 GPU nodes",
        test="test_slurm.py::test_two_nodes_stop_at_a_checkpoint_on_usr1"),
    # ---- the shipped configs' header comments
    "ddpflow launch --config config/config.yaml --stage warmup --set stages.0.epochs=1": dry(
        "ddpflow launch --config config/config.yaml --stage warmup --set stages.0.epochs=1 "
        "--dry-run", r"torch\.distributed\.run .*--stage warmup$",
        why="trains config/config.yaml's first stage (8192 images)",
        test="test_workflow.py::test_make_run_trains_the_embedded_default"),
    "snakemake --cores all --configfile config/imagefolder_resnet50.yaml": dry(
        "snakemake --cores all --configfile config/imagefolder_resnet50.yaml -n",
        r"^train\s+1$", why="GPUs and an ImageNet-style folder"),
}


# ------------------------------------------------------------------ reading the docs
def strip_comment(line: str) -> str:
    """The line without a trailing `# comment` (a # outside quotes, after a space)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def commands(text: str) -> list[tuple[int, str]]:
    """(line number, command) of each command of shell text: continuations joined,
    comments dropped, runs of blanks made one."""
    out, pending, start = [], "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        if not pending:
            start = n
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        line, pending = " ".join(strip_comment(pending + raw).split()), ""
        if line:
            out.append((start, line))
    return out


def doc_commands() -> list[tuple[str, str]]:
    """(where, command) for every command of the docs and of the configs' headers."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"^```(?:bash|sh|shell|console)[ \t]*\n(.*?)^```", text,
                             re.M | re.S):
            first = text.count("\n", 0, m.start(1)) + 1
            found += [(f"{doc.relative_to(REPO)}:{first + n - 1}", c)
                      for n, c in commands(m[1])]
    for cfg in CONFIGS:
        header = itertools.takewhile(lambda s: s.startswith("#"),
                                     (REPO / cfg).read_text().splitlines())
        for n, line in enumerate(header, 1):
            m = re.match(r"#\s{2,}((?:snakemake|ddpflow|python|make|sbatch) .*)", line)
            found += [(f"{cfg}:{n}", c) for _, c in commands(m[1])] if m else []
    return found


def yaml_blocks(doc: str) -> list[dict]:
    text = (REPO / doc).read_text()
    return [yaml.safe_load(b) for b in re.findall(r"^```yaml\n(.*?)^```", text, re.M | re.S)]


def defined_tests() -> dict[str, set[str]]:
    return {f.name: set(re.findall(r"^def (test_\w+)", f.read_text(), re.M))
            for f in (REPO / "tests").glob("test_*.py")}


# ------------------------------------------------------------------ scratch projects
class Project:
    """A scratch folder laid out like the repository (its workflow, configs and profiles
    linked, examples copied), with my.yaml and sweep.yaml. Each command runs once, one at a
    time, in the order asked (`submit` asks ahead, `sh` waits for the result)."""

    LINKED = ("Snakefile", "workflow", "config", "profiles", "Makefile", "Dockerfile",
              "pyproject.toml", "src")

    def __init__(self, root: Path):
        self.root, self.done = root, {}
        self.pool = ThreadPoolExecutor(1)
        root.mkdir()
        for name in self.LINKED:
            if (REPO / name).exists():
                (root / name).symlink_to(REPO / name)
        shutil.copytree(REPO / "examples", root / "examples",
                        ignore=shutil.ignore_patterns("data", "pretrained.pt", "__pycache__"))
        cfg = tiny_config(root, run=RUN, log_every_steps=4,
                          data={"train_size": 256, "val_size": 64, "test_size": 64},
                          hardware={"nproc_per_node": 1, "threads_per_rank": 1},
                          checkpoint={"every_steps": 0},
                          stages=[{"name": "warmup", "epochs": 1, "batch_size": 32, "lr": 0.05},
                                  {"name": "train", "epochs": 1, "batch_size": 32, "lr": 0.02,
                                   "init_from": "previous"}])
        cfg["results_dir"] = "results"  # relative, as a user writes it
        (root / "my.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        # README's sweep.yaml: my.yaml with the README's `sweep:` section
        sweep = next(b["sweep"] for b in yaml_blocks("README.md")
                     if isinstance(b, dict) and "sweep" in b)
        (root / "sweep.yaml").write_text(yaml.safe_dump({**cfg, "run": "sw", "sweep": sweep},
                                                        sort_keys=False))
        from PIL import Image

        (root / "images").mkdir()
        for i in range(3):
            pixels = np.random.default_rng(i).integers(0, 256, (16, 16, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / "images" / f"im{i}.png")

    def _run(self, cmd: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
        return subprocess.run(["bash", "-c", cmd], cwd=self.root, env=env,
                              capture_output=True, text=True, timeout=600)

    def submit(self, cmd: str) -> Future:
        cmd = cmd.replace("{venv}", sys.prefix).replace("{repo}", str(REPO))
        if cmd not in self.done:
            self.done[cmd] = self.pool.submit(self._run, cmd)
        return self.done[cmd]

    def sh(self, cmd: str) -> subprocess.CompletedProcess:
        return self.submit(cmd).result()


def config_commands(cfg: str) -> list[str]:
    return [f"ddpflow validate --config {cfg}", f"snakemake --cores all --configfile {cfg} -n"]


@pytest.fixture(scope="module")
def projects(tmp_path_factory, request):
    """The two scratch projects. The dry runs of the selected tests start at once, one at a
    time beside the real commands (which mostly wait for process start-up)."""
    base = tmp_path_factory.mktemp("doc_commands")
    real, dry = Project(base / "real"), Project(base / "dry")
    for item in request.session.items:
        params = getattr(item, "callspec", None) and item.callspec.params or {}
        if item.module is not request.module:
            continue
        if "cmd" in params and CHECKS[params["cmd"]].where == "dry":
            dry.submit(CHECKS[params["cmd"]].here(params["cmd"]))
        if item.originalname == "test_shipped_config_validates_and_builds_a_dag":
            for cmd in config_commands(params["cfg"]):
                dry.submit(cmd)
    yield {"real": real, "dry": dry}
    for project in (real, dry):
        project.pool.shutdown(cancel_futures=True)


def shown(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}"


# ------------------------------------------------------------------ the tests
def test_every_doc_command_has_a_check():
    found = doc_commands()
    assert len(found) > 30  # the reader finds the commands at all
    unknown = [f"{where}: {cmd}" for where, cmd in found if cmd not in CHECKS]
    assert not unknown, "commands in the docs without a check in CHECKS:\n" + "\n".join(unknown)
    stale = set(CHECKS) - {cmd for _, cmd in found}
    assert not stale, f"CHECKS entries that no doc has any more: {sorted(stale)}"


def test_the_table_is_sound():
    tests = defined_tests()
    for cmd, check in CHECKS.items():
        assert check.how in ("run", "dry-run", "elsewhere") and check.where in ("real", "dry")
        if PLACEHOLDER.search(cmd):  # never run as written
            assert check.cmd or check.how == "elsewhere", cmd
        if check.how != "run":
            assert check.why, f"{cmd}: say why it does not run here"
        if check.how == "elsewhere":
            assert check.test, cmd
        if check.test:
            fname, name = check.test.split("::")
            assert name in tests.get(fname, set()), f"{cmd}: {check.test} does not exist"
        if check.here(cmd):
            assert check.expect, f"{cmd}: give the output that shows it worked"


def test_comment_stripping_and_continuations():
    text = 'a --x "b # c" \\\n  d   # note\n# only a comment\n\ne f\'#\' # g\n'
    assert commands(text) == [(1, 'a --x "b # c" d'), (5, "e f'#'")]


REAL = [cmd for cmd, check in CHECKS.items() if check.here(cmd) and check.where == "real"]


HERE = [cmd for cmd, check in CHECKS.items() if check.here(cmd)]


@pytest.mark.slow
@pytest.mark.parametrize("cmd", HERE, ids=[cmd[:60] for cmd in HERE])
def test_doc_command(cmd, projects):
    check = CHECKS[cmd]
    project = projects[check.where]
    if check.where == "real":  # the commands before it, in order, once
        for earlier in REAL[:REAL.index(cmd)]:
            proc = project.sh(CHECKS[earlier].here(earlier))
            if proc.returncode != 0:
                pytest.fail(f"`{earlier}`, run before it, failed: {shown(proc)}")
    proc = project.sh(check.here(cmd))
    assert proc.returncode == 0, shown(proc)
    out = proc.stdout + proc.stderr
    for pattern in check.expect:
        assert re.search(pattern, out, re.M), f"{pattern!r} not in the output; {shown(proc)}"


def _planned_trains(cfg: dict) -> tuple[str, int]:
    """The training job and its count that a dry run of cfg plans."""
    sweep = cfg.get("sweep") or {}
    if not (sweep.get("grid") or sweep.get("variants") or sweep.get("random")):
        return "train", len(cfg["stages"])
    if sweep.get("scheduler", "none") != "none" or sweep.get("search", "none") != "none":
        return "sweep_schedule", 1  # one job runs every trial (sweeps/scheduler.py)
    drawn = sweep["random"]["samples"] if sweep.get("random") else \
        len(list(itertools.product(*sweep.get("grid", {}).values())))
    trials = drawn * max(1, len(sweep.get("variants", [])))
    return "sweep_train", trials * len(cfg["stages"])


@pytest.mark.slow
@pytest.mark.parametrize("cfg", CONFIGS)
def test_shipped_config_validates_and_builds_a_dag(cfg, projects):
    """`ddpflow validate` accepts it and Snakemake plans its jobs (a dry run: no GPU, no
    dataset; config/cifar10_resnet18_8gpu.yaml's archive is only read when it runs)."""
    data = yaml.safe_load((REPO / cfg).read_text())
    validate, plan = config_commands(cfg)
    proc = projects["dry"].sh(validate)
    assert proc.returncode == 0, shown(proc)
    assert re.search(rf"^run: {re.escape(data.get('run', 'default'))}$", proc.stdout, re.M)
    proc = projects["dry"].sh(plan)
    assert proc.returncode == 0, shown(proc)
    job, n = _planned_trains(data)
    assert re.search(rf"^{job}\s+{n}$", proc.stdout + proc.stderr, re.M), shown(proc)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_config_header_says_where_left_out_keys_come_from(cfg):
    """A --configfile is never merged with config/config.yaml: left-out keys take the
    schema's defaults, and the header says so."""
    header = "\n".join(itertools.takewhile(lambda s: s.startswith("#"),
                                           (REPO / cfg).read_text().splitlines()))
    assert not re.search(r"config/config\.yaml's values|defaults of config/config\.yaml",
                         header), cfg
    said = re.sub(r"\s*\n#\s*", " ", header)
    assert re.search(r"(?i)keys left out take the (schema's defaults|defaults of "
                     r"workflow/schemas/config\.schema\.yaml)", said), cfg


def test_sweeps_doc_shows_config_sweep_yaml(projects):
    """docs/SWEEPS.md's yaml is config/sweep.yaml's `sweep:` section, and the trial id it
    shows is one that `ddpflow sweep list` prints for that file."""
    shipped = yaml.safe_load((REPO / "config/sweep.yaml").read_text())["sweep"]
    assert yaml_blocks("docs/SWEEPS.md")[0] == {"sweep": shipped}
    asha = yaml.safe_load((REPO / "config/sweep_asha.yaml").read_text())["sweep"]
    assert {"sweep": asha} in yaml_blocks("docs/SWEEPS.md")  # the successive-halving section
    listed = projects["dry"].sh("ddpflow sweep list --config config/sweep.yaml")
    assert listed.returncode == 0, shown(listed)
    ids = {line.split("\t")[0] for line in listed.stdout.splitlines() if "\t" in line}
    named = re.search(r"\*\*Ids\*\* .*?`([\w.-]+-[0-9a-f]{6})`",
                      (REPO / "docs/SWEEPS.md").read_text(), re.S)
    assert named and named[1] in ids, (named and named[1], sorted(ids))
