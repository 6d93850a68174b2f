"""jsonschema's validation errors in the words a user reads: where, what, and what YAML
did to the value when that explains it."""

from __future__ import annotations

import re

import jsonschema

from ddpflow.core.errors import short


def _where(path) -> str:
    return ".".join(_part(p) for p in path) or "(top level)"


def _part(p) -> str:
    """A key of the path as written, or quoted when it holds what a line cannot show
    (a carriage return, a tab, an empty or padded key)."""
    s = str(p)
    return s if s and s.isprintable() and s.strip() == s else repr(s)


_FLOAT_TEXT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def _yaml_hint(err: jsonschema.ValidationError) -> str:
    """What YAML did to the value, where that explains the error."""
    value = err.instance
    if isinstance(value, str) and _FLOAT_TEXT.match(value.strip()):
        return (f" (YAML 1.1 reads {short(value.strip(), 30)} as text: write it with a dot "
                f"and a signed exponent, e.g. 1.0e-3)")
    if isinstance(value, bool) and err.validator in ("type", "pattern", "enum"):
        return (" (YAML reads yes/no/on/off/true/false as a boolean: quote it, e.g. "
                "name: 'no')")
    return ""


def yaml_text(value) -> str:
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return repr(value)


def message(err: jsonschema.ValidationError) -> str:
    where = _where(err.absolute_path)
    hint = _yaml_hint(err)
    if err.validator == "additionalProperties":
        allowed = sorted(err.schema.get("properties", {}))
        extra = sorted(set(err.instance) - set(allowed))
        names = [(str(k) if str(k).isprintable() else repr(str(k)))[:40]  # one line
                 for k in extra[:5]] + (["..."] if len(extra) > 5 else [])
        prefix = "" if where == "(top level)" else where + "."
        shown = names[0] if len(names) == 1 else "{" + ", ".join(names) + "}"
        return f"unknown key {prefix}{shown}; allowed keys here: {', '.join(allowed)}"
    if err.validator == "enum":
        # as YAML writes them: true/false/null, not Python's True/False/None
        allowed = ", ".join(yaml_text(v) for v in err.validator_value)
        return f"{where}: {short(err.instance)} is not one of {allowed}{hint}"
    if err.validator == "oneOf":
        options = []
        for sub in err.validator_value:
            options.append(repr(sub["const"]) if "const" in sub else
                           f"{sub.get('type')} >= {sub.get('minimum')}")
        return f"{where}: {short(err.instance)} is not allowed; use {' or '.join(options)}{hint}"
    if err.validator == "type":
        want = err.validator_value
        want = " or ".join(want) if isinstance(want, list) else want
        return f"{where}: {short(err.instance)} is not of type '{want}'{hint}"
    if err.validator == "pattern" and err.validator_value.startswith("^val_"):
        return (f"{where}: {short(err.instance)} is not a validation metric name: write "
                f"val_<metric>, e.g. val_loss or val_acc{hint}")
    if err.validator == "pattern" and err.schema.get("x-refuses"):  # characters a tool refuses
        return (f"{where}: {short(err.instance)} holds a character that "
                f"{err.schema['x-refuses']}; choose a name without it{hint}")
    if err.validator == "pattern" and ":" in err.validator_value:
        return (f"{where}: {short(err.instance)} is not an import path: write "
                f"package.module:callable{hint}")
    if err.validator == "pattern" and err.schema.get("examples"):  # a form, not a name
        shown = " or ".join(str(x) for x in err.schema["examples"])
        what = err.schema.get("description", "of the expected form")
        return f"{where}: {short(err.instance)} is not {what}: write it like {shown}{hint}"
    if err.validator == "pattern":
        return (f"{where}: {short(err.instance)} is not a valid name: use letters, digits, "
                f"'.', '_' and '-', starting with a letter or digit{hint}")
    if err.validator == "minItems" and isinstance(err.instance, list):
        return (f"{where}: {'is empty' if not err.instance else 'has too few values'}; give "
                f"at least {err.validator_value} value(s)")
    if err.validator == "minProperties" and isinstance(err.instance, dict) and not err.instance:
        return f"{where}: is empty; give at least {err.validator_value} key(s)"
    if err.validator == "maxLength":
        return f"{where}: {short(err.instance)} is longer than {err.validator_value} characters"
    if err.validator in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        return f"{where}: {short(err.instance)} {err.message.split(' ', 1)[1]}"
    text = " ".join(err.message.split())  # jsonschema's own words, on one line, capped
    return f"{where}: {text if len(text) <= 200 else text[:196] + ' ...'}"
