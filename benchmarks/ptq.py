"""Benchmark: GPTQ cost and layer error vs RTN, and the cost of the ABC analysis.

Part 1: one linear layer W (out, in) with correlated inputs X = Z·(I + G/√in) and 8 outlier input
channels scaled ×10 (the setup of dependencies.md §2). Reports the relative layer-output error
‖X(W − Ŵ)ᵀ‖/‖XWᵀ‖ of RTN and GPTQ (with and without act_order), and GPTQ's seconds per layer
(Hessian accumulation excluded, it is shared by all variants). Correctness is not measured here:
tests/test_gptq.py checks GPTQ against references written the way the paper and IST-DASLab's code do it.

Part 2: CPU seconds of `optquant.metrics.propagation.propagation` (four evaluations per module) as a
ratio to one FP plus one W4A4-quantized forward over the same batches, beside the implementation before
its speed-up (tests/propagation_reference.py) measured in the same run, on `tiny` and `small`; each
timing is the least of --repeat interleaved runs.

Run: python benchmarks/ptq.py [--quick] [--threads N] [--repeat R]. One thread by default: on the shared
2-core machine this was measured on, two threads made the column loop 30× slower (0.2 s → 6.9 s at 512²).
"""

from __future__ import annotations

import argparse
import copy
import time
from functools import partial

import torch

from optquant.device import keep_freed_memory
from optquant.metrics.propagation import PropagationConfig, propagation
from optquant.model import LM, model_config
from optquant.quant.gptq import accumulate_hessian, gptq_quantize, layer_error
from optquant.quant.primitives import QuantSpec, fake_quant
from optquant.quant.ptq import PTQConfig, quantize_


def correlated_inputs(n: int, d: int, seed: int = 0, outliers: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g) @ (torch.randn(d, d, generator=g) / d**0.5 + torch.eye(d))
    X[:, torch.randperm(d, generator=g)[:outliers]] *= 10
    return X


def layer_rows(shapes: list[tuple[int, int]], tokens: int) -> list[dict]:
    rows = []
    for out, d in shapes:
        torch.manual_seed(0)
        W = torch.randn(out, d) * 0.02
        X = correlated_inputs(max(tokens, 2 * d), d)
        H, _ = accumulate_hessian(None, 0, X)
        for group in (0, 128):
            spec = QuantSpec(4, "sym", "group" if group else "channel", group or 128)
            row = {"layer": f"{out}x{d}", "scheme": f"w4 sym {'g128' if group else 'per-ch'}"}
            t = time.perf_counter()
            Q = fake_quant(W, spec)
            row["rtn_s"] = time.perf_counter() - t
            row["rtn"] = layer_error(X, W, Q)
            for act_order in (False, True):
                t = time.perf_counter()
                Q = gptq_quantize(W, H, spec, act_order=act_order)
                key = "gptq_ao" if act_order else "gptq"
                row[key + "_s"] = time.perf_counter() - t
                row[key] = layer_error(X, W, Q)
            rows.append(row)
    return rows


def forwards(fp: torch.nn.Module, q: torch.nn.Module, batches: list) -> None:
    with torch.no_grad():
        for b in batches:
            fp(b), q(b)


def abc_rows(presets: list[str], n_batches: int, repeat: int) -> list[dict]:
    """CPU seconds of the ABC analysis (both granularities) and, side by side in the same run, of the
    implementation before its speed-up (tests/propagation_reference.py), each as a ratio to one FP plus
    one W4A4 forward over the same batches. Each is the least of `repeat` interleaved runs, in process
    CPU time: on a shared machine wall time also counts the time spent waiting for a core."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import propagation_reference as ref

    rows = []
    for preset in presets:
        torch.manual_seed(0)
        fp = LM(model_config(preset)).eval()
        q = quantize_(copy.deepcopy(fp), PTQConfig())
        batches = [torch.randint(0, fp.cfg.vocab_size, (4, fp.cfg.seq_len)) for _ in range(n_batches)]
        runs = {"fwd": partial(forwards, fp, q)}
        for gran in ("sublayer", "linear"):
            runs["new", gran] = partial(propagation, fp, q, cfg=PropagationConfig(granularity=gran))
            runs["old", gran] = partial(ref.propagation, fp, q, cfg=ref.PropagationConfig(granularity=gran))
        for run in runs.values():
            run(batches[:1])  # warm-up
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(repeat):
            for key, run in runs.items():
                t = time.process_time()
                run(batches)
                best[key] = min(best[key], time.process_time() - t)
        for gran in ("sublayer", "linear"):
            rows.append({"preset": preset, "granularity": gran, "fwd": best["fwd"], "new": best["new", gran],
                         "old": best["old", gran]})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="only the 512x512 layer and a nano model")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--repeat", type=int, default=3, help="ABC timings: the least of this many runs (default 3)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as every optquant command and study job does (device.py): ABC's stacked 4 MB
    # activations otherwise fault in fresh pages each call (~90k faults, ~12 % of ABC at small)
    shapes = [(512, 512)] if args.quick else [(512, 512), (1024, 4096)]
    rows = layer_rows(shapes, tokens=4096)
    head = (
        f"{'layer':>10} {'scheme':>14} {'RTN err':>8} {'GPTQ err':>9} {'GPTQ+ao':>8} "
        f"{'RTN s':>7} {'GPTQ s':>7} {'+ao s':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['layer']:>10} {r['scheme']:>14} {r['rtn']:8.4f} {r['gptq']:9.4f} {r['gptq_ao']:8.4f} "
            f"{r['rtn_s']:7.3f} {r['gptq_s']:7.2f} {r['gptq_ao_s']:7.2f}"
        )
    print(f"\nABC analysis, CPU seconds (least of {args.repeat}) and ratio to one FP + one W4A4 forward "
          "(4 batches × 4 sequences):")
    head = f"{'preset':>7} {'granularity':>11} {'FP+W4A4 s':>10} {'ABC s':>7} {'ratio':>6} {'before s':>9} {'ratio':>6}"
    print(head)
    print("-" * len(head))
    for r in abc_rows(["nano"] if args.quick else ["tiny", "small"], 4, args.repeat):
        print(f"{r['preset']:>7} {r['granularity']:>11} {r['fwd']:10.2f} {r['new']:7.2f} {r['new'] / r['fwd']:5.2f}x "
              f"{r['old']:9.2f} {r['old'] / r['fwd']:5.2f}x")


if __name__ == "__main__":
    main()
