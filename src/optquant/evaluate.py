"""Evaluation: validation loss and a built-in offline multiple-choice task.

The paper scores models by LM-Evaluation-Harness zero-shot acc_norm averaged over PIQA, HellaSwag and
ARC-Easy (paper.md §2.4), which needs datasets this project never downloads. The built-in task is a
stand-in made from the held-out split with the same scoring: an item is m tokens of context from a
validation document, and the choices are its true k-token continuation and K−1 k-token spans from
*other* documents. Like lm-eval, acc = argmax of the summed continuation log-likelihood, and
acc_norm = argmax of that log-likelihood divided by the continuation's length in characters (lm-eval's
`completion_len = len(choice)` on the string; `length="bytes"` or `"tokens"` switch the unit). Ties go
to the first choice, as with np.argmax.

Memory: on a chain model (`embed`, `sublayers()`, `head`: ours and optquant.hf's) the loss and the
choices' log-likelihoods are read from the final hidden states in chunks of rows, at most `LOGITS_BYTES`
of fp32 logits at a time, so the (tokens × vocabulary) logits never exist whole (a 152k vocabulary makes
them 0.6 GB per 1,024 tokens); the multiple-choice task evaluates the head only at the k continuation
positions. Each chunk's cross-entropy is summed in fp64; a batch within one chunk computes exactly what
the unchunked code did.

The real harness (lm-eval) and the adapter that scores our models with it are in harness.py.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from optquant.errors import OptquantError

MC_TOKENS = 1 << 24  # validation tokens the built-in task draws its items from


@contextlib.contextmanager
def eval_mode(*models: nn.Module) -> Iterator[None]:
    """The models in eval mode for the block, each back in its own mode afterwards (also on an error)."""
    modes = [m.training for m in models]
    for m in models:
        m.eval()
    try:
        yield
    finally:
        for m, mode in zip(models, modes, strict=True):
            m.train(mode)


def token_ids(batch) -> Tensor:
    """The token ids (B, T) of a batch given as ids or as an (x, y) pair."""
    return batch[0] if isinstance(batch, tuple | list) else batch


LOGITS_BYTES = 64 * 2**20  # fp32 logits per chunk: the activation buffer of the loss read-out


def hidden_states(model: nn.Module, x: Tensor) -> Tensor | None:
    """The final residual stream (B, T, D) of a chain model (what `head` reads), None for other modules."""
    if not all(hasattr(model, a) for a in ("embed", "sublayers", "head")):
        return None
    h = model.embed(x)
    for sub in model.sublayers():
        h = sub(h)
    return h


def logit_rows(model: nn.Module, x: Tensor, start: int = 0) -> Iterator[tuple[slice, Tensor]]:
    """(rows, fp32 logits) of the positions `start`.. of x (B, T), flattened to rows: a chain model's head in
    chunks (head_rows), any other model's whole output."""
    h = hidden_states(model, x)
    if h is not None:
        return head_rows(model, h[:, start:])
    logits = model(x)[:, start:].float()
    return iter([(slice(None), logits.reshape(-1, logits.size(-1)))])


def head_rows(model: nn.Module, h: Tensor) -> Iterator[tuple[slice, Tensor]]:
    """(rows, fp32 logits) of the hidden states h (…, D) flattened to rows, in chunks of ≤ LOGITS_BYTES."""
    rows = h.reshape(-1, h.shape[-1])
    vocab = model.lm_head.out_features if hasattr(model, "lm_head") else model.head(rows[:1]).shape[-1]
    step = max(1, LOGITS_BYTES // (4 * vocab))
    for i in range(0, rows.shape[0], step):
        yield slice(i, i + step), model.head(rows[i : i + step]).float()


@dataclass(frozen=True)
class LossResult:
    loss: float  # mean next-token cross-entropy (nats), token-weighted over all batches
    ppl: float  # exp(loss)
    tokens: int


@torch.no_grad()
def val_loss(model: nn.Module, batches: Iterable) -> LossResult:
    """Mean CE over fixed batches of (x, y) pairs, or of (B, T+1) token blocks split into x, y.

    Run it on the FP and the quantized model with the same batches to get Δ val loss.
    """
    device = next(model.parameters()).device
    total, count = 0.0, 0
    with eval_mode(model):
        for batch in batches:
            x, y = batch if isinstance(batch, tuple | list) else (batch[:, :-1], batch[:, 1:])
            x, y = x.to(device), y.to(device)
            flat = y.reshape(-1)
            for rows, logits in logit_rows(model, x):
                total += F.cross_entropy(logits, flat[rows], reduction="sum").item()
            count += y.numel()
    if count == 0:
        raise OptquantError("val_loss: no batches given")
    loss = total / count
    return LossResult(loss, math.exp(loss) if loss < 709 else math.inf, count)  # perplexity: inf past float range


@dataclass(frozen=True)
class MCConfig:
    n_items: int = 500
    n_choices: int = 4  # K: the true continuation and K−1 distractors
    context_len: int = 32  # m tokens
    cont_len: int = 8  # k tokens
    seed: int = 0
    length: Literal["chars", "bytes", "tokens"] = "chars"  # the acc_norm unit; lm-eval uses chars


@dataclass(frozen=True)
class MCItem:
    context: tuple[int, ...]
    choices: tuple[tuple[int, ...], ...]
    gold: int  # index of the true continuation in `choices`
    lengths: tuple[int, ...]  # each choice's length in the acc_norm unit


@dataclass(frozen=True)
class MCResult:
    acc: float
    acc_norm: float
    n_items: int


def split_at_eot(tokens: np.ndarray, eot_id: int) -> list[np.ndarray]:
    """The documents of a token stream separated by `eot_id` (empty ones dropped)."""
    tokens = np.asarray(tokens)
    cuts = np.flatnonzero(tokens == eot_id)
    docs = np.split(tokens, cuts)
    return [d[1:] if d.size and d[0] == eot_id else d for d in docs if d[d != eot_id].size]


def _length(ids: tuple[int, ...], tokenizer, unit: str) -> int:
    if unit == "tokens":
        return len(ids)
    if tokenizer is None:
        raise OptquantError(f"multiple choice: length={unit!r} needs a tokenizer (or use length='tokens')")
    text = tokenizer.decode(list(ids))
    return max(1, len(text) if unit == "chars" else len(text.encode("utf-8")))


def _distractors(docs, src: np.ndarray, d: int, true: tuple, cfg: MCConfig, rng) -> list[tuple[int, ...]]:
    """K−1 spans of k tokens from distinct documents other than `d`, all different from `true`."""
    options, used = [true], {d}
    for _ in range(100 * cfg.n_choices):
        if len(options) == cfg.n_choices:
            return options[1:]
        o = int(src[rng.integers(len(src))])
        if o in used:
            continue
        p = int(rng.integers(0, len(docs[o]) - cfg.cont_len + 1))
        cand = tuple(int(t) for t in docs[o][p : p + cfg.cont_len])
        if cand not in options:
            used.add(o)
            options.append(cand)
    raise OptquantError("multiple choice: could not find distinct distractors; too few distinct documents")


def build_mc_items(
    tokens: np.ndarray, cfg: MCConfig = MCConfig(), *, eot_id: int, tokenizer=None
) -> list[MCItem]:
    """Deterministic (seeded) items from a validation token stream; see the module docstring."""
    docs = split_at_eot(tokens, eot_id)
    need = cfg.context_len + cfg.cont_len
    ctx_docs = np.array([i for i, d in enumerate(docs) if len(d) >= need])
    src_docs = np.array([i for i, d in enumerate(docs) if len(d) >= cfg.cont_len])
    if cfg.n_choices < 2 or cfg.context_len < 1 or cfg.cont_len < 1:
        raise OptquantError("multiple choice: need n_choices >= 2, context_len >= 1, cont_len >= 1")
    if ctx_docs.size == 0 or src_docs.size < cfg.n_choices:
        raise OptquantError(
            f"multiple choice: the validation split has {ctx_docs.size} documents of >= {need} tokens and "
            f"{src_docs.size} of >= {cfg.cont_len}; need 1 and {cfg.n_choices}"
        )
    if cfg.n_items > (contexts := sum(len(docs[d]) - need + 1 for d in ctx_docs)):  # 10**9 once ran for hours
        raise OptquantError(f"multiple choice: {cfg.n_items:,} items exceed the {contexts:,} distinct contexts of "
                            f"{need} tokens in the validation split (more would only repeat them); ask for fewer")
    rng = np.random.default_rng(cfg.seed)
    items = []
    for _ in range(cfg.n_items):
        d = int(ctx_docs[rng.integers(ctx_docs.size)])
        s = int(rng.integers(0, len(docs[d]) - need + 1))
        context = tuple(int(t) for t in docs[d][s : s + cfg.context_len])
        true = tuple(int(t) for t in docs[d][s + cfg.context_len : s + need])
        options = [true, *_distractors(docs, src_docs, d, true, cfg, rng)]
        perm = rng.permutation(cfg.n_choices)
        choices = tuple(options[i] for i in perm)
        lengths = tuple(_length(c, tokenizer, cfg.length) for c in choices)
        items.append(MCItem(context, choices, int(np.flatnonzero(perm == 0)[0]), lengths))
    return items


def mc_scores(lls: np.ndarray, lengths: np.ndarray, gold: np.ndarray) -> tuple[float, float]:
    """(acc, acc_norm) from log-likelihoods (N, K), lengths (N, K) and gold indices (N,)."""
    acc = np.argmax(lls, axis=1) == gold
    acc_norm = np.argmax(lls / lengths, axis=1) == gold
    return float(acc.mean()), float(acc_norm.mean())


@torch.no_grad()
def continuation_logliks(model: nn.Module, items: Sequence[MCItem], *, batch_size: int = 16) -> np.ndarray:
    """(N, K) summed log-probabilities of each choice given its item's context."""
    if not items:
        raise OptquantError("multiple choice: no items")
    m, k = len(items[0].context), len(items[0].choices[0])
    if any(len(it.context) != m or any(len(c) != k for c in it.choices) for it in items):
        raise OptquantError("multiple choice: all items must share the context and continuation lengths")
    seq_len = getattr(getattr(model, "cfg", None), "seq_len", None)
    if seq_len is not None and m + k - 1 > seq_len:
        raise OptquantError(f"multiple choice: context+continuation {m + k} exceeds seq_len+1 = {seq_len + 1}")
    device = next(model.parameters()).device
    out = []
    with eval_mode(model):
        for i in range(0, len(items), batch_size):
            chunk = items[i : i + batch_size]
            x = torch.tensor([it.context + c for it in chunk for c in it.choices], device=device)  # (b·K, m+k)
            target = x[:, m:].reshape(-1)  # positions m-1.. predict tokens m..m+k-1
            picked = [torch.log_softmax(lg, dim=-1).gather(-1, target[rows, None])  # the head at the k
                      for rows, lg in logit_rows(model, x[:, :-1], m - 1)]  # continuation positions only
            ll = torch.cat(picked).view(len(x), k).sum(-1)
            out.append(ll.double().cpu().view(len(chunk), -1))
    return torch.cat(out).numpy()


def mc_accuracy(model: nn.Module, items: Sequence[MCItem], *, batch_size: int = 16) -> MCResult:
    lls = continuation_logliks(model, items, batch_size=batch_size)
    lengths = np.array([it.lengths for it in items], dtype=np.float64)
    acc, acc_norm = mc_scores(lls, lengths, np.array([it.gold for it in items]))
    return MCResult(acc, acc_norm, len(items))


def mc_eval(model: nn.Module, data, cfg: MCConfig = MCConfig()) -> MCResult:
    """The built-in task on a TokenData (`.val`, `.tokenizer`, `.eot_id`), drawn from the first MC_TOKENS of
    the validation split (all of the embedded corpus's; a prepared corpus's val split may not fit in memory)."""
    items = build_mc_items(data.val[:MC_TOKENS], cfg, eot_id=data.eot_id, tokenizer=data.tokenizer)
    return mc_accuracy(model, items)
