"""The paper's reported numbers as data, shown beside ours and always labelled "paper".

Transcribed from /work/shared/reference/paper.md §1, §10 (arXiv 2509.23500, "Beyond Outliers"). Every
block carries the digests it comes from (tags as in paper.md §0: [ZD], [PN], [KR], [ZS], [ALPHA], [OR]).
Accuracies are average zero-shot accuracy in % (PIQA, HellaSwag, ARC-Easy, acc_norm) of 50M–1.5B models;
a study here measures validation loss of far smaller models, so these are reference values, never
targets. `None` marks a cell the paper has no (recovered) number for.

Left out on purpose: numbers only one garbled digest reports (e.g. [ZT]'s correlation values).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

OPTIMIZERS = ("adamw", "muon", "psgd", "scion", "shampoo", "soap")
LABELS = {
    "adamw": "AdamW",
    "muon": "Muon",
    "psgd": "PSGD",
    "scion": "Scion",
    "shampoo": "Shampoo",
    "soap": "SOAP",
}


def label(opt: str) -> str:
    """An optimizer's name in the report: the paper's label, or a plugin as the user typed it with a path
    shortened to its file (`examples/lion.py:make_optimizer` → `lion.py:make_optimizer`)."""
    module, colon, attr = opt.rpartition(":")
    return LABELS.get(opt) or (f"{Path(module).name}:{attr}" if colon and module.endswith(".py") else opt)


def by_label(names) -> list[str]:
    """Optimizer names in the paper's order (LABELS), any others after them by name."""
    return sorted(names, key=lambda x: (x not in LABELS, list(LABELS).index(x) if x in LABELS else 0, x))


@dataclass(frozen=True)
class PaperGrid:
    """A size × optimizer grid of paper values; `notes[(size, opt)]` is a short marker ("*", "†") that
    `footnote` explains."""

    title: str
    sources: str
    unit: str
    sizes: tuple[str, ...]
    optimizers: tuple[str, ...]
    values: dict[str, tuple[float | None, ...]]  # size -> one value per optimizer
    notes: dict[tuple[str, str], str] = field(default_factory=dict)
    footnote: str = ""
    digits: dict[str, int] = field(default_factory=dict)  # decimals per row as printed (default 2)


TABLE2_ACC = PaperGrid(
    title="Table 2: FP accuracy at the best LR (20 TPP)",
    sources="[ZD]; 500M row inferred from Table 4 via the relative-degradation formula",
    unit="avg zero-shot acc %",
    sizes=("50M", "125M", "350M", "500M", "760M", "1.5B"),
    optimizers=("adamw", "muon", "shampoo"),
    values={
        "50M": (43.75, 45.03, 44.81),
        "125M": (48.64, 49.62, 49.53),
        "350M": (56.58, 58.08, 56.51),
        "500M": (60.39, 61.50, 61.03),
        "760M": (63.90, 64.63, 63.05),
        "1.5B": (67.93, 69.19, 68.16),
    },
    notes={("500M", o): "*" for o in ("adamw", "muon", "shampoo")},
    footnote="* inferred from Table 4, not in the digests. PSGD, Scion and SOAP FP accuracies were not recovered.",
)

TABLE3_PTQ_ACC = PaperGrid(
    title="Table 3: accuracy after W4A4 RTN PTQ of the Common-Loss models",
    sources="[ZD], [PN] (500M row), [KR]",
    unit="avg zero-shot acc %",
    sizes=("350M", "500M", "760M", "1.5B"),
    optimizers=OPTIMIZERS,
    values={
        "350M": (49.23, 47.42, 50.09, 49.80, 53.93, 49.08),
        "500M": (55.17, 50.60, None, None, 55.65, None),
        "760M": (59.22, 50.00, 52.11, 53.74, 59.26, 46.22),
        "1.5B": (62.51, 47.75, None, None, 63.88, None),
    },
    footnote="Pre-quantization accuracy of the CL models is mostly unknown (Muon 500M: 61.86 → 50.60 [KR]). "
    "PSGD, Scion and SOAP were not trained at 1.5B.",
)

TABLE4_QAT_ACC = PaperGrid(
    title="Table 4: QuEST W4A4 QAT accuracy",
    sources="[ZD] (760M and 1.5B also [PN])",
    unit="avg zero-shot acc %",
    sizes=("350M", "500M", "760M", "1.5B"),
    optimizers=("adamw", "muon", "shampoo"),
    values={
        "350M": (54.64, 55.19, 55.02),
        "500M": (60.07, 61.05, 60.80),
        "760M": (62.22, 62.32, 62.76),
        "1.5B": (66.82, 67.08, 67.34),
    },
)

TABLE4_QAT_REL = PaperGrid(
    title="Table 4: relative QAT degradation vs FP accuracy (%)",
    sources="[ZD]",
    unit="%",
    sizes=("350M", "500M", "760M", "1.5B"),
    optimizers=("adamw", "muon", "shampoo"),
    values={
        "350M": (-3.43, -4.98, -2.64),
        "500M": (-0.53, -0.73, -0.38),
        "760M": (-2.63, -3.57, -0.46),
        "1.5B": (-1.63, -2.11, -1.20),
    },
    notes={("1.5B", "muon"): "†"},
    footnote="Cells are −100·(FP − QAT)/FP. † an absolute drop; the relative one would be −3.05.",
)

TABLE10_FITS = PaperGrid(
    title="Table 10: scaling-law fits L(N) = A/(N·ρ)^α + E",
    sources="[ZD]; ρ also [PN]",
    unit="",
    sizes=("rho_4bit", "E"),
    optimizers=OPTIMIZERS,
    values={
        "rho_4bit": (0.863, 0.852, 0.739, 0.856, 0.879, 0.822),
        "E": (1.40, 1.85, 1.39, 1.75, 1.72, 2.22),
    },
    footnote="A and α per optimizer were not recovered; the fitting procedure is unknown.",
    digits={"rho_4bit": 3},
)

# Fig. 1 at 760M: correlation with post-PTQ average accuracy ([KR] says Pearson). Our damage is a loss
# increase, so the sign we expect against Δ val loss is the opposite of the paper's sign.
CORRELATIONS_760M = {"mmr": 0.62, "kurtosis": 0.70, "R_L": -0.89}
CORRELATIONS_SOURCES = "[PN], [KR], [ALPHA]; Pearson per [KR]; the point set is unknown"

# Table 9: wall-clock at 760M, probably seconds per optimizer step; hardware unknown.
TIMING_760M = {"adamw": 6.28, "shampoo": 8.38}
TIMING_SOURCES = "[ZD] Table 9; Muon ≈ AdamW"

# ρ_4bit order, best first (Table 10).
RHO_RANKING = ("shampoo", "adamw", "scion", "muon", "soap", "psgd")


@dataclass(frozen=True)
class Claim:
    key: str
    text: str
    sources: str


CLAIMS = (
    Claim("fp_best", "Muon has the best FP accuracy at most sizes", "[ZD], [ZS]"),
    Claim("mmr_lr", "Raising the learning rate raises MMR for every optimizer (Fig. 2)", "[ZD], [ZS]"),
    Claim("mmr_low", "Muon has the lowest MMR (Fig. 2)", "[ZD], [ZS]"),
    Claim("ptq_least", "Shampoo degrades least under W4A4 RTN PTQ at most sizes", "[ARX], [PN], [ZD]"),
    Claim("ptq_most", "Muon degrades most under PTQ", "[ARX], [PN], [ZD]"),
    Claim(
        "rl_predicts",
        "R_L predicts PTQ damage better than MMR or kurtosis (|ρ| 0.89 vs 0.62/0.70)",
        "[PN], [KR]",
    ),
    Claim(
        "a_dominates",
        "A_ℓ (propagated error) dominates B_ℓ and C_ℓ at almost all modules (Fig. 3)",
        "[PN], [ZD]",
    ),
    Claim("g1_one", "The spectral ratio G₁ ≈ 1 for all optimizers (Fig. 4)", "[PN], [ZD]"),
    Claim(
        "gain_rank",
        "Muon has the highest linear-layer gain; AdamW and Shampoo the lowest (Fig. 4)",
        "[PN], [ZD]",
    ),
    Claim("qat_least", "Under QAT, Shampoo has the smallest degradation", "[PN], [ZD]"),
    Claim("qat_not_fp", "The best FP optimizer is not the best under QAT", "[ARX], [PN]"),
    Claim("rho_rank", "ρ_4bit: Shampoo > AdamW > Scion > Muon > SOAP > PSGD (Table 10)", "[ZD], [PN]"),
    Claim(
        "ptq_qat_link",
        "Optimizers that recover best from PTQ are the most parameter-efficient under QAT",
        "[PN]",
    ),
    Claim("shampoo_cost", "Shampoo is slower per step than AdamW (+33 % at 760M, Table 9)", "[ZD]"),
)
