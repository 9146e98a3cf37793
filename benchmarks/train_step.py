"""Benchmark: one training step of the `cpu` study with and without PSGD's memoised einsum paths
(optim/psgd.py), which change no bit. "plain" swaps in a no-op for the memo.

For each (preset, optimizer, QAT or not): two models from the same seed train side by side in one process
on one thread (the study's workers), in interleaved blocks of `--block` steps, each timed in CPU seconds
(process time: waiting for the shared machine's cores does not count). Reported: the median CPU ms per
step of each, their ratio, and whether the two models' weights are still the same bits at the end.

Run: python benchmarks/train_step.py [--presets zepto pico] [--optimizers psgd] [--qat] [--blocks 6]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import statistics
import time
import warnings

import torch

import optquant.optim.psgd as psgd
from optquant.device import keep_freed_memory
from optquant.optim import build_optimizers
from optquant.study_spec import cpu, run_config
from optquant.train import build_model, get_batch, lm_loss

FAST, PLAIN = psgd.memoised_einsum_paths, contextlib.nullcontext


def use(variant) -> None:
    psgd.memoised_einsum_paths = variant


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha1()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:12]


def measure(preset: str, optimizer: str, qat: bool, blocks: int, block: int) -> dict:
    cfg = run_config(cpu(), preset, optimizer, {"qat.method": "quest"} if qat else None)  # the study's run
    tokens = torch.randint(0, 1024, (200_000,), generator=torch.Generator().manual_seed(1)).numpy()
    runs = {}
    for name in ("plain", "fast"):
        torch.manual_seed(0)
        model = build_model(cfg)
        runs[name] = (model, build_optimizers(model, cfg.optim), torch.Generator().manual_seed(2), [])

    def steps(name: str, n: int) -> None:
        model, opts, gen, _ = runs[name]
        for _ in range(n):
            x, y = get_batch(tokens, cfg.train.batch_size, cfg.model.seq_len, gen)
            lm_loss(model, x, y).backward()
            for o in opts:
                o.step()
                o.zero_grad(set_to_none=True)

    for name, variant in (("plain", PLAIN), ("fast", FAST)):  # warm-up
        use(variant)
        steps(name, 3)
    for _ in range(blocks):
        for name, variant in (("plain", PLAIN), ("fast", FAST)):
            use(variant)
            t = time.process_time()
            steps(name, block)
            runs[name][3].append((time.process_time() - t) / block * 1e3)
    use(FAST)
    plain, fast = (statistics.median(runs[n][3]) for n in ("plain", "fast"))
    return {"plain": plain, "fast": fast, "same": digest(runs["plain"][0]) == digest(runs["fast"][0])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["zepto", "pico"])
    ap.add_argument("--optimizers", nargs="+", default=["psgd"])
    ap.add_argument("--qat", action="store_true", help="also QuEST W4A4 QAT steps")
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--block", type=int, default=20)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    keep_freed_memory()
    torch.set_num_threads(1)
    print(f"CPU ms per step, median of {args.blocks} interleaved blocks of {args.block} steps, one thread")
    print(f"{'preset':>7} {'optimizer':>9} {'qat':>5} {'plain':>8} {'fast':>8} {'plain/fast':>10}  same bits")
    for preset in args.presets:
        for opt in args.optimizers:
            for qat in (False, True) if args.qat else (False,):
                r = measure(preset, opt, qat, args.blocks, args.block)
                print(f"{preset:>7} {opt:>9} {str(qat):>5} {r['plain']:8.2f} {r['fast']:8.2f} "
                      f"{r['plain'] / r['fast']:9.2f}x  {'yes' if r['same'] else 'NO'}")


if __name__ == "__main__":
    main()
