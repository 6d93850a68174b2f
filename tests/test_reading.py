"""core/reading.py: every file ddpflow reads but did not just write (bundle manifest,
meta.json, stage summary, tune.json, sweep plan, unsent MLflow log) is the right result or
one UserError naming the file and the field. One row per class of bad input, per file kind;
a property test for the manifest, meta.json and summary readers."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from conftest import ddpflow, tiny_config
from ddpflow.config import from_dict
from ddpflow.core import reading
from ddpflow.core.errors import UserError
from ddpflow.data import prepared
from ddpflow.engine.settings import load_choice
from ddpflow.inference.predict import load_bundle
from ddpflow.results.summary import read_summary
from ddpflow.sweeps.plan import read_plan, trial_config_path
from ddpflow.tracking.mlflowrun import UNSENT_LINE_SCHEMA

MODEL_BYTES = b"not a model: the manifest is refused before any model is loaded"
MANIFEST = {
    "format_version": 1, "task": "classification",
    "files": {"torchscript": {"file": "model.ts",
                              "sha256": hashlib.sha256(MODEL_BYTES).hexdigest()}},
    "num_classes": 2, "classes": ["cat", "dog"], "input": {"channels": 3},
    "image_size": 8, "store_size": 8, "grayscale": False,
    "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]}
META = {
    "format_version": prepared.FORMAT_VERSION, "encoding": "raw", "fingerprint": "f",
    "bytes": {"train_labels.npy": 3}, "sha256": {"train_labels.npy": "0" * 64},
    "counts": {s: {"total": 1, "per_class": [1]} for s in prepared.SPLITS},
    "num_classes": 1, "classes": ["a"], "mean": [0.5] * 3, "std": [0.2] * 3,
    "image_shape": [8, 8, 3]}
SUMMARY = {"finished": True, "steps": 5, "wall_time_s": 1.5, "world_size": 2,
           "monitor": "val_acc", "final_metrics": {"val_acc": 0.5}}


def _set(obj: dict, field, value) -> dict:
    """A deep copy of obj with the field ("a.b.0" or a tuple of keys) set to value, or
    removed for DELETE."""
    out = copy.deepcopy(obj)
    *path, last = field.split(".") if isinstance(field, str) else field
    node = out
    for k in path:
        node = node[int(k)] if isinstance(node, list) else node[k]
    if isinstance(node, list):
        last = int(last)
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return out


DELETE = object()


def _write(path: Path, content) -> None:
    """content: a dict/list (as JSON), str, bytes, or one of the special classes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if content == "<missing>":
        return
    if content == "<folder>":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content)
    else:
        path.write_text(json.dumps(content))


TRUNCATED = json.dumps(MANIFEST)[:40]
# the classes every file kind meets: (class, content, words the message must hold)
COMMON = [
    ("folder", "<folder>", ["is a folder"]),
    ("empty", "", ["is empty"]),
    ("truncated", '{"finished": true, "steps": 3', ["not valid JSON", "line 1"]),
    ("not JSON", "key: value\n", ["not valid JSON"]),
    ("not UTF-8", b'{"a": "\xff\xfe"}', ["not UTF-8"]),
    ("list, not object", [1, 2], ["(top level)", "not of type 'object'"]),
]


# ----------------------------------------------------------------- bundle manifest
def _bundle(tmp_path: Path, content) -> Path:
    folder = tmp_path / "bundle"
    folder.mkdir()
    (folder / "model.ts").write_bytes(MODEL_BYTES)
    _write(folder / "model.json", content)
    return folder


MANIFEST_ROWS = [("missing", "<missing>", ["does not exist", "ddpflow export"])] + COMMON + [
    ("missing key", _set(MANIFEST, "num_classes", DELETE), ["): num_classes: missing"]),
    ("wrong type", _set(MANIFEST, "num_classes", "2"), ["num_classes", "'integer'"]),
    ("wrong type, nested", _set(MANIFEST, "input.channels", [3]), ["input.channels"]),
    ("out of range", _set(MANIFEST, "image_size", 0), ["image_size", "below the minimum"]),
    ("out of range, a list item", _set(MANIFEST, "std", [0.2, 0, 0.2]), ["std.1"]),
    ("list of the wrong length", _set(MANIFEST, "classes", ["cat"]),
     ["classes", "num_classes says 2"]),
    ("other format version", _set(MANIFEST, "format_version", 2), ["format_version"]),
    ("path with ..", _set(MANIFEST, "files.torchscript.file", "../model.ts"),
     ["files.torchscript.file", "'..'"]),
    ("absolute path", _set(MANIFEST, "files.torchscript.file", "/etc/passwd"),
     ["files.torchscript.file", "absolute path"]),
    ("symlink out", _set(MANIFEST, "files.torchscript.file", "link.ts"),
     ["files.torchscript.file", "symlink"]),
    # a name no file system takes was an OSError read as a place that cannot be written
    ("name too long", _set(MANIFEST, "files.torchscript.file", "m" * 300),
     ["files.torchscript.file", "maxLength 255", " ... "]),
    # a line break in a name would split the message into a line that reads like ddpflow's
    ("name with a line break", _set(MANIFEST, "files.torchscript.file",
                                    "model.ts\nddpflow: predictions written to x.csv"),
     ["files.torchscript.file", "not allowed here (pattern"]),
]


@pytest.mark.parametrize("case, content, words", MANIFEST_ROWS,
                         ids=[r[0] for r in MANIFEST_ROWS])
def test_bundle_manifest_classes(tmp_path, case, content, words):
    folder = _bundle(tmp_path, content)
    (tmp_path / "outside.ts").write_bytes(MODEL_BYTES)
    (folder / "link.ts").symlink_to(tmp_path / "outside.ts")
    with pytest.raises(UserError) as e:
        load_bundle(folder)
    text = str(e.value)
    assert "model.json" in text and "\n" not in text, text
    assert all(w in text for w in words), text


def test_a_valid_manifest_is_read_and_a_symlink_inside_is_kept(tmp_path):
    folder = _bundle(tmp_path, MANIFEST)
    assert load_bundle(folder)["classes"] == ["cat", "dog"]
    (folder / "real.ts").write_bytes(MODEL_BYTES)
    (folder / "link.ts").symlink_to("real.ts")
    _write(folder / "model.json", _set(MANIFEST, "files.torchscript.file", "link.ts"))
    assert load_bundle(folder)["files"]["torchscript"]["file"] == "link.ts"


def test_predict_on_a_broken_manifest_is_one_line_exit_2(tmp_path):
    """Through the real CLI: refused before the model is loaded, nothing written."""
    folder = _bundle(tmp_path, {**MANIFEST, "files": [{"file": "../../etc/passwd"}]})
    (tmp_path / "x.png").write_bytes(b"")
    r = ddpflow("predict", "--bundle", folder, tmp_path / "x.png", "--out",
                tmp_path / "p.csv")
    errors = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(errors) == 1 and "model.json" in errors[0] and "files" in errors[0], r.stderr
    assert not (tmp_path / "p.csv").exists()


# ----------------------------------------------------------------- meta.json
def _prepared(tmp_path: Path, content) -> Path:
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "train_labels.npy").write_bytes(b"abc")
    _write(folder / "meta.json", content)
    return folder


META_ROWS = COMMON + [
    ("missing key", _set(META, "counts", DELETE), ["): counts: missing"]),
    ("missing key, nested", _set(META, "counts.val", DELETE), ["counts.val: missing"]),
    ("wrong type", _set(META, "num_classes", "1"), ["num_classes"]),
    ("out of range", _set(META, "std", [0.2, -1, 0.2]), ["std.1"]),
    ("list of the wrong length", _set(META, "image_shape", [8, 8]), ["image_shape"]),
    ("path with ..", _set(META, "bytes", {"../train_labels.npy": 3}),
     ["bytes", "'../train_labels.npy'"]),
    ("absolute path", _set(META, "bytes", {"/etc/passwd": 3}), ["bytes", "/etc/passwd"]),
    ("symlink out", _set(META, "bytes", {"link.npy": 3}), ["bytes", "symlink"]),
    # what `prepare --verify` reads and hashes: named inside the folder too
    ("sha256 path with ..", _set(META, "sha256", {"../outside.npy": "0" * 64}),
     ["sha256: '../outside.npy' is not a plain name"]),
    ("sha256 absolute path", _set(META, "sha256", {"/etc/passwd": "0" * 64}),
     ["sha256: '/etc/passwd' is not a plain name"]),
]


@pytest.mark.parametrize("case, content, words", META_ROWS, ids=[r[0] for r in META_ROWS])
def test_meta_json_classes(tmp_path, case, content, words):
    folder = _prepared(tmp_path, content)
    (tmp_path / "outside.npy").write_bytes(b"abc")
    (folder / "link.npy").symlink_to(tmp_path / "outside.npy")
    with pytest.raises(UserError) as e:
        prepared.read_meta(folder)
    text = str(e.value)
    assert "meta.json" in text and "ddpflow prepare" in text, text
    assert all(w in text for w in words), text
    assert prepared.read_meta(folder, damaged_ok=True) is None  # prepare rebuilds it


@pytest.mark.parametrize("case, content", [
    ("missing", "<missing>"), ("other format version", _set(META, "format_version", 1)),
    ("an array missing", _set(META, "bytes", {"gone.npy": 3})),
    ("an array of another size", _set(META, "bytes", {"train_labels.npy": 4}))])
def test_meta_json_absent_or_incomplete_is_none(tmp_path, case, content):
    """Not there (yet): None, as before; the callers say `run ddpflow prepare`."""
    assert prepared.read_meta(_prepared(tmp_path, content)) is None


def test_a_valid_meta_json_is_read(tmp_path):
    assert prepared.read_meta(_prepared(tmp_path, META))["classes"] == ["a"]


# ----------------------------------------------------------------- stage summary
SUMMARY_ROWS = COMMON + [
    ("missing key", _set(SUMMARY, "steps", DELETE), ["): steps: missing"]),
    ("wrong type", _set(SUMMARY, "finished", "yes"), ["finished", "'boolean'"]),
    ("wrong type, nested", _set(SUMMARY, "final_metrics.val_acc", "0.5"),
     ["final_metrics.val_acc"]),
    ("out of range", _set(SUMMARY, "steps", -1), ["steps", "below the minimum"]),
]


@pytest.mark.parametrize("case, content, words", SUMMARY_ROWS,
                         ids=[r[0] for r in SUMMARY_ROWS])
def test_summary_classes(tmp_path, case, content, words):
    path = tmp_path / "summary.json"
    _write(path, content)
    with pytest.raises(UserError) as e:
        read_summary(path)
    text = str(e.value)
    assert str(path) in text and "run the stage again" in text, text
    assert all(w in text for w in words), text
    assert read_summary(path, damaged_ok=True) is None  # the launcher runs the stage again


def test_summary_absent_or_unfinished_is_none(tmp_path):
    assert read_summary(tmp_path / "summary.json") is None
    _write(tmp_path / "summary.json", {"finished": False})
    assert read_summary(tmp_path / "summary.json") is None
    _write(tmp_path / "summary.json", SUMMARY)
    assert read_summary(tmp_path / "summary.json")["steps"] == 5


# ----------------------------------------------------------------- tune.json
CHOICE = {"batch_size": 32, "loader": "dataloader", "num_workers": 2, "prefetch_factor": 2,
          "precision": "fp32", "channels_last": False, "compile": False}
TUNE_ROWS = COMMON + [
    ("missing key", {"choice": _set(CHOICE, "precision", DELETE)}, ["choice.precision"]),
    ("wrong type", {"choice": _set(CHOICE, "batch_size", 3.5)}, ["choice.batch_size"]),
    ("out of range", {"choice": _set(CHOICE, "batch_size", 0)}, ["choice.batch_size"]),
    ("not one of", {"choice": _set(CHOICE, "precision", "fp8")}, ["choice.precision"]),
]


@pytest.mark.parametrize("case, content, words", TUNE_ROWS, ids=[r[0] for r in TUNE_ROWS])
def test_tune_json_classes(tmp_path, case, content, words):
    """Damaged: the reason instead of a choice (a stage with batch_size: auto refuses with
    it, others warn); missing: (None, None) as before."""
    cfg = from_dict(tiny_config(tmp_path))
    st = cfg.stages[0]
    assert load_choice(cfg, st) == (None, None)
    _write(cfg.run_dir / "tune.json", content)
    choice, why = load_choice(cfg, st)
    assert choice is None and str(cfg.run_dir / "tune.json") in why and "ddpflow tune" in why
    assert all(w in why for w in words), why


# ----------------------------------------------------------------- sweep plan
PLAN = {"run": "t", "swept": ["seed"], "trials": [
    {"id": "seed-1-abcdef", "variant": None, "overrides": {"seed": 1}}]}
PLAN_ROWS = COMMON + [
    ("missing key", _set(PLAN, "swept", DELETE), ["): swept: missing"]),
    ("wrong type", _set(PLAN, "trials.0.overrides", [1]), ["trials.0.overrides"]),
    ("path with ..", _set(PLAN, "trials.0.id", "../../x"), ["trials.0.id"]),
    ("absolute path", _set(PLAN, "trials.0.id", "/tmp/x"), ["trials.0.id"]),
]


@pytest.mark.parametrize("case, content, words", PLAN_ROWS, ids=[r[0] for r in PLAN_ROWS])
def test_sweep_plan_classes(tmp_path, case, content, words):
    cfg = from_dict(tiny_config(tmp_path))
    _write(cfg.run_dir / "sweep" / "plan.json", content)
    with pytest.raises(UserError) as e:
        read_plan(cfg)
    assert "plan.json" in str(e.value) and "sweep plan" in str(e.value), str(e.value)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_sweep_trial_folder_symlinked_out_is_refused(tmp_path):
    cfg = from_dict(tiny_config(tmp_path))
    _write(cfg.run_dir / "sweep" / "plan.json", PLAN)
    entry = read_plan(cfg)["trials"][0]
    assert trial_config_path(cfg, entry).parent.name == entry["id"]
    (cfg.run_dir / "trials").mkdir()
    (cfg.run_dir / "trials" / entry["id"]).symlink_to(tmp_path)
    with pytest.raises(UserError, match="trials.id.*symlink"):
        trial_config_path(cfg, entry)


# ----------------------------------------------------------------- line logs, generic
def test_unsent_log_lines(tmp_path):
    """A last line cut short by a kill: skipped silently; a bad line inside: skipped and
    counted (send_unsent warns with the count); good lines kept in order."""
    good = [["open", {"key": "k", "resume": False, "params": {}}],
            ["metrics", {"step": 1, "ts": 2, "values": {"train/loss": 0.5}}]]
    path = tmp_path / "mlflow_unsent.jsonl"
    path.write_text("\n".join([json.dumps(good[0]), "garbage", '["metrics", {"step": "x"}]',
                               json.dumps(good[1]), '["end", {"artif']))
    assert reading.read_jsonl(path, UNSENT_LINE_SCHEMA, "unsent log") == (good, [2, 3])
    assert reading.read_jsonl(path, UNSENT_LINE_SCHEMA, "log", cut_ok=False) == (good, [2, 3, 5])
    path.write_text("")
    assert reading.read_jsonl(path, UNSENT_LINE_SCHEMA, "unsent log") == ([], [])
    path.write_bytes(b"\xff\n")
    with pytest.raises(UserError, match="not UTF-8"):
        reading.read_jsonl(path, UNSENT_LINE_SCHEMA, "unsent log")


def test_too_big_and_not_a_regular_file(tmp_path):
    path = tmp_path / "big.json"
    path.write_text(json.dumps({"x": "y" * 2000}))
    with pytest.raises(UserError, match=r"big.json \(test file\) is .* MB, more than"):
        reading.read_json(path, {"type": "object"}, "test file", max_bytes=1000)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # opening it would block until a writer came
    with pytest.raises(UserError, match="not a regular file"):
        reading.read_json(fifo, {"type": "object"}, "test file")
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(UserError, match="deep.json"):
        reading.read_json(deep, {"type": "object"}, "test file")


# ----------------------------------------------------------------- properties
hypothesis = pytest.importorskip("hypothesis")
st = pytest.importorskip("hypothesis.strategies")

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4), max_leaves=12)


def _fields(obj, prefix=()):
    """Every field path (a tuple of keys) of a nested dict, lists by index."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj)
    for k, v in items:
        yield (*prefix, k)
        if isinstance(v, (dict, list)) and v:
            yield from _fields(v, (*prefix, k))


def _one_of(read, valid: dict, data) -> None:
    """A valid file with one field replaced by generated JSON, or a whole generated value:
    the reader gives a result or a UserError, never another exception."""
    if data.draw(st.booleans()):
        field = data.draw(st.sampled_from(list(_fields(valid))))
        value = _set(valid, field, data.draw(JSON | st.just(DELETE)))
    else:
        value = data.draw(JSON)
    folder = Path(tempfile.mkdtemp())
    try:
        (folder / "model.ts").write_bytes(MODEL_BYTES)
        (folder / "train_labels.npy").write_bytes(b"abc")
        try:
            out = read(folder, json.dumps(value))
        except UserError as e:
            assert str(e) and "\n" not in str(e)
        else:
            assert out is None or isinstance(out, dict)
    finally:
        shutil.rmtree(folder)


def _read_into(name: str, reader):
    def read(folder: Path, text: str):
        (folder / name).write_text(text)
        return reader(folder, folder / name)
    return read


SETTINGS = hypothesis.settings(max_examples=150, deadline=None)


@SETTINGS
@hypothesis.given(data=st.data())
def test_property_manifest(data):
    _one_of(_read_into("model.json", lambda f, p: load_bundle(f)), MANIFEST, data)


@SETTINGS
@hypothesis.given(data=st.data())
def test_property_meta(data):
    _one_of(_read_into("meta.json", lambda f, p: prepared.read_meta(f)), META, data)


@SETTINGS
@hypothesis.given(data=st.data())
def test_property_summary(data):
    _one_of(_read_into("summary.json", lambda f, p: read_summary(p)), SUMMARY, data)


@SETTINGS
@hypothesis.given(raw=st.binary(max_size=64))
def test_property_any_bytes(raw):
    folder = Path(tempfile.mkdtemp())
    try:
        (folder / "f.json").write_bytes(raw)
        try:
            reading.read_json(folder / "f.json", {"type": "object"}, "test file")
        except UserError as e:
            assert "f.json" in str(e)
    finally:
        shutil.rmtree(folder)
