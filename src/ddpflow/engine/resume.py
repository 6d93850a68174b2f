"""Which checkpoint a stage resumes from, on how many ranks, and reading it back.

`choose` runs before the data and model are built: rank 0 picks the newest valid checkpoint
of the stage's very inputs (its resume key) and tells every rank where it is and how it was
trained (ranks, micro-batches per step, batch per rank). `layout` keeps that run's global
batch on this run's ranks (a requeue onto fewer or more GPUs): the same batch per rank with
more or fewer accumulation steps where that divides, else smaller micro-batches, else one
message. `restore`, once the model and optimizer exist, loads it into them: a DDP
checkpoint's tensors on every rank, an FSDP checkpoint's shards resharded by DCP.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ddpflow.config import config_hash
from ddpflow.core.checksum import sha256_of
from ddpflow.core.errors import UserError
from ddpflow.engine import checkpoint, distributed
from ddpflow.engine.state import StageFiles
from ddpflow.results.provenance import make_record


def stage_files(cfg, stage: str, meta: dict, init_src) -> StageFiles:
    """The stage's identity: its record (what it is made of) and resume key. The key leaves
    out how many ranks, nodes and GPUs run it: a job requeued onto fewer GPUs resumes its
    checkpoint (`layout` keeps the global batch); the record keeps them."""
    record = make_record(cfg, stage, meta["fingerprint"],
                         sha256_of(init_src) if init_src else None)
    key = config_hash({**record, "stage_hash": cfg.stage_hash(stage, placement=False)})
    return StageFiles(stage, cfg.stage_dir(stage), cfg.to_dict(), cfg.hash,
                      cfg.stage_hash(stage), record, key, monitor="", mode="")


@dataclass(frozen=True)
class Chosen:
    path: Path
    step: int
    world: int  # ranks that wrote it (0: a checkpoint of an older ddpflow: as this run)
    accum: int  # micro-batches per optimizer step then
    batch: int  # samples per rank per micro-batch then
    saved: dict | None  # rank 0: the checkpoint (a sharded one's state.pt); others: None


def choose(files: StageFiles, dist) -> Chosen | None:
    """The checkpoint to resume from, the same on every rank (rank 0 chooses and verifies
    it; a broadcast), or None. Whatever rank 0 meets, every rank hears of it (no hang)."""
    found, failed = None, None
    if dist.is_master:
        try:
            found = checkpoint.latest_valid(files.ckpt_dir, files.resume_key)
        except Exception as e:  # noqa: BLE001 - told to every rank, below
            failed = f"{type(e).__name__}: {str(e)[:160]}"
    said = distributed.broadcast_object(
        dist, ("failed", failed) if failed else None if not found else
        (str(found[0]), found[1]["step"], found[1].get("world", 0),
         found[1].get("accum", 0), found[1].get("batch_size", 0)))
    if said is None:
        return None
    if said[0] != "failed" and said[2] and said[2] != dist.world and (
            files.out / "summary.json").is_file():
        return None  # a finished stage run again on other ranks on purpose: a new run
    if said[0] == "failed":
        raise UserError(f"cannot choose a checkpoint to resume from in {files.ckpt_dir}: "
                        f"{said[1]}; move the damaged file away (or set "
                        f"checkpoint.resume: never to start afresh)")
    return Chosen(Path(said[0]), *said[1:], found[1] if found else None)


def layout(chosen: Chosen | None, batch: int, accum: int, world: int, where: str
           ) -> tuple[int, int, str | None]:
    """(batch per rank, accumulation steps, what changed or None) for this run: the
    checkpoint's global batch kept on `world` ranks."""
    if chosen is None or not chosen.world or (chosen.world, chosen.accum, chosen.batch) == (
            world, accum, batch):
        return batch, accum, None
    total = chosen.batch * chosen.world * chosen.accum
    was = (f"{chosen.path.name} (step {chosen.step}) was trained on {chosen.world} rank(s) "
           f"with a global batch of {total} ({chosen.batch}/rank x {chosen.world} x "
           f"{chosen.accum} accumulation)")
    for b in range(chosen.batch, 0, -1):  # the largest micro-batch that divides evenly
        if chosen.batch % b == 0 and total % (b * world) == 0:
            a = total // (b * world)
            note = (f"resuming {was}; on {world} rank(s) it stays {total}: {b}/rank x "
                    f"{world} x {a} accumulation")
            if b != chosen.batch:
                note += (f" (micro-batches of {b}, not {chosen.batch}: BatchNorm statistics "
                         f"come from smaller batches from here on)")
            return b, a, note
    raise UserError(f"{where}: {was}, which {world} ranks cannot share evenly; resume on a "
                    f"number of ranks that divides {total} (hardware.nproc_per_node, or the "
                    f"GPUs the job gets), or set checkpoint.resume: never to start the stage "
                    f"afresh")


def restore(chosen: Chosen | None, files: StageFiles, dist, parts, accum: int) -> dict | None:
    """Load `chosen` into the bundle `parts` (checkpointer.Parts: the plain module, an FSDP
    one's shards, optimizer, scheduler, scaler, EMA) and, on as many ranks as wrote it, this
    rank's random streams.
    Returns the checkpoint's state (for TrainState; its position in the epoch counted in
    this run's `accum` micro-batches per step), or None without one. Ranks that see
    another file than rank 0 did (a write landing between their listings, a folder not
    shared between nodes) stop with one message instead of training on from other steps."""
    if chosen is None:
        return None
    saved, problem = chosen.saved, None
    if not dist.is_master:
        saved, problem = _load_chosen(chosen.path, chosen.step, files.resume_key)
    problems = [(r, p) for r, p in enumerate(distributed.gather_objects(dist, problem)) if p]
    if problems:
        rank, problem = problems[0]
        raise UserError(f"rank {rank} cannot resume from {chosen.path.name}, the "
                        f"checkpoint rank 0 chose (step {chosen.step}): {problem}; every rank "
                        f"must see the same {files.ckpt_dir} (a shared filesystem)")
    if parts.sharded:
        from ddpflow.engine import shardedckpt

        shardedckpt.load_shards(chosen.path, parts.plain, parts.opt)  # a collective: reshards
    else:
        parts.plain.load_state_dict(saved["model"])
        parts.opt.load_state_dict(saved["optimizer"])
        _match_layouts(parts.opt)
    parts.sched.load_state_dict(saved["scheduler"])
    parts.scaler.load_state_dict(saved["scaler"])
    if parts.ema:
        parts.ema.load(saved["ema"], saved["ema_updates"])
    if len(saved["rng"]) == dist.world:  # other ranks: their streams start from the seed
        distributed.set_rng_state(saved["rng"][dist.rank], dist.device)
    if chosen.accum and chosen.accum != accum:  # the epoch's steps in this run's micro-batches
        saved = {**saved, "step_in_epoch": saved["step_in_epoch"] // chosen.accum * accum}
    return saved


def _load_chosen(path: Path, step: int, resume_key: str) -> tuple[dict | None, str | None]:
    """Another rank's read of the checkpoint rank 0 chose (and verified): (checkpoint,
    None), or (None, what is wrong with it here)."""
    try:
        saved = checkpoint.load_any(path)
    except Exception as e:  # noqa: BLE001 - reported by every rank together, below
        return None, f"it cannot be read here ({type(e).__name__}: {str(e)[:120]})"
    if saved.get("step") != step or saved.get("resume_key") != resume_key:
        return None, (f"the file here holds step {saved.get('step')}"
                      + ("" if saved.get("resume_key") == resume_key else " of another run"))
    return saved, None


def _match_layouts(opt) -> None:
    """Each parameter's optimizer state (momentum, Adam's moments) in the parameter's own
    memory layout. The fused optimizers read parameter, gradient and state as flat memory
    side by side: a contiguous momentum buffer next to a channels_last weight (a checkpoint
    of another layout, or of an older ddpflow) would be summed element by wrong element."""
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p, {})
            for k, v in state.items():
                if torch.is_tensor(v) and v.shape == p.shape and v.stride() != p.stride():
                    state[k] = torch.empty_like(p, dtype=v.dtype).copy_(v)
