"""Load, override and validate a ddpflow config, and build the one typed object (types.py).

The JSON Schema at workflow/schemas/config.schema.yaml is the single source of truth for keys,
types, ranges and defaults (types.py builds the typed sections from it). `load_config` (and
`from_dict`) is the only entry point: it validates once and returns a `Config` whose
`to_dict()` is saved into every checkpoint and summary.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from ddpflow.config import endpoints
from ddpflow.config.messages import message
from ddpflow.config.stagechecks import check_data_recipe, check_stage_recipe, check_stages
from ddpflow.config.sweepchecks import check_sweep
from ddpflow.config.types import Config, build
from ddpflow.config.types import schema as _schema  # parsed once (cached)
from ddpflow.config.yamlfile import read_yaml
from ddpflow.core.errors import UserError, short


def _with_defaults(validator_class):
    """A validator that fills in schema defaults while it validates (jsonschema FAQ recipe)."""
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if "default" in sub:
                    instance.setdefault(name, copy.deepcopy(sub["default"]))
        yield from validate_properties(validator, properties, instance, schema)

    return jsonschema.validators.extend(validator_class, {"properties": set_defaults})


def _wants_integer(schema: dict) -> bool:
    types = schema.get("type")
    types = types if isinstance(types, list) else [types]
    if "integer" in types and "number" not in types:
        return True
    return any(_wants_integer(s) for s in schema.get("oneOf", []))


def _coerce_integers(value: Any, schema: dict) -> Any:
    """32.0 where the schema wants an integer becomes 32 (YAML and --set write floats)."""
    if isinstance(value, dict):
        props = schema.get("properties", {})
        return {k: _coerce_integers(v, props[k]) if k in props else v for k, v in value.items()}
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_coerce_integers(v, schema["items"]) for v in value]
    if isinstance(value, float) and value.is_integer() and _wants_integer(schema):
        return int(value)
    return value


MAX_DEPTH = 40  # a config nests a few levels; deeper is a mistake (and Python's recursion)
INT64 = 2**63 - 1  # torch takes sizes, steps and seeds as 64-bit integers


def _check_values(raw: Any) -> None:
    """Before anything recurses into the config: nesting depth, and numbers no setting
    takes: NaN and infinity (every comparison with NaN passes a schema's range check) and
    integers beyond 64 bits (floats may be large). Free mappings (`kwargs`) are the user's:
    only depth applies."""
    stack = [(raw, ())]
    while stack:
        node, path = stack.pop()
        where = ".".join(map(str, path)) or "(top level)"
        if len(path) > MAX_DEPTH:
            raise UserError(f"invalid config: {'.'.join(map(str, path[:3]))}... nests more "
                            f"than {MAX_DEPTH} levels deep; a config is a few levels of "
                            f"settings")
        free = "kwargs" in path
        if isinstance(node, float) and not free and not math.isfinite(node):
            raise UserError(f"invalid config: {where}: {node} is not a finite number; write "
                            f"a number (no setting takes nan or infinity)")
        # integers only: a float such as lr 1e30 is a legal (if unwise) value; an integer
        # setting written as a float is checked again once coerced (validate)
        if isinstance(node, int) and not isinstance(node, bool) and not free and abs(node) > INT64:
            shown = f"a {len(str(int(node)))}-digit number"
            raise UserError(f"invalid config: {where}: {shown} is larger than any setting "
                            f"takes (at most {INT64})")
        if isinstance(node, dict):
            stack.extend((v, (*path, k)) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, (*path, i)) for i, v in enumerate(node))


def validate(raw: dict[str, Any]) -> dict[str, Any]:
    """Validate a raw config dict, fill defaults, and return it. Raises UserError."""
    if not isinstance(raw, dict):
        raise UserError("the config must be a YAML mapping of keys to values")
    _check_values(raw)
    schema = _schema()
    d = _coerce_integers(copy.deepcopy(raw), schema)
    _check_values(d)  # integer settings written as floats (seed: 1e100) are integers now
    if isinstance(d.get("task"), str):  # `task: regression` is short for task.name
        d["task"] = {"name": d["task"]}
    cls = _with_defaults(jsonschema.validators.validator_for(schema))
    errors = sorted(cls(schema).iter_errors(d), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        lines = [message(e) for e in errors]
        raise UserError("invalid config: " + "; ".join(dict.fromkeys(lines)))
    check_stages(d)  # unique names (also in case), profile.stage, init_from
    _check_sources(d)
    _check_images(d["data"])
    _check_endpoints(d)
    _check_recipe(d)
    check_stage_recipe(d)  # progressive_resize, warmup_epochs, schedules
    check_data_recipe(d)  # sampling, augmentation policy, evaluation crop
    _check_deterministic(d)
    check_sweep(d)  # scheduler and search against the stages they act on
    return d


def _check_deterministic(d: dict[str, Any]) -> None:
    """torch.compile's Inductor autotunes its kernels (split reductions, atomics) outside
    torch.use_deterministic_algorithms; its own switch (torch._inductor.config.deterministic)
    is private, so the pair is refused rather than promised."""
    if not d["deterministic"]:
        return
    keys = [f"stages.{i}.compile" for i, st in enumerate(d["stages"]) if st["compile"]]
    keys += ["tune.compile"] if d["tune"]["compile"] else []
    if keys:
        raise UserError(f"invalid config: {keys[0]} is true with deterministic: true, but "
                        f"torch.compile's generated kernels are not covered by deterministic "
                        f"mode; set {keys[0]}: false (or deterministic: false)")


def _check_recipe(d: dict[str, Any]) -> None:
    """Batch-level options need labels to mix and prepared arrays to act on."""
    for i, st in enumerate(d["stages"]):
        used = [k for k in ("random_erasing", "mixup_alpha", "cutmix_alpha",
                            "progressive_resize") if st[k]]
        mixing = [k for k in used if k in ("mixup_alpha", "cutmix_alpha")]
        if mixing and d["task"]["name"] != "classification":
            raise UserError(f"invalid config: stages.{i}.{mixing[0]} mixes labels, which only "
                            f"task classification takes (task.name is "
                            f"{d['task']['name']}); set it to 0")
        if used and d["data"]["source"] == "python" and not d["data"]["materialize"]:
            raise UserError(f"invalid config: stages.{i}.{used[0]} acts on prepared arrays; "
                            f"a data.source python dataset does its own transforms (or set "
                            f"data.materialize: true)")


SMALL_SOURCES = ("synthetic", "cifar10", "cifar100", "mnist", "fashion_mnist", "python")
STORE_MARGIN = 1.15  # image folders keep this much more than training looks at (FFCV-style)


def _check_images(data: dict[str, Any]) -> None:
    """data.store_size resolved (null: image_size for 28/32 px sources, 1.15 x for image
    folders) and the crop options checked against it."""
    size, rrc, aug = data["image_size"], data["augment"]["random_resized_crop"], data["augment"]
    if data["store_size"] is None:
        big = data["source"] not in SMALL_SOURCES
        data["store_size"] = int(round(size * STORE_MARGIN)) if big else size
    if data["store_size"] < size:
        what = ("augment.random_resized_crop crops from" if rrc is not None
                else "training and validation crop")
        raise UserError(f"invalid config: data.store_size {data['store_size']} is smaller than "
                        f"data.image_size {size}; the {what} the stored image: set store_size "
                        f">= {size} (or null)")
    if data["encoding"] == "jpeg":
        _check_jpeg(data)
    if rrc is None:
        return
    rrc.setdefault("scale", [0.08, 1.0])  # torchvision's (and every ImageNet recipe's)
    rrc.setdefault("ratio", [3 / 4, 4 / 3])
    for key in ("scale", "ratio"):
        lo, hi = rrc[key]
        if lo > hi:
            raise UserError(f"invalid config: data.augment.random_resized_crop.{key} [{lo}, "
                            f"{hi}] must be [low, high] with low <= high")
    aug["crop_padding"] = aug["translate"] = 0  # the random box replaces pad-and-crop


def _check_jpeg(data: dict[str, Any]) -> None:
    """JPEG shards hold colour squares of an even size, written by prepare."""
    if data["grayscale"]:
        raise UserError("invalid config: data.encoding jpeg stores colour images; grayscale "
                        "images are small and compress little: use encoding raw with "
                        "grayscale, or grayscale: false")
    if data["source"] == "python" and not data["materialize"]:
        raise UserError("invalid config: data.encoding jpeg is how prepare stores images; a "
                        "data.source python dataset is read as it is: set data.materialize: "
                        "true, or encoding raw")
    size = data["store_size"]
    if size % 2 or size < 16:
        raise UserError(f"invalid config: data.encoding jpeg needs an even data.store_size of "
                        f"at least 16 (it is {size}): JPEG halves the colour planes, and CPU "
                        f"and GPU decoders round an odd edge differently; set store_size to "
                        f"{max(16, size + size % 2)} or use encoding raw")


def _check_endpoints(d: dict[str, Any]) -> None:
    """The addresses of outside systems, and slurm.gpus resolved (null = gres's count or 1)."""
    uri = d["tracking"]["mlflow"]["uri"]
    if uri is not None and (problem := endpoints.mlflow_uri_problem(uri)):
        raise UserError(f"invalid config: tracking.mlflow.uri '{uri}' {problem}")
    for key in ("image", "base_image"):
        ref = d["container"][key]
        if ref is not None and (problem := endpoints.image_ref_problem(ref)):
            raise UserError(f"invalid config: container.{key} {short(ref)} {problem}")
    uri = d["container"]["uri"]
    if uri is not None and (problem := endpoints.container_uri_problem(uri)):
        raise UserError(f"invalid config: container.uri {short(uri)} {problem}")
    if uri is not None and d["container"]["engine"] in ("docker", "podman"):
        raise UserError(f"invalid config: container.uri is for engine none (Snakemake runs "
                        f"the rules in it: --sdm apptainer) or apptainer (the .sif is built "
                        f"from it); engine {d['container']['engine']} builds from the "
                        f"Dockerfile: drop the uri or change the engine")
    s = d["slurm"]
    if (problem := endpoints.slurm_problem(s)):
        raise UserError(f"invalid config: slurm.{problem[0]} {problem[1]}")
    if s["gres"] is not None:
        n = endpoints.gres_gpus(s["gres"])
        if n is None:
            raise UserError(f"invalid config: slurm.gres {short(s['gres'])} is not gpu:N or "
                            f"gpu:type:N (e.g. gpu:4 or gpu:a100:4)")
        if n == 0:
            raise UserError(f"invalid config: slurm.gres '{s['gres']}' asks for no GPU; "
                            f"drop slurm.gres and set slurm.gpus: 0 for a CPU-only job")
        if s["gpu_model"]:
            raise UserError("invalid config: slurm.gres and slurm.gpu_model both name the "
                            "GPUs; put the model in gres (gpu:type:N) and drop gpu_model")
        if s["gpus"] is not None and s["gpus"] != n:
            raise UserError(f"invalid config: slurm.gres '{s['gres']}' asks for {n} GPU(s) and "
                            f"slurm.gpus for {s['gpus']}; give one of them (gres for clusters "
                            f"that only accept --gres, else gpus)")
        s["gpus"] = n
    elif s["gpus"] is None:
        s["gpus"] = 1
    if s["gpus"] == 0 and s["gpu_model"]:
        raise UserError(f"invalid config: slurm.gpu_model '{s['gpu_model']}' names a GPU but "
                        f"slurm.gpus is 0 (a CPU-only job); drop gpu_model or set gpus")


def _check_sources(d: dict[str, Any]) -> None:
    data = d["data"]
    if data["source"] == "python" and not data["factory"]:
        raise UserError("invalid config: data.source python needs data.factory, the "
                        "package.module:callable that returns a Dataset for a split")
    if data["factory"] and data["source"] != "python":
        raise UserError(f"invalid config: data.factory is set but data.source is "
                        f"'{data['source']}'; use data.source: python")
    if data["source"] not in ("synthetic", "python") and not d["data"]["path"]:
        raise UserError(f"invalid config: data.path is required for data.source "
                        f"'{d['data']['source']}' (the folder or archive with the files)")


# --------------------------------------------------------------------------- loading
def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise UserError(f"--set expects dotted.key=value, got {short(text)}")
    key, value = text.split("=", 1)
    if not key or any(not p for p in key.split(".")) or not key.isprintable():
        raise UserError(f"--set expects dotted.key=value, got {short(text)}")
    try:
        parsed = yaml.safe_load(value) if value != "" else ""
    except yaml.YAMLError:
        parsed = value
    except RecursionError:
        raise UserError(f"--set {key}: the value nests deeper than Python can read; a setting "
                        f"is a few levels deep") from None
    return key.split("."), parsed


def set_key(d: dict[str, Any], parts: list[str], value: Any, label: str = "--set") -> None:
    """d[parts[0]][parts[1]]... = value; list parts are indices, missing mappings are made."""
    node: Any = d
    for i, p in enumerate(parts):
        last = i == len(parts) - 1
        where = ".".join(parts[: i + 1])
        if isinstance(node, list):
            if not (p.isascii() and p.isdigit()) or int(p) >= len(node):
                raise UserError(f"{label} {'.'.join(parts)}: '{p}' is not an index of "
                                f"{'.'.join(parts[:i]) or 'the list'} (0..{len(node) - 1})")
            if last:
                node[int(p)] = value
            else:
                node = node[int(p)]
        elif isinstance(node, dict):
            if last:
                node[p] = value
            else:
                node = node.setdefault(p, {})
        else:
            raise UserError(f"{label} {'.'.join(parts)}: {where} is not a mapping or list")


def apply_overrides(d: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    d = copy.deepcopy(d)
    for text in overrides or []:
        parts, value = parse_override(text)
        set_key(d, parts, value)
    return d


def from_dict(raw: dict[str, Any]) -> Config:
    return build(validate(raw))


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read YAML, apply `--set` overrides, validate once, return the typed config."""
    return from_dict(apply_overrides(read_yaml(path), overrides or []))
