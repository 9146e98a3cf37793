"""`optquant eval RUN|--hf PATH --tasks ...`: zero-shot multiple-choice tasks of the real LM-Evaluation-Harness
(lm-eval 0.4.x, `pip install 'optquant[eval]'`) on one of our runs or a local Hugging Face causal LM.

The model is scored through `lm_eval_adapter` below (loglikelihood requests only), with lm-eval's own request
encoding: an optquant run conditions every request on EOT ([EOT] + context + continuation), as the tokenizer
`optquant export` writes declares, so `lm_eval --model hf` on the export gives the same log-likelihoods; an HF
folder conditions on what its tokenizer adds (as lm-eval's HFLM). Nothing downloads: the harness runs offline
(HF_DATASETS_OFFLINE=1, HF_HUB_OFFLINE=1), so task data must already be in the local Hugging Face cache, or the
task must be a local one (`--include-path DIR` of task YAMLs, e.g. over a jsonl file). Each task reports acc and
acc_norm (acc_norm: log-likelihood per character of the choice) with lm-eval's standard errors and n.

A study scores its Common-Loss models on such tasks instead of the built-in one with `--set eval.tasks=...`
(`HarnessConfig`, StudySpec.eval): FP and quantized, under every PTQ scheme (optquant.ptq_stage).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optquant.errors import OptquantError
from optquant.ranges import Natural

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class HarnessConfig:
    """lm-eval tasks to score models on (a study's `eval.*` settings); no tasks = the built-in task."""

    tasks: tuple[str, ...] = ()  # lm-eval task names, e.g. piqa,hellaswag,arc_easy (the paper's)
    include_path: str = ""  # a folder of local task YAMLs ("" = lm-eval's own tasks only)
    limit: Natural = 0  # items per task (0 = all of them)


def check_harness(cfg: HarnessConfig) -> HarnessConfig:
    """The cheap checks, before anything trains: lm-eval installed, the task folder present (made absolute,
    so worker processes find it). Task names are checked by `task_manager`, the limit by its annotation."""
    if cfg.include_path:
        path = Path(cfg.include_path).expanduser().resolve()
        if not path.is_dir():
            raise OptquantError(f"eval.include_path={cfg.include_path}: no such directory (a folder of lm-eval "
                                "task YAMLs)")
        if not cfg.tasks:
            raise OptquantError("eval.include_path is set but eval.tasks is empty: name the task(s) to run")
        cfg = replace(cfg, include_path=str(path))
    if cfg.tasks:
        require_lm_eval()
    return cfg


def require_lm_eval():
    if importlib.util.find_spec("lm_eval") is None:
        raise OptquantError("this needs the LM-Evaluation-Harness: pip install 'optquant[eval]' (lm-eval==0.4.13)")
    import lm_eval

    return lm_eval


@functools.cache  # indexing lm-eval's ~15k built-in tasks is slow (docs/benchmarks.md): once per process
def task_manager(tasks: tuple[str, ...], include_path: str | None):
    """An lm_eval TaskManager that knows every one of `tasks` (offline), or one clear error."""
    require_lm_eval()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lm_eval.tasks import TaskManager

    if include_path:  # only the local folder when it holds every task: no indexing of the built-in ones
        manager = TaskManager(include_path=include_path, include_defaults=False)
        if all(t in manager.all_tasks for t in tasks):
            return manager
    manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise OptquantError(f"lm-eval knows no task {', '.join(unknown)} (a local task needs --include-path DIR "
                            "or, in a study, eval.include_path=DIR)")
    return manager


def lm_eval_tasks(model, tokenizer, eot_id: int, tasks: list[str], *, include_path: Path | None = None,
                  limit: int | None = None, prefix_id: int | None = None) -> dict[str, dict[str, Any]]:
    """{task: {acc, acc_stderr, acc_norm, acc_norm_stderr, n}}, zero-shot (`prefix_id`: see lm_eval_adapter).

    Runs what `lm_eval.simple_evaluate` runs, `TaskManager.load` then `lm_eval.evaluator.evaluate`, without its
    extras: seeding the global RNGs (zero-shot scoring draws nothing, and a study's worker keeps its own state)
    and collecting the environment (torch's collect_env is slow, docs/benchmarks.md, and a study calls this
    twice per Common-Loss model and scheme)."""
    require_lm_eval()
    from lm_eval.evaluator import evaluate

    manager = task_manager(tuple(tasks), str(include_path) if include_path else None)
    adapter = lm_eval_adapter(model, tokenizer, eot_id=eot_id, prefix_id=prefix_id)
    try:
        loaded = manager.load(list(tasks))
        for task in loaded["tasks"].values():
            task.set_config(key="num_fewshot", value=0)
        res = evaluate(lm=adapter, task_dict=loaded, limit=limit, bootstrap_iters=1000, log_samples=False)
    except (ConnectionError, FileNotFoundError, ValueError) as e:
        raise OptquantError(f"lm-eval could not run {', '.join(tasks)} offline ({str(e).splitlines()[0]}); "
                            "the task data must be in the local Hugging Face cache") from None
    out = {}
    for task in tasks:
        r = res["results"][task]
        out[task] = {m: r.get(f"{m},none") for m in ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr")}
        out[task]["n"] = int(res["n-samples"][task]["effective"])
    return out


def eot_prefixed(tokenizer, eot_id: int):
    """A copy of our tokenizer whose default encoding (add_special_tokens=True) starts with EOT: our models are
    trained on documents separated by EOT, so each document (and each lm-eval request) follows one."""
    from tokenizers import Tokenizer, processors

    tok, eot = Tokenizer.from_str(tokenizer.to_str()), tokenizer.id_to_token(eot_id)
    tok.post_processor = processors.TemplateProcessing(single=f"{eot} $A", pair=f"{eot} $A {eot}:1 $B:1",
                                                       special_tokens=[(eot, eot_id)])
    return tok


def lm_eval_adapter(model: nn.Module, tokenizer, *, eot_id: int, prefix_id: int | None = None):
    """An lm-eval `TemplateLM` scoring with `model` (loglikelihood only, as the authors' wrapper). Requests are
    encoded by lm-eval's own code, as its HFLM (`lm_eval --model hf`) encodes them: trailing spaces of the context
    move to the continuation, the whole string is encoded and split after the context's tokens, and an empty
    context is `[prefix_token_id]`. `tokenizer` encodes as the HF tokenizer does by default (an HF folder's
    backend adds its own BOS, if any) and `prefix_id` is its BOS, else EOS (HFLM's rule). For an optquant run
    (`prefix_id` None) both are EOT, as in the exported tokenizer. Left out on purpose: few-shot prompts,
    generation tasks, and batching (the authors' wrapper also uses batch size 1)."""
    import torch

    try:
        from lm_eval.api.model import TemplateLM
    except ImportError as e:
        raise OptquantError("lm-eval is not installed: pip install 'optquant[eval]' (lm-eval==0.4.13)") from e
    if prefix_id is None:
        tokenizer, prefix_id = eot_prefixed(tokenizer, eot_id), eot_id
    prefix_text = tokenizer.decode([prefix_id], skip_special_tokens=False)

    class Adapter(TemplateLM):
        eot_token_id, prefix_token_id = eot_id, prefix_id

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
            if add_special_tokens is None:  # as HFLM: a string that starts with the prefix gets no second one
                add_special_tokens = not string.startswith(prefix_text)
            return tokenizer.encode(string, add_special_tokens=add_special_tokens).ids

        def loglikelihood(self, requests, disable_tqdm: bool = True) -> list[tuple[float, bool]]:
            return super().loglikelihood(requests, disable_tqdm=True)

        @torch.no_grad()
        def _loglikelihood_tokens(self, requests, **kwargs) -> list[tuple[float, bool]]:
            """log p(continuation | context) and whether it is the greedy continuation (lm-eval's contract)."""
            model.eval()
            out = []
            for _, ctx, cont in requests:
                if not cont:
                    out.append((0.0, True))
                    continue
                ids = (ctx + cont)[-(model.cfg.seq_len + 1) :]  # HFLM's left truncation
                x = torch.tensor([ids], device=next(model.parameters()).device)
                logp = torch.log_softmax(model(x[:, :-1]).float(), dim=-1)[0, -len(cont) :]
                target = x[0, -len(cont) :]
                out.append((logp.gather(-1, target[:, None]).sum().item(), bool((logp.argmax(-1) == target).all())))
            return out

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError("optquant's lm-eval adapter scores multiple-choice tasks only")

        def generate_until(self, requests):
            raise NotImplementedError("optquant's lm-eval adapter scores multiple-choice tasks only")

    return Adapter()
