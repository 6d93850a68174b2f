"""MLflow runs (`tracking.mlflow: {uri, experiment}`): one run per workflow run, a nested run
per stage, and in a sweep the sweep's run above each trial's run.

Each level keeps its run id in `mlflow.json` in its own folder (`<run>/`, `<run>/stages/<s>/`,
a sweep's `<run>/` above its `trials/<id>/`), so a resumed stage continues its MLflow run and
a rerun of the workflow logs under the same parent. A stage that starts afresh (no checkpoint
to resume) gets a new run: the old one stays in MLflow as the history it is.

Rank 0 sends through a background thread, in order: params (the flattened resolved config)
when the stage starts, metrics as they are logged (the records metrics.jsonl and TensorBoard
get, with the same run-wide steps), and at the end summary.json and metrics.jsonl as
artifacts and the run's status (FINISHED, KILLED when stopped at a checkpoint, FAILED).
`collect` adds the report to the workflow's run.

A tracking server that cannot be reached never fails training: the stage log gets one
warning, what could not be sent goes to `<stage>/mlflow_unsent.jsonl`, and the next
`ddpflow collect` sends it (points a run already has are not sent twice).
"""

from __future__ import annotations

import fcntl
import json
import os
import queue
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from ddpflow.config import Config
from ddpflow.core import reading
from ddpflow.core.errors import UserError
from ddpflow.core.writing import move_into_place, write_json_atomic

RUN_FILE = "mlflow.json"
UNSENT = "mlflow_unsent.jsonl"


def available() -> bool:
    """Whether mlflow can be imported here (without importing it: that takes seconds)."""
    import importlib.util

    try:
        return importlib.util.find_spec("mlflow") is not None
    except (ImportError, ValueError):
        return False


def check(cfg: Config) -> None:
    if cfg.tracking.mlflow.uri and not available():
        raise UserError("tracking.mlflow.uri is set but the mlflow package is not installed; "
                        "pip install 'ddpflow[mlflow]' (or set tracking.mlflow.uri: null)")


def warn(text: str) -> None:
    print(f"ddpflow: warning: {text}", file=sys.stderr, flush=True)


def client(uri: str):
    # a tracker must not hang a stage's end: few retries, a short timeout, no URL printing
    for key, value in (("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2"),
                       ("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1"),
                       ("MLFLOW_HTTP_REQUEST_TIMEOUT", "20"),
                       ("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")):
        os.environ.setdefault(key, value)
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def experiment_id(c, name: str) -> str:
    e = c.get_experiment_by_name(name)
    if e is not None:
        return e.experiment_id
    try:
        return c.create_experiment(name)
    except Exception:  # noqa: BLE001 - another trial created it first
        e = c.get_experiment_by_name(name)
        if e is None:
            raise
        return e.experiment_id


@contextmanager
def _locked(folder: Path):
    """Parallel trials create their sweep's run once: a blocking flock per folder."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / ".mlflow.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


_TEXT = {"type": ["string", "null"]}
# mlflow.json: the run kept for a folder (damaged or missing: a new run is made)
RUN_SCHEMA = {"type": "object", "properties": {
    "uri": _TEXT, "experiment_id": _TEXT, "run_id": _TEXT, "key": _TEXT}}
_OBJECT = {"type": "object"}
# one line of mlflow_unsent.jsonl: [op, payload] as StageSink.apply takes it
UNSENT_LINE_SCHEMA = {"type": "array", "minItems": 2, "maxItems": 2, "oneOf": [
    {"prefixItems": [{"const": "open"}, {
        "type": "object", "required": ["key", "resume"],
        "properties": {"key": _TEXT, "resume": {"type": "boolean"}, "params": _OBJECT}}]},
    {"prefixItems": [{"const": "metrics"}, {
        "type": "object", "required": ["step", "ts", "values"],
        "properties": {"step": {"type": "integer"}, "ts": {"type": "integer"},
                       "values": {"type": "object",
                                  "additionalProperties": {"type": ["number", "boolean"]}}}}]},
    {"prefixItems": [{"const": "end"}, {
        "type": "object", "required": ["artifacts", "status"],
        "properties": {"artifacts": {"type": "array", "items": {"type": "string"}},
                       "status": {"type": "string"}}}]}]}


def _saved(folder: Path) -> dict:
    return reading.read_json_or_none(folder / RUN_FILE, RUN_SCHEMA, "MLflow run record") or {}


def ensure_run(c, exp: str, folder: Path, name: str, parent: str | None, uri: str,
               key: str | None = None, reuse: bool = True) -> str:
    """The run id kept in `folder`, or a new run nested under `parent`."""
    with _locked(folder):
        saved = _saved(folder)
        if (reuse and saved.get("run_id") and saved.get("uri") == uri
                and saved.get("experiment_id") == exp and saved.get("key") == key):
            return saved["run_id"]
        tags = {"mlflow.parentRunId": parent} if parent else {}
        run_id = c.create_run(exp, run_name=name, tags=tags).info.run_id
        write_json_atomic(folder / RUN_FILE, {"uri": uri, "experiment_id": exp,
                                              "run_id": run_id, "key": key})
        return run_id


def sweep_root(cfg: Config) -> Path | None:
    """The sweep's run folder when this config is one of its trials (`<run>/trials/<id>`)."""
    root = cfg.run_dir.parent.parent
    if cfg.run_dir.parent.name == "trials" and (root / "sweep" / "plan.json").is_file():
        return root
    return None


def workflow_run(c, cfg: Config, exp: str) -> str:
    uri, parent, root = cfg.tracking.mlflow.uri, None, sweep_root(cfg)
    if root is not None:
        parent = ensure_run(c, exp, root, root.name, None, uri)
    return ensure_run(c, exp, cfg.run_dir, cfg.run, parent, uri)


class StageSink:
    """Applies one stage's operations to MLflow in order. After the first failure it keeps
    the failed operation and all later ones in `unsent` instead (one warning)."""

    def __init__(self, cfg: Config, stage: str, unsent: Path):
        self.cfg, self.stage, self.folder = cfg, stage, cfg.stage_dir(stage)
        self.uri = cfg.tracking.mlflow.uri
        self.unsent, self.kept, self.failed = unsent, 0, None
        self.c = self.run_id = None
        self.seen: dict[str, int] = {}  # metric -> last step the run has (no point twice)

    def apply(self, op: list) -> None:
        if self.failed is None:
            try:
                getattr(self, "_" + op[0])(op[1])
                return
            except Exception as e:  # noqa: BLE001 - a tracker never fails training
                self.failed = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                warn(f"MLflow at {self.uri} could not log stage {self.stage} ({self.failed}); "
                     f"what is not sent is kept in {self.unsent} and sent by the next "
                     f"`ddpflow collect`")
        with open(self.unsent, "a") as f:
            f.write(json.dumps(op) + "\n")
        self.kept += 1

    def _open(self, p: dict) -> None:
        from mlflow.entities import Param

        self.c = client(self.uri)
        exp = experiment_id(self.c, self.cfg.tracking.mlflow.experiment)
        parent = workflow_run(self.c, self.cfg, exp)
        # a sweep's trials all have stages of the same names: trial/stage tells them apart
        name = f"{self.cfg.run}/{self.stage}" if sweep_root(self.cfg) else self.stage
        self.run_id = ensure_run(self.c, exp, self.folder, name, parent, self.uri,
                                 key=p["key"], reuse=p["resume"])
        run = self.c.get_run(self.run_id)
        if run.data.params:  # a resumed (or re-sent) run: continue it, skip what it has
            self.c.update_run(self.run_id, status="RUNNING")
            self.seen = {k: max((m.step for m in self.c.get_metric_history(self.run_id, k)),
                                default=-1) for k in run.data.metrics}
            return
        params = [Param(k, str(v)[:6000]) for k, v in p.get("params", {}).items()]
        for i in range(0, len(params), 100):  # MLflow takes 100 params per batch
            self.c.log_batch(self.run_id, params=params[i:i + 100])
        self.c.set_tag(self.run_id, "ddpflow.stage", self.stage)

    def _metrics(self, p: dict) -> None:
        from mlflow.entities import Metric

        step = p["step"]
        batch = [Metric(k, float(v), p["ts"], step) for k, v in p["values"].items()
                 if step > self.seen.get(k, -1)]
        for i in range(0, len(batch), 1000):
            self.c.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def _end(self, p: dict) -> None:
        for path in p["artifacts"]:
            if Path(path).is_file():
                self.c.log_artifact(self.run_id, path)
        self.c.set_terminated(self.run_id, p["status"])


class MlflowStage:
    """The stage's tracker on rank 0: operations queued, sent by a background thread."""

    def __init__(self, cfg: Config, stage: str, offset: int, key: str, resumed: bool,
                 params: dict):
        self.cfg, self.stage, self.offset, self.resumed = cfg, stage, offset, resumed
        self.artifacts: list[str] = []  # files sent with the end (stage_end)
        folder = cfg.stage_dir(stage)
        if not resumed:  # a fresh start: what an older attempt could not send is dropped,
            (folder / UNSENT).unlink(missing_ok=True)  # as its metrics.jsonl lines are
        self.sink = StageSink(cfg, stage, folder / UNSENT)
        self.q: queue.Queue = queue.Queue()
        self.q.put(["open", {"key": key, "resume": resumed, "params": params}])
        self.thread = threading.Thread(target=self._run, name="ddpflow-mlflow", daemon=True)

    def _started(self) -> queue.Queue:
        """The sender starts with the first record (after the first step): importing mlflow
        (seconds of Python) would otherwise compete with the start-up for the GIL."""
        if self.thread.ident is None:
            self.thread.start()
        return self.q

    def _run(self) -> None:
        if self.resumed:  # the attempt this one resumes comes first, in its own run
            try:
                send_unsent(self.cfg, self.stage)
            except Exception as e:  # noqa: BLE001 - a tracker never fails training
                warn(f"MLflow: the earlier attempt's unsent metrics stay unsent ({e})")
        while (op := self.q.get()) is not None:
            self.sink.apply(op)

    def record(self, rec: dict) -> None:
        from ddpflow.tracking.records import scalars

        values = scalars(rec)
        if values:
            self._started().put(["metrics", {"step": self.offset + int(rec.get("step", 0)),
                                    "ts": int(time.time() * 1000), "values": values}])

    def stage_end(self, config: dict, final_metrics: dict, artifacts: list) -> None:
        self.artifacts = [str(a) for a in artifacts]

    def close(self, status: str) -> None:
        self._started().put(["end", {"artifacts": self.artifacts, "status": status}])
        self.q.put(None)
        self.thread.join()


def send_unsent(cfg: Config, stage: str) -> bool:
    """Send what a stage kept while the server was away; True when nothing is left."""
    path = cfg.stage_dir(stage) / UNSENT
    if not path.is_file():
        return True
    try:  # a last line cut short by a kill is skipped; other bad lines are counted
        ops, bad = reading.read_jsonl(path, UNSENT_LINE_SCHEMA, "unsent MLflow log")
    except UserError as e:  # too big, not UTF-8, ...: kept for a look, never sent
        warn(f"{e}; it is not sent")
        return False
    if bad:
        warn(f"{path}: {len(bad)} unreadable or malformed line(s) skipped (not as ddpflow writes "
             f"them)")
    retry = path.with_name(UNSENT + ".retry")
    retry.unlink(missing_ok=True)
    sink = StageSink(cfg, stage, retry)
    if ops and ops[0][0] != "open":  # the run exists: continue it
        ops.insert(0, ["open", {"key": _saved(sink.folder).get("key"), "resume": True}])
    for op in ops:
        sink.apply(op)
    if sink.failed is None:
        path.unlink()
        return True
    move_into_place(retry, path, "the unsent MLflow log")
    return False


def log_headline(c, run_id: str, params: dict, metrics: dict, config_hash: str) -> None:
    """The workflow's run gets its own params (the resolved config) and headline metrics, so
    MLflow's run list compares runs by them. A param is written once (MLflow refuses a
    changed value; the stages' runs hold each attempt's own); the tag names the config."""
    from mlflow.entities import Metric, Param

    have = c.get_run(run_id).data.params
    new = [Param(k, str(v)[:6000]) for k, v in params.items() if k not in have]
    for i in range(0, len(new), 100):  # MLflow takes 100 params per batch
        c.log_batch(run_id, params=new[i:i + 100])
    ts = int(time.time() * 1000)
    values = [Metric(k, float(v), ts, 0) for k, v in metrics.items()
              if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if values:
        c.log_batch(run_id, metrics=values)
    c.set_tag(run_id, "ddpflow.config_hash", config_hash)


def finish_workflow_run(cfg: Config, artifacts: list[Path], sweep: bool = False,
                        params: dict | None = None, metrics: dict | None = None) -> None:
    """collect's part (or the leaderboard's, for a sweep's run): send what stages kept, add
    the report files, the run's params and headline metrics to the run and mark it
    finished. Warns, never raises."""
    uri = cfg.tracking.mlflow.uri
    if not uri:
        return
    if not available():
        warn("tracking.mlflow.uri is set but mlflow is not installed here: the report is not "
             "logged (pip install 'ddpflow[mlflow]')")
        return
    try:
        sent = sweep or all([send_unsent(cfg, stage.name) for stage in cfg.stages])
        c = client(uri)
        exp = experiment_id(c, cfg.tracking.mlflow.experiment)
        run_id = (ensure_run(c, exp, cfg.run_dir, cfg.run, None, uri) if sweep
                  else workflow_run(c, cfg, exp))
        log_headline(c, run_id, params or {}, metrics or {}, cfg.hash)
        for path in artifacts:
            if path.is_dir():
                c.log_artifacts(run_id, str(path), artifact_path=path.name)
            elif path.is_file():
                c.log_artifact(run_id, str(path))
        c.set_terminated(run_id, "FINISHED")
        print(f"ddpflow: MLflow: logged to run {run_id} at {uri}"
              + ("" if sent else " (some stage metrics are still unsent)"), file=sys.stderr)
    except Exception as e:  # noqa: BLE001 - the report is on disk whatever MLflow says
        warn(f"MLflow at {uri} could not log the report ({type(e).__name__}: "
             f"{str(e).splitlines()[0][:300]}); run `ddpflow collect` again when it is "
             f"reachable")
