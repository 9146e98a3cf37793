"""Experiment tracking: `--set log.to=tensorboard|wandb` mirrors a run's numbers into TensorBoard or W&B.

What is logged (rank 0 only): the run config (as JSON text), every
training step (`train/loss`, `train/lr_mult`, `train/tokens_per_s`), every evaluation exactly as
metrics.jsonl records it (`eval/<key>` at its step), the final summary's numbers (`summary/<key>`), and
PTQ results of `optquant ptq` on the run (`ptq/<weights>/<scheme>/<key>`). TensorBoard writes
`<run>/tensorboard/`; W&B runs offline unless WANDB_MODE says otherwise (`<run>/wandb/offline-run-*`,
upload later with `wandb sync`), with steps and evaluations as history rows, the summary and PTQ
results in the run summary (PTQ of a finished run is a second W&B run of the same name).
`log.to` is not part of a run's identity: it is left out of the config hash, so switching the logger
on or off never retrains or renames a run. Nothing is imported or written when no logger is set.

Left out: media, histograms, gradients.
"""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from optquant.errors import OptquantError


@dataclass(frozen=True)
class LogConfig:
    to: Literal["none", "tensorboard", "wandb"] = "none"


class Tracker:
    """No-op base: every method is safe to call when no logger is set."""

    def step(self, step: int, values: dict[str, float]) -> None:
        """One training step's numbers: a record under "train"."""
        self.record("train", step, values)

    def record(self, prefix: str, step: int, values: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def _numbers(values: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of `values` (no bools): what a logger can plot."""
    return {k: v for k, v in values.items() if not isinstance(v, bool) and isinstance(v, int | float)
            and math.isfinite(v)}


class TensorBoardTracker(Tracker):
    def __init__(self, run_dir: Path, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, sort_keys=True) + "\n```", 0)

    def record(self, prefix: str, step: int, values: dict[str, Any]) -> None:
        for key, value in _numbers(values).items():
            self.writer.add_scalar(f"{prefix}/{key}", value, step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    def __init__(self, run_dir: Path, config: dict):
        import os

        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(project="optquant", name=Path(run_dir).name, dir=str(run_dir), config=config,
                              mode=os.environ.get("WANDB_MODE", "offline"))

    def record(self, prefix: str, step: int, values: dict[str, Any]) -> None:
        values = {f"{prefix}/{k}": v for k, v in _numbers(values).items()}
        if prefix in ("train", "eval"):
            self.run.log(values, step=step)
        else:
            self.run.summary.update(values)

    def close(self) -> None:
        import wandb

        self.run.finish()
        wandb.teardown()  # stop W&B's service process: the offline run file is complete when this returns


TRACKERS = {"tensorboard": (TensorBoardTracker, "TensorBoard"), "wandb": (WandbTracker, "Weights & Biases")}


def open_tracker(log: LogConfig | None, run_dir: Path, config: dict) -> Tracker:
    """The tracker `log.to` asks for (a no-op one for "none" or None)."""
    to = getattr(log, "to", "none")
    if to == "none":
        return Tracker()
    if to not in TRACKERS:
        raise OptquantError(f"log.to must be none, tensorboard or wandb, got {to!r}")
    cls, what = TRACKERS[to]
    if importlib.util.find_spec(to) is None:
        raise OptquantError(f"log.to={to} needs {what}: pip install 'optquant[{to}]'")
    return cls(run_dir, config)
