"""A user's own task: Huber loss, with MAE and the share of predictions within 0.25.

ddpflow calls loss() on every training batch and metrics() on every validation batch;
metrics are (sum, count) pairs, summed over ranks and reported as val_<name>.
"""

import torch
import torch.nn.functional as F


class Huber:
    monitor = "val_mae"  # what chooses best.pt unless task.monitor says otherwise
    maximize = frozenset({"within_025"})  # higher is better for these; lower for the rest

    def __init__(self, delta: float = 1.0):
        self.delta = delta

    def loss(self, outputs, batch):
        return F.huber_loss(outputs.float(), batch[1], delta=self.delta)

    def metrics(self, outputs, batch):
        err = (outputs.float() - batch[1]).abs()
        n = torch.tensor(float(err.numel()), device=err.device)
        return {"mae": (err.sum(), n), "within_025": ((err < 0.25).sum(), n)}
