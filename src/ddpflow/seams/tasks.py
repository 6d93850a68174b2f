"""The task seam: how a batch's model outputs are scored.

A task is any object with two methods (the built-ins below are written the same way):

    loss(outputs, batch) -> scalar tensor            # what backward() is called on
    metrics(outputs, batch) -> {name: (sum, count)}  # summed over the validation split

`batch` is the `(inputs, targets)` pair the data gives. Metric sums and counts are summed
on the device, all-reduced across ranks once per validation (one sync point) and
reported as `val_<name>` = sum / count. A metric named `loss` replaces the default
validation loss (the training loss times the batch size). Optional attributes:
`monitor` (the `val_<name>` that chooses best.pt by default) and `maximize` (names
where higher is better; the others are minimised).

`task.name: package.module:callable` builds a user task from `task.kwargs` (plus
`label_smoothing` and `num_classes` where the callable takes them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ddpflow.core.errors import UserError, short
from ddpflow.seams.userimport import call, is_import_path, load_callable


class Classification:
    """Cross-entropy with label smoothing; top-1 and top-5 accuracy."""

    monitor = "val_acc"
    maximize = frozenset({"acc", "top5"})

    def __init__(self, label_smoothing: float = 0.0):
        self.label_smoothing = label_smoothing

    def loss(self, outputs, batch):
        return F.cross_entropy(outputs, batch[1], label_smoothing=self.label_smoothing)

    def metrics(self, outputs, batch):
        logits, y = outputs.float(), batch[1]
        n = torch.tensor(float(len(y)), device=y.device)
        k = min(5, logits.shape[1])
        top = logits.topk(k, dim=1).indices
        return {"loss": (F.cross_entropy(logits, y, reduction="sum"), n),  # no smoothing
                "acc": ((top[:, 0] == y).sum(), n),
                "top5": ((top == y[:, None]).any(1).sum(), n)}


class Regression:
    """Mean squared error; MSE and MAE per target element."""

    monitor = "val_loss"
    maximize = frozenset()

    def loss(self, outputs, batch):
        y = batch[1]
        return F.mse_loss(outputs.float().reshape(y.shape), y.float())

    def metrics(self, outputs, batch):
        y = batch[1].float()
        err = outputs.float().reshape(y.shape) - y
        n = torch.tensor(float(err.numel()), device=err.device)
        return {"mse": (err.square().sum(), n), "mae": (err.abs().sum(), n)}


BUILTIN = {"classification": Classification, "regression": Regression}


def build_task(cfg, st, num_classes: int | None):
    """The task named by task.name for stage st."""
    name = cfg.task.name
    if name == "classification":
        return Classification(st.label_smoothing, **cfg.task.kwargs)
    if name in BUILTIN:
        return BUILTIN[name](**cfg.task.kwargs)
    if not is_import_path(name):
        raise UserError(f"task.name {short(name)} is not one of {', '.join(BUILTIN)} nor "
                        f"package.module:callable")
    task = call(load_callable(name, "task.name"), "task.name", kwargs=cfg.task.kwargs,
                optional={"label_smoothing": st.label_smoothing, "num_classes": num_classes})
    for method in ("loss", "metrics"):
        if not callable(getattr(task, method, None)):
            raise UserError(f"task.name: {name} returned {type(task).__name__}, which has no "
                            f"{method}(outputs, batch) method")
    return task


def monitor(cfg, task) -> tuple[str, str]:
    """(val_<metric>, min|max): what chooses best.pt."""
    name = cfg.task.monitor or getattr(task, "monitor", None) or "val_loss"
    return name, metric_mode(name, task, cfg.task.mode)


def metric_mode(name: str, task, mode: str = "auto") -> str:
    """max for the metrics the task maximizes (accuracy...), else min (losses)."""
    if mode != "auto":
        return mode
    return "max" if name[len("val_"):] in getattr(task, "maximize", ()) else "min"


def improves(metrics: dict, name: str, mode: str, best, task_name: str) -> bool:
    """Whether metrics[name] beats the best so far (None: nothing yet) in this mode."""
    if name not in metrics:
        raise UserError(f"task.monitor {name} is not a validation metric of task {task_name}; "
                        f"it reports {', '.join(metrics)}")
    value = metrics[name]
    return best is None or (value > best if mode == "max" else value < best)


def check_loss(loss, task_name: str) -> None:
    """The first step's loss must be a scalar tensor (else backward() fails obscurely)."""
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        what = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
                else type(loss).__name__)
        raise UserError(f"task.name {task_name}: loss(outputs, batch) returned {what}, not a "
                        f"scalar tensor; reduce it (e.g. .mean())")
    if not loss.requires_grad:
        raise UserError(f"task.name {task_name}: loss(outputs, batch) does not depend on the "
                        f"model's outputs (no gradient); compute it from `outputs`")


def metric_pairs(values, task_name: str) -> dict[str, tuple]:
    """metrics(...)'s result checked: {name: (sum, count)} with names fit for val_<name>."""
    if not isinstance(values, dict):
        raise UserError(f"task.name {task_name}: metrics(outputs, batch) returned "
                        f"{type(values).__name__}, not a dict of name -> (sum, count)")
    for key, pair in values.items():
        if not (isinstance(key, str) and key.isidentifier() and isinstance(pair, (tuple, list))
                and len(pair) == 2):
            raise UserError(f"task.name {task_name}: metrics(outputs, batch) item {short(key)} "
                            f"must be a name -> (sum, count) pair")
    return values


class MetricSums:
    """A task's validation metrics: (sum, count) per name, added up on the device, summed
    across ranks once by `reduce`, reported as {"val_<name>": sum / count}."""

    def __init__(self, task, task_name: str, device):
        self.task, self.task_name, self.device = task, task_name, device
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, outputs, batch) -> None:
        values = dict(metric_pairs(self.task.metrics(outputs, batch), self.task_name))
        if "loss" not in values:  # the training loss, weighted by the batch size
            n = next(iter(values.values()))[1] if values else len(batch[1])
            values["loss"] = (self.task.loss(outputs, batch).float() * n, n)
        for name, (total, count) in values.items():
            pair = torch.stack([torch.as_tensor(total, device=self.device).double(),
                                torch.as_tensor(count, device=self.device).double()])
            self.sums[name] = self.sums[name] + pair if name in self.sums else pair

    def reduce(self, d) -> dict[str, float]:
        from ddpflow.engine import distributed

        # ranks agree on the names first: a rank without validation batches has none
        names = sorted(set().union(*distributed.gather_objects(d, sorted(self.sums))))
        zero = torch.zeros(2, dtype=torch.float64, device=self.device)
        totals = distributed.all_sum(d, torch.stack([self.sums.get(k, zero) for k in names]))
        return {f"val_{k}": (t / c if c else float("nan"))
                for k, (t, c) in zip(names, totals.tolist())}
