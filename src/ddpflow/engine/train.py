"""Train one stage with DistributedDataParallel + automatic mixed precision.

Every rank of the node runs this, started by the torchrun line `ddpflow launch` builds
(`ddpflow launch --dry-run` prints it); on CPU, gloo ranks. Rank 0 alone writes
files and shows the progress bar. `Trainer.run` reads top to bottom: setup (data, model,
optimizer, resume), then epochs of `train_step`s with `log_interval`s, `validate` and
`checkpoint` at epoch ends (as often as asked; saver.py writes in the background), then
`finish`. `clock` (wallclock.py) gives every second to a phase. What a user replaces comes in
through seams: the model builder (models.py), the data (data/pipeline.py) and the task
(tasks.py). `TrainState` is exactly what a checkpoint holds besides the tensors' states.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm import tqdm

from ddpflow.config import Config, config_hash
from ddpflow.core import lazydynamo
from ddpflow.core.errors import UserError, nondeterministic
from ddpflow.data import prepared
from ddpflow.data.mixing import Recipe, progressive_sizes
from ddpflow.data.pipeline import close_workers, open_pipeline
from ddpflow.engine import checkpoint, distributed, earlystop, layout, runtime, stopflag
from ddpflow.engine.efficiency import FlopCount, GpuSampler, peak_flops, replica_flops, replicas
from ddpflow.engine.ema import open_ema
from ddpflow.engine.runtime import (
    StopPoll,
    build_optimizer,
    lr_factor,
    mixed_precision,
    schedule,
    trace_file,
)
from ddpflow.engine.saver import Saver, restore
from ddpflow.engine.stagelog import interval_record, write_results
from ddpflow.engine.tune import stage_settings
from ddpflow.engine.validation import VAL_BATCH_FACTOR, stage_metrics, test_metrics
from ddpflow.engine.weights import start_weights
from ddpflow.results.metrics import MetricsLog
from ddpflow.results.provenance import init_source, make_record
from ddpflow.results.wallclock import WallClock, process_start
from ddpflow.seams.models import build_model, forward, input_channels, param_count, unwrap
from ddpflow.seams.tasks import build_task, check_loss, improves, monitor
from ddpflow.seams.userimport import add_code_dirs
from ddpflow.tracking.profiling import open_profiler
from ddpflow.tracking.trackers import open_trackers


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

    @classmethod
    def from_checkpoint(cls, state: dict) -> "TrainState":
        return cls(**{k: state[k] for k in cls.__dataclass_fields__ if k in state})


class Trainer:
    def __init__(self, cfg: Config, stage: str, halt_after_steps: int | None = None):
        self.cfg, self.st = cfg, cfg.stage(stage)
        self.out = cfg.stage_dir(self.st.name)
        self.ckpt_dir = self.out / "checkpoints"
        self.halt_after_steps = halt_after_steps
        self.state = TrainState()
        self.diverged: str | None = None  # the reason, once a NaN/inf loss was seen on a rank
        self.halted = False
        self.test_metrics: dict = {}  # test_<metric> at the stage's end (no test split: {})
        # wall time since `ddpflow launch` started, phase by phase (summary.json "wall")
        self.clock = WallClock()
        self.clock.marks["rank_process"] = round(process_start() - self.clock.t0, 4)
        self.clock.mark("rank_imports")
        self.saver = Saver(self)
        self.best_due = False  # best.pt is written with the next save

    def say(self, msg: str) -> None:
        if self.d.is_master:
            tqdm.write(f"[{self.st.name}] {msg}", file=sys.stderr)

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        cfg, st = self.cfg, self.st
        if not (st.compile or cfg.tune.compile):  # tune.json may turn compile on
            lazydynamo.defer()  # seconds of start-up that only torch.compile needs
        self.d = d = distributed.setup(cfg.hardware, process_group=st.strategy == "ddp")
        self.clock.mark("process_group")
        distributed.seed_everything(cfg.seed, d.rank, cfg.deterministic)
        add_code_dirs(cfg)
        stopflag.install()  # (again: `ddpflow train` installs it before its imports)
        # batch size, precision and layout: the config's, or tune.json's for "auto"
        self.settings = stage_settings(cfg, st, d.device, self.say)
        self.batch_size, self.tuned = self.settings.batch_size, self.settings.tuned
        self.precision, self.compile = self.settings.precision, self.settings.compile
        self.channels_last = self.settings.channels_last
        self.meta = prepared.read_meta(cfg.data_dir) or prepared.load(cfg.data_dir)[0]
        self.data = open_pipeline(cfg, d, self.meta, self.batch_size, self.tuned,
                                  lambda c: input_channels(cfg.model.name, c),
                                  self.channels_last is True, trace=trace_file(d.rank),
                                  recipe=Recipe(st.random_erasing, st.mixup_alpha,
                                                st.cutmix_alpha))
        self.say(f"loader: {self.data.kind} ({self.data.reason})")
        self.clock.mark("data")
        self.accum = st.grad_accum_steps
        self.steps_per_epoch = len(self.data.train) // self.accum  # a partial group is dropped
        if self.steps_per_epoch == 0:
            raise UserError(f"stages.{cfg.stage_index(st.name)}.batch_size {self.batch_size} x "
                            f"{d.world} ranks x {self.accum} accumulation exceeds the "
                            f"{self.data.train_samples} training samples; lower the batch size")
        self.total_steps = st.max_steps or st.epochs * self.steps_per_epoch
        if st.progressive_resize:  # training size per epoch; validation keeps its size
            self.data.train.size_at = progressive_sizes(
                st.progressive_resize, -(-self.total_steps // self.steps_per_epoch))
        self.global_batch = self.batch_size * d.world * self.accum
        self.val_batch = VAL_BATCH_FACTOR * self.batch_size  # per rank; halved on a GPU OOM
        self.build_model()
        self.build_optimizer()
        self.clock.mark("model")
        self.resume()
        self.clock.mark("resume")

    def build_model(self) -> None:
        cfg, st, d = self.cfg, self.st, self.d
        in_ch = self.data.in_channels and input_channels(cfg.model.name, self.data.in_channels)
        model = build_model(cfg.model, self.data.num_classes, in_ch)
        self.task = build_task(cfg, st, self.data.num_classes)
        self.monitor, self.mode = monitor(cfg, self.task)
        self.init_src = init_source(cfg, st.name)
        self.init_report = start_weights(cfg, st, model, self.init_src, self.say)
        model.to(d.device)
        # channels_last true/false, or auto (layout.py); the inputs follow the model
        self.channels_last, self.layout_reason = layout.for_trainer(self, model, in_ch)
        if self.channels_last:
            model.to(memory_format=torch.channels_last)
        # DDP across ranks (DataParallel for strategy dp, a baseline only)
        self.model = model = distributed.wrap(model, d, st.strategy, cfg.model.sync_bn,
                                              cfg.deterministic)
        self.train_model = torch.compile(model) if self.compile else model
        self.ema = open_ema(st, unwrap(model))  # None unless stages[].ema.decay is set

    def build_optimizer(self) -> None:
        st, d = self.st, self.d
        self.lr = st.lr * lr_factor(st.lr_scaling, self.global_batch, st.lr_reference_batch)
        self.opt = build_optimizer(self.model, st, self.lr, d.device)  # fused where possible
        warmup = round(st.warmup_epochs * self.steps_per_epoch)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, schedule(st.schedule, warmup, self.total_steps))
        self.scaler, self.autocast = mixed_precision(self.precision, d.device)

    def resume(self) -> None:
        """Continue from the newest valid checkpoint of these very inputs (its record)."""
        cfg, d = self.cfg, self.d
        self.record = make_record(cfg, self.st.name, self.meta["fingerprint"],
                                  checkpoint.sha256_of(self.init_src) if self.init_src else None)
        self.resume_key = config_hash(self.record)
        found = restore(self) if cfg.checkpoint.resume == "auto" else None
        if found:
            path, saved = found
            self.state = TrainState.from_checkpoint(saved)
            self.say(f"resumed from {path.name}: step {self.state.step}, "
                     f"epoch {self.state.epoch}")
        distributed.gather_objects(d, None)  # barrier: every rank has read its checkpoint
        if d.is_master:
            (self.out / "failed.json").unlink(missing_ok=True)
            checkpoint.remove_partial(self.ckpt_dir)  # temp files of a killed write
            if not found:
                checkpoint.set_aside(self.ckpt_dir)  # never mix with a stale run's checkpoints
        self.trackers = (open_trackers(self.cfg, self.st.name, self.state.step,
                                       self.resume_key) if d.is_master else None)
        self.log = (MetricsLog(self.out / "metrics.jsonl", keep_until_step=self.state.step,
                               tracker=self.trackers) if d.is_master else None)

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        self.setup()
        s, d = self.state, self.d
        self.say(f"{self.cfg.model.name} ({param_count(self.model) / 1e6:.2f} M params) on "
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
            due = bool(every) and s.epoch % every == 0
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
        # summed on the device in float64 (no sync per step); restored exactly on resume
        self.loss_sum = torch.tensor(s.loss_sum, dtype=torch.float64, device=d.device)
        self.step_dev = torch.tensor(s.step + 1, device=d.device)  # the step being computed
        self.first_bad = torch.tensor(-1, device=d.device)  # first step with a NaN/inf loss
        self.skipped = torch.tensor(s.skipped_steps, device=d.device)  # fp16 skipped steps
        self.in_epoch = s.step_in_epoch // self.accum
        self.first_interval = True
        self.flops_per_micro = None  # FLOPs of one micro-batch, forward + backward, once
        self.peak = peak_flops(d.device, self.precision)  # per GPU, or None (CPU, unknown)
        # the GPUs this process drives: its own, or DataParallel's (MFU counts them all)
        self.devices = ([torch.device("cuda", i) for i in self.model.device_ids]
                        if replicas(self.model) > 1 else [d.device])
        self.gpu = GpuSampler(self.devices) if d.is_master else None
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
                stop_now = self.poll_stop()
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
            last = micro == self.accum - 1 or not hasattr(model, "no_sync")
            counting = self.flops_per_micro is None
            n_replicas = replicas(model) if counting else 1
            if n_replicas > 1:  # DataParallel's threads: counted apart
                self.flops_per_micro = replica_flops(unwrap(model), batch, self.batch_size,
                                                     n_replicas, self.micro_step)
            counter = FlopCount() if self.flops_per_micro is None else nullcontext()
            # the counted micro-batch runs on the uncompiled model: Dynamo does not compile a
            # frame while a dispatch mode (the FLOP counter) is active
            net = model if counting else self.train_model
            with counter, nullcontext() if last else model.no_sync():
                loss = self.micro_step(net, batch, check=counting)
            if self.flops_per_micro is None:
                self.flops_per_micro = counter.total
            self.loss_sum += loss.detach()
            # remember the first step whose loss is not finite (device ops, no sync)
            self.first_bad = torch.where((self.first_bad < 0) & ~torch.isfinite(loss.detach()),
                                         self.step_dev, self.first_bad)
        if self.st.grad_clip:
            self.scaler.unscale_(self.opt)
            nn.utils.clip_grad_norm_(model.parameters(), self.st.grad_clip)
        scale_before = self.scaler._scale.clone() if self.scaler.is_enabled() else None
        self.scaler.step(self.opt)  # skips the step when fp16 gradients overflowed
        self.scaler.update()
        if scale_before is not None:  # a skipped step lowered the scale: count it
            self.skipped += (self.scaler._scale < scale_before).squeeze()
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        s.step += 1
        if self.ema:
            self.ema.update(unwrap(model), s.step)
        s.loss_count += 1
        self.step_dev += 1
        self.in_epoch += 1
        self.interval[2] += 1
        self.bar.update(1)
        if "first_step" not in self.clock.marks:
            self.clock.mark("first_step")  # host side: the step's kernels may still be queued

    def micro_step(self, net: nn.Module, batch, check: bool = False) -> torch.Tensor:
        """Forward, loss and backward of one micro-batch; the loss (scaled for accumulation)."""
        with self.autocast:
            loss = self.task.loss(forward(net, batch[0]), batch)
            if check:
                check_loss(loss, self.cfg.task.name)
            loss = loss / self.accum
        self.scaler.scale(loss).backward()
        return loss

    def log_interval(self) -> bool:
        """Sync point: the interval's loss to the host and one collective of per-rank
        timings, first bad step and stop flag. Returns whether a rank asked to stop."""
        s, d = self.state, self.d
        # sync point first: .item() waits for the interval's queued kernels, and only then is
        # the clock read (read before, samples/s and MFU would count unfinished work)
        loss_value = float(self.loss_sum.item()) / s.loss_count
        first_bad = float(self.first_bad.item())
        now = time.perf_counter()
        t0, wait, n = self.interval
        dt = now - t0
        per_rank = distributed.all_gather_floats(
            d, [dt / n, wait / dt, first_bad, 1.0 if stopflag.received() else 0.0])
        bad_steps = [int(r[2]) for r in per_rank if r[2] >= 0]
        if bad_steps:  # every rank sees it and stops; the last checkpoint stays
            self.diverged = self.divergence(bad_steps, loss_value)
            self.halted = True
            return False
        if d.is_master:
            self.log.write(interval_record(self, per_rank, dt, wait, n, loss_value, now))
            self.bar.set_postfix(loss=f"{loss_value:.3f}", refresh=False)
        self.loss_sum.zero_()
        s.loss_count = 0
        self.first_interval = False
        self.interval = [time.perf_counter(), 0.0, 0]
        self.stop_poll.seen(s.step, max(r[0] for r in per_rank))
        return any(r[3] > 0 for r in per_rank)

    def poll_stop(self) -> bool:
        """Every ~stop_check_s seconds between log lines, a small collective (a sync
        point): has any rank been asked to stop?"""
        if not self.stop_poll.due(self.state.step):
            return False
        t0, _, n = self.interval
        per_rank = distributed.all_gather_floats(
            self.d, [(time.perf_counter() - t0) / max(n, 1),
                     1.0 if stopflag.received() else 0.0])
        self.stop_poll.seen(self.state.step, max(r[0] for r in per_rank))
        return any(r[1] > 0 for r in per_rank)

    def divergence(self, bad_steps: list[int], loss_value: float | str = "NaN/inf") -> str:
        return (f"loss became {loss_value} at step {min(bad_steps)} (epoch "
                f"{self.state.epoch}); lower stages.{self.cfg.stage_index(self.st.name)}.lr, "
                f"add grad_clip or use bf16/fp32")

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """The task's metrics over the validation split (validation.py); the monitored one
        decides best.pt."""
        d, s = self.d, self.state
        self.clock.lap("train", sync=d.device)  # sync point: queued steps count as training
        metrics = stage_metrics(self)  # at the largest batch that fits: sync points
        self.update_best(metrics)
        earlystop.check(self, metrics)  # the same decision on every rank: no collective
        if d.is_master:
            self.log.write({"kind": "val", "step": s.step, "epoch": s.epoch, **metrics,
                            "time_s": s.elapsed_s + time.perf_counter() - self.t_start})
            shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
            self.say(f"epoch {s.epoch}: {shown}")
        self.clock.lap("validation")

    def update_best(self, metrics: dict) -> None:
        s = self.state
        if improves(metrics, self.monitor, self.mode, s.best.get("value"), self.cfg.task.name):
            s.best = {"monitor": self.monitor, "mode": self.mode,
                      "value": metrics[self.monitor], "step": s.step, "epoch": s.epoch,
                      "metrics": metrics}
            self.best_due = True  # written with the save that follows this validation
        self.last_metrics = metrics

    # ------------------------------------------------------------------ checkpoint, finish
    def checkpoint(self, ckpt: bool = True) -> bool:
        """Save, unless some rank's loss went bad since the last save (then False): a
        checkpoint (ckpt) and best.pt when validation improved it (saver.py)."""
        s, d = self.state, self.d
        self.clock.lap("train")
        # a collective (every rank's RNG state, first bad step): a sync point
        gathered = distributed.gather_objects(
            d, (distributed.rng_state(d.device), int(self.first_bad.item())))
        bad_steps = [g[1] for g in gathered if g[1] >= 0]
        if bad_steps:  # never save weights that a NaN/inf loss has already touched
            self.diverged = self.divergence(bad_steps)
            return False
        if d.is_master:  # the host copy blocks; the files are written in the background
            self.saver.save(gathered, ckpt, dict(s.best) if self.best_due else None)
        self.best_due = False
        self.clock.lap("checkpoint")
        return True

    def finish(self) -> None:
        """failed.json, or final.pt and summary.json (only for a finished stage)."""
        # the test split, once, after the last validation and save: nothing selects on it
        if self.data.test and not (self.diverged or self.halted):
            self.test_metrics = test_metrics(self)  # all ranks: sync points
            self.say("test: " + ", ".join(f"{k} {v:.4f}" for k, v in self.test_metrics.items()))
        # every rank's weights, hashed and gathered (with its host): DDP must have kept
        # them identical, on one node or several
        pairs = distributed.gather_objects(self.d, (runtime.weights_sha256(
            unwrap(self.model)), socket.gethostname()))
        self.weight_hashes = [h for h, _ in pairs]
        self.rank_hosts = [host for _, host in pairs]
        if self.d.is_master:
            write_results(self)  # failed.json, or final.pt and summary.json; trackers closed


def train_stage(cfg: Config, stage_name: str, halt_after_steps: int | None = None) -> int:
    """Run (or resume) one stage. Returns 0 when it finished or stopped at a checkpoint."""
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    try:
        return Trainer(cfg, stage_name, halt_after_steps).run()
    except RuntimeError as e:
        mistake = nondeterministic(e, cfg.model.name)
        if mistake is None:
            raise
        raise mistake from None


main = train_stage  # what each torchrun rank runs (cli.py)
