"""`optquant eval RUN|--hf PATH --tasks ...`: zero-shot multiple-choice tasks of the real LM-Evaluation-Harness
(lm-eval 0.4.x, `pip install 'optquant[eval]'`) on one of our runs or a local Hugging Face causal LM.

The model is scored through `optquant.evaluate.lm_eval_adapter` (loglikelihood requests only; each
request is [EOS] + context + continuation, the continuation's tokens split off the encoding of the
whole string as lm-eval does). Nothing downloads: the harness runs offline (HF_DATASETS_OFFLINE=1,
HF_HUB_OFFLINE=1), so task data must already be in the local Hugging Face cache, or the task must be a
local one (`--include-path DIR` of task YAMLs, e.g. over a jsonl file). Each task reports acc and
acc_norm (acc_norm: log-likelihood per character of the choice) with lm-eval's standard errors and n.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from optquant.errors import OptquantError


def require_lm_eval():
    if importlib.util.find_spec("lm_eval") is None:
        raise OptquantError("this needs the LM-Evaluation-Harness: pip install 'optquant[eval]' (lm-eval==0.4.13)")
    import lm_eval

    return lm_eval


def load_model(run_dir: Path | None, hf: Path | None, weights: str = "final", seq_len: int = 2048):
    """(model, tokenizers.Tokenizer, eos id) of a run or of an HF folder."""
    if (run_dir is None) == (hf is None):
        raise OptquantError("eval: give a run directory or --hf PATH (one of them)")
    if hf is not None:
        from optquant.hf import load_hf, require_transformers

        transformers = require_transformers()
        model = load_hf(hf, seq_len)
        tok = transformers.AutoTokenizer.from_pretrained(hf, local_files_only=True)
        if getattr(tok, "backend_tokenizer", None) is None or tok.eos_token_id is None:
            raise OptquantError(f"{hf}: the tokenizer needs a fast (tokenizer.json) backend and an EOS token")
        return model, tok.backend_tokenizer, tok.eos_token_id
    from optquant.analysis import load_run_model
    from optquant.data import load_tokens

    cfg, model = load_run_model(run_dir, weights)
    data = load_tokens(cfg.data, cfg.model.vocab_size)
    return model, data.tokenizer, data.eot_id


def lm_eval_tasks(model, tokenizer, eot_id: int, tasks: list[str], *, include_path: Path | None = None,
                  limit: int | None = None) -> dict[str, dict[str, Any]]:
    """{task: {acc, acc_stderr, acc_norm, acc_norm_stderr, n}} from lm_eval.simple_evaluate, zero-shot."""
    lm_eval = require_lm_eval()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lm_eval.tasks import TaskManager

    from optquant.evaluate import lm_eval_adapter

    manager = None
    if include_path:  # indexing lm-eval's ~15k built-in tasks takes half a minute: skip it when not needed
        manager = TaskManager(include_path=str(include_path), include_defaults=False)
        if not all(t in manager.all_tasks for t in tasks):
            manager = None
    manager = manager or TaskManager(include_path=str(include_path) if include_path else None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise OptquantError(f"lm-eval knows no task {', '.join(unknown)} (a local task needs --include-path DIR)")
    adapter = lm_eval_adapter(model, tokenizer, eot_id=eot_id)
    try:
        res = lm_eval.simple_evaluate(model=adapter, tasks=list(tasks), num_fewshot=0, batch_size=1,
                                      limit=limit, task_manager=manager, bootstrap_iters=1000)
    except (ConnectionError, FileNotFoundError, ValueError) as e:
        raise OptquantError(f"lm-eval could not run {', '.join(tasks)} offline ({str(e).splitlines()[0]}); "
                            "the task data must be in the local Hugging Face cache") from None
    out = {}
    for task in tasks:
        r = res["results"][task]
        out[task] = {m: r.get(f"{m},none") for m in ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr")}
        out[task]["n"] = int(res["n-samples"][task]["effective"])
    return out
