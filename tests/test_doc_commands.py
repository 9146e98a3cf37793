"""Every command in a fenced shell block of README.md, docs/scale-out.md and docs/your-own.md runs as written
(issue 30), in a temp directory with HOME pointing into it, so `~/ClimbMix10m/` or `~/models/...` are tiny
fixtures built from what the code really writes. Placeholders (`runs/<run>`, `[--markdown]`) go through the
explicit SUBS table; what cannot run here is in SKIP with its reason. A block command in neither table fails
`test_every_documented_command_is_run_or_skipped`, so the docs cannot drift from the tests.

The cheap commands are fast tests: each runs through `optquant.cli.main` in the test's process (what the console
script calls; a fresh interpreter would add ~3 s of imports per command) on a module fixture with a zepto run,
together ~22 s of CPU (measured niced under load; an idle core gives about that wall time), plus 5.8 s for the
paper dry run whose output docs/scale-out.md quotes. SLOW ones (a study,
a default-sized `train`, the default study's refit) run through bash in a fresh directory, with -m slow.
"""

from __future__ import annotations

import os
import random
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/scale-out.md", "docs/your-own.md")
SHELLS = {"bash", "sh", "console", "shell"}


@dataclass(frozen=True)
class DocCommand:
    file: str
    line: int
    text: str  # one command, its trailing comment removed; `a && b` is two commands


def extract(path: Path, name: str | None = None) -> list[DocCommand]:
    """The commands of every fenced bash/sh/console block of a markdown file, with their line numbers."""
    name = name or str(path.relative_to(ROOT))
    out, lang = [], None
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            lang = line[3:].strip() if lang is None else None
            continue
        if lang in SHELLS and line.strip():
            text = line.strip().removeprefix("$ ")
            code = " ".join(shlex.split(text, comments=True, posix=False))  # drops a trailing `# comment`
            out += [DocCommand(name, i, part.strip()) for part in code.split(" && ")]
    return out


# The commands that cannot run here, each with why. Exact text, as extract() gives it.
SKIP = {
    'pip install -e ".[dev]"': "installs from the package index: no network here, and the venv is shared",
    "optquant study": "the whole default study, 17-32 min on an idle 2-core machine; docs/results/ is its "
                      "output, checked by test_docs.py and test_readme.py",
    "python -m pytest -q": "the test suite itself",
    "optquant eval runs/tiny-adamw-<hash> --tasks piqa,hellaswag,arc_easy":
        "needs the piqa/hellaswag/arc_easy datasets in the Hugging Face cache: a download",
    "tensorboard --logdir runs": "a server that runs until killed",
}
# Placeholders → what the test builds. `runs/<run>` is a tiny llama run trained by the fixture (llama: export
# refuses the OLMo2 variant); `[--markdown]` is optional syntax, the test runs the flag.
SUBS = {
    "runs/<run>": "runs/{run}",
    "runs/tiny-adamw-<hash>": "runs/{tiny_run}",
    "[--markdown]": "--markdown",
}
# Commands that train a real preset (a study at smoke scale, a default `train`) or refit the default study
# (bootstrap intervals: 64 s of CPU, three times the fast commands together): slow-marked.
SLOW = {
    "optquant fit studies/cpu",
    "optquant train --preset nano --set optim.name=muon --set optim.lr=0.02",
    "optquant study --preset smoke --set optimizers=adamw,examples/lion.py:make_optimizer",
    "optquant train --set model.arch=llama --out runs",
    "optquant export runs/tiny-adamw-<hash> --hf exported/tiny",
    "optquant study --preset smoke --set eval.tasks=my_mc --set eval.include_path=my_tasks/",
    "optquant train --set log.to=tensorboard",
}
# The slow ones CI runs too (.ci/run: -m ci): the plugin study (the smoke study with Lion: every stage and the
# report, in place of a hand-written copy of the README's smoke study), the smoke study scored on a local lm-eval
# task and the refit of the default study. CPU seconds of each test, measured here niced on the loaded 2-core
# machine (/usr/bin/time, children included): the task study 147 s, the refit 25 s. The documented trains run at
# SMOKE_TRAIN's step cap: the three trains and the export 56 CPU s together (as written, the README's nano Muon
# run took over 695 s of CPU and was still training).
IN_CI = {
    "optquant study --preset smoke --set optimizers=adamw,examples/lion.py:make_optimizer",
    "optquant study --preset smoke --set eval.tasks=my_mc --set eval.include_path=my_tasks/",
    "optquant fit studies/cpu",
    "optquant train --preset nano --set optim.name=muon --set optim.lr=0.02",  # at smoke scale: SMOKE_TRAIN
    "optquant train --set model.arch=llama --out runs",
    "optquant export runs/tiny-adamw-<hash> --hf exported/tiny",
    "optquant train --set log.to=tensorboard",
}


def all_commands() -> list[DocCommand]:
    return [c for doc in DOCS for c in extract(ROOT / doc)]


class DocCommandFailed(AssertionError):
    pass


# A documented `optquant train` runs at smoke scale (issue 30: "at smoke scale where the command names a
# preset"; without --preset it names the default `tiny`): its own flags, checked as written, plus a step cap,
# so the README's nano Muon run (4,925 steps) and your-own.md's default runs (12,812 steps each) take seconds.
SMOKE_TRAIN = " --set train.steps=20"


def _substituted(cmd: DocCommand, values: dict | None) -> str:
    text = cmd.text
    for placeholder, sub in SUBS.items():
        if placeholder in text:
            text = text.replace(placeholder, sub.format(**(values or {})))
    if text.startswith("optquant train") and "--dry-run" not in text:
        text += SMOKE_TRAIN
    return text


def _failed(cmd: DocCommand, code: int, out: str, err: str) -> DocCommandFailed:
    last = (err.strip() or out.strip()).splitlines()[-1:] or [""]
    return DocCommandFailed(f"{cmd.file}:{cmd.line}: `{cmd.text}` exited {code}: {last[0]}")


def run_doc_command(cmd: DocCommand, cwd: Path, values: dict | None = None, timeout: float = 3600) -> str:
    """Run one documented command through bash in `cwd` (HOME = cwd/home), placeholders replaced; a non-zero
    exit raises naming the file and line of the doc."""
    env = {**os.environ, "HOME": str(cwd / "home")}
    r = subprocess.run(["bash", "-c", _substituted(cmd, values)], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode != 0:
        raise _failed(cmd, r.returncode, r.stdout, r.stderr)
    return r.stdout


SHELL_SYNTAX = re.compile(r"[|&;<>()$`\\*?!{}\[\]\"']")


def run_in_process(cmd: DocCommand, cwd: Path, monkeypatch, capsys, values: dict | None = None) -> str:
    """A plain `optquant ...` command (words only, no shell syntax) run as the console script runs it,
    `optquant.cli.main(argv)`, in this process: the same parse and code, without a fresh interpreter's ~3 s of
    imports per command. In `cwd` with HOME = cwd/home; a word starting with `~` is expanded as bash does."""
    from optquant.cli import main

    text = _substituted(cmd, values)
    assert text.startswith("optquant ") and not SHELL_SYNTAX.search(text), f"not a plain command: {text}"
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HOME", str(cwd / "home"))
    argv = [os.path.expanduser(w) for w in shlex.split(text)[1:]]  # expanduser touches a leading ~ only
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse: a usage error (2) or --help (0)
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    if code != 0:
        raise _failed(cmd, code, out, err)
    return out


def test_every_documented_command_is_run_or_skipped():
    cmds = all_commands()
    assert len(cmds) >= 15, cmds
    texts = {c.text for c in cmds}
    stale = (set(SKIP) | SLOW) - texts
    assert not stale, f"listed but no longer in the docs: {stale}"
    assert IN_CI <= SLOW, IN_CI - SLOW
    placeholders = [c for c in cmds if re.search(r"<[^>]+>|\[--", c.text) and c.text not in SKIP
                    and not any(p in c.text for p in SUBS)]
    assert not placeholders, f"a placeholder without a substitution in SUBS: {placeholders}"


def test_no_command_hides_in_an_untagged_block():
    """A fence without a language is not extracted: one holding a command (`$ ...`, `optquant ...`) would escape
    the tests above, so it must be tagged bash. Today's untagged blocks (docs/configuration.md's robust methods)
    are text."""
    command = re.compile(r"^(\$ |optquant |python |pip )")
    for path in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        lang = None
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if line.startswith("```"):
                lang = line[3:].strip() if lang is None else None
            elif lang == "" and command.match(line.strip()):
                raise AssertionError(f"{path.relative_to(ROOT)}:{i}: a command in an untagged block: tag it bash")


def test_a_broken_doc_command_fails_naming_file_and_line(tmp_path, monkeypatch, capsys):
    doc = tmp_path / "broken.md"
    doc.write_text("# A doc\n\ntext\n\n```bash\noptquant train --no-such-flag   # a typo\n```\n")
    (cmd,) = extract(doc, "docs/broken.md")
    assert cmd == DocCommand("docs/broken.md", 6, "optquant train --no-such-flag")
    for run in (lambda: run_doc_command(cmd, tmp_path), lambda: run_in_process(cmd, tmp_path, monkeypatch, capsys)):
        with pytest.raises(DocCommandFailed, match=r"^docs/broken\.md:6: `optquant train --no-such-flag` exited 2"):
            run()


# --- quoted output ------------------------------------------------------------------------------------------
# A block of a command's output in the docs is either compared with what the command prints today, marked
# `<!-- output: COMMAND -->` on the line before its fence (each of its lines must be a line of the output, in
# order, blanks ignored and spaces collapsed; `...` marks left-out lines), or said to be measured (timings,
# memory: numbers of one machine), marked `<!-- measured: WHY -->` before it, or once before a file's first `## `
# heading for all of it. A table or block that a sentence introduces as printed ("prints", "as printed",
# "`optquant ...`:") must carry one of the two.
OUTPUT_DOCS = (*DOCS, "docs/benchmarks.md")
OUTPUT = re.compile(r"<!-- output: (optquant [^>]+) -->")
MEASURED = re.compile(r"<!-- measured: [^>]+ -->")
PRINTED = re.compile(r"\bprint(s|ed)\b|`optquant [^`]+`[^`]*:$")


@dataclass(frozen=True)
class QuotedOutput:
    file: str
    line: int  # the marker's
    command: str
    lines: tuple[str, ...]  # the block's lines, spaces collapsed, blanks dropped


def quoted_outputs(path: Path, name: str | None = None) -> list[QuotedOutput]:
    name = name or str(path.relative_to(ROOT))
    lines, out = path.read_text().splitlines(), []
    for i, line in enumerate(lines):
        if m := OUTPUT.fullmatch(line.strip()):
            start = next((k for k in range(i + 1, len(lines)) if lines[k].strip()), len(lines))
            assert start < len(lines) and lines[start].startswith("```"), f"{name}:{i + 1}: no fenced block follows"
            end = next(k for k in range(start + 1, len(lines)) if lines[k].startswith("```"))
            out.append(QuotedOutput(name, i + 1, m[1], tuple(" ".join(t.split()) for t in lines[start + 1:end]
                                                             if t.strip())))
    return out


def unmarked_outputs(path: Path, name: str | None = None) -> list[str]:
    """file:line of each table or fenced block introduced as printed output but marked neither way."""
    name = name or str(path.relative_to(ROOT))
    lines, found, fence, prev, table = path.read_text().splitlines(), [], False, "", False
    head = next((i for i, t in enumerate(lines) if t.startswith("## ")), len(lines))
    if any(MEASURED.fullmatch(t.strip()) for t in lines[:head]):
        return []
    for i, line in enumerate(lines):
        starts = (line.startswith("```") and not fence) or (line.startswith("|") and not table and not fence)
        if starts and PRINTED.search(prev) and not (OUTPUT.fullmatch(prev) or MEASURED.fullmatch(prev)):
            found.append(f"{name}:{i + 1}")
        fence ^= line.startswith("```")
        table = line.startswith("|") and not fence
        prev = line.strip() or prev
    return found


def compare_quoted(q: QuotedOutput, output: str) -> None:
    printed = [" ".join(t.split()) for t in output.splitlines()]
    at = 0
    for want in q.lines:
        if want == "...":
            continue
        if want not in printed[at:]:
            raise DocCommandFailed(f"{q.file}:{q.line}: `{q.command}` no longer prints {want!r} (in this order)")
        at = printed.index(want, at) + 1


def test_every_printed_block_is_compared_or_measured():
    assert [q.command for doc in OUTPUT_DOCS for q in quoted_outputs(ROOT / doc)], "no quoted output is compared"
    assert not [u for doc in OUTPUT_DOCS for u in unmarked_outputs(ROOT / doc)]


def test_a_drifted_quote_fails_naming_file_and_line(tmp_path, monkeypatch, capsys):
    doc = tmp_path / "quoted.md"
    doc.write_text("# A doc\n\n`optquant fit --help` prints:\n\n<!-- output: optquant fit --help -->\n```text\n"
                   "usage: optquant fit [-h] [--interval {bootstrap,loo,none}] study_dir\n...\n"
                   "  --interval {bootstrap,loo,none}\n```\n\nIt prints:\n\n| a | table |\n")
    (q,) = quoted_outputs(doc, "docs/quoted.md")
    out = run_in_process(DocCommand(q.file, q.line, q.command), tmp_path, monkeypatch, capsys)
    compare_quoted(q, out)
    assert unmarked_outputs(doc, "docs/quoted.md") == ["docs/quoted.md:14"]  # the table; the block is marked
    drifted = QuotedOutput(q.file, q.line, q.command, (*q.lines, "  --no-such-flag"))
    with pytest.raises(DocCommandFailed, match=r"^docs/quoted\.md:5: `optquant fit --help` no longer prints"):
        compare_quoted(drifted, out)
    reordered = QuotedOutput(q.file, q.line, q.command, q.lines[::-1])
    with pytest.raises(DocCommandFailed, match="in this order"):
        compare_quoted(reordered, out)


# --- the fixtures the commands run on ------------------------------------------------------------------------


def _mc_task(home: Path, corpus: Path, folder: Path, task: str):
    """docs/your-own.md's own task YAML (its yaml block), over items written as tests/test_harness.py does."""
    from test_harness import write_items

    text = (ROOT / "docs" / "your-own.md").read_text()
    yaml = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    write_items(corpus, home / "my_mc.jsonl")
    folder.mkdir(parents=True, exist_ok=True)
    yaml = yaml.replace("/data/my_mc.jsonl", str(home / "my_mc.jsonl")).replace("task: my_mc", f"task: {task}")
    (folder / f"{task}.yaml").write_text(yaml)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, corpus):
    """A directory holding what the fast commands name: a tiny llama run under runs/, studies/cpu (a copy of
    docs/results, the default study's output), ~/ClimbMix10m/ (parquet files with a `text` column),
    ~/models/Qwen2.5-0.5B (a tiny random Qwen2 with a tokenizer) and my_tasks/mytask.yaml."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path_factory.mktemp("doc-commands")
    home = d / "home"
    (home / "ClimbMix10m").mkdir(parents=True)
    # enough distinct words for the command's default 32,000-token BPE (the test corpus supports ~360)
    rng = random.Random(0)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(3, 9))) for _ in range(60_000)]
    docs = [" ".join(words[i:i + 500]) for i in range(0, len(words), 500)] * 2
    for k in range(2):
        pq.write_table(pa.table({"text": docs[k::2]}), home / "ClimbMix10m" / f"part{k}.parquet")
    shutil.copytree(ROOT / "docs" / "results", d / "studies" / "cpu")
    from optquant.cli import main

    train = ["train", "--preset", "zepto", "--out", str(d / "runs")] + [
        a for s in (f"data.source={corpus}", "model.vocab_size=320", "model.seq_len=32", "train.batch_size=8",
                    "train.steps=20", "train.eval_every=10", "train.eval_batches=2", "train.precision=fp32",
                    "model.arch=llama") for a in ("--set", s)]
    with pytest.MonkeyPatch.context() as mp:  # as conftest's _isolated_cache, which runs after this fixture
        mp.setenv("OPTQUANT_CACHE", str(tmp_path_factory.getbasetemp() / "optquant-cache"))
        assert main(train) == 0  # in this process, as run_in_process runs the commands
    (run,) = [p.name for p in (d / "runs").iterdir()]
    _mc_task(home, corpus, d / "my_tasks", "mytask")
    from test_hf import _with_tokenizer, save_tiny

    qwen = save_tiny("qwen2", home / "models" / "Qwen2.5-0.5B", vocab_size=320, max_position_embeddings=32768)
    _with_tokenizer(qwen, corpus)  # its window as the real one's: the docs' --seq-len 256 fits
    return d, run


FAST = [c for c in all_commands() if c.text not in SKIP and c.text not in SLOW]


# Fast: each runs in this process (run_in_process), on the module's fixtures.
@pytest.mark.parametrize("cmd", FAST, ids=lambda c: f"{c.file}:{c.line}:{c.text.split()[1]}")
def test_documented_command_runs(cmd, workdir, monkeypatch, capsys):
    d, run = workdir
    run_in_process(cmd, d, monkeypatch, capsys, {"run": run})


@pytest.mark.parametrize("q", [q for doc in OUTPUT_DOCS for q in quoted_outputs(ROOT / doc)],
                         ids=lambda q: f"{q.file}:{q.line}")
def test_quoted_output_is_what_the_command_prints(q, workdir, monkeypatch, capsys):
    d, run = workdir
    compare_quoted(q, run_in_process(DocCommand(q.file, q.line, q.command), d, monkeypatch, capsys, {"run": run}))


@pytest.mark.slow
@pytest.mark.parametrize("cmd", [pytest.param(c, marks=pytest.mark.ci) if c.text in IN_CI else c
                                 for c in all_commands() if c.text in SLOW],
                         ids=lambda c: f"{c.file}:{c.line}:{c.text.split()[1]}")
def test_documented_slow_command_runs(cmd, tmp_path, corpus):
    """Each in a fresh directory with examples/ beside it; `a && b` runs its commands in order there."""
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    shutil.copytree(ROOT / "docs" / "results", tmp_path / "studies" / "cpu")  # the default study's output
    (tmp_path / "home").mkdir()
    _mc_task(tmp_path / "home", corpus, tmp_path / "my_tasks", "my_mc")
    siblings = [c for c in all_commands() if c.file == cmd.file and c.line == cmd.line]
    for c in siblings[: siblings.index(cmd) + 1]:
        runs = list((tmp_path / "runs").glob("tiny-adamw-*")) if (tmp_path / "runs").is_dir() else []
        run_doc_command(c, tmp_path, {"run": "", "tiny_run": runs[0].name if runs else "<none>"})
    if "examples/lion.py:make_optimizer" in cmd.text:
        _names_the_plugin(tmp_path / "studies" / "smoke", "examples/lion.py:make_optimizer", "lion.py:make_optimizer")


def _names_the_plugin(study: Path, name: str, short: str):
    """docs/your-own.md's plugin study (issue 30's Done-when): best.json keeps the plugin's name as typed, and
    the report names it by its short label in the Tuning table, Table 2 and the claims table (measured on its
    output: rows `| lion.py:make_optimizer | embeddings |`, `| femto (17.5k) | lion.py:make_optimizer |` and
    claims' evidence `AdamW 1=, lion.py:make_optimizer 1=`), as in the HTML page; no path in a size's place."""
    import json

    from optquant.report import report_markdown

    best = json.loads((study / "best.json").read_text())
    assert {(b["optimizer"], b["size"]) for b in best} == {(o, s) for o in ("adamw", name) for s in ("femto", "nano")}
    tables = {t.split("\n", 1)[0]: t for t in report_markdown(study).split("\n### ")[1:]}
    table = {title: next(t for k, t in tables.items() if k.startswith(title))
             for title in ("Tuning", "Table 2", "LR searches left unbracketed", "Paper claims")}
    assert re.search(rf"^\| {re.escape(short)} \| embeddings \|", table["Tuning"], re.M), table["Tuning"]
    assert re.search(rf"^\| femto [^|]*\| {re.escape(short)} \|", table["Table 2"], re.M), table["Table 2"]
    assert f"{short} 1=" in table["Paper claims"] or f"{short} 1.00" in table["Paper claims"], table["Paper claims"]
    assert all(name not in t for t in table.values())  # the path is shortened everywhere
    assert not re.search(r"^\| [^|]*/", table["LR searches left unbracketed"], re.M)  # a size, not a path
    assert short in (study / "report" / "index.html").read_text()
