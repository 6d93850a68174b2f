"""The task seam: how a batch's model outputs are scored.

A task is any object with two methods (the built-ins below are written the same way):

    loss(outputs, batch) -> scalar tensor            # what backward() is called on
    metrics(outputs, batch) -> {name: (sum, count)}  # summed over the validation split

`batch` is the `(inputs, targets)` pair the data gives. Metric sums and counts are summed
on the device, all-reduced across ranks once per validation (one sync point) and
reported as `val_<name>` = sum / count. A sum and count may be 1-D tensors of one length
(a value per class, say): `val_<name>` is then a list (None where the count is 0). A
metric named `loss` replaces the default validation loss (the training loss times the
batch size). Optional attributes: `monitor` (the `val_<name>` that chooses best.pt by
default), `maximize` (names where higher is better; the others are minimised) and
`summarize(metrics) -> {name: value}` (figures made from the reduced ones: the
classification task's balanced accuracy from its per-class recall).

`task.name: package.module:callable` builds a user task from `task.kwargs` (plus
`label_smoothing` and `num_classes` where the callable takes them).

Built-in and user tasks alike come wrapped in `FirstBatchChecked`: the first batch a
process scores goes through the seam contract (contract.check_task).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ddpflow.core.errors import UserError, short
from ddpflow.seams import contract
from ddpflow.seams.userimport import call, is_import_path, load_callable


class Classification:
    """Cross-entropy with label smoothing; top-1 and top-5 accuracy, the recall of each
    class and their mean, the balanced accuracy (what imbalanced data needs shown)."""

    monitor = "val_acc"
    maximize = frozenset({"acc", "top5", "balanced_acc"})

    def __init__(self, label_smoothing: float = 0.0):
        self.label_smoothing = label_smoothing

    def loss(self, outputs, batch):
        return F.cross_entropy(outputs, batch[1], label_smoothing=self.label_smoothing)

    def metrics(self, outputs, batch):
        logits, y = outputs.float(), batch[1]
        n = torch.full((), float(len(y)), device=y.device)  # a fill there, not a copy
        k = min(5, logits.shape[1])
        top = logits.topk(k, dim=1).indices
        classes = logits.shape[1]
        hit = top[:, 0] == y
        return {"loss": (F.cross_entropy(logits, y, reduction="sum"), n),  # no smoothing
                "acc": (hit.sum(), n),
                "top5": ((top == y[:, None]).any(1).sum(), n),
                # per class: right answers over its samples (a vector: one entry a class)
                "recall": (torch.bincount(y[hit], minlength=classes),
                           torch.bincount(y, minlength=classes))}

    @staticmethod
    def summarize(metrics: dict) -> dict:
        """The balanced accuracy: the mean recall over the classes the split holds."""
        known = [r for r in metrics.get("recall") or () if r is not None]
        return {"balanced_acc": sum(known) / len(known)} if known else {}


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
        n = torch.full((), float(err.numel()), device=err.device)
        return {"mse": (err.square().sum(), n), "mae": (err.abs().sum(), n)}


BUILTIN = {"classification": Classification, "regression": Regression}


def build_task(cfg, st, num_classes: int | None):
    """The task named by task.name for stage st, its first batch checked."""
    model = getattr(getattr(cfg, "model", None), "name", None)
    return FirstBatchChecked(_build(cfg, st, num_classes), cfg.task.name,
                             f"model.name {model}" if model else "the model")


def _build(cfg, stage, num_classes: int | None):
    name = cfg.task.name
    if name == "classification":
        return Classification(stage.label_smoothing, **cfg.task.kwargs)
    if name in BUILTIN:
        return BUILTIN[name](**cfg.task.kwargs)
    if not is_import_path(name):
        raise UserError(f"task.name {short(name)} is not one of {', '.join(BUILTIN)} nor "
                        f"package.module:callable")
    task = call(load_callable(name, "task.name"), "task.name", kwargs=cfg.task.kwargs,
                optional={"label_smoothing": stage.label_smoothing, "num_classes": num_classes})
    for method in ("loss", "metrics"):
        if not callable(getattr(task, method, None)):
            raise UserError(f"task.name: {name} returned {type(task).__name__}, which has no "
                            f"{method}(outputs, batch) method")
    return task


class FirstBatchChecked:
    """The task as the engine calls it, through the seam contract on the first call of
    each method in this process (one sync each): loss() (a training step, or validation
    when it comes first) by contract.check_task (outputs against targets for the
    built-ins, a finite scalar loss), metrics() (validation batches only: training batches
    may hold mixup's soft targets) by contract.check_metrics (a count > 0)."""

    def __init__(self, task, name: str, model: str):
        self.task, self.name, self.model = task, name, model
        self.loss_checked = self.metrics_checked = False

    def __getattr__(self, attr):  # monitor, maximize and the user's own attributes
        if attr == "task":
            raise AttributeError(attr)
        return getattr(self.task, attr)

    def loss(self, outputs, batch):
        if self.loss_checked:
            return self.task.loss(outputs, batch)
        self.loss_checked = True
        return contract.check_task(self.task, outputs, batch, f"task.name {self.name}",
                                   self.name if self.name in BUILTIN else None, self.model,
                                   metrics=False)

    def metrics(self, outputs, batch):
        if self.metrics_checked:
            return self.task.metrics(outputs, batch)
        self.metrics_checked = True
        return contract.check_metrics(self.task.metrics(outputs, batch),
                                      f"task.name {self.name}")


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
    if not isinstance(value, (int, float)):
        raise UserError(f"task.monitor {name} is one value per class, and a stage is judged "
                        f"by one number; monitor val_balanced_acc (their mean) or val_acc")
    return best is None or (value > best if mode == "max" else value < best)


def check_loss(loss, task_name: str) -> None:
    """The first step's loss must be a scalar tensor (else backward() fails obscurely)."""
    contract.check_loss(loss, f"task.name {task_name}")


def metric_pairs(values, task_name: str) -> dict[str, tuple]:
    """metrics(...)'s result checked: {name: (sum, count)} with names fit for val_<name>."""
    return contract.metric_pairs(values, f"task.name {task_name}")
