"""Executors: run a batch of independent jobs locally (worker processes) or on Slurm (submitit).

A job is any picklable object with `key`, `done`, `cost`, `run` and `describe` (the idempotent `Job` of
study/jobs.py); the executor knows no kinds of job.

- `local`: a pool of `workers` spawned processes; the machine's cores are split evenly between them
  (torch threads per worker = cores // workers). workers=1 runs jobs in this process. The workers die
  with the study process, however it ends (prctl PDEATHSIG on Linux). A study keeps one `WorkerPool`
  for all its stages: a worker's start (spawn, then importing torch and optquant: seconds of CPU,
  docs/benchmarks.md) is paid once per study, not once per stage.
- `slurm`: submitit's AutoExecutor (one Slurm job per study job); `submitit-local` is submitit's local
  executor, which runs the same code path on this machine and is how the Slurm route is tested.

Waste: a job whose outputs already exist (a finished run resubmitted by a later stage, a PTQ result of
an earlier attempt) is answered from its files without a worker. The others are submitted longest
first (`Job.cost`: training FLOPs, or forward passes for PTQ/outliers), so the
long jobs do not end up alone at the tail of a batch. Every job that ran is appended to `costs.jsonl`
(one JSON line, written by this process alone: stage, optimizer, size, start/end, worker, seconds per
part), which the report's cost section reads.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optquant.files import open_nofollow
from optquant.runs import StudyDir

if TYPE_CHECKING:
    from optquant.study.jobs import Job, Result

log = logging.getLogger(__name__)


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


def timed_job(job: Job) -> tuple[Result, dict[str, Any]]:
    """(result, timing) of `job.run()`: wall-clock start/end, the worker's pid and seconds per part."""
    from optquant.device import keep_freed_memory

    keep_freed_memory()  # in the process that runs the job: a pool worker, a Slurm task, or this one
    start = time.time()
    result, parts = job.run()
    end = time.time()
    return result, {"start": start, "end": end, "worker": f"{os.uname().nodename}:{os.getpid()}", "parts": parts}


def estimate_cost(job: Job) -> float:
    """The job's own cost estimate (study/jobs.py); a job that cannot be costed yet (its config missing)
    is still run, last."""
    try:
        return job.cost()
    except Exception:
        log.debug("no cost estimate for %s", job.key, exc_info=True)
        return 0.0


def longest_first(jobs: list[Job]) -> list[Job]:
    """Jobs by decreasing estimated cost (stable: equal costs keep their order; each job costed once)."""
    return sorted(jobs, key=lambda j: -estimate_cost(j))


def timing_record(job: Job, timing: dict[str, Any], workers: int) -> dict[str, Any]:
    """One costs.jsonl line: the job, its stage, optimizer and size, and where its time went."""
    facts = job.describe()
    seconds = timing["end"] - timing["start"]
    return {"key": job.key, "kind": facts["kind"], "stage": facts["stage"], "optimizer": facts["optimizer"],
            "size": facts["size"], "start": timing["start"], "end": timing["end"], "seconds": seconds,
            "worker": timing["worker"], "workers": workers, "parts": timing["parts"] or {facts["part"]: seconds}}


def append_timing(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line with a single O_APPEND write (whole lines even if several studies log)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(record, allow_nan=False, default=str) + "\n").encode()
    fd = open_nofollow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def _init_worker(threads: int, parent: int) -> None:
    import warnings

    die_with_parent(parent)
    import torch

    warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight", category=UserWarning)
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import optquant.study.jobs  # noqa: F401  every job's imports, while the study is still planning


def threads_per_worker(workers: int) -> int:
    return max(1, (os.cpu_count() or 1) // workers)


class WorkerPool:
    """The local executor's worker processes, started at the first batch and kept for the next ones (a
    study's stages); a pool whose worker died is replaced at the next batch."""

    def __init__(self, workers: int):
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None

    def get(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=get_context("spawn"),
                                             initializer=_init_worker,
                                             initargs=(threads_per_worker(self.workers), os.getpid()))
        return self._pool

    def close(self, wait: bool = True) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=wait, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.close(wait=exc_type is None)


def run_local(jobs: list[Job], workers: int,
              pool: WorkerPool | None = None) -> Iterator[tuple[Job, tuple[Result, dict[str, Any]]]]:
    """Yield (job, (result, timing)) as jobs finish, in submission order's priority. `pool`: worker
    processes to reuse (a study's); without one, a pool lives for this batch only."""
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            yield job, timed_job(job)
        return
    own = pool is None
    pool = WorkerPool(workers) if own else pool  # processes start as jobs need them (spawn start method)
    pending = {}
    try:
        executor = pool.get()
        pending = {executor.submit(timed_job, job): job for job in jobs}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                yield pending.pop(future), future.result()
    except BrokenProcessPool:
        pool.close(wait=False)  # a worker died (killed, out of memory): the next batch starts a new pool
        raise
    finally:
        for future in pending:  # abandoned (an error, or the caller stopped): do not run the rest
            future.cancel()
        if own:
            pool.close()


def run_submitit(jobs: list[Job], folder: Path, cluster: str | None) -> Iterator[tuple[Job, dict[str, Any]]]:
    """Submit every job through submitit (cluster None = Slurm if available, "local" = this machine)."""
    import submitit

    executor = submitit.AutoExecutor(folder=str(folder), cluster=cluster)
    executor.update_parameters(timeout_min=24 * 60)
    futures = [(job, executor.submit(timed_job, job)) for job in jobs]
    for job, future in futures:
        yield job, future.result()


def execute(jobs: list[Job], executor: str, workers: int, folder: Path,
            on_done: Callable[[Job, Result, dict | None], None] | None = None,
            pool: WorkerPool | None = None) -> dict[str, Result]:
    """Run `jobs` with the chosen executor; returns key → result. Jobs already done are read, not
    run; each job that runs is logged to costs.jsonl beside `folder`, i.e. in the study directory.
    `on_done(job, result, record)`: record is the job's costs.jsonl line (None: answered from its files).
    `pool`: local workers to reuse (a study's)."""
    costs = StudyDir(Path(folder).parent).costs
    on_done = on_done or (lambda *_: None)
    results, todo = {}, []
    for job in jobs:
        done = job.done()
        if done is None:
            todo.append(job)
            continue
        results[job.key] = done
        on_done(job, done, None)
    todo = longest_first(todo)
    stream = (run_local(todo, workers, pool) if executor == "local"
              else run_submitit(todo, folder, "local" if executor == "submitit-local" else None))
    n_workers = workers if executor == "local" else len(todo)
    for job, (result, timing) in stream:
        results[job.key] = result
        record = timing_record(job, timing, max(1, min(n_workers, len(todo))))
        append_timing(costs, record)
        on_done(job, result, record)
    return results
