"""The resolved config as one typed, frozen object: `Config` and its sections.

Built once by `load_config` (loading.py) after validation; `to_dict()` is what every
checkpoint and summary saves, `hash`/`stage_hash` decide what reruns.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpflow.core.errors import UserError

PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # src/ddpflow


@dataclass(frozen=True)
class Augment:
    crop_padding: int  # pixels of zero padding before the random crop
    flip: bool  # random horizontal flip
    translate: int  # extra random shift in pixels (0 = off)
    # {scale: [lo, hi], ratio: [lo, hi]}: a random box (share of the stored area, width /
    # height) resized to image_size, instead of pad-and-crop (then 0); None = off
    random_resized_crop: dict | None = None


@dataclass(frozen=True)
class DataCfg:
    source: str
    factory: str | None  # source python: package.module:callable(split, **kwargs) -> Dataset
    kwargs: dict  # source python: the factory's keyword arguments
    code_dir: str | None  # folder of the factory's module (null = model.code_dir)
    materialize: bool  # source python: prepare copies fixed-size images into arrays
    path: str | None
    prepared_dir: str | None  # folder of the prepared data (None = <run>/data)
    image_size: int  # pixels (square)
    num_classes: int  # synthetic only; real sources report their own
    difficulty: float  # synthetic only: 1 = the hard default set, 0 = an easy one
    train_size: int | None  # samples (synthetic: generated; real: optional cap)
    val_size: int | None
    test_size: int | None  # samples of the test split (synthetic: generated; real: a cap)
    store_size: int  # pixels of the stored square (>= image_size; resolved from null)
    encoding: str  # raw (uint8 pixels) | jpeg (JPEG shards + index, decoded per batch)
    jpeg_quality: int  # encoding jpeg: 1..100
    shard_mb: float  # encoding jpeg: MiB of encoded images per shard file
    grayscale: bool
    val_fraction: float  # share of each class of the training data held out as val
    test_fraction: float  # image folders without test/: share of each class held out as test
    max_bad_fraction: float  # tolerated share of unreadable files (and jpeg samples)
    verify_checksum: bool
    prepare_workers: int | str  # processes for decoding images ("auto" = all cores)
    loader: str  # auto | device | dataloader
    device_memory_fraction: float  # share of free device memory the device loader may use
    num_workers: int  # DataLoader worker processes per rank
    pin_memory: bool
    persistent_workers: bool
    prefetch_factor: int  # batches per worker
    augment: Augment


@dataclass(frozen=True)
class ModelCfg:
    name: str  # built-in, torchvision name, timm:NAME or package.module:callable
    kwargs: dict  # keyword arguments of the model builder
    code_dir: str | None  # folder of the user's model/task code, on sys.path of every rank
    weights: str | None  # pretrained weights of stages without init_from
    weights_partial: bool  # weights may differ beyond the final layer (what fits is loaded)
    freeze: tuple[str, ...]  # parameter name prefixes kept frozen (a stage may override)
    sync_bn: bool
    shard_blocks: tuple[str, ...] | None  # block classes (FSDP units, checkpointed); None: found


@dataclass(frozen=True)
class TaskCfg:
    name: str  # classification | regression | package.module:callable
    kwargs: dict
    monitor: str | None  # val_<metric> that chooses best.pt (null = the task's default)
    mode: str  # auto | min | max


@dataclass(frozen=True)
class SlotsCfg:
    pool: str | None  # folder of slot locks shared by concurrent runs (None = whole node)
    gpus: int  # GPUs per slot
    threads: int  # CPU cores per slot on a CPU-only node


@dataclass(frozen=True)
class HardwareCfg:
    device: str  # auto | cuda | cpu
    nproc_per_node: int | str  # ranks on this node ("auto" = visible GPUs, 1 on CPU)
    devices: tuple[int, ...] | None  # GPU ids -> CUDA_VISIBLE_DEVICES
    threads_per_rank: int | str  # CPU threads per rank ("auto" = cores / ranks)
    nodes: int
    max_restarts: int  # torchrun restarts of the whole group after a rank dies
    timeout_s: int  # seconds a collective may hang, or a node take to join, before failing
    rdzv_port: int | None  # several nodes: rendezvous port on the first node (None = free)
    slots: SlotsCfg


@dataclass(frozen=True)
class CheckpointCfg:
    every_steps: int  # optimizer steps between checkpoints (0 = only at epoch ends)
    every_epochs: int  # epochs between checkpoints at epoch ends (0 = none)
    background: bool  # written by a background thread; training waits for the host copy
    keep_last: int
    resume: str  # auto | never


@dataclass(frozen=True)
class ContainerCfg:
    engine: str
    image: str
    base_image: str | None
    shm_size: str
    uri: str | None  # docker://, oras:// or .sif: the rules' `container:` (--sdm apptainer)


@dataclass(frozen=True)
class TuneCfg:
    enabled: bool  # the workflow runs `ddpflow tune` before the first stage
    stage: str | None  # the stage whose settings are measured (null = the first)
    memory_margin: float  # share of device memory left free by the chosen batch
    start_batch: int  # per GPU; the search doubles from here
    max_batch: int  # per GPU
    steps: int  # timed steps per measurement
    budget_s: float  # seconds of measuring at most (then the best measured so far wins)
    compile: bool  # also measure torch.compile (slow to compile)


@dataclass(frozen=True)
class SlurmCfg:
    gpus: int  # GPUs per training job (Snakemake resource gpu=); 0 = a CPU-only job
    gres: str | None  # gpu:N or gpu:type:N, sent as --gres instead of gpu= (gpus = N)
    gpu_model: str | None
    cpus_per_gpu: int | None  # None: a GPU's share of a node (launch/slurmsizes.py)
    cpus: int  # CPUs of a CPU-only job (gpus: 0)
    mem_mb: int | None  # MiB of host memory per training job (and node); None: a share
    runtime_min: int  # minutes of wall time per job
    partition: str | None
    account: str | None
    signal_before_end_s: int  # seconds before the time limit that SIGUSR1 arrives
    extra: str  # more sbatch options


@dataclass(frozen=True)
class MlflowCfg:
    uri: str | None  # tracking server or store; None = no MLflow
    experiment: str


@dataclass(frozen=True)
class TrackingCfg:
    tensorboard: bool | str  # auto | true | false
    mlflow: MlflowCfg


@dataclass(frozen=True)
class ProfileCfg:
    stage: str | None  # the stage to profile (None = off)
    wait: int  # optimizer steps
    warmup: int
    active: int
    all_ranks: bool


@dataclass(frozen=True)
class SweepCfg:
    grid: dict  # dotted key -> list of values (cartesian product)
    variants: tuple  # [{name, set: {dotted key: value}}]
    random: dict | None  # {samples, seed, space}
    gpus_per_trial: int
    threads_per_trial: int  # CPU cores per trial on a CPU-only node
    max_trials: int
    scheduler: str  # none | asha (sweeps/scheduler.py)
    search: str  # none | tpe: Optuna draws the trials from random.space
    asha: dict  # {eta, min_epochs, max_epochs}: rungs in epochs of the last stage
    parallel: int | str  # trials the scheduler trains at once ("auto" = the node's slots)

    @property
    def enabled(self) -> bool:
        return bool(self.grid or self.variants or self.random)

    @property
    def scheduled(self) -> bool:
        """Trials handed out by one scheduler job (asha, tpe), not one Snakemake job each."""
        return self.scheduler != "none" or self.search != "none"


@dataclass(frozen=True)
class StageCfg:
    name: str
    epochs: int
    max_steps: int | None  # optimizer steps; overrides epochs when set
    batch_size: int | str  # samples per rank per micro-step ("auto" = from tune.json)
    lr: float  # for lr_reference_batch samples of global batch, see lr_scaling
    lr_scaling: str  # none | linear | sqrt
    lr_reference_batch: int
    optimizer: str
    momentum: float
    nesterov: bool
    weight_decay: float
    schedule: str
    warmup_epochs: float
    label_smoothing: float
    grad_accum_steps: int
    grad_clip: float | None
    precision: str
    channels_last: bool | str  # true | false | "auto" (train.py decides; the summary says)
    compile: bool
    strategy: str  # ddp | fsdp | dp
    reshard_after_forward: bool  # fsdp: free gathered parameters after each block's forward
    activation_checkpointing: bool | tuple[str, ...]  # true: the model's blocks; or classes
    init_from: str | None
    freeze: tuple[str, ...] | None  # parameter name prefixes frozen here (None = model.freeze)
    validate_every_epochs: int  # epochs between validations (the last is always validated)
    stop: dict  # {monitor, patience, target}: early stopping and time-to-target (earlystop.py)
    random_erasing: float  # probability per training image of one erased box
    mixup_alpha: float  # Beta(alpha, alpha) mixing of image pairs and labels; 0 = off
    cutmix_alpha: float  # the same with a pasted box; both on: one of them per batch
    ema: dict  # {decay, every_steps}: EMA of the weights, validated and handed on (ema.py)
    progressive_resize: dict | None  # {start_size, end_size}: training size per epoch


@dataclass(frozen=True)
class Config:
    run: str
    results_dir: str
    seed: int
    deterministic: bool
    log_every_steps: int
    stop_check_s: float  # seconds between checks for a stop signal between log boundaries
    data: DataCfg
    model: ModelCfg
    task: TaskCfg
    hardware: HardwareCfg
    checkpoint: CheckpointCfg
    container: ContainerCfg
    tune: TuneCfg
    slurm: SlurmCfg
    tracking: TrackingCfg
    profile: ProfileCfg
    sweep: SweepCfg
    stages: tuple[StageCfg, ...] = field(default_factory=tuple)

    # ---- derived places
    @property
    def run_dir(self) -> Path:
        return Path(self.results_dir) / self.run

    @property
    def data_dir(self) -> Path:
        return Path(self.data.prepared_dir) if self.data.prepared_dir else self.run_dir / "data"

    def stage_dir(self, name: str) -> Path:
        return self.run_dir / "stages" / name

    def stage(self, name: str) -> StageCfg:
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
        """Hash of what one stage's result depends on: everything but the other stages.
        placement False: also without how many ranks, nodes and GPUs run it, and without
        activation checkpointing and FSDP's units (a checkpoint's resume key: a requeue onto
        fewer GPUs, or a stage that ran out of memory, resumes with them changed)."""
        d = self.to_dict()
        d["stages"] = d["stages"][: self.stage_index(name) + 1]
        # how often we look and save, and where results live: not what is computed (a moved
        # or renamed results folder stays valid; a preempted stage resumes after its
        # checkpoint settings changed)
        # nor what a Slurm job asks of a node (slurm:, sizes filled in from sinfo where the
        # workflow runs: `ddpflow collect --config my.yaml` by hand sees the same results)
        for key in ("log_every_steps", "stop_check_s", "checkpoint", "results_dir", "run",
                    "sweep", "tracking", "profile", "slurm"):
            d.pop(key, None)
        for key in ("slots", "rdzv_port"):  # which GPUs/cores and port, and where the data
            d["hardware"].pop(key, None)
        if not placement:  # nor what changes only memory, not the numbers computed
            for key in ("nproc_per_node", "devices", "nodes", "threads_per_rank",
                        "max_restarts", "timeout_s"):
                d["hardware"].pop(key, None)
            d["model"].pop("shard_blocks", None)
            for st in d["stages"]:
                st.pop("activation_checkpointing", None)
                st.pop("reshard_after_forward", None)
        d["data"].pop("prepared_dir", None)  # lives: not what is computed
        return config_hash(d)


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def config_hash(d: dict[str, Any]) -> str:
    blob = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def code_fingerprint(subdir: str = "") -> str:
    """Hash of the package's own source (or one subpackage): a code change is a new run."""
    root = PACKAGE_ROOT / subdir
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]
