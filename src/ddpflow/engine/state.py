"""What the trainer's phases share, as three plain objects with one owner each:

    TrainState   where training is: exactly what a checkpoint holds besides the tensors'
                 states (the trainer changes it; collaborators return changes to it)
    StageFiles   who the stage is and where its files go: what every checkpoint, best.pt,
                 final.pt and summary.json is stamped with (frozen once resume is decided)
    StageSetup   how the stage runs: the choices made in setup (batch, precision, layout,
                 loader, wrapper), frozen before the first step, read by the log and summary
    StageEnd     how this process ended (finished, halted, diverged) and its last figures

Components and collaborators (checkpointer.py, intervals.py, stopcontrol.py, build.py,
stagelog.py, validation.py, earlystop.py, layout.py) receive these and the live values they
need as arguments; none of them holds or changes the Trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class TrainState:
    """Where training is: saved into every checkpoint, restored from it in one place."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # epochs validated
    step_in_epoch: int = 0  # micro-batches of the current epoch already trained
    elapsed_s: float = 0.0  # training seconds before this process started
    best: dict = field(default_factory=dict)  # monitor, mode, value, step, epoch, metrics
    loss_sum: float = 0.0  # summed loss of the log interval in progress
    loss_count: int = 0  # optimizer steps in that sum
    skipped_steps: int = 0  # fp16 steps the GradScaler skipped
    wall_s: dict = field(default_factory=dict)  # earlier processes' wall split (wallclock.py)
    runs: int = 0  # earlier processes of this stage that left a checkpoint
    stop: dict = field(default_factory=dict)  # early stopping's counters and decision
    # how it was trained: a resume on another number of ranks keeps the global batch
    world: int = 0  # ranks (0: unknown, a checkpoint of an older ddpflow)
    accum: int = 0  # micro-batches per optimizer step
    batch_size: int = 0  # samples per rank per micro-batch

    @classmethod
    def from_checkpoint(cls, state: dict) -> "TrainState":
        return cls(**{k: state[k] for k in cls.__dataclass_fields__ if k in state})


@dataclass(frozen=True)
class StageFiles:
    """A stage's identity and folder: what its saved files carry and where they go."""

    stage: str
    out: Path  # <run>/stages/<stage>
    config: dict  # the resolved config (Config.to_dict())
    config_hash: str
    stage_hash: str  # the config up to this stage
    record: dict  # provenance: what the stage is made of (provenance.py)
    resume_key: str  # hash of the record: only a checkpoint with this key is resumed
    monitor: str  # the metric that chooses best.pt, and its mode (max/min)
    mode: str

    @property
    def ckpt_dir(self) -> Path:
        return self.out / "checkpoints"

    def stamp(self) -> dict:
        """What every checkpoint holds besides the weights and TrainState."""
        return {"stage": self.stage, "config": self.config, "config_hash": self.config_hash,
                "stage_hash": self.stage_hash, "resume_key": self.resume_key,
                "record": self.record}


@dataclass(frozen=True)
class StageSetup:
    """The choices setup made, fixed for the whole run of this process."""

    batch_size: int  # per rank, per micro-batch
    accum: int  # micro-batches per optimizer step
    world: int  # ranks
    device: torch.device  # this rank's
    backend: str | None  # the process group's (nccl, gloo), None without one
    global_batch: int  # batch_size x world x accum
    steps_per_epoch: int  # optimizer steps (whole global batches) per epoch
    total_steps: int  # optimizer steps of the stage
    precision: str
    strategy: str
    wrapper: str | None  # DistributedDataParallel / FSDP / DataParallel, None: a plain module
    sharding: str | None  # strategy fsdp: what was sharded and in which precision
    checkpointed: int  # blocks under activation checkpointing
    compile: bool
    tuned: bool
    channels_last: bool
    layout_reason: str
    loader: str
    loader_reason: str
    lr: float  # effective learning rate (after lr_scaling)
    init: dict | None  # where the starting weights came from (weights.py)
    params: int
    trainable_params: int
    devices: tuple[torch.device, ...]  # the GPUs this process drives (DataParallel: several)
    peak: float | None  # peak FLOP/s per GPU, None when unknown (CPU)
    ema: bool  # the stage hands on an EMA of its weights


@dataclass(frozen=True)
class StageEnd:
    """How a stage's process ended, for rank 0's final files (stagelog.write_results)."""

    diverged: str | None  # why a NaN/inf loss stopped it, or None
    halted: bool  # stopped at a checkpoint (signal, halt_after_steps): resumable
    test_metrics: dict  # test_<metric>, {} without a test split
    weight_hashes: list  # every rank's weights' SHA-256 (DDP keeps them equal)
    rank_hosts: list
    train_t0: float  # perf_counter() when training began, earlier runs' seconds included
    flops_per_micro: float | None
    skipped: int  # fp16 steps skipped
    model: dict  # the plain module's state dict
    ema: dict | None  # the EMA's weights, when stages[].ema is on
    memory: list  # every rank's memory (memory.py), rank order
