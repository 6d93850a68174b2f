"""Every command in the docs is a test, and every shipped config validates.

The ```bash blocks of README.md, docs/*.md and examples/ (at any indentation: a block in a
list item is read with the fence's indentation taken off its lines), and the indented command
lines in the header comments of the shipped configs, are split into commands (`\\`
continuations joined, trailing `# comments` dropped). Each must be in CHECKS, which says how
it is checked:

  run        runs here, as written or (where the doc writes a placeholder: `<run>`, `[--x]`,
             `IMAGE_OR_FOLDER...`) as the concrete command given, on a tiny config written as
             my.yaml into a scratch copy of the project's layout; its output must show that
             it did its work
  dry-run    what it needs is not here (GPUs, a CIFAR archive, a Slurm cluster, a real
             Apptainer, the network) or it is too slow for this file: its dry run runs here
             instead (`snakemake -n`, `ddpflow launch --dry-run`, `make -n`), and `test`
             names the test that runs it for real where one does; `like` names one that runs
             a like command line instead (`why` says how it differs)
  elsewhere  the test named in `test` runs it for real

A command the table does not know fails test_every_doc_command_has_a_check: a new command in
the docs needs a line here. The commands that run for real share two scratch projects (one
where they train, one where nothing has run, for dry runs) and each runs once.

A `test` must run its command (test_a_named_test_runs_its_command): the command's program (a
script: its file name), subcommand (make: targets) and every long option are words of the
strings that test runs, read with ast: the test function, what it uses of its module
(functions, fixtures, constants; transitively) and of the test modules it imports from,
conftest.py's `ddpflow` helper, and the scripts of tests/ it runs; docstrings and assert
messages are not run.

Every command of the docs, in a block or inline in prose, must name only what exists
(test_every_doc_command_names_what_exists), checked without running it. An inline code span is
a command where its first word is one of PROGRAMS (`ddpflow tune --memory-cap-mb 6`, `make
mutate`, `python bench/startup.py --rounds 3`); a span that is only a flag (`--dry-run`) or a
message (`ddpflow: error: ...`) is not, and a lone program is fine. The doc's placeholders are
filled in (`<x>` and a lone `...`: a dummy value, `[--opt V]`: `--opt V`, `a|b`: `a`; `ddpflow
<command>`: the program alone), and each simple command (split at && || ; |) is checked:

  ddpflow       ddpflow's own argparse parser (ddpflow.cli.build_parser) parses it, with
                nothing required and no abbreviated option
  make          each target is one of the Makefile's, each VAR=value a variable it reads
  python X.py   X.py is in the repository; each --option is in its add_argument calls (ast)
  bash X.sh     X.sh is in the repository; each --option is in its text
  snakemake, torchrun, sbatch, docker, podman (and make's options): each option is in the
                tool's --help (docker, podman: the subcommand's, which must exist), asked once;
                a tool not installed here (podman) is not checked
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import io
import itertools
import os
import re
import shlex
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
    like: str | None = None  # file::test that runs for real a like command, not this one

    def here(self, doc_command: str) -> str | None:
        return None if self.how == "elsewhere" else (self.cmd or doc_command)


def run(*expect: str, cmd: str | None = None, where: str = "real") -> Check:
    return Check("run", cmd, expect, where)


def dry(cmd: str, *expect: str, why: str, test: str | None = None,
        like: str | None = None) -> Check:
    return Check("dry-run", cmd, expect, "dry", test, why, like)


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
        why="the whole workflow, as below; the test runs snakemake, not make", like=FULL_RUN),
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
        r"^sweep_train\s+8$", why="trains 8 trials on 8 GPUs; the test runs a sweep without "
        "--resources (no GPUs here)", like="test_sweep.py::test_sweep_through_the_workflow"),
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
        r"torch\.distributed\.run .*--stage train$", why="a Slurm cluster of 2 GPU nodes; the "
        "test submits `sbatch --nodes=2 ... --wrap 'ddpflow launch ...'` on CPU nodes, without "
        "--gpus-per-node and --cpus-per-gpu",
        like="test_slurm.py::test_two_nodes_stop_at_a_checkpoint_on_usr1"),
    # ---- the shipped configs' header comments
    "ddpflow launch --config config/config.yaml --stage warmup --set stages.0.epochs=1": dry(
        "ddpflow launch --config config/config.yaml --stage warmup --set stages.0.epochs=1 "
        "--dry-run", r"torch\.distributed\.run .*--stage warmup$",
        why="trains config/config.yaml's first stage (8192 images); the test trains that "
        "config through the workflow (snakemake), not with this command line",
        like="test_workflow.py::test_make_run_trains_the_embedded_default"),
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


FENCE = re.compile(r"^([ \t]*)```[ \t]*([\w-]*)[^\n]*\n(.*?)^[ \t]*```[ \t]*$", re.M | re.S)
SHELL = ("bash", "sh", "shell", "console")


def fenced_commands(text: str) -> list[tuple[int, str]]:
    """(line number, command) of each command of the ```bash blocks of markdown text, at any
    indentation (a block in a list item): the fence's indentation is taken off its lines."""
    found = []
    for m in FENCE.finditer(text):
        if m[2] not in SHELL:
            continue
        body = "\n".join(line[len(m[1]):] if line.startswith(m[1]) else line.lstrip()
                         for line in m[3].splitlines())
        first = text.count("\n", 0, m.start(3)) + 1
        found += [(first + n - 1, c) for n, c in commands(body)]
    return found


def inline_commands(text: str) -> list[tuple[int, str]]:
    """(line number, command) of each inline code span of markdown text (outside fenced
    blocks) whose first word is a program of PROGRAMS: `ddpflow tune`, `make mutate`. A span
    that is only a flag (`--dry-run`) or a message (`ddpflow: error: ...`) is not a command."""
    prose = FENCE.sub(lambda m: "\n" * m[0].count("\n"), text)
    found = []
    for m in re.finditer(r"(?<!`)(`+)(?!`)((?:(?!\n[ \t]*\n).)+?)(?<!`)\1(?!`)", prose, re.S):
        span = " ".join(m[2].split())
        if span.split(" ", 1)[0] in PROGRAMS:
            found.append((prose.count("\n", 0, m.start()) + 1, span))
    return found


def doc_commands() -> list[tuple[str, str]]:
    """(where, command) for every command of the docs' blocks and of the configs' headers."""
    found = []
    for doc in DOCS:
        found += [(f"{doc.relative_to(REPO)}:{n}", c) for n, c in fenced_commands(doc.read_text())]
    for cfg in CONFIGS:
        header = itertools.takewhile(lambda s: s.startswith("#"),
                                     (REPO / cfg).read_text().splitlines())
        for n, line in enumerate(header, 1):
            m = re.match(r"#\s{2,}((?:snakemake|ddpflow|python|make|sbatch) .*)", line)
            found += [(f"{cfg}:{n}", c) for _, c in commands(m[1])] if m else []
    return found


def doc_inline_commands() -> list[tuple[str, str]]:
    """(where, command) for every command written inline in the docs' prose."""
    return [(f"{doc.relative_to(REPO)}:{n}", c) for doc in DOCS
            for n, c in inline_commands(doc.read_text())]


def yaml_blocks(doc: str) -> list[dict]:
    text = (REPO / doc).read_text()
    return [yaml.safe_load(b) for b in re.findall(r"^```yaml\n(.*?)^```", text, re.M | re.S)]


def defined_tests() -> dict[str, set[str]]:
    return {f.name: set(re.findall(r"^def (test_\w+)", f.read_text(), re.M))
            for f in (REPO / "tests").glob("test_*.py")}


# ------------------------------------------------------------------ what a command names
DUMMY = "1"  # what a placeholder (`<run>`, a lone `...`) stands for when a command is parsed
SEPARATORS = ("&&", "||", ";", "|")
# the tools whose options are looked up in their own --help (docker, podman: the subcommand's
# --help, which fails for a subcommand they do not have). A tool not installed here is not
# checked: podman (neither this machine nor CI installs it; the docs name it only beside
# docker, whose options are checked)
HELPED = ("snakemake", "torchrun", "sbatch", "docker", "podman", "make")
_HELP: dict[tuple[str, ...], Future] = {}
_HELP_POOL = ThreadPoolExecutor(4)


def simple_commands(cmd: str) -> list[list[str]]:
    """The simple commands of a command line (split at && || ; |) as words, the doc's
    placeholders filled in: `<x>` and a lone `...` are DUMMY, `FOLDER...` is `FOLDER`,
    `[--opt V]` is `--opt V`, `a|b` is `a`. A placeholder where the subcommand goes
    (`ddpflow <command>`) stands for any: only the program is left."""
    cmd = re.sub(r"<[^<>]*>", "<>", cmd).replace("[", "").replace("]", "")
    cmd = re.sub(r"(?<=[^\s|])\|\S+", "", cmd)  # a|b|c -> a (a pipe has blanks around it)
    try:
        words = shlex.split(cmd)
    except ValueError:  # an unbalanced quote: prose, not a command line
        words = cmd.split()
    segs = [[]]
    for w in words:
        segs.append([]) if w in SEPARATORS else segs[-1].append(w)
    return [[DUMMY if w == "..." else w.replace("<>", DUMMY).removesuffix("...")
             for w in (seg[:1] if seg[1:2] == ["<>"] else seg)] for seg in segs if seg]


def long_options(words: list[str]) -> list[str]:
    return [w.split("=")[0] for w in words if re.match(r"--\w", w)]


def said(option: str, text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text) is not None


@functools.cache
def ddpflow_parser() -> argparse.ArgumentParser:
    """ddpflow's own parser (ddpflow.cli.build_parser), where nothing is required (a doc
    names a command's options, not all of them) and no option may be abbreviated."""
    from ddpflow.cli import build_parser

    todo, top = [build_parser()], None
    while todo:
        p = todo.pop()
        top, p.allow_abbrev = top or p, False
        for action in p._actions:
            action.required = False
            if isinstance(action, argparse._SubParsersAction):
                todo += action.choices.values()
    return top


def check_ddpflow(seg: list[str]) -> list[str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            ddpflow_parser().parse_args(seg[1:])
        except SystemExit as e:
            if e.code:
                return [err.getvalue().strip().splitlines()[-1]]
    return []


@functools.cache
def script_options(script: Path) -> frozenset[str]:
    """The options a Python script's argparse takes: the strings of its add_argument calls
    and those of the modules beside it that it imports, read with ast."""
    trees = [ast.parse(script.read_text())]
    for node in ast.walk(trees[0]):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
        trees += [ast.parse((script.parent / f"{n}.py").read_text()) for n in names
                  if (script.parent / f"{n}.py").is_file()]
    return frozenset(a.value for tree in trees for call in ast.walk(tree)
                     if isinstance(call, ast.Call)
                     and getattr(call.func, "attr", None) == "add_argument"
                     for a in call.args if isinstance(a, ast.Constant)
                     and str(a.value).startswith("-"))


def check_script(seg: list[str]) -> list[str]:
    """python SCRIPT.py / bash SCRIPT.sh: the script is in the repository and takes each
    --option (a Python script's argparse; a shell script's text names it)."""
    suffix = ".py" if seg[0].startswith("python") else ".sh"
    if len(seg) < 2 or not seg[1].endswith(suffix):
        return []  # python -m / -c, bash -c: no script of ours
    script = REPO / seg[1]
    if not script.is_file():
        return [f"no {seg[1]} in the repository"]
    takes = (lambda o: o in script_options(script)) if suffix == ".py" else \
        (lambda o: said(o, script.read_text()))
    return [f"{seg[1]} takes no {o}" for o in long_options(seg[2:]) if not takes(o)]


@functools.cache
def makefile() -> tuple[frozenset[str], str]:
    text = (REPO / "Makefile").read_text()
    return frozenset(t for m in re.finditer(r"^([^\s#:=$.][^:=#]*?)\s*::?(?!=)", text, re.M)
                     for t in m[1].split()), text


def check_make(seg: list[str]) -> list[str]:
    """Each target is one of the Makefile's, each VAR=value a variable it reads (its options:
    make's --help)."""
    targets, text = makefile()
    out, words = [], iter(seg[1:])
    for w in words:
        if w in ("-C", "-f", "-j", "-l", "-o", "-W", "-I"):
            next(words, None)  # the option's value
        elif re.match(r"\w+=", w):
            var = w.split("=")[0]
            if not re.search(rf"\$[({{]{var}[)}}]", text):
                out.append(f"the Makefile reads no variable {var}")
        elif not w.startswith("-") and w not in targets:
            out.append(f"the Makefile has no target {w!r}")
    return out


def help_key(seg: list[str]) -> tuple[str, ...] | None:
    """The command whose --help lists seg's options; None: nothing to ask."""
    if seg[0] not in HELPED:
        return None
    options = [w for w in seg[1:] if re.match(r"--\w|-\w$", w)]
    sub = next((w for w in seg[1:] if not w.startswith("-")), None)
    if seg[0] in ("docker", "podman") and sub:
        return (seg[0], sub)
    return (seg[0],) if options else None


def help_of(key: tuple[str, ...]) -> Future:
    """`key --help`, once per key, in the background; its result is None where the tool is not
    installed here."""
    def ask():
        exe = shutil.which(key[0], path=f"{BIN}{os.pathsep}{os.environ['PATH']}")
        return exe and subprocess.run([exe, *key[1:], "--help"], capture_output=True,
                                      text=True, timeout=600)
    if key not in _HELP:
        _HELP[key] = _HELP_POOL.submit(ask)
    return _HELP[key]


def check_tool(seg: list[str]) -> list[str]:
    """Each option (--long, -s) is in the tool's --help. sbatch's --help leaves out some that
    it takes (--test-only): sbatch's own option parser is asked about those, as written."""
    key = help_key(seg)
    proc = key and help_of(key).result()
    if not proc:
        return []
    shown, text = f"`{' '.join(key)} --help`", proc.stdout + proc.stderr
    if proc.returncode != 0 or not said(" ".join(key), text):  # docker: the top help
        return [f"{shown} fails or is not about {' '.join(key)}"]
    out = []
    for w in seg[1:]:
        option = w.split("=")[0]
        if not re.match(r"--\w|-\w$", option) or said(option, text):
            continue
        if seg[0] == "sbatch" and subprocess.run(["sbatch", w, "--usage"],
                                                 capture_output=True, timeout=600).returncode == 0:
            continue
        out.append(f"{option} is not in {shown}")
    return out


CHECKERS = {"ddpflow": [check_ddpflow], "make": [check_make, check_tool],
            "python": [check_script], "python3": [check_script], "bash": [check_script],
            **{tool: [check_tool] for tool in HELPED if tool != "make"}}
PROGRAMS = tuple(CHECKERS)  # an inline code span that starts with one of them is a command


def problems(found: list[tuple[str, str]]) -> list[str]:
    """`where: command: what it names that does not exist` for each such thing named by the
    (where, command) pairs found (the tools' --help are asked for all at once, first)."""
    segs = [(where, cmd, seg) for where, cmd in found for seg in simple_commands(cmd)]
    for *_, seg in segs:
        if help_key(seg):
            help_of(help_key(seg))
    return [f"{where}: {cmd}: {p}" for where, cmd, seg in segs
            for check in CHECKERS.get(seg[0], []) for p in check(seg)]


def _run_strings(node: ast.AST):
    """The string constants (f-strings' too) under node, but for what never runs: docstrings
    and other bare strings, and assert messages."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Expr) and isinstance(child.value, ast.Constant):
            continue
        if isinstance(child, ast.Constant) and isinstance(child.value, str):
            yield child.value
        yield from _run_strings(ast.Assert(child.test) if isinstance(child, ast.Assert)
                                else child)


@functools.cache
def _definitions(module: str) -> dict[str, ast.AST]:
    """A test module's top-level functions (fixtures too), assignments and names imported from
    another test module, by name."""
    found = {}
    for node in ast.parse((REPO / "tests" / f"{module}.py").read_text()).body:
        if isinstance(node, ast.FunctionDef):
            found[node.name] = node
        elif isinstance(node, ast.Assign):
            found |= {t.id: node for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.ImportFrom) and (REPO / "tests" / f"{node.module}.py").is_file():
            found |= {a.asname or a.name: node for a in node.names}
    return found


def _lookup(module: str, name: str) -> tuple[str, ast.AST | None]:
    """(module, definition) of name in a test module (followed to the test module it is
    imported from), else in conftest.py (a fixture)."""
    for _ in range(5):
        node = _definitions(module).get(name)
        if not isinstance(node, ast.ImportFrom):
            return (module, node) if node else ("conftest", _definitions("conftest").get(name))
        module = node.module
    return module, None


def words_run_by(test: str) -> set[str]:
    """The words a test runs: those of the strings of the test function and of what it uses
    of its module (functions, fixtures, constants; transitively; and what it imports from
    another test module: conftest.py's `ddpflow` helper) and of the scripts of tests/ that
    it runs, each word also as its name before `=` and after the last `/`."""
    fname, name = test.split("::")
    module = fname.removesuffix(".py")
    words, seen, todo = set(), {(module, name)}, [_lookup(module, name)]
    while todo:
        module, node = todo.pop()
        for s in _run_strings(node):
            for w in s.split():
                words |= {w, w.split("=")[0], w.rsplit("/")[-1]}
                script = REPO / "tests" / w.rsplit("/")[-1]
                if script.suffix == ".py" and script.is_file() and script.name not in seen:
                    seen.add(script.name)
                    todo.append((script.stem, ast.parse(script.read_text())))
        for sub in ast.walk(node):
            used = sub.id if isinstance(sub, ast.Name) else \
                sub.arg if isinstance(sub, ast.arg) else None
            if used and (module, used) not in seen and _lookup(module, used)[1]:
                seen.add((module, used))
                todo.append(_lookup(module, used))
    return words


def command_words(seg: list[str]) -> list[str]:
    """What a test must spell out to run the simple command seg: its program (a script: its
    file name), its subcommand (ddpflow, docker, podman: the first word that is not an option;
    make: its targets) and its long options."""
    if seg[0].startswith("python") and seg[1:2] and seg[1].endswith(".py"):
        out = [seg[1].rsplit("/")[-1]]
    else:
        out = [seg[0]]
    plain = [w for w in seg[1:] if not w.startswith("-") and "=" not in w]
    if seg[0] in ("ddpflow", "docker", "podman"):
        out += plain[:1]
    elif seg[0] == "make":
        out += plain
    return out + long_options(seg[1:])


def not_run_by(cmd: str, test: str) -> list[str]:
    """The words of cmd's simple commands (those of PROGRAMS) that `test` never runs."""
    said_there = words_run_by(test)
    return [w for seg in simple_commands(cmd) if seg[0] in PROGRAMS
            for w in command_words(seg) if w not in said_there]


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
        for test in filter(None, (check.test, check.like)):
            fname, name = test.split("::")
            assert name in tests.get(fname, set()), f"{cmd}: {test} does not exist"
        if check.here(cmd):
            assert check.expect, f"{cmd}: give the output that shows it worked"


def test_comment_stripping_and_continuations():
    text = 'a --x "b # c" \\\n  d   # note\n# only a comment\n\ne f\'#\' # g\n'
    assert commands(text) == [(1, 'a --x "b # c" d'), (5, "e f'#'")]


def test_every_doc_command_names_what_exists():
    """Every command of the docs, in a block or inline in prose, names only subcommands,
    options, targets and scripts that exist (see problems)."""
    inline = doc_inline_commands()
    assert len(inline) > 40  # the reader finds the inline commands at all
    bad = problems(doc_commands() + inline)
    assert not bad, "commands in the docs that name what does not exist:\n" + "\n".join(bad)


def test_a_named_test_runs_its_command():
    """A `test` of the table runs the command: its program, subcommand and long options are
    words of what the test runs (see words_run_by)."""
    missing = [f"{cmd}: {check.test} never runs {' '.join(lack)}"
               for cmd, check in CHECKS.items() if check.test
               for lack in [not_run_by(cmd, check.test)] if lack]
    assert not missing, "tests in CHECKS that do not run their command:\n" + "\n".join(missing)


PLANTED = """\
1. Train a stage:

   ```bash
   ddpflow launch --config my.yaml \\
     --stage warmup --no-such-flag   # planted
   ```

   ```
   ddpflow launch output, not a command
   ```
2. Cap it with `ddpflow tune --memory-cap-mb 6`, never `ddpflow tune --memory-cap 6`; `make
   no-such-target`, `make run CONFIG=my.yaml`, `make run CONFIGS=my.yaml`; `python
   bench/startup.py --rounds 3`, `python bench/startup.py --no-such-option 3`; `python
   bench/no_such.py`, `bash bench/gpu.sh`, `bash bench/gpu.sh --no-such-option`;
   `snakemake -n --cores 2`, `snakemake --no-such-option`, `sbatch --test-only`, `sbatch
   --no-such-option`; `torchrun --nproc-per-node=<GPUs>`, `torchrun --no-such-option`;
   `docker build`, `docker no-such-command`; `ddpflow <command>`, `ddpflow evaluate --split
   test|val [--weights best|ema]`; `make`, ``ddpflow``. Not commands: `--dry-run`,
   `ddpflow: error: ...`, `makefile`.
"""


def test_the_readers_and_checkers_catch_planted_doc_bugs():
    assert fenced_commands(PLANTED) == [
        (4, "ddpflow launch --config my.yaml --stage warmup --no-such-flag")]
    inline = inline_commands(PLANTED)
    assert [n for n, _ in inline] == [11] * 3 + [12] * 3 + [13] * 2 + [14] * 2 + [15] * 4 \
        + [16] * 2 + [17] * 4 + [18] * 2, inline  # a span's line: its first backtick's
    assert inline[2] == (11, "make no-such-target") and inline[-2:] == [(18, "make"),
                                                                         (18, "ddpflow")]
    found = [(f"md:{n}", cmd) for n, cmd in fenced_commands(PLANTED) + inline]
    assert problems(found) == [
        "md:4: ddpflow launch --config my.yaml --stage warmup --no-such-flag: ddpflow: error: "
        "unrecognized arguments: --no-such-flag",
        "md:11: ddpflow tune --memory-cap 6: ddpflow: error: unrecognized arguments: "
        "--memory-cap 6",
        "md:11: make no-such-target: the Makefile has no target 'no-such-target'",
        "md:12: make run CONFIGS=my.yaml: the Makefile reads no variable CONFIGS",
        "md:13: python bench/startup.py --no-such-option 3: bench/startup.py takes no "
        "--no-such-option",
        "md:13: python bench/no_such.py: no bench/no_such.py in the repository",
        "md:14: bash bench/gpu.sh --no-such-option: bench/gpu.sh takes no --no-such-option",
        "md:15: snakemake --no-such-option: --no-such-option is not in `snakemake --help`",
        "md:15: sbatch --no-such-option: --no-such-option is not in `sbatch --help`",
        "md:16: torchrun --no-such-option: --no-such-option is not in `torchrun --help`",
        "md:17: docker no-such-command: `docker no-such-command --help` fails or is not about "
        "docker no-such-command",
    ]


def test_a_test_runs_a_command_only_where_it_spells_it_out():
    """Docstrings and assert messages are not what a test runs; helpers, fixtures and
    conftest.py's `ddpflow` are."""
    make_run = "test_workflow.py::test_make_run_trains_the_embedded_default"  # runs `make run`
    assert not_run_by("make run", make_run) == []
    assert not_run_by("make run", FULL_RUN) == ["make"]  # ("run": a word of its own config)
    assert not_run_by("snakemake --cores all --no-such-option", FULL_RUN) == ["--no-such-option"]
    tune = CHECKS["ddpflow tune --config my.yaml"].test
    assert not_run_by("ddpflow tune --config my.yaml", tune) == []
    assert not_run_by("ddpflow export --config my.yaml --memory-cap 6", tune) == [
        "export", "--memory-cap"]


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
