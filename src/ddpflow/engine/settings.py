"""The settings a stage runs with, resolved once: its own, or `ddpflow tune`'s for "auto".

    resolve            batch size per rank, precision, layout and compile: the stage's config
                       merged with tune.json's choice (when it was measured for this stage's
                       settings), precision `auto` picked for this device, and what goes
                       together checked once (config/stagechecks.py's check, the same one
                       validation runs, now for the precision auto picked)
    set_backend_flags  the process-wide switches that follow from the settings (TF32 for
                       fp32 on a GPU): the one place they are set, called by the trainer and
                       by tune (which measures fp32 as training runs it)
    load_choice        tune.json, validated, and whether it was measured for these settings
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from ddpflow.config import Config
from ddpflow.config.stagechecks import check_precision
from ddpflow.config.types import StageCfg
from ddpflow.core import reading
from ddpflow.core.errors import UserError


@dataclasses.dataclass(frozen=True)
class StageSettings:
    batch_size: int  # samples per rank per micro-batch
    precision: str  # bf16 | fp16 | fp32
    channels_last: bool | str  # "auto": decided once the model is built (layout.py)
    compile: bool
    tuned: dict | None  # tune.json's choice when it was used


def resolve(cfg: Config, stage: StageCfg, device: torch.device, say) -> StageSettings:
    """The stage's batch size, precision and layout: its own, or tune.json's for "auto"."""
    where = f"stages.{cfg.stage_index(stage.name)}"
    tuned, mismatch = load_choice(cfg, stage)
    batch = stage.batch_size
    if batch == "auto":
        if tuned is None:
            raise UserError(f"{where}.batch_size is auto but " + (
                mismatch or f"there is no {tune_path(cfg)}; run `ddpflow tune` first"))
        batch = tuned["batch_size"]
    if stage.precision == "auto" and tuned:  # precision and layout were measured together
        precision, channels_last = tuned["precision"], tuned["channels_last"]
        # (strategy fsdp: tune measures it uncompiled)
        compile_ = stage.compile or (tuned["compile"] and stage.strategy != "fsdp")
    else:
        precision, compile_ = pick_precision(stage.precision, device), stage.compile
        channels_last = (tuned["channels_last"] if stage.channels_last == "auto" and tuned
                         else stage.channels_last)  # measured for this stage's settings
    check_precision(where, stage.strategy, precision, auto=stage.precision == "auto")
    if mismatch:
        say(f"not using tune.json: {mismatch}")
    return StageSettings(batch, precision, channels_last, compile_, tuned)


def set_backend_flags(device: torch.device, precision: str) -> None:
    """fp32 on a GPU runs its matmuls and convolutions on TF32 tensor cores (what `fp32`
    means in the config's comment): process-wide switches, set here only."""
    if device.type == "cuda" and precision == "fp32":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def pick_precision(setting: str, device: torch.device) -> str:
    """auto = bf16 where the hardware does it natively (Ampere+ GPUs; CPUs with oneDNN's
    bf16 paths: AVX-512 or AMX), else fp16 on GPUs and fp32 on CPUs. On an AVX2-only CPU
    bf16 autocast is emulated: a smallcnn step measured 7-8x slower than in fp32."""
    if setting != "auto":
        return setting
    if device.type == "cpu":
        return "bf16" if cpu_has_fast_bf16() else "fp32"
    if torch.cuda.is_bf16_supported(including_emulation=False):
        return "bf16"
    return "fp16"


def cpu_has_fast_bf16() -> bool:
    """oneDNN's answer; DDPFLOW_CPU_BF16=1 or 0 overrides it (a CPU it misjudges, and a test
    suite run as on the other kind of CPU)."""
    forced = os.environ.get("DDPFLOW_CPU_BF16", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # no oneDNN in this build
        return False


AMP_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}  # autocast's


def mixed_precision(precision: str, device: torch.device):
    """(GradScaler, autocast context) for a precision: a scaler only for fp16, autocast off
    for fp32."""
    amp_dtype = AMP_DTYPE[precision]
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    return scaler, torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None)


# ---------------------------------------------------------------- tune.json
def tune_path(cfg: Config) -> Path:
    return cfg.run_dir / "tune.json"


def tune_settings(cfg: Config, stage: StageCfg) -> dict:
    """What a measurement depends on besides the choices it makes: a stage with other
    settings must not take a tune.json measured for these."""
    from ddpflow.data.prepare import settings_fingerprint

    hw = cfg.hardware
    return {"model.name": cfg.model.name, "data": settings_fingerprint(cfg),
            "data.augment": dataclasses.asdict(cfg.data.augment),
            "hardware": [hw.device, hw.nproc_per_node, hw.devices, hw.threads_per_rank,
                         hw.nodes],
            "optimizer": stage.optimizer, "strategy": stage.strategy,
            "activation_checkpointing": (list(stage.activation_checkpointing) if isinstance(
                stage.activation_checkpointing, tuple) else stage.activation_checkpointing),
            "grad_accum_steps": stage.grad_accum_steps}


# tune.json as its readers use it (core/reading.py validates it before any field is used)
TUNE_SCHEMA = {
    "type": "object", "required": ["choice"],
    "properties": {
        "settings": {"type": ["object", "null"]},
        "choice": {"type": "object",
                   "required": ["batch_size", "loader", "num_workers", "prefetch_factor",
                                "precision", "channels_last", "compile"],
                   "properties": {
                       "batch_size": {"type": "integer", "minimum": 1},
                       "loader": {"enum": ["device", "dataloader"]},
                       "num_workers": {"type": "integer", "minimum": 0, "maximum": 1024},
                       "prefetch_factor": {"type": ["integer", "null"], "minimum": 1},
                       "precision": {"enum": ["bf16", "fp16", "fp32"]},
                       "channels_last": {"type": "boolean"},
                       "compile": {"type": "boolean"}}}}}


def load_choice(cfg: Config, stage: StageCfg) -> tuple[dict | None, str | None]:
    """(tune.json's choice, None) when it was measured for this stage's settings;
    (None, why not) when it exists but was measured for others or is damaged (the reason
    names the file and field: the caller refuses when it needs the file, else warns);
    (None, None) without one."""
    try:
        t = reading.read_json_if_present(tune_path(cfg), TUNE_SCHEMA, "ddpflow tune's result",
                                         "run `ddpflow tune` again")
    except UserError as e:
        return None, str(e)
    if t is None:
        return None, None
    want = tune_settings(cfg, stage)
    got = t.get("settings") or {}
    differ = [k for k in want if got.get(k) != want[k]]
    if differ:
        return None, (f"{tune_path(cfg)} was measured for other settings "
                      f"({', '.join(differ)}); run `ddpflow tune` again")
    return t["choice"], None
