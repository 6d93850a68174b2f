"""Reading a config file: YAML's safe loader made strict, with one clear message per problem.

Duplicate keys are refused (last-one-wins silently drops a setting), a file that is not
UTF-8 or larger than 1 MiB is refused, and so is a document whose aliases expand to more
than MAX_YAML_NODES nodes ("billion laughs"): counted on the composed node graph, before
anything is expanded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from ddpflow.core.errors import UserError, short

MAX_CONFIG_BYTES = 1 << 20  # a config is a page of settings, not data
MAX_YAML_NODES = 100_000  # after expanding aliases: refuses "billion laughs" documents
TOO_DEEP = ("its lists or mappings nest deeper than Python can read (hundreds of levels); a "
            "config is a few levels of settings")


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses duplicate keys (last-one-wins silently drops a
    setting) and documents whose aliases expand to more than MAX_YAML_NODES nodes."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                # where the key is written: a flow mapping ({lr: 1, lr: 2}) is on one line
                at = (key_node.start_mark.line + 1, key_node.start_mark.column)
                try:
                    first = seen.setdefault(key, at)
                except TypeError:  # an unhashable key: the base class reports it
                    continue
                if first != at:
                    raise UserError(f"duplicate key {short(key)} at line {at[0]} (first at "
                                    f"line {first[0]}); YAML would silently keep only the last "
                                    f"one: remove one")
        return super().construct_mapping(node, deep)


def _expanded_size(node, sizes: dict, active: set) -> int:
    """Nodes in the document once every alias is expanded (memoised; cycles refused)."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in active:
        raise UserError("the config refers to itself through a YAML alias (a cycle)")
    active.add(key)
    total = 1
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    else:
        children = []
    for child in children:
        total += _expanded_size(child, sizes, active)
        if total > MAX_YAML_NODES:
            break
    active.discard(key)
    sizes[key] = total
    return total


def read_yaml(path: str | Path) -> dict[str, Any]:
    if str(path) == "-":  # the workflow hands a config over without writing it first
        import sys

        try:
            raw = json.loads(sys.stdin.read())
        except RecursionError:
            raise UserError(f"--config -: {TOO_DEEP}") from None
        except ValueError as e:
            raise UserError(f"--config -: standard input is not a JSON config ({e})") from None
        return raw if raw is not None else {}
    p = Path(path)
    if p.is_dir():
        raise UserError(f"--config {p} is a directory; pass a YAML file, e.g. "
                        f"config/config.yaml")
    if not p.is_file():
        raise UserError(f"config file not found: {p} (pass --config with a YAML file, "
                        f"e.g. config/config.yaml)")
    blob = p.read_bytes()[: MAX_CONFIG_BYTES + 1]
    if len(blob) > MAX_CONFIG_BYTES:
        raise UserError(f"config file {p} is larger than {MAX_CONFIG_BYTES >> 10} KiB; "
                        f"a config holds settings, not data")
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"config file {p} is not UTF-8 text (byte 0x{blob[e.start]:02x} at "
                        f"offset {e.start}); save it as UTF-8 YAML") from None
    if p.suffix == ".json":  # e.g. the workflow's config: JSON's 1e-05 is text to YAML 1.1
        try:
            raw = json.loads(text)
        except RecursionError:
            raise UserError(f"config file {p}: {TOO_DEEP}") from None
        except ValueError as e:
            raise UserError(f"config file {p} is not valid JSON: {e}") from None
        return raw if raw is not None else {}
    try:
        loader = _StrictLoader(text)
        try:
            node = loader.get_single_node()
            if node is not None and _expanded_size(node, {}, set()) > MAX_YAML_NODES:
                raise UserError(f"it expands to more than {MAX_YAML_NODES} values through "
                                f"YAML aliases; refused (write it out)")
            raw = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UserError(f"config file {p} is not valid YAML{at}: "
                        f"{getattr(e, 'problem', None) or e}") from None
    except UserError as e:
        raise UserError(f"config file {p}: {e}") from None
    except RecursionError:
        raise UserError(f"config file {p}: {TOO_DEEP}") from None
    return raw if raw is not None else {}
