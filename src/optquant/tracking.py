"""Experiment tracking: `--set log.to=tensorboard` mirrors a run's numbers into a TensorBoard event file.

What is logged (rank 0 only): the run config (as JSON text), every
training step (`train/loss`, `train/lr_mult`, `train/tokens_per_s`), every evaluation exactly as
metrics.jsonl records it (`eval/<key>` at its step), the final summary's numbers (`summary/<key>`), and
PTQ results of `optquant ptq` on the run (`ptq/<scheme>/<key>`). Files go to `<run>/tensorboard/`.
`log.to` is not part of a run's identity: it is left out of the config hash, so switching the logger
on or off never retrains or renames a run. Nothing is imported or written when no logger is set.

Left out: wandb (not finished: `log.to=wandb` is refused by the config parser), media, histograms.
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
    to: Literal["none", "tensorboard"] = "none"


class Tracker:
    """No-op base: every method is safe to call when no logger is set."""

    def step(self, step: int, values: dict[str, float]) -> None: ...

    def record(self, prefix: str, step: int, values: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker(Tracker):
    def __init__(self, run_dir: Path, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, sort_keys=True) + "\n```", 0)

    def step(self, step: int, values: dict[str, float]) -> None:
        self.record("train", step, values)

    def record(self, prefix: str, step: int, values: dict[str, Any]) -> None:
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                continue
            self.writer.add_scalar(f"{prefix}/{key}", value, step)

    def close(self) -> None:
        self.writer.close()


def open_tracker(log: LogConfig | None, run_dir: Path, config: dict) -> Tracker:
    """The tracker `log.to` asks for (a no-op one for "none" or None)."""
    to = getattr(log, "to", "none")
    if to == "none":
        return Tracker()
    if to == "tensorboard":
        if importlib.util.find_spec("tensorboard") is None:
            raise OptquantError("log.to=tensorboard needs TensorBoard: pip install 'optquant[tensorboard]'")
        return TensorBoardTracker(run_dir, config)
    raise OptquantError(f"log.to must be none or tensorboard, got {to!r}")
