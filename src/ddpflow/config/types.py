"""The resolved config as one typed, frozen object, derived from the schema.

The JSON Schema (workflow/schemas/config.schema.yaml, shipped as ddpflow/schema/) is the one
source of truth for the keys: their types, ranges, defaults and order. The Snakefile and every
`ddpflow` command validate against it, and this module builds the typed sections from it, so
a key is written in two places only: the schema and the commented config/config.yaml (which
tests/test_config.py checks against the schema). Each closed, non-nullable object of the
schema (`additionalProperties: false` with `properties`) is a frozen dataclass named after
its key (`data` -> DataCfg, `data.augment` -> AugmentCfg, `stages[]` -> StageCfg); lists are
tuples; free mappings (`kwargs`, `sweep.grid`) and nullable objects stay dicts. The methods
a section needs beyond its fields are mixins below (`Config`'s places and hashes).

Built once by `load_config` (loading.py) after validation; `to_dict()` is what every
checkpoint and summary saves; what a rerun depends on is rerun.py's.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from pathlib import Path
from typing import Any

import yaml

from ddpflow.config.rerun import config_hash, stage_hash
from ddpflow.core.errors import UserError

PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # src/ddpflow
SCHEMA_PATH = PACKAGE_ROOT / "schema" / "config.schema.yaml"
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml where PyYAML has it
_SCHEMA_CACHE: dict[str, Any] = {}


def schema() -> dict[str, Any]:
    """The config schema, parsed once per process and file version (a sweep validates every
    trial's config: parsing the YAML each time cost about 0.1 s per trial). A copy: callers
    may not change the cached one."""
    stamp = SCHEMA_PATH.stat().st_mtime_ns
    if _SCHEMA_CACHE.get("stamp") != stamp:
        with open(SCHEMA_PATH) as f:
            _SCHEMA_CACHE.update(stamp=stamp, schema=yaml.load(f, Loader=_LOADER))
    return copy.deepcopy(_SCHEMA_CACHE["schema"])


# ---------------------------------------------------------------- what sections add
class _ConfigPlaces:
    """Config's derived places and hashes (the fields come from the schema)."""

    @property
    def run_dir(self) -> Path:
        return Path(self.results_dir) / self.run

    @property
    def data_dir(self) -> Path:
        return Path(self.data.prepared_dir) if self.data.prepared_dir else self.run_dir / "data"

    def stage_dir(self, name: str) -> Path:
        return self.run_dir / "stages" / name

    def stage(self, name: str):
        for s in self.stages:
            if s.name == name:
                return s
        names = ", ".join(s.name for s in self.stages)
        raise UserError(f"no stage named '{name}' in the config; stages are: {names}")

    @property
    def data_code_dir(self) -> str | None:
        return self.data.code_dir or self.model.code_dir

    def stage_index(self, name: str) -> int:
        return [s.name for s in self.stages].index(self.stage(name).name)

    def to_dict(self) -> dict[str, Any]:
        return _plain(dataclasses.asdict(self))

    @property
    def hash(self) -> str:
        return config_hash(self.to_dict())

    def stage_hash(self, name: str, placement: bool = True) -> str:
        """What one stage's result depends on (config/rerun.py, the one rerun rule)."""
        return stage_hash(self.to_dict(), name, placement)


class _SweepSwitch:
    @property
    def enabled(self) -> bool:
        return bool(self.grid or self.variants or self.random)

    @property
    def scheduled(self) -> bool:
        """Trials handed out by one scheduler job (asha, tpe), not one Snakemake job each."""
        return self.scheduler != "none" or self.search != "none"


MIXINS = {"": _ConfigPlaces, "sweep": _SweepSwitch}
# every other section: its key in CamelCase + "Cfg" (data.augment -> AugmentCfg)
NAMES = {"": "Config", "stages[]": "StageCfg", "sweep.variants[]": "VariantCfg"}


# ---------------------------------------------------------------- the classes
def is_section(node: dict[str, Any]) -> bool:
    """A closed object that is always there: a dataclass (a nullable or open one: a dict)."""
    return (node.get("type") == "object" and "properties" in node
            and node.get("additionalProperties") is False)


_PY = {"integer": int, "number": float, "boolean": bool, "string": str, "null": type(None),
       "array": tuple, "object": dict}


def _annotation(node: dict[str, Any], cls: type | None) -> Any:
    if cls is not None:
        return cls
    types = node.get("type", [])
    types = types if isinstance(types, list) else [types]
    found = [_PY[t] for t in types if t in _PY]
    if not found:
        return Any
    out = found[0]
    for t in found[1:]:
        out = out | t
    return out


def _classes(node: dict[str, Any], path: str, out: dict[str, type]) -> type | None:
    """The dataclass of section `path` (and of the sections inside it), into out."""
    target = node.get("items") if node.get("type") == "array" else node
    if not isinstance(target, dict) or not is_section(target):
        return None
    key = path + "[]" if node is not target else path
    fields = []
    for name, sub in target["properties"].items():
        inner = _classes(sub, f"{key}.{name}" if key else name, out)
        fields.append((name, _annotation(sub, inner)))
    last = key.rsplit(".", 1)[-1]
    name = NAMES.get(key) or "".join(p.title() for p in last.split("_")) + "Cfg"
    bases = (MIXINS[key],) if key in MIXINS else ()
    cls = dataclasses.make_dataclass(name, fields, bases=bases, frozen=True,
                                     namespace={"__module__": __name__})
    out[key] = cls
    return cls


SECTIONS: dict[str, type] = {}  # "data", "data.augment", "stages[]", ...
_classes(schema(), "", SECTIONS)
Config = SECTIONS[""]
globals().update({cls.__name__: cls for cls in SECTIONS.values()})


def build(d: dict[str, Any]) -> Config:
    """The typed config of a validated dict (defaults filled)."""
    return _freeze(d, schema())


def _freeze(value: Any, node: dict[str, Any], path: str = "") -> Any:
    if isinstance(value, list):
        item = node.get("items") if isinstance(node.get("items"), dict) else {}
        return tuple(_freeze(v, item, path + "[]") for v in value)
    cls = SECTIONS.get(path)
    if cls is not None and isinstance(value, dict):
        # a key without a default that the config leaves out (sweep.random) is None
        return cls(**{k: _freeze(value.get(k), sub, f"{path}.{k}" if path else k)
                      for k, sub in node["properties"].items()})
    return value


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def code_fingerprint(subdir: str = "") -> str:
    """Hash of the package's own source (or one subpackage): a code change is a new run."""
    root = PACKAGE_ROOT / subdir
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]
