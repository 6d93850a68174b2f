"""A training stage's parts, built from the config for one rank: the model (placed, laid out,
wrapped for DDP, compiled), its task and starting weights, the optimizer, schedule and
precision, and the frozen StageSetup that the log lines and summary.json report.

Each builder takes what it needs and returns what it made; train.py's `Trainer.setup` calls
them in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddpflow.core.errors import UserError
from ddpflow.data.loaders import free_memory
from ddpflow.data.mixing import Recipe, progressive_sizes
from ddpflow.data.pipeline import open_pipeline
from ddpflow.engine import distributed, layout, sharding
from ddpflow.engine.efficiency import peak_flops, replicas
from ddpflow.engine.ema import Ema, open_ema
from ddpflow.engine.runtime import build_optimizer, decay_boundaries, lr_factor, schedule
from ddpflow.engine.settings import mixed_precision
from ddpflow.engine.state import StageSetup
from ddpflow.engine.weights import start_weights
from ddpflow.results.provenance import init_source
from ddpflow.seams.models import build_model, input_channels, param_count, unwrap
from ddpflow.seams.tasks import build_task, monitor


def data_parts(cfg, stage, dist, meta: dict, settings, batch: int, accum: int, trace, say) -> tuple:
    """This rank's data pipeline (data/pipeline.py) for `batch` per rank and `accum`
    micro-batches per step, its optimizer steps per epoch and the stage's total steps. A
    global batch larger than the training split is a user mistake."""
    data = open_pipeline(cfg, dist, meta, batch, settings.tuned,
                         lambda c: input_channels(cfg.model.name, c),
                         settings.channels_last is True, trace=trace,
                         recipe=Recipe(stage.random_erasing, stage.mixup_alpha, stage.cutmix_alpha),
                         budget=loader_budget(cfg, dist, meta), accum=accum)
    say(f"loader: {data.kind} ({data.reason})")
    steps_per_epoch = len(data.train) // accum  # whole steps of the global batch
    if steps_per_epoch == 0:
        raise UserError(f"stages.{cfg.stage_index(stage.name)}.batch_size {batch} x "
                        f"{dist.world} ranks x {accum} accumulation exceeds the "
                        f"{data.train_samples} training samples; lower the batch size")
    total_steps = stage.max_steps or stage.epochs * steps_per_epoch
    if stage.progressive_resize:  # training size per epoch; validation keeps its size
        data.train.size_at = progressive_sizes(stage.progressive_resize,
                                               -(-total_steps // steps_per_epoch))
    return data, steps_per_epoch, total_steps


def loader_budget(cfg, dist, meta: dict) -> tuple[int, str] | None:
    """(bytes, why) of device memory the dataset may take under data.loader auto, the same
    on every rank (a collective): the least any rank has free, less the model's training
    state (weights, gradients and two optimizer moments: 4 x its parameter bytes, counted
    on the meta device). None where memory does not choose the loader."""
    if cfg.data.loader != "auto" or meta.get("kind") == "python":
        return None
    model = 4 * _param_bytes(cfg, meta)
    free = distributed.all_min(dist, max(free_memory(dist.device) - model, 0))
    return free, (f" (the least of {dist.world} ranks, after the model's {model / 2**20:.0f} "
                  f"MiB)" if dist.world > 1 else f" (after the model's {model / 2**20:.0f} MiB)")


def _param_bytes(cfg, meta: dict) -> int:
    """The model's parameter bytes, built on the meta device (no memory, no init)."""
    try:
        with torch.device("meta"):
            model = build_model(cfg.model, meta["num_classes"],
                                input_channels(cfg.model.name, meta["image_shape"][2]))
    except Exception:  # noqa: BLE001 - a builder that needs real tensors: the real build
        return 0  # (next) reports its own errors; the loader then counts no model
    return sum(p.numel() * p.element_size() for p in model.parameters())


@dataclass
class ModelParts:
    model: torch.nn.Module  # wrapped: DDP (or DataParallel for strategy dp)
    train_model: torch.nn.Module  # what the step runs: the compiled model, or `model`
    ema: Ema | None
    task: object
    monitor: str  # the metric that chooses best.pt, and its mode
    mode: str
    init_src: object  # the file the stage starts from (provenance), or None
    init_report: dict | None
    channels_last: bool
    layout_reason: str
    checkpointed: list  # blocks whose activations are recomputed in the backward
    sharding: str | None  # strategy fsdp: what was sharded, and in which precision


def model_parts(cfg, stage, dist, data, batch_size: int, precision: str, compile_: bool,
                channels_last, say) -> ModelParts:
    """The stage's model on this rank's device, with its starting weights, layout (the data
    pipeline follows it) and wrapper; its task and monitor."""
    in_ch = data.in_channels and input_channels(cfg.model.name, data.in_channels)
    model = build_model(cfg.model, data.num_classes, in_ch)  # the same init on every rank
    task = build_task(cfg, stage, data.num_classes)
    mon, mode = monitor(cfg, task)
    init_src = init_source(cfg, stage.name)
    init_report = start_weights(cfg, stage, model, init_src, say)  # (a new head: the same too)
    distributed.seed_rank_stream(cfg.seed, dist.rank)  # from here on, each rank's own stream
    if stage.strategy != "fsdp":  # fsdp: fully_shard moves each block as it shards it, so a
        model.to(dist.device)  # GPU never holds the whole model (sharding.shard)
    # channels_last true/false, or auto (layout.py); the inputs follow the model
    on, why = ((False, "strategy fsdp: FSDP2 shards contiguous parameters only")
               if stage.strategy == "fsdp" else
               layout.for_stage(channels_last, cfg, model, dist, batch_size, in_ch, precision))
    data.use_channels_last(on)
    if on:
        model.to(memory_format=torch.channels_last)
        layout.channels_last_inputs(model)  # after the data's device crop, too
    if cfg.model.sync_bn and dist.backend and dist.device.type != "cuda":
        raise UserError(f"model.sync_bn: SyncBatchNorm runs on GPUs only, and this stage "
                        f"trains on {dist.device.type}; set model.sync_bn: false")
    checkpointed, blocks = model_blocks(cfg, stage, model)
    sharding.checkpoint_blocks(checkpointed)  # activation checkpointing (before FSDP)
    how = None
    if stage.strategy == "fsdp":  # each block sharded across the ranks, then the root
        if cfg.model.sync_bn:
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        how = sharding.shard(model, blocks, precision, stage.reshard_after_forward)
        say(f"fsdp: {how}")
    else:  # DDP across ranks (DataParallel for strategy dp, a baseline only)
        model = distributed.wrap(model, dist, stage.strategy, cfg.model.sync_bn, cfg.deterministic)
    if checkpointed:
        say(f"activation checkpointing: {len(checkpointed)} "
            f"{sharding.class_name(checkpointed[0])} blocks "
            f"recomputed in the backward")
    return ModelParts(model, torch.compile(model) if compile_ else model,
                      open_ema(stage, unwrap(model)),  # None unless stages[].ema.decay is set
                      task, mon, mode, init_src, init_report, on, why, checkpointed, how)


def model_blocks(cfg, stage, model) -> tuple[list, list]:
    """(blocks to checkpoint, blocks to shard) of the stage's model (sharding.py): the
    model's blocks (model.shard_blocks, or found), or the classes activation_checkpointing
    lists. A model without blocks cannot be sharded (nor checkpointed): one message."""
    where = f"stages.{cfg.stage_index(stage.name)}"
    ac = stage.activation_checkpointing
    if stage.strategy != "fsdp" and not ac:
        return [], []
    blocks = sharding.find_blocks(model, cfg.model.shard_blocks, cfg.model.name)
    if not blocks:
        why = "strategy fsdp" if stage.strategy == "fsdp" else "activation_checkpointing"
        raise UserError(f"{where}.{why}: model {cfg.model.name} has {sharding.describe(model)}"
                        f" to shard or recompute one by one; use strategy ddp without activation "
                        f"checkpointing, or name its block classes in model.shard_blocks")
    tied = sharding.shared_parameter(model, blocks) if stage.strategy == "fsdp" else None
    if tied:
        raise UserError(f"{where}.strategy fsdp: model {cfg.model.name} uses parameter "
                        f"'{tied}' in two of its blocks, or in a block and outside them (tied "
                        f"weights), and FSDP shards each block apart; name larger blocks in "
                        f"model.shard_blocks that hold every use of it, or use strategy ddp")
    if isinstance(ac, tuple):
        return sharding.find_blocks(model, ac, cfg.model.name,
                                    f"{where}.activation_checkpointing"), blocks
    return (blocks if ac else []), blocks


def optimizer_parts(model, stage, global_batch: int, steps_per_epoch: int, total_steps: int,
                    precision: str, device) -> tuple:
    """(effective lr, optimizer, LR scheduler, GradScaler, autocast context)."""
    lr = stage.lr * lr_factor(stage.lr_scaling, global_batch, stage.lr_reference_batch)
    opt = build_optimizer(model, stage, lr, device)  # fused where possible
    warmup = round(stage.warmup_epochs * steps_per_epoch)
    rule = schedule(stage.schedule, warmup, total_steps, stage.lr_min / stage.lr,
                    decay_boundaries(stage, steps_per_epoch, total_steps), stage.lr_gamma)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, rule)
    return (lr, opt, sched, *mixed_precision(precision, device))


def stage_setup(parts: ModelParts, dist, stage, data, settings, accum: int, lr: float,
                steps_per_epoch: int, total_steps: int) -> StageSetup:
    """The choices made in setup, frozen for the loop, the log lines and summary.json."""
    model, plain = parts.model, unwrap(parts.model)
    devices = ([torch.device("cuda", i) for i in model.device_ids]
               if replicas(model) > 1 else [dist.device])  # DataParallel: all its GPUs count
    return StageSetup(
        batch_size=settings.batch_size, accum=accum, world=dist.world, device=dist.device,
        backend=dist.backend, global_batch=settings.batch_size * dist.world * accum,
        steps_per_epoch=steps_per_epoch, total_steps=total_steps,
        precision=settings.precision, strategy=stage.strategy,
        wrapper="FSDP" if parts.sharding else type(model).__name__ if model is not plain
        else None, sharding=parts.sharding, checkpointed=len(parts.checkpointed),
        compile=settings.compile, tuned=settings.tuned, channels_last=parts.channels_last,
        layout_reason=parts.layout_reason, loader=data.kind, loader_reason=data.reason, lr=lr,
        init=parts.init_report, params=param_count(plain),
        trainable_params=sum(p.numel() for p in plain.parameters() if p.requires_grad),
        devices=tuple(devices), peak=peak_flops(dist.device, settings.precision),
        ema=parts.ema is not None)
