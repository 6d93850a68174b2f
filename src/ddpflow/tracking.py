"""Metrics to the trackers users already open: TensorBoard event files (`tracking.tensorboard`).

Rank 0's metrics records (the same ones metrics.jsonl gets) go to
`<run>/tensorboard/<stage>/`: per log interval loss, lr, samples/s, compute-only samples/s,
data-wait share, TFLOP/s, MFU, peak memory and grad scale; per validation every val_ (and
test_) metric; at the stage's end the resolved config as hparams with the final metrics.
Steps continue across stages (a stage's step 1 is the previous stages' steps + 1), so one
TensorBoard view shows the whole run; a resumed stage purges the points after its checkpoint
(`purge_step`), so nothing is drawn twice.

The writer lives in its own thread: importing TensorBoard (protobuf, about 2 s) and writing
events never holds up a training step. `close()` waits for it.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
from pathlib import Path

from .config import Config
from .errors import UserError

TRAIN_SCALARS = {"loss": "train/loss", "lr": "train/lr", "samples_per_s": "perf/samples_per_s",
                 "compute_samples_per_s": "perf/compute_samples_per_s",
                 "data_wait_fraction": "perf/data_wait_fraction", "tflops": "perf/tflops",
                 "mfu": "perf/mfu", "peak_mem_mib": "perf/peak_mem_mib",
                 "grad_scale": "train/grad_scale"}


def tensorboard_available() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("tensorboard") is not None
    except (ImportError, ValueError):
        return False


def check(cfg: Config) -> None:
    """tracking.tensorboard: true without the package: one message naming the extra."""
    if cfg.tracking.tensorboard is True and not tensorboard_available():
        raise UserError("tracking.tensorboard is true but the tensorboard package is not "
                        "installed; pip install 'ddpflow[tensorboard]' (or set "
                        "tracking.tensorboard: auto to log only where it is installed)")


def step_offset(cfg: Config, stage: str) -> int:
    """Optimizer steps of the stages before this one (from their summaries)."""
    total = 0
    for st in cfg.stages[: cfg.stage_index(stage)]:
        try:
            total += int(json.loads((cfg.stage_dir(st.name) / "summary.json").read_text())
                         ["steps"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return total


def flat(d: dict, prefix: str = "") -> dict:
    """{'stages.0.lr': 0.1, ...}: nested config as scalar hparams (lists as JSON text)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat(v, key + "."))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            for i, x in enumerate(v):
                out.update(flat(x, f"{key}.{i}."))
        elif isinstance(v, (bool, int, float, str)):
            out[key] = v
        else:
            out[key] = json.dumps(v)
    return out


class TensorBoard:
    """Event files for one stage, written by a background thread."""

    def __init__(self, folder: Path, offset: int, resume_step: int):
        self.folder, self.offset = Path(folder), offset
        self.q: queue.Queue = queue.Queue()
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, args=(offset + resume_step,),
                                       name="ddpflow-tensorboard", daemon=True)
        self.thread.start()

    def _run(self, purge_step: int) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(str(self.folder), purge_step=purge_step or None)
        except Exception as e:  # noqa: BLE001 - a tracker never fails training
            self.error = f"{type(e).__name__}: {e}"
            print(f"ddpflow: warning: TensorBoard logging is off ({self.error})",
                  file=sys.stderr)
            while self.q.get() is not None:
                pass
            return
        while (item := self.q.get()) is not None:
            kind, payload = item
            if kind == "scalars":
                step, values = payload
                for tag, v in values.items():
                    writer.add_scalar(tag, v, step)
            else:  # hparams with the final metrics
                hp, metrics = payload
                writer.add_hparams(hp, metrics, run_name=".")
        writer.close()

    def record(self, rec: dict) -> None:
        step = self.offset + int(rec.get("step", 0))
        if rec.get("kind") == "train":
            values = {tag: rec[k] for k, tag in TRAIN_SCALARS.items()
                      if isinstance(rec.get(k), (int, float))}
        elif rec.get("kind") == "val":
            values = {f"{k.split('_', 1)[0]}/{k.split('_', 1)[1]}": v for k, v in rec.items()
                      if k.startswith(("val_", "test_")) and isinstance(v, (int, float))}
        else:
            return
        self.q.put(("scalars", (step, values)))

    def stage_end(self, config: dict, final_metrics: dict) -> None:
        metrics = {f"hparam/{k}": v for k, v in final_metrics.items()
                   if isinstance(v, (int, float))}
        self.q.put(("hparams", (flat(config), metrics)))

    def close(self) -> None:
        self.q.put(None)
        self.thread.join()


def open_tensorboard(cfg: Config, stage: str, resume_step: int) -> TensorBoard | None:
    """The stage's TensorBoard writer on rank 0, or None (off, or auto without the package)."""
    on = cfg.tracking.tensorboard
    if on is False or (on == "auto" and not tensorboard_available()):
        return None
    check(cfg)
    return TensorBoard(cfg.run_dir / "tensorboard" / stage, step_offset(cfg, stage),
                       resume_step)
