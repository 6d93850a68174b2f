"""Configuration: one YAML file, validated once against the schema, resolved into `Config`.

    yamlfile.py   the file read strictly (duplicate keys, size, encoding, alias bombs)
    loading.py    schema validation, cross-key checks, --set overrides, building `Config`
    types.py      `Config` and its sections: frozen dataclasses derived from the schema
    rerun.py      what each result depends on (the one rerun rule: stage hashes, prepare)
    messages.py   jsonschema's errors in a user's words
    endpoints.py  addresses outside ddpflow (MLflow URI, image URI, Slurm gres) checked early
"""

from ddpflow.config.loading import (
    SMALL_SOURCES,
    STORE_MARGIN,
    apply_overrides,
    from_dict,
    load_config,
    parse_override,
    set_key,
    validate,
)
from ddpflow.config.types import (
    PACKAGE_ROOT,
    SCHEMA_PATH,
    SECTIONS,
    Config,
    code_fingerprint,
    config_hash,
)

# the sections by name (DataCfg, StageCfg, ...), as types.py derives them from the schema
globals().update({cls.__name__: cls for cls in SECTIONS.values()})

__all__ = ["PACKAGE_ROOT", "SCHEMA_PATH", "SECTIONS", "SMALL_SOURCES", "STORE_MARGIN", "Config",
           "apply_overrides", "code_fingerprint", "config_hash", "from_dict", "load_config",
           "parse_override", "set_key", "validate"]
