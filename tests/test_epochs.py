"""The epoch guard: no run or study sees its corpus more than data.max_epochs times, and the dry run says how
many times each size would.

Strategy: the real presets on the real embedded corpus. The gpu preset's 32k-token BPE of it is built once
for the module (the one slow part, ~20 s); its epochs are computed from the planner's tokens and the
corpus's own count, never typed in. The default (16) must pass the cpu and smoke presets (slow: two more
builds) and refuse gpu and paper.
"""

from __future__ import annotations

import pytest

from optquant.cli import main
from optquant.config import apply_overrides, run_id
from optquant.cost import run_cost
from optquant.data import DataConfig, load_tokens
from optquant.errors import OptquantError
from optquant.study.dryrun import check_study_epochs
from optquant.study_spec import apply_study_overrides, cpu, gpu, paper, run_config, smoke
from optquant.train import train


@pytest.fixture(scope="module")
def corpus_32k() -> int:
    return len(load_tokens(DataConfig(), 32000).train)


def test_gpu_dry_run_prints_the_epochs_and_the_study_is_refused(corpus_32k, capsys, tmp_path):
    assert main(["study", "--preset", "gpu", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    for size in gpu().sizes:
        need = run_cost(run_config(gpu(), size, "adamw")).tokens
        line = next(x for x in out if x.split()[:1] == [size] and f"{need:,}" in x and "refused" in x)
        assert f"{corpus_32k:,}" in line and f"{need / corpus_32k:,.2f}" in line and need / corpus_32k > 16
    assert main(["study", "--preset", "gpu", "--out", str(tmp_path / "s"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "size 50m needs 957,087,744 training tokens" in err
    assert "> data.max_epochs=16; prepare a larger corpus (optquant data prepare SOURCE... --out DIR), then " \
           "--set data.source=DIR" in err
    assert not (tmp_path / "s").exists()


def test_paper_preset_is_refused_and_max_epochs_is_a_setting(corpus_32k):
    with pytest.raises(OptquantError, match=r"size 50m needs .* epochs > data.max_epochs=16"):
        check_study_epochs(paper())
    check_study_epochs(apply_study_overrides(gpu(), ["data.max_epochs=1e4"]))  # the user's call, said explicitly


def test_train_refuses_past_max_epochs_and_the_guard_is_not_in_the_run_id(nano_cfg, tmp_path):
    long = apply_overrides(nano_cfg, ["train.steps=100000"])
    with pytest.raises(OptquantError, match=r"this run needs 25,600,000 training tokens .* \(optquant data prepare"):
        train(long, tmp_path / "run")
    assert not (tmp_path / "run").exists()
    assert run_id(apply_overrides(long, ["data.max_epochs=1e9"])) == run_id(long)
    with pytest.raises(OptquantError, match=r"data.max_epochs=0.0: Expected `float` > 0.0"):
        apply_overrides(nano_cfg, ["data.max_epochs=0"])


@pytest.mark.slow
def test_the_cpu_and_smoke_presets_pass_on_the_embedded_corpus():
    for spec in (cpu(), smoke()):
        check_study_epochs(spec)
