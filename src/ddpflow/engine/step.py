"""The pieces of one optimizer step that do not depend on where the loop is: a micro-batch's
forward, loss and backward, the update (clip, scaled step, schedule), and the counters that
are summed on the device so that no step waits for the host (read at log intervals and
checkpoints: those are the sync points)."""

from __future__ import annotations

import re

import torch
from torch import nn

from ddpflow.core.errors import UserError
from ddpflow.engine.state import TrainState
from ddpflow.seams.models import forward
from ddpflow.seams.tasks import check_loss


class StepCounters:
    """Device-side sums of the log interval in progress; restored exactly on resume."""

    def __init__(self, state: TrainState, device):
        self.loss_sum = torch.tensor(state.loss_sum, dtype=torch.float64, device=device)
        self.step_dev = torch.tensor(state.step + 1, device=device)  # the step being computed
        self.first_bad = torch.tensor(-1, device=device)  # first step with a NaN/inf loss
        self.skipped = torch.tensor(state.skipped_steps, device=device)  # fp16 skipped steps
        self.bad_input = torch.tensor(-1, device=device)  # first step whose inputs had NaN/inf

    def add_loss(self, loss: torch.Tensor, inputs=None) -> None:
        """A micro-batch's loss into the sum; the first step whose loss is not finite, and
        the first whose float inputs are not (the data, not the learning rate), are
        remembered (device ops, no sync)."""
        loss = loss.detach()
        self.loss_sum += loss
        self.first_bad = torch.where((self.first_bad < 0) & ~torch.isfinite(loss),
                                     self.step_dev, self.first_bad)
        bad = nonfinite(inputs)
        if bad is not None:
            self.bad_input = torch.where((self.bad_input < 0) & bad, self.step_dev,
                                         self.bad_input)

    def bad_steps(self) -> tuple[int, int]:
        """(first step with a NaN/inf loss, first with NaN/inf inputs), -1 for none: a sync."""
        return int(self.first_bad.item()), int(self.bad_input.item())


def nonfinite(inputs) -> torch.Tensor | None:
    """A device bool: some float tensor in `inputs` (a tensor, or a dict/list/tuple of them)
    holds NaN/inf; None when there is no float tensor to look at."""
    if isinstance(inputs, dict):
        inputs = list(inputs.values())
    leaves = inputs if isinstance(inputs, (list, tuple)) else [inputs]
    flags = [~torch.isfinite(t.detach()).all() for t in leaves
             if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())]
    if not flags:
        return None
    return flags[0] if len(flags) == 1 else torch.stack(flags).any()


def divergence(cfg, stage: str, bad: list[tuple[int, int]], loss_value, epoch: int) -> str:
    """Why training stopped, from each bad rank's (first bad loss step, first bad input step):
    inputs with NaN/inf at or before the loss went bad name the data; else the loss itself
    diverged (the learning rate, precision)."""
    step = min(b[0] for b in bad)
    inputs = [b[1] for b in bad if 0 <= b[1] <= step]
    if inputs:
        d = cfg.data
        source = (f"data.factory {d.factory}" if d.source == "python" else
                  f"data.source {d.source}" + (f" at {d.path}" if d.path else ""))
        return (f"the inputs of step {min(inputs)} (epoch {epoch}) hold NaN/inf, so the loss "
                f"became {loss_value} at step {step}: the data ({source}) is broken, not the "
                f"learning rate; fix or drop those samples (or their transforms)")
    return (f"loss became {loss_value} at step {step} (epoch {epoch}); lower "
            f"stages.{cfg.stage_index(stage)}.lr, add grad_clip or use bf16/fp32")


def micro_step(net: nn.Module, batch, task, autocast, scaler, accum: int,
               check_as: str | None = None, clock=None) -> torch.Tensor:
    """Forward, loss and backward of one micro-batch; the loss (scaled for accumulation).
    check_as: the task's name, to check the loss once (tasks.check_loss); clock: times the
    forward and loss, this rank's own compute (stragglers.ComputeClock), or None."""
    if clock:
        clock.start()
    with autocast:
        outputs = forward(net, batch[0])
        try:
            loss = task.loss(outputs, batch)
        except IndexError as e:  # (a CPU kernel's check; on a GPU a device-side assert)
            raise out_of_bounds(e, outputs) or e from None
        if check_as:
            check_loss(loss, check_as)
        loss = loss / accum
    if clock:
        clock.stop()  # the backward all-reduces: it waits for the slowest rank
    scaler.scale(loss).backward()
    return loss


def out_of_bounds(err: IndexError, outputs) -> UserError | None:
    """cross_entropy's `Target 9 is out of bounds.` (a label beyond the model's outputs, in
    a dataset that declares no class count, so data/stream.py could not name its item) as
    one message; None for any other IndexError."""
    m = re.search(r"Target (-?\d+) is out of bounds", str(err))
    if not m:
        return None
    width = (f"{outputs.shape[1]} outputs" if isinstance(outputs, torch.Tensor)
             and outputs.ndim == 2 else "fewer outputs")
    return UserError(f"a training batch holds label {m.group(1)}, but the model returns "
                     f"{width} per sample (one per class); fix the label, or give the dataset "
                     f"num_classes (or classes) so that ddpflow names the item")


def update(model: nn.Module, opt, sched, scaler, grad_clip: float | None,
           counters: StepCounters) -> None:
    """The optimizer step after the last micro-batch: gradients clipped (unscaled first),
    the scaled step (skipped by the GradScaler when fp16 gradients overflowed, counted),
    gradients cleared, the schedule advanced."""
    if grad_clip:
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scale_before = scaler._scale.clone() if scaler.is_enabled() else None
    scaler.step(opt)
    scaler.update()
    if scale_before is not None:  # a skipped step lowered the scale: count it
        counters.skipped += (scaler._scale < scale_before).squeeze()
    opt.zero_grad(set_to_none=True)
    sched.step()
    counters.step_dev += 1
