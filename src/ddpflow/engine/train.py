"""Train one stage with DDP (or FSDP, sharding.py) + automatic mixed precision.

Every rank runs this, started by the torchrun line `ddpflow launch` builds (`--dry-run`
prints it); on CPU, gloo ranks. Rank 0 alone writes files and shows the progress bar.

`Trainer.run` reads top to bottom: `prepare`, then epochs of `train_step`s, `validate` and
checkpoints, then `finish`. The trainer runs the loop; each component owns its own timing:
    settings.py      what the stage runs with (tune.json merged, precision picked, checked)
    checkpointer.py  the stateful parts (one bundle for restore and save), when to save, the
                     gate that never saves weights a NaN/inf loss touched
    intervals.py     when a log line is due and what it holds (a sync point, a collective),
                     the stragglers named (stragglers.py)
    heartbeat.py     each rank's last step in a file, and its stack on request; hang.py: a
                     broken collective's ranks named before the rank leaves
    stopcontrol.py   when training ends early: a stop signal, --halt-after-steps, early stop
    efficiency.py    FirstSteps: what the first micro-batches measure (FLOPs, activations)
What a user replaces comes in through seams: the model builder (seams/models.py), the data
(data/pipeline.py) and the task (seams/tasks.py). `TrainState` (state.py) is exactly what a
checkpoint holds besides the tensors' states; `clock` (wallclock.py) gives every second to a
phase.
"""
from __future__ import annotations

import os
import socket
import sys
import time
from contextlib import nullcontext
from dataclasses import replace

from tqdm import tqdm

from ddpflow.config import Config
from ddpflow.core import lazydynamo
from ddpflow.core.errors import nondeterministic
from ddpflow.data import prepared
from ddpflow.data.pipeline import close_workers
from ddpflow.engine import distributed, earlystop, hang, resume, settings, stagelog, stopflag
from ddpflow.engine.build import data_parts, model_parts, optimizer_parts, stage_setup
from ddpflow.engine.checkpointer import Checkpointer, Parts
from ddpflow.engine.efficiency import FirstSteps
from ddpflow.engine.heartbeat import Heartbeat, attempt_folder
from ddpflow.engine.intervals import IntervalLogger
from ddpflow.engine.memory import memory_record
from ddpflow.engine.runtime import trace_file
from ddpflow.engine.state import StageEnd, TrainState
from ddpflow.engine.step import StepCounters, divergence, micro_step, update
from ddpflow.engine.stopcontrol import HALTED, PREEMPTED, StopControl
from ddpflow.engine.validation import Validator, best_after, metrics_text
from ddpflow.results.metrics import MetricsLog
from ddpflow.results.provenance import init_source
from ddpflow.results.wallclock import WallClock, process_start
from ddpflow.seams.models import count_text, param_count, unwrap
from ddpflow.seams.userimport import add_code_dirs
from ddpflow.tracking.profiling import open_profiler
from ddpflow.tracking.trackers import open_trackers


class Trainer:
    def __init__(self, cfg: Config, stage: str, halt_after_steps: int | None = None,
                 halt_after_epochs: int | None = None):
        self.cfg, self.stage = cfg, cfg.stage(stage)
        self.stops = StopControl(cfg.stop_check_s, halt_after_steps, halt_after_epochs)
        self.state = TrainState()
        self.diverged: str | None = None  # why, once a NaN/inf loss was seen on some rank
        self.halted = False  # stopped at a checkpoint before the end: resumable
        # wall time since `ddpflow launch` started, phase by phase (summary.json "wall")
        self.clock = WallClock()
        self.clock.marks["rank_process"] = round(process_start() - self.clock.t0, 4)
        self.clock.mark("rank_imports")

    def say(self, msg: str) -> None:
        if self.dist.is_master:
            tqdm.write(f"[{self.stage.name}] {msg}", file=sys.stderr)

    # ------------------------------------------------------------------ setup
    def prepare(self) -> None:
        """Everything before the first step, in an order that matters (see the comments)."""
        cfg, stage = self.cfg, self.stage
        where = f"stages.{cfg.stage_index(stage.name)}"
        if not (stage.compile or cfg.tune.compile):  # tune.json may turn compile on
            lazydynamo.defer()  # seconds of start-up that only torch.compile needs
        self.dist = dist = distributed.setup(cfg.hardware, process_group={
            "ddp": True, "fsdp": "always", "dp": False}[stage.strategy])
        # a group of its own for naming the ranks of a broken collective (hang.py), and this
        # rank's heartbeat: its last step and, on request, its stack
        self.watch = hang.watch_group(dist)
        self.beat = Heartbeat(attempt_folder(cfg.stage_dir(stage.name)), dist.rank, dist.world)
        self.clock.mark("process_group")
        distributed.seed_everything(cfg.seed, dist.rank, cfg.deterministic)
        add_code_dirs(cfg)
        stopflag.install()  # (again: `ddpflow train` installs it before its imports)
        chosen = settings.resolve(cfg, stage, dist.device, self.say)  # tune.json for "auto"
        settings.set_backend_flags(dist.device, chosen.precision)  # TF32 for fp32 on a GPU
        meta = prepared.read_meta(cfg.data_dir) or prepared.load(cfg.data_dir)[0]
        # the checkpoint to resume, before the data: on other ranks it keeps its global batch
        files = resume.stage_files(cfg, stage.name, meta, init_source(cfg, stage.name))
        ckpt = resume.choose(files, dist) if cfg.checkpoint.resume == "auto" else None
        batch, accum, changed = resume.layout(ckpt, chosen.batch_size, stage.grad_accum_steps,
                                              dist.world, where)
        if changed:
            self.say(changed)
        chosen = replace(chosen, batch_size=batch)
        self.data, steps_per_epoch, total_steps = data_parts(
            cfg, stage, dist, meta, chosen, batch, accum, trace_file(dist.rank), self.say)
        self.clock.mark("data")
        model = model_parts(cfg, stage, dist, self.data, batch, chosen.precision,
                            chosen.compile, chosen.channels_last, self.say)
        lr, opt, sched, scaler, autocast = optimizer_parts(
            model.model, stage, batch * dist.world * accum, steps_per_epoch, total_steps,
            chosen.precision, dist.device)
        self.setup = stage_setup(model, dist, stage, self.data, chosen, accum, lr,
                                  steps_per_epoch, total_steps)
        self.parts = Parts(model.model, model.train_model, opt, sched, scaler, model.ema,
                           stage.strategy == "fsdp")
        self.validator = Validator(dist, model.task, cfg.task.name, autocast, batch, self.say,
                                   self.parts.sharded)
        self.first = FirstSteps(model.model, model.train_model, model.checkpointed, batch,
                                lambda net, b, check: micro_step(
                                    net, b, model.task, autocast, scaler, accum,
                                    cfg.task.name if check else None, self.logger.compute))
        self.clock.mark("model")
        self.files = replace(files, monitor=model.monitor, mode=model.mode)
        self.checkpointer = Checkpointer(self.files, cfg.checkpoint, dist, self.parts)
        self.state = self.checkpointer.restore(ckpt, accum) or self.state
        if ckpt:
            self.say(f"resumed from {ckpt.path.name}: step {self.state.step}, "
                     f"epoch {self.state.epoch}")
        self.stops.begin(self.state.step, earlystop.stop_rule(
            stage.stop, where, model.task, cfg.task.name, model.monitor, model.mode))
        self.trackers = (open_trackers(cfg, stage.name, self.state.step,
                                       self.files.resume_key) if dist.is_master else None)
        self.clock.mark("resume")

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        self.prepare()
        state, setup = self.state, self.setup
        self.say(f"{self.cfg.model.name} ({count_text(param_count(self.parts.plain))} params) "
                 f"on {setup.world} x {setup.device.type}, {setup.precision}, global batch "
                 f"{setup.global_batch} ({setup.batch_size}/rank x {setup.world} x "
                 f"{setup.accum} accum), lr {setup.lr:g}, {setup.total_steps} steps")
        self.start()
        # an epoch whose steps are done but not yet validated (stopped at its last step) is
        # validated on resume: in_epoch > 0 until the epoch's validation has run
        while ((state.step < setup.total_steps or self.in_epoch > 0) and not self.halted
               and not self.stops.stopped(state)):  # early stopping (earlystop.py)
            self.train_epoch()
            if self.halted:
                break
            last = state.step >= setup.total_steps  # the last epoch is always validated
            if (last or (state.epoch + 1) % self.stage.validate_every_epochs == 0
                    or self.stops.halts_after_epoch(state.epoch + 1)):
                self.validate()
            state.epoch += 1
            self.in_epoch = 0
            pause = self.stops.halts_after_epoch(state.epoch)  # a sweep's rung: pause here
            at_end = self.checkpointer.due_at_epoch_end(state.epoch) or pause  # (resumable)
            if (at_end or self.checkpointer.best_due) and not self.checkpoint(ckpt=at_end):
                break
            self.halted = pause
        self.clock.lap("train")
        self.logger.close()  # (and the profiler's trace)
        close_workers(self.data.train)
        self.finish()
        distributed.teardown(self.dist)
        return 0

    def start(self) -> None:
        """The loop's own state: counters on the device, the log (and the profiler)."""
        state, dist = self.state, self.dist
        log = (MetricsLog(self.files.out / "metrics.jsonl", keep_until_step=state.step,
                          tracker=self.trackers) if dist.is_master else None)
        self.logger = IntervalLogger(self.setup, self.cfg.log_every_steps, state.step,
                                     self.stage.name, log, dist.is_master, open_profiler(
                                         self.cfg, self.stage.name, dist.rank, dist.device,
                                         self.files.out),
                                     hosts=distributed.gather_objects(dist, socket.gethostname()),
                                     beat=self.beat)
        self.t_start = time.perf_counter()
        self.counters = StepCounters(state, dist.device)  # summed on the device: no sync per step
        self.in_epoch = state.step_in_epoch // self.setup.accum
        self.clock.lap("startup")  # start-up ends here: the loop asks for its first batch

    def train_epoch(self) -> None:
        state, setup = self.state, self.setup
        self.parts.train_model.train()
        self.logger.restart()
        it = self.data.train.epoch(state.epoch, state.step_in_epoch)
        if self.stage.progressive_resize:  # another image size: count the FLOPs again
            self.first.recount()
            size = self.data.train.size_at(state.epoch)
            self.say(f"epoch {state.epoch}: training images at {size} px")
        state.step_in_epoch = 0
        while self.in_epoch < setup.steps_per_epoch and state.step < setup.total_steps:
            self.train_step(it)
            logged = None
            if self.logger.due(state.step):  # sync point, a collective
                logged = self.logger.write(state, self.counters, self.dist, self.parts.sched,
                                           self.parts.scaler, self.first.flops,
                                           self.t_start - state.elapsed_s)
                if logged.bad_steps:  # every rank sees it and stops; the last checkpoint stays
                    self.diverged = divergence(self.cfg, self.stage.name, logged.bad_steps,
                                               logged.loss, state.epoch)
                    self.halted = True
                    return
            why = self.stops.after_step(self.dist, state.step, self.logger, logged)
            if why == PREEMPTED:  # every rank stops at the same step
                self.say(f"{stopflag.received() or 'signal'} received: checkpoint at step "
                         f"{state.step}")
            if why:
                self.checkpoint()
                if why == HALTED:
                    self.say(f"halted after step {state.step} as asked; the checkpoint resumes it")
                self.halted = True
                return
            if self.checkpointer.due_at_step(state.step) and not self.checkpoint():
                self.halted = True
                return

    def train_step(self, it) -> None:
        """One optimizer step: accum micro-batches, gradients all-reduced on the last."""
        state, model = self.state, self.parts.model
        for micro in range(self.setup.accum):
            self.clock.lap("train")
            batch = next(it)
            self.logger.waited(self.clock.lap("data_wait"))  # host time blocked on the batch
            # DDP all-reduces on the last micro-batch only; FSDP reduce-scatters every one
            # (it has no no_sync): its gradients stay sharded, its memory low
            last = micro == self.setup.accum - 1 or not hasattr(model, "no_sync")
            with nullcontext() if last else model.no_sync():
                loss = self.first(batch)  # the first micro-batches are measured too
            self.counters.add_loss(loss, batch[0])  # NaN/inf inputs are told apart (step.py)
        update(model, self.parts.opt, self.parts.sched, self.parts.scaler, self.stage.grad_clip,
               self.counters)
        state.step += 1
        if self.parts.ema:
            self.parts.ema.update(self.parts.plain, state.step)
        state.loss_count += 1
        self.in_epoch += 1
        self.logger.stepped(state.step)
        if "first_step" not in self.clock.marks:
            self.clock.mark("first_step")  # host side: the step's kernels may still be queued

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """The task's metrics over the validation split (validation.py); the monitored one
        decides best.pt, and early stopping looks at it."""
        state, dist = self.state, self.dist
        self.clock.lap("train", sync=dist.device)  # sync point: queued steps count as training
        metrics = self.validator.stage_metrics(unwrap(self.parts.train_model), self.parts.ema,
                                               self.data.val)  # sync points
        best = best_after(metrics, state, self.files.monitor, self.files.mode, self.cfg.task.name)
        if best:
            state.best, self.checkpointer.best_due = best, True  # best.pt: with the next save
        self.stops.after_validation(state, metrics, self.t_start, self.clock.t0, self.say)
        if dist.is_master:
            self.logger.log.write({"kind": "val", "step": state.step, "epoch": state.epoch,
                                   **metrics, "time_s": state.elapsed_s + time.perf_counter()
                                   - self.t_start})
            self.say(f"epoch {state.epoch}: {metrics_text(metrics)}")
        self.clock.lap("validation")

    # ------------------------------------------------------------------ checkpoint, finish
    def checkpoint(self, ckpt: bool = True) -> bool:
        """A checkpoint (ckpt) and best.pt when due (checkpointer.py); False, saving nothing,
        when some rank's loss went bad since the last save."""
        self.clock.lap("train")
        bad = self.checkpointer.save(self.state, self.now, self.counters.bad_steps(), ckpt)
        if bad:  # never save weights that a NaN/inf loss has already touched
            self.diverged = divergence(self.cfg, self.stage.name, bad, "NaN/inf",
                                       self.state.epoch)
            return False
        self.clock.lap("checkpoint")
        return True

    def now(self) -> TrainState:
        """TrainState as of this step, with the device counters read (sync points)."""
        state, setup = self.state, self.setup
        return replace(state, step_in_epoch=self.in_epoch * setup.accum,
                       elapsed_s=state.elapsed_s + time.perf_counter() - self.t_start,
                       loss_sum=float(self.counters.loss_sum.item()),
                       skipped_steps=int(self.counters.skipped.item()),
                       wall_s=self.clock.total(state.wall_s), runs=state.runs + 1,
                       world=setup.world, accum=setup.accum, batch_size=setup.batch_size)

    def finish(self) -> None:
        """failed.json, or final.pt and summary.json (only for a finished stage)."""
        test_metrics, plain = {}, self.parts.plain
        # the test split, once, after the last validation and save: nothing selects on it
        if self.data.test and not (self.diverged or self.halted):
            test_metrics = self.validator.test_metrics(plain, self.parts.ema,
                                                       self.data.test)  # all ranks: syncs
            self.say("test: " + metrics_text(test_metrics))
        # every rank's weights hashed (DDP must have kept them identical, on one node or
        # several; FSDP's, gathered whole once), with its host and memory
        weights, own_hash = self.checkpointer.final_weights()
        pairs = distributed.gather_objects(self.dist, (own_hash, socket.gethostname(),
                                                       memory_record(plain, self.parts.opt,
                                                                     self.first.activations,
                                                                     self.dist.device)))
        if not self.dist.is_master:
            return self.checkpointer.wait()  # its shards (FSDP) are written before it leaves
        end = StageEnd(
            diverged=self.diverged, halted=self.halted, test_metrics=test_metrics,
            weight_hashes=[p[0] for p in pairs if p[0]], rank_hosts=[p[1] for p in pairs],
            train_t0=self.t_start - self.state.elapsed_s, flops_per_micro=self.first.flops,
            skipped=int(self.counters.skipped.item()), model=weights,
            ema=self.parts.ema.weights() if self.parts.ema else None,
            memory=[p[2] for p in pairs])
        # failed.json, or final.pt and summary.json; the trackers closed
        stagelog.write_results(self.files, self.setup, self.state, end, self.clock,
                               self.logger.log, self.checkpointer, self.trackers, self.say)


    def broken(self, e: BaseException) -> None:
        """A collective that did not complete: name the ranks that did not arrive, with
        every rank's stack, before this rank leaves (hang.py; the launcher reports it)."""
        beat = getattr(self, "beat", None)
        if beat is not None and hang.is_broken_collective(e):
            hang.diagnose(self.dist, self.watch, beat, e)

    def close(self) -> None:
        if getattr(self, "beat", None) is not None:
            self.beat.close()


def train_stage(cfg: Config, stage_name: str, halt_after_steps=None, halt_after_epochs=None):
    """Run (or resume) one stage. Returns 0 when it finished or stopped at a checkpoint."""
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    trainer = Trainer(cfg, stage_name, halt_after_steps, halt_after_epochs)
    try:
        return trainer.run()
    except RuntimeError as e:
        mistake = nondeterministic(e, cfg.model.name)
        if mistake is None:
            trainer.broken(e)
            raise
        raise mistake from None
    finally:
        trainer.close()


main = train_stage  # what each torchrun rank runs (ddpflow train: cli/)
