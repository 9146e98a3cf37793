"""The real LM-Evaluation-Harness through our adapter: a local multiple-choice task (a task YAML over a
jsonl the test writes from its corpus) runs end to end via `optquant eval`, and its acc and acc_norm
must equal the built-in scorer's (continuation_logliks + mc_scores) on the very same items.

In a study (`eval.tasks`, `eval.include_path`): `ptq_damage` scores the FP model and its quantized copy with
lm-eval (equal to the built-in scorer on each), and a smallest-scale study carries those scores into
results.parquet and the report's Table 3c, Table 3 and claims, labelled with the task's name."""

import json
import random

import numpy as np
import pytest

from optquant.cli import main

pytest.importorskip("lm_eval", reason="needs the eval extra: pip install 'optquant[eval]'")

from optquant.data import load_tokens  # noqa: E402
from optquant.evaluate import MCItem, continuation_logliks, mc_scores  # noqa: E402
from optquant.harness import HarnessConfig, check_harness, lm_eval_adapter  # noqa: E402
from optquant.metrics.propagation import ptq_pair  # noqa: E402
from optquant.ptq_stage import AnalysisConfig, covers, load_run_model, ptq_damage  # noqa: E402
from optquant.quant.ptq import PTQConfig  # noqa: E402

LOCAL = "optquant_local_mc"

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
def local_task(corpus, tmp_path) -> tuple:
    """(a folder holding the local task's YAML, its items): what a user points eval.include_path at."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    items = write_items(corpus, tmp_path / "items.jsonl")
    (tasks / f"{LOCAL}.yaml").write_text(TASK.format(jsonl=tmp_path / "items.jsonl"))
    return tasks, items


@pytest.fixture
def trained_run(nano_cfg, runs_cache, tmp_path):
    """conftest's shared nano run, copied: the PTQ job writes into its run directory."""
    import shutil

    from optquant.runs import run_dir
    from optquant.train import train

    shared = run_dir(runs_cache, nano_cfg)
    train(nano_cfg, shared)
    path = tmp_path / "runs" / shared.name
    shutil.copytree(shared, path)
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
    # lm-eval's own entry point through our adapter gives the same scores as `optquant eval`'s direct call
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(tasks), include_defaults=False)  # indexing the built-in tasks: ~10 s
    res = lm_eval.simple_evaluate(model=lm_eval_adapter(model, data.tokenizer, eot_id=data.eot_id),
                                  tasks=["optquant_local_mc"], task_manager=manager,
                                  num_fewshot=0, batch_size=1, bootstrap_iters=0)
    r = res["results"]["optquant_local_mc"]
    assert r["acc,none"] == got["acc"] and r["acc_norm,none"] == got["acc_norm"]


def test_ptq_damage_scores_fp_and_quantized_with_lm_eval(trained_run, local_task):
    """The study's PTQ job with eval tasks: lm-eval's acc/acc_norm of the FP model and of its W4A4 copy, each
    equal to the built-in scorer on that model; the built-in task is not run; the result covers its request."""
    tasks, items = local_task
    acfg = AnalysisConfig(mc_items=0, harness=check_harness(HarnessConfig(tasks=(LOCAL,), include_path=str(tasks))))
    got = ptq_damage(trained_run, PTQConfig(), acfg)
    cfg, model = load_run_model(trained_run)
    data = load_tokens(cfg.data, cfg.model.vocab_size)
    for side, m in zip(("fp", "q"), ptq_pair(model, PTQConfig()), strict=True):
        acc, acc_norm = builtin_scores(m, data.tokenizer, data.eot_id, items)
        r = got["tasks"][LOCAL][side]
        assert (r["acc"], r["acc_norm"], r["n"]) == (pytest.approx(acc, abs=1e-12), pytest.approx(acc_norm, abs=1e-12),
                                                     len(items))
    assert "mc_acc_fp" not in got and list(got["harness"]["tasks"]) == [LOCAL]
    assert covers(got, acfg)
    assert not covers(got, AnalysisConfig(mc_items=0, harness=HarnessConfig(tasks=(LOCAL,), limit=5)))
    assert not covers(got, AnalysisConfig(mc_items=0, harness=HarnessConfig(tasks=(LOCAL, "other"))))


def _cell_value(cell: str) -> float:
    """The mean of a seed-table cell, '12.50 (n=1)' or '+0.00 ± ...'."""
    return float(cell.split()[0])


def test_study_with_a_local_lm_eval_task_reports_its_accuracy(corpus, local_task, tmp_path, capsys):
    """`optquant study --set eval.tasks=... --set eval.include_path=DIR` at the smallest scale (one size, two
    optimizers, one LR and seed each, RTN only, no QAT): every CL model's FP and quantized lm-eval scores land
    in results.parquet, and the report's Table 3c / Table 3 cells and claims show exactly those, by task name."""
    from optquant.cli import main
    from optquant.files import read_parquet
    from optquant.report import report_markdown
    from optquant.report.claims import check_claims
    from optquant.report.load import load_study
    from optquant.report.tables import table3, task_table

    tasks, _ = local_task
    root = tmp_path / "study"
    sets = [f"run=data.source={corpus}", "run=model.vocab_size=320", "sizes=femto", "optimizers=adamw,muon",
            "seeds=0", "lrs.adamw=0.003", "lrs.muon=0.02", "lr_extensions=0", "lr_refine=false",
            "ptq_schemes=w4a4-rtn", "sweep_ptq_schemes=", "qat_bits=", "workers=1", f"eval.tasks={LOCAL}",
            f"eval.include_path={tasks}"]
    assert main(["study", "--preset", "smoke", "--out", str(root), "--quiet",
                 *[a for s in sets for a in ("--set", s)]]) == 0
    df = read_parquet(root / "results.parquet")
    cl = df[df.kind == "cl"]
    assert not cl.metric.str.startswith("mc_").any()  # lm-eval instead of the built-in task
    fp = cl[(cl.metric == f"acc_norm/{LOCAL}") & (cl.scheme == "none")].set_index("optimizer")["value"]
    q = cl[(cl.metric == f"acc_norm/{LOCAL}") & (cl.scheme == "w4a4-rtn")].set_index("optimizer")["value"]
    delta = cl[cl.metric == f"delta_acc_norm/{LOCAL}"].set_index("optimizer")["value"]
    assert sorted(fp.index) == sorted(q.index) == sorted(delta.index) == ["adamw", "muon"]
    assert delta.to_dict() == pytest.approx((q - fp).to_dict(), abs=1e-12)
    for r in cl.drop_duplicates("run_id").itertuples():  # the very numbers lm-eval wrote for each CL model
        summary = json.loads((root / "runs" / r.run_id / "ptq" / "cl" / "w4a4-rtn" / "summary.json").read_text())
        assert summary["tasks"][LOCAL]["fp"]["acc_norm"] == fp[r.optimizer]
        assert summary["tasks"][LOCAL]["q"]["acc_norm"] == q[r.optimizer]

    d = load_study(root)
    assert d.tasks() == (LOCAL,)
    t = task_table(d, LOCAL, "w4a4-rtn")
    assert LOCAL in t.title and "w4a4-rtn" in t.title and not t.missing
    rows = {r[1]: r for r in t.rows if not r[0].startswith("pooled")}
    for opt, label in (("adamw", "AdamW"), ("muon", "Muon")):
        assert _cell_value(rows[label][2]) == pytest.approx(100 * fp[opt], abs=0.005)
        assert _cell_value(rows[label][4]) == pytest.approx(100 * q[opt], abs=0.005)
        assert _cell_value(rows[label][6]) == pytest.approx(100 * delta[opt], abs=0.005)
    t3 = table3(d, "w4a4-rtn")
    j = t3.columns.index(f"Δ acc_norm % ({LOCAL}) mean ± sd [95 % CI] (n)")
    assert {r[1]: _cell_value(r[j]) for r in t3.rows if not r[0].startswith("pooled")} == pytest.approx(
        {"AdamW": 100 * delta["adamw"], "Muon": 100 * delta["muon"]}, abs=0.005)
    claims = check_claims(d)
    assert LOCAL in claims["ptq_least_acc"][1].how and LOCAL in claims["ptq_most_acc"][1].how
    md = report_markdown(root)
    assert t.title in md and f"Δ acc_norm % ({LOCAL})" in md
    assert f"lm-eval tasks: {LOCAL}" in (root / "report" / "index.html").read_text()


def _per_request(res) -> dict:
    """{(doc_id, choice): log-likelihood} of a simple_evaluate(..., log_samples=True) result."""
    return {(s["doc_id"], j): float(r[0][0]) for s in res["samples"][LOCAL] for j, r in enumerate(s["resps"])}


def test_optquant_eval_equals_lm_eval_hf_on_the_export(nano_cfg, runs_cache, corpus, tmp_path, capsys):
    """`lm_eval --model hf` (lm-eval's HFLM, its defaults) on `optquant export`'s folder and `optquant eval` on the
    run give the same log-likelihood for every request: both condition on EOT (the exported tokenizer prepends it),
    also for empty contexts (lm-eval's prefix token) and contexts ending in a space (moved to the continuation)."""
    pytest.importorskip("accelerate", reason="lm_eval --model hf needs accelerate (in the eval extra)")
    pytest.importorskip("transformers", reason="export needs the hf extra")
    import lm_eval
    from lm_eval.tasks import TaskManager

    from optquant.config import apply_overrides
    from optquant.runs import run_dir
    from optquant.train import train

    cfg = apply_overrides(nano_cfg, ["model.arch=llama", "model.n_kv_head=1"])
    run = run_dir(runs_cache, cfg)
    train(cfg, run)
    assert main(["export", str(run), "--hf", str(tmp_path / "hf")]) == 0
    items = write_items(corpus, tmp_path / "items.jsonl", n=30)
    for it in items[:3]:  # empty contexts: lm-eval conditions the choice on its prefix token alone
        it["context"] = ""
    for it in items[3:6]:  # a trailing space: lm-eval moves it to the continuation
        it["context"], it["choices"] = it["context"] + " ", [c.lstrip() for c in it["choices"]]
    (tmp_path / "items.jsonl").write_text("".join(json.dumps(it) + "\n" for it in items))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / f"{LOCAL}.yaml").write_text(TASK.format(jsonl=tmp_path / "items.jsonl"))
    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    common = dict(tasks=[LOCAL], task_manager=manager, num_fewshot=0, batch_size=1, bootstrap_iters=0,
                  log_samples=True)
    ref = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={tmp_path / 'hf'}", device="cpu", **common)
    _, model = load_run_model(run)
    data = load_tokens(cfg.data, cfg.model.vocab_size)
    ours = lm_eval.simple_evaluate(model=lm_eval_adapter(model, data.tokenizer, eot_id=data.eot_id), **common)
    want, got = _per_request(ref), _per_request(ours)
    assert len(want) == 4 * len(items) and got.keys() == want.keys()
    assert max(abs(got[k] - want[k]) for k in want) < 1e-5
    r, o = ref["results"][LOCAL], ours["results"][LOCAL]
    assert (o["acc,none"], o["acc_norm,none"]) == (r["acc,none"], r["acc_norm,none"])
    for source in ([str(run)], ["--hf", str(tmp_path / "hf")]):  # the CLI, on the run and on the export
        out = tmp_path / "lm_eval.json"
        assert main(["eval", *source, "--tasks", LOCAL, "--include-path", str(tasks), "--out", str(out)]) == 0
        cli = json.loads(out.read_text())[LOCAL]
        assert (cli["acc"], cli["acc_norm"]) == (r["acc,none"], r["acc_norm,none"])
    import shutil

    from test_reliability import one_line_error

    bare = tmp_path / "bare"  # the export without its tokenizer files: --tokenizer gives them back, as ptq/analyze
    shutil.copytree(tmp_path / "hf", bare)
    (tmp_path / "tokenizer.json").write_bytes((bare / "tokenizer.json").read_bytes())
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (bare / f).unlink()
    ask = ["--tasks", LOCAL, "--include-path", str(tasks), "--out", str(out)]
    assert main(["eval", "--hf", str(bare), "--tokenizer", str(tmp_path / "tokenizer.json"), *ask]) == 0
    cli = json.loads(out.read_text())[LOCAL]
    assert (cli["acc"], cli["acc_norm"]) == (r["acc,none"], r["acc_norm,none"])
    capsys.readouterr()
    assert main(["eval", "--hf", str(bare), *ask]) == 2
    one_line_error(capsys, str(bare), "--tokenizer PATH")
    assert main(["eval", str(run), "--tokenizer", str(tmp_path / "tokenizer.json"), *ask]) == 2
    one_line_error(capsys, "--tokenizer goes with --hf")
    capsys.readouterr()
