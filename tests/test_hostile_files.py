"""A path where a command expects a file it reads whole (a TOML config, a bit plan, a run's config.json, token ids)
may be anything: a FIFO (whose open blocks until a writer comes), a device (/dev/zero never ends; /dev/null reads
as an empty, valid TOML), a directory or a file far larger than any settings file. Each is one line and exit 2,
and nothing is written (issue 30, item 5).

A FIFO that the code opened regardless would hang the suite: `released` gives it a writer after a while, so a
regression reads EOF and fails the assertion instead of blocking.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from pathlib import Path

import pytest

from optquant.cli import main
from optquant.errors import OptquantError
from optquant.files import MAX_TEXT_BYTES


@contextlib.contextmanager
def released(fifo: Path, after: float = 20.0):
    """Every `after` s, open `fifo` for writing and close it: a reader blocked on it gets EOF and returns."""
    done = threading.Event()

    def release():
        while not done.wait(after):
            with contextlib.suppress(OSError):  # ENXIO: nobody reads it
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


@pytest.fixture
def hostile(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "adir").mkdir()
    with open(tmp_path / "huge.toml", "wb") as f:  # sparse: no disk space
        f.truncate(MAX_TEXT_BYTES + 1)
    return tmp_path


CASES = {  # argv with FILE for the hostile path → the kind the message names
    "train --config": (["train", "--config", "FILE", "--out", "out"], "TOML"),
    "study --config": (["study", "--config", "FILE", "--dry-run", "--out", "out"], "TOML"),
    "ptq --plan": (["ptq", "no-run", "--plan", "FILE", "--out", "out"], "JSON"),
}
PATHS = {"fifo": "is a FIFO", "/dev/null": "is a device", "adir": "is a directory",
         "huge.toml": f"{MAX_TEXT_BYTES + 1:,} bytes, too large"}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", CASES)
def test_a_file_that_is_not_one_is_one_line(hostile, capsys, case, path):
    argv, kind = CASES[case]
    with released(hostile / "fifo"):
        code = main([path if a == "FILE" else a for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"optquant: error: {path}: {PATHS[path]}" in err and (kind in err or "too large" in err), err
    assert not (hostile / "out").exists()


def test_a_run_whose_config_json_is_a_fifo(hostile, capsys, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "config.json")
    for argv in (["ptq", str(run)], ["analyze", str(run)], ["export", str(run), "--hf", "out"]):
        with released(run / "config.json"):
            assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and ("is a FIFO" in err or "not a run directory" in err), err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("name", "message"), [("fifo", "is a FIFO"), ("/dev/null", "is a device"),
                                               ("adir", "is a directory")])
def test_token_ids_from_a_fifo_or_device_are_refused(hostile, name, message):
    from optquant.hf.ptq_stage import read_ids

    with released(hostile / "fifo"), pytest.raises(OptquantError, match=f"^{name}: {message}, not a token-id file"):
        read_ids(Path(name), 320, 8)
    shutil.rmtree(hostile / "adir")


@pytest.mark.parametrize("source", ["fifo", "/dev/zero"])
def test_a_corpus_source_that_is_a_fifo_or_device(hostile, capsys, source):
    assert main(["data", "prepare", source, "--out", "out"]) == 2
    err = capsys.readouterr().err
    assert err == f"optquant: error: data source {source} is not a file or directory (a FIFO or device)\n", err
    assert not (hostile / "out").exists()
