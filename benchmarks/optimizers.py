"""Step time and state memory of every registered optimizer, as ratios to fused AdamW in the same run.

Targets: the whole parameter set of the `tiny` and `small` presets (grouped as training groups them) and
single 512² and 2048² hidden matrices. Gradients are fixed random tensors: only the optimizer is timed.
Shampoo and SOAP take 20 warm-up steps (Shampoo's first roots happen at step 20) and are timed over the
next 20, which hold exactly one Shampoo root refresh and two SOAP eigenbasis refreshes: the mean is the
amortized cost. The others take 2 warm-up and 5 timed steps. PSGD is shown with its default schedule
during the first 500 steps (preconditioner updated every step) and at the schedule's floor, p = 0.03,
its cost for most of a long run, computed as 0.03·t(update) + 0.97·t(no update). Beside ours:
`pytorch_optimizer.Muon` and, if importable, heavyball (compile off). Rows print as they are measured.

Run: `python benchmarks/optimizers.py [--targets tiny small 512 2048] [--threads 1]`.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from optquant.model import LM, model_config
from optquant.optim import OPTIMIZERS, AdamWConfig, ParamGroups, PSGDConfig, split_params, state_bytes

Build = Callable[[ParamGroups], list[torch.optim.Optimizer]]


def target_groups(name: str) -> ParamGroups:
    if name.isdigit():
        n = int(name)
        return ParamGroups([], [], [torch.nn.Parameter(torch.randn(n, n) * 0.02)])
    torch.manual_seed(0)
    return split_params(LM(model_config(name)))


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
    ours: dict[str, Build] = {name: cls().build for name, cls in OPTIMIZERS.items()}
    ours["psgd p=0.03"] = PSGDConfig(update_prob=0.0).build  # never updates; blended with "psgd" below
    ours["pytorch_optimizer.Muon"] = pytorch_optimizer_muon
    return ours | heavyball_builders()


AMORTIZED = {"shampoo": (20, 20), "soap": (20, 20), "heavyball.SOAP": (20, 20)}  # (warm-up, timed) steps


def measure(build: Build, target: str, warmup: int, steps: int) -> tuple[float, int]:
    """(seconds per step, optimizer-state bytes) of one optimizer on one target."""
    groups = target_groups(target)
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


def table(targets: list[str]) -> None:
    print("| target | optimizer | ms/step | × AdamW | state MB | × AdamW |", "|---|---|---:|---:|---:|---:|", sep="\n")
    for target in targets:
        base_t, base_b = measure(AdamWConfig().build, target, 2, 5)
        times: dict[str, float] = {}
        for name, build in builders().items():
            warmup, steps = AMORTIZED.get(name, (2, 5))
            t, b = (base_t, base_b) if name == "adamw" else measure(build, target, warmup, steps)
            times[name] = t
            if name == "psgd p=0.03":
                t = 0.03 * times["psgd"] + 0.97 * t
            row = f"| {target} | {name} | {1e3 * t:.2f} | {t / base_t:.1f} | {b / 2**20:.2f} | {b / base_b:.1f} |"
            print(row, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="+", default=["tiny", "small", "512", "2048"])
    parser.add_argument("--threads", type=int, default=1)  # the 2 cores are shared: 1 is steadier
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s)")
    if not heavyball_builders():
        print("heavyball not importable: its rows are skipped")
    table(args.targets)


if __name__ == "__main__":
    main()
