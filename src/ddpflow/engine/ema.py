"""An exponential moving average of a stage's weights (`stages[].ema: {decay, every_steps}`).

The average is a copy of the model (parameters and buffers, so BatchNorm statistics are
averaged too), updated after every `every_steps` optimizer steps on each rank; the ranks'
weights are identical (DDP), so are their averages, with no communication. With EMA on,
validation scores both and the EMA weights are the ones the stage hands on: `val_<metric>`
and best.pt/final.pt's "model" are the EMA's (their "weights" key says "ema"),
`val_raw_<metric>` and "model_raw" the trained weights'. The checkpoint holds both ("ema"
and "ema_updates"), so a resume continues the average exactly.

The same arithmetic as torch's `AveragedModel` with `get_ema_multi_avg_fn` (the first update
copies, each later one is lerp(avg, model, 1 - decay)), without its per-update costs: the
count is a Python int (AveragedModel keeps a tensor, and on a GPU compares and copies it
between host and device at every update), every floating-point tensor moves in one fused
torch._foreach_lerp_, and integer buffers (BatchNorm's num_batches_tracked) are copied.
"""

from __future__ import annotations

import copy
import itertools

import torch


def _tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    return list(itertools.chain(model.parameters(), model.buffers()))


class Ema:
    def __init__(self, model: torch.nn.Module, decay: float, every_steps: int):
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA decay {decay} is outside [0, 1]")
        self.module = copy.deepcopy(model).requires_grad_(False)
        self.decay, self.every = decay, every_steps
        self.count = 0  # updates so far: a Python int, never a device tensor
        mine = _tensors(self.module)
        self._float = [i for i, t in enumerate(mine) if t.is_floating_point()]
        self._other = [i for i, t in enumerate(mine) if not t.is_floating_point()]
        self._avg_float = [mine[i] for i in self._float]
        self._avg_other = [mine[i] for i in self._other]

    def update(self, model: torch.nn.Module, step: int) -> None:
        if step % self.every == 0:
            self.update_now(model)

    @torch.no_grad()
    def update_now(self, model: torch.nn.Module) -> None:
        theirs = _tensors(model)
        if self.count == 0:  # the average starts as the weights themselves
            torch._foreach_copy_(self._avg_float, [theirs[i] for i in self._float])
        elif self._avg_float:
            torch._foreach_lerp_(self._avg_float, [theirs[i] for i in self._float],
                                 1.0 - self.decay)
        for avg, i in zip(self._avg_other, self._other):
            avg.copy_(theirs[i])
        self.count += 1

    def weights(self) -> dict:
        """The averaged weights as the model's own state dict (what best/final.pt hold)."""
        return self.module.state_dict()

    def updates(self) -> int:
        return self.count

    def load(self, weights: dict, updates: int) -> None:
        self.module.load_state_dict(weights)
        self.count = int(updates)


def open_ema(stage, model: torch.nn.Module) -> Ema | None:
    """The stage's EMA of `model` (the plain module), or None when stages[].ema is off."""
    if stage.ema.decay is None:
        return None
    return Ema(model, stage.ema.decay, stage.ema.every_steps)
