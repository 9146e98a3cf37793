"""Validation loss, the built-in multiple-choice task, and the optional lm-eval adapter.

Strategy: val_loss against a direct cross-entropy; item construction checked for determinism and for
its promises (true continuation follows the context in the same document, distractors from other
documents, lm-eval's character lengths); scoring checked with an oracle model that knows every next
token of the validation stream (acc = acc_norm = 1) and a uniform model (chance, 1/K). The lm-eval
adapter: a clear error without lm_eval, and, with a stub `lm_eval.api.model.TemplateLM`, the same
log-likelihoods as the built-in scorer.
"""

import math
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers
from torch import nn

from optquant.errors import OptquantError
from optquant.evaluate import (
    MCConfig,
    build_mc_items,
    continuation_logliks,
    mc_accuracy,
    mc_eval,
    mc_scores,
    split_at_eot,
    val_loss,
)
from optquant.harness import lm_eval_adapter
from optquant.model import LM, model_config

EOT, V = 0, 50
WORDS = ["<eot>", "<unk>"] + [
    ("abcdefghijklmnopqrstuvwx"[i % 24]) * (1 + i % 7) + str(i) for i in range(V - 2)
]




@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """Word-level: token i decodes to WORDS[i] (lengths 2..9 characters), joined by spaces."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


@pytest.fixture(scope="module")
def val() -> np.ndarray:
    """40 documents of random tokens (ids 2..V-1), each followed by EOT."""
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(2, V, rng.integers(30, 80)), EOT) for _ in range(40)]
    return np.concatenate(docs)


class Oracle(nn.Module):
    """Logits +30 on the token that follows the last `n` tokens somewhere in `stream`, else uniform."""

    def __init__(self, stream: np.ndarray, n: int = 6):
        super().__init__()
        self.n, self.dummy = n, nn.Parameter(torch.zeros(1))
        s = [int(t) for t in stream]
        self.table = {tuple(s[i - n + 1 : i + 1]): s[i + 1] for i in range(n - 1, len(s) - 1)}

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(*idx.shape, V)
        for b, row in enumerate(idx.tolist()):
            for t in range(self.n - 1, len(row)):
                nxt = self.table.get(tuple(row[t - self.n + 1 : t + 1]))
                if nxt is not None:
                    out[b, t, nxt] = 30.0
        return out + self.dummy


class Uniform(nn.Module):
    def __init__(self):
        super().__init__()
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*idx.shape, V) + self.dummy


def test_val_loss_matches_cross_entropy():
    torch.manual_seed(0)
    model = LM(model_config("nano", vocab_size=V, seq_len=16))
    blocks = [torch.randint(0, V, (3, 17)) for _ in range(2)]
    pairs = [(b[:, :-1], b[:, 1:]) for b in blocks]
    with torch.no_grad():
        ref = torch.cat(
            [F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none") for x, y in pairs]
        )
    res = val_loss(model, pairs)
    assert res.loss == pytest.approx(ref.mean().item(), rel=1e-6) and res.tokens == 2 * 3 * 16
    assert res.ppl == pytest.approx(math.exp(res.loss))
    assert val_loss(model, blocks).loss == pytest.approx(res.loss, rel=1e-9)  # (B, T+1) blocks
    with pytest.raises(OptquantError):
        val_loss(model, [])


def test_chunked_loss_and_logliks_equal_the_full_logits(monkeypatch, val, tokenizer):
    """The head read in chunks of rows (7 rows of logits at a time here, as a 152k vocabulary reads ~440)
    gives the loss and the choices' log-likelihoods of the full (B, T, V) logits; the chunks are what is
    computed (a head that records its calls never sees more than 7 rows)."""
    import optquant.evaluate as ev

    torch.manual_seed(0)
    model = LM(model_config("nano", vocab_size=V, seq_len=48)).eval()
    blocks = [torch.randint(0, V, (3, 17)) for _ in range(3)]
    items = build_mc_items(val, MCConfig(n_items=12, context_len=10, cont_len=4), eot_id=EOT, tokenizer=tokenizer)
    with torch.no_grad():
        full = [F.cross_entropy(model(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten(), reduction="sum") for b in blocks]
        x = torch.tensor([it.context + c for it in items for c in it.choices])
        logp = torch.log_softmax(model(x[:, :-1])[:, 9:], dim=-1).gather(-1, x[:, 10:, None]).squeeze(-1).sum(-1)
    monkeypatch.setattr(ev, "LOGITS_BYTES", 4 * V * 7)
    seen, head = [], model.head
    monkeypatch.setattr(model, "head", lambda h: seen.append(h.shape[0]) or head(h))
    assert val_loss(model, blocks).loss == pytest.approx(sum(full).item() / (3 * 3 * 16), rel=1e-6)
    got = continuation_logliks(model, items, batch_size=5)
    np.testing.assert_allclose(got, logp.view(len(items), -1).double().numpy(), rtol=1e-5)
    assert max(seen) == 7 and sum(seen) == 3 * 3 * 16 + len(items) * 4 * 4  # the loss's rows, then only k per choice


def test_split_at_eot():
    docs = split_at_eot(np.array([5, 6, 0, 7, 0, 0, 8, 9, 9]), eot_id=0)
    assert [d.tolist() for d in docs] == [[5, 6], [7], [8, 9, 9]]


def test_items_are_deterministic_and_honest(val, tokenizer):
    cfg = MCConfig(n_items=60, n_choices=4, context_len=12, cont_len=5, seed=1)
    items = build_mc_items(val, cfg, eot_id=EOT, tokenizer=tokenizer)
    assert items == build_mc_items(val, cfg, eot_id=EOT, tokenizer=tokenizer)
    assert items != build_mc_items(
        val, MCConfig(**{**cfg.__dict__, "seed": 2}), eot_id=EOT, tokenizer=tokenizer
    )
    docs = [tuple(int(t) for t in d) for d in split_at_eot(val, EOT)]

    def doc_of(span):
        return {
            i
            for i, d in enumerate(docs)
            for s in range(len(d) - len(span) + 1)
            if d[s : s + len(span)] == span
        }

    for it in items:
        assert len(set(it.choices)) == 4 and 0 <= it.gold < 4
        home = doc_of(it.context + it.choices[it.gold])
        assert home  # the true continuation directly follows the context, in one document
        for j, c in enumerate(it.choices):
            assert it.lengths[j] == len(tokenizer.decode(list(c)))  # lm-eval's character length
            if j != it.gold:
                assert doc_of(c) - home  # taken from another document
    assert np.bincount([it.gold for it in items], minlength=4).min() > 5  # gold position is shuffled


def test_oracle_model_scores_one(val, tokenizer):
    items = build_mc_items(
        val, MCConfig(n_items=40, context_len=12, cont_len=5), eot_id=EOT, tokenizer=tokenizer
    )
    res = mc_accuracy(Oracle(val), items)
    assert (res.acc, res.acc_norm, res.n_items) == (1.0, 1.0, 40)


def test_uniform_model_is_at_chance(val, tokenizer):
    cfg = MCConfig(n_items=400, n_choices=4, context_len=8, cont_len=4, seed=3)
    items = build_mc_items(val, cfg, eot_id=EOT, tokenizer=tokenizer)
    res = mc_accuracy(Uniform(), items, batch_size=64)
    # ties go to the first choice, as np.argmax: acc is exactly the share of items whose gold is 0
    assert res.acc == pytest.approx(np.mean([it.gold == 0 for it in items]))
    assert abs(res.acc - 0.25) < 0.08 and abs(res.acc_norm - 0.25) < 0.08


def test_mc_scores_normalise_by_length():
    lls = np.array([[-10.0, -6.0], [-3.0, -9.0]])
    lengths = np.array([[20.0, 4.0], [3.0, 30.0]])
    # acc picks the likelier total both times (wrong); per character the gold choice wins both times
    assert mc_scores(lls, lengths, np.array([0, 1])) == (0.0, 1.0)
    assert mc_scores(lls, lengths, np.array([1, 0])) == (1.0, 0.0)


def test_mc_eval_on_tokendata_and_errors(val, tokenizer):
    data = types.SimpleNamespace(val=val, tokenizer=tokenizer, eot_id=EOT)
    assert mc_eval(Oracle(val), data, MCConfig(n_items=10, context_len=8, cont_len=3)).acc == 1.0
    with pytest.raises(OptquantError, match="documents"):
        build_mc_items(val, MCConfig(context_len=500), eot_id=EOT, tokenizer=tokenizer)
    with pytest.raises(OptquantError, match="tokenizer"):
        build_mc_items(val, MCConfig(n_items=2), eot_id=EOT)
    tok_items = build_mc_items(val, MCConfig(n_items=2, length="tokens"), eot_id=EOT)
    assert tok_items[0].lengths == (8, 8, 8, 8)
    model = LM(model_config("nano", vocab_size=V, seq_len=16))
    with pytest.raises(OptquantError, match="seq_len"):
        continuation_logliks(model, tok_items)


def test_lm_eval_missing_raises(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    monkeypatch.setitem(sys.modules, "lm_eval.api", None)
    monkeypatch.setitem(sys.modules, "lm_eval.api.model", None)
    with pytest.raises(OptquantError, match="lm-eval is not installed"):
        lm_eval_adapter(Uniform(), None, eot_id=EOT)


class StubTemplateLM:
    """lm_eval.api.model.TemplateLM's contract, reduced: encode the context and the whole string (the tokenizer's
    own special tokens included), split after the context's tokens, score the token requests."""

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        encoded = []
        for r in requests:
            ctx, whole = self.tok_encode(r.args[0]), self.tok_encode(r.args[0] + r.args[1])
            encoded.append((r.args, ctx, whole[len(ctx):]))
        return self._loglikelihood_tokens(encoded)


def test_lm_eval_adapter_with_stub_harness(monkeypatch, val, tokenizer):
    """A stand-in for lm_eval.api.model.TemplateLM: the adapter's log-likelihoods equal the built-in scorer's."""
    stub = types.ModuleType("lm_eval.api.model")
    stub.TemplateLM = StubTemplateLM
    monkeypatch.setitem(sys.modules, "lm_eval", types.ModuleType("lm_eval"))
    monkeypatch.setitem(sys.modules, "lm_eval.api", types.ModuleType("lm_eval.api"))
    monkeypatch.setitem(sys.modules, "lm_eval.api.model", stub)
    torch.manual_seed(0)
    model = LM(model_config("nano", vocab_size=V, seq_len=32))
    items = build_mc_items(
        val, MCConfig(n_items=3, context_len=10, cont_len=4), eot_id=EOT, tokenizer=tokenizer
    )
    adapter = lm_eval_adapter(model, tokenizer, eot_id=EOT)
    text = tokenizer.decode
    requests = [
        types.SimpleNamespace(args=(text(list(it.context)), " " + text(list(c))))
        for it in items
        for c in it.choices
    ]
    got = np.array([ll for ll, _ in adapter.loglikelihood(requests)]).reshape(3, -1)
    # the adapter prepends EOT to the context, so score the same sequences that way
    shifted = [type(it)((EOT, *it.context), it.choices, it.gold, it.lengths) for it in items]
    np.testing.assert_allclose(got, continuation_logliks(model, shifted), rtol=1e-5)
    with pytest.raises(NotImplementedError):
        adapter.generate_until([])
