"""Benchmark: optquant's GPTQ against llm-compressor's on one HF checkpoint, the same token windows and threads.

Each side runs in its own process (`--side ours` in optquant's venv, `--side llmc` in one with llmcompressor
installed: this file imports neither package at the top) and prints one JSON line:
- `gptq_s` / `gptq_cpu_s`: wall and CPU (user + system, all threads) seconds of the quantization call alone
  (optquant's `quantize_`, llm-compressor's `oneshot` with `GPTQModifier(scheme="W4A16", targets="Linear",
  ignore=["lm_head"])`), W4 g128 symmetric weights, damp 0.01, act-order with static groups (llm-compressor's
  default actorder="static"); the same int grid (`full`: [-8, 7], scale absmax/7.5);
- `peak_gb`: the process's peak RSS once quantized (before the damage is measured, which adds logits);
- the damage on `--eval` windows: relative error of the logits ‖z_q − z‖/‖z‖ and Δ cross-entropy.
Calibration: the first N×T ids of `--tokens` as N windows of T (`--windows 64x128` or the issue's `16x512`).

    python benchmarks/gptq_vs_llmc.py --side ours --model DIR --tokens t.npy --eval e.npy --windows 64x128
    LLMC_VENV/bin/python benchmarks/gptq_vs_llmc.py --side llmc --model DIR ...

`--side both` (the default) runs the two one after the other as child processes (ours with this interpreter,
llm-compressor's with `--llmc-python`) and prints a table: per side the quantization's wall and CPU seconds, the
child's whole CPU seconds and peak RSS (from `os.wait4`: the kernel's account of that child alone), the damage,
and ours/llmc ratios. Under load wall time says little: compare CPU seconds and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch


def windows(path: str, spec: str) -> torch.Tensor:
    n, t = (int(v) for v in spec.split("x"))
    ids = np.load(path)[: n * t]
    return torch.from_numpy(ids.astype(np.int64)).view(n, t)


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


@torch.no_grad()
def fp_logits(forward, ev: torch.Tensor, tmp: Path) -> Path:
    """The FP logits of each window, one window at a time, to files (they are not held through the PTQ)."""
    for i in range(len(ev)):
        torch.save(forward(ev[i : i + 1]).float(), tmp / f"{i}.pt")
    return tmp


@torch.no_grad()
def damage(forward, ev: torch.Tensor, tmp: Path) -> dict[str, float]:
    num = den = ce_fp = ce_q = 0.0
    for i in range(len(ev)):
        a, b = torch.load(tmp / f"{i}.pt"), forward(ev[i : i + 1]).float()
        num += (b - a).double().square().sum().item()
        den += a.double().square().sum().item()
        y = ev[i, 1:]
        ce_fp += torch.nn.functional.cross_entropy(a[0, :-1], y, reduction="sum").item()
        ce_q += torch.nn.functional.cross_entropy(b[0, :-1], y, reduction="sum").item()
    n = ev[:, 1:].numel()
    return {"logits_rel_err": (num / den) ** 0.5, "ce_fp": ce_fp / n, "delta_ce": (ce_q - ce_fp) / n}


def ours(args, calib: torch.Tensor, ev: torch.Tensor) -> dict:
    from optquant.device import return_freed_memory
    from optquant.hf import load_hf
    from optquant.hf.lazy import materialize_
    from optquant.quant.ptq import PTQConfig, quantize_

    return_freed_memory()  # as the CLI's --hf commands do
    model = materialize_(load_hf(args.model, seq_len=calib.shape[1], lazy=True))  # as `ptq --hf` loads it
    fp_logits(model, ev, args.tmp)
    cfg = PTQConfig(method="gptq", a_bits=16, w_group_size=128, grid="full", act_order=True, n_calib=len(calib))
    t, c = time.perf_counter(), time.process_time()
    quantize_(model, cfg, calib)
    out = {"gptq_s": time.perf_counter() - t, "gptq_cpu_s": time.process_time() - c, "peak_gb": peak_gb()}
    return out | damage(model, ev, args.tmp)


def llmc(args, calib: torch.Tensor, ev: torch.Tensor) -> dict:
    import transformers
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier

    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype="auto", local_files_only=True).eval()
    tok = _tokenizer(transformers)
    fp_logits(lambda x: model(x).logits, ev, args.tmp)
    data = Dataset.from_dict({"input_ids": calib.tolist(), "attention_mask": torch.ones_like(calib).tolist()})
    recipe = GPTQModifier(scheme="W4A16", targets="Linear", ignore=["lm_head"], dampening_frac=0.01)
    t, c = time.perf_counter(), time.process_time()
    oneshot(model=model, processor=tok, dataset=data, recipe=recipe, max_seq_length=calib.shape[1],
            num_calibration_samples=len(calib), shuffle_calibration_samples=False)
    out = {"gptq_s": time.perf_counter() - t, "gptq_cpu_s": time.process_time() - c, "peak_gb": peak_gb()}
    return out | damage(lambda x: model(x).logits, ev, args.tmp)


def _tokenizer(transformers):
    """A stand-in tokenizer (llm-compressor asks for one; the calibration set is already token ids)."""
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<unk>", pad_token="<unk>")


def child(python: str, side: str, argv: list[str]) -> dict:
    """Run one side as a child process; its JSON line plus the kernel's CPU seconds and peak RSS of it."""
    proc = subprocess.Popen([python, __file__, "--side", side, *argv], stdout=subprocess.PIPE, text=True)
    out = proc.stdout.read()
    _, status, use = os.wait4(proc.pid, 0)
    if status:
        raise SystemExit(f"{side}: exit status {status}")
    line = next(x for x in reversed(out.splitlines()) if x.startswith("{"))
    return json.loads(line) | {"proc_cpu_s": use.ru_utime + use.ru_stime, "proc_peak_gib": use.ru_maxrss / 2**20}


def table(rows: list[dict]) -> str:
    cols = ["gptq_s", "gptq_cpu_s", "proc_cpu_s", "proc_peak_gib", "peak_gb", "logits_rel_err", "delta_ce"]
    lines = ["| side | " + " | ".join(cols) + " |", "|" + " --- |" * (len(cols) + 1)]
    lines += [f"| {r['side']} | " + " | ".join(f"{r[c]:.4g}" for c in cols) + " |" for r in rows]
    ours, llmc = rows
    lines.append("| ours/llmc | " + " | ".join(f"{ours[c] / llmc[c]:.3g}" if llmc[c] else "–" for c in cols) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--side", choices=["ours", "llmc", "both"], default="both")
    p.add_argument("--llmc-python", help="with --side both: a Python interpreter with llmcompressor installed")
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", required=True, help="calibration ids (.npy)")
    p.add_argument("--eval", required=True, help="evaluation ids (.npy), 8 windows of 128 are used")
    p.add_argument("--windows", default="64x128", help="calibration windows NxT (default 64x128)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tmp", type=Path, required=True, help="a scratch directory for the FP logits")
    args = p.parse_args()
    if args.side == "both":
        argv = [a for a in sys.argv[1:] if a not in ("--side", "both")]
        if not args.llmc_python:
            p.error("--side both needs --llmc-python (an interpreter with llmcompressor)")
        print(table([child(sys.executable, "ours", argv), child(args.llmc_python, "llmc", argv)]))
        return
    args.tmp.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    calib, ev = windows(args.tokens, args.windows), windows(args.eval, "8x128")
    t, c = time.perf_counter(), time.process_time()
    out = (ours if args.side == "ours" else llmc)(args, calib, ev)
    print(json.dumps({"side": args.side, "windows": args.windows, **out, "total_s": time.perf_counter() - t,
                      "total_cpu_s": time.process_time() - c}))


if __name__ == "__main__":
    main()
