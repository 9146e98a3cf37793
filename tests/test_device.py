"""keep_freed_memory: a freed tensor's memory is reused, not faulted in afresh, and numbers do not change.

Each case runs in a fresh process: malloc's settings are per process and glibc's default adapts as a
process runs. Page faults are the process's minor faults (getrusage), the cost keep_freed_memory removes.
They count pages, not time, but two things besides malloc move them, so the children control both:
transparent huge pages (one fault maps 2 MB where the kernel has them free: a loaded machine has fewer) are
turned off with prctl, and a step's count is the median over steps, as a single step now and then grows the
heap by a fresh 4 MB (measured: one step of ten with 1,024 faults, the others 0).
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
    import ctypes, hashlib, json, resource, statistics
    ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: one fault per 4 kB page, whatever is free
    import torch
    from optquant.device import keep_freed_memory
    from optquant.model import LM, lm_loss, model_config
    kept = keep_freed_memory()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    model = LM(model_config("zepto", vocab_size=1024))  # the cpu study's smallest model
    x, y = torch.randint(0, 1024, (2, 16, 64))  # its logits: 16 x 64 x 1024 fp32 = 4 MB = 1,024 pages
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    def step():
        lm_loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    for _ in range(5):
        step()
    steps = []
    for _ in range(10):
        before = faults()
        step()
        steps.append(faults() - before)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    for _ in range(3):  # 64 MB: above glibc's largest adaptive mmap threshold (32 MB), below KEEP_BYTES; kept,
        big = torch.ones(16 << 20)  # the third and later come without a fault (measured: 16,418, 16,384, 0, 0)
        del big
    before = faults()
    big = torch.ones(16 << 20)
    print(json.dumps({"kept": kept, "step": statistics.median(steps), "big": faults() - before, "digest": digest}))
""")
PAGE = os.sysconf("SC_PAGE_SIZE")


def start(tunables: str | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}
    env["OMP_NUM_THREADS"] = "1"
    if tunables:
        env["GLIBC_TUNABLES"] = tunables
    return subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, text=True)


def result(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate(timeout=900)  # ~5 s idle; minutes niced on a loaded machine
    assert proc.returncode == 0
    return json.loads(out.strip().splitlines()[-1])


def test_freed_memory_is_reused_with_the_same_numbers():
    """Against a reference in which every block of 128 kB or more comes fresh from the kernel (a fixed mmap
    threshold: glibc's default adapts to the program, and may or may not reuse a 4 MB block), and on a 64 MB
    block, which glibc's default always maps afresh (16,385 faults, the reference's count too)."""
    kept, fresh = map(result, [start(None), start("glibc.malloc.mmap_threshold=131072")])  # side by side
    assert kept["kept"] and not fresh["kept"]  # a user's own malloc tuning is left alone
    assert fresh["step"] >= (4 << 20) // PAGE, fresh  # at least the logits' pages, faulted in on every step
    assert kept["step"] < fresh["step"] / 5, (kept, fresh)  # measured: 0 kept, 4,384 fresh
    assert fresh["big"] >= 0.9 * (64 << 20) // PAGE and kept["big"] < 0.1 * (64 << 20) // PAGE, (kept, fresh)
    assert kept["digest"] == fresh["digest"]


@pytest.mark.parametrize(("argv", "which"), [(["analyze", "--hf", "/nonexistent"], "return"),
                                             (["analyze", "/nonexistent"], "keep")])
def test_hf_runs_give_freed_memory_back(monkeypatch, argv, which):
    """`--hf` runs are bounded by memory: they hand freed blocks back (return_freed_memory), others keep them."""
    import optquant.device
    from optquant.cli import main

    calls = []
    for name in ("keep", "return"):
        monkeypatch.setattr(optquant.device, f"{name}_freed_memory", lambda name=name: calls.append(name))
    assert main(argv) != 0
    assert calls == [which]
