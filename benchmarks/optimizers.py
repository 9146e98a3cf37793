"""Step time and state memory of every registered optimizer, as ratios to fused AdamW in the same run.

The first line says whether the machine has native bf16 (AVX512-BF16/AMX; the rule of `precision=auto`
and `ns_dtype=auto`, `optquant.device`), and what `ns_dtype=auto` picks. Muon and Scion are timed twice,
Newton–Schulz in bf16 (the libraries' choice) and in fp32, side by side. Where bf16 is emulated, bf16
Newton–Schulz on targets whose widest matrix exceeds `--max-emulated-dim` is skipped (a 2048² step would
take minutes), and says so.

Targets: the whole parameter set of a preset (`nano`, `tiny`, `small`, ... with `--vocab`, grouped as
training groups them) and single n² hidden matrices (`512`, `2048`). Gradients are fixed random tensors:
only the optimizer is timed. `--train` times whole training steps instead (forward, backward, optimizer)
at the default study's size (nano, vocab 1024, batch 16 × 64) for AdamW, Muon and Scion, rounds
interleaved over the optimizers so a busy spell on the shared machine hurts all alike; median per step.
Shampoo and SOAP take 20 warm-up steps (Shampoo's first roots happen at step 20) and are timed over the
next 20, which hold exactly one Shampoo root refresh and two SOAP eigenbasis refreshes: the mean is the
amortized cost. The others take 2 warm-up and 5 timed steps. PSGD is shown with its default schedule
during the first 500 steps (preconditioner updated every step) and at the schedule's floor, p = 0.03,
its cost for most of a long run, computed as 0.03·t(update) + 0.97·t(no update). Beside ours:
`pytorch_optimizer.Muon` and, if importable, heavyball (compile off). Rows print as they are measured.

Run: `python benchmarks/optimizers.py [--targets nano tiny small 512 2048] [--vocab 1024] [--threads 1]`
or `python benchmarks/optimizers.py --train [--preset nano] [--vocab 1024] [--batch 16] [--steps 10]`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from optquant.device import BF16_CPU_FLAGS, cpu_flags, fast_bf16, use_bf16
from optquant.model import LM, lm_loss, model_config
from optquant.optim import (
    OPTIMIZERS,
    AdamWConfig,
    MuonConfig,
    ParamGroups,
    PSGDConfig,
    ScionConfig,
    build_optimizers,
    split_params,
    state_bytes,
)

Build = Callable[[ParamGroups], list[torch.optim.Optimizer]]


# the optimizers with a Newton–Schulz dtype (the ns_dtype field), timed in bf16 and fp32
NS_VARIANTS = tuple(name for name, cls in OPTIMIZERS.items() if hasattr(cls, "ns_dtype"))
LIBRARY_BF16_NS = ("pytorch_optimizer.Muon", "heavyball.Muon", "heavyball.Scion")  # bf16 Newton–Schulz inside


def machine_line() -> str:
    """The CPU, whether it multiplies bf16 natively, and what `ns_dtype=auto` / `precision=auto` pick."""
    cpu = torch.device("cpu")
    model = next((ln.split(":", 1)[1].strip() for ln in _cpuinfo() if ln.startswith("model name")), "unknown CPU")
    native = [f for f in BF16_CPU_FLAGS if f in cpu_flags()]
    return (f"machine: {model}, torch CPU capability {torch.backends.cpu.get_cpu_capability()}, native bf16: "
            f"{'yes (' + ', '.join(native) + ')' if fast_bf16(cpu) else 'no (no AVX512-BF16/AMX: bf16 emulated)'}; "
            f"ns_dtype=auto and precision=auto pick {'bf16' if use_bf16('auto', cpu) else 'fp32'}")


def _cpuinfo() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read().splitlines()
    except OSError:
        return []


def target_groups(name: str, vocab: int | None = None) -> ParamGroups:
    if name.isdigit():
        n = int(name)
        return ParamGroups([], [], [torch.nn.Parameter(torch.randn(n, n) * 0.02)])
    torch.manual_seed(0)
    return split_params(LM(model_config(name, **({"vocab_size": vocab} if vocab else {}))))


def pytorch_optimizer_muon(groups: ParamGroups) -> list[torch.optim.Optimizer]:
    from pytorch_optimizer import Muon

    rest = groups.embeddings + groups.vectors
    params = [{"params": groups.matrices, "use_muon": True}] + ([{"params": rest, "use_muon": False}] if rest else [])
    return [Muon(params, lr=3e-2, momentum=0.95, adamw_lr=3e-3, adamw_eps=1e-6)]


def heavyball_builders() -> dict[str, Build]:
    try:
        import heavyball
    except ImportError:
        return {}
    heavyball.utils.compile_mode = None

    def make(cls_name: str, **kw) -> Build:
        return lambda g: [getattr(heavyball, cls_name)(g.all(), consume_grad=False, **kw)]

    names = ("AdamW", "Muon", "SOAP", "PSGDKron", "Scion")
    return {f"heavyball.{n}": make(n) for n in names if hasattr(heavyball, n)}


def builders() -> dict[str, Build]:
    ours: dict[str, Build] = {}
    for name, cls in OPTIMIZERS.items():
        if name in NS_VARIANTS:
            ours |= {f"{name} ns=bf16": cls(ns_dtype="bf16").build, f"{name} ns=fp32": cls(ns_dtype="fp32").build}
        else:
            ours[name] = cls().build
    ours["psgd p=0.03"] = PSGDConfig(update_prob=0.0).build  # never updates; blended with "psgd" below
    ours["pytorch_optimizer.Muon"] = pytorch_optimizer_muon
    return ours | heavyball_builders()


AMORTIZED = {"shampoo": (20, 20), "soap": (20, 20), "heavyball.SOAP": (20, 20)}  # (warm-up, timed) steps


def measure(build: Build, target: str, warmup: int, steps: int, vocab: int | None = None) -> tuple[float, int]:
    """(seconds per step, optimizer-state bytes) of one optimizer on one target."""
    groups = target_groups(target, vocab)
    params = groups.all()
    gen = torch.Generator().manual_seed(1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-2
    opts = build(groups)
    for _ in range(warmup):
        for opt in opts:
            opt.step()
    start = time.perf_counter()
    for _ in range(steps):
        for opt in opts:
            opt.step()
    return (time.perf_counter() - start) / steps, state_bytes(opts)


def widest(target: str, vocab: int | None) -> int:
    return max(min(p.shape) for p in target_groups(target, vocab).matrices)


def table(targets: list[str], vocab: int | None, max_emulated_dim: int) -> None:
    print("| target | optimizer | ms/step | × AdamW | state MB | × AdamW |", "|---|---|---:|---:|---:|---:|", sep="\n")
    emulated = not fast_bf16(torch.device("cpu"))
    for target in targets:
        base_t, base_b = measure(AdamWConfig().build, target, 2, 5, vocab)
        times: dict[str, float] = {}
        for name, build in builders().items():
            bf16_ns = name.endswith("ns=bf16") or name in LIBRARY_BF16_NS
            if emulated and bf16_ns and widest(target, vocab) > max_emulated_dim:
                print(f"| {target} | {name} | skipped: bf16 emulated, matrices wider than {max_emulated_dim} | | | |")
                continue
            warmup, steps = AMORTIZED.get(name, (2, 5))
            t, b = (base_t, base_b) if name == "adamw" else measure(build, target, warmup, steps, vocab)
            times[name] = t
            if name == "psgd p=0.03":
                t = 0.03 * times["psgd"] + 0.97 * t
            row = f"| {target} | {name} | {1e3 * t:.2f} | {t / base_t:.1f} | {b / 2**20:.2f} | {b / base_b:.1f} |"
            print(row, flush=True)


TRAIN_CONFIGS = {
    "adamw": AdamWConfig(),
    "muon ns=bf16": MuonConfig(ns_dtype="bf16"),
    "muon ns=fp32": MuonConfig(ns_dtype="fp32"),
    "scion ns=bf16": ScionConfig(ns_dtype="bf16"),
    "scion ns=fp32": ScionConfig(ns_dtype="fp32"),
}


def train_table(preset: str, vocab: int, batch: int, steps: int, rounds: int) -> None:
    """Whole training steps (fp32 model, as `precision=auto` trains where bf16 is emulated) per optimizer,
    `rounds` rounds of `steps` steps interleaved over the optimizers; the median round, per step."""
    cfg = model_config(preset, vocab_size=vocab)
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, vocab, (steps, batch, cfg.seq_len + 1), generator=gen)
    runs = {}
    for name, ocfg in TRAIN_CONFIGS.items():
        torch.manual_seed(0)
        model = LM(cfg)
        runs[name] = (model, build_optimizers(model, ocfg))
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}

    def one_round(name: str) -> tuple[float, float]:
        model, opts = runs[name]
        wall, cpu = time.perf_counter(), time.process_time()
        for idx in data:
            lm_loss(model, idx[:, :-1].contiguous(), idx[:, 1:].contiguous()).backward()
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=True)
        return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps

    for name in runs:  # warm-up round, not timed
        one_round(name)
    for _ in range(rounds):
        for name in runs:
            times[name].append(one_round(name))
    print(f"training step, {preset} (vocab {vocab}, batch {batch} × {cfg.seq_len}), fp32 model, median of "
          f"{rounds} interleaved rounds of {steps} steps; CPU = this process's CPU time (steadier when shared)")
    print("| optimizer | wall ms/step | × AdamW | CPU ms/step | × AdamW |", "|---|---:|---:|---:|---:|", sep="\n")
    base = [statistics.median(t[i] for t in times["adamw"]) for i in (0, 1)]
    for name, ts in times.items():
        wall, cpu = (statistics.median(t[i] for t in ts) for i in (0, 1))
        print(f"| {name} | {1e3 * wall:.1f} | {wall / base[0]:.2f} | {1e3 * cpu:.1f} | {cpu / base[1]:.2f} |",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="+", default=["nano", "tiny", "small", "512", "2048"])
    parser.add_argument("--vocab", type=int, default=None, help="preset targets' vocabulary (default: the preset's)")
    parser.add_argument("--max-emulated-dim", type=int, default=512)
    parser.add_argument("--train", action="store_true", help="time whole training steps instead")
    parser.add_argument("--preset", default="nano")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)  # the 2 cores are shared: 1 is steadier
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_line())
    print(f"torch {torch.__version__}, {args.threads} thread(s)")
    if args.train:
        train_table(args.preset, args.vocab or 1024, args.batch, args.steps, args.rounds)
        return
    if not heavyball_builders():
        print("heavyball not importable: its rows are skipped")
    table(args.targets, args.vocab, args.max_emulated_dim)


if __name__ == "__main__":
    main()
