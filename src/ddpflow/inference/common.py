"""What evaluate, export and predict share: a stage's weights in a model, image files read
exactly like validation, and classification scores.

Image files go the way prepared data went, then the way validation goes:
    decode (any mode -> RGB or L), resize the short side to store_size and keep the centre
    square (prepare's rule, imagefolder.decode_file)
    -> (x/255 - mean) / std  -> resize to image_size / 0.875, keep the centre image_size
       (data.eval_resize_size and eval_crop_size where set; data.interpolation's filter)
so `predict` on a file gives what `evaluate` gives on the same file.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from ddpflow.config import Config
from ddpflow.core.errors import UserError
from ddpflow.data import crops, imagefolder
from ddpflow.data.loaders import Normalize
from ddpflow.engine import checkpoint
from ddpflow.seams.contract import probe
from ddpflow.seams.models import build_model, input_channels
from ddpflow.seams.userimport import add_code_dirs

WEIGHTS = {  # --weights: which file, which entry
    "final": ("final.pt", "model"),  # what the stage hands on (the EMA's when it had one)
    "best": ("best.pt", "model"),  # the best validation result's
    "ema": ("final.pt", "model"),  # the EMA's, explicitly (an error without stages[].ema)
    "raw": ("final.pt", "model_raw"),  # the trained weights beside an EMA
}


def stage_weights(cfg: Config, stage: str, kind: str = "final") -> tuple[dict, dict]:
    """(state dict, record) of a finished stage's `kind` weights."""
    cfg.stage(stage)
    name, key = WEIGHTS[kind]
    path = cfg.stage_dir(stage) / name
    if not path.is_file():
        why = "is a folder, not a file" if path.is_dir() else "does not exist"
        raise UserError(f"stage '{stage}' has no {name}: {path} {why}; run the stage first "
                        f"(`ddpflow launch --stage {stage}` or snakemake)")
    problem = checkpoint.verify(path)
    if problem:
        raise UserError(f"{path} {problem}; run the stage again")
    ck = checkpoint.load(path)
    holds = ck.get("weights", "raw")
    if kind == "ema" and holds != "ema":
        raise UserError(f"stage '{stage}' kept no EMA of its weights (stages[].ema.decay is "
                        f"null); use --weights final or best")
    if kind == "raw" and key not in ck:
        key = "model"  # no EMA: the trained weights are the ones handed on
    record = {"stage": stage, "file": str(path), "sha256": checkpoint.sha256_of(path),
              "weights": kind, "holds": "raw" if key == "model_raw" else holds,
              "step": ck.get("step")}
    return ck[key], record


def warn_if_stale(cfg: Config, stage: str) -> None:
    """A stage result made from other inputs than the config names is still evaluated or
    exported (it is what is on disk), but never silently."""
    from ddpflow.results.provenance import stage_result

    _, stale = stage_result(cfg, stage)
    if stale:
        print(f"ddpflow: warning: stage '{stage}' is {stale}; its weights are "
              f"used as they are (run the stage again for a fresh result)", file=sys.stderr)


def stage_model(cfg: Config, meta: dict, stage: str, kind: str = "final"):
    """(model in eval mode on the CPU, record) for a finished stage on prepared data meta."""
    if meta.get("kind") == "python":
        raise UserError("evaluate, export and predict work on prepared images; a data.source "
                        "python dataset without data.materialize has none")
    sd, record = stage_weights(cfg, stage, kind)
    add_code_dirs(cfg)  # model.code_dir on sys.path: a user's model builder imports
    channels = input_channels(cfg.model.name, meta["image_shape"][2])
    model = build_model(cfg.model, meta["num_classes"], channels, probe(cfg, meta))
    checkpoint.check_fits(model, sd, f"{record['file']} ({kind})")
    model.load_state_dict(sd)
    return model.eval(), record


def preprocess(mean, std, image_size: int, channels: int, device,
               crop: crops.EvalCrop | None = None):
    """uint8 NHWC stored-size images -> normalised float NCHW: validation's own Normalize
    and centre crop (loaders.val_batches; `crop` None: to image_size), so the numbers are
    the same."""
    norm = Normalize(mean, std, device, channels, channels_last=False)
    crop = crop or crops.EvalCrop(image_size)
    return lambda x: crop(norm(x.to(device, non_blocking=True))).contiguous()


def image_files(args: list[str]) -> list[str]:
    """Files named, and image files inside folders named (sorted, recursive), as given: a
    file found in a folder is the folder joined with its relative path."""
    out = []
    for a in args:
        p = Path(a)
        if p.is_dir():
            out += [str(Path(a) / f.relative_to(p)) for f in sorted(p.rglob("*"))
                    if f.is_file() and f.suffix.lower() in imagefolder.EXTENSIONS]
        elif p.exists():
            out.append(a)
        else:
            raise UserError(f"{a} does not exist (give image files or folders of them)")
    if not out:
        raise UserError(f"no image files ({', '.join(sorted(imagefolder.EXTENSIONS))}) in "
                        f"{', '.join(args)}")
    return out


def decode(files: list[str], store_size: int, grayscale: bool):
    """(uint8 [n, s, s, c] of the readable files, their positions, {position: reason})."""
    arrays, kept, bad = [], [], {}
    for i, f in enumerate(files):
        arr, err = imagefolder.decode_file((f, store_size, grayscale))
        if arr is None:
            bad[i] = err
        else:
            arrays.append(arr)
            kept.append(i)
    c = 1 if grayscale else 3
    x = np.stack(arrays) if arrays else np.zeros((0, store_size, store_size, c), np.uint8)
    return x, kept, bad


def scores(logits: torch.Tensor, labels: torch.Tensor, num_classes: int) -> dict:
    """Top-1, top-5, mean cross-entropy, confusion matrix and per-class precision, recall
    and F1 of these outputs (Tally, all at once)."""
    tally = Tally(num_classes, logits.device)
    tally.add(logits, labels)
    return tally.scores()


class Tally:
    """Classification scores added up batch by batch where the outputs are (the device):
    the confusion matrix, the summed cross-entropy and the top-5 hits; no outputs are kept.
    Ranks add their tallies together (evaluate.combine), `scores` reads the total."""

    def __init__(self, num_classes: int, device):
        self.num_classes = num_classes
        self.confusion = torch.zeros(num_classes, num_classes, dtype=torch.long, device=device)
        self.sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss, top-5 hits

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        logits = logits.float()
        top = logits.topk(min(5, self.num_classes), 1).indices
        self.confusion.index_put_((labels, top[:, 0]), torch.ones_like(labels),
                                  accumulate=True)
        self.sums += torch.stack([
            torch.nn.functional.cross_entropy(logits, labels, reduction="sum").double(),
            (top == labels[:, None]).any(1).sum().double()])

    def scores(self) -> dict:
        """The figures of everything added (read to the host: a sync point)."""
        conf = self.confusion.cpu()
        loss, top5 = self.sums.tolist()
        n = int(conf.sum())
        tp = conf.diag().double()
        precision = tp / conf.sum(0).clamp(min=1)
        recall = tp / conf.sum(1).clamp(min=1)
        f1 = 2 * precision * recall / (precision + recall).clamp(min=1e-12)
        held = conf.sum(1) > 0  # the classes the split has: their mean recall
        balanced = recall[held].mean().item() if held.any() else None
        return {"samples": n, "acc": tp.sum().item() / n if n else None,
                "balanced_acc": balanced,
                "top5": top5 / n if n else None, "loss": loss / n if n else None,
                "confusion": conf.tolist(),
                "per_class": {"precision": precision.tolist(), "recall": recall.tolist(),
                              "f1": f1.tolist(), "support": conf.sum(1).tolist()}}
