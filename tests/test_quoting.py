"""Text that reaches an interpreter (core/quoting.py): shell lines, CSV cells, HTML.

Table-driven rows per function; structural checks that every surface goes through it (the
rules' `shell:` lines, the handlers' shell() calls, every CSV writer and HTML escape in the
package); and the real sweep `onerror` handler run by Snakemake with a results_dir holding
a space, `$(...)` and backticks."""

from __future__ import annotations

import ast
import csv
import io
import json
import re
import shlex
import string
import subprocess
import tokenize
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import REPO
from ddpflow.core.quoting import (
    csv_cell,
    csv_text,
    format_literal,
    html_text,
    path_arg,
    shell_line,
    shell_word,
    write_csv,
)

WORKFLOW_FILES = sorted([REPO / "Snakefile", *(REPO / "workflow" / "rules").glob("*.smk")])

# --------------------------------------------------------------------------- shell
SHELL_WORDS = [
    pytest.param("results/run", id="plain"),
    pytest.param("my results/run 1", id="spaces"),
    pytest.param("it's \"quoted\"", id="quotes"),
    pytest.param("$(touch PWNED)", id="command-substitution"),
    pytest.param("`touch PWNED`", id="backticks"),
    pytest.param("a; touch PWNED #", id="separator-and-comment"),
    pytest.param("a\ntouch PWNED", id="newline"),
    pytest.param("-rf", id="leading-dash"),
    pytest.param("résultats/日本/ø", id="non-ascii"),
    pytest.param("", id="empty"),
    pytest.param("$HOME ~ * ?[a] {a,b} !!", id="expansions"),
]


@pytest.mark.parametrize("word", SHELL_WORDS)
def test_shell_word_is_one_word_that_a_real_shell_reads_back(word, tmp_path):
    """The word and the line reach a real bash as exactly these arguments, nothing runs."""
    assert shlex.split(shell_word(word)) == [word]
    words = [word, "second", word]
    out = subprocess.run(["bash", "-c", "printf '%s\\0' " + shell_line(words)],
                         cwd=tmp_path, capture_output=True, check=True)
    assert out.stdout.decode().split("\0")[:-1] == words
    assert not list(tmp_path.iterdir()), "a quoted word ran as a command"


def test_shell_word_takes_paths_and_format_literal_survives_str_format():
    assert shell_word(Path("a b/c")) == "'a b/c'"
    assert [path_arg(p) for p in ("-res/x", Path("-r"), "res", "/-abs", "./-x")] == \
        ["./-res/x", "./-r", "res", "/-abs", "./-x"]
    line = shell_line(["echo", "{WCFG}", "{0}", "}{"])
    assert format_literal(line).format() == line  # what Snakemake's shell() does to it


def test_launch_prints_a_torchrun_line_a_shell_runs_as_planned(tmp_path):
    """`ddpflow launch --dry-run` with a relative results_dir that starts with `-` and holds
    a space and `$(...)`: the printed line is the argv word for word, the resolved config
    is `./-...` (never read as an option), and nothing ran."""
    from conftest import ddpflow, tiny_config, write_config

    odd = "-my res $(touch PWNED)"
    cfg = write_config(tmp_path, tiny_config(tmp_path, results_dir=odd))
    proc = ddpflow("launch", "--config", cfg, "--stage", "s1", "--dry-run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    [line] = [ln.removeprefix("ddpflow: ") for ln in proc.stderr.splitlines()
              if "torch.distributed.run" in ln]
    words = shlex.split(line)
    resolved = words[words.index("--resolved") + 1]
    assert resolved.startswith(f"./{odd}/") and resolved.endswith("/stages/s1/config.json")
    out = subprocess.run(["bash", "-c", "printf '%s\\0' " + line], cwd=tmp_path,
                         capture_output=True, check=True)
    assert out.stdout.decode().split("\0")[:-1] == words
    assert not list(tmp_path.rglob("PWNED"))


# --------------------------------------------------------------------------- CSV
CSV_CELLS = [
    # (value, the cell written) -- one row per class
    pytest.param("=HYPERLINK(\"http://x\",\"y\")", "'=HYPERLINK(\"http://x\",\"y\")", id="="),
    pytest.param("+cmd|' /C calc'!A0", "'+cmd|' /C calc'!A0", id="+"),
    pytest.param("-2+3+cmd|' /C calc'!A0", "'-2+3+cmd|' /C calc'!A0", id="-"),
    pytest.param("@SUM(1+1)*cmd", "'@SUM(1+1)*cmd", id="@"),
    pytest.param("\t=1+1", "'\t=1+1", id="tab"),
    pytest.param("\r=1+1", "'\r=1+1", id="carriage-return"),
    pytest.param(-0.5, -0.5, id="negative-float"),
    pytest.param(-3, -3, id="negative-int"),
    pytest.param("-0.500000", "-0.500000", id="negative-number-as-text"),
    pytest.param("+1e-5", "+1e-5", id="signed-exponent-as-text"),
    pytest.param(float("-inf"), "'-inf", id="negative-infinity"),
    pytest.param("cat", "cat", id="plain-text"),
    pytest.param("a=b", "a=b", id="equals-inside"),
    pytest.param("", "", id="empty"),
    pytest.param(None, "", id="None"),
    pytest.param(True, "True", id="bool"),
    pytest.param("-", "'-", id="lone-dash"),
]


@pytest.mark.parametrize("value, cell", CSV_CELLS)
def test_csv_cell(value, cell):
    assert csv_cell(value) == cell


def test_write_csv_round_trip_header_mappings_sequences_and_path(tmp_path):
    rows = [{"class": "=cmd()", "f1": -0.25, "extra": "left out"}, ["@x", None]]
    text = csv_text(["class", "f1"], rows)
    assert list(csv.reader(io.StringIO(text))) == [["class", "f1"], ["'=cmd()", "-0.25"],
                                                   ["'@x", ""]]
    assert csv_text(["=evil"], []).startswith("'=evil")  # the header too
    buf = io.StringIO()
    write_csv(buf, ["class", "f1"], rows)
    assert buf.getvalue() == text
    write_csv(tmp_path / "t.csv", ["class", "f1"], rows)
    assert (tmp_path / "t.csv").read_bytes() == text.encode()
    assert [p.name for p in tmp_path.iterdir()] == ["t.csv"]  # no temp file left


# --------------------------------------------------------------------------- HTML
HOSTILE = "<script>alert(1)</script>\"'&<img src=x onerror=alert(2)>"


@pytest.mark.parametrize("value, text", [
    (HOSTILE, "&lt;script&gt;alert(1)&lt;/script&gt;&quot;&#x27;&amp;&lt;img src=x "
              "onerror=alert(2)&gt;"),
    ("cat", "cat"), (3, "3"), (None, "None"), ("ø 日本", "ø 日本"),
])
def test_html_text(value, text):
    assert html_text(value) == text


def test_reports_escape_every_user_value():
    """report.html (one run) and the sweep's report.html with a hostile class name, metric,
    swept key, trial reason, figure caption and stage key: no tag of theirs survives."""
    from ddpflow.results.report import render as run_page
    from ddpflow.sweeps.leaderboard import render as sweep_page

    cfg = SimpleNamespace(run="r")
    ev = {"samples": 2, "stage": "a", "weights": {"holds": "final"}, "acc": 0.5, "top5": 1.0,
          "loss": 0.1, "classes": [HOSTILE], "per_class": {"precision": [0.5], "recall": [0.5],
                                                          "f1": [0.5], "support": [HOSTILE]}}
    summary = {"finished": False, "config_hash": HOSTILE, "evaluation": ev, "export": None,
               "stages": [{"stage": "a", "finished": False, "note": HOSTILE, HOSTILE: 1}]}
    pages = [run_page(cfg, summary, {"torch": HOSTILE}, {}, metric=f"val_{HOSTILE}")]
    row = {"rank": 1, "trial": HOSTILE, "best": True, "status": "failed", "reason": HOSTILE,
           "best_value": None, "final_value": None, "wall_time_s": None,
           "wall_samples_per_s": None, "gpu_hours": None, "report": "/nonexistent",
           f"param:{HOSTILE}": HOSTILE}
    board = {"swept": [HOSTILE], "trials": [row],
             "best": {"trial": HOSTILE, "monitor": HOSTILE, "value": 0.5, "weights": HOSTILE}}
    pages.append(sweep_page(cfg, board, {}, REPO))
    for page in pages:
        assert "<script>alert" not in page and "<img src=x" not in page
        assert html_text(HOSTILE) in page


# --------------------------------------------------------------------------- surfaces
def test_every_csv_writer_and_html_escape_in_the_package_is_quoting():
    """One place for each: a new CSV writer or HTML page that bypasses it fails here."""
    src = REPO / "src" / "ddpflow"
    pattern = re.compile(r"csv\.writer|csv\.DictWriter|html\.escape|shell=True|os\.system|"
                         r"^\s*(import snakemake|from snakemake)", re.M)
    found = [f"{p.relative_to(src)}: {m.group(0)}" for p in sorted(src.rglob("*.py"))
             if p.name != "quoting.py" for m in pattern.finditer(p.read_text())]
    assert found == []


# placeholders a `shell:` line may use unquoted: numbers the workflow itself sets
SAFE_UNQUOTED = {"threads", "resources.mem_mb", "resources.runtime", "resources.gpu",
                 "resources.cpus_per_task", "resources.cpus_per_gpu", "resources.nodes",
                 "resources.tasks"}
# names a Python-built line may use: the quoting module's functions
QUOTERS = {"format_literal", "shell_line", "shell_word"}


def _tokens(path):
    return [t for t in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
            if t.type not in (tokenize.NL, tokenize.COMMENT)]


def _is_fstring(tok) -> bool:
    return tok.type == getattr(tokenize, "FSTRING_START", -1) or (
        tok.type == tokenize.STRING and re.match(r"[A-Za-z]*[fF]", tok.string) is not None)


def _unquoted_fields(text: str) -> list[str]:
    return [f"{{{name}:{spec}}}" for _, name, spec, _ in string.Formatter().parse(text)
            if name is not None and not spec.endswith("q") and name not in SAFE_UNQUOTED]


def _shell_directives(toks):
    """(line, [string tokens]) of each rule's `shell:` directive."""
    for i, t in enumerate(toks[:-1]):
        if t.string == "shell" and toks[i + 1].string == ":" and t.start[1] > 0:
            j = i + 2
            while toks[j].type in (tokenize.NEWLINE, tokenize.INDENT):
                j += 1
            body = []
            while toks[j].type not in (tokenize.NEWLINE, tokenize.DEDENT, tokenize.ENDMARKER):
                body.append(toks[j])
                j += 1
            yield t.start[0], body


def _shell_calls(toks):
    """(line, argument tokens) of each shell(...), shell.prefix(...), shell.suffix(...)."""
    for i, t in enumerate(toks[:-3]):
        if t.string != "shell" or (i and toks[i - 1].string == "."):
            continue
        j = i + 1 if toks[i + 1].string == "(" else i + 3 if (
            toks[i + 1].string == "." and toks[i + 3].string == "(") else None
        if j is None:
            continue
        depth, k = 1, j + 1
        while depth:
            depth += {"(": 1, ")": -1}.get(toks[k].string, 0)
            k += 1
        yield t.start[0], toks[j + 1:k - 1]


@pytest.mark.parametrize("path", WORKFLOW_FILES, ids=lambda p: p.name)
def test_every_value_on_a_workflow_shell_line_is_quoted(path):
    toks = _tokens(path)
    bad = []
    for line, body in _shell_directives(toks):
        if not body or any(t.type != tokenize.STRING or _is_fstring(t) for t in body):
            bad.append(f"{path.name}:{line}: shell: is not plain string literals")
            continue
        text = "".join(ast.literal_eval(t.string) for t in body)
        bad += [f"{path.name}:{line}: {f} in {text!r}" for f in _unquoted_fields(text)]
    for line, arg in _shell_calls(toks):
        where = f"{path.name}:{line}: shell(...)"
        if any(_is_fstring(t) for t in arg):
            bad.append(f"{where} interpolates with an f-string")
        if any(t.string in ("format", "%") for t in arg):
            bad.append(f"{where} interpolates with .format or %")
        for t in arg:
            if t.type == tokenize.STRING and not _is_fstring(t):
                bad += [f"{where}: {f}" for f in _unquoted_fields(ast.literal_eval(t.string))]
        values = {t.string for t in arg if t.type == tokenize.NAME} - QUOTERS
        if values and [t.string for t in arg[:2]] != ["format_literal", "("]:
            bad.append(f"{where} puts {sorted(values)} on the line without "
                       f"format_literal(shell_line/shell_word(...))")
    assert bad == []


def test_the_workflow_imports_only_the_quoting_module_of_the_library():
    imports = [m.group(0) for p in WORKFLOW_FILES
               for m in re.finditer(r"^\s*(from|import) ddpflow\S*", p.read_text(), re.M)]
    assert imports and all(i.split()[-1] == "ddpflow.core.quoting" for i in imports), imports


def test_the_checker_catches_the_old_onerror_line(tmp_path):
    """The static check above would have caught the bug it is written for."""
    old = tmp_path / "old.smk"
    old.write_text('onerror:\n    shell(f"ddpflow sweep collect --config {WCFG} || true")\n'
                   'rule r:\n    shell:\n        "cp {input} {output:q}"\n')
    with pytest.raises(AssertionError) as e:
        test_every_value_on_a_workflow_shell_line_is_quoted(old)
    assert "f-string" in str(e.value) and "{input:}" in str(e.value)


# --------------------------------------------------------------------------- end to end
ODD = "-my res $(touch PWNED) `touch PWNED` x"  # relative, so `-` leads every path


@pytest.mark.slow
def test_sweep_onerror_handler_with_an_odd_results_dir(tmp_path):
    """A real sweep through Snakemake whose one trial fails (a batch larger than the data):
    the onerror handler runs `ddpflow sweep collect` with a results_dir holding a leading
    `-`, a space, `$(...)` and backticks; the leaderboard is written with the failed row
    and nothing in the path ran (~15 s). Before quoting.py the handler ran the `touch`
    and then failed on the space, silently (`|| true`): no leaderboard."""
    from test_workflow import snakemake, write

    write(tmp_path, {"run": "sw", "results_dir": ODD, "log_every_steps": 4,
                     "data": {"train_size": 64, "val_size": 32, "image_size": 8},
                     "hardware": {"device": "cpu"},
                     "stages": [{"name": "a", "epochs": 1, "batch_size": 100000, "lr": 0.1}],
                     "sweep": {"grid": {"stages.0.lr": [0.1]}}})
    proc = snakemake(tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]  # the trial failed, as it should
    assert not list(tmp_path.rglob("PWNED")), "a value on a shell line ran as a command"
    board = json.loads((tmp_path / ODD / "sw/sweep/leaderboard.json").read_text())
    [row] = board["trials"]
    assert row["status"] == "failed" and "batch_size 100000" in row["reason"], row
    cells = list(csv.reader((tmp_path / ODD / "sw/sweep/leaderboard.csv").open()))
    assert len(cells) == 2 and "batch_size 100000" in cells[1][cells[0].index("reason")]
