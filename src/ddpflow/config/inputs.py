"""The files a command reads, as far as its command line and config say: what `--log` may
never be (a swapped argument or a tab completion once truncated the config before it was
read: `ddpflow --log c.yaml validate --config c.yaml`)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ddpflow.core.errors import UserError
from ddpflow.core.writing import check_log_place


def _strings(value, where: str):
    """(where, text) of every string in a parsed config value, nested."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _strings(v, f"{where}.{i}")
    elif isinstance(value, str):
        yield where, value


def command_inputs(args: argparse.Namespace) -> dict[str, str]:
    """what -> path of every existing file the command line names (--config, --bundle, the
    images...) and every existing file its config names (model.weights, init_from, ...): a
    config that does not read is left to the command, which says why."""
    found: dict[str, str] = {}
    for name, value in vars(args).items():
        option = "an input" if name == "inputs" else \
            "--set" if name == "overrides" else f"the --{name.replace('_', '-')}"
        for i, text in enumerate(value if isinstance(value, list) else [value]):
            if name == "log" or not isinstance(text, str):
                continue
            if name == "overrides":  # KEY=VALUE: the value may name a file
                text = text.partition("=")[2]
            if os.path.isfile(text):
                found[f"{option} #{i + 1}" if isinstance(value, list) else option] = text
    config = getattr(args, "config", None)
    if isinstance(config, str) and os.path.isfile(config):
        from ddpflow.config.yamlfile import read_yaml

        try:
            raw = read_yaml(config)
        except UserError:
            raw = {}
        for where, text in _strings(raw, ""):
            if os.path.isfile(text):
                found[f"the file {where} names"] = text
    return found


def checked_log(log: str, args: argparse.Namespace) -> Path:
    """`--log` checked against the command's inputs (core/writing.py's check_log_place) and
    its output: never the --out of the command nor a file inside it (the log, made first,
    would be taken for a file the command did not write)."""
    out = getattr(args, "out", None)
    if isinstance(out, str) and out:
        place, target = Path(log).resolve(), Path(out).resolve()
        if place == target or target in place.parents:
            where = "the --out" if place == target else "inside the --out folder"
            raise UserError(f"--log {log} is {where} of this command ({out}): the command "
                            f"would find its own log where its output goes; nothing was "
                            f"changed; give --log a file of its own, e.g. run.log")
    return check_log_place(Path(log), command_inputs(args))
