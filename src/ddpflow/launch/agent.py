"""torchrun's agent, warmed up: `ddpflow launch` starts this process first thing, so its
`import torch` (seconds) runs while the launcher loads and checks the config; then it
runs `python -m torch.distributed.run` with the arguments and environment the launcher
sends through a pipe. Nothing arrives when the launcher finds a mistake or needs no
agent: then it exits at once, having started nothing."""

from __future__ import annotations

import json
import os
import sys


def main(fd: int) -> int:
    from torch.distributed.run import main as torchrun  # the slow part, done ahead

    with os.fdopen(fd, "rb") as f:
        job = f.read()
    if not job:
        return 0
    job = json.loads(job)
    os.environ.clear()
    os.environ.update(job["env"])
    sys.argv = ["torchrun", *job["args"]]
    torchrun(job["args"])  # as `python -m torch.distributed.run ARGS` would
    return 0


if __name__ == "__main__":
    rc = main(int(sys.argv[1]))  # a failed group raises, as torchrun does, and exits slowly
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # skip a second of tearing torch's modules down (see cli.entry)
