"""Executors: run a batch of independent jobs locally (worker processes) or on Slurm (submitit).

A job is a plain picklable `Job(kind, key, args)`; `run_job` dispatches it to `study.jobs`. Every job
is idempotent (its outputs are files written atomically, found and reused on a rerun), so a killed
study is resumed by running the same batch again.

- `local`: a pool of `workers` spawned processes; the machine's cores are split evenly between them
  (torch threads per worker = cores // workers). workers=1 runs jobs in this process. The workers die
  with the study process, however it ends (prctl PDEATHSIG on Linux).
- `slurm`: submitit's AutoExecutor (one Slurm job per study job); `submitit-local` is submitit's local
  executor, which runs the same code path on this machine and is how the Slurm route is tested.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    kind: str  # "train" | "ptq" | "outliers"
    key: str  # unique within a study: the run id, or run id/scheme
    args: dict[str, Any] = field(default_factory=dict)


def run_job(job: Job) -> dict[str, Any]:
    from optquant.study import jobs

    return {"train": jobs.train_job, "ptq": jobs.ptq_job, "outliers": jobs.outliers_job}[job.kind](**job.args)


def die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux prctl PR_SET_PDEATHSIG), so a
    killed study (SIGKILL, SIGTERM, Ctrl-C) leaves no workers behind; elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the prctl: nobody would send the signal
        os._exit(1)


def _init_worker(threads: int, parent: int | None = None) -> None:
    import warnings

    if parent is not None:
        die_with_parent(parent)

    import torch

    warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight", category=UserWarning)

    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))


def _threads(workers: int) -> int:
    return max(1, (os.cpu_count() or 1) // workers)


def run_local(jobs: list[Job], workers: int) -> Iterator[tuple[Job, dict[str, Any]]]:
    """Yield (job, result) as jobs finish."""
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            yield job, run_job(job)
        return
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=get_context("spawn"),
                             initializer=_init_worker, initargs=(_threads(workers), os.getpid())) as pool:
        pending = {pool.submit(run_job, job): job for job in jobs}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                yield pending.pop(future), future.result()


def run_submitit(jobs: list[Job], folder: Path, cluster: str | None,
                 slurm: dict[str, Any] | None = None) -> Iterator[tuple[Job, dict[str, Any]]]:
    """Submit every job through submitit (cluster None = Slurm if available, "local" = this machine)."""
    import submitit

    executor = submitit.AutoExecutor(folder=str(folder), cluster=cluster)
    executor.update_parameters(timeout_min=24 * 60, **(slurm or {}))
    futures = [(job, executor.submit(run_job, job)) for job in jobs]
    for job, future in futures:
        yield job, future.result()


def execute(jobs: list[Job], kind: str, workers: int, folder: Path,
            on_done: Callable[[Job, dict[str, Any]], None] | None = None) -> dict[str, dict[str, Any]]:
    """Run `jobs` with the chosen executor; returns key → result."""
    if kind == "local":
        stream = run_local(jobs, workers)
    else:
        stream = run_submitit(jobs, folder, "local" if kind == "submitit-local" else None)
    results = {}
    for job, result in stream:
        results[job.key] = result
        if on_done is not None:
            on_done(job, result)
    return results
