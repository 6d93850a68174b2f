"""A rank's stop flag: SIGTERM and SIGUSR1 only set it (saving inside a signal handler can
deadlock); the training loop reads it where the ranks agree on stopping. Installed first
thing in a rank, before the heavy imports, so that a signal during start-up is not lost."""

from __future__ import annotations

import signal

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_received: list[str] = []


def _on_signal(signum, _frame) -> None:
    _received.append(signal.Signals(signum).name)


def install() -> None:
    for s in PREEMPT_SIGNALS:
        signal.signal(s, _on_signal)


def received() -> str | None:
    """The first stop signal this rank received, or None."""
    return _received[0] if _received else None
