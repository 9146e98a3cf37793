"""Benchmark: training steps with glibc's default malloc vs `device.keep_freed_memory` (what every optquant
command and study job does first).

Each measurement is a fresh process (malloc's settings are per process and glibc's default adapts as the
process runs, so the two cannot share one): the default is run with GLIBC_TUNABLES naming glibc.malloc,
which keep_freed_memory leaves alone. A process builds the `cpu` study's model at a preset (vocab 1024,
batch 16, seq_len 64), trains `--steps` steps with one optimizer on one thread (the study's workers), and
prints its CPU seconds per step (process time: page faults count, waiting for a core does not) and a
digest of the final weights, which must be the same bits both ways. Runs are interleaved, `--repeats`
each, and the median is reported with the ratio default / kept.

Run: python benchmarks/allocator.py [--presets zepto pico] [--optimizers adamw muon] [--qat] [--steps 60]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys

DEFAULT_MALLOC = "glibc.malloc.check=0"  # a malloc tunable that changes nothing: keep_freed_memory stands back


def child(preset: str, optimizer: str, qat: bool, steps: int) -> None:
    import time
    import warnings

    import torch

    from optquant.config import apply_overrides, run_preset
    from optquant.device import keep_freed_memory
    from optquant.optim import build_optimizers
    from optquant.train import build_model, get_batch, lm_loss

    warnings.filterwarnings("ignore")
    kept = keep_freed_memory()
    torch.set_num_threads(1)
    overrides = ["model.vocab_size=1024", f"optim.name={optimizer}"] + (["qat.method=quest"] if qat else [])
    cfg = apply_overrides(run_preset(preset), overrides)
    torch.manual_seed(0)
    model = build_model(cfg)
    opts = build_optimizers(model, cfg.optim)
    tokens = torch.randint(0, 1024, (200_000,), generator=torch.Generator().manual_seed(1)).numpy()
    gen = torch.Generator().manual_seed(2)

    def step():
        x, y = get_batch(tokens, 16, cfg.model.seq_len, gen)
        lm_loss(model, x, y).backward()
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)

    for _ in range(5):
        step()
    t = time.process_time()
    for _ in range(steps):
        step()
    seconds = (time.process_time() - t) / steps
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    print(json.dumps({"kept": kept, "ms": 1000 * seconds, "digest": digest[:16]}))


def measure(preset: str, optimizer: str, qat: bool, steps: int, default: bool) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("GLIBC_TUNABLES", None)
    if default:
        env["GLIBC_TUNABLES"] = DEFAULT_MALLOC
    args = [sys.executable, __file__, "--child", preset, optimizer, str(int(qat)), str(steps)]
    out = subprocess.run(args, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=["zepto", "pico"])
    ap.add_argument("--optimizers", nargs="+", default=["adamw", "muon"])
    ap.add_argument("--qat", action="store_true", help="also QuEST W4A4 QAT steps")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cases = [(p, o, q) for p in args.presets for o in args.optimizers for q in ([False, True] if args.qat else [False])]
    times = {c: {True: [], False: []} for c in cases}
    digests = {c: set() for c in cases}
    for _ in range(args.repeats):
        for case in cases:
            for default in (True, False):
                r = measure(*case, args.steps, default)
                assert r["kept"] is not default, r  # the default run really ran glibc's default
                times[case][default].append(r["ms"])
                digests[case].add(r["digest"])
    print(f"CPU ms per training step, 1 thread, median of {args.repeats} interleaved runs of {args.steps} steps")
    print(f"{'preset':<7} {'optimizer':<9} {'qat':<4} {'default':>8} {'kept':>8} {'ratio':>6}  same bits")
    for case, t in times.items():
        d, k = statistics.median(t[True]), statistics.median(t[False])
        print(f"{case[0]:<7} {case[1]:<9} {'w4a4' if case[2] else '-':<4} {d:8.2f} {k:8.2f} {d / k:6.2f}  "
              f"{len(digests[case]) == 1}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[4] == "1", int(sys.argv[5]))
    else:
        main()
