"""Hugging Face models in and out (the optional extra `optquant[hf]`): load a local causal LM folder as an
optquant sublayer chain (`load_hf`, adapter.py), and export our Llama-variant runs (export.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from optquant.errors import OptquantError


def require_transformers():
    """transformers, or one clear error naming the extra that installs it."""
    if importlib.util.find_spec("transformers") is None:
        raise OptquantError("this needs Hugging Face transformers: pip install 'optquant[hf]'")
    import transformers

    return transformers


def load_hf_model(path: Path):
    """The HF model of a local folder, in fp32 and eval mode; nothing is downloaded."""
    transformers = require_transformers()
    path = Path(path)
    if not (path / "config.json").is_file():
        raise OptquantError(f"{path}: not a Hugging Face model folder (no config.json)")
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="float32", local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise OptquantError(f"{path}: transformers could not load it ({str(e).splitlines()[0]})") from None
    return model.eval()


def load_hf(path: Path, seq_len: int = 128):
    """The HF causal LM at `path` as an optquant chain (HFLM), fp32, eval mode."""
    from optquant.hf.adapter import HFLM

    return HFLM(load_hf_model(path), seq_len=seq_len).eval()


def load_hf_tokenizer(path: Path):
    """(the fast tokenizers.Tokenizer backend, the EOS id) of the tokenizer in a local HF folder."""
    transformers = require_transformers()
    try:
        tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise OptquantError(f"{path}: no tokenizer transformers can load ({str(e).splitlines()[0]})") from None
    if getattr(tok, "backend_tokenizer", None) is None or tok.eos_token_id is None:
        raise OptquantError(f"{path}: the tokenizer needs a fast (tokenizer.json) backend and an EOS token")
    return tok.backend_tokenizer, tok.eos_token_id
