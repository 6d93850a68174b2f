"""`ddpflow --log FILE`: everything into the log, ddpflow's own lines also on the console."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO
from ddpflow.core.teelog import tee_log

CHILD = r"""
import sys
print("plain output, log only")
sys.stdout.flush()
sys.stderr.write("ddpflow: stage 'a': 2 rank(s) on cpu\n")
sys.stderr.write("[a]  5%|#  | 1/20\r[a] step 4/20: loss 2.1\n")
sys.stderr.write("[a] step 8/20: loss 2.0, data wait 3%")  # another rank's text lands here
sys.stderr.write("[rank1]: Traceback (most recent call last):\n[rank1]: ValueError: bad shape\n")
sys.stderr.write("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n")
sys.stderr.write("ddpflow: error: the end, without a newline")
"""


def test_tee_sends_everything_to_the_log_and_ddpflow_lines_to_the_console(tmp_path, capfd):
    log = tmp_path / "logs/deep/job.log"  # the folder is made
    with tee_log(log) as tee:
        os.write(1, b"from this process\n")  # the process's own fd 1 (pytest replaces sys.stdout)
        subprocess.run([sys.executable, "-c", CHILD], check=True)  # a child inherits the fds
    console = capfd.readouterr().err
    text = log.read_bytes().decode()
    for line in ("from this process", "plain output, log only", "ChildFailedError",
                 "[rank1]: Traceback", "1/20\r[a] step 4/20"):
        assert line in text
    # the console: only ddpflow's lines, a redrawn bar as its last state, the unended last line
    assert console.splitlines() == ["ddpflow: stage 'a': 2 rank(s) on cpu",
                                    "[a] step 4/20: loss 2.1",
                                    "[a] step 8/20: loss 2.0, data wait 3%",
                                    "ddpflow: error: the end, without a newline"]
    # the cause of a crash is the rank's exception, not torchrun's summary of it
    assert tee.last_error == "[rank1]: ValueError: bad shape"


def test_log_option_on_a_mistake_gives_the_one_line_error_on_both(tmp_path):
    log = tmp_path / "v.log"
    proc = subprocess.run([sys.executable, "-m", "ddpflow", f"--log={log}", "validate",
                           "--config", str(tmp_path / "missing.yaml")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("ddpflow: error: ") and "missing.yaml" in proc.stderr
    assert proc.stderr.count("\n") == 1 and "the last exception" not in proc.stderr
    assert log.read_text() == proc.stderr


def test_a_log_that_cannot_be_written_is_one_message_and_runs_nothing(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("mine")  # a file where the log's folder would be
    proc = subprocess.run([sys.executable, "-m", "ddpflow", f"--log={blocker}/sub/x.log",
                           "validate", "--config", str(REPO / "config/config.yaml")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert proc.stderr.startswith("ddpflow: error: cannot write the log ") and \
        proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert blocker.read_text() == "mine"
