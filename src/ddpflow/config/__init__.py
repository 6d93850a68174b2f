"""Configuration: one YAML file, validated once against the schema, resolved into `Config`.

    yamlfile.py   the file read strictly (duplicate keys, size, encoding, alias bombs)
    loading.py    schema validation, cross-key checks, --set overrides, building `Config`
    types.py      `Config` and its sections (frozen dataclasses), hashes of what reruns
    messages.py   jsonschema's errors in a user's words
    endpoints.py  addresses outside ddpflow (MLflow URI, image URI, Slurm gres) checked early
"""

from ddpflow.config.loading import (
                                    SCHEMA_PATH,
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
                                    Augment,
                                    CheckpointCfg,
                                    Config,
                                    ContainerCfg,
                                    DataCfg,
                                    HardwareCfg,
                                    MlflowCfg,
                                    ModelCfg,
                                    ProfileCfg,
                                    SlotsCfg,
                                    SlurmCfg,
                                    StageCfg,
                                    SweepCfg,
                                    TaskCfg,
                                    TrackingCfg,
                                    TuneCfg,
                                    code_fingerprint,
                                    config_hash,
)

__all__ = ["PACKAGE_ROOT", "SCHEMA_PATH", "SMALL_SOURCES", "STORE_MARGIN", "Augment",
           "CheckpointCfg", "Config", "ContainerCfg", "DataCfg", "HardwareCfg", "MlflowCfg",
           "ModelCfg", "ProfileCfg", "SlotsCfg", "SlurmCfg", "StageCfg", "SweepCfg", "TaskCfg",
           "TrackingCfg", "TuneCfg", "apply_overrides", "code_fingerprint", "config_hash",
           "from_dict", "load_config", "parse_override", "set_key", "validate"]
