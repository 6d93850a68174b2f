"""Saving a stage without stopping it: the state is copied to host memory at the step
boundary (the only part training waits for), then a background thread writes best.pt and
the checkpoint (serialise, checksum, fsync, rename: checkpoint.py's atomic rules). The next
save, a stop and the stage's end wait for the write in flight. DDP: rank 0 saves the whole
state; FSDP: every rank its shards (shardedckpt.py), rank 0 the rest, best.pt gathered.
resume.py reads them back. Takes what it saves as arguments (state.py), never the Trainer."""

from __future__ import annotations

from dataclasses import asdict

from ddpflow.core.errors import OneRankError, UserError
from ddpflow.engine import checkpoint
from ddpflow.engine.stagelog import write_best
from ddpflow.engine.state import StageFiles, TrainState
from ddpflow.seams.models import unwrap


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


class Saver:
    """The saves of one stage (`files`): host copy now, files in the background."""

    def __init__(self, files: StageFiles, keep_last: int, background: bool, d=None,
                 sharded: bool = False):
        self.files, self.keep_last = files, keep_last
        self.writer = RankZeroWriter(background)
        self.host_copy = checkpoint.HostCopy()
        self.shards = None
        if sharded:  # every rank: a collective (the writer's own process group)
            from ddpflow.engine.shardedckpt import ShardedWriter

            self.shards = ShardedWriter(d, files.ckpt_dir, keep_last, background)

    def save_stage(self, d, model, opt, sched, scaler, ema, now: TrainState | None,
                   rngs: list, best: dict | None) -> None:
        """Every rank: a checkpoint as of `now` (None: none) with every rank's RNG state
        `rngs`, and best.pt when `best` (TrainState.best) is given."""
        if self.shards is None:
            if d.is_master:
                state = (checkpoint_state(now, self.files, opt, sched, scaler, rngs)
                         if now else None)
                self.save(unwrap(model).state_dict(), ema, state, best)
            return
        from ddpflow.engine.shardedckpt import full_model

        whole = full_model(model, d) if best is not None else None  # a collective
        if now:
            state = (checkpoint_state(now, self.files, None, sched, scaler, rngs)
                     if d.is_master else None)
            self.shards.save(now.step, model, opt, state)  # a collective: DCP's plan
        if d.is_master and best is not None:
            self.save(whole, None, None, best)

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
        """Until the writes in flight are complete (raises their error, if one had one)."""
        self.writer.wait()
        if self.shards is not None:
            self.shards.wait()


def checkpoint_state(now: TrainState, files: StageFiles, opt, sched, scaler,
                     rngs: list) -> dict:
    """Everything a checkpoint holds besides the model's weights: TrainState as of this
    step (`now`), optimizer (None: sharded apart), scheduler, scaler, every rank's RNG state
    (`rngs`), and what the stage was made of (`files`)."""
    return {**({"optimizer": opt.state_dict()} if opt is not None else {}),
            "scheduler": sched.state_dict(), "scaler": scaler.state_dict(), **asdict(now),
            "rng": rngs, **files.stamp()}


def final_weights(model, d, sharded: bool) -> tuple[dict | None, str | None]:
    """(the plain module's whole state dict, None on FSDP's other ranks; this rank's hash of
    it, None there). FSDP: gathered once, a collective."""
    from ddpflow.engine.runtime import weights_sha256

    if sharded:
        from ddpflow.engine.shardedckpt import full_model

        whole = full_model(model, d)
        return whole, weights_sha256(whole) if whole is not None else None
    return model.state_dict(), weights_sha256(model)
