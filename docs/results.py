"""docs/results.md is `optquant report STUDY_DIR --markdown` of the default study; docs/results/ is the part of
that study directory the markdown reads, so that a test can rebuild the page byte for byte without the study.

    python docs/results.py STUDY_DIR    # refresh docs/results/ and docs/results.md from a finished study
    python docs/results.py --write      # re-render docs/results.md from the record (the report's code changed)
    python docs/results.py --check      # exit 1 if docs/results.md is not what the record renders to
    python docs/results.py              # print what the record renders to

The record is found, not listed: the refresh renders the study's markdown while watching which files under
STUDY_DIR it reads (every read goes through `open` or `pandas.read_parquet`), copies exactly those, renders the
copy and refuses to write anything unless the two texts are equal. So a report that starts reading another file
refreshes without an edit here. Today those are study.json, results.parquet, correlations.parquet, fits.json,
best.json (robust.parquet when the study ran the robust arm) and, for the claims table's A-vs-B share, the
propagation.parquet of every Common-Loss model at the largest size under the paper's PTQ scheme.

Rendering happens in a temporary copy: with a robust arm `report --markdown` also draws a figure into
STUDY_DIR/report/figures, which must not land in docs/. Nothing in the output names the study directory or
the machine the report runs on (the machine line is study.json's record of where the study ran), so nothing is
normalised.

It uses the source tree it lives in (../src is put first on sys.path), not an installed optquant.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

RECORD = ROOT / "docs" / "results"
OUTPUT = ROOT / "docs" / "results.md"
COMMAND = "python docs/results.py STUDY_DIR"
WRITE = "python docs/results.py --write"
MAX_RECORD_BYTES = 2 * 2**20  # the record is committed: a report that reads far more should be looked at first

HEADER = """\
# Results of the default study

`optquant report studies/{name} --markdown` of the `{name}` study (`optquant study --preset {name}`),
pasted unedited by `{command}`; the README's section "What the default study finds" quotes it.
docs/results/ holds the files of that study the markdown reads, and tests/test_docs.py rebuilds this page
from them.

"""


def render(record: Path = RECORD) -> str:
    """docs/results.md as the study record at `record` renders it (in a temporary copy of the record)."""
    from optquant.report import report_markdown

    with tempfile.TemporaryDirectory(prefix="optquant-results-") as tmp:
        study = Path(tmp) / "study"
        shutil.copytree(record, study)
        text = report_markdown(study)
    name = json.loads((record / "study.json").read_text(encoding="utf-8")).get("spec", {}).get("name", "cpu")
    return HEADER.format(name=name, command=COMMAND) + text + "\n"


# ----------------------------------------------------------------------------- refresh
class _Reads:
    """The files under `root` a block of code reads, through `open` (the audit hook) and pandas.read_parquet
    (pyarrow opens files in C++, unseen by the hook). Listing a directory under `root` is an error: a record
    that holds a subset of it could render differently."""

    active: _Reads | None = None

    def __init__(self, root: Path):
        self.root, self.files, self.listed = Path(os.path.realpath(root)), set(), set()

    def _under(self, path) -> Path | None:
        try:
            p = Path(os.path.realpath(os.fsdecode(path)))
        except (TypeError, ValueError):
            return None
        return p.relative_to(self.root) if p.is_relative_to(self.root) else None

    @staticmethod
    def hook(event: str, args: tuple) -> None:
        self = _Reads.active
        if self is None or not args or not isinstance(args[0], str | bytes | os.PathLike):
            return
        if event == "open":
            mode, flags = (args[1] if len(args) > 1 else None), (args[2] if len(args) > 2 else 0)
            writes = any(c in (mode or "") for c in "wax+") or (mode is None and flags & (os.O_WRONLY | os.O_RDWR))
            if not writes and (rel := self._under(args[0])) is not None:
                self.files.add(rel)
        elif event in ("os.listdir", "os.scandir", "glob.glob") and (rel := self._under(args[0])) is not None:
            self.listed.add(rel)

    def __enter__(self) -> _Reads:
        import pandas as pd

        if not getattr(_Reads, "installed", False):
            sys.addaudithook(_Reads.hook)  # hooks cannot be removed: it is idle while `active` is None
            _Reads.installed = True
        self.read_parquet = pd.read_parquet

        def read_parquet(path, *args, **kwargs):
            if (rel := self._under(path)) is not None:
                self.files.add(rel)
            return self.read_parquet(path, *args, **kwargs)

        pd.read_parquet = read_parquet
        _Reads.active = self
        return self

    def __exit__(self, *exc) -> None:
        import pandas as pd

        _Reads.active = None
        pd.read_parquet = self.read_parquet


def refresh(study_dir: Path) -> tuple[str, int]:
    """Replace docs/results/ by the files of `study_dir` its markdown reads and docs/results.md by the markdown;
    (the text, the record's bytes). Fails, writing nothing, unless the record renders exactly as the study."""
    from optquant.report import report_markdown

    study_dir = Path(study_dir)
    if not (study_dir / "study.json").is_file() or not (study_dir / "results.parquet").is_file():
        raise SystemExit(f"{study_dir}: not a finished study (no study.json or results.parquet)")
    with tempfile.TemporaryDirectory(prefix="optquant-results-") as tmp:
        # in place, as `optquant report --markdown` does (a robust arm's figure goes to STUDY_DIR/report/figures)
        with _Reads(study_dir) as reads:
            full = report_markdown(study_dir)
        if reads.listed:
            raise SystemExit(f"report --markdown lists {sorted(map(str, reads.listed))} in the study: a record of "
                             "the files it reads is not enough any more; docs/results.py needs another design")
        files = sorted(f for f in reads.files if (study_dir / f).is_file() and "report" not in f.parts[:1])
        staged = Path(tmp) / "results"
        for rel in files:
            (staged / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(study_dir / rel, staged / rel)
        size = sum((staged / f).stat().st_size for f in files)
        if size > MAX_RECORD_BYTES:
            raise SystemExit(f"the record would be {size / 2**20:.1f} MB (> {MAX_RECORD_BYTES / 2**20:.0f} MB): "
                             f"{len(files)} files; look at what the report reads before committing that")
        text = render(staged)
        expected = HEADER.format(name=json.loads((staged / "study.json").read_text())["spec"].get("name", "cpu"),
                                 command=COMMAND) + full + "\n"
        if text != expected:
            diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True), "study", "record"))
            raise SystemExit(f"the record does not render as the study does:\n{diff}")
        if RECORD.exists():
            shutil.rmtree(RECORD)
        shutil.copytree(staged, RECORD)
    OUTPUT.write_text(text, encoding="utf-8")
    return text, size


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("study_dir", nargs="?", type=Path, help="a finished study: refresh the record and results.md")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="re-render docs/results.md from the committed record")
    mode.add_argument("--check", action="store_true", help="exit 1 if docs/results.md is not what the record renders")
    args = p.parse_args(argv)
    if args.study_dir and (args.check or args.write):
        p.error("--write and --check read the committed record; give no STUDY_DIR")
    if args.study_dir:
        _, size = refresh(args.study_dir)
        n = sum(1 for f in RECORD.rglob("*") if f.is_file())
        print(f"wrote {OUTPUT.relative_to(ROOT)} and {RECORD.relative_to(ROOT)}/ ({n} files, {size / 1024:.0f} kB)")
        return 0
    text = render()
    if args.write:
        OUTPUT.write_text(text, encoding="utf-8")
    elif args.check:
        if OUTPUT.read_text(encoding="utf-8") != text:
            print(f"{OUTPUT.relative_to(ROOT)} is not what {RECORD.relative_to(ROOT)}/ renders to: `{WRITE}` "
                  f"re-renders it (the report's code changed), `{COMMAND}` refreshes both (the study changed)",
                  file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
