"""Tests for optquant.corpus: `optquant data prepare` and training on what it writes.

Strategy: small corpora generated in every format the command reads, prepared for real (a 300-token BPE),
and checked by invariants that fail on real bugs: the shards decode to exactly the documents the split rule
assigns them, in file order; 1 and 2 processes and submitit's local executor write the same bytes; a
prepare killed with SIGKILL continues to the same shards; windows drawn from the shards equal windows of
the concatenated stream; a run on a prepared directory resumes bitwise. Every bad input is one
OptquantError (one CLI line) naming what is wrong, and leaves the finished work intact.
"""

from __future__ import annotations

import errno
import gzip
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from optquant.cli import main
from optquant.config import apply_overrides, run_preset
from optquant.corpus import prepare as prep
from optquant.corpus.manifest import MANIFEST, Shard, ShardedTokens, open_prepared, read_manifest
from optquant.corpus.prepare import PrepareConfig, prepare
from optquant.corpus.sources import EOT, documents, resolve_inputs
from optquant.data import DataConfig, get_batch, is_val, load_tokens
from optquant.errors import OptquantError
from optquant.runs import read_metrics
from optquant.train import train

V = 300
CFG = PrepareConfig(vocab_size=V, sample_bytes=1 << 20, processes=1)


def texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 7))) for _ in range(60)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(20, 120))) + "." for _ in range(n)]


def write_corpus(root: Path, n: int = 60) -> Path:
    """One file of every supported kind (a nested directory too), with blank lines and nulls in them."""
    (root / "sub").mkdir(parents=True, exist_ok=True)
    t = texts(6 * n, 0)
    (root / "a.txt").write_text(EOT.join(t[:n]), encoding="utf-8")
    lines = [json.dumps({"text": x}) for x in t[n : 2 * n]]
    (root / "b.jsonl").write_text("\n".join(lines[:5] + [""] + lines[5:] + ['{"text": null}']) + "\n")
    with gzip.open(root / "sub" / "c.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": x}) + "\n" for x in t[2 * n : 3 * n])
    with pa.output_stream(str(root / "sub" / "d.jsonl.zst"), compression="zstd") as f:
        f.write("".join(json.dumps({"text": x}) + "\n" for x in t[3 * n : 4 * n]).encode())
    pq.write_table(pa.table({"text": t[4 * n :], "n": list(range(2 * n))}), root / "e.parquet", row_group_size=n // 2)
    return root


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("raw"))


@pytest.fixture(scope="module")
def prepared(raw, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prep") / "tok"
    prepare([str(raw)], out, CFG)
    return out


def shard_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.glob("*/*.bin"))}


def test_shards_hold_exactly_the_split_documents_in_file_order(raw, prepared):
    m = read_manifest(prepared)
    tok = load_tokens(DataConfig(source=str(prepared)), V).tokenizer
    split = DataConfig()
    for s in ("train", "val"):
        want = [t for inp in resolve_inputs([str(raw)]) for d, t in documents(inp, "text")
                if is_val(d, split) == (s == "val")]
        got = []
        for e in m["shards"][s]:
            ids = np.fromfile(prepared / e["file"], dtype=m["dtype"])
            assert ids[-1] == m["tokenizer"]["eot_id"] and e["sha256"]
            docs = np.split(ids, np.flatnonzero(ids == m["tokenizer"]["eot_id"]) + 1)[:-1]
            assert len(docs) == e["documents"] and ids.size == e["tokens"]
            got += [tok.decode(d[:-1].tolist()) for d in docs]
        assert got == want and m["totals"][s]["documents"] == len(want)
    assert m["dtype"] == "uint16" and m["tokenizer"]["vocab_size"] == V
    assert [s["name"] for s in m["sources"]] == ["a.txt", "b.jsonl", "e.parquet", "sub/c.jsonl.gz", "sub/d.jsonl.zst"]
    assert m["split"]["val_fraction"] == 0.05 and "sha1" in m["split"]["rule"]


def test_same_shards_from_one_and_two_processes_and_submitit(raw, prepared, tmp_path):
    two = tmp_path / "two"
    prepare([str(raw)], two, PrepareConfig(vocab_size=V, sample_bytes=1 << 20, processes=2))
    cluster = tmp_path / "cluster"
    prepare([str(raw)], cluster, PrepareConfig(vocab_size=V, sample_bytes=1 << 20, executor="submitit-local", jobs=2))
    for other in (two, cluster):
        assert shard_bytes(other) == shard_bytes(prepared)
        assert read_manifest(other)["corpus_id"] == read_manifest(prepared)["corpus_id"]
    assert list((cluster / prep.WORK / "submitit").glob("*_result.pkl"))  # it did run as submitit jobs
    globbed = tmp_path / "globbed"  # the same files named as a glob gives them: the same documents and ids
    prepare([str(raw / "*"), str(raw / "**" / "*.jsonl.*")], globbed, CFG)
    assert read_manifest(globbed)["sources"] == read_manifest(prepared)["sources"]


def test_windows_across_shards_equal_the_concatenated_stream(tmp_path):
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 500, n).astype(np.uint16) for n in (7, 1, 40, 3, 25)]
    shards = []
    for i, p in enumerate(parts):
        p.tofile(tmp_path / f"{i}.bin")
        shards.append(Shard(tmp_path / f"{i}.bin", p.size, ""))
    stream, whole = ShardedTokens(shards, "uint16"), np.concatenate(parts)
    assert len(stream) == whole.size and np.array_equal(np.asarray(stream), whole)
    assert np.array_equal(stream[5:60], whole[5:60])
    for seed in range(5):
        a = get_batch(stream, 6, 9, torch.Generator().manual_seed(seed))
        b = get_batch(whole, 6, 9, torch.Generator().manual_seed(seed))
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_prepared_corpus_trains_resumes_bitwise_and_serves_ptq(prepared, tmp_path):
    cfg = apply_overrides(run_preset("nano"), [
        f"data.source={prepared}", f"model.vocab_size={V}", "model.seq_len=32", "train.batch_size=8",
        "train.steps=40", "train.eval_every=10", "train.eval_batches=2", "train.precision=fp32"])
    straight = train(cfg, tmp_path / "straight")

    class Interrupt(Exception):
        pass

    def kill_at_25(info):
        if info["step"] == 25:
            raise Interrupt

    with pytest.raises(Interrupt):
        train(cfg, tmp_path / "killed", on_step=kill_at_25)
    resumed = train(cfg, tmp_path / "killed")
    assert resumed["final_val_loss"] == straight["final_val_loss"]
    assert read_metrics(tmp_path / "killed") == read_metrics(tmp_path / "straight")
    assert main(["ptq", str(tmp_path / "straight"), "--method", "rtn", "--mc-items", "20"]) == 0
    with pytest.raises(OptquantError, match=f"tokenizer has {V} tokens, more than model.vocab_size=280"):
        train(apply_overrides(cfg, ["model.vocab_size=280"]), tmp_path / "small-vocab")
    assert not (tmp_path / "small-vocab").exists()


def test_killed_prepare_resumes_with_the_same_shards(tmp_path):
    src = tmp_path / "many"
    for i in range(12):
        (src / f"{i:02d}").mkdir(parents=True)
        (src / f"{i:02d}" / "x.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts(1500, i)))
    argv = ["data", "prepare", str(src), "--vocab-size", str(V), "--processes", "1"]
    clean, killed = tmp_path / "clean", tmp_path / "k"
    assert main([*argv, "--processes", "2", "--out", str(clean)]) == 0
    proc = subprocess.Popen([sys.executable, "-m", "optquant.cli", *argv, "--out", str(killed)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tasks, deadline = killed / prep.WORK / "tasks", time.time() + 120
    while not (tasks.is_dir() and any(tasks.glob("*.json"))) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / MANIFEST).exists(), "killed too late: every task had finished"
    kept = shard_bytes(killed)  # only whole shards are ever visible, each already the clean run's
    assert kept and all(kept[k] == v for k, v in shard_bytes(clean).items() if k in kept)
    assert main([*argv, "--out", str(killed)]) == 0
    assert shard_bytes(killed) == shard_bytes(clean)
    assert not list(killed.rglob("*.tmp"))


def test_user_tokenizer_folder_and_its_end_of_document_token(raw, prepared, tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "tokenizer.json").write_text((prepared / "tokenizer.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": EOT}}))
    out = tmp_path / "user"
    m = prepare([str(raw / "b.jsonl")], out, PrepareConfig(tokenizer=str(folder)))
    assert m["tokenizer"]["sha256"] == read_manifest(prepared)["tokenizer"]["sha256"]
    assert shard_bytes(out)["train/000000.bin"] == shard_bytes(prepared)["train/000001.bin"]
    with pytest.raises(OptquantError, match="no end-of-document token <eos>"):
        prepare([str(raw / "b.jsonl")], tmp_path / "x", PrepareConfig(tokenizer=str(folder), eot="<eos>"))
    with pytest.raises(OptquantError, match="no tokenizer.json there"):
        prepare([str(raw / "b.jsonl")], tmp_path / "y", PrepareConfig(tokenizer=str(tmp_path)))


# ------------------------------------------------------------------------------------------- bad input


def _prepare_error(tmp_path: Path, name: str, content: bytes) -> str:
    (tmp_path / "bad").mkdir(exist_ok=True)
    (tmp_path / "bad" / name).write_bytes(content)
    with pytest.raises(OptquantError) as e:
        prepare([str(tmp_path / "bad" / name)], tmp_path / "out", CFG)
    return str(e.value)


@pytest.mark.parametrize("name, content, match", [
    ("m.jsonl", b'{"text": "fine"}\n{"text": "fine"}\n{"text": broken\n', r"m.jsonl line 3 is not valid JSON"),
    ("f.jsonl", b'{"text": "fine"}\n{"body": "x"}\n', r"f.jsonl line 2 has no field 'text'"),
    ("u.jsonl", b'{"text": "fine"}\n{"text": "caf\xe9"}\n', r"u.jsonl line 2 is not UTF-8"),
    ("u.txt", b"fine" + EOT.encode() + b"caf\xe9 au lait", r"u.txt block 1 is not UTF-8"),
    ("e.jsonl", b"", r"e.jsonl is empty"),
    ("z.jsonl.zst", b"\x28\xb5\x2f\xfd garbage", r"z.jsonl.zst: damaged after line 0"),
    ("p.parquet", b"PAR1 not really", r"p.parquet is not a readable parquet file"),
])
def test_bad_input_files_are_one_error_naming_file_and_place(tmp_path, name, content, match):
    assert re.search(match, _prepare_error(tmp_path, name, content))
    assert not (tmp_path / "out" / MANIFEST).exists()


def test_damaged_parquet_row_group_and_invalid_utf8_are_named(tmp_path):
    path = tmp_path / "rg.parquet"
    pq.write_table(pa.table({"text": texts(200, 1)}), path, row_group_size=100, compression="none")
    data = bytearray(path.read_bytes())
    offset = pq.ParquetFile(path).metadata.row_group(1).column(0).data_page_offset
    data[offset : offset + 40] = b"\xff" * 40
    bad = _write(tmp_path / "d" / "rg.parquet", bytes(data))
    with pytest.raises(OptquantError, match=r"rg.parquet row group 1 \(rows from 100\) is damaged"):
        prepare([str(bad)], tmp_path / "o1", CFG)
    raw = b"fine textcaf\xe9"
    offsets = np.array([0, 9, 13], np.int32)
    arr = pa.Array.from_buffers(pa.string(), 2, [None, pa.py_buffer(offsets.tobytes()), pa.py_buffer(raw)])
    pq.write_table(pa.table({"text": arr}), tmp_path / "u.parquet")
    with pytest.raises(OptquantError, match=r"u.parquet row group 0 \(rows from 0\) is damaged or not UTF-8"):
        prepare([str(tmp_path / "u.parquet")], tmp_path / "o2", CFG)


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_truncated_or_edited_prepared_directory_is_refused(prepared, tmp_path):
    cache = tmp_path / "cache"
    cut = _copy(prepared, tmp_path / "cut")
    shard = cut / read_manifest(cut)["shards"]["train"][0]["file"]
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(OptquantError, match="truncated or edited"):
        open_prepared(str(cut), cache)
    edited = _copy(prepared, tmp_path / "edited")
    shard = edited / read_manifest(edited)["shards"]["train"][0]["file"]
    data = bytearray(shard.read_bytes())
    data[10:12] = bytes([data[10] ^ 1, data[11]])
    shard.write_bytes(bytes(data))
    with pytest.raises(OptquantError, match="does not match the manifest's sha256"):
        open_prepared(str(edited), cache)
    hand = _copy(prepared, tmp_path / "hand")
    m = json.loads((hand / MANIFEST).read_text())
    m["totals"]["train"]["tokens"] += 1
    (hand / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(OptquantError, match="was edited after it was written"):
        open_prepared(str(hand), cache)
    short = _copy(prepared, tmp_path / "short")
    (short / MANIFEST).write_text((short / MANIFEST).read_text()[:100])
    with pytest.raises(OptquantError, match="not a readable manifest"):
        load_tokens(DataConfig(source=str(short)), V)
    assert main(["train", "--preset", "nano", "--set", f"data.source={short}", "--out", str(tmp_path / "r")]) == 2
    assert not (tmp_path / "r").exists()


def test_two_prepared_directories_train_together_only_with_one_tokenizer(raw, prepared, tmp_path):
    other = tmp_path / "other"
    prepare([str(raw / "b.jsonl")], other, PrepareConfig(vocab_size=V + 20, sample_bytes=1 << 20))
    with pytest.raises(OptquantError, match="were prepared with different tokenizers"):
        load_tokens(DataConfig(source=f"{prepared},{other}"), 512)
    same = tmp_path / "same"
    prepare([str(raw / "b.jsonl")], same, PrepareConfig(tokenizer=str(prepared / "tokenizer.json")))
    both = load_tokens(DataConfig(source=f"{prepared},{same}"), V)
    assert len(both.train) == read_manifest(prepared)["totals"]["train"]["tokens"] + \
        read_manifest(same)["totals"]["train"]["tokens"]


def test_a_disk_that_fills_mid_shard_loses_nothing(raw, prepared, tmp_path, monkeypatch, capsys):
    real, calls = prep._Shard.write, {"n": 0}

    def fill(self, ids, docs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.tmp))
        real(self, ids, docs)

    monkeypatch.setattr(prep._Shard, "write", fill)
    argv = ["data", "prepare", str(raw), "--out", str(tmp_path / "full"), "--vocab-size", str(V),
            "--sample-bytes", str(1 << 20), "--processes", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "the disk is full" in err
    assert not list((tmp_path / "full").rglob("*.tmp")) and not (tmp_path / "full" / MANIFEST).exists()
    monkeypatch.setattr(prep._Shard, "write", real)
    assert main(argv) == 0
    assert shard_bytes(tmp_path / "full") == shard_bytes(prepared)


def test_another_prepare_into_the_same_directory_is_refused(raw, prepared, tmp_path):
    with pytest.raises(OptquantError, match="holds a prepare of other inputs or settings"):
        prepare([str(raw)], prepared, PrepareConfig(vocab_size=V + 1, sample_bytes=1 << 20))
    assert prepare([str(raw)], prepared, CFG)["corpus_id"] == read_manifest(prepared)["corpus_id"]  # done: a no-op
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(OptquantError, match="exists and is not empty"):
        prepare([str(raw)], tmp_path / "full", CFG)
    with pytest.raises(OptquantError, match="does not exist"):
        prepare([str(tmp_path / "nope")], tmp_path / "o", CFG)


def test_the_data_command_loads_no_torch(prepared):
    code = ("import sys; from optquant.cli import main; "
            f"assert main(['data', 'info', {str(prepared)!r}]) == 0; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def _peak_rss_of_prepare(src: Path, out: Path) -> int:
    """The largest resident set of `optquant data prepare` (one process: it trains the BPE and encodes)."""
    code = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)")
    cmd = [sys.executable, "-m", "optquant.cli", "data", "prepare", str(src), "--out", str(out), "--processes", "1",
           "--vocab-size", str(V), "--sample-bytes", str(8 << 20)]
    return int(subprocess.run([sys.executable, "-c", code, *cmd], check=True, capture_output=True, text=True).stdout)


@pytest.mark.slow
def test_memory_is_bounded_whatever_the_corpus_size(tmp_path):
    """Peak RSS at two corpus sizes 4× apart (25 MB and 100 MB of jsonl in four files): ≤ 1 GB and the same
    within 15 % (a batch of text, the tokenizer and the BPE sample, never the corpus)."""
    peaks = []
    for mb in (25, 100):
        src = tmp_path / f"c{mb}"
        src.mkdir()
        docs = texts(4000, mb)
        for i in range(4):
            with open(src / f"{i}.jsonl", "w") as f:
                size = 0
                while size < mb * 1e6 / 4:
                    line = json.dumps({"text": random.choice(docs)}) + "\n"
                    f.write(line)
                    size += len(line)
        peaks.append(_peak_rss_of_prepare(src, tmp_path / f"out{mb}"))
    assert max(peaks) <= 1 << 30 and max(peaks) / min(peaks) < 1.15, peaks


def test_a_split_setting_other_than_the_corpus_was_prepared_with_is_refused(prepared):
    assert len(load_tokens(DataConfig(source=str(prepared), val_fraction=0.05), V).val) > 0  # its own: fine
    with pytest.raises(OptquantError, match=r"prepared with val_fraction, split_seed, text_field = \(0.05, 0"):
        load_tokens(DataConfig(source=str(prepared), split_seed=3), V)


# ------------------------------------------------------------------ a run remembers the corpus it trained on


def test_a_run_is_evaluated_on_its_prepared_corpus_and_refused_on_one_prepared_again(raw, prepared, tmp_path, capsys):
    """Through the CLI: a run on data.source=DIR records DIR's corpus_id; `ptq` of it scores the very validation
    windows the run did (DIR's val split: the same loss); once another corpus is prepared into DIR, resuming the
    killed run, continuing a study over the finished one, and ptq/analyze/eval/export of it are one error line
    each, and nothing in the runs is touched (export reads the same way: ptq_stage.run_tokens)."""
    import shutil

    from test_reliability import one_line_error

    from optquant.config import from_dict
    from optquant.study.jobs import TrainJob

    d = _copy(prepared, tmp_path / "tok")
    args = ["train", "--preset", "nano", "--quiet", "--set", f"data.source={d}", "--set", f"model.vocab_size={V}",
            "--set", "model.seq_len=32", "--set", "train.batch_size=8", "--set", "train.steps=20", "--set",
            "train.eval_every=10", "--set", "train.eval_batches=2", "--set", "train.precision=fp32"]
    assert main([*args, "--out", str(tmp_path / "runs")]) == 0
    (run,) = (tmp_path / "runs").iterdir()
    record = json.loads((run / "config.json").read_text())
    assert record["corpus_id"] == read_manifest(d)["corpus_id"]
    assert main(["ptq", str(run), "--mc-items", "0"]) == 0
    damage = json.loads((run / "ptq" / "final" / "w4a4-rtn" / "summary.json").read_text())
    assert damage["val_loss_fp"] == pytest.approx(json.loads((run / "summary.json").read_text())["final_val_loss"],
                                                  rel=1e-6)
    cfg = from_dict(record["config"])

    class Interrupt(Exception):
        pass

    def stop(info):
        if info["step"] == 15:
            raise Interrupt

    killed = tmp_path / "killed" / run.name
    with pytest.raises(Interrupt):
        train(cfg, killed, on_step=stop)
    assert TrainJob(cfg, run).done() is not None  # the same corpus: the finished run counts
    shutil.rmtree(d)
    prepare([str(raw / "b.jsonl")], d, PrepareConfig(tokenizer=str(prepared / "tokenizer.json")))  # another corpus
    before = {p: p.read_bytes() for p in sorted((tmp_path / "killed").rglob("*")) + sorted(run.rglob("*"))
              if p.is_file() and p.name != ".lock"}
    capsys.readouterr()
    assert main([*args, "--out", str(tmp_path / "killed")]) == 2
    one_line_error(capsys, str(killed), "was trained on corpus", "now holds corpus", "another --out")
    for argv in (["ptq", str(run), "--mc-items", "0", "--method", "gptq"], ["analyze", str(run)],
                 ["eval", str(run), "--tasks", "piqa"]):
        assert main(argv) == 2, argv
        one_line_error(capsys, str(run), "was trained on corpus")
    with pytest.raises(OptquantError, match="was trained on corpus"):
        TrainJob(cfg, run).done()
    after = {p: p.read_bytes() for p in before}
    assert after == before


def test_the_two_documented_commands_take_a_parquet_directory_to_the_gpu_dry_run(tmp_path, capsys):
    """docs/scale-out.md's two commands, as written (its paths replaced by temporary ones), on a directory of
    FineWeb-style parquet files (a text column beside others, several row groups): the prepare trains the
    presets' 32k BPE, and the gpu dry run counts the corpus from the manifest."""
    import shlex

    doc = (Path(__file__).parents[1] / "docs" / "scale-out.md").read_text()
    block = doc.split("A web corpus gets in with two commands", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split(" #")[0].strip() for line in block.strip().splitlines()]
    assert len(commands) == 2 and all(c.startswith("optquant ") for c in commands)
    src, out = tmp_path / "ClimbMix10m", tmp_path / "climbmix-tok"
    src.mkdir()
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9))) for _ in range(30000)]
    for i in range(3):
        docs = [" ".join(rng.choice(words) for _ in range(rng.randint(50, 300))) + "." for _ in range(600)]
        pq.write_table(pa.table({"id": [f"<urn:{i}-{j}>" for j in range(len(docs))], "text": docs,
                                 "url": [f"https://example.org/{j}" for j in range(len(docs))]}),
                       src / f"part-{i:05d}.parquet", row_group_size=200)
    for command in commands:
        argv = shlex.split(command.replace("~/ClimbMix10m/", f"{src}/").replace("~/climbmix-tok", str(out)))
        assert main(argv[1:]) == 0, command
    m = read_manifest(out)
    assert m["tokenizer"]["vocab_size"] == 32000 and m["totals"]["train"]["documents"] > 1500
    lines = [x.split() for x in capsys.readouterr().out.splitlines()]
    sizes = [x for x in lines if x[:1] in (["50m"], ["125m"]) and f"{m['totals']['train']['tokens']:,}" in x]
    assert len(sizes) == 2
