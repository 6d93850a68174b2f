"""The switch a mutated copy of ddpflow calls at each site (installed as `_ddpflow_mutant`
beside the copy's package; tests/mutation/schemata.py writes the calls).

    DDPFLOW_MUTANT=N          the mutant that is on in this process and every process it
                              starts (0 or unset: none, the original code runs)
    DDPFLOW_MUTANT_RECORD=DIR record which sites each test reaches: every process appends
                              "<test>\\t<site>" once per pair to DIR/<pid>.hits
    DDPFLOW_MUTANT_TEST=ID    the test a process belongs to (set by tests/mutation/plugin.py
                              for each test, inherited by what the test starts)

A forked test process sets ACTIVE (and the environment) itself: the switch reads ACTIVE at
each call, never at import only.
"""

import os

ACTIVE = int(os.environ.get("DDPFLOW_MUTANT") or 0)
TEST = os.environ.get("DDPFLOW_MUTANT_TEST", "")
_RECORD = os.environ.get("DDPFLOW_MUTANT_RECORD")
_seen: set = set()
_fd: list = []


def _note(site: int) -> None:
    key = (TEST, site)
    if key in _seen:
        return
    _seen.add(key)
    if not _fd:
        _fd.append(os.open(os.path.join(_RECORD, f"{os.getpid()}.hits"),
                           os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))
    os.write(_fd[0], f"{TEST}\t{site}\n".encode())


if _RECORD:
    def hit(site: int) -> bool:
        _note(site)
        return site == ACTIVE
else:
    def hit(site: int) -> bool:
        return site == ACTIVE
