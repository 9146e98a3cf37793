"""Benchmark: peak memory and wall time of `optquant analyze --hf` and `optquant ptq --hf` on real-size models.

Random-weight checkpoints shaped like Qwen2-0.5B, Qwen2.5-1.5B, Llama-3.2-3B and Llama-3.1-8B are written
under --work (safetensors shards of ≤ 2 GB with an index, as the hub's; generated one tensor at a time, so
writing an 8B model needs one shard of memory), with 8,192 random token ids. Each command then runs as its
own process under /usr/bin/time -v: peak RSS (the kernel's high-water mark of the process) and wall
time. `--before DIR` also runs each command with DIR/src first on PYTHONPATH (a checkout of the code
before the change: "before" and "after" columns measured in one session).

    python benchmarks/hf_scale.py --work /tmp/hf --models qwen2-0.5b --dtypes fp32 bf16 \
        --commands analyze ptq-rtn ptq-gptq [--before /work/main] [--blocks N]

`--blocks N` keeps only the first N decoder layers (for an estimate of a model too slow to run whole: time
and the activation part of memory scale with the layers). The weights are deleted afterwards unless
--keep. Token ids are random, so the numbers are costs, not accuracies.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

SHAPES = {  # the published configs' sizes (config.json of each model)
    "qwen2-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                       num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                       rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=32768),
    "qwen2.5-1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=32768),
    "llama-3.2-3b": dict(model_type="llama", vocab_size=128256, hidden_size=3072, intermediate_size=8192,
                         num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                         tie_word_embeddings=True, rope_theta=5e5, rms_norm_eps=1e-5, max_position_embeddings=131072),
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         tie_word_embeddings=False, rope_theta=5e5, rms_norm_eps=1e-5, max_position_embeddings=131072),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
COMMANDS = {
    "analyze": ["analyze"],
    "ptq-rtn": ["ptq", "--mc-items", "0"],
    "ptq-gptq": ["ptq", "--mc-items", "0", "--method", "gptq", "--w-bits", "4", "--a-bits", "16", "--group-size",
                 "128"],
}
SHARD = 2 * 2**30


def write_model(path: Path, shape: str, dtype: str, blocks: int | None = None, seed: int = 0) -> Path:
    """A random-weight HF checkpoint of `shape` in `dtype`: N(0, 0.02) matrices, unit norm gains, small biases."""
    import transformers
    from safetensors.torch import save_file

    cfg = dict(SHAPES[shape], **({"num_hidden_layers": blocks} if blocks else {}))
    config = transformers.AutoConfig.for_model(**cfg, bos_token_id=0, eos_token_id=0,
                                               dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    g = torch.Generator().manual_seed(seed)
    names = [n for n in model.state_dict() if not (config.tie_word_embeddings and n == "lm_head.weight")]
    shapes = dict(model.state_dict().items())
    shards, current, size, index = [], {}, 0, {}
    for name in names:
        t = torch.empty(shapes[name].shape, dtype=torch.float32)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        else:
            t.normal_(0.0, 0.02 if t.dim() > 1 else 0.1, generator=g)
        current[name] = t.to(DTYPES[dtype])
        size += current[name].numel() * current[name].element_size()
        if size >= SHARD:
            shards.append(current)
            current, size = {}, 0
            _save(path, shards, index, save_file)
    shards.append(current)
    _save(path, shards, index, save_file, last=True)
    return path


def _save(path: Path, shards: list, index: dict, save_file, last: bool = False) -> None:
    """Write the newest shard as model-0000k.safetensors (renamed to -of-N at the end, with the index)."""
    k = len(shards)
    name = f"part-{k:05d}.safetensors"
    save_file(shards[-1], path / name, metadata={"format": "pt"})
    index.update(dict.fromkeys(shards[-1], name))
    shards[-1] = list(shards[-1])  # free the tensors
    if not last:
        return
    final = {f"part-{i:05d}.safetensors": f"model-{i:05d}-of-{k:05d}.safetensors" for i in range(1, k + 1)}
    for old, new in final.items():
        (path / old).rename(path / new)
    weight_map = {n: final[f] for n, f in index.items()}
    total = sum((path / f).stat().st_size for f in final.values())
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                    "weight_map": weight_map}))


def run(cmd: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """(wall s, peak RSS GiB, status with the CPU seconds) of one command under /usr/bin/time -v."""
    t = time.perf_counter()
    p = subprocess.run(["/usr/bin/time", "-v", *cmd], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)
    tail = [ln for ln in p.stdout.splitlines() + p.stderr.splitlines() if ln.strip()]
    cpu = sum(float(m) for m in re.findall(r"(?:User|System) time \(seconds\): ([\d.]+)", p.stderr))
    errors = [ln for ln in tail if "rror" in ln][-1:]
    status = f"ok, CPU {cpu:.0f} s" if p.returncode == 0 else f"exit {p.returncode}: {errors}"
    return wall, int(peak.group(1)) / 2**20 if peak else float("nan"), status


def weights_gb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, required=True, help="where the checkpoints and outputs go")
    p.add_argument("--models", nargs="+", default=["qwen2-0.5b"], choices=list(SHAPES))
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    p.add_argument("--commands", nargs="+", default=list(COMMANDS), choices=list(COMMANDS))
    p.add_argument("--before", type=Path, help="a checkout of the code before the change (its src/ is used)")
    p.add_argument("--sides", nargs="+", default=["before", "after"], choices=["before", "after"])
    p.add_argument("--blocks", type=int, help="keep only the first N decoder layers")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--keep", action="store_true", help="keep the checkpoints")
    args = p.parse_args()
    rows = []
    tokens = args.work / "tokens.npy"
    args.work.mkdir(parents=True, exist_ok=True)
    np.save(tokens, np.random.default_rng(0).integers(0, 128256, 8192))
    for shape in args.models:
        for dtype in args.dtypes:
            path = args.work / (f"{shape}-{dtype}" + (f"-{args.blocks}" if args.blocks else ""))
            if not (path / "config.json").exists():
                write_model(path, shape, dtype, args.blocks)
            for command in args.commands:
                for side, src in (("before", args.before), ("after", None)):
                    if (side == "before" and src is None) or side not in args.sides:
                        continue
                    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
                    if src is not None:
                        env["PYTHONPATH"] = str(Path(src) / "src")
                    out = args.work / f"out-{side}"
                    cmd = [sys.executable, "-m", "optquant.cli", *COMMANDS[command], "--hf", str(path), "--tokens",
                           str(tokens), "--out", str(out)]
                    wall, peak, status = run(cmd, env)
                    shutil.rmtree(out, ignore_errors=True)
                    rows.append(dict(model=shape, dtype=dtype, blocks=args.blocks or SHAPES[shape]["num_hidden_layers"],
                                     weights=weights_gb(path), command=command, side=side, wall=wall, peak=peak,
                                     status=status))
                    r = rows[-1]
                    print(f"{shape:>13} {dtype:>5} {r['blocks']:>3} {r['weights']:6.2f} GiB {command:>9} {side:>6} "
                          f"{wall:8.1f} s {peak:6.2f} GiB ({peak / r['weights']:4.2f}x) {status}", flush=True)
            if not args.keep:
                shutil.rmtree(path)
    (args.work / "hf_scale.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
