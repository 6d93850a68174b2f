"""The seam contract: what ddpflow expects of a model builder, a dataset factory's items and
a task, checked by one checker for the built-ins and the user's callables alike.

- the model (`check_model`, run by `models.build_model` when given a `Probe`): one forward
  of a batch of 2 probe images (CPU, eval mode, no grad; shapes only on the meta device)
  gives a finite tensor of logits [batch, width], width = the class count for
  classification, 1 for regression on prepared labels;
- a dataset item (`check_item`, `check_items` probing the first, a middle and the last
  item): an (input, target) pair of tensors, arrays or numbers (or tuples / dicts of them),
  all finite and of one shape across items; a 3-D input is an image, C x H x W, uint8 or
  float in [0, 1] (any float as it is read, but not 0..255 whole numbers); a target of the
  built-in classification task an integer class index in [0, classes);
- the task (`check_task`, and `check_loss` / `check_metrics` on the first batch): the loss
  a finite scalar tensor that depends on the outputs, the metrics a dict of
  name -> (sum, count) with some count > 0.

Each refusal is one UserError naming the callable, what it returned and what was expected.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from ddpflow.core.errors import UserError, short

CHANNELS = (1, 3, 4)  # image channel counts: grey, RGB, RGBA (HWC detection)


class Probe(NamedTuple):
    """What a built model is checked against: the images it is probed with, the built-in
    task its outputs feed (None: a user task, which takes any outputs) and the outputs per
    sample that task needs (None: unknown)."""

    hw: tuple[int, int] | None  # the images' height and width (None: the input is no image)
    task: str | None
    width: int | None


BUILTIN_TASKS = ("classification", "regression")


def probe(cfg, meta: dict) -> Probe:
    """The probe for a config and its prepared data's meta.json."""
    python = meta.get("kind") == "python"  # a user dataset read as it is: its items' shape
    if python:
        shape = meta.get("input_shape")
        hw = tuple(shape[1:]) if shape and len(shape) == 3 else None
    else:
        hw = (cfg.data.image_size, cfg.data.image_size)
    task = cfg.task.name if cfg.task.name in BUILTIN_TASKS else None
    width = meta.get("num_classes") if task == "classification" else \
        1 if task == "regression" and not python else None  # prepared labels: one value
    return Probe(hw, task, width)


def describe(x: Any) -> str:
    """What a value is, for a message: type, shape and dtype."""
    if isinstance(x, (torch.Tensor, np.ndarray)):
        dtype = str(x.dtype).replace("torch.", "")
        return f"a {type(x).__name__} of shape {tuple(x.shape)} ({dtype})"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)}: ({', '.join(map(describe, x[:3]))}" + (
            ", ...)" if len(x) > 3 else ")")
    if isinstance(x, dict):
        return f"a dict with keys {', '.join(map(_key, list(x)[:5]))}"
    return f"{type(x).__name__} {short(x, 40)}"


def _key(k) -> str:
    """A dict key as a message shows it: as it is, or repr() where it holds a line break or
    another unprintable character (a message is one line)."""
    text = str(k)
    return text if text.isprintable() else repr(text)


def _nonfinite(x) -> bool:
    if isinstance(x, torch.Tensor):
        return (x.is_floating_point() or x.is_complex()) and not x.is_meta and \
            not bool(torch.isfinite(x).all())
    if isinstance(x, np.ndarray):
        return x.dtype.kind in "fc" and not bool(np.isfinite(x).all())
    return isinstance(x, numbers.Number) and not isinstance(x, numbers.Integral) and \
        not bool(np.isfinite(x))


# ------------------------------------------------------------------ model
def check_outputs(out, name: str, task: str | None = "classification",
                  width: int | None = None, batch: int = 2, finite: bool = True) -> None:
    """A model's outputs for `batch` samples, for the built-in task: a (finite) tensor
    [batch, width] (classification), batch x width values (regression); for a user task
    (None) any outputs, finite."""
    if task is None:
        if finite and any(_nonfinite(v) for v in _leaves(out)):
            raise UserError(f"{name} returned NaN/inf outputs for a probe batch of finite "
                            f"images, before training: NaN/inf in its starting weights or "
                            f"forward(); check its initialisation")
        return
    expected = f"a tensor of {'logits' if task == 'classification' else 'outputs'} " \
               f"[batch, {width or 'outputs'}]"
    if isinstance(out, (tuple, list, dict)):
        raise UserError(f"{name} returned {describe(out)} from forward(), not a tensor; the "
                        f"{task} task expects {expected}: return only that (e.g. out[0] or "
                        f"out['logits'])")
    if not isinstance(out, torch.Tensor):
        raise UserError(f"{name} returned {describe(out)} from forward(); the {task} task "
                        f"expects {expected}")
    if task == "regression":
        if out.shape[:1] != (batch,) or (width and out.numel() != batch * width):
            raise UserError(f"{name} returned {describe(out)} for a batch of {batch}; the "
                            f"regression task expects {expected}: one output per target "
                            f"value")
    elif out.ndim != 2 or out.shape[0] != batch:
        raise UserError(f"{name} returned {describe(out)} for a batch of {batch}; expected "
                        f"{expected} (flatten or pool the rest)")
    elif width and out.shape[1] != width:
        raise UserError(f"{name} returned {describe(out)} for a batch of {batch}; expected "
                        f"[{batch}, {width}]: one output per class of the data ({width}); "
                        f"build the head with num_classes")
    check_outputs(out, name, None, finite=finite)


def check_model(model: nn.Module, num_classes: int | None, in_channels: int,
                image_size, name: str, task: str | None = "classification",
                width: int | None = -1) -> None:
    """One forward of a probe batch of 2 images (in_channels x image_size, int or (h, w))
    through a freshly built model, in eval mode without gradients; its outputs checked by
    `check_outputs` for the task (width: num_classes unless given; None: unknown)."""
    h, w = (image_size, image_size) if isinstance(image_size, int) else image_size
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    if device.type == "meta":
        x = torch.zeros(2, in_channels, h, w, device=device)
    else:  # its own generator: the probe leaves the seeded random stream untouched
        x = torch.rand(2, in_channels, h, w, generator=torch.Generator().manual_seed(0))
        x = x.to(device)
    was_training = model.training
    try:
        with torch.no_grad():
            out = model.eval()(x)
    except Exception as e:  # noqa: BLE001 - the model's forward raised
        from ddpflow.seams.userimport import cause

        if device.type == "meta" and (isinstance(e, (NotImplementedError, TypeError))
                                      or "meta" in str(e)):
            return  # an op without a meta kernel, or one that needs values: no shape probe

        raise UserError(f"{name}: forward() of a probe batch of shape {tuple(x.shape)} "
                        f"failed ({cause(e)}); the data gives {in_channels} x {h} x {w} "
                        f"images (data.image_size)") from None
    finally:
        model.train(was_training)
    check_outputs(out, name, task, num_classes if width == -1 else width)


# ------------------------------------------------------------------ dataset items
def _image_problem(x, in_channels: int | None, materialize: bool) -> str | None:
    """What is wrong with a 3-D input as a C x H x W image, or None."""
    shape = tuple(x.shape)
    hwc = (shape[-1] == in_channels != shape[0]) if in_channels else \
        (shape[-1] in CHANNELS and shape[0] not in CHANNELS)
    if hwc:
        return ("H x W x C (channels last); expected C x H x W: x.permute(2, 0, 1) "
                "(ToTensor does this for images)")
    if in_channels and shape[0] != in_channels:
        return f"{shape[0]} channels; expected {in_channels}"
    t = torch.as_tensor(x)
    if t.dtype == torch.uint8 or not t.is_floating_point():
        return None if t.dtype == torch.uint8 or not materialize else \
            f"dtype {t.dtype}; expected uint8 or float in [0, 1]"
    t = t.float()
    lo, hi = float(t.min()), float(t.max())
    if materialize and (lo < 0 or hi > 1):
        return (f"values in [{lo:g}, {hi:g}]; expected float in [0, 1] or uint8 (divide "
                f"0..255 values by 255)")
    if lo >= 0 and hi > 1 and hi <= 255 and bool((t == t.round()).all()):
        return (f"whole-number float values in [{lo:g}, {hi:g}]: 0..255 pixels; expected "
                f"float in [0, 1] (divide by 255) or uint8")
    return None


def label_problem(y, num_classes: int | None) -> str | None:
    """What is wrong with a target as a class index, or None."""
    if isinstance(y, (torch.Tensor, np.ndarray)):
        if y.ndim != 0 and not (y.ndim == 1 and y.shape[0] == 1):
            return f"a label of shape {tuple(y.shape)}; expected one integer class index"
        integer = (not y.dtype.is_floating_point and not y.dtype.is_complex
                   and y.dtype != torch.bool) if isinstance(y, torch.Tensor) \
            else y.dtype.kind in "iu"
        if not integer:
            return (f"a {str(y.dtype).replace('torch.', '')} label; expected an integer "
                    f"class index (int(label), or torch.long)")
        y = int(y.reshape(-1)[0])
    elif isinstance(y, bool) or not isinstance(y, numbers.Integral):
        return (f"a {type(y).__name__} label {short(y, 30)}; expected an integer class "
                f"index")
    if y < 0 or (num_classes and y >= num_classes):
        span = f"[0, {num_classes})" if num_classes else "0 or more"
        return f"label {int(y)}, out of range; expected a class index in {span}"
    return None


def _leaves(x: Any):
    if isinstance(x, dict):
        for v in x.values():
            yield from _leaves(v)
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from _leaves(v)
    else:
        yield x


def check_item(item, index: int, factory_name: str, split: str, in_channels: int | None,
               num_classes: int | None, *, classify: bool = True,
               materialize: bool = False) -> None:
    """One dataset item against the contract (module docstring). classify: the target is
    a class index (the built-in classification task, or data.materialize)."""
    where = f"{factory_name}: item {index} of the '{split}' dataset"
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise UserError(f"{where} is {describe(item)}; expected an (input, target) pair")
    x, y = item
    bad = next((type(v) for v in _leaves(item) if not isinstance(  # a type: None is one too
        v, (torch.Tensor, np.ndarray, numbers.Number))), None)
    if any(isinstance(v, (tuple, list, dict)) and not v for v in item):
        raise UserError(f"{where} is {describe(item)}: an empty input or target")
    if bad is not None:
        hint = " (add a transform that makes a tensor, e.g. ToTensor)" \
            if "Image" in bad.__name__ else ""
        raise UserError(f"{where} holds {bad.__name__}{hint}, not tensors; expected "
                        f"tensors, arrays or numbers")
    if any(_nonfinite(v) for v in _leaves(item)):
        part = "input" if any(_nonfinite(v) for v in _leaves(x)) else "target"
        raise UserError(f"{where} has NaN/inf in its {part}; expected finite values")
    image = isinstance(x, (torch.Tensor, np.ndarray)) and x.ndim == 3
    if materialize and not image:
        raise UserError(f"{where}: its input is {describe(x)}; data.materialize needs C x H x "
                        f"W images")
    problem = _image_problem(x, in_channels, materialize) if image else None
    if problem:
        raise UserError(f"{where}: its image is {describe(x)}: {problem}")
    problem = label_problem(y, num_classes) if classify or materialize else None
    if problem:
        raise UserError(f"{where}: its target is {problem}")


def shapes(x: Any):
    """The nested shapes of an item: what must agree across items to make a batch."""
    if isinstance(x, dict):
        return {k: shapes(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return tuple(shapes(v) for v in x)
    return tuple(x.shape) if isinstance(x, (torch.Tensor, np.ndarray)) else ()


def read_item(ds, index: int, factory_name: str, split: str):
    try:
        return ds[index]
    except Exception as e:  # noqa: BLE001 - the user's __getitem__ raised
        from ddpflow.seams.userimport import cause

        lies = f" (len() says {len(ds)})" if isinstance(e, (IndexError, KeyError)) else ""
        raise UserError(f"{factory_name}: reading item {index} of the '{split}' dataset "
                        f"failed{lies} ({cause(e)})") from None


def check_items(ds, factory_name: str, split: str, in_channels: int | None,
                num_classes: int | None, **kw):
    """The first, a middle and the last item checked (check_item) and of one shape.
    Returns the first."""
    n = len(ds)
    first = None
    for i in sorted({0, n // 2, n - 1}):
        item = read_item(ds, i, factory_name, split)
        check_item(item, i, factory_name, split, in_channels, num_classes, **kw)
        if first is None:
            first = item
        elif shapes(item) != shapes(first):
            raise UserError(f"{factory_name}: item {i} of the '{split}' dataset has shapes "
                            f"{shapes(item)}, item 0 has {shapes(first)}; expected items of "
                            f"one shape (images must be one size: resize or crop them)")
    return first


# ------------------------------------------------------------------ task
def check_loss(loss, name: str, grad: bool = True) -> None:
    """A loss: a scalar tensor that depends on the model's outputs (grad: when they have a
    gradient)."""
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        what = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
                else describe(loss))
        raise UserError(f"{name}: loss(outputs, batch) returned {what}, not a scalar tensor; "
                        f"reduce it (e.g. .mean())")
    if grad and not loss.requires_grad:
        raise UserError(f"{name}: loss(outputs, batch) does not depend on the model's "
                        f"outputs (no gradient); compute it from `outputs`")


def metric_pairs(values, name: str) -> dict:
    """metrics(...)'s result: {name: (sum, count)} with names fit for val_<name> (no sync:
    run on every validation batch)."""
    if not isinstance(values, dict):
        raise UserError(f"{name}: metrics(outputs, batch) returned {describe(values)}, not a "
                        f"dict of name -> (sum, count)")
    for key, pair in values.items():
        if not (isinstance(key, str) and key.isidentifier() and isinstance(pair, (tuple, list))
                and len(pair) == 2):
            raise UserError(f"{name}: metrics(outputs, batch) item {short(key)} must be a "
                            f"name -> (sum, count) pair; it is {describe(pair)}")
    return values


def check_metrics(values, name: str) -> dict:
    """metric_pairs, and some count > 0 (a sync: the first batch only)."""
    metric_pairs(values, name)
    counts = [float(torch.as_tensor(c, dtype=torch.float64).sum()) for _, c in values.values()]
    if counts and not any(c > 0 for c in counts):
        raise UserError(f"{name}: metrics(outputs, batch) returned a count of 0 for every "
                        f"metric ({', '.join(values)}); expected (sum, count) pairs with "
                        f"count > 0 (e.g. the number of samples in the batch)")
    return values


def _fits(builtin: str | None, outputs, y, model: str) -> None:
    """The built-in tasks' rules for outputs and targets, before their loss runs: an
    IndexError or a device-side assert later otherwise."""
    if builtin not in ("classification", "regression") or not isinstance(y, torch.Tensor):
        return
    if builtin == "regression":
        if isinstance(outputs, torch.Tensor) and outputs.numel() != y.numel():
            raise UserError(f"{model} returned {describe(outputs)} for targets of shape "
                            f"{tuple(y.shape)}; the regression task expects one output per "
                            f"target value")
        return
    check_outputs(outputs, model, "classification", batch=len(y), finite=False)
    width = outputs.shape[1]
    if y.is_floating_point():  # soft targets (mixup, cutmix): a distribution per sample
        if tuple(y.shape) != tuple(outputs.shape):
            raise UserError(f"{model}: the batch's targets are {describe(y)}; the "
                            f"classification task expects integer class indices [{len(y)}] (or "
                            f"soft targets [{len(y)}, {width}]) for its {width} outputs")
        return
    if y.ndim != 1:
        raise UserError(f"{model}: the batch's targets are {describe(y)}; the classification "
                        f"task expects one integer class index per sample")
    lo, hi = int(y.min()), int(y.max())
    if lo < 0 or hi >= width:
        raise UserError(f"{model}: the batch's targets hold class {lo if lo < 0 else hi}, but "
                        f"it returned {describe(outputs)}: {width} outputs per sample; expected "
                        f"class indices in [0, {width}) (set the model's num_classes to the "
                        f"data's class count)")


def _non_finite_cause(outputs, batch, model: str) -> str:
    if any(_nonfinite(v) for v in _leaves(batch[0])):
        return "the batch's inputs hold NaN/inf (the data)"
    if isinstance(outputs, torch.Tensor) and _nonfinite(outputs.detach()):
        return (f"{model} returned NaN/inf for finite inputs (its starting weights or "
                f"forward())")
    return "the outputs and inputs are finite: the loss itself"


def check_task(task, outputs, batch, name: str, builtin: str | None = None,
               model: str = "the model", metrics: bool = True):
    """The task on one batch (the first this process scores): the built-in tasks' rules
    for outputs and targets, a finite scalar loss (with a gradient where the outputs have
    one), and (metrics: a validation batch, never mixed up) metrics of name -> (sum,
    count) with a count > 0. Returns the loss."""
    _fits(builtin, outputs, batch[1], model)
    loss = task.loss(outputs, batch)
    grad = isinstance(outputs, torch.Tensor) and outputs.requires_grad
    check_loss(loss, name, grad=grad)
    if _nonfinite(loss.detach()):
        raise UserError(f"{name}: loss(outputs, batch) is {float(loss.detach())} on the first "
                        f"batch of this run, before any update (so not the learning rate): "
                        f"{_non_finite_cause(outputs, batch, model)}")
    if not metrics:
        return loss
    with torch.no_grad():
        detached = outputs.detach() if isinstance(outputs, torch.Tensor) else outputs
        check_metrics(task.metrics(detached, batch), name)
    return loss
