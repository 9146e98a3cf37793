"""Report tests on a real smoke study (conftest `smoke_study`: `run_study` on 2 optimizers × 2 sizes).

Checks: the page and every referenced PNG exist and decode; each table shows the numbers of the rows it
names in results.parquet / correlations.parquet / best.json (recomputed here independently); the headline
correlation table starts at the largest size and ends with the pooled one; every claim verdict is one of
the three answers (or n/a with a reason); with several seeds and a clear effect, rankings and claims
resolve, and with the smoke study's few units they say "not resolved at this scale"; `optquant report
--markdown` prints the same tables as the page; partial and bad study directories. Several-seed studies are
the real study's files with its rows repeated over seeds (the layout the pipeline writes, other values).
"""

import json
import re
import shutil
import subprocess
from dataclasses import replace
from html import escape
from pathlib import Path

import matplotlib.image
import numpy as np
import pandas as pd
import pytest

from optquant.errors import OptquantError
from optquant.report import headline_tables, render_report, report_markdown
from optquant.report.claims import check_claims
from optquant.report.design import NOT_TESTABLE
from optquant.report.load import load_study
from optquant.report.protocol import cl_table, correlation_table, cost_table, lr_status_table, tuning_table
from optquant.report.scaling import fit_diagnostics_table, table10, table10_joint
from optquant.report.tables import Table, column_digits, table2, table3
from optquant.stats import NOT_RESOLVED, summarize

VERDICTS = {"supported", "contradicted", NOT_RESOLVED}


@pytest.fixture(scope="module")
def page(smoke_study):
    """The page `run_study` rendered (render_report) at the end of the smoke study."""
    return smoke_study / "report" / "index.html"


def _imgs(page: Path) -> list[Path]:
    return [page.parent / src for src in re.findall(r'<img src="([^"]+)"', page.read_text())]


def _section(html: str, sid: str) -> str:
    return html.split(f'<section id="{sid}">')[1].split("</section>")[0]


def _results(root: Path) -> pd.DataFrame:
    return pd.read_parquet(root / "results.parquet")


def test_page_and_every_figure_png(smoke_study, page):
    assert page == smoke_study / "report" / "index.html"
    imgs = _imgs(page)
    assert {"fig1_damage_vs_metrics.png", "fig3_abc.png", "lr_sweeps.png", "scaling.png"} <= {p.name for p in imgs}
    for p in imgs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        h, w = matplotlib.image.imread(p).shape[:2]
        assert h > 100 and w > 100
    text = page.read_text()
    assert "http://" not in text and "https://" not in text


def test_tables_show_seed_summaries_of_the_named_rows(smoke_study, page):
    df, d = _results(smoke_study), load_study(smoke_study)
    html = page.read_text()
    best = df[(df.kind == "fp") & df.best_lr & (df.metric == "final_val_loss")]
    rows = {(r[0], r[1]): r for r in table2(d).rows}
    digits = column_digits([summarize(g["value"]) for _, g in best.groupby(["size", "optimizer"])], 4)
    for (size, opt), g in best.groupby(["size", "optimizer"]):
        cell = summarize(g["value"]).text(digits)
        assert rows[(d.size_label(size), d.label(opt))][3] == cell
        assert cell in re.sub(r"<[^>]+>", "", _section(html, "fp"))
    worse = df[(df.kind == "fp") & ~df.best_lr & (df.metric == "final_val_loss")]["value"]
    assert not any(f"{v:.4f}" in _section(html, "fp") for v in worse if v not in set(best["value"]))
    dl = df[(df.kind == "cl") & (df.scheme == "w4a4-rtn") & (df.metric == "delta_val_loss")]
    t3 = {(r[0], r[1]): r[2] for r in table3(d, "w4a4-rtn").rows}
    digits = column_digits([summarize(g["value"]) for _, g in dl.groupby(["size", "optimizer"])], 4)
    for (size, opt), g in dl.groupby(["size", "optimizer"]):
        assert t3[(d.size_label(size), d.label(opt))] == summarize(g["value"]).text(digits, signed=True)
    assert "pooled (all sizes)" in {r[0] for r in table2(d).rows}


def test_headline_correlation_table_is_per_size_with_n_and_partials(smoke_study):
    df, d = _results(smoke_study), load_study(smoke_study)
    t = correlation_table(d, "w4a4-rtn")
    assert "partial Pearson (FP loss)" in t.columns and "n" in t.columns
    sizes = [r[0] for r in t.rows]
    assert sizes[0] == d.size_label(d.largest()) and sizes[-1] == "pooled (all sizes)"
    ptq = df[(df.scheme == "w4a4-rtn") & (df.metric == "delta_val_loss") & df.kind.isin(["fp", "cl"])]
    n_largest = ptq[ptq["size"] == d.largest()]["run_id"].nunique()
    first = t.rows[0]
    assert first[2].split()[0] == str(n_largest)
    assert [r[2].split()[0] for r in t.rows if r[0] == "pooled (all sizes)"][0] == str(ptq["run_id"].nunique())
    loo = t.columns.index("Pearson LOO range")  # every r with the range of r over its leave-one-out subsets
    for row in t.rows:
        r = float(row[t.columns.index("Pearson")].split()[0])
        lo, hi = (float(v) for v in row[loo].split(" … "))
        assert lo - 0.01 <= r <= hi + 0.01, row


def test_cl_losses_spread_and_unbracketed_lrs(smoke_study):
    df, d = _results(smoke_study), load_study(smoke_study)
    t = cl_table(d)
    loss = df[(df.kind == "cl") & (df.scheme == "none") & (df.metric == "val_loss")]
    for size, g in loss.groupby("size"):
        spread = [r for r in t.rows if r[0] == d.size_label(size) and r[1] == "spread (max − min)"]
        assert spread[0][3] == f"{np.ptp(g['value']):.4f}" and spread[0][2] == f"{len(g)} models"
    best = d.best
    open_ = {k for k, v in best.items() if (v.get("status") or ("edge" if v.get("edge") else "bracketed"))
             not in ("bracketed", "refined")}  # fmt: skip
    lr = lr_status_table(d)
    assert {(r[1], r[0]) for r in lr.rows} == {(d.label(o), d.size_label(s)) for o, s in open_}
    assert all(r[4] for r in lr.rows)  # every unbracketed search carries its reason


def tuned(d):
    """`d` as if every LR and group-ratio search of its study had ended bracketed (the smoke study's 2-point
    grids with one extension often end at an edge), for tests of the rankings rather than of the design."""
    best = {k: {**v, "status": "bracketed", "ratio_status": {f: "bracketed" for f in v.get("ratio_status", {})}}
            for k, v in d.best.items()}
    return replace(d, best=best)


def test_claims_have_three_answers_with_evidence(smoke_study, page):
    got = check_claims(tuned(load_study(smoke_study)))
    for key, (_, c) in got.items():
        assert c.verdict in VERDICTS or c.verdict.startswith(("n/a: ", f"{NOT_TESTABLE}: ")), (key, c.verdict)
        if c.verdict in VERDICTS:
            assert c.ours != "–", key
    units = load_study(smoke_study).seeds("fp", "final_val_loss", best=True).groupby("optimizer").size().min()
    assert units < 5  # 2 sizes × 2 seeds: 2^(1−n) ≥ 0.0625 > α, so no ranking can resolve
    for key in ("fp_best", "mmr_low", "ptq_most"):
        assert got[key][1].verdict == NOT_RESOLVED, key
    assert "reproduction" in _section(page.read_text(), "claims")


def test_a_claim_the_design_cannot_decide_says_not_testable(smoke_study):
    d = tuned(load_study(smoke_study))
    assert d.blocks == {"femto": 3, "nano": 2}  # read from study.json as the study wrote it
    ok = {k: c.verdict for k, (_, c) in check_claims(d).items()}
    assert not any(v.startswith(NOT_TESTABLE) for k, v in ok.items() if k in ("fp_best", "a_dominates")), ok
    shallow = {k: c.verdict for k, (_, c) in check_claims(replace(d, blocks={"femto": 1, "nano": 2})).items()}
    for key in ("a_dominates", "rl_predicts"):  # (gain_rank is n/a: it needs Shampoo's gains too)
        assert shallow[key].startswith(NOT_TESTABLE) and "femto (1)" in shallow[key], key
    assert shallow["fp_best"] == ok["fp_best"]  # a ranking of FP losses does not need depth
    # Muon's AdamW group at the authors' fixed 3e-3 (a study without group tuning): every comparison is untestable
    fixed = {k: {**v, "groups": [{**g, "rule": "fixed"} if g["rule"] == "tied" else g for g in v["groups"]]}
             for k, v in d.best.items()}
    got = {k: c.verdict for k, (_, c) in check_claims(replace(d, best=fixed)).items()}
    for key in ("fp_best", "ptq_most", "mmr_low", "qat_not_fp"):
        assert got[key].startswith(NOT_TESTABLE) and "Muon's embeddings step size" in got[key], key
    assert got["a_dominates"] == ok["a_dominates"] and got["mmr_lr"] == ok["mmr_lr"]
    capped = {**d.best, ("adamw", "nano"): {**d.best[("adamw", "nano")], "status": "cap"}}
    assert "AdamW's LR at nano (cap)" in check_claims(replace(d, best=capped))["fp_best"][1].verdict


def test_depth_of_a_study_from_before_study_json_recorded_it_comes_from_its_runs(smoke_study, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(smoke_study, old)
    info = json.loads((old / "study.json").read_text())
    for v in info["sizes"].values():
        del v["n_layer"]
    (old / "study.json").write_text(json.dumps(info))
    assert load_study(old).blocks == {"femto": 3, "nano": 2}  # from each size's runs' config.json


def test_the_tuning_table_shows_each_best_runs_built_step_sizes(smoke_study):
    from optquant.optim import build_optimizers
    from optquant.report.load import fmt_lr
    from optquant.runs import read_config
    from optquant.train import build_model

    d = load_study(smoke_study)
    t = tuning_table(d)
    df = _results(smoke_study)
    best = df[(df.kind == "fp") & df.best_lr & (df.seed == 0) & (df.metric == "final_val_loss")]
    seen = 0
    for r in best.itertuples():
        cfg = read_config(smoke_study / "runs" / r.run_id)
        opts = build_optimizers(build_model(cfg), cfg.optim)
        lrs = {fmt_lr(g["base_lr"]) for o in opts for g in o.param_groups}
        col = t.columns.index(d.size_label(r.size))
        cells = {row[col].split(" ")[0].rstrip(",") for row in t.rows if row[0] == d.label(r.optimizer)}
        assert cells == lrs, (r.run_id, cells, lrs)
        seen += 1
        if r.optimizer == "muon":  # the AdamW group is tied to the LR at the searched ratio
            rows = [row for row in t.rows if row[0] == "Muon" and row[1] == "embeddings"]
            assert rows[0][3].startswith("tied") and f"({cfg.optim.adam_lr_ratio:.3g} × LR)" in rows[0][col]
    assert seen == 4  # 2 optimizers × 2 sizes


def with_seeds(src: Path, dst: Path, seeds: int, shift: dict[tuple[str, str], float]) -> Path:
    """The smoke study's files with every best-LR FP, CL and QAT row of its first seed repeated over `seeds`
    seeds (small deterministic jitter; the study's other seeds dropped) and `shift[(optimizer, metric)]`
    added to that optimizer's values."""
    shutil.copytree(src, dst)
    df = _results(src)
    rep = df[df.kind.isin(["cl", "qat"]) | ((df.kind == "fp") & df.best_lr)]
    df = df.drop(rep[rep.seed != rep.seed.min()].index)
    rep = rep[rep.seed == rep.seed.min()]
    rng = np.random.default_rng(0)
    out = [df[~df.index.isin(rep.index)]]
    for s in range(seeds):
        part = rep.copy()
        part["seed"] = s
        part["run_id"] = part["run_id"] + ("" if s == 0 else f"-s{s}")
        part["value"] = part["value"] * (1 + 1e-3 * rng.standard_normal(len(part)))
        for (opt, metric), v in shift.items():
            part.loc[(part.optimizer == opt) & (part.metric == metric), "value"] += v
        out.append(part)
    pd.concat(out, ignore_index=True).to_parquet(dst / "results.parquet")
    return dst


def test_rankings_resolve_with_seeds_and_a_clear_effect(smoke_study, tmp_path):
    shift = {("muon", "final_val_loss"): -5.0, ("muon", "mmr"): -10.0, ("muon", "delta_val_loss"): 1.0}
    d = tuned(load_study(with_seeds(smoke_study, tmp_path / "s5", 5, shift)))
    t = table2(d)
    pooled = {r[1]: r[-1] for r in t.rows if r[0] == "pooled (all sizes)"}
    assert pooled == {"Muon": "1", "AdamW": "2"}  # 2 sizes × 5 seeds = 10 units: p = 2/1024 < 0.05
    assert {r[-1] for r in t.rows if r[0] != "pooled (all sizes)"} == {"1="}  # 5 seeds alone: p ≥ 1/16
    assert "± " in t.rows[0][3] and "(n=5)" in t.rows[0][3]
    got = {k: c.verdict for k, (_, c) in check_claims(d).items()}
    assert got["fp_best"] == got["mmr_low"] == got["ptq_most"] == "supported"
    flipped = tuned(load_study(with_seeds(smoke_study, tmp_path / "flip", 5, {("adamw", "delta_val_loss"): 1.0})))
    assert check_claims(flipped)["ptq_most"][1].verdict == "contradicted"


def test_markdown_cli_prints_the_page_tables(smoke_study, page, capsys):
    from optquant.cli import main

    assert main(["report", str(smoke_study), "--markdown"]) == 0
    md = capsys.readouterr().out
    assert md == report_markdown(smoke_study) + "\n"
    html = re.sub(r"<[^>]+>", "", page.read_text())  # a number cell's parts are spans (html.py `_cell`)
    for t in headline_tables(load_study(smoke_study)):
        assert f"### {t.title}" in md
        for row in t.rows[:3]:
            for cell in row:
                assert cell.replace("|", "\\|") in md
                assert escape(cell) in html, cell  # as report/html.py escapes every cell


def test_partial_study_says_not_run(smoke_study, tmp_path):
    root = tmp_path / "fp_only"
    shutil.copytree(smoke_study, root)
    df = _results(root)
    df[df.kind == "fp"].to_parquet(root / "results.parquet")
    for f in ("correlations.parquet", "fits.json"):
        (root / f).unlink()
    (root / "report" / "figures" / "stale.png").write_bytes(b"old")
    html = render_report(root).read_text()
    assert not (root / "report" / "figures" / "stale.png").exists()
    for sid in ("ptq", "qat", "scaling", "abc", "outliers"):
        assert "not run in this study" in _section(html, sid), sid
    assert report_markdown(root).count("_not run in this study") >= 4


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


CHROMIUM = shutil.which("chromium")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian package 'chromium')")
def test_chromium_loads_every_figure_and_no_table_overflows(page, tmp_path):
    """Every image decodes, and at a 1400 px window no table is wider than its box (none clipped or
    scrolled sideways) and the page has no horizontal scroll (the page's load script reports both)."""
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1400,1000", "--virtual-time-budget=5000",
           "--dump-dom", page.resolve().as_uri()]  # fmt: skip
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
    m = re.search(r'data-figures="(\d+)/(\d+)"', dom)
    assert m, dom[:500]
    assert m.group(1) == m.group(2) == str(len(_imgs(page)))
    wide = re.search(r'data-overflow="([^"]*)"', dom)
    assert wide and wide.group(1) == "", wide and wide.group(1)


def test_fit_tables_say_not_identified_and_show_diagnostics(smoke_study, tmp_path):
    """fits.json from the real fitting code: the smoke study's 2 sizes are too few; six sizes over three
    decades of a known law give numbers and an "identified" verdict."""
    from optquant.scaling import FitConfig, ScalingPoint, fit_joint, fit_laws
    from optquant.study.results import fits

    root = tmp_path / "study"
    shutil.copytree(smoke_study, root)
    df = pd.read_parquet(root / "results.parquet")
    (root / "fits.json").write_text(json.dumps(fits(df, "none")))
    d = load_study(root)
    assert [r[1][:40] for r in table10(d).rows] == ["not identified (2 distinct sizes (< 4); "] * 2
    joint = table10_joint(d)
    assert all(c.startswith("not identified (whole fit, see below") for r in joint.rows for c in r[1:])
    assert joint.caption.startswith("The whole fit is not identified: 2 distinct sizes (< 4)")
    diag = fit_diagnostics_table(d)
    assert [r[0] for r in diag.rows] == ["AdamW (per optimizer)", "Muon (per optimizer)", "joint (headline)"]
    assert all(r[2].startswith("2 over ") and r[-1].startswith("not identified: 2") for r in diag.rows)

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


def test_cost_table_shows_the_newton_schulz_dtype(smoke_study, tmp_path):
    """The dtype each run's summary.json records (train() writes it) reaches the cost table; a changed
    summary changes the cell, so the column is read, not assumed."""
    root = tmp_path / "study"
    shutil.copytree(smoke_study, root)
    written = {json.loads(p.read_text()).get("ns_dtype") for p in root.glob("runs/*-muon-*/summary.json")}
    assert len(written) == 1 and written <= {"bf16", "fp32"}
    col = cost_table(load_study(root)).columns.index("Newton–Schulz")
    got = {row[1]: row[col] for row in cost_table(load_study(root)).rows}
    assert got == {"AdamW": "–", "Muon": written.pop()}
    flipped = {"bf16": "fp32", "fp32": "bf16"}[got["Muon"]]
    for path in root.glob("runs/*-muon-*/summary.json"):
        path.write_text(json.dumps({**json.loads(path.read_text()), "ns_dtype": flipped}))
    assert {row[1]: row[col] for row in cost_table(load_study(root)).rows}["Muon"] == flipped


# ---------------------------------------------------------------- figures, as drawn (issue 22)
def _drawn_figures(root: Path, monkeypatch) -> dict:
    """Every figure the report draws, by key, captured where it would be saved (the canvas as drawn)."""
    from optquant.report import curves, figures

    drawn = {}

    def keep(fig, out_dir, key):
        drawn[key] = fig
        return f"figures/{key}.png"

    monkeypatch.setattr(figures, "save", keep)
    monkeypatch.setattr(curves, "save", keep)
    render_report(root)
    return drawn


def test_scaling_curves_pass_through_the_points_they_were_fitted_to(smoke_study, tmp_path):
    """Points and curves in the N the fits used: with the budget counting non-embedding parameters (the
    cpu preset), each drawn curve, read at each drawn point's N, is at the fit's own prediction there and
    within the fit's largest |residual| of the point; read at the total N (the old figure) it is not."""
    from optquant.report.curves import scaling_figure
    from optquant.study.results import fits

    root = tmp_path / "study"
    shutil.copytree(smoke_study, root)
    df = pd.read_parquet(root / "results.parquet").assign(budget_params="non_embedding")
    df.to_parquet(root / "results.parquet")
    (root / "fits.json").write_text(json.dumps(fits(df, "none"), allow_nan=False))
    d = load_study(root)
    fig, count, _ = scaling_figure(d)
    assert count == "non_embedding"
    checked = 0
    for ax, opt in zip([a for a in fig.axes if a.get_visible()], d.optimizers, strict=True):
        res = pd.DataFrame(d.fits["per_optimizer"][opt]["diagnostics"]["residuals"])
        res = res[res["precision"] == "fp"]
        tol = float((res["loss"] - res["predicted"]).abs().max()) + 1e-9
        curve = next(line for line in ax.get_lines() if line.get_label().startswith("fit, FP"))
        cx, cy = np.log(curve.get_xdata()), curve.get_ydata()
        fp = next(c for c in ax.collections if c.get_label() == "FP")
        for x, y in fp.get_offsets():
            assert np.isclose(res["n_params"], x).any(), (opt, x, sorted(set(res["n_params"])))
            at = float(np.interp(np.log(x), cx, cy))
            predicted = float(res.loc[np.isclose(res["n_params"], x), "predicted"].iloc[0])
            assert abs(at - predicted) < 1e-3 * abs(predicted)
            assert abs(at - y) <= tol, (opt, x, at, y, tol)
            checked += 1
        total = float(df.loc[(df["optimizer"] == opt) & (df["n_params_non_embedding"] == res["n_params"].iloc[0]),
                             "n_params"].iloc[0])
        assert abs(float(np.interp(np.log(total), cx, cy)) - res["predicted"].iloc[0]) > 0.05  # the old figure
    assert checked == 2 * len(d.optimizers)


def _overlaps(fig) -> list[str]:
    """Tick labels (in view, non-empty) whose boxes overlap on the same axis, as drawn."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    bad = []
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
            lo, hi = sorted(axis.get_view_interval())
            labels = [t for t, v in zip(axis.get_majorticklabels(), axis.get_majorticklocs(), strict=False)
                      if t.get_visible() and t.get_text() and lo <= v <= hi]
            boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in labels]
            for i, (a, ba) in enumerate(boxes):
                bad += [f"{ax.get_title()[:20]!r} {name}: {a!r} / {b!r}" for b, bb in boxes[i + 1:] if ba.overlaps(bb)]
    return bad


def test_figures_have_no_colliding_tick_labels_and_integer_layer_ticks(smoke_study, tmp_path, monkeypatch):
    root = tmp_path / "study"
    shutil.copytree(smoke_study, root)
    drawn = _drawn_figures(root, monkeypatch)
    assert {"lr_sweeps", "fig1_damage_vs_metrics", "fig2_mmr_vs_lr", "fig3_abc", "scaling"} <= set(drawn)
    for key, fig in drawn.items():
        assert _overlaps(fig) == [], key
    for key in ("fig3_abc", "fig4_gains"):
        axes = [a for a in drawn[key].axes if a.get_visible()]
        assert all(float(v).is_integer() for a in axes for v in a.get_xticks()), key
    g4 = [a.get_xlim() for a in drawn["fig4_gains"].axes if a.get_visible()]
    assert len(set(g4)) == 1  # G, G₁ and G₂ over the same layers


def test_log_axis_ticks_stay_apart_over_many_decades():
    from optquant.report.figures import grid, log_axis
    from optquant.report.load import fmt_lr

    for lo, hi in ((1e-4, 1e-1), (3e-3, 2e-2), (1e-9, 1e-1), (5e-4, 7e-4)):
        fig, axes = grid(3)
        for ax in axes:
            ax.plot(np.geomspace(lo, hi, 7), np.arange(7))
            log_axis(ax, "x", fmt_lr)
        assert _overlaps(fig) == [], (lo, hi)
        lim = axes[0].get_xlim()
        assert lo / lim[0] < 2 and lim[1] / hi < 2  # no empty decades around the data
        assert sum(lim[0] <= t <= lim[1] for t in axes[0].get_xticks()) >= 1


def test_one_dominant_point_is_found_and_loo_shows_it():
    from optquant.report.figures import dominant, loo_range

    rng = np.random.default_rng(0)
    y = pd.Series(rng.normal(0.01, 0.003, 60), index=[f"run{i}" for i in range(60)])
    x = rng.normal(3, 1, 60)
    assert dominant(y) is None
    y["run7"], x[7] = 1.23, 40.0
    idx, linthresh = dominant(y)
    assert idx == "run7" and 0 < linthresh < 0.1
    lo, hi = loo_range(x, y.to_numpy())
    assert hi > 0.95 and lo < 0.5  # r ≈ 1 with the point, near 0 without it


def test_columns_are_printed_at_the_precision_of_their_intervals():
    from optquant.stats import Summary

    tight = [summarize([5.3851, 5.3853, 5.3856]), summarize([5.1, 5.1002, 5.1003])]
    assert column_digits(tight, 4) == 4  # half-widths ~5e-4: four decimals
    loose = [summarize([0.0, 0.0017, 0.0033]), summarize([-0.0017, 0.0, 0.0017])]
    assert column_digits(loose, 4) == 3  # ~4e-3: three
    assert column_digits([summarize([1.0])], 4) == 4  # no interval: the column's default
    assert Summary(-0.00001, 0.001, 3, -0.002, 0.002).text(3, signed=True) == "0.000 ± 0.001 [-0.002, +0.002] (n=3)"


def test_every_table_names_optimizers_by_their_label():
    """One formatter at the table layer: a table built from raw names shows the paper's label in an optimizer
    column and in headers, a plugin's path shortened, other cells as given; a rebuilt table is unchanged."""
    plugin = "examples/lion.py:make_optimizer"
    t = Table("k", "t", ("optimizer", "adamw", plugin, "muon rate"),
              (("muon", "soap", plugin, "x"), (plugin, "adamw", "1", "2")))
    assert t.columns == ("optimizer", "AdamW", "lion.py:make_optimizer", "muon rate")
    assert t.rows == (("Muon", "soap", plugin, "x"), ("lion.py:make_optimizer", "adamw", "1", "2"))
    assert replace(t, caption="c").rows == t.rows
