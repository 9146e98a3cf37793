"""`optquant export RUN --hf OUT`: a Llama-variant run as a Hugging Face `LlamaForCausalLM` folder, exactly.

The mapping (optquant.model's llama arch → HF Llama):
- pre-norm residual sublayers, SwiGLU MLP (down(silu(gate x) · up x)), no biases, 1/√Dh attention, GQA
  with each key/value head shared by consecutive query heads: the same in both;
- RMSNorm: torch's nn.RMSNorm with eps=None uses the dtype's machine epsilon, so rms_norm_eps = that
  (fp32: 1.19e-7);
- RoPE: ours rotates interleaved pairs (x[2i], x[2i+1]), HF's rotate_half the pairs (x[i], x[i+Dh/2]),
  both with frequency base^(−2i/Dh). Permuting the rows of q_proj and k_proj within each head to
  [0, 2, 4, …, 1, 3, 5, …] turns one into the other; q·k is unchanged by a common permutation;
- tied or untied head: tie_word_embeddings.
The tokenizer goes along as tokenizer.json (+ tokenizer_config.json) that AutoTokenizer loads, with
<|endoftext|> as EOS and BOS, prepended by default (add_special_tokens=True): our runs separate documents with
it, so a text follows it, and `lm_eval --model hf` on the folder conditions on it as `optquant eval` does.

The paper's OLMo2 variant is refused: HF's Olmo2 has a SwiGLU MLP and RMS QK-norm over all heads with
a per-channel gain, ours a ReLU² MLP and per-head L2 QK-norm with a per-head scale; no HF architecture
computes it, and a near match would be a silent approximation. QAT runs are refused too (their
quantizers are not HF modules).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from optquant.data import EOT
from optquant.errors import OptquantError
from optquant.files import temp_path
from optquant.hf import require_transformers
from optquant.model import LM
from optquant.ptq_stage import load_run_model, run_tokens
from optquant.runs import RunDir, StudyDir, Weights


def rope_permutation(head_dim: int) -> torch.Tensor:
    """Row order within a head taking our interleaved RoPE pairs to HF's half-split ones."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def _per_head(W: torch.Tensor, heads: int, perm: torch.Tensor) -> torch.Tensor:
    Dh = perm.numel()
    return W.view(heads, Dh, -1)[:, perm].reshape(heads * Dh, -1).contiguous()


def llama_state_dict(model: LM) -> dict[str, torch.Tensor]:
    """Our llama-variant weights under HF LlamaForCausalLM's names (q/k rows permuted for RoPE)."""
    cfg = model.cfg
    perm = rope_permutation(cfg.head_dim)
    sd = {"model.embed_tokens.weight": model.embed.weight, "model.norm.weight": model.norm.weight,
          "lm_head.weight": model.lm_head.weight}
    for i, block in enumerate(model.blocks):
        attn, mlp, p = block.attn.inner, block.mlp.inner, f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = block.attn.norm.weight
        sd[p + "post_attention_layernorm.weight"] = block.mlp.norm.weight
        sd[p + "self_attn.q_proj.weight"] = _per_head(attn.q_proj.weight, cfg.n_head, perm)
        sd[p + "self_attn.k_proj.weight"] = _per_head(attn.k_proj.weight, cfg.n_kv_head, perm)
        sd[p + "self_attn.v_proj.weight"] = attn.v_proj.weight
        sd[p + "self_attn.o_proj.weight"] = attn.o_proj.weight
        for name in ("gate_proj", "up_proj", "down_proj"):
            sd[p + f"mlp.{name}.weight"] = getattr(mlp, name).weight
    return {k: v.detach().clone() for k, v in sd.items()}


def llama_config(model: LM, eot_id: int):
    transformers = require_transformers()
    cfg = model.cfg
    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.mlp_hidden,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
        head_dim=cfg.head_dim, hidden_act="silu", max_position_embeddings=cfg.seq_len,
        rms_norm_eps=torch.finfo(torch.float32).eps, rope_theta=cfg.rope_base, attention_bias=False,
        mlp_bias=False, tie_word_embeddings=cfg.tie_embeddings, bos_token_id=eot_id, eos_token_id=eot_id,
        pad_token_id=None, torch_dtype="float32",
    )


def _holds_results(path: Path) -> bool:
    """A run's or a study's directory."""
    return RunDir(path).is_run() or StudyDir(path).is_study()


def _is_export(path: Path) -> bool:
    """A folder this command wrote: an HF LlamaForCausalLM config.json, and none of a run's or study's files."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(config, dict) and config.get("architectures") == ["LlamaForCausalLM"]
            and not _holds_results(path))


def check_target(run_dir: Path, out: Path, force: bool) -> None:
    """Refuse an output that would destroy something: the run itself, a run or study directory, an existing
    file, a folder with other contents; an earlier export only with `force`."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise OptquantError(f"export --hf {out}: exists and is not a directory; choose a new folder")
    if not out.exists() or not any(out.iterdir()):
        return
    if out.resolve() == Path(run_dir).resolve() or _holds_results(out):
        raise OptquantError(f"export --hf {out}: is a run or study directory; export into a new folder")
    if not _is_export(out):
        raise OptquantError(f"export --hf {out}: not empty and not an earlier export; choose a new folder")
    if not force:
        raise OptquantError(f"export --hf {out}: holds an earlier export; add --force to overwrite it")


def export_hf(run_dir: Path, out: Path, weights: Weights = "final", force: bool = False) -> Path:
    """Write run_dir's model (+ tokenizer) as an HF LlamaForCausalLM folder at `out`; returns `out`.
    The folder is written beside `out` and renamed into place, so a failure leaves `out` as it was."""
    out = Path(out)
    check_target(run_dir, out, force)
    cfg, model = load_run_model(run_dir, weights)
    if cfg.model.arch != "llama":
        raise OptquantError(f"{run_dir}: the {cfg.model.arch} variant (ReLU² MLP, per-head L2 QK-norm with a "
                            "learned scale) matches no Hugging Face architecture exactly; only model.arch=llama "
                            "runs export")
    if cfg.qat is not None:
        raise OptquantError(f"{run_dir}: a QAT run's quantizers have no Hugging Face equivalent; export FP runs")
    if cfg.model.norm != "rms" or cfg.model.embed_proj:
        raise OptquantError(f"{run_dir}: OSP's model.norm=single / model.embed_proj are not exported (no merge "
                            "into LlamaForCausalLM's weights is written)")
    if cfg.model.block != "standard" or cfg.model.attn_gate:
        raise OptquantError(f"{run_dir}: model.block=op / model.attn_gate have no LlamaForCausalLM equivalent; "
                            "they are not exported")
    data = run_tokens(run_dir, cfg)
    transformers = require_transformers()  # after the run's checks: a bad run is named first, with or without it
    hf = transformers.LlamaForCausalLM(llama_config(model, data.eot_id))
    missing, unexpected = hf.load_state_dict(llama_state_dict(model), strict=False)
    if unexpected or [k for k in missing if not (k == "lm_head.weight" and cfg.model.tie_embeddings)]:
        raise OptquantError(f"export: weight names do not match LlamaForCausalLM ({missing}, {unexpected})")
    if cfg.model.tie_embeddings:
        hf.tie_weights()
    tmp, old = temp_path(out), temp_path(out)
    try:
        hf.save_pretrained(tmp)
        tok = transformers.PreTrainedTokenizerFast(tokenizer_object=data.tokenizer, eos_token=EOT, bos_token=EOT,
                                                   add_bos_token=True, model_max_length=cfg.model.seq_len)
        tok.save_pretrained(tmp)
        if out.exists():
            os.rename(out, old)  # checked above: empty, or an earlier export with --force
        try:
            os.rename(tmp, out)
        except OSError:
            if old.exists():
                os.rename(old, out)
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return out
