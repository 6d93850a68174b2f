"""Text that reaches an interpreter: a shell, a spreadsheet, a browser.

Every value ddpflow puts into such text (a path from the config, a class or file name, a
sweep key, a reason from a log) goes through one function here, so a value is always data,
never code:

    shell_word(s), shell_line(words)   a POSIX shell word / line (`shlex.quote`): a space,
                                       `$(...)`, a backtick, `;` or a newline stay inside
                                       the one argument they belong to
    path_arg(p)                        a path argument never read as an option (`./-x`)
    format_literal(text)               text a str.format template takes as written
                                       (Snakemake's shell() and shell.prefix() format their
                                       argument with the caller's variables)
    csv_cell(value), write_csv(...)    a CSV cell a spreadsheet shows, never evaluates: a
                                       text starting with = + - @ tab or CR gets a leading
                                       ' (OWASP); numbers stay numbers
    html_text(s)                       text and attribute values in HTML (`html.escape`)

Light on purpose (standard library only): the workflow's .smk files import it too.
"""

from __future__ import annotations

import csv
import html
import io
import math
import os
import re
import shlex
from collections.abc import Iterable, Mapping
from typing import Any

# --------------------------------------------------------------------------- shell


def shell_word(value: Any) -> str:
    """One shell word that means exactly `value` (a str or a path) to sh, bash and zsh."""
    return shlex.quote(os.fspath(value) if isinstance(value, os.PathLike) else str(value))


def shell_line(words: Iterable[Any]) -> str:
    """A command line whose words are exactly `words`: what to print for a user to copy,
    or to hand to a shell."""
    return " ".join(shell_word(w) for w in words)


def path_arg(path: Any) -> str:
    """A path as a command-line argument no option parser reads as an option: a relative
    path starting with `-` (results_dir "-runs") gets `./` in front; the same file."""
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    return f"./{text}" if text.startswith("-") else text


def format_literal(text: str) -> str:
    """`text` for a str.format template, taken as written: braces doubled. Snakemake's
    shell() and shell.prefix() format their argument, so a quoted line built in Python
    goes through this before it is handed to them (a `{` in a path would else be a field)."""
    return text.replace("{", "{{").replace("}", "}}")


# --------------------------------------------------------------------------- CSV

# what makes a spreadsheet (Excel, LibreOffice, Google Sheets) read a cell as a formula
FORMULA_LEADS = ("=", "+", "-", "@", "\t", "\r")
# a plain decimal number: a spreadsheet reads it as that number, never as a formula
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


def csv_cell(value: Any) -> Any:
    """A CSV cell that a spreadsheet shows as data. Numbers (int, finite float, and text
    that is a plain decimal number such as "-0.5") stay numbers; None is an empty cell;
    any other text starting with = + - @ tab or CR gets a leading ' (OWASP CSV injection),
    which the spreadsheet shows but does not evaluate."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int) or (isinstance(value, float) and math.isfinite(value)):
        return value
    text = str(value)
    if text.startswith(FORMULA_LEADS) and not _NUMBER.fullmatch(text):
        return "'" + text
    return text


def csv_text(header: list[str], rows: Iterable[Mapping | Iterable]) -> str:
    """The CSV text of `header` and `rows`, every cell (the header's too) through
    csv_cell. A row is a sequence in header order or a mapping (keys not in the header
    are left out, missing keys are empty cells)."""
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow([csv_cell(h) for h in header])
    for row in rows:
        cells = [row.get(h) for h in header] if isinstance(row, Mapping) else row
        w.writerow([csv_cell(c) for c in cells])
    return buf.getvalue()


def write_csv(target, header: list[str], rows: Iterable[Mapping | Iterable],
              what: str | None = None) -> None:
    """Write csv_text(header, rows) to an open text file, or to a path whole or not at all
    (core.writing.write_text_atomic; `what` names the output in its one-line errors)."""
    text = csv_text(header, rows)
    if hasattr(target, "write"):
        target.write(text)
        return
    from ddpflow.core.writing import write_text_atomic  # here: the .smk files import this

    write_text_atomic(target, text, what)


# --------------------------------------------------------------------------- HTML


def html_text(value: Any) -> str:
    """`value` as HTML text or a quoted attribute value: & < > " ' escaped."""
    return html.escape(str(value), quote=True)
