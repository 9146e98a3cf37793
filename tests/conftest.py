"""Shared fixtures: a tiny synthetic corpus and a nano run config that trains in seconds on CPU.

Tests never touch $HOME: the token cache and matplotlib's config go to temp dirs.
"""

import os
import random
import tempfile

import pytest
import torch

from optquant.device import keep_freed_memory

os.environ.setdefault("MPLCONFIGDIR", tempfile.mkdtemp(prefix="optquant-mpl-"))
# Tests use tiny tensors: one thread is faster than two and immune to a busy neighbour.
torch.set_num_threads(1)
keep_freed_memory()  # as every optquant command does (the tests train in this process)

WORDS = ("the quick brown fox jumps over a lazy dog while seven wise owls sing of rivers and "
         "mountains under silver moons and golden suns in kingdoms far away").split()


def make_corpus(root, n_docs: int = 40, words_per_doc: int = 400, seed: int = 0):
    """Plain-text documents with learnable structure (a noisy Markov chain over a small vocabulary)."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for d in range(n_docs):
        i, out = rng.randrange(len(WORDS)), []
        for _ in range(words_per_doc):
            i = (i + 1) % len(WORDS) if rng.random() < 0.8 else rng.randrange(len(WORDS))
            out.append(WORDS[i])
        (root / f"doc{d:03d}.txt").write_text(" ".join(out) + ".\n")
    return root


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("OPTQUANT_CACHE", str(tmp_path_factory.getbasetemp() / "optquant-cache"))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture
def nano_cfg(corpus):
    """A RunConfig for a ~100k-parameter model that trains 40 steps in a few seconds."""
    from optquant.config import apply_overrides, run_preset

    return apply_overrides(run_preset("nano"), [
        f"data.source={corpus}", "model.vocab_size=320", "model.seq_len=32", "train.batch_size=8",
        "train.steps=40", "train.eval_every=10", "train.eval_batches=2", "train.precision=fp32",
    ])


@pytest.fixture(scope="session")
def runs_cache(tmp_path_factory):
    """Finished runs shared by the session: `train(cfg, run_dir(runs_cache, cfg))` trains cfg the first time
    and, as train() skips a finished run, reads its summary every later time. Tests must not change them."""
    return tmp_path_factory.mktemp("runs-cache")


SMOKE_OVERRIDES = ("run=model.vocab_size=320", "optimizers=adamw,muon", "ptq_schemes=w4a4-rtn,w4a4-gptq-had",
                   "lrs.adamw=0.001,0.003", "sweeps.muon.optim.momentum=0.9,0.95", "workers=1")


@pytest.fixture(scope="session")
def smoke_study(tmp_path_factory, corpus):
    """A real study directory written by `run_study` on the smoke preset reduced to 2 optimizers × 2 sizes and
    2 PTQ schemes, with a 2-point sweep of Muon's momentum (~30 s on one core). test_study checks the pipeline
    on it, test_report the report. Tests that change files must copy it first."""
    from optquant.study.plan import run_study
    from optquant.study_spec import apply_study_overrides, study_preset

    spec = apply_study_overrides(study_preset("smoke"), [f"run=data.source={corpus}", *SMOKE_OVERRIDES])
    root = tmp_path_factory.mktemp("smoke") / "study"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OPTQUANT_CACHE", str(tmp_path_factory.getbasetemp() / "optquant-cache"))
        run_study(spec, root)
    return root
