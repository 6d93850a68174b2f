"""Weights & Biases runs (`tracking.wandb: {project, entity, checkpoints}`): one run per stage,
grouped by the workflow run (a sweep's trials by the sweep), the stage as its job type.

The run's id is kept in `wandb.json` in the stage folder with the resume key and the last
step the run was given: a resumed stage (a requeue, a restart, a stop at a checkpoint)
continues the same run (`resume="allow"`) and logs only what comes after that step, so no
step is logged twice (a hard kill loses what wandb's service had not yet written: a gap,
never a step twice); a stage that starts afresh gets a new run. With `WANDB_MODE=offline`
the run is written under `<run>/wandb/` (or WANDB_DIR), an attempt a folder, each with the
run's id, for `wandb sync` to upload later.

Rank 0 sends through a background thread, opened with the first record (importing wandb and
starting its service take seconds): the resolved config, every metrics line (the records
metrics.jsonl gets, at the run-wide steps TensorBoard and MLflow use), at the end
summary.json's values as the run's summary, summary.json and metrics.jsonl as files and,
with `checkpoints: true`, final.pt, best.pt and the kept checkpoints as a model artifact;
then the run's end: finished, preempted (stopped at a checkpoint) or failed.

A missing package, a WANDB_MODE wandb refuses, a folder that cannot be written and, online,
a server that does not answer are one message before any rank starts (`check`). A failure
in the middle of a stage never fails it: one warning, and the run goes on offline, on disk.
"""

from __future__ import annotations

import os
import queue
import secrets
import shutil
import socket
import sys
import threading
from pathlib import Path
from urllib.parse import urlsplit

from ddpflow.config import Config
from ddpflow.core import reading
from ddpflow.core.errors import UserError
from ddpflow.core.writing import write_json_atomic
from ddpflow.tracking.records import scalars

RUN_FILE = "wandb.json"
ANSWER_S = 5.0  # seconds a W&B server has to accept a connection at the check
INIT_TIMEOUT_S = 60  # seconds wandb.init may take in a stage (WANDB_INIT_TIMEOUT wins)
EXIT_CODES = {"FINISHED": 0, "KILLED": 75, "FAILED": 1}  # 75: launch's "stopped" code
_TEXT = {"type": ["string", "null"]}
RUN_SCHEMA = {"type": "object", "required": ["id"], "properties": {
    "id": {"type": "string", "pattern": "^[a-z0-9]{1,64}$"}, "key": _TEXT, "project": _TEXT,
    "entity": _TEXT, "last_step": {"type": "integer"},
    "last_kinds": {"type": "array", "items": {"type": "string"}}}}


def warn(text: str) -> None:
    print(f"ddpflow: warning: {text}", file=sys.stderr, flush=True)


def available() -> bool:
    """Whether wandb can be imported here (without importing it: that takes seconds)."""
    import importlib.util

    try:
        return importlib.util.find_spec("wandb") is not None
    except (ImportError, ValueError):
        return False


def folder_of(cfg: Config) -> Path:
    """Where wandb writes its runs: WANDB_DIR, else the workflow run's folder."""
    return Path(os.environ.get("WANDB_DIR") or cfg.run_dir)


def settings() -> tuple[str, str]:
    """(mode, base URL) as the installed wandb reads this process's environment: a value it
    refuses (WANDB_MODE=bogus) is one UserError."""
    import wandb

    s = wandb.Settings()
    if not hasattr(s, "update_from_env_vars"):  # wandb before 0.19: the variables as set
        return (os.environ.get("WANDB_MODE") or "online",
                os.environ.get("WANDB_BASE_URL") or s.base_url)
    try:
        s.update_from_env_vars(dict(os.environ))
    except Exception as e:  # noqa: BLE001 - pydantic's error: the value named in its text
        said = [ln.split("[type=")[0].strip() for ln in str(e).splitlines()[1:]
                if ln.strip() and not ln.strip().startswith("For further")]
        raise UserError(f"tracking.wandb: the installed wandb refuses this environment "
                        f"({': '.join(said)[:200] or type(e).__name__}); set WANDB_MODE to "
                        f"online or offline") from None
    return s.mode, s.base_url


def check(cfg: Config) -> None:
    """Before any rank starts: wandb installed, its environment valid, the folder it
    writes in writable and, online, its server answering. Each is one UserError."""
    w = cfg.tracking.wandb
    if not w.project:
        return
    if not available():
        raise UserError("tracking.wandb.project is set but the wandb package is not "
                        "installed; pip install 'ddpflow[wandb]' (or set "
                        "tracking.wandb.project: null)")
    mode, url = settings()
    check_folder(folder_of(cfg))
    if mode in ("online", "run"):
        check_server(url)


def check_folder(folder: Path) -> None:
    """The folder wandb writes in can be written: it, or the nearest folder above it that
    exists (nothing is made here; a probe file is made and removed)."""
    where = "WANDB_DIR" if os.environ.get("WANDB_DIR") else "the run folder"
    place = Path(folder)
    while not os.path.lexists(place) and place != place.parent:
        place = place.parent
    try:
        if not place.is_dir():
            raise NotADirectoryError(20, "a file is where a folder belongs")
        probe = place / f".ddpflow-wandb-{secrets.token_hex(3)}"
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        probe.unlink()
    except OSError as e:
        raise UserError(f"tracking.wandb: W&B cannot write its run files in {where} {folder} "
                        f"({place}: {e.strerror or e}); set WANDB_DIR to a folder you can "
                        f"write") from None


def check_server(url: str) -> None:
    """Online: the server at `url` accepts a connection within ANSWER_S seconds."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname or "", port), timeout=ANSWER_S):
            return
    except OSError as e:
        raise UserError(f"tracking.wandb: the W&B server at {url} does not answer "
                        f"({e.strerror or type(e).__name__}); check WANDB_BASE_URL and the "
                        f"network, or set WANDB_MODE=offline to keep the run on disk and "
                        f"upload it later with `wandb sync`") from None


def sweep_name(cfg: Config) -> str | None:
    from ddpflow.tracking.mlflowrun import sweep_root

    root = sweep_root(cfg)
    return root.name if root is not None else None


class WandbStage:
    """The stage's W&B run on rank 0: operations queued, sent by a background thread."""

    def __init__(self, cfg: Config, stage: str, offset: int, key: str, resumed: bool,
                 config: dict):
        self.cfg, self.stage, self.offset, self.key = cfg, stage, offset, key
        self.resumed, self.config = resumed, config
        self.file = cfg.stage_dir(stage) / RUN_FILE
        self.run, self.id, self.failed = None, None, False
        self.last, self.kinds = -1, set()  # the last step given to the run, and its records
        self.end: dict = {"artifacts": []}
        self.q: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="ddpflow-wandb", daemon=True)

    def _started(self) -> queue.Queue:
        if self.thread.ident is None:
            self.thread.start()
        return self.q

    def _run(self) -> None:
        while (op := self.q.get()) is not None:
            if self.failed:
                continue
            try:
                if self.run is None:
                    self.open()
                getattr(self, "_" + op[0])(op[1])
            except Exception as e:  # noqa: BLE001 - a tracker never fails training
                self.failed = True
                warn(f"W&B could not log stage {self.stage} ({type(e).__name__}: "
                     f"{str(e).splitlines()[0][:300] if str(e) else ''}); its run stops here")

    def open(self) -> None:
        """The run: the kept one when this stage resumes it, else a new one; online, a
        server that fails makes it an offline run (one warning)."""
        w = self.cfg.tracking.wandb
        saved = reading.read_json_or_none(self.file, RUN_SCHEMA, "W&B run record") or {}
        same = (self.resumed and saved.get("key") == self.key
                and saved.get("project") == w.project and saved.get("entity") == w.entity)
        self.id = saved["id"] if same else secrets.token_hex(4)
        if same:
            self.last = saved.get("last_step", -1)
            self.kinds = set(saved.get("last_kinds", []))
        try:
            self.run = self._init(None)
        except Exception as e:  # noqa: BLE001 - the server away, a login missing
            warn(f"W&B did not open the run of stage {self.stage} ({type(e).__name__}: "
                 f"{str(e).splitlines()[0][:300] if str(e) else ''}); it is kept offline in "
                 f"{folder_of(self.cfg) / 'wandb'} for `wandb sync`")
            import wandb

            wandb.teardown()  # its service still holds the run's id after the failed init
            self.run = self._init("offline")
        self.keep()

    def _init(self, mode: str | None):
        import wandb

        w, sweep = self.cfg.tracking.wandb, sweep_name(self.cfg)
        extra = {} if os.environ.get("WANDB_INIT_TIMEOUT") else {"init_timeout": INIT_TIMEOUT_S}
        folder = folder_of(self.cfg)
        folder.mkdir(parents=True, exist_ok=True)
        return wandb.init(
            project=w.project, entity=w.entity, id=self.id, resume="allow", mode=mode,
            group=sweep or self.cfg.run, job_type=self.stage,
            name=f"{self.cfg.run}/{self.stage}" if sweep else self.stage,
            config=self.config, dir=str(folder),
            settings=wandb.Settings(console="off", silent=True, **extra))

    def keep(self) -> None:
        write_json_atomic(self.file, {"id": self.id, "key": self.key,
                                      "project": self.cfg.tracking.wandb.project,
                                      "entity": self.cfg.tracking.wandb.entity,
                                      "last_step": self.last, "last_kinds": sorted(self.kinds)})

    def _log(self, p: dict) -> None:
        """One metrics line, unless the run has it (a resumed stage trains again the steps
        after its checkpoint: those the run was given before are not logged twice)."""
        step, kind = p["step"], p["kind"]
        if step < self.last or (step == self.last and kind in self.kinds):
            return
        self.run.log(p["values"], step=step)
        self.kinds = self.kinds | {kind} if step == self.last else {kind}
        self.last = step
        self.keep()

    def _end(self, p: dict) -> None:
        self.run.summary.update(p["summary"])
        for path in map(Path, p["files"]):  # a copy in the run's files: as it is now
            if path.is_file():
                shutil.copyfile(path, Path(self.run.dir) / path.name)
                self.run.save(str(Path(self.run.dir) / path.name), base_path=self.run.dir,
                              policy="now")
        if p["artifacts"]:
            import wandb

            art = wandb.Artifact(f"{self.cfg.run}-{self.stage}", type="model")
            for path in map(Path, p["artifacts"]):
                (art.add_dir(str(path), name=path.name) if path.is_dir()
                 else art.add_file(str(path)))
            self.run.log_artifact(art)
        if p["status"] == "KILLED":
            self.run.mark_preempting()
        self.run.finish(exit_code=EXIT_CODES.get(p["status"], 1))

    def record(self, rec: dict) -> None:
        values = scalars(rec)
        if values:
            self._started().put(["log", {"step": self.offset + int(rec.get("step", 0)),
                                         "kind": str(rec.get("kind")),
                                         "values": {**values, **({"epoch": rec["epoch"]} if
                                                    isinstance(rec.get("epoch"), int) else {})}}])

    def stage_end(self, config: dict, final_metrics: dict, artifacts: list) -> None:
        """The finished stage: its summary values (summary.json) and files."""
        files = [Path(a) for a in artifacts]
        summary = reading.read_json_or_none(files[0], {"type": "object"}, "stage summary") \
            if files else None
        self.end = {"summary": {**{k: v for k, v in (summary or {}).items() if isinstance(
            v, (int, float, str, bool))}, **final_metrics}, "files": [str(f) for f in files]}

    def close(self, status: str) -> None:
        out = self.cfg.stage_dir(self.stage)
        weights = []
        if self.cfg.tracking.wandb.checkpoints:
            weights = [p for p in (out / "final.pt", out / "best.pt") if p.is_file()] + sorted(
                (out / "checkpoints").glob("ckpt-*"))
        self._started().put(["end", {"summary": self.end.get("summary", {}),
                                     "files": self.end.get("files", []),
                                     "artifacts": [str(p) for p in weights],
                                     "status": status}])
        self.q.put(None)
        self.thread.join()
