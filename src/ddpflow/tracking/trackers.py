"""Metrics to the trackers users already open: TensorBoard event files (`tracking.tensorboard`),
MLflow runs (`tracking.mlflow`, in mlflowrun.py) and Weights & Biases runs (`tracking.wandb`,
in wandbrun.py), all fed by `Trackers` on rank 0.

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

import queue
import sys
import threading
from pathlib import Path

from ddpflow.config import Config
from ddpflow.core import reading
from ddpflow.core.errors import UserError
from ddpflow.tracking.records import flat, scalars


def installed(package: str) -> bool:
    """Whether `package` can be imported here (without importing it: both are slow)."""
    import importlib.util

    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def tensorboard_available() -> bool:
    return installed("tensorboard")


def check(cfg: Config) -> None:
    """Before any rank starts: a tracker asked for without its package is one message naming
    the extra; W&B's environment, folder and server (wandbrun.check)."""
    from ddpflow.tracking.mlflowrun import check as check_mlflow
    from ddpflow.tracking.wandbrun import check as check_wandb

    check_mlflow(cfg)
    check_tensorboard(cfg)
    check_wandb(cfg)


def check_tensorboard(cfg: Config) -> None:
    if cfg.tracking.tensorboard is True and not tensorboard_available():
        raise UserError("tracking.tensorboard is true but the tensorboard package is not "
                        "installed; pip install 'ddpflow[tensorboard]' (or set "
                        "tracking.tensorboard: auto to log only where it is installed)")


# what step_offset reads of a summary (results/summary.py has the whole SUMMARY_SCHEMA)
_STEPS = {"type": "object", "required": ["steps"],
          "properties": {"steps": {"type": "integer", "minimum": 0}}}


def step_offset(cfg: Config, stage: str) -> int:
    """Optimizer steps of the stages before this one (from their summaries)."""
    total = 0
    for st in cfg.stages[: cfg.stage_index(stage)]:
        s = reading.read_json_or_none(cfg.stage_dir(st.name) / "summary.json", _STEPS,
                                      "stage summary")
        total += s["steps"] if s else 0  # missing or damaged: that stage runs again anyway
    return total


class TensorBoard:
    """Event files for one stage, written by a background thread."""

    def __init__(self, folder: Path, offset: int, resume_step: int):
        self.folder, self.offset = Path(folder), offset
        self.q: queue.Queue = queue.Queue()
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, args=(offset + resume_step,),
                                       name="ddpflow-tensorboard", daemon=True)

    def _started(self) -> queue.Queue:
        """The writer thread starts with the first record (after the first step): importing
        TensorBoard would otherwise compete with the start-up for the GIL."""
        if self.thread.ident is None:
            self.thread.start()
        return self.q

    def _run(self, purge_step: int) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
            from torch.utils.tensorboard.summary import hparams

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
                # the hparams summaries alone: the HParams table reads each metric's value from
                # the scalar series of the same tag (val/acc, ...), so no single-point chart per
                # metric is drawn (add_hparams would write one, hparam/*)
                file_writer = writer._get_file_writer()
                for summary in hparams(hp, metrics):
                    file_writer.add_summary(summary)
        writer.close()

    def record(self, rec: dict) -> None:
        values = scalars(rec)
        if values:
            self._started().put(("scalars", (self.offset + int(rec.get("step", 0)), values)))

    def stage_end(self, config: dict, final_metrics: dict, artifacts: list) -> None:
        # val_acc -> val/acc: the tag its points were logged under during the stage
        metrics = {f"{k.split('_', 1)[0]}/{k.split('_', 1)[1]}": v
                   for k, v in final_metrics.items()
                   if isinstance(v, (int, float)) and k.startswith(("val_", "test_"))}
        self._started().put(("hparams", (flat(config), metrics)))

    def close(self, status: str) -> None:
        self._started().put(None)
        self.thread.join()


class Trackers:
    """Every tracker of a stage, fed the same calls."""

    def __init__(self, items: list):
        self.items = items

    def record(self, rec: dict) -> None:
        for t in self.items:
            t.record(rec)

    def stage_end(self, config: dict, final_metrics: dict, artifacts: list) -> None:
        for t in self.items:
            t.stage_end(config, final_metrics, artifacts)

    def close(self, status: str) -> None:
        """status: FINISHED, KILLED (stopped at a checkpoint, resumable) or FAILED."""
        for t in self.items:
            t.close(status)


def open_trackers(cfg: Config, stage: str, resume_step: int, key: str) -> Trackers | None:
    """The stage's trackers on rank 0, or None when none is on."""
    from ddpflow.tracking import mlflowrun, wandbrun

    items: list = []
    offset = step_offset(cfg, stage)
    on = cfg.tracking.tensorboard
    if on is True or (on == "auto" and tensorboard_available()):
        check_tensorboard(cfg)
        items.append(TensorBoard(cfg.run_dir / "tensorboard" / stage, offset, resume_step))
    if cfg.tracking.mlflow.uri:
        mlflowrun.check(cfg)
        items.append(mlflowrun.MlflowStage(cfg, stage, offset, key, resume_step > 0,
                                           flat(cfg.to_dict())))
    if cfg.tracking.wandb.project:  # (checked before the ranks started: launcher.preflight)
        items.append(wandbrun.WandbStage(cfg, stage, offset, key, resume_step > 0,
                                         cfg.to_dict()))
    return Trackers(items) if items else None
