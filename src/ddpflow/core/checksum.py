"""A file's SHA-256 and the check against the `<file>.sha256` written beside it.

Apart from checkpoint.py so that what only reads and compares files (collect, provenance,
the image's inputs) does not import torch: a few seconds per workflow job.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def verify(path: Path) -> str | None:
    """None if the file matches its recorded SHA-256, else the reason it does not."""
    side = Path(str(path) + ".sha256")
    if not side.is_file():
        return "no checksum file (the write did not finish)"
    try:
        recorded = side.read_text(errors="replace").split()  # "<sha256>  <name>"
        if not recorded or sha256_of(path) != recorded[0]:  # empty if cut short
            return "checksum mismatch (truncated or corrupt)"
    except OSError as e:  # a folder in its place, unreadable: not a checkpoint to trust
        return f"cannot be read ({e.strerror or type(e).__name__})"
    return None
