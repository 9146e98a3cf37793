"""The study report: the paper's Tables 2/3/4/10 and Figs. 1–4 rebuilt from a study's saved files.

`render_report(study_dir)` writes STUDY_DIR/report/index.html and report/figures/*.png, a self-contained
page (inline CSS, relative image paths) with the paper's numbers (reference/paper.md §10) in separate
"paper" tables beside ours and a claims table that says where this study agrees. `report_markdown` gives
the headline tables as markdown. Both read only files (load.py), so a report rebuilds without retraining,
and a stage the study did not run shows "not run in this study" instead of failing.

Left out on purpose: anything that needs a model or a GPU; the report never recomputes a metric.
"""

from __future__ import annotations

import logging
from html import escape
from pathlib import Path

from optquant.files import atomic_write_text
from optquant.report import curves, figures, paper
from optquant.report.bit_plans import bits_section
from optquant.report.claims import claims_table
from optquant.report.html import Section, page
from optquant.report.load import StudyData, load_study
from optquant.report.protocol import cl_table, correlation_table, cost_table, lr_status_table, tuning_table
from optquant.report.robust import robust_section
from optquant.report.scaling import fit_diagnostics_table, table10, table10_joint
from optquant.report.tables import (
    Table,
    outlier_table,
    paper_table,
    paper_values_table,
    table2,
    table3,
    table3_schemes,
    table4,
    task_table,
    to_markdown,
)
from optquant.report.timings import timing_section
from optquant.study_spec import spec_to_dict

__all__ = ["headline_tables", "render_report", "report_markdown"]

log = logging.getLogger(__name__)

CAVEAT = (
    "Read the comparison with the paper as qualitative. The paper trains 50M–1.5B-parameter OLMo2 models on "
    "ClimbMix and scores zero-shot accuracy (PIQA, HellaSwag, ARC-Easy); this study's models are far smaller "
    "and its main score is validation loss (lower is better), with a small built-in multiple-choice task, or "
    "the lm-eval tasks the study names (eval.tasks, Table 3c), where present. Cells labelled “paper” are the "
    "paper's reported numbers (reference/paper.md §10), shown for orientation only. Δ always means quantized − "
    "full precision."
)


def _fp_section(d: StudyData, fig_dir: Path) -> Section:
    timing = paper_values_table(
        "paper-timing", "Table 9 step time at 760M (s)", paper.TIMING_760M, paper.TIMING_SOURCES, "s / step"
    )
    blocks = (
        (table2(d), paper_table(paper.TABLE2_ACC, "paper-t2")),
        tuning_table(d),
        lr_status_table(d),
        curves.fig_lr_sweeps(d, fig_dir),
        curves.fig_training_curves(d, fig_dir),
        (cost_table(d), timing),
    )
    intro = ("Each optimizer's LR sweep per size; the best LR is chosen by final validation loss and, where the "
             "search could not bracket it, listed with the reason. Numbers are mean ± sd [95 % interval] over "
             "seeds; ranks come with ties where paired tests cannot tell optimizers apart.")
    return Section("fp", "Full-precision baselines (Table 2)", intro, blocks)


def _ptq_sections(d: StudyData, fig_dir: Path) -> list[Section]:
    scheme = d.paper_scheme() or "w4a4-rtn"
    other = tuple(table3(d, s) for s in d.schemes("cl") if s != scheme)
    corr_paper = paper_values_table(
        "paper-corr", "Fig. 1 correlations at 760M (vs post-PTQ accuracy)", paper.CORRELATIONS_760M,
        paper.CORRELATIONS_SOURCES, "ρ",
    )  # fmt: skip
    ptq = ((table3(d, scheme), paper_table(paper.TABLE3_PTQ_ACC, "paper-t3")),
           *(task_table(d, t, scheme) for t in d.tasks()), table3_schemes(d), *other, cl_table(d))
    other_corr = tuple(correlation_table(d, s) for s in d.schemes("cl") if s != scheme)
    outliers = (
        (correlation_table(d, scheme), corr_paper),
        figures.fig1_damage_vs_metrics(d, fig_dir),
        outlier_table(d),
        figures.fig2_mmr_vs_lr(d, fig_dir),
        *other_corr,
    )
    return [
        Section("ptq", "Post-training quantization at the Common Loss (Table 3)",
                "Every optimizer's model is taken at the first checkpoint reaching the size's common "
                "validation loss, then quantized; lower Δ val loss means more robust.", ptq),
        Section("outliers", "Outlier metrics vs PTQ damage (Figs. 1–2)",
                "Do MMR, kurtosis or R_L predict which model is hurt most by quantization? Within each size "
                "over every model with PTQ rows; the largest size is the headline, pooled sizes come last.",
                outliers),
        Section("abc", "Error propagation: the ABC decomposition (Figs. 3–4)",
                "R = A + B + C per module: A is the error carried in from earlier layers, B the error this "
                "module adds, C their interaction; G = A / R_in is the module's gain.",
                (figures.fig3_abc(d, fig_dir), figures.fig4_gains(d, fig_dir))),
    ]  # fmt: skip


def _qat_sections(d: StudyData, fig_dir: Path) -> list[Section]:
    qat = ((table4(d), paper_table(paper.TABLE4_QAT_ACC, "paper-t4"),
            paper_table(paper.TABLE4_QAT_REL, "paper-t4rel")),)  # fmt: skip
    scaling = (
        (table10(d), paper_table(paper.TABLE10_FITS, "paper-t10")),
        table10_joint(d),
        fit_diagnostics_table(d),
        curves.fig_scaling(d, fig_dir),
    )
    return [
        Section("qat", "Quantization-aware training (Table 4)",
                "QuEST W4A4 trained from scratch at each optimizer's best full-precision LR.", qat),
        Section("scaling", "Scaling laws and 4-bit parameter efficiency (Table 10)",
                "ρ_4bit < 1 means a 4-bit QAT model with N parameters is worth a ρ·N-parameter FP model.",
                scaling),
        Section("claims", "Paper claims vs this study", "Computed from the tables and figures above.",
                (claims_table(d),)),
    ]  # fmt: skip


def _header(d: StudyData) -> str:
    r = d.results
    kinds = ", ".join(f"{k}: {r.loc[r['kind'] == k, 'run_id'].nunique()}" for k in ("fp", "cl", "qat"))
    sizes = ", ".join(d.size_label(s) for s in d.sizes) or "none"
    opts = ", ".join(d.label(o) for o in d.optimizers) or "none"
    schemes = ", ".join(d.schemes("cl")) or "none"
    tasks = ", ".join(t for t in d.tasks() if t != "avg") or "none (the built-in multiple-choice task)"
    return (
        f'<p class="meta">Study directory: <code>{escape(str(d.root))}</code> · runs by kind: {kinds} · '
        f"sizes (parameters): {escape(sizes)} · optimizers: {escape(opts)} · PTQ schemes: "
        f'{escape(schemes)} · lm-eval tasks: {escape(tasks)}</p>\n<p class="meta">{escape(d.count_note())}</p>\n'
        f'<p class="meta">{escape(machine_text(d))}</p>\n'
        f'<div class="caveat">{escape(CAVEAT)}</div>'
    )


def machine_text(d: StudyData) -> str:
    """Where the study ran (study.json's `machine`, written at its last start)."""
    m = d.machine
    if not m:
        return "Machine: not recorded (a study from before optquant recorded it)."
    commit = (m.get("commit") or "unknown")[:10] + (" (uncommitted changes)" if m.get("dirty") else "")
    return (f"Machine: {m.get('cpu') or 'unknown CPU'}, {m.get('cores')} cores, native bf16 "
            f"{'yes' if m.get('native_bf16') else 'no'} · precision {', '.join(m.get('precision') or [])}; "
            f"Newton–Schulz {', '.join(m.get('newton_schulz') or []) or '–'} · {m.get('workers')} workers × "
            f"{m.get('threads_per_worker')} thread(s) · torch {m.get('torch')} · optquant commit {commit}")


def render_report(study_dir: str | Path) -> Path:
    """Write STUDY_DIR/report/index.html (+ report/figures/*.png) and return the HTML path."""
    d = load_study(study_dir)
    fig_dir = d.dir.figures
    fig_dir.mkdir(parents=True, exist_ok=True)
    for stale in fig_dir.glob("*.png"):  # a rebuilt report must not show figures of an earlier build
        stale.unlink()
    title = f"optquant report — {(d.spec and d.spec.name) or d.root.name}"
    sections = [_fp_section(d, fig_dir), *_ptq_sections(d, fig_dir), *_qat_sections(d, fig_dir),
                robust_section(d, fig_dir), *filter(None, [bits_section(d.root, fig_dir)]), timing_section(d.root)]
    text = page(title, _header(d), sections, spec_to_dict(d.spec) if d.spec else {})
    path = d.dir.page
    atomic_write_text(path, text)
    log.info("report written to %s", path)
    return path


def headline_tables(d: StudyData) -> list:
    """The tables the README pastes, in order; the HTML page shows the same `Table` objects."""
    scheme = d.paper_scheme() or "w4a4-rtn"
    return [table2(d), tuning_table(d), lr_status_table(d), table3(d, scheme),
            *(task_table(d, t, scheme) for t in d.tasks()), table3_schemes(d), table4(d), outlier_table(d),
            correlation_table(d, scheme), cl_table(d), table10(d), table10_joint(d), fit_diagnostics_table(d),
            claims_table(d)]


def report_markdown(study_dir: str | Path) -> str:
    """The headline tables (2, LR status, 3, 3c, 3b, 4, MMR/R_L, correlations, CL, 10), the claims, and the Robustness
    and Bit plans tables where the study has them, as markdown."""
    d = load_study(study_dir)
    tables = headline_tables(d)
    robust = robust_section(d, d.dir.figures) if d.dir.robust.is_file() else None  # issue 23's, if run
    for section in (robust, bits_section(d.root, d.dir.figures)):  # and issue 31's plans, where the study wrote them
        tables += [b for b in section.blocks if isinstance(b, Table)] if section else []
    head = (f"## optquant study {(d.spec and d.spec.name) or d.root.name}\n\n{machine_text(d)}\n\n_{CAVEAT}_\n\n"
            f"_{d.count_note()}_\n")
    return "\n".join([head, *(to_markdown(t) for t in tables)])
