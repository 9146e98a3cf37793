"""Hugging Face models in and out (the optional extra `optquant[hf]`): load a local causal LM folder as an
optquant sublayer chain (`load_hf`, adapter.py), and export our Llama-variant runs (export.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from optquant.errors import OptquantError
from optquant.files import read_json


def require_transformers():
    """transformers, or one clear error naming the extra that installs it."""
    if importlib.util.find_spec("transformers") is None:
        raise OptquantError("this needs Hugging Face transformers: pip install 'optquant[hf]'")
    import transformers

    transformers.utils.logging.set_verbosity_error()  # its load reports are many lines; we say it in one
    transformers.utils.logging.disable_progress_bar()  # and so are its progress bars
    return transformers


_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings")


def check_hf_config(path: Path) -> dict:
    """config.json of an HF folder, checked before transformers sees it: a supported model_type and
    positive whole sizes that fit together (transformers itself divides by zero on some)."""
    from optquant.hf.adapter import FAMILIES

    file = Path(path) / "config.json"
    config = read_json(file)
    if not isinstance(config, dict):
        raise OptquantError(f"{file}: not a Hugging Face config (a JSON object)")
    if not isinstance(config.get("model_type"), str) or config["model_type"] not in FAMILIES:
        raise OptquantError(f"{file}: model_type {config.get('model_type')!r} is not supported; supported: "
                            f"{', '.join(FAMILIES)}")
    for key in (*_SIZES, *_OPTIONAL_SIZES):
        value = config.get(key)
        if (key in _SIZES or value is not None) and (type(value) is not int or value < 1):
            raise OptquantError(f"{file}: {key} must be a positive whole number, got {value!r}")
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    if heads % kv or (config.get("head_dim") is None and config["hidden_size"] % heads):
        raise OptquantError(f"{file}: num_attention_heads={heads} must be a multiple of num_key_value_heads={kv} "
                            f"and (without head_dim) divide hidden_size={config['hidden_size']}")
    return config


DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: the checkpoint's own (config.json's dtype)


def load_hf_model(path: Path, dtype: str = "auto"):
    """The HF model of a local folder in eval mode, in its stored dtype (`dtype="auto"`: a bf16 checkpoint
    stays bf16, held once) or the one given; nothing is downloaded. Weights that do not match config.json
    (a missing, unexpected or differently shaped tensor) are an error: transformers would initialise the
    missing ones at random and only say so in a log."""
    transformers = require_transformers()
    config = check_hf_config(path)
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, local_files_only=True, output_loading_info=True)
    except Exception as e:  # transformers over files from elsewhere: any failure is bad input
        first = (str(e).strip().splitlines() or [""])[0]
        raise OptquantError(f"{path}: transformers could not load it ({type(e).__name__}: {first})") from None
    tied = {"lm_head.weight"} if config.get("tie_word_embeddings", True) else set()
    missing = sorted(set(info.get("missing_keys") or ()) - tied)
    wrong = sorted(set(info.get("unexpected_keys") or ())) + sorted(map(str, info.get("mismatched_keys") or ()))
    if missing or wrong:
        raise OptquantError(f"{path}: the weights do not match config.json (model_type "
                            f"{config['model_type']!r}): missing {missing[:3]}, unexpected or mis-shaped {wrong[:3]}")
    return model.eval()


def load_hf(path: Path, seq_len: int = 128, dtype: str = "auto", lazy: bool = False):
    """The HF causal LM at `path` as an optquant chain (HFLM), in its stored dtype (or `dtype`), eval mode;
    `lazy`: its decoder layers left in the safetensors files, read one sublayer at a time (hf/lazy.py)."""
    from optquant.hf.adapter import HFLM

    if type(seq_len) is not int or seq_len < 2:
        raise OptquantError(f"--seq-len {seq_len}: must be at least 2 tokens")
    if not (Path(path) / "config.json").is_file():
        raise OptquantError(f"{path}: not a Hugging Face model folder (no config.json)")
    if dtype not in DTYPES:
        raise OptquantError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if lazy:
        from optquant.hf.lazy import load_lazy

        return load_lazy(Path(path), dtype, seq_len)
    return HFLM(load_hf_model(path, dtype), seq_len=seq_len).eval()


def load_hf_tokenizer(path: Path, model: Path | None = None):
    """(the fast tokenizers.Tokenizer backend, the EOS id, the BOS id or else EOS: lm-eval's prefix token) of the
    tokenizer in a local HF folder or a tokenizer.json file; without an EOS of its own, `model`'s config.json's."""
    transformers = require_transformers()
    path = Path(path)
    try:
        tok = (transformers.PreTrainedTokenizerFast(tokenizer_file=str(path)) if path.is_file() else
               transformers.AutoTokenizer.from_pretrained(path, local_files_only=True))
    except Exception as e:  # transformers / tokenizers over files from elsewhere: any failure is bad input
        first = (str(e).splitlines() or [""])[0]
        raise OptquantError(f"{path}: no tokenizer transformers can load ({first}); for a checkpoint without one, "
                            "--hf takes --tokenizer PATH (ptq/analyze: or --tokens FILE)") from None
    eos = tok.eos_token_id
    if eos is None and model is not None:
        eos = check_hf_config(model).get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos
    if getattr(tok, "backend_tokenizer", None) is None or type(eos) is not int:
        raise OptquantError(f"{path}: the tokenizer needs a fast (tokenizer.json) backend and an EOS token")
    return tok.backend_tokenizer, eos, eos if tok.bos_token_id is None else tok.bos_token_id
