"""The real LM-Evaluation-Harness through our adapter: a local multiple-choice task (a task YAML over a
jsonl the test writes from its corpus) runs end to end via `optquant eval`, and its acc and acc_norm
must equal the built-in scorer's (continuation_logliks + mc_scores) on the very same items."""

import json
import random

import numpy as np
import pytest

from optquant.cli import main

pytest.importorskip("lm_eval", reason="needs the eval extra: pip install 'optquant[eval]'")

from optquant.analysis import load_run_model  # noqa: E402
from optquant.data import load_tokens  # noqa: E402
from optquant.evaluate import MCItem, continuation_logliks, mc_scores  # noqa: E402

TASK = """task: optquant_local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {jsonl}
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: gold
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


def write_items(corpus, path, n: int = 24, seed: int = 0) -> list[dict]:
    """Context: 4 words of a document; choices: its next 2 words and 2 words from other documents."""
    rng = random.Random(seed)
    docs = [p.read_text().split() for p in sorted(corpus.iterdir())]
    items = []
    for _ in range(n):
        d = rng.randrange(len(docs))
        s = rng.randrange(len(docs[d]) - 6)
        spans = [docs[d][s + 4: s + 6]]
        while len(spans) < 4:
            o = docs[rng.randrange(len(docs))]
            p = rng.randrange(len(o) - 2)
            if o[p: p + 2] not in spans:
                spans.append(o[p: p + 2])
        order = list(range(4))
        rng.shuffle(order)
        items.append({"context": " ".join(docs[d][s: s + 4]),
                      "choices": [" " + " ".join(spans[i]) for i in order], "gold": order.index(0)})
    path.write_text("".join(json.dumps(it) + "\n" for it in items))
    return items


def builtin_scores(model, tokenizer, eot_id: int, items: list[dict]) -> tuple[float, float]:
    """Our scorer on the same items: token ids with the EOS the adapter prepends, char lengths of the choices."""
    lls = np.zeros((len(items), 4))
    for i, it in enumerate(items):
        ctx = tokenizer.encode(it["context"], add_special_tokens=False).ids
        for j, choice in enumerate(it["choices"]):
            whole = tokenizer.encode(it["context"] + choice, add_special_tokens=False).ids
            assert whole[: len(ctx)] == ctx  # the seam is a space: the context keeps its tokens
            item = MCItem(tuple([eot_id, *ctx]), (tuple(whole[len(ctx):]),), 0, (len(choice),))
            lls[i, j] = continuation_logliks(model, [item])[0, 0]
    lengths = np.array([[len(c) for c in it["choices"]] for it in items], dtype=float)
    return mc_scores(lls, lengths, np.array([it["gold"] for it in items]))


@pytest.fixture
def trained_run(nano_cfg, tmp_path):
    from optquant.runs import run_dir
    from optquant.train import train

    path = run_dir(tmp_path / "runs", nano_cfg)
    train(nano_cfg, path)
    return path


def test_lm_eval_local_task_equals_builtin_scorer(trained_run, corpus, tmp_path, capsys):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    items = write_items(corpus, tmp_path / "items.jsonl")
    (tasks / "optquant_local_mc.yaml").write_text(TASK.format(jsonl=tmp_path / "items.jsonl"))
    out = tmp_path / "lm_eval.json"
    assert main(["eval", str(trained_run), "--tasks", "optquant_local_mc", "--include-path", str(tasks),
                 "--out", str(out)]) == 0
    got = json.loads(out.read_text())["optquant_local_mc"]
    cfg, model = load_run_model(trained_run)
    data = load_tokens(cfg.data, cfg.model.vocab_size)
    acc, acc_norm = builtin_scores(model, data.tokenizer, data.eot_id, items)
    assert got["n"] == len(items)
    assert got["acc"] == pytest.approx(acc, abs=1e-12) and got["acc_norm"] == pytest.approx(acc_norm, abs=1e-12)
    assert acc != acc_norm or acc > 0.25  # the items discriminate (a trained model beats chance or norms differ)
    assert "optquant_local_mc" in capsys.readouterr().out
