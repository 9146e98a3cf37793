"""Reliability (issue 12): one writer per run, real divergence, clear one-line errors, nothing left behind.

Each test drives the CLI (or the library function the CLI calls) the way a user would and checks what
the user sees: the exit status, one line on stderr, and the files in the run directory.
"""

import errno
import json
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest

from optquant.cli import main
from optquant.config import resolve
from optquant.errors import OptquantError
from optquant.runs import locked, read_metrics, run_dir
from optquant.train import train

SRC = str(Path(__file__).resolve().parents[1] / "src")


def nano_args(corpus, out, *extra) -> list[str]:
    sets = [f"data.source={corpus}", "model.vocab_size=320", "model.seq_len=32", "train.batch_size=8",
            "train.steps=20", "train.eval_every=10", "train.eval_batches=2", "train.precision=fp32", *extra]
    return ["--preset", "nano", "--out", str(out), "--quiet", *[a for s in sets for a in ("--set", s)]]


def nano_path(corpus, out, *extra) -> Path:
    args = nano_args(corpus, out, *extra)
    return run_dir(out, resolve("nano", None, [a for a in args[6:] if a != "--set"]))


def one_line_error(capsys, *needles: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("optquant: error:") and "\n" not in err and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


@pytest.fixture(scope="module")
def done_run(tmp_path_factory, corpus):
    """A finished nano run, made by `optquant train` (copy it before changing it)."""
    out = tmp_path_factory.mktemp("runs")
    assert main(["train", *nano_args(corpus, out)]) == 0
    return nano_path(corpus, out)


# --- one writer per run directory ---------------------------------------------------------------


def test_second_writer_gets_one_line_naming_the_holder(corpus, tmp_path, capsys):
    path = nano_path(corpus, tmp_path)
    with locked(path):  # what a study job or another `optquant train` holds while it trains this run
        assert main(["train", *nano_args(corpus, tmp_path)]) == 2
        one_line_error(capsys, str(path), f"pid {os.getpid()}")
        assert read_metrics(path) == []  # the second process wrote nothing
    assert main(["train", *nano_args(corpus, tmp_path)]) == 0  # free again once the holder is gone
    assert [m["step"] for m in read_metrics(path)] == [10, 20]


def test_ptq_takes_the_same_lock(done_run, capsys):
    from optquant.ptq_stage import AnalysisConfig, out_dir

    with locked(out_dir(done_run, AnalysisConfig(), "w4a4-rtn")):
        assert main(["ptq", str(done_run), "--mc-items", "0"]) == 2
    one_line_error(capsys, "in use by")


def test_study_jobs_and_cli_share_one_lock():
    from optquant.study import jobs

    assert jobs.locked is locked


def test_partial_last_metrics_line_is_recomputed_on_resume(nano_cfg, runs_cache, tmp_path):
    straight = train(nano_cfg, run_dir(runs_cache, nano_cfg))

    def kill_at_25(info):
        if info["step"] == 25:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(nano_cfg, tmp_path / "killed", on_step=kill_at_25)
    with open(tmp_path / "killed" / "metrics.jsonl", "a") as f:
        f.write('{"step": 30, "train_loss": 2.1')  # an append cut short by a crash
    resumed = train(nano_cfg, tmp_path / "killed")
    assert resumed["final_val_loss"] == straight["final_val_loss"]
    assert read_metrics(tmp_path / "killed") == read_metrics(run_dir(runs_cache, nano_cfg))


def test_corrupt_summary_is_an_error_not_a_result(done_run, tmp_path, capsys, corpus):
    run = tmp_path / done_run.name
    shutil.copytree(done_run, run)
    (run / "summary.json").write_text('{"status": "done", "final_val_')
    assert main(["train", *nano_args(corpus, tmp_path)]) == 2
    one_line_error(capsys, "summary.json")


def test_json_results_never_hold_infinity(tmp_path):
    from optquant.files import atomic_write_json

    atomic_write_json(tmp_path / "best.json", {"adamw/nano": {"best_lr": 1e3, "edge": True, "loss": math.inf}})

    def strict(name):
        raise ValueError(f"non-standard JSON constant {name}")

    best = json.loads((tmp_path / "best.json").read_text(), parse_constant=strict)
    assert best["adamw/nano"]["loss"] is None


# --- divergence ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["adamw", "psgd", "shampoo", "soap"])
def test_huge_lr_is_diverged_not_done(nano_cfg, tmp_path, name):
    from optquant.config import apply_overrides

    summary = train(apply_overrides(nano_cfg, [f"optim.name={name}", "optim.lr=1e3"]), tmp_path / "run")
    assert summary["status"] == "diverged" and summary["final_val_loss"] is None
    assert summary["diverged_step"] is not None and "divergence bound" in summary["diverged_reason"]


def test_divergence_bound_is_a_config_field(nano_cfg, tmp_path):
    from optquant.config import apply_overrides

    with pytest.raises(OptquantError, match="diverge_factor"):
        apply_overrides(nano_cfg, ["train.diverge_factor=0.5"])
    cfg = apply_overrides(nano_cfg, ["optim.lr=1e3", "train.diverge_factor=0", "train.steps=3"])
    off = train(cfg, tmp_path / "off")
    assert off["status"] == "done" and off["final_val_loss"] > 3 * math.log(320)  # only NaN/inf count


def test_diverged_run_says_so_on_stderr(corpus, tmp_path, capsys):
    assert main(["train", *nano_args(corpus, tmp_path, "optim.lr=1e3")]) == 3
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "diverged at step" in err and "divergence bound" in err


def test_study_warns_when_no_lr_converged(nano_cfg, tmp_path):
    from optquant.config import apply_overrides
    from optquant.study.plan import Study, loss_of, warn_unconverged
    from optquant.study.tuning import LRSearch
    from optquant.study_spec import StudySpec

    table = {}
    for opt in ("adamw", "soap"):
        lrs = ("1e3", "1e4") if opt == "soap" else ("3e-3",)
        per_lr = {float(lr): [train(apply_overrides(nano_cfg, [f"optim.name={opt}", f"optim.lr={lr}"]),
                                    tmp_path / f"{opt}-{lr}")] for lr in lrs}
        best = min(per_lr, key=lambda lr: loss_of(per_lr[lr][0]))
        table[(opt, "nano")] = LRSearch(per_lr, best, "bracketed", "", loss_of(per_lr[best][0]))
    events = []
    messages = warn_unconverged(Study(StudySpec(), tmp_path, events.append), table)
    assert len(messages) == 1 and "soap" in messages[0] and "nano" in messages[0]
    assert events == [{"event": "warning", "message": messages[0]}]


# --- validation at the boundary -----------------------------------------------------------------


@pytest.mark.parametrize("sets, needle", [
    (["train.batch_size=0"], "train.batch_size"),
    (["train.batch_size=-1"], "train.batch_size"),
    (["optim.lr=-1"], "optim.lr"),
    (["optim.lr=nan"], "optim.lr"),
    (["optim.lr=inf"], "optim.lr"),
    (["train.eval_every=0"], "train.eval_every"),
    (["train.eval_batches=0"], "train.eval_batches"),
    (["train.grad_accum=0"], "train.grad_accum"),
    (["train.grad_accum=3"], "divisible"),
    (["train.steps=-5"], "train.steps"),
    (["train.steps=0", "train.tokens_per_param=0"], "tokens_per_param"),
    (["train.warmup_frac=0.9", "train.decay_frac=0.5"], "exceeds 1"),
    (["model.n_head=5"], "n_head"),
    (["seed=-1"], "seed"),
    (["name=../escape"], "name"),
    (["optim.name=muon", "optim.momentum=1.5"], "optim.momentum"),
    (["train.steps=1e400"], "train.steps"),
])
def test_bad_values_fail_before_a_run_directory_exists(corpus, tmp_path, capsys, sets, needle):
    assert main(["train", *nano_args(corpus, tmp_path / "out", *sets)]) == 2
    one_line_error(capsys, needle)
    assert not (tmp_path / "out").exists()


def test_non_utf8_toml_is_one_line(tmp_path, capsys):
    toml = tmp_path / "run.toml"
    toml.write_bytes('[optim]\nname = "adamw" # caf\xe9\n'.encode("latin-1"))
    assert main(["train", "--config", str(toml), "--out", str(tmp_path / "out")]) == 2
    one_line_error(capsys, str(toml), "UTF-8")


@pytest.mark.parametrize("name, content, needle", [
    ("docs.jsonl", '{"text": "caf\xe9 au lait"}\n'.encode("latin-1"), "UTF-8"),
    ("docs.parquet", b"PAR1 this is not parquet", "parquet"),
])
def test_bad_corpus_file_is_one_line_naming_it(tmp_path, capsys, name, content, needle):
    source = tmp_path / "corpus"
    source.mkdir()
    (source / name).write_bytes(content)
    assert main(["train", *nano_args(source, tmp_path / "out")]) == 2
    one_line_error(capsys, name, needle)
    assert not (tmp_path / "out").exists()


def _results_parquet(path: Path) -> Path:
    """A results.parquet as the study writes it (files.write_parquet of a long table)."""
    from optquant.files import write_parquet

    df = pd.DataFrame({"size": ["nano"], "n_params": [1000], "optimizer": ["adamw"], "lr": [1e-3], "seed": [0],
                       "kind": ["fp"], "best_lr": [True], "run_id": ["r"], "scheme": ["none"],
                       "metric": ["final_val_loss"], "value": [3.0]})
    write_parquet(path / "results.parquet", df)
    return path / "results.parquet"


@pytest.mark.parametrize("command", ["fit", "report"])
def test_truncated_results_parquet_is_one_line(tmp_path, capsys, command):
    results = _results_parquet(tmp_path)
    results.write_bytes(results.read_bytes()[: results.stat().st_size // 2])
    assert main([command, str(tmp_path)]) == 2
    one_line_error(capsys, "results.parquet")


def test_report_on_an_empty_directory_is_an_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    one_line_error(capsys, "not a study directory")


def test_checkpoint_of_another_optimizer_is_a_clear_error(nano_cfg, tmp_path):
    from optquant.config import apply_overrides

    def stop_at_15(info):
        if info["step"] == 15:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(nano_cfg, tmp_path / "adamw", on_step=stop_at_15)
    (tmp_path / "muon").mkdir()
    shutil.copy(tmp_path / "adamw" / "checkpoint.safetensors", tmp_path / "muon")
    with pytest.raises(OptquantError, match="written by optimizer 'adamw', not 'muon'"):
        train(apply_overrides(nano_cfg, ["optim.name=muon"]), tmp_path / "muon")


def test_ptq_group_size_must_divide_the_width(done_run, capsys):
    assert main(["ptq", str(done_run), "--group-size", "7", "--a-bits", "16", "--mc-items", "0"]) == 2
    one_line_error(capsys, "w_group_size=7", "48")
    assert not (done_run / "ptq" / "final" / "w4a16-rtn-g7").exists()


# --- OS errors ------------------------------------------------------------------------------------


def test_output_under_a_file_is_one_line(corpus, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert main(["train", *nano_args(corpus, tmp_path / "file" / "runs")]) == 2
    one_line_error(capsys, str(tmp_path / "file"))


@pytest.mark.parametrize("command", ["train", "study", "report"])
def test_read_only_output_is_one_line_with_the_path(corpus, tmp_path, capsys, monkeypatch, command):
    ro = tmp_path / "ro"
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):  # a read-only mount, as root sees it too (chmod does not stop root)
        if str(self).startswith(str(ro)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_mkdir(self, *args, **kwargs)

    if command == "report":
        shutil.copytree(_results_parquet(tmp_path / "study").parent, ro)
    monkeypatch.setattr(Path, "mkdir", mkdir)
    argv = {"train": ["train", *nano_args(corpus, ro)],
            "study": ["study", "--preset", "smoke", "--out", str(ro), "--quiet"],
            "report": ["report", str(ro)]}[command]
    assert main(argv) == 2
    one_line_error(capsys, str(ro), "Read-only file system")


def test_full_disk_is_one_line_and_keeps_the_checkpoint(corpus, tmp_path, capsys, monkeypatch):
    import optquant.checkpoint as ck

    def stop_at_15(info):
        if info["step"] == 15:
            raise KeyboardInterrupt

    path = nano_path(corpus, tmp_path)
    with pytest.raises(KeyboardInterrupt):
        train(resolve("nano", None, [a for a in nano_args(corpus, tmp_path)[6:] if a != "--set"]), path,
              on_step=stop_at_15)
    before = (path / "checkpoint.safetensors").read_bytes()
    real = ck.save_file

    def full_disk(tensors, filename, metadata=None):  # what safetensors 0.8 raises on a full tmpfs
        if Path(filename).name == "checkpoint.safetensors":
            raise ck.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(ck, "save_file", full_disk)
    assert main(["train", *nano_args(corpus, tmp_path)]) == 2
    one_line_error(capsys, "checkpoint.safetensors", "disk is full")
    assert (path / "checkpoint.safetensors").read_bytes() == before
    assert not list(path.glob(".*.tmp")) and not list(path.glob(".tmp*"))


def test_report_into_a_closed_pipe_is_quiet(tmp_path):
    """`optquant report | head`: the reader leaves early; no BrokenPipeError traceback."""
    _results_parquet(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from optquant.cli import main; "
                             f"sys.exit(main(['report', {str(tmp_path)!r}]))"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": SRC})
    proc.stdout.close()  # the reader is gone before the first write (the child is still importing)
    err = proc.stderr.read().decode()
    assert proc.wait(120) == 141 and "Traceback" not in err and "Error" not in err, err


# --- nothing left behind ----------------------------------------------------------------------------


def _run_script(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": SRC, **env}, timeout=120)


def test_killed_checkpoint_write_leaves_no_temp_file(tmp_path):
    """A writer SIGKILLed mid-write leaves its temporary; the next write of that file removes it."""
    proc = _run_script(f"""
        import os, signal
        from pathlib import Path
        from optquant.files import atomic_write

        def die(tmp):
            Path(tmp).write_bytes(b"")  # the file exists, nothing in it yet
            os.kill(os.getpid(), signal.SIGKILL)

        atomic_write(Path({str(tmp_path)!r}) / "checkpoint.safetensors", die)
    """)
    assert proc.returncode == -signal.SIGKILL
    assert len(list(tmp_path.glob(".checkpoint.safetensors.*.tmp"))) == 1  # what the kill leaves
    from optquant.checkpoint import save_checkpoint
    from optquant.config import RunConfig
    from optquant.model import LM

    save_checkpoint(tmp_path / "checkpoint.safetensors", LM(RunConfig().model), {"step": 1})
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.safetensors"]


def test_killed_tokenizer_build_leaves_no_temp_dir(corpus, tmp_path):
    cache = tmp_path / "cache"
    proc = _run_script(f"""
        import os, signal
        import optquant.data as data
        from optquant.data import DataConfig, load_tokens

        def die(tmp, *args):
            (tmp / "tokenizer.json").write_text("")
            os.kill(os.getpid(), signal.SIGKILL)

        data._build = die
        load_tokens(DataConfig(source={str(corpus)!r}), 320)
    """, OPTQUANT_CACHE=str(cache))
    assert proc.returncode == -signal.SIGKILL
    tokens = cache / "tokens"
    assert len([p for p in tokens.iterdir() if p.name.startswith(".")]) == 1  # what the kill leaves
    from optquant.data import DataConfig, load_tokens

    load_tokens(DataConfig(source=str(corpus), cache_dir=str(cache)), 320)
    assert [p.name for p in tokens.iterdir() if p.name.startswith(".")] == []


def test_files_follow_the_umask(corpus, tmp_path, capsys):
    old = os.umask(0o022)
    try:
        assert main(["train", *nano_args(corpus, tmp_path, "train.steps=10", "train.eval_every=5",
                                         "train.cl_threshold=100")]) == 0
        path = nano_path(corpus, tmp_path, "train.steps=10", "train.eval_every=5", "train.cl_threshold=100")
        for name in ("config.json", "summary.json", "model.safetensors", "cl_model.safetensors", "metrics.jsonl"):
            assert stat.S_IMODE((path / name).stat().st_mode) == 0o644, name
        capsys.readouterr()
        assert main(["ptq", str(path), "--mc-items", "0"]) == 0
        out = path / "ptq" / "final" / "w4a4-rtn"
        assert stat.S_IMODE((out / "summary.json").stat().st_mode) == 0o644
        assert stat.S_IMODE(out.stat().st_mode) == 0o755
    finally:
        os.umask(old)


def _descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            children = (task / "children").read_text().split() if (task / "children").exists() else []
            for c in map(int, children):
                if c not in out:
                    out.add(c)
                    todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in status  # a zombie has exited; only its exit status waits to be read


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_workers_die_with_a_killed_study(nano_cfg, tmp_path):
    """SIGKILL the process that runs a pool of study workers (`run_local`, the pool `execute` runs local jobs
    in; called directly, the parent skips execute's bookkeeping imports): no worker (or helper) may outlive it."""
    from optquant.config import apply_overrides, to_dict

    cfgs = [apply_overrides(nano_cfg, ["train.steps=100000", "data.max_epochs=1e9", f"seed={s}"]) for s in (1, 2)]
    script = f"""
        from optquant.config import from_dict
        from optquant.study.executor import run_local
        from optquant.study.jobs import TrainJob
        jobs = [TrainJob(from_dict(c), {str(tmp_path)!r} + f"/run{{i}}")
                for i, c in enumerate({[to_dict(c) for c in cfgs]!r})]
        for _ in run_local(jobs, 2):
            pass
    """
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)],
                              env={**os.environ, "PYTHONPATH": SRC}, stderr=subprocess.DEVNULL)
    children: set[int] = set()
    try:
        deadline = time.time() + 90
        while time.time() < deadline and not all((tmp_path / f"run{i}" / "config.json").exists() for i in (0, 1)):
            time.sleep(0.2)
        children = _descendants(parent.pid)
        assert len(children) >= 2, "the workers did not start"
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.time() + 20
        while time.time() < deadline and any(_alive(c) for c in children):
            time.sleep(0.2)
        assert not [c for c in children if _alive(c)]
    finally:
        parent.kill()
        for c in children:
            if _alive(c):
                os.kill(c, signal.SIGKILL)
