"""`ddpflow tune` on the launcher's side: check the stage and its data, then one torchrun
whose ranks measure together (engine/tune.py); the choice lands in <run>/tune.json."""

from __future__ import annotations

import sys

from ddpflow.config import Config
from ddpflow.core import locks, quoting, reading
from ddpflow.core.errors import UserError
from ddpflow.core.writing import remove_scratch, write_json_atomic
from ddpflow.data import prepared
from ddpflow.data.prepare import check_settings
from ddpflow.engine.tune import STOPPED
from ddpflow.launch.launcher import _read_json, plan
from ddpflow.launch.procs import run_torchrun
from ddpflow.launch.rankerror import Reports
from ddpflow.launch.slurmnodes import check_slurm_gpus, missing_nodes_text, roll_call_dir

STOPPED_SCHEMA = {"type": "object", "required": ["signal"],
                  "properties": {"signal": {"type": "string"}}}


def tune(cfg: Config, stage: str | None, memory_cap_mb: str | None) -> int:
    """`ddpflow tune`: one torchrun whose ranks measure together; writes <run>/tune.json."""
    stage = stage or cfg.tune.stage or cfg.stages[0].name
    cfg.stage(stage)
    check_slurm_gpus(cfg)
    meta = prepared.read_meta(cfg.data_dir)
    if meta is None:
        raise UserError(f"no prepared data at {cfg.data_dir}; run `ddpflow prepare` first")
    check_settings(cfg, meta)
    if meta.get("kind") == "python" or cfg.task.name != "classification":
        raise UserError("ddpflow tune measures the prepared image data with the classification "
                        "task; with data.source python (without data.materialize) or another "
                        "task, set batch_size and precision in the stage instead of auto")
    out = cfg.run_dir / "tune"
    resolved = out / "config.json"
    extra = [f"--memory-cap-mb={memory_cap_mb}"] if memory_cap_mb else []
    cmd, env = plan(cfg, stage, resolved, extra, command="tune-rank")
    print(f"ddpflow: tuning for stage '{stage}': {quoting.shell_line(cmd)}", file=sys.stderr)
    with locks.exclusive(out / ".lock", f"tuning of run '{cfg.run}' ({out})"), \
            Reports(out) as reports:  # a mistake inside a rank (rankerror.py)
        out.mkdir(parents=True, exist_ok=True)
        (out / STOPPED).unlink(missing_ok=True)
        remove_scratch(roll_call_dir(resolved))
        write_json_atomic(resolved, cfg.to_dict())
        rc, stop = run_torchrun(cmd, {**env, **reports.env}, watch=reports)
        if reports.message():
            raise UserError(reports.message())
        # a signal to a rank alone (not through this launcher): the ranks stopped all the same
        stop = stop or (_read_json(out / STOPPED, STOPPED_SCHEMA) or {}).get("signal")
    result = cfg.run_dir / "tune.json"
    if stop:  # the ranks stopped at the same candidate and wrote nothing
        kept = f"the earlier {result} is kept" if result.is_file() else "no tune.json written"
        print(f"ddpflow: tuning stopped by {stop}; {kept}: run `ddpflow tune` again to "
              f"measure", file=sys.stderr)
        return 130 if stop == "SIGINT" else 143
    if rc != 0 or not result.is_file():
        why = (rc and missing_nodes_text(cfg, out)) or f"torchrun exited with {rc}"
        print(f"ddpflow: error: tuning failed ({why})", file=sys.stderr)
        return rc or 1
    from ddpflow.engine.settings import TUNE_SCHEMA

    choice = reading.read_json(result, TUNE_SCHEMA, "ddpflow tune's result",
                               "run `ddpflow tune` again")["choice"]
    print(f"ddpflow: tuned -> {result}: " + ", ".join(f"{k} {v}" for k, v in choice.items()),
          file=sys.stderr)
    return 0
