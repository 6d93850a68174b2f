"""`ddpflow evaluate`: a finished stage's weights on a split (or an image folder), across
the node's ranks with torchrun like training.

    launcher  checks the stage and the data, runs torchrun (`ddpflow evaluate-rank`)
    each rank its strided share, in fp32, scored on its device as batches come (the
              next read ahead); the confusion matrices and sums reduced to rank 0
    rank 0    top-1, top-5, loss, per-class precision/recall/F1, the confusion matrix:
              metrics.json, per_class.csv and confusion.png in
              results/<run>/evaluate/<stage>/<split>-<weights>/ (written atomically)
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as torch_dist

from ddpflow.config import Config
from ddpflow.core import reading, writing
from ddpflow.core.errors import UserError
from ddpflow.core.quoting import write_csv
from ddpflow.core.writing import remove_scratch, write_json_atomic
from ddpflow.data import crops, imagefolder, prepared
from ddpflow.data.loaders import host_batch, read_ahead
from ddpflow.data.prepare import check_settings
from ddpflow.data.splits import SPLIT_LIKE
from ddpflow.engine import distributed
from ddpflow.inference.common import (
    Tally,
    decode,
    preprocess,
    stage_model,
    stage_weights,
    warn_if_stale,
)
from ddpflow.results import plots
from ddpflow.seams.models import input_channels

BATCH = 256  # images per forward, per rank
WHAT = "the evaluation results"
# what evaluate writes in its folder (error.json: rankerror.RANK_ERROR; nodes: the roll call)
NAMES = ("config.json", "metrics.json", "per_class.csv", "confusion.png", "error.json", "nodes")
_NUMBER = {"type": "number"}
# metrics.json as `ddpflow evaluate` reports it (core/reading.py validates it first)
EVAL_SCHEMA = {"type": "object", "required": ["weights", "split", "acc", "top5", "loss", "samples"],
               "properties": {"weights": {"type": "object", "required": ["weights"]},
                              "split": {"type": "string"}, "acc": _NUMBER, "top5": _NUMBER,
                              "loss": _NUMBER, "samples": {"type": "integer", "minimum": 0}}}


def out_dir(cfg: Config, stage: str, split: str | None, weights: str) -> Path:
    return cfg.run_dir / "evaluate" / stage / f"{split or 'images'}-{weights}"


def launch(cfg: Config, stage: str | None, split: str, images: str | None, weights: str,
           out: str | None, allow_empty: bool = False) -> int:
    """Check, then one torchrun whose ranks evaluate together; prints the result."""
    stage = stage or cfg.stages[-1].name
    cfg.stage(stage)
    meta = _meta(cfg)
    if images is not None:  # missing, or a file: said which
        reading.existing(images, "--images", "give a labelled folder DIR/<class>/<image> "
                         "(class names as in training)", folder=True)
        _labelled_folder(images, meta["classes"])  # its classes, before any folder is made
    elif meta["counts"][split]["total"] == 0 and not allow_empty:
        other = "val" if split == "test" else "test"
        raise UserError(f"--split {split}: the prepared data has no {split} split "
                        f"(data.{split}_fraction 0, or a data.factory without one); "
                        f"evaluate --split {other}, --images a labelled folder, or add "
                        f"--allow-empty to record an empty result")
    stage_weights(cfg, stage, weights)  # there and readable (and an EMA for --weights ema)
    warn_if_stale(cfg, stage)
    folder = Path(out) if out else out_dir(cfg, stage, None if images else split, weights)
    with writing.output_lock(folder, WHAT):  # a second at once is told who holds it
        writing.claim_folder(folder, WHAT, NAMES, legacy=_is_evaluation)
        return _run(cfg, stage, split, images, weights, meta, folder, allow_empty)


def _is_evaluation(folder: Path) -> bool:
    """An evaluate folder of a version before the `.ddpflow-output` marker: its config.json
    is a resolved ddpflow config and it holds an evaluation's results (a run folder has a
    config.json too, and stages/ beside it: that is not an evaluation to replace)."""
    if (folder / "stages").exists() or not any(
            (folder / name).is_file() for name in ("metrics.json", "per_class.csv")):
        return False
    return reading.read_json_or_none(folder / "config.json", {
        "type": "object", "required": ["run", "stages", "results_dir"]},
        "config.json") is not None


def _run(cfg: Config, stage: str, split: str, images: str | None, weights: str, meta: dict,
         folder: Path, allow_empty: bool) -> int:
    from ddpflow.launch.launcher import plan
    from ddpflow.launch.procs import run_torchrun
    from ddpflow.launch.rankerror import Reports
    from ddpflow.launch.slurmnodes import missing_nodes_text, roll_call_dir
    if images is None and meta["counts"][split]["total"] == 0:  # --allow-empty (launch)
        write_json_atomic(folder / "metrics.json", {"stage": stage, "split": split,
                                                    "samples": 0, "note": f"no {split} split"})
        print(f"ddpflow: no {split} split to evaluate; wrote {folder / 'metrics.json'}")
        return 0
    resolved = folder / "config.json"
    write_json_atomic(resolved, cfg.to_dict())
    (folder / "metrics.json").unlink(missing_ok=True)  # an earlier result never passes
    extra = [f"--split={split}", f"--weights={weights}", f"--out={folder}"]
    extra += [f"--images={images}"] if images else []
    cmd, env = plan(cfg, stage, resolved, extra, command="evaluate-rank")
    remove_scratch(roll_call_dir(resolved))  # several nodes: who answers
    with Reports(folder) as reports:  # a mistake inside a rank (rankerror.py)
        rc, _ = run_torchrun(cmd, {**env, **reports.env}, watch=reports)
        if reports.message():
            raise UserError(reports.message())
    if rc != 0 or not (folder / "metrics.json").is_file():
        why = (rc and missing_nodes_text(cfg, folder)) or f"torchrun exited with {rc}"
        print(f"ddpflow: error: evaluation failed ({why})", file=sys.stderr)
        return rc or 1
    m = reading.read_json(folder / "metrics.json", EVAL_SCHEMA, "evaluation result",
                          "run `ddpflow evaluate` again")
    w = m["weights"]  # which file, and whose weights it holds (final.pt holds the EMA's)
    print(f"ddpflow: {stage} {Path(w.get('file', '')).name or w['weights']} ({w['holds']} "
          f"weights, fp32) on {m['split']}: "
          f"acc {m['acc']:.4f}, top5 {m['top5']:.4f}, loss {m['loss']:.4f} over "
          f"{m['samples']} images -> {folder}")
    return 0


def _meta(cfg: Config) -> dict:
    meta = prepared.read_meta(cfg.data_dir)
    if meta is None:
        raise UserError(f"no prepared data at {cfg.data_dir}; run `ddpflow prepare` first")
    check_settings(cfg, meta)
    if cfg.task.name != "classification":
        raise UserError(f"ddpflow evaluate reports classification metrics; task.name is "
                        f"{cfg.task.name} (its metrics are in the stage's summary.json)")
    return meta


def rank_main(cfg: Config, stage: str, split: str, images: str | None, weights: str,
              out: Path) -> None:
    """One rank: its share of the images through the model, scored on its device; the
    ranks' tallies summed on rank 0."""
    dist = distributed.setup(cfg.hardware)
    meta, arrays = prepared.load(cfg.data_dir)
    model, record = stage_model(cfg, meta, stage, weights)
    model.to(dist.device)
    pre = preprocess(meta["mean"], meta["std"], cfg.data.image_size,
                     input_channels(cfg.model.name, meta["image_shape"][2]), dist.device,
                     crops.eval_sizes(cfg.data))
    if images:
        files, labels = _labelled_folder(images, meta["classes"])
        mine = share(len(files), dist.rank, dist.world).tolist()
        x, kept, bad = decode([files[i] for i in mine], cfg.data.store_size, cfg.data.grayscale)
        skipped = [(files[mine[i]], why) for i, why in bad.items()]
        idx = np.array([mine[i] for i in kept], dtype=np.int64)
        y, n = labels[idx], len(files)

        def rows(a, b):
            return x[a:b]
    else:
        x_all, y_all = arrays[split]
        idx = share(len(y_all), dist.rank, dist.world)
        y, skipped, n = y_all[idx], [], len(y_all)

        def rows(a, b):  # read (JPEG shards: decode) one batch at a time
            return x_all[idx[a:b]]
    tally = run_share(model, pre, rows, y, meta["num_classes"], dist.device)
    total = combine(dist, tally, idx, skipped)  # rank 0 only: the sum of every rank's
    if total is not None:
        tally, every, skipped = total
        each_once(every, n, len(skipped))
        _write(cfg, meta, tally.scores(), skipped, out, {
            "stage": stage, "split": images or split, "weights": record, "world_size": dist.world})
    distributed.teardown(dist)


def run_share(model, pre, rows, labels, num_classes: int, device, batch: int = BATCH) -> Tally:
    """This rank's images (rows(a, b): the a-th to b-th) through the model in fp32 (the
    figures predict and export compare against), scored on the device as they come. A
    thread reads (decodes) the next batch meanwhile, into pinned memory for a GPU, so the
    copy to the GPU is asynchronous; nothing is copied back per batch."""
    tally = Tally(num_classes, device)
    y = torch.as_tensor(np.asarray(labels), dtype=torch.long).to(device)  # one copy
    pin = device.type == "cuda"
    ahead = read_ahead(lambda a: (a, host_batch(np.asarray(rows(a, a + batch)), pin)),
                       range(0, len(y), batch))
    with torch.no_grad():
        for a, x in ahead:
            tally.add(model(pre(x)), y[a:a + batch])
    return tally


def combine(dist, tally: Tally, idx: np.ndarray, skipped: list):
    """On rank 0: (every rank's tally summed, every rank's image numbers, every skipped
    (file, reason)); None on the others. The tallies are reduced on the device (confusion
    matrix and sums); only image numbers and skipped files travel as objects, to rank 0
    alone: no rank receives another's outputs (collectives, sync points)."""
    if not dist.backend:
        return tally, np.asarray(idx), skipped
    torch_dist.reduce(tally.confusion, dst=0)
    torch_dist.reduce(tally.sums, dst=0)
    held = [None] * dist.world if dist.is_master else None
    torch_dist.gather_object((np.asarray(idx), skipped), held, dst=0)
    if not dist.is_master:
        return None
    return tally, np.concatenate([h[0] for h in held]), [s for h in held for s in h[1]]


def share(n: int, rank: int, world: int) -> np.ndarray:
    """This rank's images of n: every world-th from its rank, so each image is evaluated
    by exactly one rank (no padding to a multiple of the ranks, nothing left out)."""
    return np.arange(rank, n, world, dtype=np.int64)


def each_once(idx: np.ndarray, n: int, skipped: int) -> None:
    """The gathered image numbers: each of the n at most once, all but the skipped ones."""
    if len(np.unique(idx)) != len(idx) or len(idx) + skipped != n or (
            len(idx) and (idx.min() < 0 or idx.max() >= n)):
        raise RuntimeError(f"evaluate gathered {len(idx)} results ({len(np.unique(idx))} "
                           f"distinct) for {n} images ({skipped} skipped): an image was "
                           f"counted twice or not at all")


def _labelled_folder(root: str, classes: list[str]) -> tuple[list[str], np.ndarray]:
    """Files and labels (the model's class numbers) of a root/<class>/<image> folder."""
    found, items = imagefolder.scan(Path(root))
    unknown = [c for c in found if c not in classes]
    splits = [c for c in unknown if c.lower() in SPLIT_LIKE]
    if splits:  # DIR/<split>/<class>/<image>: the split folders, not classes
        raise UserError(f"--images {root} holds split folders ({', '.join(splits)}), not "
                        f"class folders: give one split's folder, e.g. --images "
                        f"{Path(root) / _test_first(splits)}")
    if unknown:
        raise UserError(f"--images {root} has class folder(s) the model does not know: "
                        f"{', '.join(unknown[:5])}; its classes are {', '.join(classes[:20])}: "
                        f"give a folder of those classes")
    return ([f for f, _ in items],
            np.array([classes.index(found[label]) for _, label in items], dtype=np.int64))


def _test_first(splits: list[str]) -> str:
    return next((c for c in splits if SPLIT_LIKE[c.lower()] == "test"), splits[0])


def _write(cfg: Config, meta: dict, result: dict, skipped: list, out: Path,
           head: dict) -> None:
    classes = meta["classes"]
    out = Path(out)
    pc = result["per_class"]
    write_csv(out / "per_class.csv", ["class", "precision", "recall", "f1", "support"],
              [[name, f"{pc['precision'][i]:.6f}", f"{pc['recall'][i]:.6f}",
                f"{pc['f1'][i]:.6f}", pc["support"][i]] for i, name in enumerate(classes)],
              WHAT)
    plots.confusion(np.array(result["confusion"]), classes, out / "confusion.png",
                    f"{head['stage']} on {Path(str(head['split'])).name}")
    write_json_atomic(out / "metrics.json", {  # last: its presence means complete
        **head, **result, "classes": classes,
        "skipped": [{"file": f, "reason": r} for f, r in skipped],
        "image_size": cfg.data.image_size, "store_size": cfg.data.store_size,
        "config_hash": cfg.hash, "data_fingerprint": meta.get("fingerprint")})
