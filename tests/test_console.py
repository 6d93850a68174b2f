"""`ddpflow --log FILE`: everything into the log, ddpflow's own lines also on the console."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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


# ------------------------------------------------------------ the log is a place ddpflow writes
def _cfg(tmp_path, **top):
    from conftest import tiny_config, write_config

    return write_config(tmp_path, tiny_config(tmp_path, **top))


LOG_ROWS = [  # (class, argv after `ddpflow` ({c}: the config), words of the message)
    ("the config itself (arguments swapped)", ["--log", "{c}", "validate", "--config", "{c}"],
     ["--log {c} is the --config of this command ({c})", "nothing was changed"]),
    ("a hard link to the config", ["--log", "{t}/hard.log", "validate", "--config", "{c}"],
     ["--log {t}/hard.log is the --config of this command"]),
    ("a symlink to the config", ["--log", "{t}/sym.log", "validate", "--config", "{c}"],
     ["--log {t}/sym.log is the --config of this command"]),
    ("a file the config names (model.weights)", ["--log", "{t}/w.log", "validate", "--config",
                                                 "{c}"],
     ["--log {t}/w.log is the file model.weights names of this command"]),
    ("a file --set names", ["--log", "{t}/init.log", "validate", "--config", "{c}", "--set",
                            "stages.0.init_from={t}/init.log"],
     ["--log {t}/init.log is --set #1 of this command"]),
    ("an input image of predict", ["--log", "{t}/img.log", "predict", "--bundle", "{t}",
                                   "{t}/img.log"], ["--log {t}/img.log is an input #1"]),
    ("a name of a config or weights file", ["--log", "{t}/other.yaml", "validate", "--config",
                                            "{c}"],
     ["--log {t}/other.yaml: a log does not take the name of a .yaml file"]),
    # a file the command finds itself (export reads the stage's final.pt and its checksum)
    ("a checksum ddpflow keeps", ["--log", "{t}/final.pt.sha256", "validate", "--config", "{c}"],
     ["--log {t}/final.pt.sha256: a log does not take the name of a .sha256 file",
      "a checksum or lock ddpflow keeps"]),
    ("a folder", ["--log", "{t}", "validate", "--config", "{c}"], ["--log {t} is a folder"]),
    ("a FIFO", ["--log", "{t}/pipe.log", "validate", "--config", "{c}"],
     ["--log {t}/pipe.log is not a regular file"]),
    ("predict's --out, not there yet", ["--log", "{t}/preds.csv", "predict", "--bundle", "{t}",
                                        "{t}/img.log", "--out", "{t}/preds.csv"],
     ["--log {t}/preds.csv is the --out of this command ({t}/preds.csv)"]),
    ("a file inside export's --out", ["--log", "{t}/bundle/x.log", "export", "--config", "{c}",
                                      "--out", "{t}/bundle"],
     ["--log {t}/bundle/x.log is inside the --out folder of this command ({t}/bundle)"]),
    ("ddpflow's record of a folder it wrote", ["--log", "{t}/.ddpflow-output", "validate",
                                               "--config", "{c}"],
     ["--log {t}/.ddpflow-output: .ddpflow-output is the record ddpflow keeps"]),
]


@pytest.mark.parametrize("what, argv, words", LOG_ROWS, ids=[r[0] for r in LOG_ROWS])
def test_a_log_that_is_an_input_or_no_place_for_a_log_is_refused_before_anything(
        tmp_path, what, argv, words):
    """`ddpflow --log c.yaml validate --config c.yaml` truncated the config before reading it."""
    cfg = _cfg(tmp_path, model={"name": "smallcnn", "weights": str(tmp_path / "w.log")})
    (tmp_path / "w.log").write_bytes(b"weights of mine")
    (tmp_path / "init.log").write_bytes(b"starting weights")
    (tmp_path / "img.log").write_bytes(b"\x89PNG not really")
    (tmp_path / "other.yaml").write_text("mine: 1\n")
    (tmp_path / "final.pt.sha256").write_text(f"{'0' * 64}  final.pt\n")
    os.link(cfg, tmp_path / "hard.log")
    (tmp_path / "sym.log").symlink_to(cfg)
    os.mkfifo(tmp_path / "pipe.log")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    argv = [str(a).format(c=cfg, t=tmp_path) for a in argv]
    proc = subprocess.run([sys.executable, "-m", "ddpflow", *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.startswith("ddpflow: error: ") and proc.stderr.count("\n") == 1, \
        proc.stderr
    for w in words:
        assert w.format(c=cfg, t=tmp_path) in proc.stderr, proc.stderr
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    assert after == before and not (tmp_path / "results").exists()


def test_a_log_beside_its_inputs_is_written(tmp_path):
    """What the rules do: the log in a place of its own, an earlier log replaced."""
    cfg = _cfg(tmp_path)
    log = tmp_path / "logs" / "validate.log"
    log.parent.mkdir()
    log.write_text("an earlier run's log\n")
    proc = subprocess.run([sys.executable, "-m", "ddpflow", f"--log={log}", "validate",
                           "--config", str(cfg)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert log.read_text().startswith("run: t\n") and "earlier" not in log.read_text()


@pytest.fixture
def full_tmpfs(tmp_path):
    """A 64 KiB tmpfs, filled but for `left` bytes (mounting needs root: else skipped)."""
    d = tmp_path / "full"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(d)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")

    def fill(left: int) -> Path:
        free = os.statvfs(d).f_bavail * os.statvfs(d).f_frsize
        (d / "filler").write_bytes(b"\0" * max(0, free - left))
        return d
    yield fill
    subprocess.run(["umount", "-l", str(d)], check=False)


def test_a_log_whose_disk_fills_up_is_one_line_and_keeps_the_result(tmp_path, full_tmpfs):
    """A log on a full disk ended in an OSError traceback from the tee after the stage had
    finished: under Snakemake the stage counted as failed. Now: one warning line, the
    command's own exit code, and its ddpflow lines still on the console."""
    d = full_tmpfs(0)  # (tmpfs counts whole pages: the resolved config is less than one)
    cfg = _cfg(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "ddpflow", "--log", str(d / "v.log"),
                           "validate", "--config", str(cfg)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    warned = [ln for ln in proc.stderr.splitlines() if "warning" in ln]
    assert warned == [f"ddpflow: warning: cannot write the log at {d / 'v.log'}: no space "
                      f"left on the device; free space there or choose another place; the "
                      f"command goes on, its output from here on is not in the log"], \
        proc.stderr
    assert "Traceback" not in proc.stderr
    # and a failing command keeps its own exit code and one-line error
    proc = subprocess.run([sys.executable, "-m", "ddpflow", "--log", str(d / "v2.log"),
                           "validate", "--config", str(tmp_path / "missing.yaml")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "missing.yaml" in proc.stderr, proc.stderr


def test_tee_goes_on_past_a_full_log_and_still_echoes(tmp_path, full_tmpfs, capfd):
    d = full_tmpfs(8192)
    child = ("import sys\nfor i in range(2000): print('filler line', i)\n"
             "sys.stderr.write('ddpflow: the end\\n')\n")
    with tee_log(d / "x.log") as tee:
        rc = subprocess.run([sys.executable, "-c", child]).returncode
    err = capfd.readouterr().err
    assert rc == 0 and tee.log_failed and "no space left" in tee.log_failed
    assert err.splitlines()[-1] == "ddpflow: the end" and err.count("warning") == 1, err
    assert 0 < (d / "x.log").stat().st_size <= 8192


def test_a_config_that_does_not_read_is_the_commands_message_in_its_log(tmp_path):
    """The log's check reads the config only to find the files it names; a broken one is
    left to the command, whose one-line error lands in the log and on the console."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages: [unclosed\n")
    log = tmp_path / "v.log"
    proc = subprocess.run([sys.executable, "-m", "ddpflow", f"--log={log}", "validate",
                           "--config", str(bad)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"ddpflow: error: config file {bad} is not valid YAML")
    assert log.read_text() == proc.stderr


def test_an_empty_out_is_no_folder_the_log_could_be_inside(tmp_path, monkeypatch):
    """`--out ""` (an empty argument) names no place: the log beside it is not refused as
    being inside it (the command says what is wrong with its --out itself)."""
    import argparse

    from ddpflow.config.inputs import checked_log
    from ddpflow.core.errors import UserError

    monkeypatch.chdir(tmp_path)
    assert checked_log("run.log", argparse.Namespace(out="", log="run.log")) == \
        tmp_path.joinpath("run.log").relative_to(tmp_path)
    with pytest.raises(UserError, match="inside the --out folder"):
        checked_log("b/run.log", argparse.Namespace(out="b", log="b/run.log"))


def test_an_input_that_cannot_be_compared_is_passed_over_for_the_next(tmp_path):
    """check_log_place compares the log with each input by inode: one that cannot be
    stat'd (gone since the command line was read) is passed over, not an error, and the
    next input is still compared."""
    from ddpflow.core.errors import UserError
    from ddpflow.core.writing import check_log_place

    cfg = tmp_path / "c.yaml"
    cfg.write_text("run: t\n")
    log = tmp_path / "c.log"
    os.link(cfg, log)
    gone = {"the --bundle": str(tmp_path / "gone" / "model.json")}
    with pytest.raises(UserError) as e:
        check_log_place(log, {**gone, "the --config": str(cfg)})
    assert f"--log {log} is the --config of this command ({cfg})" in str(e.value)
    assert check_log_place(tmp_path / "new.log", gone) == tmp_path / "new.log"
    assert check_log_place(log, gone) == log
