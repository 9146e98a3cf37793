"""Read the files a study writes into one `StudyData`; every later step of the report reads only this.

Why a loader of its own: the report must rebuild from a finished study directory without retraining, and a
study may be partial (no QAT, no fits). Each optional input loads as empty/None and the section that needs it
says "not run in this study". Files read: study.json, results.parquet (long table, one row per run × scheme
× metric), correlations.parquet, fits.json, best.json (the LR search's status per optimizer/size),
runs/<run_id>/ptq/cl/<scheme>/propagation.parquet and runs/<run_id>/metrics.jsonl. fits.json is
`optquant.scaling` `to_dict` output (ρ as {"4bit": x}, interval names "rho_4bit", "rho_4bit/<opt>").

Seeds: `seeds` gives one value per (size, optimizer, seed), the unit every interval and paired test of
the report uses (optquant.stats).

Left out on purpose: schema migrations; a missing required column is an error, not a guess.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from optquant.errors import OptquantError
from optquant.files import NUMBER, check_numeric_columns, check_record, parse_metrics, read_json, read_parquet
from optquant.report.paper import by_label, label
from optquant.runs import StudyDir
from optquant.study_spec import StudySpec, spec_from_dict

log = logging.getLogger(__name__)

RESULT_COLUMNS = ("size", "n_params", "optimizer", "lr", "seed", "kind", "best_lr", "scheme", "metric", "value")
PAPER_SCHEME = "w4a4-rtn"  # the paper's PTQ scheme (paper.md §5)
_COLORS = {
    "adamw": "#1f77b4",
    "muon": "#d62728",
    "psgd": "#9467bd",
    "scion": "#ff7f0e",
    "shampoo": "#2ca02c",
    "soap": "#8c564b",
}
_EXTRA_COLORS = ("#17becf", "#e377c2", "#7f7f7f", "#bcbd22")


@dataclass(frozen=True)
class StudyData:
    root: Path
    spec: StudySpec | None  # study.json's, None without one
    sizes: tuple[str, ...]  # presets, smallest first
    n_params: dict[str, float]
    optimizers: tuple[str, ...]
    results: pd.DataFrame
    correlations: pd.DataFrame | None
    fits: dict | None
    best: dict | None = None  # best.json: (optimizer, size) -> best_lr, status, reason, ...
    blocks: dict[str, int] = field(default_factory=dict)  # size -> transformer blocks (study.json, else a run's config)
    machine: dict = field(default_factory=dict)  # study.json's `machine`: CPU, bf16, precision, threads, commit
    search_seed: int = 0  # study.json's: the seed the LR searches ran with (study_spec.py search_seed)
    n_count: str = "total"  # what n_params counts: the token budget's (and the fits') N, "non_embedding" or "total"
    n_other: dict[str, float] | None = None  # the other count per size (with the embedding, or without), for notes

    # ---------------------------------------------------------------- row selection
    def rows(self, kind: str, metric: str, scheme: str | None = "none", best: bool | None = None) -> pd.DataFrame:
        r = self.results
        m = (r["kind"] == kind) & (r["metric"] == metric)
        if scheme is not None:
            m &= r["scheme"] == scheme
        if best is not None:
            m &= r["best_lr"] == best
        return r[m]

    def cell(self, kind: str, metric: str, scheme: str | None = "none", best: bool | None = None) -> dict:
        """{(size, optimizer): mean value over seeds/runs} of the selected rows."""
        df = self.rows(kind, metric, scheme, best)
        return {k: float(v) for k, v in df.groupby(["size", "optimizer"])["value"].mean().items()}

    def seeds(self, kind: str, metric: str, scheme: str | None = "none", best: bool | None = None) -> pd.DataFrame:
        """Columns size, optimizer, seed, value: one value per seed (a mean if a seed has several runs)."""
        df = self.rows(kind, metric, scheme, best)
        df = df[np.isfinite(df["value"].to_numpy(dtype=float))]
        if df.empty:
            return pd.DataFrame(columns=["size", "optimizer", "seed", "value"])
        return df.groupby(["size", "optimizer", "seed"], as_index=False)["value"].mean()

    def schemes(self, kind: str = "cl") -> tuple[str, ...]:
        s = set(self.results.loc[self.results["kind"] == kind, "scheme"]) - {"none"}
        return tuple(sorted(s, key=lambda x: (x != PAPER_SCHEME, x)))

    def tasks(self) -> tuple[str, ...]:
        """The lm-eval tasks the study scored its Common-Loss models on (`acc_norm/<task>` rows), with
        "avg" (their mean, the paper's number) first when there are several."""
        r = self.results
        metrics = r.loc[r["kind"] == "cl", "metric"].astype(str)
        names = {m.split("/", 1)[1] for m in metrics if m.startswith("acc_norm/")}
        return tuple(sorted(names, key=lambda t: (t != "avg", t)))

    def task_label(self, task: str) -> str:
        """A task's name for captions; "avg" spelled out with the tasks it averages."""
        if task != "avg":
            return task
        return "mean of " + ", ".join(t for t in self.tasks() if t != "avg")

    def paper_scheme(self) -> str | None:
        """W4A4 RTN if the study ran it, else the first PTQ scheme (None without PTQ)."""
        return next(iter(self.schemes("cl")), None)

    def largest(self) -> str | None:
        """The largest size with any result rows (study.json may list sizes that never ran)."""
        ran = set(self.results["size"])
        return next((s for s in reversed(self.sizes) if s in ran), None)

    def best_runs(self, size: str, kind: str = "fp") -> dict[str, str]:
        """{optimizer: run_id} of the first best-LR run of `kind` at `size` (every CL and QAT row is one)."""
        r = self.results
        df = r[(r["kind"] == kind) & (r["size"] == size) & r["best_lr"]]
        return {o: str(g["run_id"].iloc[0]) for o, g in df.groupby("optimizer")}

    # ---------------------------------------------------------------- per-run files
    @property
    def dir(self) -> StudyDir:
        return StudyDir(self.root)

    def summary_values(self, kind: str, metric: str, key: str) -> dict[tuple[str, str], str]:
        """{(size, optimizer): the distinct values of `key` in runs/<run_id>/summary.json over the runs
        of the selected rows, joined by "/"}; cells where no run records the key are absent."""
        out = {}
        for cell, g in self.rows(kind, metric).groupby(["size", "optimizer"]):
            summaries = (_optional(read_json, self.dir.run(str(r)).summary) or {} for r in g["run_id"].unique())
            values = {str(v) for s in summaries if (v := s.get(key)) is not None}
            if values:
                out[cell] = "/".join(sorted(values))
        return out

    def propagation(self, run_id: str, scheme: str) -> pd.DataFrame | None:
        """A CL model's ABC rows, as `optquant analyze` wrote them."""
        return _one_norm(_optional(read_parquet, self.dir.run(run_id).ptq_file("cl", scheme, "propagation")))

    def propagation_set(self) -> tuple[str, str, dict[str, pd.DataFrame]] | None:
        """(size, scheme, {optimizer: propagation frame}) for the largest size whose CL models have ABC
        files under the paper's scheme (Figs. 3–4 use the largest model, as the paper does)."""
        scheme = self.paper_scheme()
        if scheme is None:
            return None
        for size in reversed(self.sizes):
            runs = self.best_runs(size, "cl")
            frames = {o: df for o, r in runs.items() if (df := self.propagation(r, scheme)) is not None}
            if frames:
                return size, scheme, {o: frames[o] for o in self.optimizers if o in frames}
        return None

    def curve(self, run_id: str) -> pd.DataFrame | None:
        """runs/<run_id>/metrics.jsonl as a frame (None if absent or empty)."""
        lines = _optional(parse_metrics, self.dir.run(run_id).metrics)
        return pd.DataFrame(lines) if lines else None

    # ---------------------------------------------------------------- display
    def label(self, opt: str) -> str:
        return label(opt)

    def color(self, opt: str) -> str:
        if opt in _COLORS:
            return _COLORS[opt]
        extra = [o for o in self.optimizers if o not in _COLORS]
        return _EXTRA_COLORS[extra.index(opt) % len(_EXTRA_COLORS)] if opt in extra else "#333333"

    def size_label(self, size: str) -> str:
        """The size with its one parameter count (`n_count`) everywhere in the report."""
        n = self.n_params.get(size)
        return f"{size} ({fmt_count(n)})" if n else size

    def count_note(self) -> str:
        """Which count `size_label` shows, and the other one per size."""
        rest = ", ".join(f"{s} {fmt_count(n)}" for s in self.sizes if (n := (self.n_other or {}).get(s)))
        if self.n_count == "non_embedding":
            return ("Parameter counts are non-embedding, the N the token budget and the scaling fits count"
                    + (f"; with the embedding: {rest}." if rest else "."))
        return "Parameter counts include the embedding" + (f"; without it: {rest}." if rest else ".")


def load_study(study_dir: str | Path) -> StudyData:
    root = Path(study_dir)
    if not root.is_dir():
        raise OptquantError(f"study directory {root} does not exist")
    files = StudyDir(root)
    info = _optional(read_json, files.study) or {}
    results = _read_results(files.results)
    sizes_info = {s: v for s, v in (info.get("sizes") or {}).items() if isinstance(v, dict)}
    total = {s: float(v.get("n_params", math.nan)) for s, v in sizes_info.items()}
    non_emb = {s: float(v["n_params_non_embedding"]) for s, v in sizes_info.items() if "n_params_non_embedding" in v}
    for s, g in results.groupby("size"):
        total.setdefault(str(s), float(g["n_params"].median()))
        if "n_params_non_embedding" in g and g["n_params_non_embedding"].notna().any():
            non_emb.setdefault(str(s), float(g["n_params_non_embedding"].median()))
    budget = set(results["budget_params"].dropna()) if "budget_params" in results else set()
    n_count = "non_embedding" if budget == {"non_embedding"} and non_emb else "total"
    n_params, n_other = (non_emb, total) if n_count == "non_embedding" else (total, non_emb)
    return StudyData(
        root=root,
        spec=spec_from_dict(info["spec"]) if info.get("spec") else None,
        sizes=tuple(sorted(set(n_params) | set(results["size"]), key=lambda s: (n_params.get(s, math.inf), s))),
        n_params=n_params,
        optimizers=tuple(by_label(set(results["optimizer"]))),
        results=results,
        correlations=_optional(read_parquet, files.correlations),
        fits=_optional(read_json, files.fits),
        best=_read_best(files.best),
        blocks=_blocks(files, sizes_info, results),
        machine=info.get("machine") or {},
        search_seed=info.get("search_seed", (info.get("spec", {}).get("seeds") or [0])[0]),  # older: the first
        n_count=n_count,
        n_other=n_other,
    )


def _blocks(files: StudyDir, sizes_info: dict, results: pd.DataFrame) -> dict[str, int]:
    """Blocks per size: study.json's `n_layer`, or (a study from before it was recorded) the config.json of
    one of the size's runs."""
    out = {s: int(v["n_layer"]) for s, v in sizes_info.items() if "n_layer" in v}
    for size, g in results.groupby("size"):
        if str(size) not in out:
            record = _optional(read_json, files.run(str(g["run_id"].iloc[0])).config) or {}
            cfg = record.get("config") if isinstance(record, dict) else None
            if isinstance(cfg, dict) and isinstance(n := (cfg.get("model") or {}).get("n_layer"), int):
                out[str(size)] = n
    return out


def _read_best(path: Path) -> dict[tuple[str, str], dict] | None:
    """best.json as {(optimizer, size): entry}, each entry checked for the types study/results.py writes:
    a list of entries naming their optimizer and size, or (before issue 30) an object keyed
    "<optimizer>/<size>", split at the last "/" (a size has none; a plugin's path may)."""
    best = _optional(read_json, path)
    if best is None:
        return None
    if isinstance(best, dict) and all(isinstance(v, dict) and "/" in k for k, v in best.items()):
        best = [{"optimizer": k.rpartition("/")[0], "size": k.rpartition("/")[2], **v} for k, v in best.items()]
    if not isinstance(best, list) or not all(isinstance(v, dict) for v in best):
        raise OptquantError(f"{path}: not a best-LR record (a list of objects); rerun optquant study")
    out = {}
    for i, entry in enumerate(best):
        where = f"{path} entry {i}"
        if not (isinstance(entry.get("optimizer"), str) and isinstance(entry.get("size"), str)):
            raise OptquantError(f"{where}: no optimizer and size (strings); rerun optquant study to rewrite it")
        check_record(where, entry, {"best_lr": (*NUMBER, type(None)), "status": (str,), "reason": (str, type(None)),
                                    "loss": (*NUMBER, type(None)), "seeds": (int,)},
                     "; rerun optquant study to rewrite it")
        out[(entry["optimizer"], entry["size"])] = entry
    return out


def _read_results(path: Path) -> pd.DataFrame:
    if not path.is_file():
        log.info("%s missing: every results section will say 'not run'", path)
        return pd.DataFrame({c: pd.Series(dtype=object) for c in RESULT_COLUMNS + ("run_id",)})
    df = read_parquet(path)
    missing = [c for c in RESULT_COLUMNS if c not in df.columns]
    if missing:
        raise OptquantError(f"{path} lacks column(s) {missing}; has {list(df.columns)}")
    check_numeric_columns(df, path, ("value", "lr", "seed", "n_params"))
    df = df.copy()
    df["best_lr"] = df["best_lr"].fillna(False).astype(bool)
    df["value"] = pd.to_numeric(df["value"], errors="coerce").astype(float)
    df["size"] = df["size"].astype(str)
    if "run_id" not in df.columns:
        df["run_id"] = ""
    return df


def _optional(read: Callable[[Path], Any], path: Path) -> Any:
    """`read(path)`, or None for a file the study did not write; a damaged one is an error (files.py)."""
    return read(path) if path.is_file() else None


def _one_norm(df: pd.DataFrame | None) -> pd.DataFrame | None:
    """metrics.propagation writes a per-token and a whole-tensor row per module: the figures show the
    per-token terms (the default norm) with G1/G2 from the tensor rows, the only norm they exist in."""
    if df is None or "norm" not in df.columns:
        return df
    keys = ["index", "name", "kind"]
    token = df[df["norm"] == "token"].drop(columns=["G1", "G2", "G_lin", "norm"], errors="ignore")
    tensor = df[df["norm"] == "tensor"][keys + [c for c in ("G1", "G2") if c in df.columns]]
    out = token.merge(tensor, on=keys, how="left").rename(columns={"name": "module"})
    return out.reset_index(drop=True)


# ---------------------------------------------------------------- fits.json
def fit_n(df: pd.DataFrame) -> tuple[pd.Series, str]:
    """Per row, the parameter count the run's token budget used, and its name: the scaling fits' N
    (optquant.study.results), which the report's figure draws in too. A results.parquet written before
    the budget columns existed falls back to the total count."""
    if "budget_params" not in df or "n_params_non_embedding" not in df:
        log.warning("results.parquet has no budget_params column; fitting total parameter counts")
        return df["n_params"], "total (results.parquet predates budget_params)"
    non_emb = df["budget_params"] == "non_embedding"
    n = df["n_params_non_embedding"].where(non_emb, df["n_params"])
    return n, "/".join(sorted(set(df["budget_params"].dropna()))) or "total"


def fit_rho4(rho: object) -> float:
    """ρ_4bit from either a number or optquant.scaling's {"4bit": x}."""
    if isinstance(rho, dict):
        rho = rho.get("4bit", math.nan)
    return math.nan if rho is None else float(rho)


def fit_interval(intervals: dict | None, *names: str) -> tuple[float, float]:
    for n in names:
        v = (intervals or {}).get(n)
        if v is not None and len(v) == 2:
            return tuple(math.nan if b is None else float(b) for b in v)  # type: ignore[return-value]
    return (math.nan, math.nan)


# ---------------------------------------------------------------- formatting
def fmt(v: float | None, digits: int = 4, signed: bool = False) -> str:
    if v is None or not np.isfinite(v):
        return "–"
    return f"{v:{'+' if signed else ''}.{digits}f}"


def fmt_lr(lr: float) -> str:
    if not np.isfinite(lr) or lr <= 0:
        return "–"
    m, e = f"{lr:.2e}".split("e")
    m = m.rstrip("0").rstrip(".")
    return f"{m}e{int(e)}"


def fmt_count(n: float | None) -> str:
    return _with_unit(n, (("B", 1e9), ("M", 1e6), ("k", 1e3)), "", "")


def fmt_bytes(n: float | None) -> str:
    return _with_unit(n, (("GB", 2**30), ("MB", 2**20), ("kB", 2**10)), " ", " B")


def _with_unit(n: float | None, units: tuple[tuple[str, float], ...], sep: str, ones: str) -> str:
    """n in the largest unit it reaches (3 significant digits), else as a whole number with `ones`."""
    if n is None or not np.isfinite(n):
        return "–"
    for unit, k in units:
        if abs(n) >= k:
            return f"{n / k:.3g}{sep}{unit}"
    return f"{n:.0f}{ones}"


def fmt_ci(v: float, ci: tuple[float, float], digits: int = 3) -> str:
    if not all(np.isfinite(ci)):
        return fmt(v, digits)
    return f"{fmt(v, digits)} [{fmt(ci[0], digits)}, {fmt(ci[1], digits)}]"
