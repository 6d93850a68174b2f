"""The sweep's scheduler loop (sweeps/scheduler.py) where tests/test_scheduler_unit.py and
tests/test_sweep_run_unit.py leave it: a scheduler interrupted again while it stops its trials
(a second Ctrl-C) still returns only once every trial's job has ended, so the sweep's lock
(held by `schedule` around it) is never let go while a trial still trains. The trials run by a
runner that plays a trainer's job (no training). Fast.
"""

from __future__ import annotations

import threading
import time

import pytest

from conftest import tiny_config
from ddpflow.config import from_dict
from ddpflow.launch.launcher import EXIT_STOPPED

STAGE = [{"name": "s1", "epochs": 3, "batch_size": 32, "lr": 0.1}]


class Interrupted:
    """A runner (sweeps/runner.py's interface): Ctrl-C lands in the job of the trial with lr
    0.1 while the other trains; that one, once the scheduler stops it, takes a moment to write
    its checkpoint before it ends. A second Ctrl-C arrives as the scheduler stops its trials
    (Python raises it in the main thread, wherever it is)."""

    where = "the test"

    def __init__(self):
        self.told = threading.Event()
        self.ended: list[str] = []

    def preflight(self, cfg, log):
        pass

    def stop(self):
        self.told.set()
        raise KeyboardInterrupt  # the second Ctrl-C

    def run(self, cfg, words, log, gpus=True):
        words = [str(w) for w in words]
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("")
        if words[0] != "launch":
            return 0
        if "lr-0.1" in words[2]:
            raise KeyboardInterrupt
        assert self.told.wait(60)
        time.sleep(2.0)  # its checkpoint: a run() that did not wait would be long gone
        self.ended.append(words[2])
        return EXIT_STOPPED


def test_a_second_ctrl_c_while_stopping_still_waits_for_every_trials_job(tmp_path, capsys):
    from ddpflow.sweeps import plan as planning
    from ddpflow.sweeps.scheduler import Scheduler

    cfg = from_dict(tiny_config(tmp_path, stages=STAGE, hardware={"device": "cpu"}, sweep={
        "grid": {"stages.0.lr": [0.1, 0.2]}, "scheduler": "asha", "parallel": 2,
        "asha": {"min_epochs": 1, "eta": 3}}))
    s = Scheduler(cfg, planning.plan(cfg), cfg.run_dir / "logs" / "trials", "node")
    s.runner = s.job.runner = runner = Interrupted()
    with pytest.raises(KeyboardInterrupt):
        s.run()
    assert runner.told.is_set() and s.stopping is True
    assert len(runner.ended) == 1 and "lr-0.2" in runner.ended[0]  # ended before run() did
