"""The seam contract at every batch of a user dataset (`data.source: python`), not only at
the probe (the first, a middle and the last item: contract.check_items).

A dataset whose item 200 has label 9 in a 4-class set, or whose item 7 is 3 x 17 x 16 among
3 x 16 x 16 images, passes the probe and then failed inside a rank with `Target 9 is out of
bounds` (CPU) or a device-side assert (GPU), or a collate `RuntimeError`. Here each batch, as
the DataLoader hands it over and before it goes to the device:
  - a batch the loader could not make (items of unequal shapes, an item that raised) is read
    again item by item, and the item that raises or whose shape is not the others' named by
    its dataset index (`loader_error`);
  - the targets of the built-in classification task are class indices within the dataset's
    class count (`check_labels`), the offending dataset index and label named.
Both look at host tensors only (the loader's output, not yet copied): no device sync, so a
step does not wait for the host. A rank that finds one reports it (error.json) and waits to
be stopped with its peers (OneRankError): the launcher stops every rank at once and prints
the message once; no peer crashes first on a closed connection.
"""

from __future__ import annotations

import re
from typing import Sequence

import torch

from ddpflow.core.errors import OneRankError, UserError

IN_WORKER = re.compile(r"Caught (\w+) in DataLoader worker process \d+")
WORKER_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def _items(indices: Sequence[int]) -> str:
    shown = ", ".join(str(i) for i in indices[:5])
    return shown + (f" ... ({len(indices)} items)" if len(indices) > 5 else "")


def _shown(shape) -> str:
    """An item's nested shapes as a message shows them: the input's alone when the item is
    an (input, target) pair whose target is a number."""
    if isinstance(shape, tuple) and len(shape) == 2 and shape[1] == ():
        shape = shape[0]
    return str(shape)


def _odd_item(ds, indices: Sequence[int], name: str, split: str):
    """The batch's items read again, one by one: (index, its shapes, the shapes of most of
    the others) of the first whose shapes differ, or None when they agree. A read that
    raises is one UserError naming that item (contract.read_item)."""
    from collections import Counter

    from ddpflow.seams.contract import read_item, shapes

    got = [(i, shapes(read_item(ds, i, name, split))) for i in indices]
    common = Counter(s for _, s in got).most_common(1)[0][0]
    return next(((i, s, common) for i, s in got if s != common), None)


def loader_error(err: Exception, ds, indices: Sequence[int], name: str, split: str
                 ) -> OneRankError | None:
    """What the DataLoader raised while making the batch of dataset items `indices` (of
    `ds`), as one OneRankError naming the item: the batch is read again item by item (which
    item raises, or which item's shape is not the others'). None for an error that is not
    the dataset's (a worker killed for memory or by a signal)."""
    text = str(err)
    if "DataLoader worker (pid" in text:
        return None
    try:
        odd = _odd_item(ds, list(indices), name, split)
    except UserError as e:  # the item that raises, named
        return OneRankError(str(e))
    if odd is not None:
        i, shape, common = odd
        return OneRankError(f"{name}: item {i} of the '{split}' dataset has shape "
                            f"{_shown(shape)}, the other items of its batch {_shown(common)}; "
                            f"items must be of one shape to make a batch (resize or crop "
                            f"them, e.g. in the dataset's transform)")
    worker = IN_WORKER.search(text)
    if worker:  # the exception in a worker (its collate): its last lines say what and where
        last = [ln for ln in text.splitlines() if ln.strip()][-1].strip()
        frames = WORKER_FRAME.findall(text)
        where = f" at {frames[-1][0].rsplit('/', 1)[-1]}:{frames[-1][1]}" if frames else ""
        why = (last if last.startswith(worker.group(1)) else f"{worker.group(1)}: {last}") \
            + where
    else:
        from ddpflow.seams.userimport import cause

        why = cause(err)
    return OneRankError(f"{name}: reading items {_items(list(indices))} of the '{split}' "
                        f"dataset into a batch failed ({why[:240]}); fix the dataset's "
                        f"__getitem__ (or its transform) for these items")


def check_labels(y, indices: Sequence[int], classes: int | None, name: str, split: str
                 ) -> None:
    """The targets of a batch of the built-in classification task: integer class indices
    in [0, classes) (classes None: 0 or more). Host tensors only (a sync otherwise)."""
    if not (isinstance(y, torch.Tensor) and y.device.type == "cpu" and y.ndim == 1
            and not y.is_floating_point() and not y.is_complex() and y.dtype != torch.bool):
        return  # soft targets, a user task's targets, a dataset's own device tensors
    bad = y < 0
    if classes:
        bad |= y >= classes
    if not bool(bad.any()):
        return
    k = int(bad.nonzero()[0, 0])
    item = indices[k] if k < len(indices) else f"#{k} of its batch"
    span = f"[0, {classes})" if classes else "0 or more"
    raise OneRankError(f"{name}: item {item} of the '{split}' dataset has label {int(y[k])}, out "
                    f"of range for its {classes or 'classes'}"
                    + (" classes (its num_classes / classes)" if classes else "")
                    + f"; expected a class index in {span}: fix the item's label, or the "
                      f"dataset's class count")


def _odd_label(ds, indices: Sequence[int], classes: int | None, name: str, split: str):
    """Targets the loader could not make a tensor of (a str among them): the batch's items
    read again, the first whose target is no class index named (contract.label_problem)."""
    from ddpflow.seams.contract import label_problem, read_item

    for i in indices:
        problem = label_problem(read_item(ds, i, name, split)[1], classes)
        if problem:
            raise OneRankError(f"{name}: item {i} of the '{split}' dataset: its target is "
                               f"{problem}")


def checked(loader, ds, indices: Sequence[int], batch_size: int, name: str, split: str,
            classes: int | None, classify: bool):
    """The loader's batches (items `indices` of `ds`, in order, `batch_size` a batch), each
    checked: `loader_error` for a batch that could not be made, `check_labels` when
    `classify`."""
    it = iter(loader)
    for k in range(len(loader)):
        part = indices[k * batch_size:(k + 1) * batch_size]
        try:
            batch = next(it)
        except StopIteration:
            return
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - the dataset's items, or collating them
            user = loader_error(e, ds, part, name, split)
            if user is None:
                raise
            raise user from None
        if classify and isinstance(batch, (tuple, list)) and len(batch) == 2:
            y = batch[1]
            if not isinstance(y, torch.Tensor):  # the loader kept them as they came
                _odd_label(ds, part, classes, name, split)
            elif y.ndim == 1 and (y.is_floating_point() or y.dtype == torch.bool):
                # one float (or bool) among integer labels makes the whole batch float: the
                # loss would fail inside the rank; the item that is not a class index named
                _odd_label(ds, part, classes, name, split)
            check_labels(batch[1], part, classes, name, split)
        yield batch
