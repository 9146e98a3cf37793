"""Run records: a run is a directory named from its config hash.

    <root>/<name>-<optimizer>-<hash>/
      config.json       the resolved config + package version, git commit, torch version
      metrics.jsonl     one line per evaluation
      checkpoint.safetensors  model + optimizer + RNG + data position (for exact resume)
      cl_model.safetensors    the model that first reached the Common Loss threshold, if asked
      model.safetensors the final weights
      summary.json      written last and atomically: its presence means the run is done
"""

from __future__ import annotations

import functools
import json
import subprocess
from pathlib import Path
from typing import Any

import torch

import optquant
from optquant.checkpoint import atomic_write_json, read_json
from optquant.config import RunConfig, from_dict, run_id, to_dict
from optquant.errors import OptquantError


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
    return Path(root) / run_id(cfg)


def write_config(path: Path, cfg: RunConfig) -> None:
    record = {"config": to_dict(cfg), "optquant_version": optquant.__version__,
              "torch_version": torch.__version__, **git_commit()}
    atomic_write_json(Path(path) / "config.json", record)


def read_config(path: Path) -> RunConfig:
    record = read_json(Path(path) / "config.json")
    if "config" not in record:
        raise OptquantError(f"{path}/config.json: not an optquant run record")
    return from_dict(record["config"], f"{path}/config.json")


def read_summary(path: Path) -> dict[str, Any] | None:
    summary = Path(path) / "summary.json"
    return read_json(summary) if summary.exists() else None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    metrics = Path(path) / "metrics.jsonl"
    if not metrics.exists():
        return []
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
