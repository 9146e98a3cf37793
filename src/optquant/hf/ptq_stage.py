"""`optquant ptq --hf PATH` and `optquant analyze --hf PATH`: the run analyses on a local HF causal LM.

The model is the HF folder's weights seen through `optquant.hf.adapter.HFLM`; the text is our corpus
(`data.source`, the embedded one by default) split by document exactly as for our runs and encoded with
the folder's own tokenizer, its EOS token after every document. Validation windows (val loss, outliers,
ABC) come from the held-out documents, GPTQ calibration from the first training documents, and the
built-in multiple-choice task from the held-out stream, all seeded as for our runs. A directory prepared by
`optquant data prepare` is read as it is (its val shards, train shards and tokenizer), if its tokenizer is the
model's (the same vocabulary; a folder without a tokenizer takes the directory's). Results go to
`OUT/<scheme>/` (default OUT: `hf-analysis/<folder name>`), the same files `optquant ptq/analyze` write.
The model stays in its stored dtype (`dtype`) and is held once: `ptq` quantizes it in place after its FP
numbers; `analyze` reads the decoder layers lazily (hf/lazy.py), one sublayer at a time, and makes each
quantized sublayer as it goes (not with a rotation, which loads the model whole). docs/your-own.md gives
the memory of each.

A folder without a tokenizer (a bare checkpoint) takes one from elsewhere (`tokenizer`: a tokenizer folder or a
tokenizer.json; EOS from it or else config.json's eos_token_id), or token ids instead of text (`tokens`: the
evaluation windows; `calib_tokens`: GPTQ's, default the same file): a 1-D integer `.npy`, or any other file
as text of whitespace-separated integers, each in [0, vocab_size), at least one window (seq_len + 1) long.
Without text there is no built-in multiple-choice task (its acc_norm counts characters).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from optquant.config import RunConfig, TrainConfig
from optquant.corpus.manifest import is_prepared
from optquant.data import DataConfig, TokenData, load_tokens, read_documents, split_documents
from optquant.errors import OptquantError
from optquant.files import regular_file
from optquant.hf import load_hf, load_hf_tokenizer
from optquant.model import ModelConfig
from optquant.ptq_stage import AnalysisConfig, LoadedRun, model_analysis, model_damage
from optquant.quant.ptq import PTQConfig

TRAIN_TOKENS_PER_SEQUENCE = 4  # calibration needs gptq_sequences windows: encode ~4x that many train tokens


@dataclass(frozen=True)
class HFSource:
    path: Path
    data: DataConfig = DataConfig()
    seq_len: int = 128
    batch_size: int = 8
    tokenizer: Path | None = None  # a tokenizer folder or tokenizer.json (None: the model folder's own)
    tokens: Path | None = None  # token ids instead of text: the evaluation windows
    calib_tokens: Path | None = None  # with `tokens`: GPTQ's calibration windows (None: `tokens`)
    dtype: str = "auto"  # the weights' dtype: the checkpoint's own, or one of optquant.hf.DTYPES


def read_ids(path: Path, vocab_size: int, seq_len: int) -> np.ndarray:
    """The token ids in `path` (see the module docstring), checked, as int64."""
    regular_file(path, "token-id")  # a FIFO or /dev/zero would block or never end
    try:
        ids = np.load(path, allow_pickle=False) if path.suffix == ".npy" else np.array(path.read_text().split(),
                                                                                     dtype=np.int64)
    except (OSError, ValueError, OverflowError) as e:
        raise OptquantError(f"{path}: not token ids (a 1-D integer .npy, or text of whitespace-separated integers): "
                            f"{(str(e).splitlines() or [type(e).__name__])[0]}") from None
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise OptquantError(f"{path}: token ids must be a 1-D array of integers, got {ids.dtype} {tuple(ids.shape)}")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise OptquantError(f"{path}: token id {bad[0]} is outside [0, {vocab_size}) (the model's vocab_size)")
    if ids.size <= seq_len:
        raise OptquantError(f"{path}: {ids.size} token ids cannot fill one window of --seq-len {seq_len} + 1")
    return ids.astype(np.int64)


def file_tokens(src: HFSource, vocab_size: int, seq_len: int) -> TokenData:
    """`src.tokens` (evaluation) and `src.calib_tokens` (calibration) as TokenData; no tokenizer, no EOS (-1)."""
    val = read_ids(src.tokens, vocab_size, seq_len)
    train = read_ids(src.calib_tokens, vocab_size, seq_len) if src.calib_tokens else val
    return TokenData(train, val, vocab_size, None, -1, f"tokens:{src.tokens}")


def prepared_tokens(src: HFSource) -> TokenData:
    """A prepared corpus (`optquant data prepare`) as it is: its shards and tokenizer. The model's own tokenizer (the
    folder's tokenizer.json, or `src.tokenizer`), where it has one, must have the same vocabulary."""
    from tokenizers import Tokenizer

    data = load_tokens(src.data, sys.maxsize)  # the model's embeddings are checked by _setup
    own = Path(src.tokenizer or src.path)
    file = own / "tokenizer.json" if own.is_dir() else own
    if file.is_file() and Tokenizer.from_file(str(file)).get_vocab(True) != data.tokenizer.get_vocab(True):
        raise OptquantError(f"--data {src.data.source} was prepared with another tokenizer than {file}; prepare it "
                            f"with optquant data prepare ... --tokenizer {own}")
    return data


def hf_tokens(src: HFSource, train_tokens: int) -> TokenData:
    """Held-out documents fully, and the first training documents up to `train_tokens` tokens, encoded with
    the folder's tokenizer (or `src.tokenizer`; AutoTokenizer's fast backend), EOS after each document;
    a prepared corpus's own shards (`prepared_tokens`)."""
    if is_prepared(src.data.source):
        return prepared_tokens(src)
    backend, eos, _ = load_hf_tokenizer(src.tokenizer or src.path, model=src.path)
    train_docs, val_docs = split_documents(read_documents(src.data), src.data)

    def encode(docs, limit: int | None) -> np.ndarray:
        out, n = [], 0
        for i in range(0, len(docs), 256):
            for e in backend.encode_batch([t for _, t in docs[i: i + 256]], add_special_tokens=False):
                out.append(np.array([*e.ids, eos], dtype=np.int64))
                n += out[-1].size
            if limit is not None and n >= limit:
                break
        return np.concatenate(out)

    vocab = backend.get_vocab_size(with_added_tokens=True)
    return TokenData(encode(train_docs, train_tokens), encode(val_docs, None), vocab, backend, eos, f"hf:{src.path}")


def _setup(src: HFSource, acfg: AnalysisConfig, lazy: bool = False):
    model = load_hf(src.path, src.seq_len, src.dtype, lazy)
    seq_len = model.cfg.seq_len
    cfg = RunConfig(name=Path(src.path).name, model=ModelConfig(vocab_size=model.cfg.vocab_size, seq_len=seq_len),
                    data=src.data, train=TrainConfig(batch_size=src.batch_size, eval_batches=8))
    if src.tokens:
        return cfg, model, file_tokens(src, model.cfg.vocab_size, seq_len)
    data = hf_tokens(src, TRAIN_TOKENS_PER_SEQUENCE * acfg.gptq_sequences * (seq_len + 1))
    if data.vocab_size > model.cfg.vocab_size:
        raise OptquantError(f"{src.path}: the tokenizer has {data.vocab_size} tokens but the model only "
                            f"{model.cfg.vocab_size} embeddings")
    return cfg, model, data


def default_out(path: Path) -> Path:
    return Path("hf-analysis") / Path(path).resolve().name


def hf_damage(src: HFSource, qcfg: PTQConfig, acfg: AnalysisConfig, out: Path) -> dict[str, Any]:
    from optquant.hf.lazy import materialize_

    cfg, model, data = _setup(src, acfg, lazy=True)  # read whole, but so that each quantized linear frees its FP one
    materialize_(model)
    return model_damage(LoadedRun.of(cfg, model, data, owned=True), qcfg, acfg, Path(out) / qcfg.name)


def hf_analysis(src: HFSource, qcfg: PTQConfig, acfg: AnalysisConfig, out: Path) -> dict[str, Any]:
    cfg, model, data = _setup(src, acfg, lazy=qcfg.rotation == "none")  # the rotation needs every block at once
    return model_analysis(LoadedRun.of(cfg, model, data, owned=True), qcfg, acfg, Path(out) / qcfg.name)
