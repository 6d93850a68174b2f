"""pytest plugin of the mutation runner (tests/mutation/mutate.py loads it with -p).

    --mutate-record DIR   (with DDPFLOW_MUTANT_RECORD=DIR in the environment of pytest) name
                          each test to the switch, so that the sites it reaches, in this
                          process and in every process it starts, are written under DIR;
                          each test's duration goes to DIR/durations-<pid>.json
    --mutate-serve PLAN   run the mutants of PLAN (JSON: jobs, mutants [{id, tests, timeout}],
                          out, deadline: epoch seconds after which no mutant starts) instead
                          of the session: the tests are collected once, then a
                          forked process per mutant switches it on and runs its tests in
                          order, stopping at the first failure; results are appended to out
                          as JSON lines {id, outcome, by, why, seconds}

A forked process does not start from a fresh interpreter, so it must not inherit an OpenMP
thread pool (libgomp's pool does not survive fork: the child hangs at its first parallel op):
the serving process runs torch on one thread, each child gets the default number back.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest


def pytest_addoption(parser):
    g = parser.getgroup("mutate")
    g.addoption("--mutate-record", metavar="DIR", help="record the sites each test reaches")
    g.addoption("--mutate-serve", metavar="PLAN", help="run the mutants of PLAN")


def _switch():
    import _ddpflow_mutant  # the copy's switch (PYTHONPATH puts it first)

    return _ddpflow_mutant


class Recorder:
    def __init__(self, folder: Path):
        self.folder = folder
        self.durations: dict[str, float] = {}
        self.failed: set[str] = set()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        os.environ["DDPFLOW_MUTANT_TEST"] = item.nodeid
        _switch().TEST = item.nodeid

    def pytest_runtest_logreport(self, report):
        self.durations[report.nodeid] = self.durations.get(report.nodeid, 0.0) \
            + report.duration
        if report.failed:  # a test that fails unmutated cannot tell a mutant apart
            self.failed.add(report.nodeid)

    def pytest_sessionfinish(self):
        out = self.folder / f"durations-{os.getpid()}.json"
        out.write_text(json.dumps({"durations": self.durations,
                                   "failed": sorted(self.failed)}))


class Server:
    """The fork server: one collection, a child per mutant, `jobs` children at a time."""

    def __init__(self, config, plan_path: Path):
        self.config = config
        self.plan = json.loads(Path(plan_path).read_text())
        self.threads = 1
        try:
            import torch

            self.threads = torch.get_num_threads()
            torch.set_num_threads(1)  # no OpenMP pool in the parent (see the docstring)
        except ImportError:
            pass

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session):
        items = {item.nodeid: item for item in session.items}
        # a mutant may signal the wrong process (a pid off by one, its parent): the server
        # outlives it, and each child starts with the handlers the tests expect
        self.signals = {s: signal.signal(s, signal.SIG_IGN) for s in SERVER_IGNORES}
        out = open(self.plan["out"], "a", buffering=1)
        todo = list(self.plan["mutants"])
        jobs = max(1, int(self.plan.get("jobs", 1)))
        deadline = self.plan.get("deadline")  # epoch seconds: no new mutant after it
        running: dict[int, tuple] = {}
        try:
            while todo or running:
                if deadline is not None and time.time() > deadline:
                    todo = []  # the rest is not run (the caller sees them missing)
                while todo and len(running) < jobs:
                    m = todo.pop(0)
                    chosen = [items[t] for t in m["tests"] if t in items]
                    missing = [t for t in m["tests"] if t not in items]
                    if not chosen:
                        out.write(json.dumps({"id": m["id"], "outcome": "error", "by": None,
                                              "why": f"no such tests: {missing[:3]}",
                                              "seconds": 0.0}) + "\n")
                        continue
                    tmp = Path(tempfile.mkdtemp(prefix=f"mutant-{m['id']}-"))
                    pid = os.fork()
                    if pid == 0:
                        self._child(m["id"], chosen, tmp)  # never returns
                    running[pid] = (m, time.monotonic(), tmp)
                self._reap(running, out)
                time.sleep(0.05)
        finally:
            for pid in running:
                _kill_group(pid)
            out.close()
        return True

    def _reap(self, running, out):
        now = time.monotonic()
        for pid, (m, t0, tmp) in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done and now - t0 < m["timeout"]:
                continue
            if not done:  # a timeout is not a kill: the mutant may only be slow
                _kill_group(pid)
                os.waitpid(pid, 0)
                result = {"outcome": "timeout", "by": None, "why": f"> {m['timeout']} s"}
            else:
                _kill_group(pid)  # whatever the tests left running in its session
                result = _read_result(tmp, status)
            result = {"id": m["id"], **result, "seconds": round(now - t0, 2)}
            out.write(json.dumps(result) + "\n")
            shutil.rmtree(tmp, ignore_errors=True)
            del running[pid]

    def _child(self, mid: int, chosen: list, tmp: Path):
        code = 3
        try:
            from _pytest.runner import runtestprotocol

            os.setsid()
            for s, handler in self.signals.items():
                signal.signal(s, handler)
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 0)
            os.dup2(null, 1)
            os.dup2(null, 2)
            switch = _switch()
            switch.ACTIVE = mid
            os.environ["DDPFLOW_MUTANT"] = str(mid)
            try:
                import torch

                torch.set_num_threads(self.threads)
            except ImportError:
                pass
            factory = self.config._tmp_path_factory
            factory._basetemp = None
            factory._given_basetemp = tmp / "basetemp"
            result = {"outcome": "survived", "by": None, "why": None}
            for i, item in enumerate(chosen):
                nxt = chosen[i + 1] if i + 1 < len(chosen) else None
                reports = runtestprotocol(item, nextitem=nxt, log=False)
                failed = [r for r in reports if r.failed]
                if failed:
                    text = failed[0].longreprtext.strip().splitlines()
                    why = next((ln for ln in reversed(text) if ln.startswith("E ")),
                               text[-1] if text else "")
                    result = {"outcome": "killed", "by": item.nodeid, "why": why[:300]}
                    break
            (tmp / "result.json").write_text(json.dumps(result))
            code = 0
        finally:
            os._exit(code)


SERVER_IGNORES = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_result(tmp: Path, status: int) -> dict:
    try:
        return json.loads((tmp / "result.json").read_text())
    except (OSError, ValueError):  # the mutant ended the test process itself (a crash, an
        # exit, a signal): the test run fails, as it would under plain pytest
        return {"outcome": "killed", "by": "(the test process)", "why": f"the test process "
                f"ended with status {status} before its tests did"}


def pytest_configure(config):
    record = config.getoption("--mutate-record")
    serve = config.getoption("--mutate-serve")
    if record:
        config.pluginmanager.register(Recorder(Path(record)), "mutate-recorder")
    if serve:
        config.pluginmanager.register(Server(config, Path(serve)), "mutate-server")
