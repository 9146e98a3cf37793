"""Run records: a run is a directory named from its config hash, laid out by `RunDir` alone, and a study's
directory, laid out by `StudyDir` alone (torch-free at import, so that the report can read them without
loading torch).

    <root>/<name>-<optimizer>-<hash>/
      config.json       the resolved config + package version, git commit, torch version
      metrics.jsonl     one line per evaluation
      checkpoint.safetensors  model + optimizer + RNG + data position (for exact resume)
      history/step<N>.safetensors  the checkpoint of every evaluation, with train.keep_history
      cl_model.safetensors    the model that first reached the Common Loss threshold, if asked
      model.safetensors the final weights
      summary.json      written last and atomically: its presence means the run is done
      ptq/<weights>/<scheme>/  one PTQ scheme on the final or Common-Loss weights: summary.json (damage),
                        analysis.json, outliers.parquet and propagation.parquet (outliers and ABC)
      ptq/<weights>/outliers.json  the FP model's outliers alone
      lm_eval.json      `optquant eval`'s lm-eval scores
      .lock             one writer at a time (fcntl, released when its process dies); holds who has it;
                        a PTQ directory (and ptq/, for outliers.json) has its own

    <study>/            optquant study's output (study/plan.py)
      study.json        the spec, each size's parameter counts and the machine, written at each start
      runs/<run id>/    the study's runs (RunDir)
      submitit/         the Slurm executors' job files
      costs.jsonl       one line per job the executor ran: its wall time (report/timings.py)
      results.parquet   one row per run × scheme × metric (study/results.py), with correlations.parquet,
                        fits.json (the scaling fits) and best.json (each LR search's outcome)
      robust.parquet    the robust arm's rows (study/robust.py), when the study ran one
      bits/<name>.json  bit plans from optquant bits, shown by the report
      report/index.html the report, with report/figures/*.png
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import optquant
from optquant.errors import OptquantError
from optquant.files import (
    NUMBER,
    atomic_write_json,
    atomic_write_text,
    check_record,
    open_nofollow,
    parse_metrics,
    read_json,
)

if TYPE_CHECKING:
    from optquant.config import RunConfig

# A finished run's loss is a cross-entropy in nats: a uniform guess over a 2^31-token vocabulary is 21.5, and a run
# far above its start is marked diverged; anything above this bound in a "done" summary is damage.
MAX_LOSS = 1e3
# summary.json's fields and the types train._summarise writes (None where a run may have no value)
SUMMARY_FIELDS: dict[str, tuple[type, ...]] = {
    **dict.fromkeys(("steps", "total_steps", "n_params", "n_params_non_embedding", "optimizer_state_bytes",
                     "tokens_per_step"), (int,)),
    **dict.fromkeys(("mean_step_seconds", "tokens_per_s", "lr"), NUMBER),
    **dict.fromkeys(("final_val_loss", "best_val_loss", "cl_threshold", "qat_rel_degradation_pct"),
                    (*NUMBER, type(None))),
    **dict.fromkeys(("cl_step", "diverged_step"), (int, type(None))),
    **dict.fromkeys(("run_id", "optimizer"), (str,)),
}


Weights = Literal["final", "cl"]
WEIGHT_FILES: dict[str, str] = {"final": "model.safetensors", "cl": "cl_model.safetensors"}
PTQ_FILES = {"damage": "summary.json", "analysis": "analysis.json", "outliers": "outliers.parquet",
             "propagation": "propagation.parquet"}
LOCK = ".lock"


def _file(name: str) -> property:
    return property(lambda self: self.path / name)


@dataclass(frozen=True)
class RunDir:
    """Every path inside one run directory (the layout above); no other module spells one."""

    path: Path
    config = _file("config.json")
    metrics = _file("metrics.jsonl")
    summary = _file("summary.json")
    checkpoint = _file("checkpoint.safetensors")
    history = _file("history")
    lm_eval = _file("lm_eval.json")  # `optquant eval`'s lm-eval scores of the run (its default output)

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    @property
    def name(self) -> str:
        return self.path.name

    def history_checkpoint(self, step: int) -> Path:
        """The checkpoint a run with train.keep_history wrote at evaluation `step`."""
        return self.history / f"step{step:08d}.safetensors"

    def weights(self, kind: Weights) -> Path:
        return self.path / WEIGHT_FILES[kind]

    def ptq(self, weights: Weights | None = None, scheme: str | None = None) -> Path:
        """ptq/, ptq/<weights>/ or ptq/<weights>/<scheme>/ (a PTQ job's directory)."""
        return self.path.joinpath("ptq", *(p for p in (weights, scheme) if p))

    def ptq_file(self, weights: Weights, scheme: str, what: str) -> Path:
        """One PTQ result: `what` is "damage", "analysis", "outliers" or "propagation" (PTQ_FILES)."""
        return self.ptq(weights, scheme) / PTQ_FILES[what]

    def outliers(self, weights: Weights = "final") -> Path:
        """The FP model's outliers alone (an outlier job's result)."""
        return self.ptq(weights) / "outliers.json"

    def is_run(self) -> bool:
        """Whether the directory holds a run's files (a trained or training run)."""
        return any(p.exists() for p in (self.summary, self.metrics, self.checkpoint, self.path / LOCK))


@dataclass(frozen=True)
class StudyDir:
    """Every path inside one study directory (the layout above); no other module spells one."""

    path: Path
    study = _file("study.json")
    runs = _file("runs")
    submitit = _file("submitit")
    costs = _file("costs.jsonl")
    results = _file("results.parquet")
    correlations = _file("correlations.parquet")
    fits = _file("fits.json")
    best = _file("best.json")
    robust = _file("robust.parquet")
    bits = _file("bits")
    report = _file("report")

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    @property
    def figures(self) -> Path:
        return self.report / "figures"

    @property
    def page(self) -> Path:
        """The report's HTML page."""
        return self.report / "index.html"

    def run(self, run_id: str) -> RunDir:
        return RunDir(self.runs / run_id)

    def is_study(self) -> bool:
        """Whether the directory holds a study's own files (one that started, or that has results)."""
        return self.study.exists() or self.results.exists()


@functools.lru_cache(maxsize=1)
def git_commit() -> dict[str, Any]:
    root = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=5).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                    capture_output=True, text=True, timeout=5).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        sha, dirty = "", False
    return {"commit": sha or None, "dirty": dirty}


def run_dir(root: Path, cfg: RunConfig) -> Path:
    from optquant.config import run_id

    return Path(root) / run_id(cfg)


def write_config(path: Path, cfg: RunConfig, corpus_id: str | None = None) -> None:
    """config.json; `corpus_id`: the prepared corpus the run trains on (no such field for the embedded corpus or
    raw files, so their records are as they always were)."""
    import torch

    from optquant.config import to_dict

    record = {"config": to_dict(cfg), "optquant_version": optquant.__version__,
              "torch_version": torch.__version__, **git_commit()}
    atomic_write_json(RunDir(path).config, record | ({"corpus_id": corpus_id} if corpus_id else {}))


def check_corpus(path: Path, source: str) -> None:
    """Refuse a run recorded on another prepared corpus than data.source holds now (prepared again into the same
    directory, or edited): resuming, continuing or evaluating it would mix two corpora."""
    try:  # a damaged record is config.json's own error where it is read (read_config); a resume rewrites it
        record = read_json(RunDir(path).config)
    except OptquantError:
        record = None
    recorded = record.get("corpus_id") if isinstance(record, dict) else None
    if recorded is None:
        return
    from optquant.corpus.manifest import is_prepared, source_id

    now = source_id(source) if is_prepared(source) else None
    if now != recorded:
        raise OptquantError(f"{path} was trained on corpus {str(recorded)[:16]}, but data.source={source} now holds "
                            f"{'corpus ' + now[:16] if now else 'no prepared corpus'}; restore that corpus, or "
                            "train a new run in another --out")


def read_config(path: Path) -> RunConfig:
    from optquant.config import from_dict

    file = RunDir(path).config
    record = read_json(file)
    if not isinstance(record, dict) or "config" not in record:
        raise OptquantError(f"{file}: not an optquant run record")
    return from_dict(record["config"], str(file))


def read_summary(path: Path) -> dict[str, Any] | None:
    """A finished run's summary, or None; a damaged summary.json is an error (never shown as a result)."""
    summary = RunDir(path).summary
    if not summary.exists():
        return None
    redo = f"; delete the run directory {Path(path)} (or train it with --force) to redo it"
    record = read_json(summary)
    if not isinstance(record, dict) or record.get("status") not in ("done", "diverged"):
        raise OptquantError(f"{summary}: not an optquant run summary{redo}")
    check_record(summary, record, SUMMARY_FIELDS, redo)
    for key in ("final_val_loss", "best_val_loss"):  # a finished run evaluated at its last step
        if record["status"] == "done" and not isinstance(record.get(key), NUMBER):
            raise OptquantError(f"{summary}: status 'done' without a {key}{redo}")
        if record["status"] == "done" and not 0 <= record[key] <= MAX_LOSS:
            raise OptquantError(f"{summary}: field {key!r} is {record[key]!r}, not a finished run's loss "
                                f"(a cross-entropy in [0, {MAX_LOSS:g}] nats){redo}")
    return record


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return parse_metrics(RunDir(path).metrics)


@contextlib.contextmanager
def locked(path: Path, wait: bool = True) -> Iterator[None]:
    """Hold `path`/.lock: the one writer of a run (or PTQ) directory. `wait=False` (the CLI) raises at
    once, naming the holder; study jobs wait. The lock dies with its process. A directory this call
    created is removed again if the body fails with bad input before training (nothing in it but the lock
    and config.json). A `.lock` that is a symbolic link is an error: its target is never opened."""
    path = Path(path)
    created = [d for d in (path, *path.parents) if not d.exists()]  # innermost first
    path.mkdir(parents=True, exist_ok=True)
    lock = path / LOCK
    fd = open_nofollow(lock, os.O_RDWR | os.O_CREAT)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OptquantError(f"{lock}: not a regular file; remove it and rerun")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            try:  # who holds it: what its holder wrote below
                holder = os.pread(fd, 400, 0).decode(errors="replace").strip()
            except OSError:
                holder = ""
            raise OptquantError(f"{path} is in use by {holder or 'another process'}; wait for it to finish, "
                                "or stop that process") from None
        os.ftruncate(fd, 0)
        who = f"pid {os.getpid()} on {socket.gethostname()} ({' '.join(['optquant', *sys.argv[1:]])[:200]}, " \
              f"since {time.strftime('%Y-%m-%d %H:%M:%S')})"
        os.pwrite(fd, who.encode(), 0)
        try:
            yield
        except OptquantError:
            if created and {p.name for p in path.iterdir()} <= {LOCK, RunDir(path).config.name}:  # no trace
                RunDir(path).config.unlink(missing_ok=True)
                lock.unlink(missing_ok=True)
                for d in created:
                    with contextlib.suppress(OSError):
                        d.rmdir()
            raise
    finally:
        os.close(fd)  # releases the lock


def truncate_metrics(path: Path, step: int) -> None:
    """Drop evaluations after the checkpoint we resume from, and a last line cut short by a crash: they
    will be recomputed identically. Rewritten atomically, so a crash here loses nothing."""
    if not path.exists():
        return
    keep = [r for r in parse_metrics(path) if r["step"] <= step]
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in keep))
