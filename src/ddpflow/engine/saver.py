"""Saving a stage without stopping it: rank 0 copies the state to host memory at the step
boundary (the only part training waits for), then a background thread writes best.pt and
the checkpoint (serialise, checksum, fsync, rename: checkpoint.py's atomic rules). The next
save, a stop and the stage's end wait for the write in flight. `restore` reads the newest
valid checkpoint back in. Takes what it saves as arguments (state.py), never the Trainer."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from ddpflow.core.errors import UserError
from ddpflow.engine import checkpoint, distributed
from ddpflow.engine.stagelog import write_best
from ddpflow.engine.state import StageFiles, TrainState


class Saver:
    """Rank 0's saves of one stage (`files`): host copy now, files in the background."""

    def __init__(self, files: StageFiles, keep_last: int, background: bool):
        self.files, self.keep_last = files, keep_last
        self.writer = checkpoint.BackgroundWriter(background)
        self.host_copy = checkpoint.HostCopy()

    def save(self, model: dict, ema, state: dict | None, best: dict | None) -> None:
        """A checkpoint (when `state`, from checkpoint_state) and best.pt (when `best`,
        TrainState.best now) of the weights as they are at this step: `model` the plain
        module's state dict, `ema` the stage's Ema or None."""
        self.writer.wait()  # the previous write is done: its host buffers are free
        model = self.host_copy(model, "model")
        weights = self.host_copy(ema.weights(), "ema") if ema else None
        updates = ema.updates() if ema else None
        state = self.host_copy(state, "state") if state is not None else None
        self.host_copy.finish()  # sync point (GPU): the copies have landed
        self.writer.submit(self._write, model, weights, updates, state, best)

    def _write(self, model: dict, ema: dict | None, updates: int | None, state: dict | None,
               best: dict | None) -> None:
        if best is not None:  # the weights the stage hands on: the EMA's when it is on
            write_best(self.files, model, best, ema)
        if state is not None:
            extra = {"ema": ema, "ema_updates": updates} if ema is not None else {}
            checkpoint.save(self.files.ckpt_dir, state["step"], {"model": model, **extra, **state},
                            self.keep_last)

    def wait(self) -> None:
        """Until the write in flight is complete (raises its error, if it had one)."""
        self.writer.wait()


def checkpoint_state(now: TrainState, files: StageFiles, opt, sched, scaler,
                     rngs: list) -> dict:
    """Everything a checkpoint holds besides the model's weights: TrainState as of this
    step (`now`), optimizer, scheduler, scaler, every rank's RNG state (`rngs`), and what the
    stage was made of (`files`)."""
    return {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "scaler": scaler.state_dict(), **asdict(now), "rng": rngs, **files.stamp()}


def restore(files: StageFiles, d, model, opt, sched, scaler, ema) -> tuple[Path, dict] | None:
    """The newest valid checkpoint of the stage's very inputs (its resume key), loaded into
    `model` (the plain module), the optimizer, scheduler, scaler, EMA and this rank's random
    streams: (path, the checkpoint) for TrainState, or None without one.

    Rank 0 alone chooses it (and verifies its SHA-256) and names it to the others, which
    load that very file and check its step: ranks that saw different files (a write landing
    between their listings, a folder not shared between nodes) stop with one message
    instead of training on from different steps."""
    found, failed = None, None
    if d.is_master:
        try:  # whatever rank 0 meets, every rank hears of it in the broadcast (no hang)
            found = checkpoint.latest_valid(files.ckpt_dir, files.resume_key)
        except Exception as e:  # noqa: BLE001 - told to every rank, below
            failed = f"{type(e).__name__}: {str(e)[:160]}"
    chosen = distributed.broadcast_object(
        d, ("failed", failed) if failed else (str(found[0]), found[1]["step"]) if found
        else None)
    if chosen is None:
        return None
    if chosen[0] == "failed":
        raise UserError(f"cannot choose a checkpoint to resume from in {files.ckpt_dir}: "
                        f"{chosen[1]}; move the damaged file away (or set "
                        f"checkpoint.resume: never to start afresh)")
    if not d.is_master:
        found, problem = _load_chosen(Path(chosen[0]), chosen[1], files.resume_key)
    else:
        problem = None
    problems = [(r, p) for r, p in enumerate(distributed.gather_objects(d, problem)) if p]
    if problems:
        rank, problem = problems[0]
        raise UserError(f"rank {rank} cannot resume from {Path(chosen[0]).name}, the "
                        f"checkpoint rank 0 chose (step {chosen[1]}): {problem}; every rank "
                        f"must see the same {files.ckpt_dir} (a shared filesystem)")
    saved = found[1]
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    _match_layouts(opt)
    sched.load_state_dict(saved["scheduler"])
    scaler.load_state_dict(saved["scaler"])
    if ema:
        ema.load(saved["ema"], saved["ema_updates"])
    if len(saved["rng"]) == d.world:
        distributed.set_rng_state(saved["rng"][d.rank], d.device)
    return found


def _load_chosen(path: Path, step: int, resume_key: str) -> tuple[tuple | None, str | None]:
    """Another rank's read of the checkpoint rank 0 chose (and verified):
    ((path, checkpoint), None), or (None, what is wrong with it here)."""
    try:
        saved = checkpoint.load(path)
    except Exception as e:  # noqa: BLE001 - reported by every rank together, below
        return None, f"it cannot be read here ({type(e).__name__}: {str(e)[:120]})"
    if saved.get("step") != step or saved.get("resume_key") != resume_key:
        return None, (f"the file here holds step {saved.get('step')}"
                      + ("" if saved.get("resume_key") == resume_key else " of another run"))
    return (path, saved), None


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
