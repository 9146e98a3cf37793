"""The training loop: train(cfg, run_dir) -> summary, top to bottom.

Follows the authors' code (paper.md §2.3): fp32 master weights, bf16 autocast, random-window batches,
WSD schedule (5 % linear warm-up from 0.001·lr, constant, last 20 % linear decay to 0) or cosine, no
gradient clipping, evaluation on a fixed validation set (in fp32: the evaluator that measures PTQ
damage). Beyond it: a checkpoint at every evaluation with everything needed to resume *exactly* (on CPU
a killed-and-resumed run ends bitwise where an uninterrupted one does), optionally kept for every
evaluation (`keep_history`); a Common Loss checkpoint (the first evaluation at or below
`train.cl_threshold`, with fine evaluations every `cl_eval_every` steps from `cl_eval_from` on, so the
crossing is found to the step); and divergence recorded (status, step, reason) rather than a crash: a
NaN/inf loss, or a loss above `train.diverge_factor` × ln(vocab_size), the loss of a uniform guess.
`robust.method` (quant/robust.py) adds a quantization-robust method through three calls: before the
step, in the loss, after the optimizer step; a weight average (ema, lawa) is what evaluations and the saved
weights see, its state in the checkpoint beside the raw weights; "none" leaves the loop as it was.
Distributed data parallel is used when launched under torchrun (WORLD_SIZE > 1).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from optquant import distributed as dist
from optquant.checkpoint import load_checkpoint, rng_state, save_checkpoint, save_weights, set_rng_state
from optquant.compiled import maybe_compile
from optquant.config import RunConfig, TrainConfig, to_dict, validate
from optquant.corpus.manifest import is_prepared
from optquant.data import check_enough, check_epochs, fixed_batches, get_batch, load_tokens
from optquant.device import use_bf16
from optquant.errors import OptquantError
from optquant.evaluate import val_loss
from optquant.files import atomic_write_json, open_nofollow
from optquant.model import LM, count_params, lm_loss
from optquant.optim import build_optimizers, ns_dtype, state_bytes
from optquant.quant.qat import prepare_qat_, relative_degradation
from optquant.quant.robust import Robust
from optquant.runs import RunDir, check_corpus, read_summary, truncate_metrics, write_config
from optquant.runs import run_dir as twin_dir
from optquant.tracking import Tracker, open_tracker

log = logging.getLogger(__name__)


def lr_multiplier(step: int, total: int, cfg: TrainConfig) -> float:
    """The schedule's factor on every group's base lr at optimizer step `step` (0-based)."""
    warmup = round(total * cfg.warmup_frac)
    if step < warmup:
        return 0.001 + (1 - 0.001) * step / warmup
    if cfg.schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
    decay = round(total * cfg.decay_frac)
    if step >= total - decay:
        return (total - step) / decay
    return 1.0


def steps_for(cfg: RunConfig, n: int) -> int:
    """The steps of `cfg` for a model of `n` parameters as train.budget_params counts them."""
    if cfg.train.steps > 0:
        return cfg.train.steps
    return max(1, math.ceil(cfg.train.tokens_per_param * n / (cfg.train.batch_size * cfg.model.seq_len)))


def autocast(device: torch.device, bf16: bool):
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()


def validation_loss(model: nn.Module, batches: list) -> float:
    """The run's validation loss, always in fp32: the evaluator that PTQ damage and Common-Loss crossings
    are measured with (evaluate.val_loss), whatever precision the training steps use."""
    return val_loss(model, batches).loss


def build_model(cfg: RunConfig) -> nn.Module:
    model = LM(cfg.model)
    if cfg.qat is not None:
        prepare_qat_(model, cfg.qat)
    return model


@dataclass(frozen=True)
class _Loop:
    """What the loop works with, built once by _setup; the loop's changing state is the `state` dict that
    checkpoints carry. `model` owns the weights; `ddp_model` is it wrapped for DDP, `run_model` that
    compiled for the step, and `eval_model` the model compiled for evaluation."""

    cfg: RunConfig
    run: RunDir
    ctx: dist.Context
    model: nn.Module
    ddp_model: nn.Module
    run_model: nn.Module
    eval_model: nn.Module
    optimizers: list
    tokens: np.ndarray  # the training split
    val: list  # this rank's share of the fixed validation batches
    gen: torch.Generator  # this rank's data stream
    tracker: Any
    steps: int
    micro: int  # sequences per forward pass: the batch split over accumulation steps and processes
    bf16: bool  # the steps' autocast
    bound: float  # a loss above it has diverged (train.diverge_factor × ln vocab; 0 = off)
    robust: Any = None  # quant.robust.Robust for a robust.method other than "none"


def train(cfg: RunConfig, run_dir: Path, on_step: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Train one run in `run_dir`, resuming from its checkpoint if there is one; returns the summary."""
    run_dir = Path(run_dir)
    ctx = dist.setup()  # first: its barrier orders this check after rank 0's `--force` removal
    if (done := read_summary(run_dir)) is not None:
        dist.teardown(ctx)
        return done
    r = _setup(cfg, run_dir, ctx)
    steps, tc = r.steps, cfg.train
    state = _resume(r)
    if ctx.rank == 0:
        truncate_metrics(RunDir(run_dir).metrics, state["step"])
    if tc.keep_history and state["step"] == 0:  # the start, for a crossing at the first evaluation
        _checkpoint(r, state, ctx.gather(rng_state(r.gen)), keep=True)
    ended = None  # (step, reason) when the run diverges
    r.model.train()
    while state["step"] < steps:
        step, t0, c0 = state["step"], time.perf_counter(), time.process_time()
        mult = lr_multiplier(step, steps, tc)
        if r.robust is not None:
            r.robust.begin(step)
        loss = _forward_backward(r, mult, step)
        if (reason := divergence("train loss", loss, r.bound)) is not None:
            ended = (step, reason)
            break
        for opt in r.optimizers:
            opt.step()
        if r.robust is not None:
            r.robust.end(step)
        for opt in r.optimizers:
            opt.zero_grad(set_to_none=True)
        state["train_time"] += time.perf_counter() - t0
        state["cpu_time"] += time.process_time() - c0
        state["timed_steps"] += 1
        state["step"] = step + 1
        _log_step(r, state, on_step, {"loss": loss, "lr_mult": mult}, t0)
        if _regular(tc, state, steps) or _near_cl(tc, state):
            if (reason := _evaluate_and_checkpoint(r, state, loss, mult)) is not None:
                ended = (state["step"], reason)
                break
            if tc.stop_at_cl and state["cl_step"] is not None:
                break
    summary = _finish(r, state, ended)
    dist.teardown(ctx)
    return summary


def _setup(cfg: RunConfig, run_dir: Path, ctx: dist.Context) -> _Loop:
    """Check the input, seed every RNG, write config.json, build the model and optimizers, draw the
    validation set. Bad input raises before the run directory exists."""
    validate(cfg)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    tc = cfg.train
    if tc.batch_size % (tc.grad_accum * ctx.world_size):
        raise OptquantError(f"train.batch_size={tc.batch_size} is not divisible by grad_accum×processes "
                            f"= {tc.grad_accum}×{ctx.world_size}")
    data = load_tokens(cfg.data, cfg.model.vocab_size)
    micro = tc.batch_size // (tc.grad_accum * ctx.world_size)
    check_enough(data.train, micro, cfg.model.seq_len, "train")
    val_batch = tc.batch_size // tc.grad_accum  # one process's micro-batch, split over the ranks below
    check_enough(data.val, val_batch, cfg.model.seq_len, "val")
    model = build_model(cfg).to(ctx.device)
    steps = steps_for(cfg, count_params(model, embeddings=tc.budget_params == "total"))
    check_epochs(cfg.data, steps * tc.batch_size * cfg.model.seq_len, len(data.train))
    if RunDir(run_dir).checkpoint.exists():  # a resume: on the corpus it began on, never a re-prepared one
        check_corpus(run_dir, cfg.data.source)
    if ctx.rank == 0:  # after every check of the input: bad input leaves no run directory behind
        write_config(run_dir, cfg, data.cache_key if is_prepared(cfg.data.source) else None)
    tracker = open_tracker(cfg.log, run_dir, to_dict(cfg)) if ctx.rank == 0 else Tracker()  # no-op unless log.to
    optimizers = build_optimizers(model, cfg.optim)
    ddp_model = ctx.wrap(model)
    run_model = maybe_compile(ddp_model, tc.compile, ctx.device)
    eval_model = run_model if ddp_model is model else maybe_compile(model, tc.compile, ctx.device)
    # The validation set must not depend on how many processes train: draw it as one process would and
    # give each rank an equal share (ctx.mean of equal-size shares is the mean over the whole set).
    val = [(x.chunk(ctx.world_size)[ctx.rank], y.chunk(ctx.world_size)[ctx.rank]) for x, y in
           fixed_batches(data.val, tc.eval_batches, val_batch, cfg.model.seq_len, seed=cfg.seed + 12345)]
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + 17 + ctx.rank)
    robust = Robust(cfg.robust, model, steps, ctx.world_size, tc.eval_every) if cfg.robust.method != "none" else None
    return _Loop(cfg, RunDir(run_dir), ctx, model, ddp_model, run_model, eval_model, optimizers, data.train, val, gen,
                 tracker, steps, micro, use_bf16(tc.precision, ctx.device),
                 tc.diverge_factor * math.log(cfg.model.vocab_size), robust)


def _resume(r: _Loop) -> dict[str, Any]:
    """The loop state: fresh, or restored with the model, optimizers and every RNG from the checkpoint."""
    ckpt = r.run.checkpoint
    if not ckpt.exists():
        return {"step": 0, "best_val": math.inf, "cl_step": None, "train_time": 0.0, "cpu_time": 0.0,
                "timed_steps": 0}
    saved = load_checkpoint(ckpt, r.model)
    step = saved.get("loop", {}).get("step") if isinstance(saved, dict) and isinstance(saved.get("loop"), dict) \
        else None
    if type(step) is not int or not 0 <= step <= r.steps:
        raise OptquantError(f"{ckpt} is at step {step!r}, not within this run's {r.steps} steps; delete it to "
                            "train this run from scratch")
    _load_optimizer_states(ckpt, r.cfg, r.optimizers, saved)
    rngs = saved["rng"] if isinstance(saved["rng"], list) else [saved["rng"]]
    if len(rngs) != r.ctx.world_size:
        raise OptquantError(f"{ckpt} was written by {len(rngs)} process(es); resume it with as many "
                            f"(torchrun --nproc_per_node={len(rngs)})")
    set_rng_state(rngs[r.ctx.rank], r.gen)
    if r.robust is not None:
        r.robust.load(saved.get("robust"))
    log.info("resumed %s at step %d", ckpt.parent.name, saved["loop"]["step"])
    return {"cpu_time": 0.0, **saved["loop"]}  # a checkpoint from before CPU time was kept has none


def _forward_backward(r: _Loop, mult: float, step: int) -> float:
    """Set the step's lr; one optimizer step's gradients over grad_accum micro-batches; returns the mean
    loss over ranks (the cross-entropy: a robust penalty is in the gradients, not in the loss reported)."""
    for opt in r.optimizers:
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * mult
    cfg, device = r.cfg, r.ctx.device
    accum, loss_sum = cfg.train.grad_accum, 0.0
    for i in range(accum):
        x, y = get_batch(r.tokens, r.micro, cfg.model.seq_len, r.gen)
        with r.ctx.no_sync(r.ddp_model, last=i == accum - 1), autocast(device, r.bf16):
            penalized = None if r.robust is None else r.robust.loss(r.run_model, x.to(device), y.to(device), step)
            loss = (lm_loss(r.run_model, x.to(device), y.to(device)) if penalized is None else penalized[0]) / accum
        loss.backward()
        loss_sum += (loss if penalized is None else penalized[1] / accum).item()  # the CE: what runs compare
    return r.ctx.mean(loss_sum)


def _log_step(r: _Loop, state: dict, on_step: Callable[[dict], None] | None, record: dict, t0: float) -> None:
    """The progress callback (mean throughput so far) and the tracker (this step's throughput)."""
    per_step = r.cfg.train.batch_size * r.cfg.model.seq_len
    if on_step is not None and r.ctx.rank == 0:
        on_step({"step": state["step"], "total": r.steps, **record,
                 "tokens_per_s": per_step * state["timed_steps"] / state["train_time"]})
    r.tracker.step(state["step"], {**record, "tokens_per_s": per_step / (time.perf_counter() - t0)})


def _regular(tc: TrainConfig, state: dict, steps: int) -> bool:
    """An evaluation every eval_every steps and at the end; each one saves the resumable checkpoint."""
    return state["step"] % tc.eval_every == 0 or state["step"] == steps


def _evaluate_and_checkpoint(r: _Loop, state: dict, loss: float, mult: float) -> str | None:
    """The validation loss (fp32; the same on every rank, so every rank breaks alike) into metrics.jsonl;
    the Common-Loss model at the first evaluation at or below the threshold; the resumable checkpoint at
    regular evaluations. Returns why the run diverged, else None."""
    cfg, ctx, step = r.cfg, r.ctx, state["step"]
    with _averaged(r):
        val = ctx.mean(validation_loss(r.eval_model, r.val))
    if (reason := divergence("val loss", val, r.bound)) is not None:
        return reason
    state["best_val"] = min(state["best_val"], val)
    state["last_val"] = val
    threshold = cfg.train.cl_threshold
    crossed = threshold is not None and state["cl_step"] is None and val <= threshold
    if crossed:
        state["cl_step"] = step
    rngs = ctx.gather(rng_state(r.gen))  # every rank's data stream, for an exact resume
    if ctx.rank == 0:
        r.tracker.record("eval", step, _eval_record(r, state, loss, mult, val))
        if crossed:
            with _averaged(r):
                save_weights(r.run.weights("cl"), r.model, {
                    "step": str(step), "val_loss": repr(val), "threshold": repr(threshold)})
    if _regular(cfg.train, state, r.steps):
        _checkpoint(r, state, rngs, keep=cfg.train.keep_history)
    return None


def _checkpoint(r: _Loop, state: dict, rngs: list, keep: bool) -> None:
    """Rank 0 writes the resumable checkpoint (and, with `keep`, keeps this step's copy in history/)."""
    if r.ctx.rank != 0:
        return
    extra = {} if r.robust is None or (avg := r.robust.state()) is None else {"robust": avg}
    save_checkpoint(r.run.checkpoint, r.model, {"optimizers": [o.state_dict() for o in r.optimizers],
                                      "optimizer": r.cfg.optim.name, "rng": rngs, "loop": state, **extra})
    if keep:
        _keep(r.run, state["step"])


def _finish(r: _Loop, state: dict, ended: tuple[int, str] | None) -> dict[str, Any]:
    """The summary; rank 0 writes the final weights (unless diverged) and summary.json, which supersede
    the checkpoint."""
    summary = _summarise(r, state, ended)
    if r.ctx.rank == 0:
        if ended is None:
            with _averaged(r):
                save_weights(r.run.weights("final"), r.model)
        _add_qat_degradation(summary, r.cfg, r.run.path)
        atomic_write_json(r.run.summary, summary)
        r.run.checkpoint.unlink(missing_ok=True)
    r.tracker.record("summary", state["step"], summary)
    r.tracker.close()
    return summary


def _averaged(r: _Loop):
    """The model holds the weights the run evaluates and saves inside (a weight average's, else its own)."""
    return nullcontext() if r.robust is None else r.robust.averaged()


def _summarise(r: _Loop, state: dict, ended: tuple[int, str] | None) -> dict[str, Any]:
    cfg, model, optimizers = r.cfg, r.model, r.optimizers
    diverged_step, reason = ended or (None, None)
    summary = {
        "run_id": r.run.name, "status": "done" if ended is None else "diverged",
        "diverged_step": diverged_step, "diverged_reason": reason,
        "steps": state["step"],
        "final_val_loss": state.get("last_val") if ended is None else None,
        "best_val_loss": state["best_val"] if math.isfinite(state["best_val"]) else None,
        "cl_threshold": cfg.train.cl_threshold, "cl_step": state["cl_step"],
        "optimizer": cfg.optim.name, "lr": cfg.optim.lr, "qat": cfg.qat.method if cfg.qat else None,
        "optimizer_state_bytes": state_bytes(optimizers),
        "ns_dtype": ns_dtype(optimizers),  # Muon's/Scion's Newton–Schulz: "bf16", "fp32", or None
        "eigh_retries": sum(getattr(o, "eigh_retries", 0) for o in optimizers),  # Shampoo's fp64 retries
        "mean_step_seconds": state["train_time"] / max(1, state["timed_steps"]),
        # the process's CPU seconds (every thread): what a step costs, whatever else loads the machine
        "mean_step_cpu_seconds": state["cpu_time"] / max(1, state["timed_steps"]),
        "n_params": count_params(model), "n_params_non_embedding": count_params(model, False),
        "total_steps": r.steps, "bf16": r.bf16, "tokens_per_step": cfg.train.batch_size * cfg.model.seq_len,
    }
    summary["tokens_per_s"] = summary["tokens_per_step"] / summary["mean_step_seconds"]
    if r.robust is not None:
        summary["robust"] = r.robust.label
    return summary


def _near_cl(tc: TrainConfig, state: dict) -> bool:
    """A fine evaluation while locating the Common-Loss crossing (every cl_eval_every steps from
    cl_eval_from on, until the crossing), so that every CL model sits just below the threshold."""
    return (tc.cl_threshold is not None and state["cl_step"] is None and tc.cl_eval_every > 0
            and state["step"] >= tc.cl_eval_from and state["step"] % tc.cl_eval_every == 0)


def _keep(run: RunDir, step: int) -> None:
    """Keep this evaluation's checkpoint (a hard link: free; the next save replaces the checkpoint's inode), so a
    later Common-Loss run can start from the last evaluation before its crossing instead of replaying
    the whole run: the run is deterministic, so resuming from it is the same as replaying it."""
    path = run.history_checkpoint(step)
    path.parent.mkdir(exist_ok=True)
    path.unlink(missing_ok=True)
    try:
        os.link(run.checkpoint, path)
    except OSError:  # a file system without hard links
        shutil.copyfile(run.checkpoint, path)


def divergence(what: str, loss: float, bound: float) -> str | None:
    """Why a loss means the run has diverged (NaN/inf, or above `bound` when it is > 0), else None."""
    if not math.isfinite(loss):
        return f"{what} is {loss}"
    if bound > 0 and loss > bound:
        return f"{what} {loss:.4g} is above the divergence bound {bound:.4g} (train.diverge_factor × ln vocab)"
    return None


def _load_optimizer_states(ckpt: Path, cfg: RunConfig, optimizers: list, saved: dict[str, Any]) -> None:
    """Restore the optimizers from a checkpoint, which must come from this run's optimizer."""
    name = saved.get("optimizer", cfg.optim.name)
    states = saved.get("optimizers")
    if name != cfg.optim.name or not isinstance(states, list) or len(states) != len(optimizers):
        raise OptquantError(f"{ckpt} was written by optimizer {name!r}, not {cfg.optim.name!r}; "
                            "delete it to train this run from scratch")
    try:
        for opt, opt_state in zip(optimizers, states, strict=True):
            opt.load_state_dict(opt_state)
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise OptquantError(f"{ckpt}: optimizer state does not match {cfg.optim.name!r} on this model ({e}); "
                            "delete it to train this run from scratch") from None


def _eval_record(r: _Loop, state: dict, loss: float, mult: float, val_loss: float) -> dict:
    cfg = r.cfg
    record = {"step": state["step"], "train_loss": loss, "val_loss": val_loss,
              "lr": cfg.optim.lr * mult, "tokens": state["step"] * cfg.train.batch_size * cfg.model.seq_len}
    with os.fdopen(open_nofollow(r.run.metrics, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a") as f:
        f.write(json.dumps(record) + "\n")
    return record


def _add_qat_degradation(summary: dict, cfg: RunConfig, run_dir: Path) -> None:
    """For a QAT run whose FP twin (same config, no QAT) is done beside it: the paper's relative gap."""
    if cfg.qat is None or summary["final_val_loss"] is None:
        return
    twin = read_summary(twin_dir(run_dir.parent, replace(cfg, qat=None)))
    if twin and twin.get("final_val_loss"):
        summary["fp_twin_val_loss"] = twin["final_val_loss"]
        summary["qat_rel_degradation_pct"] = relative_degradation(
            twin["final_val_loss"], summary["final_val_loss"], "loss")
