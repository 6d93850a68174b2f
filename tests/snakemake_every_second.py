"""`snakemake` for the Slurm tests, with the Slurm executor looking at its jobs every second.

snakemake-executor-plugin-slurm waits 10 s longer after every status check that finds no job
finished (1, 11, 21, 31 s ...), whatever --seconds-between-status-checks says: sound for
jobs of hours, but a 13 s test job is then seen finished after 33 s, and the Slurm tests
spent most of their time waiting. Here the wait is reset to the initial one after each
check. Nothing else changes: the jobs, sbatch, sacct and Snakemake are the real ones.
"""

import sys

from snakemake.cli import main
from snakemake_executor_plugin_slurm import Executor

_check = Executor.check_active_jobs


async def _check_every_second(self, active_jobs):
    async for job in _check(self, active_jobs):
        yield job
    self.next_seconds_between_status_checks = self.workflow.executor_settings \
        .init_seconds_before_status_checks


Executor.check_active_jobs = _check_every_second

if __name__ == "__main__":
    sys.argv[0] = "snakemake"
    sys.exit(main())
