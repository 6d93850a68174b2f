"""bench/gpu.sh, the GPU machine's script, as far as a CPU machine can check it: it refuses
in one line without a GPU, every check it lists is defined and prints PASS/FAIL, it parses
(bash -n, shellcheck where installed), and its 2-rank checks (bench/gpu_ranks.py) run here
on 2 gloo CPU ranks: exact results, each able to FAIL, the CUDA-only ones said as SKIP."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys

import pytest

from conftest import REPO

SCRIPT = REPO / "bench" / "gpu.sh"
RANKS = REPO / "bench" / "gpu_ranks.py"


def test_without_a_gpu_the_script_says_so_in_one_line_and_fails(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the script would run its checks")
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True,
                       env={**os.environ, "PYTHON": sys.executable}, timeout=120)
    assert r.returncode != 0 and r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and "needs a CUDA GPU" in lines[0] and "ran no checks" in lines[0]
    assert not out.exists()  # nothing made, nothing run


def test_every_listed_check_is_defined_documented_and_prints_pass_or_fail():
    text = SCRIPT.read_text()
    r = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    checks = re.findall(r"^check (\S+) (\S+)$", text, re.M)
    assert len(checks) >= 10, checks
    header = text.split("set -uo pipefail")[0]
    for name, fn in checks:
        assert re.search(rf"^{fn}\(\) {{", text, re.M), f"{fn} is not defined"
        assert re.search(rf"^#   {name}\b", header, re.M), f"{name} is not in the header"
    body = text[text.index("check() {"):text.index("cfg() {")]
    assert 'echo "PASS $name' in body and 'echo "FAIL $name' in body and "fails=$((" in body
    assert "NOT EXERCISED" in text and 'exit "$fails"' in text
    # the fp16 check asserts the planted count exactly, not a range
    assert "s['skipped_steps'] == 4" in text and "<= s['skipped_steps']" not in text
    # the 2-rank parts gpu.sh reports are the parts gpu_ranks.py runs
    loop = re.search(r"for part in ([a-z_ 0-9]+); do", text).group(1).split()
    defined = re.search(r"^PARTS = \((.*)\)$", RANKS.read_text(), re.M).group(1)
    assert loop == [p.strip() for p in defined.split(",")]
    assert "ranks gloo" in text and "ranks nccl" in text
    if shutil.which("shellcheck"):
        r = subprocess.run(["shellcheck", "-S", "warning", str(SCRIPT)], capture_output=True,
                           text=True)
        assert r.returncode == 0, r.stdout


def _ranks(broken: str = "") -> subprocess.Popen:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", str(RANKS)],
        env={**os.environ, "GPU_RANKS_DEVICE": "cpu", "GPU_RANKS_BACKEND": "gloo",
             "GPU_RANKS_BREAK": broken, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _results(proc) -> dict:
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, out + err
    return {m[0]: (m[1], m[2]) for m in re.findall(r"^RESULT (\S+) (\S+) (.*)$", out, re.M)}


@pytest.mark.slow
def test_the_two_rank_checks_run_on_two_gloo_ranks_and_can_fail():
    exact = ["collectives", "ddp_no_sync", "grad_hook", "fp16_skipped"]
    runs = _ranks(), _ranks(",".join(exact))  # side by side: one wait
    good, broken = (_results(p) for p in runs)
    assert [k for k, v in good.items() if v[0] == "PASS"] == exact, good
    assert good["fp16_skipped"][1].startswith("skipped 2 of 8 steps"), good
    assert good["collectives"][1].startswith("9 exact"), good
    # CUDA-only parts: said, not passed
    assert {k: v[0] for k, v in good.items() if k not in exact} == {
        "syncbn": "SKIP", "compile_ddp": "SKIP"}
    # a wrong expectation fails each exact part, on the rank(s) that saw it
    assert all(broken[k][0] == "FAIL" for k in exact), broken
    assert "skipped 2, planted 2" in broken["fp16_skipped"][1], broken
