"""The checkpointer of one stage: what it saves, when, and reading it back.

It holds the stage's stateful parts as one bundle (`Parts`: the model, DDP- or FSDP-wrapped,
optimizer, scheduler, GradScaler, EMA), so restore and save cannot drift apart, and it
decides when to save:
    due        every `checkpoint.every_steps` optimizer steps, at every
               `checkpoint.every_epochs`-th epoch end, and at the next save point after
               validation found a new best (best.pt comes with the next save)
    the gate   a save is a collective that also gathers every rank's first bad step: weights
               a NaN/inf loss has touched are never saved (`save` returns why instead)
    writing    the state is copied to host memory at the step boundary (the only part
               training waits for), then a background thread writes best.pt and the
               checkpoint (serialise, checksum, fsync, rename: checkpoint.py's atomic rules).
               The next save, a stop and the stage's end wait for the write in flight. DDP:
               rank 0 saves the whole state; FSDP: every rank its shards (shardedckpt.py),
               rank 0 the rest, best.pt gathered
    restore    the checkpoint resume.choose picked, into the same bundle (resume.restore)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from ddpflow.core.errors import OneRankError, UserError
from ddpflow.engine import checkpoint, distributed, resume
from ddpflow.engine.ema import Ema
from ddpflow.engine.stagelog import write_best
from ddpflow.engine.state import StageFiles, TrainState
from ddpflow.seams.models import unwrap


@dataclass
class Parts:
    """What a checkpoint restores and saves besides TrainState."""

    model: torch.nn.Module  # wrapped (DDP, FSDP, DataParallel) or plain
    train_model: torch.nn.Module  # what the step runs: the compiled model, or `model`
    opt: torch.optim.Optimizer
    sched: Any  # torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    ema: Ema | None
    sharded: bool  # strategy fsdp: the model and optimizer are sharded across the ranks

    @property
    def plain(self) -> torch.nn.Module:
        return unwrap(self.model)


class RankZeroWriter(checkpoint.BackgroundWriter):
    """Rank 0's writes (best.pt; a DDP checkpoint): a place that cannot take them (a full
    disk) is a mistake rank 0 alone finds while the other ranks train on, so it is raised as
    OneRankError (reported, rank 0 waits to be stopped with them: no rank crashes first)."""

    def wait(self) -> None:
        try:
            super().wait()
        except OneRankError:
            raise
        except UserError as e:
            raise OneRankError(str(e)) from None


class Checkpointer:
    def __init__(self, files: StageFiles, cfg_checkpoint, dist, parts: Parts):
        self.files, self.dist, self.parts = files, dist, parts
        self.every_steps = cfg_checkpoint.every_steps  # 0: only at epoch ends
        self.every_epochs = cfg_checkpoint.every_epochs  # 0: none at epoch ends
        self.keep_last = cfg_checkpoint.keep_last
        self.best_due = False  # validation found a new best: best.pt with the next save
        self.writer = RankZeroWriter(cfg_checkpoint.background)
        self.host_copy = checkpoint.HostCopy()
        self.shards = None
        if parts.sharded:  # every rank: a collective (the writer's own process group)
            from ddpflow.engine.shardedckpt import ShardedWriter

            self.shards = ShardedWriter(dist, files.ckpt_dir, self.keep_last,
                                        cfg_checkpoint.background)

    # ------------------------------------------------------------------ when
    def due_at_step(self, step: int) -> bool:
        return bool(self.every_steps) and step % self.every_steps == 0

    def due_at_epoch_end(self, epoch: int) -> bool:
        """At the end of epoch `epoch` (counted from 1): a checkpoint is due there."""
        return bool(self.every_epochs) and epoch % self.every_epochs == 0

    # ------------------------------------------------------------------ restore
    def restore(self, chosen, accum: int) -> TrainState | None:
        """Every rank: the chosen checkpoint (resume.choose) into the bundle; its TrainState,
        or None for a fresh start. Rank 0 then clears what a killed run left and sets aside
        a stale run's checkpoints (never mixed with this one's)."""
        dist = self.dist
        saved = resume.restore(chosen, self.files, dist, self.parts, accum)
        distributed.gather_objects(dist, None)  # barrier: every rank has read its checkpoint
        if dist.is_master:
            (self.files.out / "failed.json").unlink(missing_ok=True)
            checkpoint.remove_partial(self.files.ckpt_dir)  # temp files of a killed write
            if not chosen:
                checkpoint.set_aside(self.files.ckpt_dir)
        return TrainState.from_checkpoint(saved) if saved else None

    # ------------------------------------------------------------------ save
    def save(self, state: TrainState, snapshot, bad_steps: tuple,
             with_ckpt: bool = True) -> list | None:
        """Every rank (a collective: every rank's RNG state and first bad steps
        `bad_steps`, a sync point): a checkpoint as of `snapshot()` (TrainState with the
        device counters read) when `with_ckpt`, and best.pt of `state.best` when due.
        Returns the ranks' (first bad loss step, first bad input step) instead, saving
        nothing, when a NaN/inf loss has touched the weights."""
        dist = self.dist
        gathered = distributed.gather_objects(dist, (distributed.rng_state(dist.device), bad_steps))
        bad = [g[1] for g in gathered if g[1][0] >= 0]
        if bad:
            return bad
        best = dict(state.best) if self.best_due else None
        self._save(snapshot() if with_ckpt else None, [g[0] for g in gathered], best)
        self.best_due = False
        return None

    def _save(self, now: TrainState | None, rngs: list, best: dict | None) -> None:
        p, dist = self.parts, self.dist
        if self.shards is None:
            if dist.is_master:
                state = self.state_dict(now, rngs, with_optimizer=True) if now else None
                self._write_async(p.plain.state_dict(), p.ema, state, best)
            return
        from ddpflow.engine.shardedckpt import full_model

        whole = full_model(p.model, dist) if best is not None else None  # a collective
        if now:
            state = self.state_dict(now, rngs, with_optimizer=False) if dist.is_master else None
            self.shards.save(now.step, p.model, p.opt, state)  # a collective: DCP's plan
        if dist.is_master and best is not None:
            self._write_async(whole, None, None, best)

    def state_dict(self, now: TrainState, rngs: list, with_optimizer: bool) -> dict:
        """Everything a checkpoint holds besides the model's weights: TrainState as of this
        step, optimizer (not when sharded apart), scheduler, scaler, every rank's RNG state
        and what the stage was made of."""
        p = self.parts
        return {**({"optimizer": p.opt.state_dict()} if with_optimizer else {}),
                "scheduler": p.sched.state_dict(), "scaler": p.scaler.state_dict(),
                **asdict(now), "rng": rngs, **self.files.stamp()}

    def _write_async(self, model: dict, ema, state: dict | None, best: dict | None) -> None:
        """The host copies now (a sync point on a GPU), the files in the background."""
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
            checkpoint.save(self.files.ckpt_dir, state["step"],
                            {"model": model, **extra, **state}, self.keep_last)

    def wait(self) -> None:
        """Until the writes in flight are complete (raises their error, if one had one)."""
        self.writer.wait()
        if self.shards is not None:
            self.shards.wait()

    def final_weights(self) -> tuple[dict | None, str | None]:
        """(the plain module's whole state dict, None on FSDP's other ranks; this rank's
        hash of it, None there). FSDP: gathered once, a collective."""
        from ddpflow.engine.runtime import weights_sha256

        if self.parts.sharded:
            from ddpflow.engine.shardedckpt import full_model

            whole = full_model(self.parts.model, self.dist)
            return whole, weights_sha256(whole) if whole is not None else None
        return self.parts.plain.state_dict(), weights_sha256(self.parts.plain)
