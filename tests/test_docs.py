"""The docs' promises are checkable: every test and script they name exists, and every
figure in docs/BENCHMARKS.md and docs/SCALE.md appears in the output that the named command
printed at the named commit (kept verbatim beside the table)."""

from __future__ import annotations

import re
import subprocess

import pytest

from conftest import REPO

DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]


def test_every_named_test_and_script_exists():
    tests: dict[str, set[str]] = {}
    for f in (REPO / "tests").glob("test_*.py"):
        tests[f.name] = set(re.findall(r"^def (test_\w+)", f.read_text(), re.M))
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        for fname, name in re.findall(r"(test_\w+\.py)::(test_\w+)", text):
            if name not in tests.get(fname, set()):
                missing.append(f"{doc.name}: {fname}::{name}")
        for script in re.findall(r"\bbench/[\w./-]+\.(?:py|sh)", text):
            if not (REPO / script).is_file():
                missing.append(f"{doc.name}: {script}")
    assert not missing, missing


def sections(text: str) -> list[str]:
    return re.split(r"^## ", text, flags=re.M)[1:]


@pytest.mark.parametrize("doc", ["BENCHMARKS.md", "SCALE.md"])
def test_every_benchmark_figure_was_printed_at_the_named_commit(doc):
    text = (REPO / "docs" / doc).read_text()
    checked = 0
    for sec in sections(text):
        rows = [line for line in sec.splitlines() if line.startswith("|")
                and not set(line) <= set("|- ")]
        if len(rows) < 2:
            continue
        title = sec.splitlines()[0]
        commit = re.search(r"[Pp]rinted at commit `([0-9a-f]{7,40})`", sec)
        assert commit, f"section '{title}' names no commit its figures were printed at"
        known = subprocess.run(["git", "cat-file", "-e", f"{commit[1]}^{{commit}}"],
                               cwd=REPO, capture_output=True)
        assert known.returncode == 0, f"section '{title}': commit {commit[1]} is not in git"
        outputs = "\n".join(re.findall(r"```text\n(.*?)```", sec, re.S))
        assert outputs, f"section '{title}' keeps no printed output"
        for row in rows[1:]:  # the first row is the header
            for figure in re.findall(r"(?<![\w.])\d+(?:\.\d+)?x?(?![\w.])", row):
                assert figure.rstrip("x") in outputs, (
                    f"section '{title}': {figure} is not in the printed output")
                checked += 1
    assert checked > 0
