"""Benchmark: the cost of a training step with each quantization-robust method (quant/robust.py) against plain
training, side by side in one process.

For each (preset, optimizer) of the `cpu` study: one model per variant, all from the same seed, train in
interleaved blocks of `--block` steps on one thread (the study's workers), each block timed in CPU seconds
(process time: waiting for the shared machine's cores does not count). A step is what train.py runs:
robust.begin, forward + backward (the penalty's objective on its steps), the optimizer, robust.end. Reported:
the median CPU ms per step and its ratio to plain training measured in the same run. late-qat is timed in its
QuEST phase (strength 1: on from step 0); a run that spends the fraction f of its steps there costs
1 + f·(ratio − 1) on average, given in the last column for f = 0.2 (the default). ema and lawa are timed with
their updates (ema's after every step, lawa's copy at the run's eval_every); the evaluations of the average
replace the raw model's, so they cost nothing more. The architecture arms (`model.FIELD=VALUE` entries: OSP's
single-scale RMSNorm with the embedding projection, the Outlier Protected block, gated attention) are models
of their own, built from the same seed and timed in the same blocks.

Run: python benchmarks/robust.py [--presets zepto pico] [--optimizers adamw muon] [--blocks 5] [--block 10]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from optquant.config import apply_overrides
from optquant.device import keep_freed_memory
from optquant.optim import build_optimizers
from optquant.quant.robust import Robust
from optquant.quant.robust_config import RobustConfig
from optquant.study_spec import cpu, run_config
from optquant.train import build_model, get_batch, lm_loss

VARIANTS: dict[str, RobustConfig | tuple[str, ...] | None] = {
    "plain": None,
    "penalty k=1": RobustConfig("penalty", 0.1, every=1),
    "penalty k=4": RobustConfig("penalty", 0.1, every=4),
    "gain k=1": RobustConfig("gain", 4.0, every=1),
    "gain k=4": RobustConfig("gain", 4.0, every=4),
    "late-qat (on)": RobustConfig("late-qat", 1.0),
    "ema 0.99": RobustConfig("ema", 0.99),  # an update after every step
    "lawa k=4": RobustConfig("lawa", 4.0),  # a kept copy at every evaluation (the run's eval_every)
    # the architecture arms: plain training of another model
    "osp norm+proj": ("model.norm=single", "model.embed_proj=true"),
    "op block": ("model.block=op",),
    "attn gate": ("model.attn_gate=true",),
}
LATE_FRACTION = 0.2


def measure(preset: str, optimizer: str, blocks: int, block: int) -> dict[str, float]:
    cfg = run_config(cpu(), preset, optimizer)  # the study's run
    tokens = torch.randint(0, cfg.model.vocab_size, (200_000,), generator=torch.Generator().manual_seed(1)).numpy()
    runs = {}
    for name, rc in VARIANTS.items():
        torch.manual_seed(0)
        model = build_model(apply_overrides(cfg, list(rc)) if isinstance(rc, tuple) else cfg)
        robust = None if not isinstance(rc, RobustConfig) else Robust(rc, model, 10**6, eval_every=cfg.train.eval_every)
        runs[name] = [model, build_optimizers(model, cfg.optim), robust, torch.Generator().manual_seed(2), 0, []]

    def steps(name: str, n: int) -> None:
        model, opts, robust, gen, step, _ = runs[name]
        for _ in range(n):
            x, y = get_batch(tokens, cfg.train.batch_size, cfg.model.seq_len, gen)
            if robust is not None:
                robust.begin(step)
            penalized = None if robust is None else robust.loss(model, x, y, step)
            (lm_loss(model, x, y) if penalized is None else penalized[0]).backward()
            for o in opts:
                o.step()
            if robust is not None:
                robust.end(step)
            for o in opts:
                o.zero_grad(set_to_none=True)
            step += 1
        runs[name][4] = step

    for name in runs:  # warm-up; a multiple of 4 keeps every k=4 variant's blocks alike
        steps(name, 4)
    for _ in range(blocks):
        for name in runs:
            t = time.process_time()
            steps(name, block)
            runs[name][5].append((time.process_time() - t) / block * 1e3)
    return {name: statistics.median(r[5]) for name, r in runs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["zepto", "pico"])
    ap.add_argument("--optimizers", nargs="+", default=["adamw", "muon"])
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--block", type=int, default=12)  # a multiple of 4: each block has the same k=4 steps
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    keep_freed_memory()
    torch.set_num_threads(1)
    print(f"CPU ms per step, median of {args.blocks} interleaved blocks of {args.block} steps, one thread; "
          f"ratio = against plain in the same run")
    print(f"| preset | optimizer | {' | '.join(VARIANTS)} | late-qat f={LATE_FRACTION} |")
    print("|---" * (len(VARIANTS) + 3) + "|")
    for preset in args.presets:
        for opt in args.optimizers:
            ms = measure(preset, opt, args.blocks, args.block)
            cells = [f"{ms['plain']:.1f} ms"] + [f"{ms[n]:.1f} ms ({ms[n] / ms['plain']:.2f}×)"
                                                for n in VARIANTS if n != "plain"]
            late = 1 + LATE_FRACTION * (ms["late-qat (on)"] / ms["plain"] - 1)
            print(f"| {preset} | {opt} | {' | '.join(cells)} | {late:.2f}× |")


if __name__ == "__main__":
    main()
