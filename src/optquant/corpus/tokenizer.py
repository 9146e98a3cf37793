"""The tokenizer of a prepared corpus: the user's own (a `tokenizer.json` or a Hugging Face folder), or a
byte-level BPE trained on a bounded sample of the corpus.

A user's tokenizer is read with `tokenizers` alone (no transformers): the folder's `tokenizer.json`, and
its end-of-document token from `--eot`, else `tokenizer_config.json`'s `eos_token`, else the first of the
usual names the vocabulary holds. Documents are encoded without the tokenizer's own special tokens (no BOS),
with that token appended, as the embedded corpus is (data.py).

The trained BPE is data.py's recipe (`train_tokenizer`: 256 bytes + EOT + merges, exactly `vocab_size`
tokens) on a sample of the train split: an equal byte share from the start of every input file, so that
every file is represented and the sample does not depend on the number of processes. `--sample-bytes`
bounds it, and with it the trainer's memory (its pair counts grow with the sample, not the corpus).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tokenizers import Tokenizer

from optquant.corpus.sources import Input, documents
from optquant.data import EOT, DataConfig, is_val, train_tokenizer
from optquant.errors import OptquantError

EOT_NAMES = (EOT, "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>")


def tokenizer_hash(tok: Tokenizer) -> str:
    """sha256 of the tokenizer's canonical JSON: what the manifest and a run check it by."""
    return hashlib.sha256(tok.to_str().encode()).hexdigest()


def _config_eos(folder: Path) -> str | None:
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return None
    try:
        eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token")
    except (ValueError, AttributeError, OSError):
        raise OptquantError(f"{path}: not a JSON object") from None
    return eos.get("content") if isinstance(eos, dict) else eos if isinstance(eos, str) else None


def load_user_tokenizer(path: Path, eot: str | None = None) -> tuple[Tokenizer, str]:
    """(tokenizer, end-of-document token) from a tokenizer.json file or a folder holding one."""
    path = Path(path).expanduser()
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise OptquantError(f"--tokenizer {path}: no tokenizer.json there (give the file or its folder)")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers' own parse errors: any failure is a bad file
        raise OptquantError(f"{file}: not a tokenizer.json tokenizers can load ({str(e)[:200]})") from None
    names = [eot] if eot else [n for n in (_config_eos(file.parent), *EOT_NAMES) if n]
    token = next((n for n in names if tok.token_to_id(n) is not None), None)
    if token is None:
        raise OptquantError(f"{file}: no end-of-document token {' / '.join(names)} in its vocabulary; name one "
                            "with --eot TOKEN")
    return tok, token


def train_on_sample(inputs: list[Input], split: DataConfig, vocab_size: int, sample_bytes: int) -> Tokenizer:
    """data.py's byte-level BPE at `vocab_size`, trained on train-split documents: about sample_bytes / len(inputs)
    from the start of each file."""
    share, texts = max(1, sample_bytes // max(1, len(inputs))), []
    for inp in inputs:
        taken = 0
        for doc_id, text in documents(inp, split.text_field):
            if is_val(doc_id, split):
                continue
            texts.append(text)
            taken += len(text.encode())
            if taken >= share:
                break
    if not texts:
        raise OptquantError("the corpus has no train-split text to train a tokenizer on")
    return train_tokenizer(texts, vocab_size)
