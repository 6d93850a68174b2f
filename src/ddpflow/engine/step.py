"""The pieces of one optimizer step that do not depend on where the loop is: a micro-batch's
forward, loss and backward, the update (clip, scaled step, schedule), and the counters that
are summed on the device so that no step waits for the host (read at log intervals and
checkpoints: those are the sync points)."""

from __future__ import annotations

import torch
from torch import nn

from ddpflow.engine.state import TrainState
from ddpflow.seams.models import forward
from ddpflow.seams.tasks import check_loss


class StepCounters:
    """Device-side sums of the log interval in progress; restored exactly on resume."""

    def __init__(self, s: TrainState, device):
        self.loss_sum = torch.tensor(s.loss_sum, dtype=torch.float64, device=device)
        self.step_dev = torch.tensor(s.step + 1, device=device)  # the step being computed
        self.first_bad = torch.tensor(-1, device=device)  # first step with a NaN/inf loss
        self.skipped = torch.tensor(s.skipped_steps, device=device)  # fp16 skipped steps

    def add_loss(self, loss: torch.Tensor) -> None:
        """A micro-batch's loss into the sum; the first step whose loss is not finite is
        remembered (device ops, no sync)."""
        loss = loss.detach()
        self.loss_sum += loss
        self.first_bad = torch.where((self.first_bad < 0) & ~torch.isfinite(loss),
                                     self.step_dev, self.first_bad)


def micro_step(net: nn.Module, batch, task, autocast, scaler, accum: int,
               check_as: str | None = None) -> torch.Tensor:
    """Forward, loss and backward of one micro-batch; the loss (scaled for accumulation).
    check_as: the task's name, to check the loss once (tasks.check_loss)."""
    with autocast:
        loss = task.loss(forward(net, batch[0]), batch)
        if check_as:
            check_loss(loss, check_as)
        loss = loss / accum
    scaler.scale(loss).backward()
    return loss


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
