"""The one exception type for mistakes a user can fix (bad config, missing data, ...).

The CLI prints its message on one line and exits non-zero, without a traceback.
Anything else that escapes is a bug in ddpflow and keeps its traceback.
"""

import signal
from contextlib import contextmanager


class UserError(Exception):
    """A problem in the user's input; the message says what is wrong and what to do."""

    exit_code = 2


class OneRankError(UserError):
    """A mistake that one rank alone finds (a bad item in its share of the data) while its
    peers go on into a collective with it. Once it is reported, the rank waits to be stopped
    with the others (launch/rankerror.report) instead of leaving: its peers would
    otherwise fail first on the closed connection, each with a traceback."""


class Stopped(BaseException):
    """SIGTERM (what Slurm, Snakemake and `kill` send) during a one-process command, raised
    from its handler so that the command cleans up as it does for Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextmanager
def stop_raises():
    """SIGTERM raises Stopped inside the block (otherwise it ends the process at once, with
    no message and no clean-up)."""
    def stop(signum, _frame):
        raise Stopped(signum)

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def short(value, limit: int = 80) -> str:
    """repr() capped: a message never prints a whole huge value."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 5] + " ..."


NONDETERMINISTIC = " does not have a deterministic implementation"  # torch's alert


def nondeterministic(e: BaseException, model_name: str) -> UserError | None:
    """deterministic: true and a kernel without a deterministic version (most are CUDA
    backward kernels: adaptive pooling, index_add, scatter_add, interpolation): torch raises
    a RuntimeError at the op's first call, that is in the first step, before any weight
    changed. As a UserError naming the op; None for any other error."""
    if not isinstance(e, RuntimeError) or NONDETERMINISTIC not in str(e):
        return None
    op = str(e).split(NONDETERMINISTIC)[0].strip().split()[-1]
    return UserError(f"deterministic: true, but model {model_name} runs {op}, which has no "
                     f"deterministic kernel on this device; set deterministic: false "
                     f"(results then vary slightly from run to run), or replace the layer "
                     f"that calls it")
