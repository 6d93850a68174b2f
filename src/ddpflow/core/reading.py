"""Reading a file ddpflow did not just write (a manifest, meta.json, a summary, tune.json, a
plan, a log it resends): the one boundary every such reader goes through.

A file is read whole, capped in size, decoded as UTF-8, parsed as JSON and validated against
a JSON-Schema (kept next to the code that writes the file) before any field is used. Every
way it can be wrong (missing, a folder, empty, truncated, not JSON, not UTF-8, too big, a
list where an object belongs, keys missing, wrong types, values out of range) is one
`UserError` naming the file, the field and what to do; a path named inside a file is kept
inside its folder by `inside`. No torch here (core stays light).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import jsonschema

from ddpflow.core.errors import UserError, short

MAX_BYTES = 64 << 20  # no file ddpflow writes for itself to read comes near this
REMAKE = "re-run the command that made it"
NOT_OURS = "it was not written by ddpflow (or was edited)"
FOREIGN = f"{NOT_OURS}; {REMAKE}"


def _where(path) -> str:
    """'a.b.0'; a key that is not a plain name as its repr, capped: one line, always."""
    return ".".join(str(p) if str(p).replace("_", "a").replace("-", "a").isalnum()
                    and len(str(p)) <= 40 else short(p, 40) for p in path) or "(top level)"


def problem(err: jsonschema.ValidationError) -> str:
    """'<field path>: <problem>' of one jsonschema error, in a reader's words."""
    where, v, want = _where(err.absolute_path), err.validator, err.validator_value
    if v == "required":
        missing = [k for k in want if isinstance(err.instance, dict) and k not in err.instance]
        key = missing[0] if missing else want[0]
        return f"{'' if where == '(top level)' else where + '.'}{key}: missing"
    if v == "type":
        want = " or ".join(want) if isinstance(want, list) else want
        return f"{where}: {short(err.instance)} is not of type '{want}'"
    if v == "const":
        return f"{where}: {short(err.instance)} is not {want!r}"
    if v == "enum":
        return f"{where}: {short(err.instance)} is not one of {', '.join(map(repr, want))}"
    if v in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        words = {"minimum": "below the minimum", "maximum": "above the maximum",
                 "exclusiveMinimum": "not above", "exclusiveMaximum": "not below"}[v]
        return f"{where}: {short(err.instance)} is {words} {want}"
    if v in ("minItems", "maxItems", "minProperties", "maxProperties"):
        bound = "at least" if v.startswith("min") else "at most"
        return f"{where}: {len(err.instance)} item(s), expected {bound} {want}"
    if v == "pattern" and want.startswith("^[A-Za-z0-9_]"):
        return (f"{where}: {short(err.instance)} is not a plain name (letters, digits, '.', "
                f"'_', '-'; no '/', no leading '.')")
    if v in ("minLength", "maxLength", "pattern"):
        return f"{where}: {short(err.instance)} is not allowed here ({v} {short(want, 40)})"
    return f"{where}: {short(err.message, 200)}"


def validate(value: Any, schema: dict, path: Path | str, what: str, fix: str = FOREIGN) -> Any:
    """`value` if it matches `schema`, else UserError '<path> (<what>): <field>: <problem>'."""
    try:
        err = jsonschema.exceptions.best_match(
            jsonschema.Draft202012Validator(schema).iter_errors(value))
    except RecursionError:  # nested deeper than any schema looks
        raise UserError(f"{path} ({what}) is nested too deeply to be a file ddpflow wrote; "
                        f"{fix}") from None
    if err is not None:
        raise UserError(f"{path} ({what}): {problem(err)}; {fix}")
    return value


def read_text(path: Path | str, what: str, fix: str = REMAKE,
              max_bytes: int = MAX_BYTES, empty_ok: bool = False) -> str:
    """A file's whole text: missing, a folder, too big, not UTF-8 or empty (unless
    `empty_ok`) is one UserError."""
    path = Path(path)
    try:
        if not stat.S_ISREG(os.stat(path).st_mode) and not path.is_dir():  # a FIFO blocks
            raise UserError(f"{path} ({what}) is not a regular file; {fix}")
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:
                raise UserError(f"{path} ({what}) is {size / 1e6:.1f} MB, more than the "
                                f"{max_bytes / 1e6:.0f} MB such a file ever has; {NOT_OURS}; {fix}")
            data = f.read(max_bytes + 1)
    except IsADirectoryError:
        raise UserError(f"{path} ({what}) is a folder, not a file; {fix}") from None
    except FileNotFoundError:
        raise UserError(f"{path} ({what}) does not exist; {fix}") from None
    except OSError as e:
        raise UserError(f"{path} ({what}) cannot be read ({e.strerror or e}); check its "
                        f"permissions, or {fix}") from None
    if len(data) > max_bytes:  # grew while read
        raise UserError(f"{path} ({what}) is larger than {max_bytes / 1e6:.0f} MB; {fix}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path} ({what}) is not UTF-8 text (byte {e.start}); {NOT_OURS}; "
                        f"{fix}") from None
    if not text.strip() and not empty_ok:
        raise UserError(f"{path} ({what}) is empty (a write cut short); {fix}")
    return text


def parse(text: str, path: Path | str, what: str, fix: str = REMAKE) -> Any:
    """JSON text -> value; not JSON (or truncated) is one UserError naming the place."""
    try:
        return json.loads(text)
    except ValueError as e:  # JSONDecodeError, or an integer too long to convert
        where = (f" at line {e.lineno} column {e.colno}: {e.msg}"
                 if isinstance(e, json.JSONDecodeError) else f": {short(str(e), 100)}")
        raise UserError(f"{path} ({what}) is not valid JSON{where} (truncated, or not "
                        f"written by ddpflow); {fix}") from None
    except RecursionError:
        raise UserError(f"{path} ({what}) is nested too deeply to be a file ddpflow wrote; "
                        f"{fix}") from None


def read_json(path: Path | str, schema: dict, what: str, fix: str = REMAKE,
              max_bytes: int = MAX_BYTES) -> Any:
    """A JSON file validated against `schema` before any field is used; UserError otherwise."""
    value = parse(read_text(path, what, fix, max_bytes), path, what, fix)
    return validate(value, schema, path, what, fix)


def read_json_if_present(path: Path | str, schema: dict, what: str, fix: str = REMAKE,
                         max_bytes: int = MAX_BYTES) -> Any | None:
    """None when the file does not exist ("not done yet"); a file that is there is read as
    `read_json` reads it: valid, or one UserError (a folder in its place included)."""
    if not os.path.lexists(path):
        return None
    return read_json(path, schema, what, fix, max_bytes)


def read_json_or_none(path: Path | str, schema: dict, what: str,
                      max_bytes: int = MAX_BYTES) -> Any | None:
    """The value, or None for anything `read_json` refuses: for files whose absence or
    damage only means "do it again" (a cache, a record ddpflow rewrites next time)."""
    try:
        return read_json(path, schema, what, max_bytes=max_bytes)
    except UserError:
        return None


def existing(path: Path | str, what: str, fix: str, folder: bool = False) -> Path:
    """`path` as a Path when it is a file (folder=False) or a folder (folder=True); otherwise
    one UserError that says which it is: missing, a folder where a file belongs, a file where
    a folder belongs, or neither (a FIFO, a device)."""
    path = Path(path)
    want = "folder" if folder else "file"
    if not os.path.lexists(path):
        why = "does not exist"
    elif not path.exists():
        why = "is a broken symlink"
    elif path.is_dir():
        if folder:
            return path
        why = "is a folder, not a file"
    elif path.is_file():
        if not folder:
            return path
        why = "is a file, not a folder"
    else:
        why = f"is not a regular {want}"
    raise UserError(f"{what}: {path} {why}; {fix}")


def inside(folder: Path | str, name: Any, what: str, fix: str = REMAKE) -> Path:
    """folder/name, for a path `what` (e.g. "<file>: files.onnx.file") names: a relative
    path that stays in `folder`, symlinks resolved; otherwise one UserError with the value."""
    folder = Path(folder)
    if not isinstance(name, str) or not name or "\0" in name:
        why = "is not a file name"
    elif os.path.isabs(name) or name.startswith("~"):
        why = "is an absolute path"
    elif ".." in Path(name).parts:
        why = "goes up with '..'"
    else:
        path = folder / name
        try:
            real, top = path.resolve(), folder.resolve()
        except (OSError, RuntimeError):  # a symlink loop
            why = "is a symlink that cannot be resolved"
        else:
            if real == top or top in real.parents:
                return path
            why = f"is a symlink to {real}"
    raise UserError(f"{what}: {short(name)} {why}, outside {folder}: a file names only paths "
                    f"inside its own folder; {NOT_OURS}; {fix}")


def read_jsonl(path: Path | str, schema: dict, what: str, fix: str = REMAKE,
               max_bytes: int = MAX_BYTES, cut_ok: bool = True) -> tuple[list, list[int]]:
    """(records, bad line numbers) of a line log: one JSON value per line, each validated by
    `schema`. A last line without its newline that does not parse is a write cut short by a
    kill: skipped silently (`cut_ok`, else counted as bad). Any other line that is not JSON
    or does not match is skipped and its number returned (the caller says so); the file
    itself missing, a folder, too big or not UTF-8 is one UserError as in `read_text` (an
    empty file is no records)."""
    lines = read_text(path, what, fix, max_bytes, empty_ok=True).split("\n")
    cut = len(lines) - 1  # the part after the last newline: "" unless a write was cut short
    records, bad = [], []
    validator = jsonschema.Draft202012Validator(schema)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
            ok = validator.is_valid(value)
        except (ValueError, RecursionError):
            ok = False
        if ok:
            records.append(value)
        elif i != cut or not cut_ok:
            bad.append(i + 1)
    return records, bad
