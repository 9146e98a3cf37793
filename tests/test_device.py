"""keep_freed_memory: a freed tensor's memory is reused, not faulted in afresh, and numbers do not change.

Each case runs in a fresh process: malloc's settings are per process and glibc's default adapts as a
process runs. Page faults are the process's minor faults (getrusage), the cost keep_freed_memory removes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")

CHILD = textwrap.dedent("""
    import hashlib, json, resource
    import torch
    from optquant.device import keep_freed_memory
    from optquant.model import LM, lm_loss, model_config
    kept = keep_freed_memory()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LM(model_config("zepto", vocab_size=1024))  # the cpu study's smallest model
    x, y = torch.randint(0, 1024, (2, 16, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    def step():
        lm_loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    for _ in range(5):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        step()
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    print(json.dumps({"kept": kept, "faults": faults, "digest": digest}))
""")


def start(tunables: str | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}
    env["OMP_NUM_THREADS"] = "1"
    if tunables:
        env["GLIBC_TUNABLES"] = tunables
    return subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, text=True)


def result(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    return json.loads(out.strip().splitlines()[-1])


def test_freed_memory_is_reused_with_the_same_numbers():
    kept, default = map(result, [start(None), start("glibc.malloc.check=0")])  # side by side
    assert kept["kept"] and not default["kept"]  # a user's own malloc tuning is left alone
    # measured: ~1,700-2,000 faults per step by default (the 4 MB logits, softmax and their gradients are
    # ~1,000 pages each), 0-120 kept
    assert default["faults"] > 500, default
    assert kept["faults"] < default["faults"] / 5, (kept, default)
    assert kept["digest"] == default["digest"]


@pytest.mark.parametrize(("argv", "kept"), [(["analyze", "--hf", "/nonexistent"], False),
                                            (["analyze", "/nonexistent"], True)])
def test_hf_runs_give_freed_memory_back(monkeypatch, argv, kept):
    """`--hf` runs are bounded by memory: they leave malloc's defaults (freed blocks go back), others keep them."""
    import optquant.device
    from optquant.cli import main

    calls = []
    monkeypatch.setattr(optquant.device, "keep_freed_memory", lambda: calls.append(1))
    assert main(argv) != 0
    assert bool(calls) is kept


def test_every_command_declares_whether_it_keeps_freed_memory():
    """No special case in the dispatcher: each command's parser sets keep_freed (a forgotten one would fail)."""
    import argparse

    from optquant.cli import build_parser

    def leaves(parser: argparse.ArgumentParser):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        for child in subs[0].choices.values() if subs else ():
            yield from leaves(child)
        if not subs:
            yield parser

    commands = {p.prog.removeprefix("optquant "): p.get_default("keep_freed") for p in leaves(build_parser())}
    assert {"train", "study", "ptq", "analyze", "eval", "data prepare"} <= set(commands)
    assert all(isinstance(v, bool) for v in commands.values()), commands
    assert not commands["data prepare"] and commands["train"]
