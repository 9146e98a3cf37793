"""The LR search (study/bracket.py) on synthetic loss-vs-LR curves: it must end with the optimum bracketed
when the budget allows, flag it when it does not, and stop at divergence."""

import math

import pytest

from optquant.study.bracket import best_lr, bracket, extensions, refinement


def search(loss, grid, step=3.0, max_extensions=3, refine=True):
    """What the study does with a loss function: the same rounds as plan.fp_stage."""
    losses = {lr: loss(lr) for lr in grid}
    for _ in range(max_extensions):
        new = extensions(losses, step)
        if not new:
            break
        losses.update({lr: loss(lr) for lr in new})
    if refine and bracket(losses).status in ("bracketed", "diverged"):
        lr = refinement(losses)
        if lr is not None:
            losses[lr] = loss(lr)
    return losses, bracket(losses)


def parabola(opt):
    """A convex loss in log LR with its minimum at `opt`; diverges above 100·opt."""
    return lambda lr: math.inf if lr > 100 * opt else 3.0 + (math.log(lr / opt)) ** 2


@pytest.mark.parametrize("opt", [3e-3, 0.05, 2e-4])
def test_search_brackets_an_optimum_within_reach(opt):
    losses, b = search(parabola(opt), (1e-3, 3e-3, 9e-3))
    assert b.status == "bracketed"
    lrs = sorted(losses)
    i = lrs.index(b.best)
    assert 0 < i < len(lrs) - 1 and losses[lrs[i - 1]] > losses[b.best] < losses[lrs[i + 1]]
    assert abs(math.log(b.best / opt)) <= math.log(3.0) / 2 + 1e-9  # within half a grid step after refining


def test_optimum_beyond_the_cap_is_flagged_not_hidden():
    losses, b = search(parabola(10.0), (1e-3, 3e-3, 9e-3))  # 3 extensions reach 0.243 only
    assert b.status == "cap" and b.best == max(losses) and "edge" in b.reason
    assert len(losses) == 6  # no refinement of an unbracketed optimum


def test_divergence_ends_the_search_on_that_side():
    loss = parabola(1e-2)
    diverging = lambda lr: math.inf if lr > 2e-2 else loss(lr)  # noqa: E731
    losses, b = search(diverging, (1e-3, 3e-3, 9e-3))
    assert b.status == "diverged" and math.isinf(losses[max(losses)])
    assert b.best < 2e-2 and "diverged" in b.reason
    assert len([lr for lr in losses if lr > 9e-3]) == 1  # one diverged point up, no more


def test_all_diverged_and_empty_inputs():
    losses, b = search(lambda lr: math.nan if lr < 0 else math.inf, (1e-3, 3e-3))
    assert b.status == "no-converged-lr" and b.best is None and extensions(losses, 3.0) == []
    assert best_lr({}) is None and refinement({1e-3: math.inf}) is None


def test_refinement_goes_towards_the_better_neighbour():
    losses = {1e-3: 4.0, 3e-3: 3.0, 9e-3: 3.5}
    assert refinement(losses) == pytest.approx(math.sqrt(3e-3 * 9e-3), rel=1e-3)
    assert extensions(losses, 3.0) == []
    assert extensions({1e-3: 3.0, 3e-3: 3.5}, 3.0) == [pytest.approx(3.333e-4)]
    assert sorted(extensions({1e-3: 3.0}, 2.0)) == [5e-4, 2e-3]  # a single point extends both ways
