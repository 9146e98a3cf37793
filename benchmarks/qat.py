"""Benchmark: the cost of QAT. One training step (forward + backward + AdamW step) of a QAT model as a
ratio to the same step of the FP model, for the CPU presets, in fp32 and under bf16 autocast.

Methods: QuEST W4A4 (the paper's: Hadamard rotation of inputs and weights, RMS scale, trust mask),
absmax-RTN STE and LSQ, all with the LM head quantized (the authors' default). Each cell is the median
of `--steps` timed steps after `--warmup` untimed ones (the same batch every step), all methods timed
round-robin so that load from other jobs hits each alike.

Run: python benchmarks/qat.py [--presets tiny small] [--batch 8] [--steps 10] [--threads 1].
One thread by default: the machine this was measured on has 2 cores shared with other jobs, and
small ops on two threads made timings erratic.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch

from optquant.model import LM, lm_loss, model_config
from optquant.optim import AdamWConfig, build_optimizers
from optquant.quant.qat import QATConfig, prepare_qat_

QAT_VARIANTS: dict[str, QATConfig | None] = {
    "fp": None,
    "quest": QATConfig(),
    "ste": QATConfig(method="ste"),
    "lsq": QATConfig(method="lsq"),
}


def make_step(preset: str, qat: QATConfig | None, bf16: bool, batch: int) -> Callable[[], None]:
    """One forward + backward + AdamW step of a fresh model, as a closure over a fixed batch."""
    torch.manual_seed(0)
    cfg = model_config(preset)
    model = LM(cfg)
    if qat is not None:
        prepare_qat_(model, qat)
    optimizers = build_optimizers(model, AdamWConfig())
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))
    y = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext():
            loss = lm_loss(model, x, y)
        loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)

    return step


def median_seconds(steps: dict[str, Callable[[], None]], rounds: int, warmup: int) -> dict[str, float]:
    """Median seconds per step of each closure, timed round-robin so that load from other jobs on
    the machine hits every method alike."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(warmup + rounds):
        for name, step in steps.items():
            t = time.perf_counter()
            step()
            if i >= warmup:
                times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--methods", nargs="+", default=list(QAT_VARIANTS)[1:], choices=list(QAT_VARIANTS)[1:])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    head = f"{'preset':<7} {'precision':<9} {'FP ms/step':>10}"
    head += "".join(f" {m + ' ms':>9} {m + ' ×FP':>8}" for m in args.methods)
    print(f"batch {args.batch} × seq_len, AdamW(fused), {args.threads} thread(s), median of {args.steps} steps")
    print(head)
    print("-" * len(head))
    for preset in args.presets:
        for precision in ("fp32", "bf16"):
            bf16 = precision == "bf16"
            steps = {m: make_step(preset, QAT_VARIANTS[m], bf16, args.batch) for m in ["fp", *args.methods]}
            sec = median_seconds(steps, args.steps, args.warmup)
            row = f"{preset:<7} {precision:<9} {sec['fp'] * 1e3:>10.1f}"
            row += "".join(f" {sec[m] * 1e3:>9.1f} {sec[m] / sec['fp']:>8.2f}" for m in args.methods)
            print(row, flush=True)


if __name__ == "__main__":
    main()
