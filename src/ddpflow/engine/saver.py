"""Saving a stage without stopping it: rank 0 copies the state to host memory at the step
boundary (the only part training waits for), then a background thread writes best.pt and
the checkpoint (serialise, checksum, fsync, rename: checkpoint.py's atomic rules). The next
save, a stop and the stage's end wait for the write in flight. `restore` reads the newest
valid checkpoint back in. Reads the `Trainer` (train.py) it saves, like stagelog.py."""

from __future__ import annotations

import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from ddpflow.engine import checkpoint, distributed
from ddpflow.engine.stagelog import write_best
from ddpflow.seams.models import unwrap


class Saver:
    def __init__(self, trainer):
        self.t = trainer
        self.writer = checkpoint.BackgroundWriter(trainer.cfg.checkpoint.background)
        self.host_copy = checkpoint.HostCopy()

    def save(self, gathered: list, ckpt: bool, best: dict | None) -> None:
        """On rank 0: a checkpoint (ckpt) and best.pt (best: TrainState.best now) from the
        state as it is at this step; `gathered`: every rank's (RNG state, first bad step)."""
        t = self.t
        self.writer.wait()  # the previous write is done: its host buffers are free
        model = self.host_copy(unwrap(t.model).state_dict(), "model")
        ema = self.host_copy(t.ema.weights(), "ema") if t.ema else None
        state = self.host_copy(checkpoint_state(t, gathered), "state") if ckpt else None
        self.host_copy.finish()  # sync point (GPU): the copies have landed
        self.writer.submit(self._write, model, ema, state, best)

    def _write(self, model: dict, ema: dict | None, state: dict | None,
               best: dict | None) -> None:
        if best is not None:  # the weights the stage hands on: the EMA's when it is on
            write_best(self.t, model, best, ema)
        if state is not None:
            extra = {"ema": ema, "ema_updates": self.t.ema.updates()} if ema is not None else {}
            checkpoint.save(self.t.ckpt_dir, state["step"], {"model": model, **extra, **state},
                            self.t.cfg.checkpoint.keep_last)

    def wait(self) -> None:
        """Until the write in flight is complete (raises its error, if it had one)."""
        self.writer.wait()


def checkpoint_state(t, gathered: list) -> dict:
    """Everything a checkpoint holds besides the model's weights: TrainState as of this
    step, optimizer, scheduler, scaler, every rank's RNG, and what the stage was made of."""
    s = t.state
    now = replace(s, step_in_epoch=t.in_epoch * t.accum,
                  elapsed_s=s.elapsed_s + time.perf_counter() - t.t_start,
                  loss_sum=float(t.loss_sum.item()), skipped_steps=int(t.skipped.item()),
                  wall_s=t.clock.total(s.wall_s), runs=s.runs + 1)
    return {"optimizer": t.opt.state_dict(), "scheduler": t.sched.state_dict(),
            "scaler": t.scaler.state_dict(), **asdict(now), "rng": [g[0] for g in gathered],
            "stage": t.st.name, "config": t.cfg.to_dict(), "config_hash": t.cfg.hash,
            "stage_hash": t.cfg.stage_hash(t.st.name), "resume_key": t.resume_key,
            "record": t.record}


def restore(t) -> tuple[Path, dict] | None:
    """The newest valid checkpoint of the trainer's very inputs (its resume key), loaded into
    its model, optimizer, scheduler, scaler, EMA and this rank's random streams: (path, the
    checkpoint) for TrainState, or None without one."""
    d = t.d
    found = checkpoint.latest_valid(t.ckpt_dir, t.resume_key,
                                    warn=print if d.is_master else lambda *a, **k: None)
    if not found:
        return None
    saved = found[1]
    unwrap(t.model).load_state_dict(saved["model"])
    t.opt.load_state_dict(saved["optimizer"])
    _match_layouts(t.opt)
    t.sched.load_state_dict(saved["scheduler"])
    t.scaler.load_state_dict(saved["scaler"])
    if t.ema:
        t.ema.load(saved["ema"], saved["ema_updates"])
    if len(saved["rng"]) == d.world:
        distributed.set_rng_state(saved["rng"][d.rank], d.device)
    return found


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
