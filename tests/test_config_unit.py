"""The config's own modules, edge by edge, each message exact (it names the key and what to
write): reading a config file (config/yamlfile.py: every kind of bad file, the size and alias
limits at their boundary, duplicate keys also in a flow mapping), the typed config
(config/types.py: places, stages, hashes, the sections derived from the schema), addresses
outside ddpflow (config/endpoints.py: MLflow URIs against the mlflow installed here, images,
Slurm values), a sweep's scheduler and search (config/sweepchecks.py), stages and recipes
(config/stagechecks.py), and loading (config/loading.py: value limits, integer coercion,
--set overrides, the checks validate runs). Fast: no training, no subprocess.
"""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path

import pytest

from conftest import tiny_config
from ddpflow.config import from_dict, yamlfile
from ddpflow.config.yamlfile import MAX_CONFIG_BYTES, MAX_YAML_NODES, TOO_DEEP, read_yaml
from ddpflow.core.errors import UserError


def _refusal(fn, *args, **kw) -> str:
    with pytest.raises(UserError) as e:
        fn(*args, **kw)
    return str(e.value)


# ------------------------------------------------------------------ reading a config file

def _file(tmp_path: Path, text: str | bytes, name: str = "c.yaml") -> Path:
    p = tmp_path / name
    p.write_bytes(text.encode() if isinstance(text, str) else text)
    return p


def test_a_yaml_file_is_read_whole_and_an_empty_one_is_an_empty_config(tmp_path):
    assert read_yaml(_file(tmp_path, "run: r\nstages:\n  - {name: a, lr: 0.1}\n")) == {
        "run": "r", "stages": [{"name": "a", "lr": 0.1}]}
    assert read_yaml(_file(tmp_path, "")) == {}
    assert read_yaml(_file(tmp_path, "# only a comment\n")) == {}
    assert read_yaml(str(_file(tmp_path, "seed: 3\n"))) == {"seed": 3}


def test_merge_keys_and_aliases_are_yaml_as_usual(tmp_path):
    text = ("base: &b {x: 1, y: 2}\nuse:\n  <<: *b\n  y: 3\n"
            "both: [*b, *b]\n")
    assert read_yaml(_file(tmp_path, text)) == {
        "base": {"x": 1, "y": 2}, "use": {"x": 1, "y": 3},
        "both": [{"x": 1, "y": 2}, {"x": 1, "y": 2}]}


@pytest.mark.parametrize("text, line, first", [
    ("stages:\n  - name: a\n    lr: 0.1\n    lr: 0.2\n", 4, 3),
    ("stages: [{name: a, lr: 0.1, lr: 0.2}]\n", 1, 1),  # a flow mapping: one line
    ("seed: 1\nrun: r\nseed: 2\n", 3, 1),
])
def test_a_duplicate_key_is_refused_with_both_lines(tmp_path, text, line, first):
    p = _file(tmp_path, text)
    key = "seed" if "seed" in text else "lr"
    assert _refusal(read_yaml, p) == (
        f"config file {p}: duplicate key '{key}' at line {line} (first at line {first}); YAML "
        f"would silently keep only the last one: remove one")


def test_an_unhashable_key_is_yaml_s_own_error(tmp_path):
    p = _file(tmp_path, "? [a, b]\n: 1\n")
    assert _refusal(read_yaml, p).startswith(
        f"config file {p} is not valid YAML at line 1, column 3: found unhashable key")


def test_a_missing_file_or_a_folder_says_what_to_pass(tmp_path):
    assert _refusal(read_yaml, tmp_path / "nope.yaml") == (
        f"config file not found: {tmp_path / 'nope.yaml'} (pass --config with a YAML file, "
        f"e.g. config/config.yaml)")
    assert _refusal(read_yaml, tmp_path) == (
        f"--config {tmp_path} is a directory; pass a YAML file, e.g. config/config.yaml")


def test_the_size_limit_is_exact_and_a_file_is_never_cut(tmp_path):
    head = "note: "
    fits = _file(tmp_path, head + "x" * (MAX_CONFIG_BYTES - len(head)))
    assert fits.stat().st_size == MAX_CONFIG_BYTES
    assert read_yaml(fits) == {"note": "x" * (MAX_CONFIG_BYTES - len(head))}
    big = _file(tmp_path, head + "x" * (MAX_CONFIG_BYTES + 1 - len(head)))
    assert _refusal(read_yaml, big) == (
        f"config file {big} is larger than 1024 KiB; a config holds settings, not data")


def test_a_file_that_is_not_utf8_names_the_byte(tmp_path):
    p = _file(tmp_path, b"run: r\nnote: \xe9t\xe9\n")
    assert _refusal(read_yaml, p) == (
        f"config file {p} is not UTF-8 text (byte 0xe9 at offset 13); save it as UTF-8 YAML")


def test_bad_yaml_names_the_line_and_column(tmp_path):
    p = _file(tmp_path, "run: r\nstages: [a\n")
    assert _refusal(read_yaml, p) == (
        f"config file {p} is not valid YAML at line 3, column 1: expected ',' or ']', but got "
        f"'<stream end>'")


def test_a_json_file_is_json_so_its_numbers_stay_numbers(tmp_path):
    p = _file(tmp_path, '{"stages": [{"name": "a", "lr": 1e-05}]}', "c.json")
    assert read_yaml(p) == {"stages": [{"name": "a", "lr": 1e-05}]}
    assert read_yaml(_file(tmp_path, "null", "n.json")) == {}
    bad = _file(tmp_path, '{"a": 1,}', "bad.json")
    with pytest.raises(ValueError) as e:
        json.loads('{"a": 1,}')
    assert _refusal(read_yaml, bad) == f"config file {bad} is not valid JSON: {e.value}"


@pytest.mark.parametrize("name, text", [
    ("deep.yaml", "a: " + "[" * 5000 + "]" * 5000 + "\n"),
    ("deep.json", '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")])
def test_a_file_nested_too_deep_is_one_message(tmp_path, name, text):
    p = _file(tmp_path, text, name)
    assert _refusal(read_yaml, p) == f"config file {p}: {TOO_DEEP}"


def test_standard_input_is_a_json_config(monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO('{"run": "r", "lr": 1e-05}'))
    assert read_yaml("-") == {"run": "r", "lr": 1e-05}
    monkeypatch.setattr("sys.stdin", io.StringIO("null"))
    assert read_yaml("-") == {}
    monkeypatch.setattr("sys.stdin", io.StringIO("run: r"))
    with pytest.raises(ValueError) as e:
        json.loads("run: r")
    assert _refusal(read_yaml, "-") == (
        f"--config -: standard input is not a JSON config ({e.value})")
    monkeypatch.setattr("sys.stdin", io.StringIO("[" * 100_000 + "]" * 100_000))
    assert _refusal(read_yaml, "-") == f"--config -: {TOO_DEEP}"


def _count(x) -> int:
    """Nodes of a loaded document: each value, each key, each list and mapping."""
    if isinstance(x, dict):
        return 1 + sum(1 + _count(v) for v in x.values())
    if isinstance(x, list):
        return 1 + sum(_count(v) for v in x)
    return 1


def _aliased(nodes: int) -> str:
    """`a: [...]` whose list is built mostly of aliases, `nodes` nodes in all once expanded."""
    k = 999  # &s is a list of k zeros: 1 + k nodes
    m, r = divmod(nodes - 3, 1 + k)  # the root, the key `a`, the list itself
    return "a: [&s [" + ", ".join(["0"] * k) + "]" + ", *s" * (m - 1) + ", 0" * r + "]\n"


def test_the_alias_limit_is_exact(tmp_path):
    fits = _aliased(MAX_YAML_NODES)
    assert _count(read_yaml(_file(tmp_path, fits))) == MAX_YAML_NODES
    for text in (_aliased(MAX_YAML_NODES + 1),
                 # the limit is reached exactly before the root's last key: still counted
                 _aliased(MAX_YAML_NODES) + "z: null\n"):
        p = _file(tmp_path, text)
        assert _refusal(read_yaml, p) == (
            f"config file {p}: it expands to more than {MAX_YAML_NODES} values through YAML "
            f"aliases; refused (write it out)")


def test_a_billion_laughs_is_refused_before_it_is_expanded(tmp_path):
    text = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n"
        for i in range(8))
    p = _file(tmp_path, text)
    assert "expands to more than" in _refusal(read_yaml, p)


def test_an_alias_cycle_is_refused(tmp_path):
    p = _file(tmp_path, "a: &x [1, *x]\n")
    assert _refusal(read_yaml, p) == (
        f"config file {p}: the config refers to itself through a YAML alias (a cycle)")
    assert yamlfile.MAX_YAML_NODES == 100_000


# ------------------------------------------------------------------ the typed config

def _cfg(tmp_path: Path, **top):
    return from_dict(tiny_config(tmp_path, **top))


def test_a_config_s_places_are_under_its_results_folder(tmp_path):
    cfg = _cfg(tmp_path, run="r1")
    run = tmp_path / "results" / "r1"
    assert cfg.run_dir == run
    assert cfg.data_dir == run / "data"
    assert cfg.stage_dir("s1") == run / "stages" / "s1"
    moved = _cfg(tmp_path, data={"prepared_dir": str(tmp_path / "prep")})
    assert moved.data_dir == tmp_path / "prep"


def test_the_data_code_comes_from_data_else_from_the_model(tmp_path):
    assert _cfg(tmp_path).data_code_dir is None
    assert _cfg(tmp_path, model={"code_dir": "m"}).data_code_dir == "m"
    assert _cfg(tmp_path, data={"code_dir": "d"}).data_code_dir == "d"
    assert _cfg(tmp_path, data={"code_dir": "d"}, model={"code_dir": "m"}).data_code_dir == "d"


def test_stages_are_found_by_name_and_an_unknown_one_names_them_all(tmp_path):
    stages = [{"name": n, "epochs": 1, "batch_size": 8, "lr": 0.1} for n in ("warm", "main")]
    cfg = _cfg(tmp_path, stages=stages)
    assert cfg.stage("main").name == "main" and cfg.stage("warm").name == "warm"
    assert cfg.stage_index("warm") == 0 and cfg.stage_index("main") == 1
    assert _refusal(cfg.stage, "cool") == (
        "no stage named 'cool' in the config; stages are: warm, main")
    assert _refusal(cfg.stage_index, "cool").startswith("no stage named 'cool'")


def test_to_dict_is_the_validated_dict_and_the_hashes_are_rerun_s(tmp_path):
    from ddpflow.config import validate
    from ddpflow.config.rerun import config_hash, stage_hash

    d = validate(tiny_config(tmp_path, stages=[
        {"name": "a", "epochs": 1, "batch_size": 8, "lr": 0.1},
        {"name": "b", "epochs": 1, "batch_size": 8, "lr": 0.2}]))
    cfg = from_dict(d)
    plain = cfg.to_dict()
    # sweep.random has no default: None in the config, so in its dict
    assert plain == {**d, "sweep": {**d["sweep"], "random": None}}
    assert type(plain["stages"]) is list and type(plain["stages"][0]) is dict
    assert type(plain["data"]["augment"]) is dict
    assert cfg.hash == config_hash(plain) and len(cfg.hash) == 16
    assert cfg.stage_hash("a") == stage_hash(d, "a") != stage_hash(d, "b")
    more = from_dict({**d, "hardware": {**d["hardware"], "nproc_per_node": 1}})
    assert more.stage_hash("a", placement=False) == cfg.stage_hash("a", placement=False)
    assert more.stage_hash("a") != cfg.stage_hash("a")


def test_build_makes_sections_tuples_and_leaves_free_mappings_dicts(tmp_path):
    from ddpflow.config import types

    cfg = _cfg(tmp_path, model={"kwargs": {"width": [8, 16]}})
    assert type(cfg) is types.Config
    assert type(cfg.data) is types.SECTIONS["data"]
    assert type(cfg.data.augment) is types.SECTIONS["data.augment"]
    assert type(cfg.stages) is tuple and type(cfg.stages[0]) is types.SECTIONS["stages[]"]
    assert type(cfg.stages[0].ema) is types.SECTIONS["stages[].ema"]
    assert cfg.model.kwargs == {"width": [8, 16]} and type(cfg.model.kwargs) is dict
    assert cfg.sweep.random is None  # no default, left out: None


def test_a_sweep_is_on_with_any_of_its_three_forms_and_scheduled_by_either(tmp_path):
    import dataclasses

    sweep = _cfg(tmp_path).sweep
    assert sweep.enabled is False and sweep.scheduled is False
    for form, value in (("grid", {"lr": [0.1]}), ("variants", ({"name": "v"},)),
                        ("random", {"trials": 2})):
        assert dataclasses.replace(sweep, **{form: value}).enabled is True, form
    assert dataclasses.replace(sweep, scheduler="asha").scheduled is True
    assert dataclasses.replace(sweep, search="tpe").scheduled is True
    assert dataclasses.replace(sweep, scheduler="asha", search="tpe").scheduled is True


def test_sections_are_frozen_dataclasses_named_after_their_keys():
    import dataclasses

    from ddpflow.config import types

    out: dict = {}
    top = types._classes(types.schema(), "", out)
    props = types.schema()["properties"]
    assert top is out[""] and top.__name__ == "Config" and top.__module__ == types.__name__
    assert [f.name for f in dataclasses.fields(top)] == list(props)
    names = {k: c.__name__ for k, c in out.items()}
    assert names["data"] == "DataCfg" and names["data.augment"] == "AugmentCfg"
    assert names["stages[]"] == "StageCfg" and names["sweep.variants[]"] == "VariantCfg"
    assert names["hardware.slots"] == "SlotsCfg" and names["stages[].ema"] == "EmaCfg"
    assert "sweep.grid" not in out and "model.kwargs" not in out  # free mappings
    fields = {f.name: f.type for f in dataclasses.fields(top)}
    assert fields["data"] is out["data"] and fields["stages"] is out["stages[]"]
    assert fields["seed"] is int and fields["run"] is str
    stage = {f.name: f.type for f in dataclasses.fields(out["stages[]"])}
    assert list(stage) == list(props["stages"]["items"]["properties"])
    assert stage["ema"] is out["stages[].ema"]
    assert issubclass(top, types._ConfigPlaces) and issubclass(out["sweep"], types._SweepSwitch)
    assert not issubclass(out["data"], (types._ConfigPlaces, types._SweepSwitch))
    ema = out["stages[].ema"](**{f.name: None for f in dataclasses.fields(out["stages[].ema"])})
    with pytest.raises(dataclasses.FrozenInstanceError):
        ema.decay = 0.5


def test_a_schema_type_is_its_python_type():
    from typing import Any

    from ddpflow.config.types import _annotation, is_section

    assert _annotation({"type": "integer"}, None) is int
    assert _annotation({"type": ["string", "null"]}, None) == str | None
    assert _annotation({"type": ["integer", "number", "null"]}, None) == int | float | None
    assert _annotation({"type": ["number", "array"]}, None) == float | tuple
    assert _annotation({}, None) is Any and _annotation({"type": "nonsense"}, None) is Any
    assert _annotation({"type": "object"}, dict) is dict
    section = {"type": "object", "properties": {}, "additionalProperties": False}
    assert is_section(section) is True
    for key, value in (("type", "array"), ("additionalProperties", True)):
        assert is_section({**section, key: value}) is False, key
    assert is_section({"type": "object", "additionalProperties": False}) is False
    assert is_section({"type": "object", "properties": {}}) is False


def test_the_schema_is_read_again_when_its_file_changes_and_is_a_copy(tmp_path, monkeypatch):
    from ddpflow.config import types

    real = types.schema()
    real["properties"].clear()
    assert types.schema()["properties"], "the cached schema must not change with a copy"
    p = tmp_path / "schema.yaml"
    p.write_text("a: 1\n")
    monkeypatch.setattr(types, "SCHEMA_PATH", p)
    assert types.schema() == {"a": 1}
    p.write_text("a: 2\n")
    import os

    st = p.stat()
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert types.schema() == {"a": 2}


def test_the_code_fingerprint_follows_names_and_contents_of_python_files(tmp_path,
                                                                         monkeypatch):
    from ddpflow.config import types

    monkeypatch.setattr(types, "PACKAGE_ROOT", tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.py").write_text("x = 1\n")
    (tmp_path / "top.py").write_text("y = 2\n")
    whole, sub = types.code_fingerprint(), types.code_fingerprint("sub")
    assert len(whole) == 16 and len(sub) == 16 and whole != sub
    assert all(c in "0123456789abcdef" for c in whole + sub)
    (tmp_path / "notes.txt").write_text("not code")
    assert types.code_fingerprint() == whole
    (tmp_path / "sub" / "a.py").rename(tmp_path / "sub" / "b.py")
    assert types.code_fingerprint("sub") != sub
    (tmp_path / "sub" / "b.py").rename(tmp_path / "sub" / "a.py")
    assert types.code_fingerprint("sub") == sub
    (tmp_path / "sub" / "a.py").write_text("x = 3\n")
    assert types.code_fingerprint("sub") != sub and types.code_fingerprint() != whole


# ------------------------------------------------------------------ addresses outside ddpflow

def _mlflow_version() -> tuple[int, int]:
    from importlib import metadata

    major, minor = metadata.version("mlflow").split(".")[:2]
    return int(major), int(minor)


def test_the_installed_mlflow_is_its_major_and_minor_or_none(tmp_path, monkeypatch):
    import sys

    from ddpflow.config.endpoints import _installed_mlflow

    assert _installed_mlflow() == _mlflow_version()
    monkeypatch.setattr(sys, "path", [str(tmp_path)])  # an environment without mlflow
    assert _installed_mlflow() is None


def test_a_module_is_present_when_python_can_import_it(monkeypatch):
    import sys

    from ddpflow.config.endpoints import _present

    assert _present("json") is True and _present("json.decoder") is True
    assert _present("ddpflow_no_such_module") is False
    assert _present("json.nope.deeper") is False  # its parent is no package: ImportError
    assert _present("") is False  # ValueError
    monkeypatch.setitem(sys.modules, "json", None)  # import blocked
    assert _present("json") is False


FORMS = ("http://host:port, https://host, sqlite:///relative.db, sqlite:////absolute.db, "
         "postgresql://..., mysql://..., mssql://... or databricks")


@pytest.mark.parametrize("uri, problem", [
    ("", "is empty or has surrounding spaces or control characters"),
    (" http://h:5000", "is empty or has surrounding spaces or control characters"),
    ("http://h:5000/a\x1fb", "is empty or has surrounding spaces or control characters"),
    ("http://h:5000/a!b c", None),  # printable characters are the server's business
    ("https://mlflow.example.org", None),
    ("localhost:5000", f"has scheme 'localhost:', which MLflow does not take; use {FORMS}"),
    ("ftp://h/x", f"has scheme 'ftp:', which MLflow does not take; use {FORMS}"),
    ("http+x://h", f"has scheme 'http+x:', which MLflow does not take; use {FORMS}"),
    ("postgresql+a+b://h/db",
     f"has scheme 'postgresql+a+b:', which MLflow does not take; use {FORMS}"),
    ("http://", "has no host; write it as http://host:port"),
    ("https:///path", "has no host; write it as https://host:port"),
    ("http://host:port", "has a port that is not a number"),
    ("sqlite:rel.db", "is not a form SQLAlchemy reads; write sqlite:///relative/file.db or "
                      "sqlite:////absolute/file.db"),
    ("sqlite:///", "is an in-memory database, which keeps nothing once each process ends; "
                   "write sqlite:///relative/file.db or sqlite:////absolute/file.db"),
    ("sqlite:///:memory:", "is an in-memory database, which keeps nothing once each process "
                           "ends; write sqlite:///relative/file.db or sqlite:////absolute/file.db"),
    ("sqlite:///runs/m.db", None),
    ("file://otherhost/tmp/x", "names the host 'otherhost'; a file: URI is a folder on this "
                               f"machine (file:/folder); use {FORMS}"),
    ("databricks", None),  # databricks-sdk is installed with mlflow here
    ("databricks://profile", None),
])
def test_mlflow_uri_forms(monkeypatch, uri, problem):
    from ddpflow.config.endpoints import mlflow_uri_problem

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    assert mlflow_uri_problem(uri) == problem


def test_a_folder_store_is_refused_by_this_mlflow_unless_opted_into(monkeypatch):
    from ddpflow.config.endpoints import mlflow_uri_problem

    major, minor = _mlflow_version()
    assert (major, minor) >= (3, 13), "this mlflow writes folder stores: nothing to refuse"
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    refused = (f"is a folder (MLflow's file store), which the installed mlflow {major}.{minor} "
               f"refuses to log to; use sqlite:///mlflow.db (one file, made on first use) or a "
               f"server, i.e. {FORMS}, or set MLFLOW_ALLOW_FILE_STORE=true to keep the folder "
               f"store")
    for uri in ("mlruns", "file:mlruns", "file:///tmp/x", "file://localhost/tmp/x"):
        assert mlflow_uri_problem(uri) == refused, uri
    for value in ("true", "1", "TRUE"):
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", value)
        assert mlflow_uri_problem("mlruns") is None, value
    for value in ("false", "0"):
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", value)
        assert mlflow_uri_problem("mlruns") == refused, value
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "yes")
    assert mlflow_uri_problem("mlruns") == (
        "is a folder store and MLFLOW_ALLOW_FILE_STORE='yes', which mlflow refuses; set it to "
        "true or false")


def test_the_folder_store_is_refused_from_mlflow_3_13_on(monkeypatch):
    """Another mlflow than the one installed here: its version is what decides."""
    from ddpflow.config import endpoints

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    for version, refused in (((3, 12), False), ((3, 13), True), ((4, 0), True)):
        monkeypatch.setattr(endpoints, "_installed_mlflow", lambda v=version: v)
        problem = endpoints.mlflow_installed_problem("mlruns", "file")
        assert (problem is not None) == refused, version
    monkeypatch.setattr(endpoints, "_installed_mlflow", lambda: None)
    assert endpoints.mlflow_installed_problem("mlruns", "file") is None
    assert endpoints.mlflow_installed_problem("postgresql://h/db", "postgresql") is None


def test_a_database_needs_its_driver_installed(tmp_path, monkeypatch):
    import sys

    from ddpflow.config.endpoints import mlflow_installed_problem, mlflow_uri_problem

    for mod in ("psycopg2", "pymysql"):
        monkeypatch.setitem(sys.modules, mod, None)  # not installed here
    assert mlflow_uri_problem("postgresql://u@h/db") == (
        "needs the database driver psycopg2 (pip install psycopg2-binary), which is not "
        "installed here")
    assert mlflow_uri_problem("mysql+pymysql://u@h/db") == (
        "needs the database driver pymysql (pip install pymysql), which is not installed here")
    assert mlflow_uri_problem("postgresql+otherdriver://u@h/db") is None  # SQLAlchemy's
    assert mlflow_installed_problem("http://h", "http") is None
    monkeypatch.delitem(sys.modules, "psycopg2")
    (tmp_path / "psycopg2").mkdir()  # a driver on the path: installed
    (tmp_path / "psycopg2" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert mlflow_uri_problem("postgresql://u@h/db") is None
    assert mlflow_uri_problem("postgresql+psycopg2://u@h/db") is None


def test_databricks_needs_the_databricks_sdk(monkeypatch):
    import sys

    from ddpflow.config.endpoints import mlflow_uri_problem

    major, minor = _mlflow_version()
    monkeypatch.setitem(sys.modules, "databricks.sdk", None)  # not installed
    needs = (f"needs the databricks-sdk package, which the installed mlflow {major}.{minor} "
             f"reads credentials with and is not installed: pip install databricks-sdk")
    assert mlflow_uri_problem("databricks") == needs
    assert mlflow_uri_problem("databricks://profile") == needs


IMAGE_FORM = ("[registry/]name[:tag] with a lowercase name and a tag of letters, digits, '_', "
              "'.' and '-' (at most 128), e.g. ddpflow:latest or localhost:5000/org/ddpflow:1.0")


def test_an_image_reference_is_at_most_255_characters():
    from ddpflow.config.endpoints import image_ref_problem

    assert image_ref_problem("org/" + "a" * 251) is None
    assert image_ref_problem("localhost:5000/org/ddpflow:1.0") is None
    refused = f"is not an image reference: write {IMAGE_FORM}"
    assert image_ref_problem("org/" + "a" * 252) == refused
    assert image_ref_problem("org/DDPflow") == refused


@pytest.mark.parametrize("uri, problem", [
    ("docker://org/ddpflow:1.0", None),
    ("oras://ghcr.io/org/ddpflow:1.0", None),
    ("docker:// org/ddpflow", "has spaces or a line break around the image: remove them"),
    ("docker://org/ddpflow\n", "has spaces or a line break around the image: remove them"),
    ("docker://", "has no image after the scheme, e.g. docker://org/ddpflow:1.0"),
    ("oras:///abs", "has no image after the scheme, e.g. docker://org/ddpflow:1.0"),
    ("docker://Org/X", f"has 'Org/X' after the scheme, which is not an image: write {IMAGE_FORM}"),
    ("docker://org/x://y",
     f"has 'org/x://y' after the scheme, which is not an image: write {IMAGE_FORM}"),
    ("/images/my images/ddpflow!.sif", None),
    ("ddpflow.sif", None),
    ("/images/a\x1f.sif", "is not docker://<image>, oras://<image> or a path to a .sif file (a "
                          "plain image name needs docker:// in front)"),
    ("https://x/ddpflow.sif", "is not docker://<image>, oras://<image> or a path to a .sif file "
                              "(a plain image name needs docker:// in front)"),
    ("org/ddpflow:1.0", "is not docker://<image>, oras://<image> or a path to a .sif file (a "
                        "plain image name needs docker:// in front)"),
])
def test_container_uri_forms(uri, problem):
    from ddpflow.config.endpoints import container_uri_problem

    assert container_uri_problem(uri) == problem


def test_gres_gpus_counts_the_gpus_of_a_gpu_gres():
    from ddpflow.config.endpoints import gres_gpus

    assert gres_gpus("gpu:2") == 2 and gres_gpus("gpu:a100:4") == 4
    assert gres_gpus("gpu") is None and gres_gpus("gpu:a100") is None
    assert gres_gpus("tmp:10") is None


SLURM = {"partition": None, "account": None, "gpu_model": None, "extra": None,
         "runtime_min": 10, "signal_before_end_s": 120}


def test_slurm_values_that_cannot_reach_sbatch_as_meant():
    from ddpflow.config.endpoints import slurm_problem

    assert slurm_problem(SLURM) is None
    good = {**SLURM, "partition": "gpu,long", "account": "proj-1.2", "gpu_model": "a100_80",
            "extra": "--mail-type=END --mail-user=me@x.org"}
    assert slurm_problem(good) is None
    for key, value, example in (("partition", "gpu long", "gpu or gpu,long"),
                                ("account", "a;b", "proj-123"),
                                ("gpu_model", "a100-80", "a100")):
        shown = "gpu model" if key == "gpu_model" else key
        assert slurm_problem({**good, key: value}) == (key, (
            f"{value!r} is not a Slurm {shown}: use letters, digits, '_', '.' and '-' (e.g. "
            f"{example}), no spaces, quotes or ';'"))
    assert slurm_problem({**SLURM, "extra": "--time=10"}) == (
        "extra", "sets --time, which slurm.extra may not set: set slurm.runtime_min instead")


def test_the_signal_before_the_end_must_come_before_the_end():
    from ddpflow.config.endpoints import slurm_problem

    assert slurm_problem({**SLURM, "runtime_min": 10, "signal_before_end_s": 599}) is None
    assert slurm_problem({**SLURM, "runtime_min": 10, "signal_before_end_s": 600}) == (
        "signal_before_end_s", "is 600 s but a job runs only 600 s (slurm.runtime_min 10): the "
        "signal to checkpoint must come before the end; set it below 600 (e.g. 180) or raise "
        "runtime_min")
    assert slurm_problem({**SLURM, "runtime_min": 2, "signal_before_end_s": 900})[1] == (
        "is 900 s but a job runs only 120 s (slurm.runtime_min 2): the signal to checkpoint "
        "must come before the end; set it below 120 (e.g. 60) or raise runtime_min")


def test_slurm_extra_is_plain_sbatch_words():
    from ddpflow.config.endpoints import slurm_extra_problem

    assert slurm_extra_problem("--mail-type=END  --mail-user=me@x.org") is None
    assert slurm_extra_problem("") is None
    assert slurm_extra_problem("--comment='a;b' --x") == (
        "has \"'\", ';' in \"--comment='a;b'\": the Slurm executor pastes slurm.extra into a shell "
        "line unquoted, so ddpflow takes only sbatch options made of letters, digits and _ = : "
        ", . / @ % + - separated by spaces (no quotes needed, e.g. --gpus-per-node=8 "
        "--mail-type=END)")
    shown = slurm_extra_problem("--x=$(a|b)&;<>")
    assert shown.startswith("has '$', '&', '(', ')', ';' in '--x=$(a|b)&;<>': "), shown
    assert slurm_extra_problem("--nodes=2").startswith("sets --nodes, which slurm.extra may not")


# ------------------------------------------------------------------ a sweep's scheduler

def _ends(fn, *args, lines: int = 100_000):
    """fn(*args), failed once it has run `lines` lines: a check loops forever never."""
    import sys

    count = 0

    def local(frame, event, arg):
        nonlocal count
        count += 1
        if count > lines:
            raise AssertionError(f"{fn.__name__} ran {lines} lines without ending")
        return local

    sys.settrace(lambda frame, event, arg: local)
    try:
        return fn(*args)
    finally:
        sys.settrace(None)


def test_rungs_grow_by_eta_up_to_the_last_stage_s_end():
    from ddpflow.config.sweepchecks import rungs

    assert _ends(rungs, 1, 9, 3) == [1, 3, 9]
    assert _ends(rungs, 1, 10, 3) == [1, 3, 9, 10]
    assert _ends(rungs, 2, 20, 2) == [2, 4, 8, 16, 20]
    assert _ends(rungs, 4, 4, 2) == [4]


def _swept(tmp_path, sweep: dict | None = None, stage: dict | None = None, **top) -> dict:
    """A validated two-stage config, then its sweep (and last stage) changed as given: the
    dict check_sweep sees."""
    from ddpflow.config import validate

    d = validate(tiny_config(tmp_path, stages=[
        {"name": "a", "epochs": 1, "batch_size": 8, "lr": 0.1},
        {"name": "b", "epochs": 9, "batch_size": 8, "lr": 0.1}], **top))
    d["sweep"].update({"grid": {"stages.1.lr": [0.1, 0.2]}, "scheduler": "asha"},
                      **(sweep or {}))
    d["stages"][1].update(stage or {})
    return d


def _sweep_refusal(d: dict) -> str:
    from ddpflow.config.sweepchecks import check_sweep

    with pytest.raises(UserError) as e:
        _ends(check_sweep, d)
    return str(e.value)


def test_schedule_rungs_are_asha_s_or_the_last_stage_s_end(tmp_path):
    from ddpflow.config.sweepchecks import schedule_rungs

    d = _swept(tmp_path)
    assert _ends(schedule_rungs, d) == [1, 3, 9]
    d["sweep"]["asha"].update(min_epochs=2, eta=2, max_epochs=9)
    assert _ends(schedule_rungs, d) == [2, 4, 8, 9]
    d["sweep"]["scheduler"] = "none"
    assert _ends(schedule_rungs, d) == [9]


def test_a_good_scheduled_sweep_passes(tmp_path):
    from ddpflow.config.sweepchecks import check_sweep

    assert _ends(check_sweep, _swept(tmp_path)) is None
    assert _ends(check_sweep, _swept(tmp_path, {"asha": {"eta": 3, "min_epochs": 3,
                                                         "max_epochs": 9}},
                                     {"validate_every_epochs": 3})) is None
    # an earlier stage's length and the last stage's learning rate may be swept
    assert _ends(check_sweep, _swept(tmp_path, {"grid": {"stages.0.epochs": [1, 2]}})) is None
    assert _ends(check_sweep, _swept(tmp_path, {"scheduler": "none"})) is None
    d = _swept(tmp_path, {"scheduler": "none", "grid": {"stages.1.epochs": [1, 2]}})
    assert _ends(check_sweep, d) is None  # no scheduler: nothing to keep the same


def test_a_scheduled_sweep_without_trials(tmp_path):
    d = _swept(tmp_path, {"grid": {}})
    assert _sweep_refusal(d) == ("invalid config: sweep.scheduler asha has no trials to run: set "
                                 "sweep.grid, sweep.random or sweep.variants")
    d = _swept(tmp_path, {"grid": {}, "scheduler": "none", "search": "tpe"})
    assert _sweep_refusal(d) == ("invalid config: sweep.search tpe has no trials to run: set "
                                 "sweep.grid, sweep.random or sweep.variants")


@pytest.mark.parametrize("sweep, stage, message", [
    ({}, {"max_steps": 100},
     "invalid config: sweep.scheduler asha counts rungs in epochs of the last stage, but "
     "stages.1.max_steps is set; give stages.1.epochs instead"),
    ({"asha": {"eta": 3, "min_epochs": 1, "max_epochs": 8}}, {},
     "invalid config: sweep.asha.max_epochs 8 is not stages.1.epochs 9; the last rung is the "
     "stage's end (its learning-rate schedule runs to it): set one to the other, or "
     "max_epochs: null"),
    ({"asha": {"eta": 3, "min_epochs": 9, "max_epochs": None}}, {},
     "invalid config: sweep.asha.min_epochs 9 leaves no rung before the end of stages.1 (9 "
     "epochs); give min_epochs below 9"),
    ({"asha": {"eta": 3, "min_epochs": 1, "max_epochs": None}}, {"epochs": 2,
                                                                  "validate_every_epochs": 2},
     "invalid config: sweep.asha rung at epoch 1 is not validated: stages.1."
     "validate_every_epochs is 2; make sweep.asha.min_epochs a multiple of 2 (or "
     "validate_every_epochs: 1)"),
    ({}, {"stop": {"monitor": None, "patience": 3, "target": None}},
     "invalid config: stages.1.stop.patience stops trials early on its own, and "
     "sweep.scheduler asha stops them too; use one of them (set stages.1.stop.patience: null)"),
])
def test_asha_s_rungs_must_fit_the_last_stage(tmp_path, sweep, stage, message):
    assert _sweep_refusal(_swept(tmp_path, sweep, stage)) == message


def test_asha_s_bounds_are_exact(tmp_path):
    from ddpflow.config.sweepchecks import check_sweep

    fits = _swept(tmp_path, {"asha": {"eta": 3, "min_epochs": 8, "max_epochs": 9}})
    assert _ends(check_sweep, fits) is None


@pytest.mark.parametrize("where, key", [
    ("grid", "stages.1.epochs"),
    ("grid", "stages.01.epochs"),
    ("grid", "stages.1.stop.patience"),
    ("grid", "stages.1"),
    ("grid", "task.monitor"),
    ("random", "stages.1.validate_every_epochs"),
    ("variants", "stages.1.max_steps"),
])
def test_a_scheduled_sweep_may_not_change_its_rungs_or_metric(tmp_path, where, key):
    fixed = {"stages.01.epochs": "stages.1.epochs", "stages.1": "stages.1.epochs"}.get(
        key, "stages.1.stop" if key.startswith("stages.1.stop") else key)
    if where == "grid":
        sweep, shown = {"grid": {key: [1, 2]}}, "sweep.grid"
    elif where == "random":
        sweep = {"grid": {}, "random": {"samples": 2, "seed": 0, "space": {key: [1, 2]}}}
        shown = "sweep.random.space"
    else:
        sweep = {"grid": {}, "variants": [{"name": "v1", "set": {}},
                                          {"name": "v2", "set": {key: 3}}]}
        shown = "sweep.variants 'v2' set"
    assert _sweep_refusal(_swept(tmp_path, sweep)) == (
        f"invalid config: {shown} key '{key}' changes {fixed}, which sweep.scheduler asha "
        f"needs to be the same for every trial (the rungs and the metric they rank by); set "
        f"it once, outside the sweep")


def test_a_scheduled_sweep_resumes_its_trials(tmp_path):
    d = _swept(tmp_path, checkpoint={"resume": "never"})
    assert _sweep_refusal(d) == (
        "invalid config: sweep.scheduler asha resumes paused and stopped trials from their "
        "checkpoints, but checkpoint.resume is never; set checkpoint.resume: auto")


TPE = {"scheduler": "none", "search": "tpe", "grid": {},
       "random": {"samples": 4, "seed": 0, "space": {"stages.1.lr": [0.1, 0.2]}}}


def test_tpe_draws_from_sweep_random_alone(tmp_path):
    from ddpflow.config.sweepchecks import check_sweep

    assert _ends(check_sweep, _swept(tmp_path, TPE)) is None
    assert _sweep_refusal(_swept(tmp_path, {**TPE, "random": None, "grid": {"a": [1]}})) == (
        "invalid config: sweep.search tpe draws its trials from sweep.random's space: set "
        "sweep.random {samples, seed, space} (and no sweep.grid)")
    for key, sweep in (("sweep.grid", {"grid": {"stages.1.lr": [0.3]}}),
                       ("sweep.variants", {"variants": [{"name": "v", "set": {}}]})):
        assert _sweep_refusal(_swept(tmp_path, {**TPE, **sweep})) == (
            f"invalid config: sweep.search tpe draws every trial from sweep.random.space; "
            f"{key} cannot be combined with it (put the setting into the space, e.g. as a "
            f"choice)")
    d = _swept(tmp_path, {**TPE, "scheduler": "asha"})
    assert _ends(check_sweep, d) is None


def _optuna(tmp_path: Path, version: str | None) -> str:
    """A folder on which Python finds optuna `version` installed (None: none)."""
    site = tmp_path / f"site-{version}"
    site.mkdir()
    if version is not None:
        info = site / f"optuna-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: optuna\n"
                                       f"Version: {version}\n")
    return str(site)


def test_tpe_needs_optuna_3_or_newer(tmp_path, monkeypatch):
    import sys

    from ddpflow.config.sweepchecks import check_sweep

    fix = "install it with pip install 'ddpflow[sweep]' (or pip install 'optuna>=3')"
    d = _swept(tmp_path, TPE)
    for version in ("3.0.0", "10.2.1"):
        monkeypatch.setattr(sys, "path", [_optuna(tmp_path, version)])
        assert _ends(check_sweep, d) is None, version
    monkeypatch.setattr(sys, "path", [_optuna(tmp_path, "2.10.1")])
    assert _sweep_refusal(d) == (
        f"invalid config: sweep.search tpe needs Optuna 3 or newer, found 2.10.1: {fix}")
    monkeypatch.setattr(sys, "path", [_optuna(tmp_path, None)])
    assert _sweep_refusal(d) == (
        f"invalid config: sweep.search tpe needs Optuna, which is not installed: {fix}")


# ------------------------------------------------------------------ stages and recipes

def _stages_d(tmp_path, names=("a", "b"), **top) -> dict:
    """A validated config dict with stages `names` (8 epochs each): the dict the checks see."""
    from ddpflow.config import validate

    return validate(tiny_config(tmp_path, stages=[
        {"name": n, "epochs": 8, "batch_size": 8, "lr": 0.1} for n in names], **top))


def test_stage_names_are_unique_also_in_any_case(tmp_path):
    from ddpflow.config.stagechecks import check_stages

    d = _stages_d(tmp_path, ("a", "b", "c"))
    assert check_stages(d) is None
    for i, n in enumerate(("a", "b", "a", "b", "c")):
        d["stages"][i:i + 1] = [{**d["stages"][0], "name": n}]
    assert _refusal(check_stages, d) == (
        "invalid config: stages: stage names must be unique, repeated: a, b; rename one of them")
    d = _stages_d(tmp_path, ("Warm", "main", "cool"))
    d["stages"][2]["name"] = "warm"
    assert _refusal(check_stages, d) == (
        "invalid config: stages: stage names 'Warm' and 'warm' differ only in case, and would "
        "share one folder on a case-insensitive filesystem (macOS, Windows); rename one of them")


def test_profile_stage_is_a_stage(tmp_path):
    from ddpflow.config.stagechecks import check_stages

    d = _stages_d(tmp_path)
    d["profile"]["stage"] = "b"
    assert check_stages(d) is None
    d["profile"]["stage"] = "c"
    assert _refusal(check_stages, d) == (
        "invalid config: profile.stage 'c' is not a stage; stages are: a, b")


def test_init_from_is_checked_for_every_stage(tmp_path):
    from ddpflow.config.stagechecks import check_stages

    d = _stages_d(tmp_path)
    d["stages"][1]["init_from"] = "previous"
    assert check_stages(d) is None
    d["stages"][0]["init_from"] = "previous"
    assert _refusal(check_stages, d) == (
        "invalid config: stages.0.init_from: the first stage has no previous stage; use null or "
        "a path to weights")


@pytest.mark.parametrize("i, init, why", [
    (0, "previous", "the first stage has no previous stage; use null or a path to weights"),
    (2, "Previous", "'Previous' is read as a file name; write previous (lower case) to start "
                    "from the stage before, or ./Previous for a file"),
    (2, "c", "'c' names a stage; stage 'c' is this very stage, which cannot start from its own "
             "result: use previous, null or a path to weights"),
    (2, "d", "'d' names a stage; stage 'd' runs after this one (stage 3), so it has no weights "
             "yet: move it before this stage, or use previous, null or a path to weights"),
    (2, "b", "'b' names a stage; stage 'b' is the stage just before: write init_from: previous"),
    (2, "a", "'a' names a stage; stage 'a' is an earlier stage; init_from takes previous or a "
             "path to a weights file: give that stage's final.pt, or ./a for a file of that "
             "name"),
    (1, "previous", None),
    (0, None, None),
    (0, "weights/a.pt", None),
])
def test_init_from_names_what_it_starts_from(i, init, why):
    from ddpflow.config.stagechecks import _check_init_from

    names = ["a", "b", "c", "d"]
    if why is None:
        assert _check_init_from(i, init, names) is None
    else:
        assert _refusal(_check_init_from, i, init, names) == (
            f"invalid config: stages.{i}.init_from: {why}")


def _recipe_refusal(tmp_path, **stage) -> str | None:
    from ddpflow.config.stagechecks import check_stage_recipe

    d = _stages_d(tmp_path)
    d["stages"][1].update(stage)
    try:
        check_stage_recipe(d)
    except UserError as e:
        return str(e)
    return None


def test_progressive_resizing_grows_to_the_image_size_over_two_epochs(tmp_path):
    def pr(start, end):
        return {"start_size": start, "end_size": end}

    assert _recipe_refusal(tmp_path, progressive_resize=pr(8, 16)) is None
    assert _recipe_refusal(tmp_path, progressive_resize=pr(16, 16), epochs=1) is None
    assert _recipe_refusal(tmp_path, progressive_resize=pr(8, 16), epochs=2) is None
    assert _recipe_refusal(tmp_path, progressive_resize=pr(8, 12)) == (
        "invalid config: stages.1.progressive_resize.end_size: 12 is not data.image_size 16; the "
        "last epochs train at the size validation, evaluate and export use: set end_size: 16")
    assert _recipe_refusal(tmp_path, progressive_resize=pr(20, 16)) == (
        "invalid config: stages.1.progressive_resize.start_size: 20 is larger than end_size 16; "
        "progressive resizing grows the images: set start_size <= 16")
    assert _recipe_refusal(tmp_path, progressive_resize=pr(8, 16), epochs=1) == (
        "invalid config: stages.1.progressive_resize: a stage of 1 epoch trains at start_size 8 "
        "only and never reaches 16; set stages.1.epochs >= 2, or drop progressive_resize")


def test_warm_up_fits_in_the_stage(tmp_path):
    assert _recipe_refusal(tmp_path, warmup_epochs=8) is None
    assert _recipe_refusal(tmp_path, warmup_epochs=9) == (
        "invalid config: stages.1.warmup_epochs: 9 is more than the stage's 8 epoch(s); the "
        "learning rate would never reach lr: set warmup_epochs <= 8")


@pytest.mark.parametrize("stage, message", [
    ({"strategy": "ddp", "reshard_after_forward": False},
     "reshard_after_forward: false is a setting of strategy fsdp, and this stage's strategy is "
     "ddp; drop it, or set strategy: fsdp"),
    ({"strategy": "fsdp", "ema": {"decay": 0.99, "every_steps": 1}},
     "ema: an EMA of the weights is not kept under strategy fsdp (each rank holds a shard of "
     "them); set ema.decay: null, or strategy: ddp"),
    ({"strategy": "fsdp", "compile": True},
     "compile: torch.compile is not offered with strategy fsdp yet; set compile: false, or "
     "strategy: ddp"),
    ({"strategy": "fsdp", "channels_last": True},
     "channels_last: true does not go with strategy fsdp (FSDP2 shards contiguous parameters "
     "only); set channels_last: false or auto (off under fsdp), or strategy: ddp"),
    ({"strategy": "fsdp", "precision": "fp16"},
     "precision: fp16 does not go with strategy fsdp (the GradScaler would skip steps on some "
     "ranks only); set precision: bf16 or fp32, or strategy: ddp"),
    ({"strategy": "fsdp", "channels_last": "auto", "reshard_after_forward": False,
      "precision": "bf16"}, None),
    ({"strategy": "fsdp"}, None),
    ({"strategy": "ddp", "compile": True, "precision": "fp16",
      "ema": {"decay": 0.99, "every_steps": 1}, "channels_last": True}, None),
])
def test_what_a_strategy_goes_with(tmp_path, stage, message):
    got = _recipe_refusal(tmp_path, **stage)
    assert got == (message and f"invalid config: stages.1.{message}")


def test_fp16_under_fsdp_says_when_auto_picked_it():
    from ddpflow.config.stagechecks import check_precision

    assert check_precision("k", "ddp", "fp16") is None
    assert check_precision("k", "fsdp", "bf16") is None
    assert _refusal(check_precision, "k", "fsdp", "fp16", auto=True) == (
        "k.precision: fp16 does not go with strategy fsdp (the GradScaler would skip steps on "
        "some ranks only) (what precision auto picks on a GPU without native bf16); set "
        "precision: bf16 or fp32, or strategy: ddp")


@pytest.mark.parametrize("stage, message", [
    ({"schedule": "step", "lr_step_epochs": 3}, None),
    ({"schedule": "step"},
     "lr_step_epochs: schedule step multiplies the learning rate by lr_gamma every "
     "lr_step_epochs epochs; set it (e.g. 30)"),
    ({"schedule": "cosine", "lr_step_epochs": 3},
     "lr_step_epochs is a setting of schedule step, and this stage's schedule is cosine; drop "
     "it, or set schedule: step"),
    ({"schedule": "multistep", "lr_milestones": [2, 7]}, None),
    ({"schedule": "multistep"},
     "lr_milestones: schedule multistep multiplies the learning rate by lr_gamma at each of "
     "these epochs; list them, e.g. [30, 60]"),
    ({"schedule": "linear", "lr_milestones": [2]},
     "lr_milestones is a setting of schedule multistep, and this stage's schedule is linear; "
     "drop it, or set schedule: multistep"),
    ({"schedule": "multistep", "lr_milestones": [2, 2]},
     "lr_milestones [2, 2]: each epoch once, in increasing order"),
    ({"schedule": "multistep", "lr_milestones": [1, 3, 2]},
     "lr_milestones [1, 3, 2]: each epoch once, in increasing order"),
    ({"schedule": "multistep", "lr_milestones": [2, 8]},
     "lr_milestones: epoch 8 is not inside the stage's 8 epoch(s), so that decay never comes; "
     "list epochs below 8"),
    ({"schedule": "multistep", "lr_milestones": [2, 8], "max_steps": 100}, None),
    ({"schedule": "constant", "lr_min": 0.01},
     "lr_min is where a cosine or linear schedule ends, and this stage's schedule is constant; "
     "drop it, or set schedule: cosine"),
    ({"schedule": "linear", "lr_min": 0.01}, None),
    ({"schedule": "cosine", "lr_min": 0.1},
     "lr_min 0.1 is not below lr 0.1; the schedule decays from lr down to lr_min: set "
     "lr_min < lr"),
])
def test_each_schedule_s_own_keys(tmp_path, stage, message):
    got = _recipe_refusal(tmp_path, **stage)
    assert got == (message and f"invalid config: stages.1.{message}")


def _data_refusal(tmp_path, task=None, **data) -> str | None:
    from ddpflow.config.stagechecks import check_data_recipe

    d = _stages_d(tmp_path)
    aug = data.pop("augment", {})
    d["data"].update(data)
    d["data"]["augment"].update(aug)
    d["task"].update(task or {})
    try:
        check_data_recipe(d)
    except UserError as e:
        return str(e)
    return None


def test_sampling_and_its_weights(tmp_path):
    assert _data_refusal(tmp_path, sampling="weights", sample_weights="m:f") is None
    assert _data_refusal(tmp_path, sampling="balanced") is None
    assert _data_refusal(tmp_path, {"name": "regression"}) is None
    assert _data_refusal(tmp_path, sampling="weights") == (
        "invalid config: data.sampling weights draws each sample by its weight, and "
        "data.sample_weights is null; set it to package.module:callable(labels) returning one "
        "weight per sample")
    assert _data_refusal(tmp_path, sample_weights="m:f") == (
        "invalid config: data.sample_weights is read by data.sampling weights only, and "
        "data.sampling is uniform; set sampling: weights, or drop sample_weights")
    assert _data_refusal(tmp_path, {"name": "regression"}, sampling="balanced") == (
        "invalid config: data.sampling balanced draws each class equally often, and task "
        "regression has no classes; use data.sampling uniform, or weights "
        "(data.sample_weights)")


def test_a_python_dataset_does_its_own_transforms(tmp_path):
    def acts(key):
        return (f"invalid config: data.{key} acts on prepared images; a data.source python "
                f"dataset does its own transforms (or set data.materialize: true)")

    assert _data_refusal(tmp_path, source="python") is None
    assert _data_refusal(tmp_path, source="python", materialize=True,
                         augment={"policy": "randaugment"}, eval_crop_size=12) is None
    assert _data_refusal(tmp_path, augment={"policy": "randaugment"}, eval_crop_size=12) is None
    assert _data_refusal(tmp_path, source="python", augment={"policy": "randaugment"},
                         eval_crop_size=12) == acts("augment.policy")
    assert _data_refusal(tmp_path, source="python", eval_resize_size=20) == acts(
        "eval_resize_size")
    assert _data_refusal(tmp_path, source="python", eval_crop_size=12) == acts("eval_crop_size")


def test_a_policy_s_own_keys_and_augmix_s_severity(tmp_path):
    assert _data_refusal(tmp_path, augment={"policy": "randaugment", "num_ops": 2,
                                            "magnitude": 15}) is None
    for magnitude in (1, 10):
        assert _data_refusal(tmp_path, augment={"policy": "augmix", "magnitude": magnitude}) \
            is None, magnitude
    assert _data_refusal(tmp_path, augment={"policy": "augmix"}) is None
    assert _data_refusal(tmp_path, augment={"policy": "augmix", "num_ops": 2}) == (
        "invalid config: data.augment.num_ops is a setting of policy randaugment, and "
        "data.augment.policy is augmix; drop it, or set the policy")
    assert _data_refusal(tmp_path, augment={"magnitude": 3}) == (
        "invalid config: data.augment.magnitude is a setting of policy randaugment and augmix, "
        "and data.augment.policy is null; drop it, or set the policy")
    for magnitude in (0, 11):
        assert _data_refusal(tmp_path, augment={"policy": "augmix", "magnitude": magnitude}) == (
            f"invalid config: data.augment.magnitude {magnitude} is AugMix's severity, from 1 "
            f"to 10; set it in that range (3 is torchvision's default)")


def test_the_evaluation_crop_is_cut_from_the_resized_image(tmp_path):
    assert _data_refusal(tmp_path, eval_resize_size=16) is None
    assert _data_refusal(tmp_path, eval_resize_size=12, eval_crop_size=12) is None
    assert _data_refusal(tmp_path, eval_resize_size=15) == (
        "invalid config: data.eval_resize_size 15 is smaller than the centre crop it is cut "
        "from (16: data.eval_crop_size or image_size); set it >= 16")
    assert _data_refusal(tmp_path, eval_resize_size=11, eval_crop_size=12) == (
        "invalid config: data.eval_resize_size 11 is smaller than the centre crop it is cut "
        "from (12: data.eval_crop_size or image_size); set it >= 12")


# ------------------------------------------------------------------ loading and validating

def _valid(tmp_path, **top) -> dict:
    from ddpflow.config import validate

    return validate(tiny_config(tmp_path, **top))


def test_deterministic_refuses_compile_anywhere(tmp_path):
    from ddpflow.config.loading import _check_deterministic

    d = _stages_d(tmp_path)
    d["stages"][1]["compile"] = True
    assert _check_deterministic(d) is None  # deterministic: false
    d["deterministic"] = True
    assert _refusal(_check_deterministic, d) == (
        "invalid config: stages.1.compile is true with deterministic: true, but torch.compile's "
        "generated kernels are not covered by deterministic mode; set stages.1.compile: false "
        "(or deterministic: false)")
    d["stages"][1]["compile"] = False
    assert _check_deterministic(d) is None
    d["tune"]["compile"] = True
    assert _refusal(_check_deterministic, d).startswith(
        "invalid config: tune.compile is true with deterministic: true")


def test_batch_options_need_labels_and_prepared_arrays(tmp_path):
    from ddpflow.config.loading import _check_recipe

    d = _stages_d(tmp_path)
    d["stages"][1].update(random_erasing=0.25, cutmix_alpha=1.0)
    assert _check_recipe(d) is None
    d["task"]["name"] = "regression"
    assert _refusal(_check_recipe, d) == (
        "invalid config: stages.1.cutmix_alpha mixes labels, which only task classification "
        "takes (task.name is regression); set it to 0")
    d["stages"][1]["cutmix_alpha"] = 0
    assert _check_recipe(d) is None
    d["data"].update(source="python", materialize=True)
    assert _check_recipe(d) is None
    d["data"]["materialize"] = False
    assert _refusal(_check_recipe, d) == (
        "invalid config: stages.1.random_erasing acts on prepared arrays; a data.source python "
        "dataset does its own transforms (or set data.materialize: true)")


def test_a_source_and_what_it_needs(tmp_path):
    from ddpflow.config.loading import _check_sources

    d = _valid(tmp_path)
    assert _check_sources(d) is None
    d["data"]["factory"] = "m:f"
    assert _refusal(_check_sources, d) == (
        "invalid config: data.factory is set but data.source is 'synthetic'; use data.source: "
        "python")
    d["data"]["source"] = "python"
    assert _check_sources(d) is None
    d["data"]["factory"] = None
    assert _refusal(_check_sources, d) == (
        "invalid config: data.source python needs data.factory, the package.module:callable "
        "that returns a Dataset for a split")
    d["data"].update(source="cifar10", path=None)
    assert _refusal(_check_sources, d) == (
        "invalid config: data.path is required for data.source 'cifar10' (the folder or "
        "archive with the files)")
    d["data"]["path"] = "x"
    assert _check_sources(d) is None


def test_the_store_size_is_resolved_and_holds_the_crop(tmp_path):
    from ddpflow.config.loading import _check_images

    data = {**_valid(tmp_path)["data"], "store_size": None}
    base = copy.deepcopy(data)
    _check_images(data)
    assert data["store_size"] == 16 and data["augment"]["crop_padding"] == 4
    big = {**copy.deepcopy(base), "source": "imagefolder", "image_size": 224}
    _check_images(big)
    assert big["store_size"] == 258  # round(224 x 1.15)
    small = {**copy.deepcopy(base), "store_size": 15}
    assert _refusal(_check_images, small) == (
        "invalid config: data.store_size 15 is smaller than data.image_size 16; the training and "
        "validation crop the stored image: set store_size >= 16 (or null)")
    small["augment"]["random_resized_crop"] = {}
    assert _refusal(_check_images, small).startswith(
        "invalid config: data.store_size 15 is smaller than data.image_size 16; the "
        "augment.random_resized_crop crops from the stored image:")
    same = {**copy.deepcopy(base), "store_size": 16}
    same["augment"]["random_resized_crop"] = {}
    _check_images(same)
    assert same["augment"]["random_resized_crop"] == {"scale": [0.08, 1.0], "ratio": [3 / 4, 4 / 3]}
    assert same["augment"]["crop_padding"] == 0 and same["augment"]["translate"] == 0
    for key in ("scale", "ratio"):
        bad = copy.deepcopy(base)
        bad["augment"]["random_resized_crop"] = {key: [0.9, 0.5]}
        assert _refusal(_check_images, bad) == (
            f"invalid config: data.augment.random_resized_crop.{key} [0.9, 0.5] must be [low, "
            f"high] with low <= high")
    fits = copy.deepcopy(base)
    fits["augment"]["random_resized_crop"] = {"scale": [0.5, 0.5], "ratio": [1.0, 1.0]}
    _check_images(fits)
    assert fits["augment"]["random_resized_crop"] == {"scale": [0.5, 0.5], "ratio": [1.0, 1.0]}
    jpeg = {**copy.deepcopy(base), "encoding": "jpeg", "store_size": 17}
    assert _refusal(_check_images, jpeg).startswith("invalid config: data.encoding jpeg needs")


def test_jpeg_needs_colour_prepared_images_of_an_even_size(tmp_path):
    from ddpflow.config.loading import _check_jpeg

    base = {**_valid(tmp_path)["data"], "encoding": "jpeg", "store_size": 16}
    assert _check_jpeg(base) is None
    assert _check_jpeg({**base, "source": "python", "materialize": True}) is None
    assert _refusal(_check_jpeg, {**base, "grayscale": True}) == (
        "invalid config: data.encoding jpeg stores colour images; grayscale images are small "
        "and compress little: use encoding raw with grayscale, or grayscale: false")
    assert _refusal(_check_jpeg, {**base, "source": "python"}) == (
        "invalid config: data.encoding jpeg is how prepare stores images; a data.source python "
        "dataset is read as it is: set data.materialize: true, or encoding raw")
    for size, fix in ((17, 18), (14, 16), (8, 16)):
        assert _refusal(_check_jpeg, {**base, "store_size": size}) == (
            f"invalid config: data.encoding jpeg needs an even data.store_size of at least 16 "
            f"(it is {size}): JPEG halves the colour planes, and CPU and GPU decoders round an "
            f"odd edge differently; set store_size to {fix} or use encoding raw")


def _endpoint_refusal(tmp_path, **sections) -> str | None:
    from ddpflow.config.loading import _check_endpoints

    d = _valid(tmp_path)
    for name, values in sections.items():
        d[name].update(values)
    try:
        _check_endpoints(d)
    except UserError as e:
        return str(e)
    return d


def test_outside_addresses_name_their_key(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    assert _endpoint_refusal(tmp_path, tracking={"mlflow": {"uri": "ftp://h"}}) == (
        f"invalid config: tracking.mlflow.uri 'ftp://h' has scheme 'ftp:', which MLflow does "
        f"not take; use {FORMS}")
    assert isinstance(_endpoint_refusal(tmp_path, tracking={"mlflow": {"uri": "http://h:1"}}),
                      dict)
    for key in ("image", "base_image"):
        assert _endpoint_refusal(tmp_path, container={key: "Org/X"}) == (
            f"invalid config: container.{key} 'Org/X' is not an image reference: write "
            f"{IMAGE_FORM}")
        assert isinstance(_endpoint_refusal(tmp_path, container={key: "org/x:1"}), dict)
    assert _endpoint_refusal(tmp_path, container={"uri": "org/x"}) == (
        "invalid config: container.uri 'org/x' is not docker://<image>, oras://<image> or a "
        "path to a .sif file (a plain image name needs docker:// in front)")
    for engine in ("none", "apptainer"):
        assert isinstance(_endpoint_refusal(tmp_path, container={"uri": "docker://org/x",
                                                                 "engine": engine}), dict)
    assert _endpoint_refusal(tmp_path, container={"uri": "docker://org/x", "engine": "podman"}) \
        == ("invalid config: container.uri is for engine none (Snakemake runs the rules in it: "
            "--sdm apptainer) or apptainer (the .sif is built from it); engine podman builds "
            "from the Dockerfile: drop the uri or change the engine")
    assert _endpoint_refusal(tmp_path, container={"engine": "docker"})["container"]["uri"] \
        is None
    assert _endpoint_refusal(tmp_path, slurm={"account": "a b"}) == (
        "invalid config: slurm.account 'a b' is not a Slurm account: use letters, digits, '_', "
        "'.' and '-' (e.g. proj-123), no spaces, quotes or ';'")


def test_slurm_gpus_come_from_gres_or_default_to_one(tmp_path):
    def gpus(**slurm):
        return _endpoint_refusal(tmp_path, slurm={"gpus": None, **slurm})

    assert gpus()["slurm"]["gpus"] == 1
    assert gpus(gpus=0)["slurm"]["gpus"] == 0
    assert gpus(gpus=4)["slurm"]["gpus"] == 4
    assert gpus(gres="gpu:a100:4")["slurm"]["gpus"] == 4
    assert gpus(gres="gpu:2", gpus=2)["slurm"]["gpus"] == 2
    assert gpus(gres="gpu:2", gpus=4) == (
        "invalid config: slurm.gres 'gpu:2' asks for 2 GPU(s) and slurm.gpus for 4; give one of "
        "them (gres for clusters that only accept --gres, else gpus)")
    assert gpus(gres="tmp:10") == (
        "invalid config: slurm.gres 'tmp:10' is not gpu:N or gpu:type:N (e.g. gpu:4 or "
        "gpu:a100:4)")
    assert gpus(gres="gpu:0") == (
        "invalid config: slurm.gres 'gpu:0' asks for no GPU; drop slurm.gres and set "
        "slurm.gpus: 0 for a CPU-only job")
    assert gpus(gres="gpu:2", gpu_model="a100") == (
        "invalid config: slurm.gres and slurm.gpu_model both name the GPUs; put the model in "
        "gres (gpu:type:N) and drop gpu_model")
    assert gpus(gpus=0, gpu_model="a100") == (
        "invalid config: slurm.gpu_model 'a100' names a GPU but slurm.gpus is 0 (a CPU-only "
        "job); drop gpu_model or set gpus")
    assert gpus(gpus=1, gpu_model="a100")["slurm"]["gpus"] == 1


def _nested(levels: int):
    """1 inside `levels` lists: its path is `levels` + 1 keys long under a top-level key."""
    out = 1
    for _ in range(levels):
        out = [out]
    return out


@pytest.mark.parametrize("raw, message", [
    ({"a": _nested(40)},
     "invalid config: a.0.0... nests more than 40 levels deep; a config is a few levels of "
     "settings"),
    ({"stages": [{"lr": float("nan")}]},
     "invalid config: stages.0.lr: nan is not a finite number; write a number (no setting "
     "takes nan or infinity)"),
    ({"lr": float("-inf")},
     "invalid config: lr: -inf is not a finite number; write a number (no setting takes nan "
     "or infinity)"),
    ({"seed": 2**63}, "invalid config: seed: a 19-digit number is larger than any setting takes "
                      "(at most 9223372036854775807)"),
    ({"seed": -2**63 - 1}, "invalid config: seed: a 20-digit number is larger than any setting "
                           "takes (at most 9223372036854775807)"),
])
def test_values_no_setting_takes(raw, message):
    from ddpflow.config.loading import _check_values

    assert _refusal(_check_values, raw) == message


def test_values_every_setting_may_take():
    from ddpflow.config.loading import _check_values

    ok = {"a": _nested(39),
          "seed": 2**63 - 1, "low": -2**63 + 1, "on": True, "lr": 1e300,
          "model": {"kwargs": {"x": float("nan"), "big": 10**40}}}
    assert _check_values(ok) is None


def test_integers_written_as_floats_become_integers():
    from ddpflow.config.loading import _coerce_integers, _wants_integer

    assert _wants_integer({"type": "integer"}) is True
    assert _wants_integer({"type": ["integer", "null"]}) is True
    assert _wants_integer({"type": ["integer", "number"]}) is False
    assert _wants_integer({"type": "number"}) is False
    assert _wants_integer({"oneOf": [{"type": "string"}, {"type": "integer"}]}) is True
    assert _wants_integer({"oneOf": [{"type": "string"}]}) is False
    schema = {"properties": {"n": {"type": "integer"}, "x": {"type": "number"},
                             "l": {"type": "array", "items": {"type": "integer"}},
                             "f": {"type": "array"}}}
    out = _coerce_integers({"n": 32.0, "x": 2.0, "l": [1.0, 2.5], "f": [3.0], "free": 4.0},
                           schema)
    assert out == {"n": 32, "x": 2.0, "l": [1, 2.5], "f": [3.0], "free": 4.0}
    assert [type(out[k]) for k in ("n", "x", "f", "free")] == [int, float, list, float]
    assert type(out["l"][0]) is int and type(out["f"][0]) is float


@pytest.mark.parametrize("text, parsed", [
    ("stages.0.lr=0.2", (["stages", "0", "lr"], 0.2)),
    ("run=", (["run"], "")),
    ("a=b=c", (["a"], "b=c")),
    ("data.kwargs={x: [1, 2]}", (["data", "kwargs"], {"x": [1, 2]})),
    ("run=[unclosed", (["run"], "[unclosed")),
])
def test_a_set_override_is_a_dotted_key_and_a_yaml_value(text, parsed):
    from ddpflow.config.loading import parse_override

    assert parse_override(text) == parsed


@pytest.mark.parametrize("text", ["lr", "=1", "a..b=1", ".a=1", "a.=1", "a\tb=1"])
def test_a_malformed_set_says_what_it_expects(text):
    from ddpflow.config.loading import parse_override

    assert _refusal(parse_override, text) == f"--set expects dotted.key=value, got {text!r}"


def test_a_set_value_nested_too_deep_is_one_message():
    from ddpflow.config.loading import parse_override

    assert _refusal(parse_override, "model.kwargs.x=" + "[" * 5000 + "]" * 5000) == (
        "--set model.kwargs.x: the value nests deeper than Python can read; a setting is a few "
        "levels deep")


def test_set_key_walks_mappings_and_list_indices():
    from ddpflow.config.loading import set_key

    d = {"stages": [{"name": "a"}, {"name": "b"}], "run": "r"}
    set_key(d, ["stages", "1", "lr"], 0.5)
    set_key(d, ["stages", "0"], {"name": "z"})
    set_key(d, ["data", "augment", "flip"], False)
    assert d == {"stages": [{"name": "z"}, {"name": "b", "lr": 0.5}], "run": "r",
                 "data": {"augment": {"flip": False}}}
    assert _refusal(set_key, d, ["stages", "2", "lr"], 1) == (
        "--set stages.2.lr: '2' is not an index of stages (0..1)")
    assert _refusal(set_key, d, ["stages", "x"], 1, "stage") == (
        "stage stages.x: 'x' is not an index of stages (0..1)")
    assert _refusal(set_key, d, ["stages", "٣"], 1) == (
        "--set stages.٣: '٣' is not an index of stages (0..1)")
    assert _refusal(set_key, [1], ["5"], 1) == "--set 5: '5' is not an index of the list (0..0)"
    assert _refusal(set_key, d, ["run", "x", "y"], 1) == (
        "--set run.x.y: run.x is not a mapping or list")
    assert d["run"] == "r"


def test_overrides_apply_in_order_to_a_copy(tmp_path):
    from ddpflow.config import apply_overrides, load_config

    raw = {"run": "r", "stages": [{"name": "a"}]}
    out = apply_overrides(raw, ["run=s", "run=t", "stages.0.lr=0.5"])
    assert out == {"run": "t", "stages": [{"name": "a", "lr": 0.5}]}
    assert raw == {"run": "r", "stages": [{"name": "a"}]}
    assert apply_overrides(raw, None) == raw
    p = tmp_path / "c.yaml"
    import yaml

    p.write_text(yaml.safe_dump(tiny_config(tmp_path)))
    cfg = load_config(p, ["stages.0.lr=0.25"])
    assert cfg.stages[0].lr == 0.25 and cfg.run == "t"
    assert load_config(p).stages[0].lr == 0.05


def test_validate_fills_defaults_coerces_and_refuses_in_one_message(tmp_path):
    from ddpflow.config import from_dict, validate

    raw = tiny_config(tmp_path, task="regression", seed=3.0)
    d = validate(raw)
    assert d["task"] == {"name": "regression", "kwargs": {}, "monitor": None, "mode": "auto"}
    assert d["seed"] == 3 and type(d["seed"]) is int and raw["seed"] == 3.0
    assert d["slurm"]["gpus"] == 1 and d["data"]["store_size"] == 16
    d["checkpoint"]["keep_last"] = 99
    assert validate(tiny_config(tmp_path))["checkpoint"]["keep_last"] == 3
    assert validate(tiny_config(tmp_path))["sweep"]["grid"] == {}
    d2 = validate(tiny_config(tmp_path))
    d2["sweep"]["grid"]["x"] = [1]
    assert validate(tiny_config(tmp_path))["sweep"]["grid"] == {}  # defaults are copies
    assert type(from_dict(tiny_config(tmp_path))).__name__ == "Config"
    assert _refusal(validate, ["run"]) == "the config must be a YAML mapping of keys to values"
    assert _refusal(validate, {"model": {"kwargs": {"x": _nested(5000)}}}) == (
        "invalid config: model.kwargs.x... nests more than 40 levels deep; a config is a few "
        "levels of settings")
    assert _refusal(validate, {"seed": 1e100, "stages": [{"name": "a"}]}) == (
        "invalid config: seed: a 101-digit number is larger than any setting takes (at most "
        "9223372036854775807)")
    both = _refusal(validate, tiny_config(tmp_path, seed=-1, log_every_steps=0, run=5))
    assert both.startswith("invalid config: log_every_steps") and both.count("; ") >= 2
    assert both.index("log_every_steps") < both.index("run") < both.index("seed")


@pytest.mark.parametrize("top, words", [
    ({"stages": [{"name": "a"}, {"name": "a"}]}, "stage names must be unique"),
    ({"data": {"source": "python"}}, "data.source python needs data.factory"),
    ({"data": {"store_size": 8}}, "data.store_size 8 is smaller"),
    ({"slurm": {"gres": "gpu:0"}}, "asks for no GPU"),
    ({"task": "regression", "stages": [{"name": "a", "mixup_alpha": 0.2}]}, "mixes labels"),
    ({"stages": [{"name": "a", "warmup_epochs": 99}]}, "warmup_epochs: 99"),
    ({"data": {"sampling": "weights"}}, "data.sample_weights is null"),
    ({"deterministic": True, "stages": [{"name": "a", "compile": True}]}, "deterministic mode"),
    ({"sweep": {"scheduler": "asha"}}, "has no trials to run"),
])
def test_validate_runs_every_check(tmp_path, top, words):
    from ddpflow.config import validate

    assert words in _refusal(validate, tiny_config(tmp_path, **top))
