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
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from optquant import distributed as dist
from optquant.checkpoint import atomic_write_json, atomic_write_text, load_checkpoint, save_checkpoint, save_weights
from optquant.config import RunConfig, TrainConfig, validate
from optquant.data import check_enough, fixed_batches, get_batch, load_tokens
from optquant.device import use_bf16
from optquant.errors import OptquantError
from optquant.evaluate import val_loss
from optquant.model import LM, count_params, lm_loss
from optquant.optim import build_optimizers, ns_dtype, state_bytes
from optquant.runs import parse_metrics, read_summary, write_config

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


def total_steps(cfg: RunConfig, model: nn.Module) -> int:
    if cfg.train.steps > 0:
        return cfg.train.steps
    n = count_params(model, embeddings=cfg.train.budget_params == "total")
    return max(1, math.ceil(cfg.train.tokens_per_param * n / (cfg.train.batch_size * cfg.model.seq_len)))


def autocast(device: torch.device, bf16: bool):
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()


def validation_loss(model: nn.Module, batches: list) -> float:
    """The run's validation loss, always in fp32: the evaluator that PTQ damage and Common-Loss crossings
    are measured with (evaluate.val_loss), whatever precision the training steps use."""
    return val_loss(model, batches).loss


def rng_state(generator: torch.Generator) -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "data": generator.get_state(),
            "python": list(random.getstate()[1]) + [random.getstate()[2]],
            "numpy": list(np.random.get_state()[1].tolist()) + [int(np.random.get_state()[2])]}


def set_rng_state(state: dict[str, Any], generator: torch.Generator) -> None:
    torch.set_rng_state(state["torch"])
    generator.set_state(state["data"])
    py = state["python"]
    random.setstate((3, tuple(py[:-1]), py[-1]))
    npy = state["numpy"]
    np.random.set_state(("MT19937", np.array(npy[:-1], dtype=np.uint32), npy[-1]))


def build_model(cfg: RunConfig) -> nn.Module:
    model = LM(cfg.model)
    if cfg.qat is not None:
        from optquant.quant.qat import prepare_qat_

        prepare_qat_(model, cfg.qat)
    return model


def train(cfg: RunConfig, run_dir: Path, on_step: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Train one run in `run_dir`, resuming from its checkpoint if there is one; returns the summary."""
    run_dir = Path(run_dir)
    ctx = dist.setup()  # first: its barrier orders this check after rank 0's `--force` removal
    if (done := read_summary(run_dir)) is not None:
        dist.teardown(ctx)
        return done
    device = ctx.device
    validate(cfg)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    tc = cfg.train
    if tc.batch_size % (tc.grad_accum * ctx.world_size):
        raise OptquantError(f"train.batch_size={tc.batch_size} is not divisible by grad_accum×processes "
                            f"= {tc.grad_accum}×{ctx.world_size}")
    micro = tc.batch_size // (tc.grad_accum * ctx.world_size)
    data = load_tokens(cfg.data, cfg.model.vocab_size)
    check_enough(data.train, micro, cfg.model.seq_len, "train")
    val_batch = tc.batch_size // tc.grad_accum  # one process's micro-batch, split over the ranks below
    check_enough(data.val, val_batch, cfg.model.seq_len, "val")
    if ctx.rank == 0:  # after every check of the input: bad input leaves no run directory behind
        write_config(run_dir, cfg)
    tracker = _tracker(cfg, run_dir, ctx.rank)
    model = build_model(cfg).to(device)
    optimizers = build_optimizers(model, cfg.optim)
    ddp_model = ctx.wrap(model)
    from optquant.compiled import maybe_compile  # train.compile: the step and the evaluations

    run_model = maybe_compile(ddp_model, tc.compile, device)
    eval_model = run_model if ddp_model is model else maybe_compile(model, tc.compile, device)
    steps = total_steps(cfg, model)
    bf16 = use_bf16(tc.precision, device)
    # The validation set must not depend on how many processes train: draw it as one process would and
    # give each rank an equal share (ctx.mean of equal-size shares is the mean over the whole set).
    val = [(x.chunk(ctx.world_size)[ctx.rank], y.chunk(ctx.world_size)[ctx.rank]) for x, y in
           fixed_batches(data.val, tc.eval_batches, val_batch, cfg.model.seq_len, seed=cfg.seed + 12345)]
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + 17 + ctx.rank)
    ckpt = run_dir / "checkpoint.safetensors"
    state = _resume(ckpt, cfg, model, optimizers, gen, ctx)
    if ctx.rank == 0:
        _truncate_metrics(run_dir / "metrics.jsonl", state["step"])
    info = {"n_params": count_params(model), "n_params_non_embedding": count_params(model, False),
            "total_steps": steps, "bf16": bf16, "tokens_per_step": tc.batch_size * cfg.model.seq_len}
    status, diverged_step, reason, last_val = "done", None, None, state.get("last_val")
    bound = tc.diverge_factor * math.log(cfg.model.vocab_size)
    if tc.keep_history and state["step"] == 0 and ctx.rank == 0:  # the start, for a crossing at the first eval
        _save(ckpt, cfg, model, optimizers, ctx.gather(rng_state(gen)), state)
        _keep(ckpt, run_dir, 0)
    model.train()
    while state["step"] < steps:
        step, t0 = state["step"], time.perf_counter()
        mult = lr_multiplier(step, steps, tc)
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = group["base_lr"] * mult
        loss_sum = _forward_backward(cfg, ctx, ddp_model, run_model, data.train, micro, gen, bf16)
        if (reason := divergence("train loss", loss_sum, bound)) is not None:
            status, diverged_step = "diverged", step
            break
        for opt in optimizers:
            opt.step()
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        state["train_time"] += time.perf_counter() - t0
        state["timed_steps"] += 1
        state["step"] = step + 1
        if on_step is not None and ctx.rank == 0:
            on_step({"step": step + 1, "total": steps, "loss": loss_sum, "lr_mult": mult,
                     "tokens_per_s": info["tokens_per_step"] * state["timed_steps"] / state["train_time"]})
        tracker.step(state["step"], {"loss": loss_sum, "lr_mult": mult,
                                     "tokens_per_s": info["tokens_per_step"] / (time.perf_counter() - t0)})
        regular = state["step"] % tc.eval_every == 0 or state["step"] == steps
        if regular or _near_cl(tc, state):
            last_val = ctx.mean(validation_loss(eval_model, val))  # the same on every rank: same breaks
            if (reason := divergence("val loss", last_val, bound)) is not None:
                status, diverged_step = "diverged", state["step"]
                break
            state["best_val"] = min(state["best_val"], last_val)
            state["last_val"] = last_val
            threshold = tc.cl_threshold
            crossed = threshold is not None and state["cl_step"] is None and last_val <= threshold
            if crossed:
                state["cl_step"] = state["step"]
            rngs = ctx.gather(rng_state(gen))  # every rank's data stream, for an exact resume
            if ctx.rank == 0:
                tracker.record("eval", state["step"], _eval_record(run_dir, cfg, state, loss_sum, mult, last_val))
                if crossed:
                    save_weights(run_dir / "cl_model.safetensors", model, {
                        "step": str(state["step"]), "val_loss": repr(last_val), "threshold": repr(threshold)})
                if regular:
                    _save(ckpt, cfg, model, optimizers, rngs, state)
                    if tc.keep_history:
                        _keep(ckpt, run_dir, state["step"])
            if tc.stop_at_cl and state["cl_step"] is not None:
                break
    summary = _summarise(run_dir, cfg, state, optimizers, info, status, diverged_step, reason, last_val)
    if ctx.rank == 0:
        if status == "done":
            save_weights(run_dir / "model.safetensors", model)
        _add_qat_degradation(summary, cfg, run_dir)
        atomic_write_json(run_dir / "summary.json", summary)
        ckpt.unlink(missing_ok=True)  # the final weights and summary supersede it
    tracker.record("summary", state["step"], summary)
    tracker.close()
    dist.teardown(ctx)
    return summary


def _resume(ckpt: Path, cfg: RunConfig, model: nn.Module, optimizers: list, gen: torch.Generator,
            ctx) -> dict[str, Any]:
    """The loop state: fresh, or restored with the model, optimizers and every RNG from `ckpt`."""
    if not ckpt.exists():
        return {"step": 0, "best_val": math.inf, "cl_step": None, "train_time": 0.0, "timed_steps": 0}
    saved = load_checkpoint(ckpt, model)
    _load_optimizer_states(ckpt, cfg, optimizers, saved)
    rngs = saved["rng"] if isinstance(saved["rng"], list) else [saved["rng"]]
    if len(rngs) != ctx.world_size:
        raise OptquantError(f"{ckpt} was written by {len(rngs)} process(es); resume it with as many "
                            f"(torchrun --nproc_per_node={len(rngs)})")
    set_rng_state(rngs[ctx.rank], gen)
    log.info("resumed %s at step %d", ckpt.parent.name, saved["loop"]["step"])
    return saved["loop"]


def _save(ckpt: Path, cfg: RunConfig, model: nn.Module, optimizers: list, rngs: list, state: dict) -> None:
    save_checkpoint(ckpt, model, {"optimizers": [o.state_dict() for o in optimizers],
                                  "optimizer": cfg.optim.name, "rng": rngs, "loop": state})


def _forward_backward(cfg: RunConfig, ctx, ddp_model: nn.Module, run_model: nn.Module, tokens, micro: int,
                      gen: torch.Generator, bf16: bool) -> float:
    """One optimizer step's gradients over grad_accum micro-batches; returns the mean loss over ranks."""
    device, accum, loss_sum = ctx.device, cfg.train.grad_accum, 0.0
    for i in range(accum):
        x, y = get_batch(tokens, micro, cfg.model.seq_len, gen)
        with ctx.no_sync(ddp_model, last=i == accum - 1), autocast(device, bf16):
            loss = lm_loss(run_model, x.to(device), y.to(device)) / accum
        loss.backward()
        loss_sum += loss.item()
    return ctx.mean(loss_sum)


def _summarise(run_dir: Path, cfg: RunConfig, state: dict, optimizers: list, info: dict, status: str,
               diverged_step: int | None, reason: str | None, last_val: float | None) -> dict[str, Any]:
    summary = {
        "run_id": run_dir.name, "status": status, "diverged_step": diverged_step, "diverged_reason": reason,
        "steps": state["step"],
        "final_val_loss": last_val if status == "done" else None,
        "best_val_loss": state["best_val"] if math.isfinite(state["best_val"]) else None,
        "cl_threshold": cfg.train.cl_threshold, "cl_step": state["cl_step"],
        "optimizer": cfg.optim.name, "lr": cfg.optim.lr, "qat": cfg.qat.method if cfg.qat else None,
        "optimizer_state_bytes": state_bytes(optimizers),
        "ns_dtype": ns_dtype(optimizers),  # Muon's/Scion's Newton–Schulz: "bf16", "fp32", or None
        "eigh_retries": sum(getattr(o, "eigh_retries", 0) for o in optimizers),  # Shampoo's fp64 retries
        "mean_step_seconds": state["train_time"] / max(1, state["timed_steps"]),
        **info,
    }
    summary["tokens_per_s"] = info["tokens_per_step"] / summary["mean_step_seconds"]
    return summary


def _near_cl(tc: TrainConfig, state: dict) -> bool:
    """A fine evaluation while locating the Common-Loss crossing (every cl_eval_every steps from
    cl_eval_from on, until the crossing), so that every CL model sits just below the threshold."""
    return (tc.cl_threshold is not None and state["cl_step"] is None and tc.cl_eval_every > 0
            and state["step"] >= tc.cl_eval_from and state["step"] % tc.cl_eval_every == 0)


HISTORY = "history"


def history_checkpoint(run_dir: Path, step: int) -> Path:
    """The checkpoint a run with train.keep_history wrote at evaluation `step` (see _keep)."""
    return Path(run_dir) / HISTORY / f"step{step:08d}.safetensors"


def _keep(ckpt: Path, run_dir: Path, step: int) -> None:
    """Keep this evaluation's checkpoint (a hard link: free; the next save replaces `ckpt`'s inode), so a
    later Common-Loss run can start from the last evaluation before its crossing instead of replaying
    the whole run: the run is deterministic, so resuming from it is the same as replaying it."""
    path = history_checkpoint(run_dir, step)
    path.parent.mkdir(exist_ok=True)
    path.unlink(missing_ok=True)
    try:
        os.link(ckpt, path)
    except OSError:  # a file system without hard links
        shutil.copyfile(ckpt, path)


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


def _tracker(cfg: RunConfig, run_dir: Path, rank: int):
    """The run's experiment tracker (optquant.tracking; a no-op one unless log.to is set, and off rank 0)."""
    from optquant.config import to_dict
    from optquant.tracking import Tracker, open_tracker

    return open_tracker(cfg.log, run_dir, to_dict(cfg)) if rank == 0 else Tracker()


def _eval_record(run_dir: Path, cfg: RunConfig, state: dict, loss: float, mult: float,
                 val_loss: float) -> dict:
    record = {"step": state["step"], "train_loss": loss, "val_loss": val_loss,
              "lr": cfg.optim.lr * mult, "tokens": state["step"] * cfg.train.batch_size * cfg.model.seq_len}
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    return record


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop evaluations after the checkpoint we resume from, and a last line cut short by a crash: they
    will be recomputed identically. Rewritten atomically, so a crash here loses nothing."""
    if not path.exists():
        return
    keep = [r for r in parse_metrics(path) if r["step"] <= step]
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in keep))


def _add_qat_degradation(summary: dict, cfg: RunConfig, run_dir: Path) -> None:
    """For a QAT run whose FP twin (same config, no QAT) is done beside it: the paper's relative gap."""
    if cfg.qat is None or summary["final_val_loss"] is None:
        return
    from dataclasses import replace

    from optquant.runs import run_dir as twin_dir

    twin = read_summary(twin_dir(run_dir.parent, replace(cfg, qat=None)))
    if twin and twin.get("final_val_loss"):
        from optquant.quant.qat import relative_degradation

        summary["fp_twin_val_loss"] = twin["final_val_loss"]
        summary["qat_rel_degradation_pct"] = relative_degradation(
            twin["final_val_loss"], summary["final_val_loss"], "loss")
