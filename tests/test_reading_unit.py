"""core/reading.py and results/summary.py, edge by edge: the size limit at its boundary and
a file that grows while read, a FIFO, a path through a file, a symlink loop, nesting deeper
than any schema, field names too long to print, blank lines in a line log; and the stage
summary's one-line result text. Fast: no training.
"""

from __future__ import annotations

import os
import threading

import pytest

from ddpflow.core import reading
from ddpflow.core.errors import UserError
from ddpflow.results import summary

INTS = {"type": "object", "additionalProperties": {"type": "integer"}}


def _refusal(fn, *args, **kw) -> str:
    with pytest.raises(UserError) as e:
        fn(*args, **kw)
    return str(e.value)


@pytest.mark.parametrize("key, shown", [
    ("k" * 40, "k" * 40),  # a plain name of 40 characters: as it is
    ("k" * 41, "'" + "k" * 34 + " ..."),  # longer: its repr, capped at 40 characters
    ("a-b_c", "a-b_c"),
    ("a b", "'a b'"),  # not a plain name: its repr
    ("x" * 9 + "\n", repr("x" * 9 + "\n")),
])
def test_a_field_name_is_printed_whole_only_when_it_is_a_short_plain_name(tmp_path, key, shown):
    text = _refusal(reading.validate, {key: "v"}, INTS, "f.json", "a file")
    assert text.startswith(f"f.json (a file): {shown}: 'v' is not of type 'integer'"), text
    assert len(shown) <= 40 and "\n" not in text


def test_the_first_missing_key_is_named():
    schema = {"type": "object", "required": ["alpha", "beta"]}
    assert _refusal(reading.validate, {}, schema, "f.json", "a file").startswith(
        "f.json (a file): alpha: missing")
    assert _refusal(reading.validate, {"alpha": 1}, schema, "f.json", "a file").startswith(
        "f.json (a file): beta: missing")


def test_nesting_deeper_than_python_recurses_is_one_message():
    deep = "[" * 100000 + "]" * 100000
    text = _refusal(reading.parse, deep, "f.json", "a file", "fix it")
    assert text == "f.json (a file) is nested too deeply to be a file ddpflow wrote; fix it"
    nested: list = []
    for _ in range(5000):
        nested = [nested]
    schema = {"type": "array", "items": {"$ref": "#"}}
    text = _refusal(reading.validate, nested, schema, "f.json", "a file", "fix it")
    assert text == "f.json (a file) is nested too deeply to be a file ddpflow wrote; fix it"


def test_an_integer_too_long_to_convert_is_one_message():
    text = _refusal(reading.parse, "1" * 5000, "f.json", "a file", "fix it")
    assert text.startswith("f.json (a file) is not valid JSON: ") and "digits" in text, text
    assert text.endswith("(truncated, or not written by ddpflow); fix it"), text


@pytest.mark.parametrize("size", [99, 100])
def test_a_file_of_at_most_the_limit_is_read_whole(tmp_path, size):
    p = tmp_path / "f.json"
    p.write_text("x" * size)
    assert reading.read_text(p, "a file", max_bytes=100) == "x" * size


def test_a_file_over_the_limit_is_refused_with_its_size(tmp_path):
    p = tmp_path / "f.json"
    p.write_text("x" * 2_000_001)
    text = _refusal(reading.read_text, p, "a file", "fix it", max_bytes=1_000_000)
    assert text.startswith(f"{p} (a file) is 2.0 MB, more than the 1 MB such a file ever "
                           f"has;"), text


def test_a_file_that_holds_more_than_its_size_says_is_refused():
    """/proc files say 0 bytes and hold more: what is read past the limit is refused, not
    cut off silently (the case of a file that grows while it is read)."""
    text = _refusal(reading.read_text, "/proc/self/status", "a file", "fix it", max_bytes=100)
    assert text == "/proc/self/status (a file) is larger than 0 MB; fix it", text


def test_a_fifo_is_refused_without_blocking(tmp_path):
    """A FIFO would block the reader until some writer comes; it is refused up front. (A
    writer is started anyway, so that a reader that did open it would return.)"""
    fifo = tmp_path / "f.json"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: open(fifo, "wb").close(), daemon=True)
    writer.start()
    try:
        text = _refusal(reading.read_text, fifo, "a file", "fix it")
    finally:
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # let the writer go
        writer.join(10)
        os.close(fd)
    assert text == f"{fifo} (a file) is not a regular file; fix it"
    assert _refusal(reading.existing, fifo, "the log", "fix it") == (
        f"the log: {fifo} is not a regular file; fix it")
    assert _refusal(reading.existing, fifo, "the log", "fix it", folder=True) == (
        f"the log: {fifo} is not a regular folder; fix it")


def test_a_path_through_a_file_cannot_be_read(tmp_path):
    (tmp_path / "f").write_text("{}")
    text = _refusal(reading.read_text, tmp_path / "f" / "x.json", "a file", "fix it")
    assert text == (f"{tmp_path / 'f' / 'x.json'} (a file) cannot be read (Not a directory); "
                    f"check its permissions, or fix it")


@pytest.mark.parametrize("name, why", [
    (5, "is not a file name"), (None, "is not a file name"), ("", "is not a file name"),
    ("a\0b", "is not a file name"), ("loop", "is a symlink that cannot be resolved"),
    ("out", "is a symlink to "),
])
def test_a_name_inside_a_file_that_leaves_its_folder_is_refused(tmp_path, name, why):
    os.symlink(tmp_path / "loop2", tmp_path / "loop")
    os.symlink(tmp_path / "loop", tmp_path / "loop2")
    os.symlink(tmp_path.parent, tmp_path / "out")
    text = _refusal(reading.inside, tmp_path, name, "m.json: files.x")
    assert text.startswith(f"m.json: files.x: {name!r} {why}"), text
    if name == "out":
        assert f"is a symlink to {tmp_path.parent}, outside {tmp_path}" in text, text


def test_a_damaged_cache_reads_as_none_and_a_good_one_as_its_value(tmp_path):
    p = tmp_path / "c.json"
    p.write_text('{"a": 1}')
    assert reading.read_json_or_none(p, INTS, "a cache") == {"a": 1}
    p.write_text('{"a": "x"}')
    assert reading.read_json_or_none(p, INTS, "a cache") is None
    assert reading.read_json_or_none(tmp_path / "none.json", INTS, "a cache") is None


def test_blank_lines_of_a_line_log_are_not_bad_lines(tmp_path):
    p = tmp_path / "log.jsonl"
    p.write_text('{"a": 1}\n\n   \n{"a": "x"}\n{"a": 2}\n')
    assert reading.read_jsonl(p, INTS, "a log") == ([{"a": 1}, {"a": 2}], [4])


# ------------------------------------------------------------------ stage summaries

FINISHED = {"finished": True, "steps": 10, "wall_time_s": 1.5, "world_size": 2}


def test_a_summary_written_is_read_back_and_a_damaged_one_is_named(tmp_path):
    p = tmp_path / "summary.json"
    summary.write_summary(p, FINISHED)
    assert summary.read_summary(p) == FINISHED and summary.summary_problem(p) is None
    assert summary.summary_problem(tmp_path / "none.json") is None  # not done yet
    p.write_text('{"finished": true, "steps": -1}')
    problem = summary.summary_problem(p)
    assert problem.startswith(f"{p} (stage summary): ") and "delete it and run" in problem


@pytest.mark.parametrize("s, text", [
    ({"final_val_acc": 0.91204, "best_val_acc": 0.915}, "val_acc 0.9120 (best 0.9150)"),
    ({"monitor": None, "final_metrics": None, "final_val_acc": None},
     "val_acc n/a (best n/a)"),
    ({"monitor": "val_loss", "final_metrics": {"val_loss": 0.5}, "best_value": 0.25,
      "final_val_acc": 0.9, "test_loss": 0.125}, "val_loss 0.5000 (best 0.2500), test_loss 0.1250"),
    ({"monitor": "val_top5_acc", "final_metrics": {"val_top5_acc": 1.0}, "test_top5_acc": 0.5,
      "test_acc": 0.1}, "val_top5_acc 1.0000 (best n/a), test_top5_acc 0.5000"),
    ({"monitor": "val_acc", "final_metrics": {}, "final_val_acc": 0.5, "test_acc": None},
     "val_acc 0.5000 (best n/a)"),
])
def test_the_result_text_names_the_monitored_metric_and_its_test_twin(s, text):
    assert summary.result_text(s) == text
