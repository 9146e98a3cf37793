"""The study's robust arm (issue 23): every optimizer's best-LR run again with each `robust` entry.

An entry is `method[:strength[:every]]` (quant/robust_config.py), e.g. `robust=penalty:0.3,gain:4,late-qat:0.2`.
For each (optimizer, size) and every seed of its best LR, the run is repeated with the method on: the same
config, LR and seed, trained for the whole budget, with the size's Common-Loss threshold set, so its first
evaluation at or below the threshold is kept (fine evaluations every `cl_eval_every` steps from where the
plain run of that seed started its own search; a robust run that crosses earlier, at a regular evaluation, is
run again to its crossing with fine evaluations from its own last evaluation above the threshold: its CL model
and `cl_step` are that run's, the rest its full run's). Measured, as for the plain runs: at the Common Loss
every PTQ scheme's damage with R_L, the ABC sums and the gains; on the final model the first scheme's damage
and the FP validation loss (the evaluator in fp32, so a late-QAT model's FP loss too, not its quantized one);
the mean step time, wall clock and CPU.

Everything goes to robust.parquet, long: optimizer, size, seed, arm ("none" = the plain run), weights
("cl" | "final" | "train"), scheme, metric, value. The report's Robustness table pairs each arm with the
plain run of the same (size, seed). The stage itself is plan.robust_stage; this module turns its results
into rows. Left out: a robust LR search (the plain best LR is kept, as the paper keeps it for QAT) and
robust runs of the LR sweep.
"""

from __future__ import annotations

import pandas as pd

from optquant.runs import read_summary
from optquant.study.results import metric_rows

CL_METRICS = ("delta_val_loss", "val_loss_fp", "R_L", "sum_A", "sum_B", "mean_gain", "mean_gain_linear",
              "mean_G1", "mean_G2")
TRAIN_METRICS = ("mean_step_seconds", "mean_step_cpu_seconds", "cl_step", "best_val_loss")
COLUMNS = ("optimizer", "size", "seed", "arm", "weights", "scheme", "metric", "value")


def robust_rows(spec, cl_models: dict, finals: dict, trained: dict, results: dict) -> pd.DataFrame:
    """robust.parquet's rows: `cl_models`, `finals` and `trained` map (opt, size, seed, arm) to a run
    directory; `results` holds the PTQ jobs' results by job key (plan.ptq_jobs) and the runs' summaries by
    run id."""
    rows, first = [], spec.ptq_schemes[0]

    def add(key: tuple, weights: str, scheme: str, values: dict, names: tuple[str, ...]) -> None:
        rows.extend(metric_rows(dict(zip(COLUMNS, (*key, weights), strict=False)), scheme, values, names))

    for key, p in cl_models.items():
        for scheme in spec.ptq_schemes:
            add(key, "cl", scheme, results.get(f"{p.name}/cl/{scheme}") or {}, CL_METRICS)
    for key, p in finals.items():
        add(key, "final", first, results.get(f"{p.name}/final/{first}") or {}, ("delta_val_loss", "val_loss_fp"))
    for key, p in trained.items():
        add(key, "train", "none", results.get(p.name) or read_summary(p) or {}, TRAIN_METRICS)
    return pd.DataFrame(rows, columns=COLUMNS)
