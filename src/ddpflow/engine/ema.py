"""An exponential moving average of a stage's weights (`stages[].ema: {decay, every_steps}`).

torch's own `AveragedModel` with its EMA average keeps the copy (parameters and buffers, so
BatchNorm statistics are averaged too) and is updated after every `every_steps` optimizer
steps on each rank; the ranks' weights are identical (DDP), so are their averages, with no
communication. With EMA on, validation scores both and the EMA weights are the ones the
stage hands on: `val_<metric>` and best.pt/final.pt's "model" are the EMA's (their
"weights" key says "ema"), `val_raw_<metric>` and "model_raw" the trained weights'. The
checkpoint holds both, so a resume continues the average exactly.
"""

from __future__ import annotations

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


class Ema:
    def __init__(self, model: torch.nn.Module, decay: float, every_steps: int):
        self.avg = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay),
                                 use_buffers=True)
        self.every = every_steps

    def update(self, model: torch.nn.Module, step: int) -> None:
        if step % self.every == 0:
            self.avg.update_parameters(model)

    @property
    def module(self) -> torch.nn.Module:
        return self.avg.module

    def weights(self) -> dict:
        """The averaged weights as the model's own state dict (what best/final.pt hold)."""
        return self.avg.module.state_dict()

    def updates(self) -> int:
        return int(self.avg.n_averaged.item())

    def load(self, weights: dict, updates: int) -> None:
        self.avg.module.load_state_dict(weights)
        self.avg.n_averaged.fill_(updates)


def open_ema(st, model: torch.nn.Module) -> Ema | None:
    """The stage's EMA of `model` (the plain module), or None when stages[].ema is off."""
    if st.ema.get("decay") is None:
        return None
    return Ema(model, st.ema["decay"], st.ema.get("every_steps", 1))
