"""Benchmark: training-step throughput of the CPU presets, fp32 vs bf16 autocast, against matmul peak.

One step = forward + loss + backward + AdamW step (`build_optimizers` with the default AdamWConfig,
fused) + zero_grad, on a batch of B random-token sequences at the preset's seq_len T, vocab 4096.

Achieved GFLOP/s counts useful model FLOPs per token (the usual MFU convention, not what the kernels
execute):
    6·N + 6·L·T·d
N = weights of every nn.Linear, the tied LM head included (an embedding lookup is no matmul; norms and
QK scales are negligible); 6 = 2 (multiply-add) × 3 (forward, plus backward for inputs and weights).
The attention scores QKᵀ and the mixing AV cost 2·2·T·d per token per layer forward, 12·L·T·d with the
backward; a causal mask halves the useful part: 6·L·T·d (PaLM's 12·L·T·d without the mask).

The peak is measured in the same run: GFLOP/s of one n×n by n×n matmul (2n³ FLOPs), fp32 and bf16, at
the same thread count, the fastest of 5 calls. Every number is then the median of `--repeats` runs
(the machine is shared and noisy), repeats interleaved over configs so a busy spell hurts all alike.

Compiled column: the same step with `torch.compile(model)` (what `train.compile=on` does), measured in
the same run and interleaved with the eager one; "compile s" is the first (compiling) step's seconds.

Run: python benchmarks/train_throughput.py [--quick] [--repeats 3] [--threads N] [--batch 16] [--no-compile]
     [--precision both|fp32|bf16] [--presets nano tiny]
One thread by default: on the shared 2-core machine this was written on (load average ≈ 4), two
threads made a nano step 28× slower (2.3 s vs 81 ms), OpenMP workers waiting on a preempted sibling.
Under bf16 autocast torch warns that RMSNorm gets a bf16 input with an fp32 weight and skips its fused
kernel; the warning is silenced here and the cost is part of the bf16 numbers.
Left out on purpose: GPU timing (no synchronisation here) and data loading (the loop's get_batch is a
memmap gather, negligible next to a step).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from torch import nn

from optquant.model import LM, lm_loss, model_config
from optquant.optim import AdamWConfig, build_optimizers
from optquant.train import autocast

CPU_MODEL_PRESETS = ("nano", "micro", "tiny", "small")
VOCAB = 4096


def matmul_gflops(n: int, dtype: torch.dtype, reps: int) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b  # warm-up: first-call allocation and kernel selection
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * n**3 / min(times) / 1e9


def flops_per_token(model: LM) -> tuple[int, float]:
    cfg = model.cfg
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    return n, 6 * n + 6 * cfg.n_layer * cfg.seq_len * cfg.d_model


class Bench:
    """One preset × precision: a model, its optimizers and a fixed batch."""

    def __init__(self, preset: str, bf16: bool, batch: int, compiled: bool = False):
        torch.manual_seed(0)
        self.model = LM(model_config(preset, vocab_size=VOCAB))
        self.fwd = torch.compile(self.model) if compiled else self.model  # as train.compile=on does
        self.compile_seconds = 0.0
        self.optimizers = build_optimizers(self.model, AdamWConfig())
        T = self.model.cfg.seq_len
        self.x = torch.randint(0, VOCAB, (batch, T))
        self.y = torch.randint(0, VOCAB, (batch, T))
        self.bf16, self.device = bf16, torch.device("cpu")

    def step(self) -> None:
        with autocast(self.device, self.bf16):
            loss = lm_loss(self.fwd, self.x, self.y)
        loss.backward()
        for opt in self.optimizers:
            opt.step()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def seconds_per_step(self, steps: int, warmup: int) -> float:
        for i in range(warmup):
            t = time.perf_counter()
            self.step()
            if i == 0 and self.fwd is not self.model and not self.compile_seconds:
                self.compile_seconds = time.perf_counter() - t  # the first call compiles (fwd + bwd)
        t = time.perf_counter()
        for _ in range(steps):
            self.step()
        return (time.perf_counter() - t) / steps


def run(args: argparse.Namespace) -> None:
    steps, warmup, mm_reps = (2, 1, 2) if args.quick else (args.steps, 2, 5)
    modes = (False, True) if args.compile else (False,)
    precisions = {"fp32": (False,), "bf16": (True,), "both": (False, True)}[args.precision]
    benches = {(p, bf16, c): Bench(p, bf16, args.batch, c) for p in args.presets for bf16 in precisions
               for c in modes}
    peaks: dict[str, list[float]] = {"fp32": [], "bf16": []}
    seconds: dict[tuple[str, bool, bool], list[float]] = {key: [] for key in benches}
    for _ in range(args.repeats):
        peaks["fp32"].append(matmul_gflops(args.matmul_n, torch.float32, mm_reps))
        peaks["bf16"].append(matmul_gflops(args.matmul_n, torch.bfloat16, mm_reps))
        for key, bench in benches.items():
            seconds[key].append(bench.seconds_per_step(steps, warmup))
    peak = {k: statistics.median(v) for k, v in peaks.items()}
    n = args.matmul_n
    print(
        f"threads {torch.get_num_threads()}, batch {args.batch} sequences, vocab {VOCAB}, "
        f"median of {args.repeats} repeats × {steps} steps"
    )
    print(f"matmul peak {n}×{n}×{n}: fp32 {peak['fp32']:.1f} GFLOP/s, bf16 {peak['bf16']:.1f} GFLOP/s\n")
    print("| preset | L | d | T | N (matmul) | FLOP/token | precision | ms/step | tokens/s | GFLOP/s | % of peak "
          "| compiled ms/step | compiled speed-up | compile s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (preset, bf16, compiled), bench in benches.items():
        if compiled:
            continue
        cfg = bench.model.cfg
        n_mm, fpt = flops_per_token(bench.model)
        s = statistics.median(seconds[(preset, bf16, False)])
        tps = args.batch * cfg.seq_len / s
        gflops, name = tps * fpt / 1e9, "bf16" if bf16 else "fp32"
        comp = "| – | – | – |"
        if (preset, bf16, True) in benches:
            sc = statistics.median(seconds[(preset, bf16, True)])
            comp = f"| {1e3 * sc:.1f} | {s / sc:.2f}× | {benches[(preset, bf16, True)].compile_seconds:.1f} |"
        print(
            f"| {preset} | {cfg.n_layer} | {cfg.d_model} | {cfg.seq_len} | {n_mm / 1e6:.2f}M | "
            f"{fpt / 1e6:.1f}M | {name} | {1e3 * s:.1f} | {tps:,.0f} | {gflops:.1f} | "
            f"{100 * gflops / peak[name]:.0f}% {comp}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 timed steps per config (a smoke run)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="timed steps per config and repeat")
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0 = torch's default)")
    p.add_argument("--matmul-n", type=int, default=2048)
    p.add_argument("--presets", nargs="+", default=list(CPU_MODEL_PRESETS), choices=CPU_MODEL_PRESETS)
    p.add_argument("--precision", choices=("both", "fp32", "bf16"), default="both",
                   help="fp32 only on a CPU without native bf16 (there torch emulates bf16 matmuls, ~47x slower)")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="skip the torch.compile column (compiling takes minutes per config on a busy CPU)")
    args = p.parse_args()
    warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
    if args.threads:
        torch.set_num_threads(args.threads)
    run(args)


if __name__ == "__main__":
    main()
