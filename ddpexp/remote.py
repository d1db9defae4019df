"""Jobs of a sweep that a Hydra launcher plugin runs in processes of their own (submitit: its local
executor or Slurm), seen from the command that submitted them.

A job that fails says so through Hydra (its task raises runner.JobFailed), and every job's own record
(metrics.json) says how it ended. A job whose process is killed outright (SIGKILL, the out-of-memory
killer, scancel) leaves submitit no result: submitit raises UncompletedJobError from that job's
`results()`, the launcher plugin stops collecting the other jobs there, and the command would end in
that traceback while they still run. `killed_jobs_fail` makes such a job a failed one, like any other:
every job is waited for, and the killed one is reported from its record (crashed: its process is gone,
see ddpexp/runrecord.py), or by its submitit job and log when it died before writing one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def killed_jobs_fail(failure: type[Exception]) -> Iterator[list[str]]:
    """Within the block, a submitit job that left no result is a failed Hydra job (its return value
    raises `failure`), not an UncompletedJobError; the list yielded gets one line per such job, naming
    it and its log."""
    killed: list[str] = []
    try:
        from submitit.core import core, utils
    except ImportError:  # no submitit: no job runs under it
        yield killed
        return
    results = core.Job.results

    def results_or_failure(job: Any) -> list[Any]:
        try:
            return results(job)
        except utils.UncompletedJobError:  # FailedJobError too: it died outside Hydra's own handling
            from hydra.core.utils import JobReturn, JobStatus

            line = f"submitit job {job.job_id} ended without a result (killed?); its log: {job.paths.stdout}"
            killed.append(line)
            return [JobReturn(status=JobStatus.FAILED, _return_value=failure(line))]

    core.Job.results = results_or_failure  # type: ignore[method-assign,assignment]
    try:
        yield killed
    finally:
        core.Job.results = results  # type: ignore[method-assign]
