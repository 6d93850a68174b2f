"""The user's own code: import paths `package.module:callable`, the folders they live in,
and the fingerprint of those folders that decides what reruns when the user edits them.

Every seam a user replaces (model builder, dataset factory, task) is reached through
`load_callable`, so every one fails the same way: one message naming the setting, the
import path and the cause, never a traceback from inside importlib.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

from ddpflow.core.errors import UserError, short
from ddpflow.core.reading import existing

IMPORT_PATH_HELP = "write it as package.module:callable (the module importable from a code_dir)"


def is_import_path(text: str | None) -> bool:
    return isinstance(text, str) and ":" in text and not text.startswith("timm:")


def add_code_dirs(cfg) -> None:
    """Put the user's code folders (model.code_dir, data.code_dir) first on sys.path: every
    rank, prepare and the launcher's checks call this (build_model too, for model.code_dir:
    every command that builds a model finds the user's module the same way)."""
    for setting, folder in (("model.code_dir", cfg.model.code_dir),
                            ("data.code_dir", cfg.data.code_dir)):
        add_code_dir(folder, setting)


def add_code_dir(folder: str | None, setting: str) -> None:
    """One code folder (the value of `setting`) first on sys.path; None: nothing to add."""
    if not folder:
        return
    existing(folder, setting, "point it at the folder that holds your Python modules "
             "(relative paths start where ddpflow or snakemake runs)", folder=True)
    path = str(Path(folder).resolve())
    if path not in sys.path:
        sys.path.insert(0, path)


def _origin(err: BaseException) -> str:
    """'file.py:line' of the innermost frame of the user's code that raised."""
    frames = traceback.extract_tb(err.__traceback__)
    mine = str(Path(__file__).resolve().parent.parent)  # all of ddpflow
    user = [f for f in frames if not f.filename.startswith(mine)
            and "importlib" not in f.filename]
    return f" at {Path(user[-1].filename).name}:{user[-1].lineno}" if user else ""


def cause(err: BaseException) -> str:
    """One line: the exception type, its first line, and where in the user's code it rose."""
    first = (str(err).splitlines() or [""])[0][:200]
    return f"{type(err).__name__}: {first}{_origin(err)}"


def load_callable(spec: str, setting: str) -> Callable:
    """The callable that `spec` ('pkg.mod:name' or 'pkg.mod:Class.attr') names."""
    if not is_import_path(spec):
        raise UserError(f"{setting}: {short(spec)} is not an import path; {IMPORT_PATH_HELP}")
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UserError(f"{setting}: {short(spec)} is not an import path; {IMPORT_PATH_HELP}")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise UserError(f"{setting}: module '{module_name}' was not found; set "
                            f"model.code_dir (or data.code_dir) to the folder that holds it, "
                            f"or install it") from None
        raise UserError(f"{setting}: importing '{module_name}' failed ({cause(e)})") from None
    except Exception as e:  # noqa: BLE001 - the user's module raised while importing
        raise UserError(f"{setting}: importing '{module_name}' failed ({cause(e)})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UserError(f"{setting}: '{module_name}' has no attribute '{attr}'")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UserError(f"{setting}: '{spec}' is not callable")
    return obj


def call(fn: Callable, setting: str, args: tuple = (), optional: dict | None = None,
         kwargs: dict | None = None):
    """fn(*args, **kwargs, **the optional arguments fn accepts); a user error names setting.

    `optional` holds what ddpflow offers (num_classes, in_channels, ...): passed only where
    the callable has a parameter of that name (or **kwargs)."""
    offered = {k: v for k, v in (optional or {}).items() if v is not None}
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature: offer nothing extra
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    given = dict(kwargs or {})
    extra = {k: v for k, v in offered.items()
             if k not in given and (takes_any or k in params)}
    try:
        return fn(*args, **given, **extra)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's callable raised
        raise UserError(f"{setting}: calling {getattr(fn, '__qualname__', fn)} failed "
                        f"({cause(e)})") from None


def dir_fingerprint(folder: str | None) -> str | None:
    """Hash of the Python files (and their names) under a user's code folder; None if unset.
    Compiled caches and hidden folders are left out: running the code must not change it."""
    if not folder:
        return None
    root = Path(folder)
    if not root.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root)
        if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
            continue
        h.update(str(rel).encode() + b"\0")
        h.update(f.read_bytes())
    return h.hexdigest()[:16]
