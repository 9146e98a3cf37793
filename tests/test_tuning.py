"""The study's step sizes (study/tuning.py): group LRs tied to lr, the coordinate search on synthetic loss
surfaces, how each declared step size is classified (and that the declaration is what the optimizers build),
and the default sizes' depth and embedding share."""

import math
from pathlib import Path

import pytest
import torch

from optquant.config import apply_overrides, run_preset
from optquant.model import LM, count_params
from optquant.optim import OPTIMIZERS, build_optimizers
from optquant.study.bracket import bracket
from optquant.study.tuning import initial_ratios, losses, ratio_settings, step_sizes, tune
from optquant.study_spec import StudySpec, cpu, run_config
from optquant.train import build_model


def _lrs(cfg) -> list[list[float]]:
    model = build_model(cfg)
    return [[g["lr"] for g in o.param_groups] for o in build_optimizers(model, cfg.optim)]


def test_group_lrs_are_tied_to_lr_by_their_ratio_or_stay_the_authors_fixed_value():
    base = run_preset("zepto")
    muon = apply_overrides(base, ["optim.name=muon", "optim.lr=0.1"])
    assert _lrs(muon) == [[0.1], [3e-3, 3e-3]]  # the paper's fixed AdamW group
    tied = apply_overrides(base, ["optim.name=muon", "optim.lr=0.1", "optim.adam_lr_ratio=0.5"])
    assert _lrs(tied) == [[0.1], [0.05, 0.05]]
    scion = apply_overrides(base, ["optim.name=scion", "optim.lr=0.1", "optim.embed_lr_ratio=2",
                                   "optim.vector_lr_ratio=0.25"])
    assert _lrs(scion) == [[0.2, 0.025, 0.1]]  # embedding, vectors, matrices
    assert _lrs(apply_overrides(base, ["optim.name=scion", "optim.lr=0.1"])) == [[1.0, 3e-3, 0.1]]


def built_step_sizes(cfg, searched: set[str]) -> list[dict]:
    """The reference: `step_sizes` as it was before the optimizers declared their groups, found by building the
    model and the optimizers at lr and at 2·lr."""
    from dataclasses import replace

    from optquant.optim import split_params

    model = build_model(cfg)
    kinds = {id(p): kind for kind, ps in vars(split_params(model)).items() for p in ps}
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    twice = [g for o in build_optimizers(model, replace(cfg.optim, lr=2 * cfg.optim.lr)) for g in o.param_groups]
    rows, lr = {}, cfg.optim.lr
    for g, g2 in zip([g for o in build_optimizers(model, cfg.optim) for g in o.param_groups], twice, strict=True):
        base, ratio = g["base_lr"], g["base_lr"] / lr
        group = "+".join(sorted({kinds[id(p)] for p in g["params"]}))
        if math.isclose(base, lr, rel_tol=1e-9):
            rule, fld = "searched", None
        elif math.isclose(g2["base_lr"], 2 * base, rel_tol=1e-9):
            fld = next((f for f in sorted(searched) if math.isclose(getattr(cfg.optim, f, math.nan), ratio,
                                                                   rel_tol=1e-9)), None)
            rule = "tied" if fld else "tied-fixed"
        else:
            rule, fld = "fixed", None
        row = rows.setdefault((group, rule, base), {"group": group, "rule": rule, "lr": base, "ratio": ratio,
                                                     "field": fld, "params": 0})
        row["params"] += sum(p.numel() for p in g["params"])
    for row in rows.values():
        row["share"] = row["params"] / total
    return list(rows.values())


LION = str(Path(__file__).parents[1] / "examples" / "lion.py") + ":make_optimizer"


@pytest.mark.parametrize("name", [*OPTIMIZERS, LION])
def test_declared_groups_are_the_built_ones(name):
    """Each optimizer's `lr_groups` against its built optimizers at lr and 2·lr (the trial build it replaced): at
    its defaults, with every tie ratio set (searched, and not), untied embeddings and QAT's extra vectors; a plugin
    by the stated default (one param group per group at lr, as examples/lion.py packs them)."""
    ratios = [r for _, r in getattr(OPTIMIZERS.get(name), "GROUP_LRS", {}).values()]
    base = apply_overrides(run_preset("zepto"), [f"optim.name={name}", "optim.lr=0.02"])
    variants = [base, apply_overrides(base, ["model.tie_embeddings=false", "qat.method=quest"]),
                apply_overrides(base, [f"optim.{r}={0.5 + i}" for i, r in enumerate(ratios)])]
    for cfg in variants:
        for searched in ({*ratios}, set(), {*ratios[:1]}):
            assert step_sizes(cfg, searched) == built_step_sizes(cfg, searched), (cfg.optim, searched)


def test_step_sizes_name_how_every_group_moves_with_lr():
    base = run_preset("zepto")
    rules = lambda cfg, searched=frozenset(): {(g["group"], g["rule"], g["field"]) for g in step_sizes(cfg, searched)}  # noqa: E731
    assert {r for _, r, _ in rules(apply_overrides(base, ["optim.name=adamw"]))} == {"searched"}
    tied = apply_overrides(base, ["optim.name=muon", "optim.adam_lr_ratio=0.3"])
    assert ("embeddings", "tied", "adam_lr_ratio") in rules(tied, {"adam_lr_ratio"})
    assert ("embeddings", "tied-fixed", None) in rules(tied)  # a ratio the study did not search
    assert ("embeddings", "fixed", None) in rules(apply_overrides(base, ["optim.name=muon"]))
    shares = step_sizes(tied, {"adam_lr_ratio"})
    assert math.isclose(sum(g["share"] for g in shares), 1.0)
    assert [g["lr"] for g in shares if g["rule"] == "tied"] == pytest.approx([0.3 * tied.optim.lr] * 2)


def _surface(cfg) -> float:
    """A synthetic final loss: quadratic in log lr and log ratio, optimum lr 0.05 at zepto and 0.15 at atto,
    Muon's ratio optimum 0.8 (off the authors' 0.1 by more than two grid steps)."""
    lr_opt = {"zepto": 0.05, "atto": 0.15}[cfg.preset]
    loss = 3 + math.log(cfg.optim.lr / lr_opt) ** 2
    if cfg.optim.name == "muon":
        loss += math.log(cfg.optim.adam_lr_ratio / 0.8) ** 2
    return loss


def test_the_search_brackets_every_step_size_and_later_sizes_start_from_the_smallest():
    spec = StudySpec(sizes=("zepto", "atto"), optimizers=("adamw", "muon"), lr_extensions=6, tune_groups=True,
                     lr_from_smallest=True)
    submitted = []

    def run(stage, cfgs):
        submitted.append((stage, list(cfgs.values())))
        return {tag: {"status": "done", "final_val_loss": _surface(c)} for tag, c in cfgs.items()}

    found = tune(run, spec, lambda k, lr, r: run_config(spec, k[1], k[0], lr, 0, ratio_settings(r)))
    for (opt, size), t in found.items():
        b = bracket(losses(t.lr_runs))
        assert b.status == "bracketed"
        assert abs(math.log(b.best / {"zepto": 0.05, "atto": 0.15}[size])) <= math.log(3) / 2 + 1e-9
        assert t.lr == b and t.ratio_ends == {f: bracket(losses(r)) for f, r in t.ratio_runs.items()}  # carried
        if opt == "muon":
            assert t.ratio_ends["adam_lr_ratio"].status == "bracketed"
            assert abs(math.log(t.ratios["adam_lr_ratio"] / 0.8)) <= math.log(3) / 2 + 1e-9
        else:
            assert t.ratios == {} and t.ratio_runs == {}
    # the larger size's first grid is centred on the smallest size's best LR, its ratio search on its ratio
    first_atto = next(cfgs for stage, cfgs in submitted if any(c.preset == "atto" for c in cfgs))
    zepto_best = bracket(losses(found[("adamw", "zepto")].lr_runs)).best
    assert sorted(c.optim.lr for c in first_atto if c.optim.name == "adamw") == pytest.approx(
        [zepto_best / 3, zepto_best, zepto_best * 3], rel=1e-3)
    assert initial_ratios(spec, "muon") == {"adam_lr_ratio": 0.1}  # the authors' 3e-3 over their 3e-2


def test_without_group_tuning_the_ratios_are_not_searched():
    spec = StudySpec(sizes=("zepto",), optimizers=("muon",), lr_extensions=2)

    def run(stage, cfgs):
        assert not stage.startswith("group")
        return {t: {"status": "done", "final_val_loss": 3 + math.log(c.optim.lr / 0.05) ** 2} for t, c in cfgs.items()}

    found = tune(run, spec, lambda k, lr, r: run_config(spec, k[1], k[0], lr, 0, ratio_settings(r)))
    assert found[("muon", "zepto")].ratios == {}


def test_the_default_sizes_have_depth_a_bounded_embedding_and_an_8x_span():
    spec = cpu()
    counts = []
    for size in spec.sizes:
        cfg = run_config(spec, size, "adamw")
        assert cfg.model.n_layer >= 2, size
        with torch.device("meta"):
            model = LM(cfg.model)
        counts.append((count_params(model, False), count_params(model)))
    largest = run_config(spec, spec.sizes[-1], "adamw")
    assert largest.model.n_layer >= 4 and largest.train.budget_params == "non_embedding"
    n, total = counts[-1]
    assert (total - n) / total <= 0.5  # the embedding's share at the largest size
    assert counts[-1][0] / counts[0][0] >= 8  # the span in the N the fits count


def test_the_default_study_pins_its_precision():
    spec = cpu()
    for opt in spec.optimizers:
        cfg = run_config(spec, spec.sizes[0], opt)
        assert cfg.train.precision == "fp32"
        assert getattr(cfg.optim, "ns_dtype", "fp32") == "fp32"
    assert spec.tune_groups and spec.lr_from_smallest
