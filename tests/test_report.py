"""Report tests on a fabricated study directory in the planner's file layout (no training).

`make_study` writes 6 optimizers × 3 sizes × 3 LRs of FP runs, Common-Loss models under 4 PTQ schemes
with ABC files, QAT runs, correlations and fits, with numbers chosen so the expected cells and the claim
verdicts are known (Shampoo damages least under PTQ, Muon most, G₁ ≈ 1, ...). Checks: the page and every
referenced PNG exist and decode; tables show the exact numbers of the chosen rows; partial studies say
"not run in this study"; a headless Chromium loads every figure (skipped without chromium).
"""

import json
import re
import shutil
import subprocess
from pathlib import Path

import matplotlib.image
import numpy as np
import pandas as pd
import pytest
from scipy import stats

from optquant.errors import OptquantError
from optquant.report import render_report, report_markdown
from optquant.report.claims import check_claims
from optquant.report.figures import fig2_mmr_vs_lr
from optquant.report.load import load_study
from optquant.report.tables import fit_diagnostics_table, table10, table10_joint

OPTS = ("adamw", "muon", "psgd", "scion", "shampoo", "soap")
SIZES = {"s1": 2e5, "s2": 6e5, "s3": 1.8e6}
LRS = (1e-3, 3e-3, 1e-2)
SCHEMES = ("w4a4-rtn", "w4a4-gptq", "w4a4-rtn-had", "w4a4-gptq-had")
QUALITY = dict(adamw=1.0, muon=0.93, psgd=1.02, scion=0.97, shampoo=0.98, soap=0.96)
BEST = dict(adamw=1, muon=2, psgd=0, scion=1, shampoo=1, soap=1)  # index into LRS
DAMAGE = dict(adamw=0.10, muon=0.30, psgd=0.15, scion=0.14, shampoo=0.06, soap=0.20)
SCHEME_F = {"w4a4-rtn": 1.0, "w4a4-gptq": 0.6, "w4a4-rtn-had": 0.4, "w4a4-gptq-had": 0.25}
MMR = dict(adamw=20.0, muon=8.0, psgd=40.0, scion=15.0, shampoo=35.0, soap=25.0)
GAIN = dict(adamw=1.05, muon=2.0, psgd=1.5, scion=1.4, shampoo=1.0, soap=1.3)
QAT_DEG = dict(adamw=2.5, muon=4.0, psgd=6.0, scion=3.0, shampoo=1.0, soap=3.5)
STEP_S = dict(adamw=0.10, muon=0.12, psgd=0.30, scion=0.11, shampoo=0.15, soap=0.25)


def fp_loss(opt, n, lr_i):
    return 2.0 + 30 * QUALITY[opt] / n**0.3 + 0.05 * (lr_i - BEST[opt]) ** 2


def _base(size, opt, lr_i, kind, best, scheme, run_id):
    return dict(size=size, n_params=int(SIZES[size]), optimizer=opt, lr=LRS[lr_i], seed=0, kind=kind,
                best_lr=best, scheme=scheme, run_id=run_id)  # fmt: skip


def _write_run(root, rid, opt, loss, lr):
    run = root / "runs" / rid
    run.mkdir(parents=True)
    lines = [dict(step=s, train_loss=loss + 1 / (s + 1), val_loss=loss + 0.8 / (s + 1), lr=lr, tokens=s * 512)
             for s in range(0, 100, 10)]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (run / "summary.json").write_text(json.dumps({"final_val_loss": loss}))
    (run / "config.json").write_text(json.dumps({"optim": {"name": opt, "lr": lr}}))


def _fp_rows(add, root, mmr_sweep):
    for size, n in SIZES.items():
        for opt in OPTS:
            for i, lr in enumerate(LRS):
                rid = f"fp-{opt}-{size}-{i}"
                diverged = opt == "psgd" and i == 2
                loss = np.nan if diverged else fp_loss(opt, n, i)
                base = _base(size, opt, i, "fp", i == BEST[opt], "none", rid)
                step = STEP_S[opt] * n / 1e6
                add(base, final_val_loss=loss, best_val_loss=loss - 0.005, mean_step_seconds=step,
                    optimizer_state_bytes=8.0 * n * (2 if opt == "shampoo" else 1),
                    tokens_per_s=1e4 / STEP_S[opt], diverged=float(diverged))  # fmt: skip
                if mmr_sweep:
                    add(base, mmr=MMR[opt] * (1 + i))
                _write_run(root, rid, opt, loss, lr)


PROP_COLS = ("module", "index", "kind", "R", "A", "B", "C", "G", "G1", "G2")


def _propagation(opt, k):
    """2 blocks: attn/mlp chain + head, and 6 linear rows per block; A dominates at all but the first."""
    rows, g, nan = [], GAIN[opt], np.nan
    for layer in range(2):
        for sub, lins in (("attn", ("q", "k", "v", "o")), ("mlp", ("up", "down"))):
            for name in lins:
                g1 = 1.0 + 0.01 * (len(rows) % 3)
                rows.append((f"{layer}.{sub}.{name}", "linear", 0.01 * k, 0.008 * k, 0.002 * k, 0.0, g, g1, g / g1))
            R = 0.02 * k * (1 + len(rows) / 10)
            first = layer == 0 and sub == "attn"
            A = 0.0 if first else 0.8 * R
            rows.append((f"{layer}.{sub}", sub, R, A, 0.99 * R - A, 0.01 * R, nan if first else g, nan, nan))
    rows.append(("head", "head", 0.1 * k, 0.09 * k, 0.008 * k, 0.002 * k, g, nan, nan))
    return pd.DataFrame([(r[0], i, *r[1:]) for i, r in enumerate(rows)], columns=PROP_COLS)


def _cl_rows(add, root, damage):
    for j, (size, n) in enumerate(SIZES.items()):
        for opt in OPTS:
            rid = f"cl-{opt}-{size}"
            base = _base(size, opt, BEST[opt], "cl", True, "none", rid)
            fp, m = 2.0 + 30 / n**0.3, MMR[opt]
            add(base, val_loss=fp, mc_acc=0.4, mc_acc_norm=0.45, mmr=m, mmr_mean=m / 2, kurtosis=m * 3,
                kurtrms=2.0, cl_threshold=fp, cl_step=90.0)  # fmt: skip
            for scheme in SCHEMES:
                dmg = damage[opt] * SCHEME_F[scheme] * (1 + 0.2 * j)
                add({**base, "scheme": scheme}, val_loss=fp + dmg, mc_acc=0.38, mc_acc_norm=0.45 - dmg / 10,
                    delta_val_loss=dmg, delta_acc_norm=-dmg / 10, R_L=dmg / 2, sum_A=dmg, sum_B=dmg / 5,
                    sum_C=0.0, mean_gain=GAIN[opt])  # fmt: skip
            path = root / "ptq" / rid / "w4a4-rtn" / "propagation.parquet"
            path.parent.mkdir(parents=True)
            _propagation(opt, damage[opt]).to_parquet(path)
            out = root / "ptq" / rid / "none" / "outliers.parquet"
            out.parent.mkdir(parents=True)
            pd.DataFrame(dict(layer=["0.attn.q"], index=[0], site=["linear_input"], mmr=[m], mmr_mean=[1.0],
                              kurtosis=[3.0], kurtrms=[1.0])).to_parquet(out)  # fmt: skip


def _qat_rows(add):
    for size, n in SIZES.items():
        for opt in OPTS:
            loss = fp_loss(opt, n, BEST[opt]) * (1 + QAT_DEG[opt] / 100)
            base = _base(size, opt, BEST[opt], "qat", True, "quest-w4a4", f"qat-{opt}-{size}")
            add(base, final_val_loss=loss, mc_acc_norm=0.42, qat_rel_degradation_pct=QAT_DEG[opt])


def _correlations(df):
    cl = df[df["kind"] == "cl"]

    def col(metric, scheme="none"):
        return cl[(cl["metric"] == metric) & (cl["scheme"] == scheme)].set_index("run_id")["value"]

    rows = []
    for scheme in SCHEMES:
        sizes = cl.drop_duplicates("run_id").set_index("run_id")["size"]
        wide = pd.DataFrame({"size": sizes, "mmr": col("mmr"),
                             "kurtosis": col("kurtosis"), "R_L": col("R_L", scheme),
                             "delta_val_loss": col("delta_val_loss", scheme),
                             "delta_acc_norm": col("delta_acc_norm", scheme)})  # fmt: skip
        for size in ("all", *SIZES):
            w = wide if size == "all" else wide[wide["size"] == size]
            for m in ("mmr", "kurtosis", "R_L"):
                for t in ("delta_val_loss", "delta_acc_norm"):
                    p, s = stats.pearsonr(w[m], w[t]).statistic, stats.spearmanr(w[m], w[t]).statistic
                    rows.append(dict(size=size, scheme=scheme, metric=m, target=t, n=len(w), pearson=p,
                                     pearson_lo=max(-1, p - 0.1), pearson_hi=min(1, p + 0.1), spearman=s,
                                     spearman_lo=max(-1, s - 0.1), spearman_hi=min(1, s + 0.1)))  # fmt: skip
    return pd.DataFrame(rows)


PLAIN_FITS = {  # the brief's plain schema: ρ a number, its interval named "rho"
    "per_optimizer": {o: {"A": 30.0 * QUALITY[o], "alpha": 0.3, "E": 2.0, "rho": 0.5 + 0.05 * i,
                          "intervals": {"rho": [0.4 + 0.05 * i, 0.6 + 0.05 * i]}, "n_points": 6}
                      for i, o in enumerate(OPTS)},
    "joint": {"A": 30.0, "alpha": 0.3, "E": 2.0, "rho": {o: 0.7 for o in OPTS}, "intervals": {}},
}  # fmt: skip
RHO = dict(shampoo=0.879, adamw=0.863, scion=0.856, muon=0.852, soap=0.822, psgd=0.739)  # the paper's order


def _fits():
    """fits.json exactly as scaling.py's to_dict writes it, with known values (no fitting in tests)."""
    from optquant.scaling import JointFit, LawFit

    per = {o: LawFit(o, A=30.0 * QUALITY[o], alpha=0.3, E=2.0, rho={"4bit": RHO[o]}, n_points=6, objective=0,
                     intervals={"rho_4bit": (RHO[o] - 0.05, RHO[o] + 0.05), "E": (1.9, 2.1),
                                "alpha": (0.25, 0.35), "A": (np.nan, np.nan)},
                     at_bound=("rho_4bit",) if o == "psgd" else (), method="loo") for o in OPTS}  # fmt: skip
    joint = JointFit(A=30.0, alpha=0.3, E=2.0, reference="adamw", rho_fp={o: QUALITY[o] for o in OPTS},
                     rho={o: {"4bit": RHO[o]} for o in OPTS}, n_points=36, objective=0.0,
                     intervals={f"rho_4bit/{o}": (0.7, 0.9) for o in OPTS}, at_bound=(),
                     method="loo")  # fmt: skip
    return {"per_optimizer": {o: f.to_dict() for o, f in per.items()}, "joint": joint.to_dict()}


def make_study(
    root: Path, *, cl=True, qat=True, fits="scaling", correlations=True, mmr_sweep=False, damage=DAMAGE
) -> Path:
    """A study directory in the planner's layout; `fits`: "scaling" (scaling.py to_dict), "plain" or None."""
    root.mkdir(parents=True)
    rows = []

    def add(base, **metrics):
        rows.extend({**base, "metric": k, "value": float(v)} for k, v in metrics.items())

    _fp_rows(add, root, mmr_sweep)
    if cl:
        _cl_rows(add, root, damage)
    if qat:
        _qat_rows(add)
    df = pd.DataFrame(rows)
    df.to_parquet(root / "results.parquet")
    sizes = {s: {"n_params": int(n), "n_params_non_embedding": int(0.7 * n)} for s, n in SIZES.items()}
    (root / "study.json").write_text(json.dumps({"spec": {"name": "fab", "preset": "smoke"}, "sizes": sizes}))
    if cl and correlations:
        _correlations(df).to_parquet(root / "correlations.parquet")
    if fits:
        (root / "fits.json").write_text(json.dumps(_fits() if fits == "scaling" else PLAIN_FITS))
    return root


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    root = make_study(tmp_path_factory.mktemp("study") / "full")
    return root, render_report(root)


def _imgs(page: Path) -> list[Path]:
    return [page.parent / src for src in re.findall(r'<img src="([^"]+)"', page.read_text())]


def _section(html: str, sid: str) -> str:
    return html.split(f'<section id="{sid}">')[1].split("</section>")[0]


def test_page_and_every_figure_png(full):
    root, page = full
    assert page == root / "report" / "index.html"
    imgs = _imgs(page)
    assert {p.name for p in imgs} == {
        "fig1_damage_vs_metrics.png",
        "fig2_mmr_vs_lr.png",
        "fig3_abc.png",
        "fig4_gains.png",
        "scaling.png",
        "lr_sweeps.png",
        "training_curves.png",
    }
    for p in imgs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        h, w = matplotlib.image.imread(p).shape[:2]
        assert h > 100 and w > 100
    text = page.read_text()
    assert "http://" not in text and "https://" not in text and "not run in this study" not in text


def test_tables_show_the_chosen_rows(full):
    root, page = full
    html = page.read_text()
    best = fp_loss("muon", SIZES["s3"], BEST["muon"])
    assert f"{best:.4f} (1e-2)</td>" in _section(html, "fp")  # Table 2: Muon's best-LR run at s3
    worse = fp_loss("muon", SIZES["s3"], 1)
    assert f"{worse:.4f}" not in _section(html, "fp")  # a non-best LR never enters Table 2
    dmg = DAMAGE["shampoo"] * 1.4  # s3, RTN
    assert f'<td class="best">{dmg:+.4f}</td>' in _section(html, "ptq")  # smallest Δ at s3 is bold
    qat = _section(html, "qat")  # Shampoo at s2: FP twin, QAT loss, and the smallest gap in bold
    fp_s2 = fp_loss("shampoo", SIZES["s2"], 1)
    assert f'<td>{fp_s2:.4f}</td><td>{fp_s2 * 1.01:.4f}</td><td class="best">+1.00</td>' in qat
    scaling = _section(html, "scaling")
    assert "0.822 [0.772, 0.872]" in scaling and "at bound: rho_4bit" in scaling  # SOAP ρ; PSGD's note
    assert "<td>0.879</td>" in scaling and "paper — Table 10" in scaling
    assert "1.50×" in _section(html, "fp") and "2.00×" in _section(html, "fp")  # Shampoo time, state vs AdamW


def test_markdown_headline_tables(full):
    root, _ = full
    md = report_markdown(root)
    for title in ("Table 2", "Table 3", "Table 4", "Table 10"):
        assert f"### {title}" in md
    assert f"**{fp_loss('muon', SIZES['s1'], 2):.4f} (1e-2)**" in md  # best loss of s1, bold
    assert "not run" not in md


def test_claims_follow_the_numbers(full, tmp_path):
    root, page = full
    got = {k: c.agree for k, (_, c) in check_claims(load_study(root)).items()}
    assert got["ptq_least"] == "yes" and got["ptq_most"] == "yes" and got["qat_least"] == "yes"
    assert got["fp_best"] == "yes" and got["mmr_low"] == "yes" and got["g1_one"] == "yes"
    assert got["gain_rank"] == "yes" and got["a_dominates"] == "yes" and got["rl_predicts"] == "yes"
    assert got["mmr_lr"].startswith("n/a") and got["shampoo_cost"] == "yes" and got["rho_rank"] == "yes"
    assert '<td class="t yes">yes</td>' in _section(page.read_text(), "claims")
    flipped = make_study(tmp_path / "flip", qat=False, fits=None, damage={**DAMAGE, "muon": 0.01})
    got = {k: c.agree for k, (_, c) in check_claims(load_study(flipped)).items()}
    assert got["ptq_least"] == "no" and got["ptq_most"] == "no" and got["qat_least"].startswith("n/a")


def test_partial_study_says_not_run(tmp_path):
    root = make_study(tmp_path / "fp_only", cl=False, qat=False, fits=None)
    (root / "report" / "figures").mkdir(parents=True)
    (root / "report" / "figures" / "stale.png").write_bytes(b"old")
    page = render_report(root)
    assert not (root / "report" / "figures" / "stale.png").exists()
    html = page.read_text()
    for sid in ("ptq", "qat", "scaling", "abc"):
        assert "not run in this study" in _section(html, sid), sid
    assert {p.name for p in _imgs(page)} == {"scaling.png", "lr_sweeps.png", "training_curves.png"}
    assert all(p.is_file() for p in _imgs(page))
    md = report_markdown(root)
    assert md.count("_not run in this study") >= 4  # Tables 3, 3b, 4, 10, 10b


def test_empty_and_bad_study_dirs(tmp_path):
    with pytest.raises(OptquantError, match="does not exist"):
        render_report(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    html = render_report(empty).read_text()
    assert "<img" not in html and html.count("not run in this study") >= 10
    bad = tmp_path / "bad"
    bad.mkdir()
    pd.DataFrame({"size": ["s1"], "value": [1.0]}).to_parquet(bad / "results.parquet")
    with pytest.raises(OptquantError, match="lacks column"):
        render_report(bad)


def test_plain_fits_schema_and_fp_mmr_sweep(tmp_path):
    root = make_study(tmp_path / "plain", qat=False, fits="plain", mmr_sweep=True)
    d = load_study(root)
    assert ("SOAP", "0.750 [0.650, 0.850]") == table10(d).rows[-1][:2]  # plain ρ with its interval
    assert table10_joint(d).rows[0][2] == "0.700"  # no interval stored: the value alone
    fig2 = fig2_mmr_vs_lr(d, tmp_path / "figs")
    assert "kind=fp, scheme=none, metric=mmr (54 rows" in fig2.caption
    assert (tmp_path / "figs" / "fig2_mmr_vs_lr.png").is_file()
    got = check_claims(d)
    assert got["mmr_lr"][1].agree == "yes"
    assert got["rho_rank"][1].agree == "no"  # ρ rises in OPTS order here, so Shampoo is not first


CHROMIUM = shutil.which("chromium")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian package 'chromium')")
def test_chromium_loads_every_figure(full, tmp_path):
    _, page = full
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--virtual-time-budget=5000",
        "--dump-dom",
        page.resolve().as_uri(),
    ]
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
    m = re.search(r'data-figures="(\d+)/(\d+)"', dom)
    assert m, dom[:500]
    assert m.group(1) == m.group(2) == str(len(_imgs(page)))


def test_fit_tables_say_not_identified_and_show_diagnostics(tmp_path):
    """fits.json from the real fitting code: the fabricated study's 3 sizes (9×) are too few; six sizes over
    three decades of a known law give numbers and an "identified" verdict."""
    from optquant.scaling import FitConfig, ScalingPoint, fit_joint, fit_laws
    from optquant.study.results import fits

    root = make_study(tmp_path / "few", cl=False, fits=None)
    df = pd.read_parquet(root / "results.parquet")
    (root / "fits.json").write_text(json.dumps(fits(df[df.optimizer.isin(["adamw", "muon"])], "none")))
    d = load_study(root)
    assert [r[1][:40] for r in table10(d).rows] == ["not identified (3 distinct sizes (< 4); "] * 2
    joint = table10_joint(d)
    assert all(c.startswith("not identified (whole fit, see below") for r in joint.rows for c in r[1:])
    assert joint.caption.startswith("The whole fit is not identified: 3 distinct sizes (< 4)")
    diag = fit_diagnostics_table(d)
    assert [r[0] for r in diag.rows] == ["AdamW (per optimizer)", "Muon (per optimizer)", "joint (headline)"]
    assert {r[2] for r in diag.rows} == {"3 over 9×"} and all(r[-1].startswith("not identified: 3") for r in diag.rows)

    rho = {"adamw": 0.85, "muon": 0.75}
    pts = [ScalingPoint(o, n, 400 / (n * r) ** 0.3 + 1.8, q) for o, rq in rho.items()
           for n in np.geomspace(1e6, 1e9, 6) for q, r in ((False, 1.0), (True, rq))]
    cfg = FitConfig(n_boot=6)
    good = {"per_optimizer": {o: f.to_dict() for o, f in fit_laws(pts, cfg).items()},
            "joint": fit_joint(pts, cfg).to_dict(), "headline": "joint", "n_count": "non_embedding"}
    (root / "fits.json").write_text(json.dumps(good, allow_nan=False))
    d = load_study(root)
    assert [r[1][:5] for r in table10(d).rows] == ["0.850", "0.750"]
    assert [r[2][:5] for r in table10_joint(d).rows] == ["0.850", "0.750"]
    assert "N counts non_embedding" in table10(d).caption and "headline" in table10_joint(d).caption
    assert [r[-1] for r in fit_diagnostics_table(d).rows] == ["identified"] * 3
