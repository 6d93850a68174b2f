"""What a result was made from, and whether it still matches the config.

Every stage output (summary.json, final.pt, best.pt, each checkpoint) carries a *record*:
the stage hash (the config up to that stage), the package code's fingerprint, the prepared
data's fingerprint and the SHA-256 of the starting weights. Before anything trusts an output
(`launch` of a later stage, `launch` deciding a stage is already done, `collect`), the
record is compared with what the current config, code, data and weights would record.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from ddpflow.config import Config, code_fingerprint
from ddpflow.core.checksum import sha256_of
from ddpflow.core.errors import UserError
from ddpflow.data import prepared
from ddpflow.results.summary import read_summary
from ddpflow.seams.pretrained import pretrained_file
from ddpflow.seams.userimport import dir_fingerprint

# record key -> what a mismatch means, in the words the user reads
REASONS = {"stage_hash": "made with another config", "code": "made by other ddpflow code",
           "user_code": "made by other code of yours (model.code_dir)",
           "data": "made from other prepared data", "init_sha256": "started from other weights"}


def init_source(cfg: Config, stage: str) -> Path | None:
    """The weights a stage starts from: the previous stage's final.pt, a file, model.weights
    (stages without init_from), or None."""
    st = cfg.stage(stage)
    if st.init_from == "previous":
        return cfg.stage_dir(cfg.stages[cfg.stage_index(stage) - 1].name) / "final.pt"
    if st.init_from:
        return Path(st.init_from)
    return pretrained_file(cfg)


def make_record(cfg: Config, stage: str, data_fingerprint: str | None,
                init_sha256: str | None) -> dict:
    return {"stage_hash": cfg.stage_hash(stage), "code": code_fingerprint(),
            "user_code": dir_fingerprint(cfg.model.code_dir),
            "data": data_fingerprint, "init_sha256": init_sha256}


def expected_record(cfg: Config, stage: str) -> dict:
    """The record a run of `stage` would write now (damaged prepared data: no fingerprint,
    so the stage shows as stale; the commands that read the data say what is wrong)."""
    meta = prepared.read_meta(cfg.data_dir, damaged_ok=True)
    try:
        src = init_source(cfg, stage)
    except UserError:  # pretrained weights missing from the hub cache
        src = None
    sha = sha256_of(src) if src is not None and src.is_file() else None
    return make_record(cfg, stage, meta.get("fingerprint") if meta else None, sha)


def stale_reason(recorded, expected: dict) -> str | None:
    """None when the recorded inputs are the expected ones, else why not."""
    if not isinstance(recorded, dict):
        return "stale: no record of what it was made from (an older ddpflow)"
    for key, why in REASONS.items():
        if recorded.get(key) != expected.get(key):
            return f"stale: {why}"
    return None


def stage_result(cfg: Config, stage: str) -> tuple[dict | None, str | None]:
    """(finished summary or None, None if it is fresh else the reason it is stale)."""
    folder = cfg.stage_dir(stage)
    s = read_summary(folder / "summary.json", damaged_ok=True)  # damaged: run it again
    if s is None:
        return None, None
    reason = stale_reason(s.get("record"), expected_record(cfg, stage))
    if reason is None:
        final = folder / "final.pt"
        if not final.is_file():
            reason = "stale: final.pt is missing"
        elif s.get("final_sha256") != sha256_of(final):
            reason = "stale: final.pt was replaced after the stage finished"
    return s, reason


def git_revision(repo: Path) -> str:
    """The git commit of `repo` (the project a run was started from), or "unknown"."""
    try:
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        # (a repository without a commit prints "HEAD" and fails: no revision either)
        return (out.stdout.strip() or "unknown") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
