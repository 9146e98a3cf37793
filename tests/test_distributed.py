"""DDP tests: `optquant train` under torchrun with 2 gloo processes on CPU vs 1 process, same global batch.

Strategy. The 2-rank run (global batch 16 = 2 ranks × 8) and the 1-process reference (16 = 2 accumulation
steps × 8) share the model init; only the training data differ (each rank has its own data stream).
Curves are measured on a probe set of 4 × 8 validation windows that a spy evaluates beside the loop's
own evaluation, so every layout is scored on the same windows whatever the loop's set depends on.

1. The real path (`optquant.cli.main`, random data): probe curves must agree within the natural
   spread of 1-process runs that differ only in their data stream. Measured on this config (nano,
   vocab 320, T = 32, 60 steps, eval every 10, 8 data seeds = 28 pairs): mean |Δ| over the 6 evals
   ≤ 0.040 nats (median 0.020), max |Δ| at any eval ≤ 0.079; per-eval std 0.007–0.029. Global batch 8
   instead of 16 (what a rank trains if gradients are not combined, or if the ranks draw the same
   data) differs from batch 16 by mean |Δ| ≥ 0.087 and max |Δ| ≥ 0.122 (32 pairs). Tolerances: mean
   |Δ| < 0.06, max |Δ| < 0.12. Measured for DDP vs 1 process: mean 0.010, max 0.027.
2. Same data (the loop's `get_batch` patched so micro-batch k of a step is the same windows in both
   layouts): losses and final weights are bitwise equal. Scaling a loss by 1/2 is exact in floating
   point and a sum of two terms commutes, so the all-reduce of 2 ranks and the accumulation of 2
   micro-batches give the same bits. This checks the gradient combination itself: loss scaling,
   no_sync, every rank's batch counting.
3. A 2-rank run resumed from its step-30 checkpoint ends bitwise where the uninterrupted one does.
4. The same on a corpus prepared by `optquant data prepare` (memory-mapped shards): each rank's first batch is
   the windows its own generator draws from the prepared stream (so the ranks differ), and a resume is exact.

Both ranks must end with bitwise identical parameters and probe losses (saved by spies beside the run,
since only rank 0 writes the run), and rank 0 alone must have written the run directory. The three
2-rank jobs run in one torchrun launch, one after another in the same processes, as a study's would.

This file is also the torchrun worker: `python -m torch.distributed.run ... tests/test_distributed.py JOBS`.
"""

from __future__ import annotations

import contextlib
import faulthandler
import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

SAME_DATA_SEED = 4242
RESUME_STEP = 30
PROBE_SEED, PROBE_BATCHES = 999, 4
RUN_FILES = {".lock", "config.json", "metrics.jsonl", "model.safetensors", "summary.json"}  # .lock: runs.locked
ARGS = (
    "--preset nano --quiet --set model.vocab_size=320 --set model.seq_len=32 --set train.batch_size=16 "
    "--set train.steps=60 --set train.eval_every=10 --set train.eval_batches=4 --set train.precision=fp32"
).split()


def _lay_out_resume(job: dict) -> None:
    """Rank 0 copies the source run's config, metrics and step-30 checkpoint into a fresh run dir; the
    barrier at the end of distributed.setup keeps the other ranks from looking before it is done."""
    (source,) = Path(job["resume_from"], "runs").iterdir()
    target = Path(job["out"]) / source.name
    target.mkdir(parents=True)
    for name in ("config.json", "metrics.jsonl"):
        shutil.copy(source / name, target)
    shutil.copy(Path(job["resume_from"], "spy", "checkpoint.safetensors"), target)


def run_job(job: dict) -> int:
    """`optquant train` with spies: this rank's final parameters, the checkpoint at RESUME_STEP."""
    from safetensors.torch import save_file

    import optquant.train as loop
    from optquant.checkpoint import model_tensors
    from optquant.cli import main
    from optquant.data import fixed_batches

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    spy_dir = Path(job["spy"])
    spy_dir.mkdir(parents=True, exist_ok=True)
    models, probe, probe_losses, calls = [], [], [], itertools.count()
    build, get_batch, save_checkpoint = loop.build_model, loop.get_batch, loop.save_checkpoint
    evaluate = loop.validation_loss

    def spy_build(cfg):
        models.append(build(cfg))
        val = loop.load_tokens(cfg.data, cfg.model.vocab_size).val
        probe[:] = fixed_batches(val, PROBE_BATCHES, 8, cfg.model.seq_len, seed=PROBE_SEED)
        return models[-1]

    def spy_evaluate(model, batches):
        # the same validation set in every layout, whatever the loop's own set depends on
        probe_losses.append(evaluate(model, probe))
        return evaluate(model, batches)

    def spy_save(path, model, state):
        save_checkpoint(path, model, state)
        if state["loop"]["step"] == RESUME_STEP:
            shutil.copy(path, spy_dir / "checkpoint.safetensors")

    def recorded_batch(tokens, batch_size, seq_len, generator):
        x, y = get_batch(tokens, batch_size, seq_len, generator)
        if not (spy_dir / f"batch{rank}.safetensors").exists():  # this rank's first micro-batch
            save_file({"x": x}, str(spy_dir / f"batch{rank}.safetensors"))
        return x, y

    def shared_batch(tokens, batch_size, seq_len, generator):
        # call c of rank r is global micro-batch c·world + r: with 1 process and grad_accum = world,
        # step s draws micro-batches s·world … s·world + world − 1, exactly what the ranks draw at step s
        k = next(calls) * world + rank
        return get_batch(tokens, batch_size, seq_len, torch.Generator().manual_seed(SAME_DATA_SEED + k))

    if job.get("resume_from") and rank == 0:
        _lay_out_resume(job)
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(loop, "build_model", spy_build))
        stack.enter_context(mock.patch.object(loop, "save_checkpoint", spy_save))
        stack.enter_context(mock.patch.object(loop, "validation_loss", spy_evaluate))
        stack.enter_context(mock.patch.object(loop, "get_batch", shared_batch if job["same_data"] else recorded_batch))
        code = main(["train", "--out", job["out"], *job["args"]])
    save_file(model_tensors(models[-1]), str(spy_dir / f"rank{rank}.safetensors"))
    (spy_dir / f"probe{rank}.json").write_text(json.dumps(probe_losses))
    return code


def curve(root: Path, key: str = "val_loss") -> list[tuple[int, int, float]]:
    (run,) = root.glob("nano-adamw-*")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [(m["step"], m["tokens"], m[key]) for m in map(json.loads, lines)]


def probe_curve(path: Path, rank: int = 0) -> list[float]:
    return json.loads((path / f"probe{rank}.json").read_text())


def spied(path: Path, rank: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / f"rank{rank}.safetensors"))


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory) -> dict[str, dict]:
    """Two 1-process references here, then the three 2-rank jobs in one torchrun launch."""
    from optquant.corpus.prepare import PrepareConfig, prepare

    root = tmp_path_factory.mktemp("ddp")
    prepare([str(corpus)], root / "tok", PrepareConfig(vocab_size=320, processes=1))
    base = ARGS + ["--set", f"data.source={corpus}", "--set", f"data.cache_dir={root / 'cache'}"]
    prepared = ARGS + ["--set", f"data.source={root / 'tok'}", "--set", f"data.cache_dir={root / 'cache'}"]
    jobs = {}
    layouts = {
        "single-random": False,
        "single-same": True,
        "ddp-random": False,
        "ddp-same": True,
        "ddp-resume": False,
        "ddp-prepared": False,
        "ddp-prepared-resume": False,
    }  # name: same_data
    for name, same in layouts.items():
        extra = ["--set", "train.grad_accum=2"] if name.startswith("single") else []
        spy, out = str(root / name / "spy"), str(root / name / "runs")
        jobs[name] = {"out": out, "spy": spy, "same_data": same, "args": (prepared if "prepared" in name else base)
                      + extra}
    jobs["ddp-resume"]["resume_from"] = str(root / "ddp-random")
    jobs["ddp-prepared-resume"]["resume_from"] = str(root / "ddp-prepared")
    for name in ("single-random", "single-same"):
        assert run_job(jobs[name]) == 0  # also builds the token cache, so the ranks only read it
    ddp = [job for name, job in jobs.items() if name.startswith("ddp")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, *"-m torch.distributed.run --standalone --nproc_per_node=2".split(), __file__]
    proc = subprocess.run([*cmd, json.dumps(ddp)], env=env, capture_output=True, text=True, timeout=100 * len(ddp))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {name: {**job, "out": Path(job["out"]), "spy": Path(job["spy"])} for name, job in jobs.items()} | \
        {"tok": root / "tok", "cache": root / "cache"}


def test_two_ranks_match_one_process_within_data_noise(runs):
    one, two = curve(runs["single-random"]["out"]), curve(runs["ddp-random"]["out"])
    assert [r[:2] for r in one] == [r[:2] for r in two] == [(s, s * 16 * 32) for s in range(10, 61, 10)]
    one, two = probe_curve(runs["single-random"]["spy"]), probe_curve(runs["ddp-random"]["spy"])
    deltas = [abs(a - b) for a, b in zip(one, two, strict=True)]
    assert len(deltas) == 6 and sum(deltas) / len(deltas) < 0.06, deltas
    assert max(deltas) < 0.12, deltas
    assert two[-1] < 0.25 * two[0]  # it trained (the reference falls 4.1 → 0.7)


@pytest.mark.parametrize("kind", ["random", "same", "resume", "prepared", "prepared-resume"])
def test_ranks_end_identical_and_only_rank0_writes(runs, kind):
    job = runs[f"ddp-{kind}"]
    rank0 = spied(job["spy"], 0)
    assert same_tensors(rank0, spied(job["spy"], 1))
    assert probe_curve(job["spy"], 0) == probe_curve(job["spy"], 1)  # so every rank stops at the same eval
    (run,) = job["out"].iterdir()
    assert {p.name for p in run.iterdir()} == RUN_FILES  # no checkpoint left, no stray temp file
    from safetensors.torch import load_file

    assert same_tensors(load_file(str(run / "model.safetensors")), rank0)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "done" and summary["steps"] == 60 and summary["tokens_per_step"] == 16 * 32
    assert len(curve(job["out"])) == 6  # one writer: two would have doubled the lines


def test_same_data_gives_the_same_bits(runs):
    one, two = runs["single-same"], runs["ddp-same"]
    assert curve(one["out"], "train_loss") == curve(two["out"], "train_loss")
    assert probe_curve(one["spy"]) == probe_curve(two["spy"])
    assert same_tensors(spied(one["spy"], 0), spied(two["spy"], 0))
    # the shared stream differs from the layouts' own draws (else this test would show nothing)
    assert probe_curve(one["spy"]) != probe_curve(runs["single-random"]["spy"])


def test_resumed_two_rank_run_ends_bitwise_where_the_straight_one_does(runs):
    straight, resumed = runs["ddp-random"], runs["ddp-resume"]
    for key in ("val_loss", "train_loss"):
        assert curve(resumed["out"], key) == curve(straight["out"], key)
    assert probe_curve(resumed["spy"]) == probe_curve(straight["spy"])[RESUME_STEP // 10 :]
    assert same_tensors(spied(resumed["spy"], 0), spied(straight["spy"], 0))


def test_on_a_prepared_corpus_each_rank_draws_its_own_windows_and_a_resume_is_exact(runs):
    from safetensors.torch import load_file

    from optquant.corpus.manifest import open_prepared, read_manifest
    from optquant.data import get_batch

    straight, resumed = runs["ddp-prepared"], runs["ddp-prepared-resume"]
    (run,) = straight["out"].iterdir()
    record = json.loads((run / "config.json").read_text())
    assert record["corpus_id"] == read_manifest(runs["tok"])["corpus_id"]
    stream, seed = open_prepared(str(runs["tok"]), runs["cache"] / "tokens").train, record["config"]["seed"]
    firsts = [load_file(str(straight["spy"] / f"batch{rank}.safetensors"))["x"] for rank in (0, 1)]
    for rank, x in enumerate(firsts):  # the stream of train._setup's generator for this rank, on the shards
        want, _ = get_batch(stream, 8, 32, torch.Generator().manual_seed(seed * 1000 + 17 + rank))
        assert torch.equal(x, want)
    assert not torch.equal(*firsts)
    for key in ("val_loss", "train_loss"):
        assert curve(resumed["out"], key) == curve(straight["out"], key)
    assert same_tensors(spied(resumed["spy"], 0), spied(straight["spy"], 0))
    assert probe_curve(resumed["spy"]) == probe_curve(straight["spy"])[RESUME_STEP // 10 :]


if __name__ == "__main__":  # a torchrun worker: the jobs run in turn in the same processes
    jobs = json.loads(sys.argv[1])
    faulthandler.dump_traceback_later(80 * len(jobs), exit=True)  # a hung collective fails the test with stacks
    torch.set_num_threads(1)
    sys.exit(max([run_job(job) for job in jobs]))
