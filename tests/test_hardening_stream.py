"""The seam contract at every batch of a user dataset (data/stream.py), not only at the probe
of its first, middle and last item: a label out of range, items of unequal shapes, an item
that raises, each named by its dataset index, on the host (no device sync per step), and in
a real 2-rank stage one message (the rank that found it waits to be stopped with the others:
no peer's traceback)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from conftest import ddpflow, tiny_config, write_config
from ddpflow.core.errors import OneRankError, UserError
from ddpflow.data import stream
from ddpflow.data.factory import FactoryBatches, val_batches

NAME = "data.factory mine:make"


class Items(Dataset):
    """256 items of 3 x 8 x 8, label i % 4; `bad` spoils one (200 unless `at`)."""

    def __init__(self, bad=None, at=200, declare=True, n=256):
        self.bad, self.at, self.n = bad, at, n
        if declare:
            self.classes = ["a", "b", "c", "d"]

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x, y = torch.full((3, 8, 8), i / self.n), i % 4
        if i == self.at:
            if self.bad == "label":
                y = 9
            elif self.bad == "negative":
                y = -1
            elif self.bad == "shape":
                x = torch.zeros(3, 9, 8)
            elif self.bad == "raises":
                raise ValueError(f"cannot decode item {i}")
            elif self.bad == "text":
                y = "cat"  # of one shape with the others, but no batch can hold it
            elif self.bad == "float":
                y = 2.5  # the whole batch's labels become float: the loss fails in the rank
        return x, y


ROWS = [  # (dataset, classify, the message; None: every batch passes)
    (Items("label"), True, "item 200 of the 'train' dataset has label 9, out of range for its "
                           "4 classes (its num_classes / classes); expected a class index in "
                           "[0, 4)"),
    (Items("label", at=203), True, "item 203 of the 'train' dataset has label 9"),
    (Items("negative", declare=False), True, "item 200 of the 'train' dataset has label -1, "
                                             "out of range for its classes; expected a class "
                                             "index in 0 or more"),
    (Items("label", declare=False), True, None),  # no class count: the loss names it (step.py)
    (Items("label"), False, None),  # a user task: its targets are its own
    (Items("shape"), True, "item 200 of the 'train' dataset has shape (3, 9, 8), the other "
                           "items of its batch (3, 8, 8); items must be of one shape"),
    (Items("shape", at=7), True, "item 7 of the 'train' dataset has shape (3, 9, 8)"),
    (Items("raises"), True, "reading item 200 of the 'train' dataset failed (ValueError: "
                            "cannot decode item 200 at test_hardening_stream.py:"),
    (Items("text"), True, "item 200 of the 'train' dataset: its target is a str label 'cat'; "
                          "expected an integer class index"),
    (Items("float"), True, "item 200 of the 'train' dataset: its target is a float label 2.5; "
                           "expected an integer class index"),
    (Items("float", at=203), True, "item 203 of the 'train' dataset: its target is a float "
                                   "label 2.5"),
    (Items("float"), False, None),  # a user task's targets may be floats
    (Items("text", at=201), True, "reading items 200, 201, 202, 203, 204 ... (8 items) of the "
                                  "'train' dataset into a batch failed ("),
    (Items(), True, None),
]


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("ds, classify, words", ROWS, ids=[
    f"{r[0].bad}{'' if hasattr(r[0], 'classes') else '-undeclared'}{'' if r[1] else '-task'}"
    f"-at{r[0].at}" for r in ROWS])
def test_every_batch_keeps_the_contract_or_names_the_item(ds, classify, words, workers):
    loader = DataLoader(ds, batch_size=8, num_workers=workers)
    batches = stream.checked(loader, ds, range(len(ds)), 8, NAME, "train",
                             getattr(ds, "classes", None) and 4, classify)
    if words is None:
        assert sum(1 for _ in batches) == 32
        return
    with pytest.raises(OneRankError) as e:
        for _ in batches:
            pass
    text = str(e.value)
    assert text.startswith(f"{NAME}: ") and words in text and "\n" not in text, text


def test_the_index_named_is_the_datasets_in_a_shuffled_epoch_of_one_rank():
    """FactoryBatches reads a permutation of its rank's share: the message names the dataset
    index (200), not a position in the batch or the epoch; validation batches too."""
    cfg = tiny_config(__import__("pathlib").Path("/nonexistent"))["data"]
    data = type("D", (), {"factory": "mine:make", "num_workers": 0, "pin_memory": False,
                          "persistent_workers": False, "prefetch_factor": 2, **cfg})
    ds = Items("label")
    for rank in (0, 1):
        batches = FactoryBatches(ds, 8, torch.device("cpu"), 2, rank, 0, data, classify=True)
        order = list(batches.sampler)
        if 200 not in order:
            continue
        with pytest.raises(OneRankError, match=r"item 200 of the 'train' dataset has label 9"):
            for _ in batches.epoch(0):
                pass
        break
    else:
        raise AssertionError("neither rank reads item 200")
    with pytest.raises(OneRankError, match=r"item 200 of the 'val' dataset has label 9"):
        list(val_batches(ds, 16, torch.device("cpu"), 2, 0, data, "val", classify=True))
    assert len(list(val_batches(ds, 16, torch.device("cpu"), 2, 1, data, "val",
                                classify=True))) == 8  # rank 1's share: odd items


def test_a_label_beyond_the_outputs_of_an_undeclared_set_is_one_message():
    """A dataset without num_classes/classes: the label is caught where the loss is taken
    (cross_entropy's `Target 9 is out of bounds`, on a CPU), one message."""
    from ddpflow.engine.step import out_of_bounds

    outputs = torch.zeros(4, 4)
    try:
        torch.nn.functional.cross_entropy(outputs, torch.tensor([0, 9, 1, 2]))
    except IndexError as e:
        err = out_of_bounds(e, outputs)
    assert isinstance(err, UserError) and str(err) == (
        "a training batch holds label 9, but the model returns 4 outputs per sample (one per "
        "class); fix the label, or give the dataset num_classes (or classes) so that ddpflow "
        "names the item")
    assert out_of_bounds(IndexError("list index out of range"), outputs) is None


STAGE_SETS = '''
import torch
from torch.utils.data import Dataset


class Items(Dataset):
    classes = ["a", "b", "c", "d"]

    def __init__(self, split, bad):
        self.n, self.bad = (256 if split == "train" else 64), bad if split == "train" else None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = torch.rand(3, 9 if (self.bad == "shape" and i == 7) else 8, 8,
                       generator=torch.Generator().manual_seed(i))
        return x, (9 if (self.bad == "label" and i == 200) else i % 4)


def make(split, bad=None):
    return Items(split, bad)
'''


@pytest.mark.slow
@pytest.mark.parametrize("bad, words", [
    ("label", "data.factory sets:make: item 200 of the 'train' dataset has label 9, out of "
              "range for its 4 classes"),
    ("shape", "data.factory sets:make: item 7 of the 'train' dataset has shape (3, 9, 8)"),
])
def test_a_bad_item_past_the_probe_stops_the_stage_with_one_message(tmp_path, bad, words):
    """Item 200's label 9 in a 4-class set, item 7 of 3 x 9 x 8 among 3 x 8 x 8: the probe
    (first, middle, last) passes them; before, a rank failed with `Target 9 is out of bounds`
    or a collate RuntimeError (and the other rank with its own traceback)."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "sets.py").write_text(STAGE_SETS)
    raw = tiny_config(tmp_path, data={"source": "python", "factory": "sets:make",
                                      "code_dir": str(code), "kwargs": {"bad": bad},
                                      "num_workers": 0},
                      hardware={"nproc_per_node": 2, "threads_per_rank": 1, "max_restarts": 1},
                      stages=[{"name": "s", "epochs": 1, "batch_size": 8}],
                      checkpoint={"every_steps": 4})
    p = write_config(tmp_path, raw)
    ddpflow("prepare", "--config", p, check=True)
    proc = ddpflow("launch", "--config", p, "--stage", "s")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "out of bounds" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"ddpflow: error: {words}"), \
        proc.stderr[-2000:]
    assert [ln for ln in proc.stderr.splitlines() if "error" in ln][:1] == \
        proc.stderr.strip().splitlines()[-1:]
    stage = tmp_path / "results/t/stages/s"
    assert not (stage / "final.pt").exists() and not (stage / "summary.json").exists()
