"""Train one stage with DDP (or FSDP, sharding.py) + automatic mixed precision.

Every rank runs this, started by the torchrun line `ddpflow launch` builds (`--dry-run`
prints it); on CPU, gloo ranks. Rank 0 alone writes files and shows the progress bar.
`Trainer.run` reads top to bottom: setup (checkpoint choice, data, model, optimizer, resume),
then epochs of `train_step`s with `log_interval`s, `validate` and `checkpoint` at epoch ends
(saver.py writes in the background), then `finish`. `clock` (wallclock.py) gives every second
to a phase. What a user replaces comes in through seams: the model builder (models.py), the
data (data/pipeline.py) and the task (tasks.py). `TrainState` (state.py) is exactly what a
checkpoint holds besides the tensors' states. The collaborators (build.py, resume.py,
validation.py, saver.py, stagelog.py, earlystop.py) get what they need as arguments and
return what they change; only this file changes the trainer.
"""
from __future__ import annotations

import os
import socket
import sys
import time
from contextlib import nullcontext
from dataclasses import replace

import torch
from torch import nn
from tqdm import tqdm

from ddpflow.config import Config
from ddpflow.core import lazydynamo
from ddpflow.core.errors import nondeterministic
from ddpflow.data import prepared
from ddpflow.data.pipeline import close_workers
from ddpflow.engine import checkpoint, distributed, earlystop, resume, stagelog, stopflag
from ddpflow.engine.build import data_parts, model_parts, optimizer_parts, stage_setup
from ddpflow.engine.efficiency import FlopCount, GpuSampler, replica_flops, replicas
from ddpflow.engine.rankmemory import activation_meter, memory_record
from ddpflow.engine.runtime import StopPoll, trace_file
from ddpflow.engine.saver import Saver, final_weights
from ddpflow.engine.sharding import check_precision
from ddpflow.engine.stagelog import interval_record, progress_line
from ddpflow.engine.state import StageEnd, TrainState
from ddpflow.engine.step import StepCounters, divergence, micro_step, update
from ddpflow.engine.tune import stage_settings
from ddpflow.engine.validation import Validator, best_after
from ddpflow.results.metrics import MetricsLog
from ddpflow.results.provenance import init_source
from ddpflow.results.wallclock import WallClock, process_start
from ddpflow.seams.models import count_text, param_count, unwrap
from ddpflow.seams.userimport import add_code_dirs
from ddpflow.tracking.profiling import open_profiler
from ddpflow.tracking.trackers import open_trackers


class Trainer:
    def __init__(self, cfg: Config, stage: str, halt_after_steps=None, halt_after_epochs=None):
        self.cfg, self.st = cfg, cfg.stage(stage)
        self.out = cfg.stage_dir(self.st.name)
        self.halt_after_steps, self.halt_after_epochs = halt_after_steps, halt_after_epochs
        self.state = TrainState()
        self.diverged: str | None = None  # the reason, once a NaN/inf loss was seen on a rank
        self.halted = False
        self.test_metrics: dict = {}  # test_<metric> at the stage's end (no test split: {})
        # wall time since `ddpflow launch` started, phase by phase (summary.json "wall")
        self.clock = WallClock()
        self.clock.marks["rank_process"] = round(process_start() - self.clock.t0, 4)
        self.clock.mark("rank_imports")
        self.best_due = False  # best.pt is written with the next save

    def say(self, msg: str) -> None:
        if self.d.is_master:
            tqdm.write(f"[{self.st.name}] {msg}", file=sys.stderr)

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        cfg, st = self.cfg, self.st
        if not (st.compile or cfg.tune.compile):  # tune.json may turn compile on
            lazydynamo.defer()  # seconds of start-up that only torch.compile needs
        self.d = d = distributed.setup(cfg.hardware, process_group={
            "ddp": True, "fsdp": "always", "dp": False}[st.strategy])
        self.clock.mark("process_group")
        distributed.seed_everything(cfg.seed, d.rank, cfg.deterministic)
        add_code_dirs(cfg)
        stopflag.install()  # (again: `ddpflow train` installs it before its imports)
        # batch size, precision and layout: the config's, or tune.json's for "auto"
        self.settings = stage_settings(cfg, st, d.device, self.say)
        self.tuned, self.precision = self.settings.tuned, self.settings.precision
        self.compile, self.sharded = self.settings.compile, st.strategy == "fsdp"
        check_precision(st.strategy, self.precision, cfg.stage_index(st.name))
        self.meta = prepared.read_meta(cfg.data_dir) or prepared.load(cfg.data_dir)[0]
        # the checkpoint to resume, before the data: on other ranks it keeps its global batch
        self.files = resume.stage_files(cfg, st.name, self.meta, init_source(cfg, st.name))
        self.chosen = resume.choose(self.files, d) if cfg.checkpoint.resume == "auto" else None
        self.batch_size, self.accum, changed = resume.layout(
            self.chosen, self.settings.batch_size, st.grad_accum_steps, d.world,
            f"stages.{cfg.stage_index(st.name)}")
        if changed:
            self.say(changed)
        self.data, self.steps_per_epoch, self.total_steps = data_parts(
            cfg, st, d, self.meta, self.settings, self.batch_size, self.accum,
            trace_file(d.rank), self.say)
        self.clock.mark("data")
        self.global_batch = self.batch_size * d.world * self.accum
        parts = model_parts(cfg, st, d, self.data, self.batch_size, self.precision,
                            self.compile, self.settings.channels_last, self.say)
        self.model, self.train_model, self.ema = parts.model, parts.train_model, parts.ema
        self.task, self.monitor, self.mode = parts.task, parts.monitor, parts.mode
        self.checkpointed = parts.checkpointed  # blocks recomputed in the backward
        self.lr, self.opt, self.sched, self.scaler, self.autocast = optimizer_parts(
            self.model, st, self.global_batch, self.steps_per_epoch, self.total_steps,
            self.precision, d.device)
        self.fixed = stage_setup(parts, d, st, self.data, self.settings, self.accum,
                                 self.global_batch, self.lr)
        self.validator = Validator(d, self.task, cfg.task.name, self.autocast, self.batch_size,
                                   self.say, self.sharded)
        self.stop_rule = earlystop.stop_rule(st.stop, f"stages.{cfg.stage_index(st.name)}",
                                             self.task, cfg.task.name, self.monitor, self.mode)
        self.clock.mark("model")
        self.resume()
        self.clock.mark("resume")

    def resume(self) -> None:
        """Continue from the checkpoint `setup` chose (resume.py), if any."""
        cfg, d = self.cfg, self.d
        self.files = replace(self.files, monitor=self.monitor, mode=self.mode)
        self.saver = Saver(self.files, cfg.checkpoint.keep_last, cfg.checkpoint.background,
                           d, self.sharded)
        found = self.chosen
        saved = resume.restore(found, self.files, d, unwrap(self.model), self.opt, self.sched,
                               self.scaler, self.ema, self.sharded, self.accum)
        if saved:
            self.state = TrainState.from_checkpoint(saved)
            self.say(f"resumed from {found.path.name}: step {self.state.step}, "
                     f"epoch {self.state.epoch}")
        distributed.gather_objects(d, None)  # barrier: every rank has read its checkpoint
        if d.is_master:
            (self.out / "failed.json").unlink(missing_ok=True)
            checkpoint.remove_partial(self.files.ckpt_dir)  # temp files of a killed write
            if not found:  # never mix with a stale run's checkpoints
                checkpoint.set_aside(self.files.ckpt_dir)
        self.trackers = (open_trackers(self.cfg, self.st.name, self.state.step,
                                       self.files.resume_key) if d.is_master else None)
        self.log = (MetricsLog(self.out / "metrics.jsonl", keep_until_step=self.state.step,
                               tracker=self.trackers) if d.is_master else None)

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        self.setup()
        s, d = self.state, self.d
        self.say(f"{self.cfg.model.name} ({count_text(param_count(self.model))} params) on "
                 f"{d.world} x {d.device.type}, {self.precision}, global batch "
                 f"{self.global_batch} ({self.batch_size}/rank x {d.world} x {self.accum} "
                 f"accum), lr {self.lr:g}, {self.total_steps} steps")
        self.start_counters()
        # an epoch whose steps are done but not yet validated (stopped at its last step) is
        # validated on resume: in_epoch > 0 until the epoch's validation has run
        while ((s.step < self.total_steps or self.in_epoch > 0) and not self.halted
               and "stopped" not in s.stop):  # early stopping (earlystop.py)
            self.train_epoch()
            if self.halted:
                break
            last = s.step >= self.total_steps  # the last epoch is always validated
            if last or (s.epoch + 1) % self.st.validate_every_epochs == 0:
                self.validate()
            s.epoch += 1
            self.in_epoch = 0
            every = self.cfg.checkpoint.every_epochs  # 0: no checkpoint at epoch ends
            self.halted = s.epoch == self.halt_after_epochs  # a sweep's rung: pause here
            due = (bool(every) and s.epoch % every == 0) or self.halted  # (resumable)
            if (due or self.best_due) and not self.checkpoint(ckpt=due):
                break
        self.clock.lap("train")
        if self.prof:
            self.prof.close()
        close_workers(self.data.train)
        self.bar.close()
        if self.gpu:
            self.gpu.close()
        self.finish()
        distributed.teardown(d)
        return 0

    def start_counters(self) -> None:
        s, d = self.state, self.d
        self.bar = tqdm(total=self.total_steps, initial=s.step, desc=self.st.name, unit="step",
                        file=sys.stderr, disable=not d.is_master or None, dynamic_ncols=True,
                        mininterval=1.0)
        self.t_start = time.perf_counter()
        self.counters = StepCounters(s, d.device)  # summed on the device: no sync per step
        self.in_epoch = s.step_in_epoch // self.accum
        self.first_interval = True
        self.flops_per_micro = None  # FLOPs of one micro-batch, forward + backward, once
        self.activations = None  # what one micro-batch keeps for the backward (rankmemory)
        self.gpu = GpuSampler(list(self.fixed.devices)) if d.is_master else None
        self.stop_poll = StopPoll(self.cfg.stop_check_s, s.step)
        self.prof = open_profiler(self.cfg, self.st.name, d.rank, d.device, self.out)
        self.clock.lap("startup")  # start-up ends here: the loop asks for its first batch

    def train_epoch(self) -> None:
        s = self.state
        self.train_model.train()
        self.interval = [time.perf_counter(), 0.0, 0]  # start, data wait (s), steps
        it = self.data.train.epoch(s.epoch, s.step_in_epoch)
        if self.st.progressive_resize:  # another image size: count the FLOPs again
            self.flops_per_micro = None
            self.say(f"epoch {s.epoch}: training images at {self.data.train.size_at(s.epoch)} px")
        s.step_in_epoch = 0
        while self.in_epoch < self.steps_per_epoch and s.step < self.total_steps:
            self.train_step(it)
            if self.prof:
                self.prof.step()
            if s.step % self.cfg.log_every_steps == 0 or s.step == self.total_steps:
                stop_now = self.log_interval()
                if self.halted:
                    return
            else:
                # every ~stop_check_s seconds between log lines: a small collective
                stop_now = self.stop_poll.poll(self.d, s.step, self.interval)
            if stop_now:  # preemption: every rank stops at the same step
                self.say(f"{stopflag.received() or 'signal'} received: checkpoint at step "
                         f"{s.step}")
                self.checkpoint()
                self.halted = True
                return
            if self.halt_after_steps is not None and s.step >= self.halt_after_steps:
                self.checkpoint()
                self.say(f"halted after step {s.step} as asked; the checkpoint resumes it")
                self.halted = True
                return
            every = self.cfg.checkpoint.every_steps
            if every and s.step % every == 0 and not self.checkpoint():
                self.halted = True
                return

    def train_step(self, it) -> None:
        """One optimizer step: accum micro-batches, gradients all-reduced on the last."""
        s, model = self.state, self.model
        for micro in range(self.accum):
            self.clock.lap("train")
            batch = next(it)
            self.interval[1] += self.clock.lap("data_wait")  # host time blocked on the batch
            # DDP all-reduces on the last micro-batch only; FSDP reduce-scatters every one
            # (it has no no_sync): its gradients stay sharded, its memory low
            last = micro == self.accum - 1 or not hasattr(model, "no_sync")
            counting = self.flops_per_micro is None
            metering = not counting and self.activations is None  # the next micro-batch
            n_replicas = replicas(model) if counting else 1
            if n_replicas > 1:  # DataParallel's threads: counted apart
                self.flops_per_micro = replica_flops(unwrap(model), batch, self.batch_size,
                                                     n_replicas, self.micro)
            counter = FlopCount() if self.flops_per_micro is None else nullcontext()
            # the counted micro-batch runs on the uncompiled model: Dynamo does not compile a
            # frame while a dispatch mode (the FLOP counter) is active
            net = model if counting else self.train_model
            with counter, nullcontext() if last else model.no_sync(), (
                    activation_meter(self.checkpointed) if metering else nullcontext({})) as m:
                loss = self.micro(net, batch, check=counting)
            if self.flops_per_micro is None:
                self.flops_per_micro = counter.total
            if metering:
                self.activations = m
            self.counters.add_loss(loss, batch[0])  # NaN/inf inputs are told apart (step.py)
        update(model, self.opt, self.sched, self.scaler, self.st.grad_clip, self.counters)
        s.step += 1
        if self.ema:
            self.ema.update(unwrap(model), s.step)
        s.loss_count += 1
        self.in_epoch += 1
        self.interval[2] += 1
        self.bar.update(1)
        if "first_step" not in self.clock.marks:
            self.clock.mark("first_step")  # host side: the step's kernels may still be queued

    def micro(self, net: nn.Module, batch, check: bool = False) -> torch.Tensor:
        return micro_step(net, batch, self.task, self.autocast, self.scaler, self.accum,
                          self.cfg.task.name if check else None)

    def log_interval(self) -> bool:
        """Sync point: the interval's loss to the host and one collective of per-rank
        timings, first bad step and stop flag. Returns whether a rank asked to stop."""
        s, d = self.state, self.d
        # sync point first: .item() waits for the interval's queued kernels, and only then is
        # the clock read (read before, samples/s and MFU would count unfinished work)
        loss_value = float(self.counters.loss_sum.item()) / s.loss_count
        first_bad, bad_input = self.counters.bad_steps()
        now = time.perf_counter()
        t0, wait, n = self.interval
        dt = now - t0
        per_rank = distributed.all_gather_floats(
            d, [dt / n, wait / dt, first_bad, 1.0 if stopflag.received() else 0.0, bad_input])
        bad_steps = [(int(r[2]), int(r[4])) for r in per_rank if r[2] >= 0]
        if bad_steps:  # every rank sees it and stops; the last checkpoint stays
            self.diverged = divergence(self.cfg, self.st.name, bad_steps, loss_value, s.epoch)
            self.halted = True
            return False
        if d.is_master:
            rec = self.log.write(interval_record(
                s, self.fixed, per_rank, dt, wait, n, loss=loss_value,
                lr=self.sched.get_last_lr()[0], flops_per_micro=self.flops_per_micro,
                gpu=self.gpu.interval(), skipped=int(self.counters.skipped.item()),
                grad_scale=self.scaler.get_scale() if self.scaler.is_enabled() else None,
                warmup=self.first_interval, time_s=s.elapsed_s + now - self.t_start))
            self.bar.set_postfix(loss=f"{loss_value:.3f}", refresh=False)
            if self.bar.disable:  # no terminal (a log file, a Snakemake job): a line instead
                self.say(progress_line(rec, self.total_steps))
        self.counters.loss_sum.zero_()
        s.loss_count = 0
        self.first_interval = False
        self.interval = [time.perf_counter(), 0.0, 0]
        self.stop_poll.seen(s.step, max(r[0] for r in per_rank))
        return any(r[3] > 0 for r in per_rank)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """The task's metrics over the validation split (validation.py); the monitored one
        decides best.pt."""
        d, s = self.d, self.state
        self.clock.lap("train", sync=d.device)  # sync point: queued steps count as training
        metrics = self.validator.stage_metrics(unwrap(self.train_model), self.ema,
                                               self.data.val)  # sync points
        best = best_after(metrics, self.state, self.monitor, self.mode, self.cfg.task.name)
        if best:
            self.state.best, self.best_due = best, True  # best.pt: with the next save
        s.stop = earlystop.after_validation(self.stop_rule, s, metrics, self.t_start,
                                            self.clock.t0, self.say)
        if d.is_master:
            self.log.write({"kind": "val", "step": s.step, "epoch": s.epoch, **metrics,
                            "time_s": s.elapsed_s + time.perf_counter() - self.t_start})
            shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
            self.say(f"epoch {s.epoch}: {shown}")
        self.clock.lap("validation")

    # ------------------------------------------------------------------ checkpoint, finish
    def checkpoint(self, ckpt: bool = True) -> bool:
        """Save, unless some rank's loss went bad since the last save (then False): a
        checkpoint (ckpt) and best.pt when validation improved it (saver.py)."""
        s, d = self.state, self.d
        self.clock.lap("train")
        # a collective (every rank's RNG state, first bad step): a sync point
        gathered = distributed.gather_objects(
            d, (distributed.rng_state(d.device), self.counters.bad_steps()))
        bad_steps = [g[1] for g in gathered if g[1][0] >= 0]
        if bad_steps:  # never save weights that a NaN/inf loss has already touched
            self.diverged = divergence(self.cfg, self.st.name, bad_steps, "NaN/inf", s.epoch)
            return False
        # the host copy blocks; the files are written in the background (saver.py)
        self.saver.save_stage(d, unwrap(self.model), self.opt, self.sched, self.scaler,
                              self.ema, self.now() if ckpt else None, [g[0] for g in gathered],
                              dict(s.best) if self.best_due else None)
        self.best_due = False
        self.clock.lap("checkpoint")
        return True

    def now(self) -> TrainState:
        """TrainState as of this step, with the device counters read (sync points)."""
        s = self.state
        return replace(s, step_in_epoch=self.in_epoch * self.accum,
                       elapsed_s=s.elapsed_s + time.perf_counter() - self.t_start,
                       loss_sum=float(self.counters.loss_sum.item()),
                       skipped_steps=int(self.counters.skipped.item()),
                       wall_s=self.clock.total(s.wall_s), runs=s.runs + 1, world=self.d.world,
                       accum=self.accum, batch_size=self.batch_size)

    def finish(self) -> None:
        """failed.json, or final.pt and summary.json (only for a finished stage)."""
        # the test split, once, after the last validation and save: nothing selects on it
        if self.data.test and not (self.diverged or self.halted):
            self.test_metrics = self.validator.test_metrics(  # all ranks: sync points
                unwrap(self.model), self.ema, self.data.test)
            self.say("test: " + ", ".join(f"{k} {v:.4f}" for k, v in self.test_metrics.items()))
        # every rank's weights hashed (DDP must have kept them identical, on one node or
        # several; FSDP's, gathered whole once), with its host and memory
        weights, own_hash = final_weights(unwrap(self.model), self.d, self.sharded)
        pairs = distributed.gather_objects(self.d, (own_hash, socket.gethostname(), memory_record(
            unwrap(self.model), self.opt, self.activations, self.d.device)))
        if not self.d.is_master:
            return self.saver.wait()  # its shards (FSDP) are written before the rank leaves
        end = StageEnd(
            diverged=self.diverged, halted=self.halted, test_metrics=self.test_metrics,
            weight_hashes=[p[0] for p in pairs if p[0]], rank_hosts=[p[1] for p in pairs],
            train_t0=self.t_start - self.state.elapsed_s,
            flops_per_micro=self.flops_per_micro, skipped=int(self.counters.skipped.item()),
            model=weights, ema=self.ema.weights() if self.ema else None,
            memory=[p[2] for p in pairs])
        # failed.json, or final.pt and summary.json; the trackers closed
        stagelog.write_results(self.files, self.fixed, self.state, end, self.clock, self.log,
                               self.saver, self.trackers, self.say)


def train_stage(cfg: Config, stage_name: str, halt_after_steps=None, halt_after_epochs=None):
    """Run (or resume) one stage. Returns 0 when it finished or stopped at a checkpoint."""
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    try:
        return Trainer(cfg, stage_name, halt_after_steps, halt_after_epochs).run()
    except RuntimeError as e:
        mistake = nondeterministic(e, cfg.model.name)
        if mistake is None:
            raise
        raise mistake from None


main = train_stage  # what each torchrun rank runs (cli.py)
