"""config/messages.py: each kind of jsonschema error in a user's words, one line, naming the
key as written (quoted when a line cannot show it) and what YAML did to the value where that
explains it. Errors made by jsonschema itself from small schemas, then one through a whole
config. Fast."""

from __future__ import annotations

import jsonschema
import pytest

from ddpflow.config.messages import _part, message, yaml_text


def _msg(schema: dict, value) -> str:
    err = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(schema).iter_errors(value))
    assert err is not None
    text = message(err)
    assert "\n" not in text
    return text


def _at(inner: dict) -> dict:
    """inner as the schema of key a.b"""
    return {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": inner}}}}


@pytest.mark.parametrize("key, shown", [
    ("lr", "lr"), ("a b", "a b"), ("", "''"), (" lr", "' lr'"), ("lr\t", "'lr\\t'"),
    ("x\ry", "'x\\ry'"), (3, "3")])
def test_a_key_is_shown_as_written_or_quoted(key, shown):
    assert _part(key) == shown


@pytest.mark.parametrize("value, text", [(True, "true"), (False, "false"), (None, "null"),
                                         ("x", "'x'"), (1.5, "1.5")])
def test_values_are_shown_as_yaml_writes_them(value, text):
    assert yaml_text(value) == text


def test_unknown_keys_are_named_with_the_allowed_ones():
    schema = {"type": "object", "properties": {"lr": {}, "epochs": {}},
              "additionalProperties": False}
    assert _msg(_at(schema), {"a": {"b": {"lrr": 1}}}) == (
        "unknown key a.b.lrr; allowed keys here: epochs, lr")
    assert _msg(schema, {"x": 1, "y": 2}) == "unknown key {x, y}; allowed keys here: epochs, lr"
    five = {f"k{i}": 1 for i in range(5)}
    assert _msg(schema, five) == "unknown key {k0, k1, k2, k3, k4}; allowed keys here: epochs, lr"
    six = {f"k{i}": 1 for i in range(6)}
    assert _msg(schema, six) == ("unknown key {k0, k1, k2, k3, k4, ...}; allowed keys here: "
                                 "epochs, lr")
    many = {f"k{i}": 1 for i in range(7)}
    assert _msg(schema, many) == ("unknown key {k0, k1, k2, k3, k4, ...}; allowed keys here: "
                                  "epochs, lr")
    assert _msg(schema, {"a\tb": 1}) == "unknown key 'a\\tb'; allowed keys here: epochs, lr"
    assert _msg(schema, {"z" * 50: 1}) == f"unknown key {'z' * 40}; allowed keys here: epochs, lr"


def test_a_value_not_among_the_choices_is_told_the_choices_in_yaml():
    assert _msg(_at({"enum": ["fp32", True, None]}), {"a": {"b": "fp64"}}) == (
        "a.b: 'fp64' is not one of 'fp32', true, null")
    assert _msg({"enum": ["a", "b"]}, "no") == "(top level): 'no' is not one of 'a', 'b'"


def test_one_of_names_each_option():
    schema = {"oneOf": [{"const": "auto"}, {"type": "integer", "minimum": 1}]}
    err, = jsonschema.Draft202012Validator(_at(schema)).iter_errors({"a": {"b": 0}})
    assert message(err) == "a.b: 0 is not allowed; use 'auto' or integer >= 1"


@pytest.mark.parametrize("value, hint", [
    ("1e-3", " (YAML 1.1 reads '1e-3' as text: write it with a dot and a signed exponent, "
             "e.g. 1.0e-3)"),
    (" 5e4 ", " (YAML 1.1 reads '5e4' as text: write it with a dot and a signed exponent, "
              "e.g. 1.0e-3)"),
    ("fast", ""),
])
def test_a_number_yaml_read_as_text_says_so(value, hint):
    assert _msg(_at({"type": "number"}), {"a": {"b": value}}) == (
        f"a.b: {value!r} is not of type 'number'{hint}")


def test_a_boolean_where_a_name_belongs_says_what_yaml_did():
    assert _msg(_at({"type": "string"}), {"a": {"b": False}}) == (
        "a.b: False is not of type 'string' (YAML reads yes/no/on/off/true/false as a "
        "boolean: quote it, e.g. name: 'no')")
    assert _msg(_at({"type": ["string", "null"]}), {"a": {"b": 3}}) == (
        "a.b: 3 is not of type 'string or null'")
    # any other error: jsonschema's own words, unquoted, on one line
    assert _msg(_at({"const": 1}), {"a": {"b": True}}) == "a.b: 1 was expected"
    long = _msg(_at({"const": "x" * 300}), {"a": {"b": 0}})
    assert long.startswith("a.b: 'xxx") and long.endswith(" ...") and len(long) == 5 + 200


@pytest.mark.parametrize("schema, value, text", [
    ({"type": "string", "pattern": "^val_"}, "loss",
     "a.b: 'loss' is not a validation metric name: write val_<metric>, e.g. val_loss or val_acc"),
    ({"type": "string", "pattern": "^[a-z]+$", "x-refuses": "Slurm refuses in a name"}, "a;b",
     "a.b: 'a;b' holds a character that Slurm refuses in a name; choose a name without it"),
    ({"type": "string", "pattern": "^[a-z.]+:[a-z]+$"}, "pkg.mod",
     "a.b: 'pkg.mod' is not an import path: write package.module:callable"),
    ({"type": "string", "pattern": "^[0-9]+[gm]$", "examples": ["16g", "512m"],
      "description": "a size"}, "16 GB", "a.b: '16 GB' is not a size: write it like 16g or 512m"),
    ({"type": "string", "pattern": "^[0-9]+[gm]$", "examples": ["16g"]}, "x",
     "a.b: 'x' is not of the expected form: write it like 16g"),
    ({"type": "string", "pattern": "^[a-z]+$"}, "A!",
     "a.b: 'A!' is not a valid name: use letters, digits, '.', '_' and '-', starting with a "
     "letter or digit"),
    ({"type": "array", "minItems": 2}, [], "a.b: is empty; give at least 2 value(s)"),
    ({"type": "array", "minItems": 2}, [1], "a.b: has too few values; give at least 2 value(s)"),
    ({"type": "object", "minProperties": 1}, {}, "a.b: is empty; give at least 1 key(s)"),
    ({"type": "string", "maxLength": 3}, "abcd", "a.b: 'abcd' is longer than 3 characters"),
    ({"type": "number", "minimum": 1}, 0, "a.b: 0 is less than the minimum of 1"),
    ({"type": "number", "exclusiveMaximum": 1}, 1,
     "a.b: 1 is greater than or equal to the maximum of 1"),
    ({"type": "array", "maxItems": 1}, [1, 2], "a.b: [1, 2] is too long"),
])
def test_each_kind_of_error_in_a_users_words(schema, value, text):
    assert _msg(_at(schema), {"a": {"b": value}}) == text
