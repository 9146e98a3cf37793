"""Benchmark: the study's ETA on a recorded study, before (tqdm's job-count ETA) and after (the cost model).

Replays a study's costs.jsonl in order of completion (optquant.study.eta `replay`) and prints, at 10,
50 and 90 % of the study's wall time and of its jobs, the true remaining time (to the last job's end), each
ETA and its error. The old ETA is what `optquant study` showed before issue 22: tqdm's rate (EMA,
smoothing 0.3) over the planned job total (eta.plan_cells), grown when exceeded.

Run: python benchmarks/eta.py STUDY_DIR  (reads STUDY_DIR/study.json and STUDY_DIR/costs.jsonl), or
python benchmarks/eta.py tests/data/costs-cpu.jsonl (the fixture, its study-cpu.json beside it).
`--fixture NAME` writes tests/data/costs-NAME.jsonl and study-NAME.json from a study directory, with only
the fields the replay reads. `--scale X` replays the recording as a machine X times slower would have run it
(every time from the first start, every job's seconds and the probe's times, × X); `--probe FILE` replays it
with that probe (a study.json's "probe", or study/probe.py's output as JSON) in place of its own.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from optquant.study.eta import replay
from optquant.study_spec import spec_from_dict

FIELDS = ("stage", "optimizer", "size", "start", "end", "seconds")
DATA = Path(__file__).resolve().parents[1] / "tests" / "data"


def load(path: Path) -> tuple[dict, list[dict]]:
    """(study.json, the costs.jsonl records) of a study directory or of a fixture file."""
    if path.is_dir():
        study, costs = path / "study.json", path / "costs.jsonl"
    else:
        study, costs = path.with_name(path.name.replace("costs-", "study-").replace(".jsonl", ".json")), path
    records = []
    for line in costs.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return json.loads(study.read_text()), records


def scaled(records: list[dict], x: float) -> list[dict]:
    """The records of a machine `x` times slower: times from the first start, and seconds, × x."""
    t0 = min(r["start"] for r in records)
    return [{**r, "start": t0 + x * (r["start"] - t0), "end": t0 + x * (r["end"] - t0), "seconds": x * r["seconds"]}
            for r in records]


def scaled_probe(study: dict, x: float) -> dict:
    """study.json as a machine `x` times slower would have written it: its probe's times × x."""
    probe = study.get("probe")
    if not probe:
        return study
    times = {k: {o: ({s: x * t for s, t in v.items()} if isinstance(v, dict) else x * v) for o, v in probe[k].items()}
             for k in ("step", "forward") if k in probe}
    return {**study, "probe": {**probe, **times}}


def checkpoints(study: dict, records: list[dict]) -> list[dict]:
    """At 10/50/90 % of the wall time and of the jobs: the replay's row (t, jobs, true, eta, old)."""
    rows = replay(spec_from_dict(study["spec"]), records, probe=study.get("probe"))
    total = rows[-1]["t"] + rows[-1]["true"]
    out = []
    for f in (0.1, 0.5, 0.9):
        out.append({"at": f"{f:.0%} of the time", **next(r for r in rows if r["t"] >= f * total)})
        out.append({"at": f"{f:.0%} of the jobs", **next(r for r in rows if r["jobs"] >= f * len(rows))})
    return out


SHARES = (0.0, 0.02, 0.05, 0.1, 0.25, 0.5, 0.9)


def ratios(study: dict, records: list[dict]) -> dict[float, float]:
    """ETA ÷ true remaining time at each share of the run's wall time in SHARES (0: before the first job, the
    probed prior alone; issue 30's goal: within [0.7, 1.3] from 5 % on)."""
    rows = replay(spec_from_dict(study["spec"]), records, probe=study.get("probe"))
    total = rows[-1]["t"] + rows[-1]["true"]
    return {f: r["eta"] / r["true"] for f in SHARES for r in [next(r for r in rows if r["t"] >= f * total)]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("path", type=Path)
    p.add_argument("--fixture", help="write tests/data/costs-NAME.jsonl and study-NAME.json")
    p.add_argument("--scale", type=float, default=1.0, help="replay as a machine this many times slower")
    p.add_argument("--probe", type=Path, help="a probe (JSON) to replay with")
    args = p.parse_args()
    study, records = load(args.path)
    if args.scale != 1.0:
        records, study = scaled(records, args.scale), scaled_probe(study, args.scale)
    if args.probe:
        probe = json.loads(args.probe.read_text())
        study = {**study, "probe": probe.get("probe", probe)}
    print("| share of the run's time | " + " | ".join(f"{f:.0%}" for f in SHARES) + " |")
    print("|---" * (len(SHARES) + 1) + "|")
    print("| ETA ÷ true remaining | " + " | ".join(f"{r:.2f}" for r in ratios(study, records).values()) + " |\n")
    if args.fixture:
        lines = [json.dumps({k: r.get(k) for k in FIELDS}) for r in sorted(records, key=lambda r: r["end"])]
        (DATA / f"costs-{args.fixture}.jsonl").write_text("\n".join(lines) + "\n")
        kept = {k: study[k] for k in ("spec", "probe") if k in study}
        (DATA / f"study-{args.fixture}.json").write_text(json.dumps(kept, indent=1) + "\n")
    print(f"{len(records)} jobs; wall {max(r['end'] for r in records) - min(r['start'] for r in records):.0f} s\n")
    print("| at | elapsed s | jobs done | true remaining s | old ETA s | old error | new ETA s | new error |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in checkpoints(study, records):
        err = {k: f"{100 * (r[k] - r['true']) / r['true']:+.0f} %" if r["true"] > 0 else "–" for k in ("old", "eta")}
        print(f"| {r['at']} | {r['t']:.0f} | {r['jobs']} | {r['true']:.0f} | {r['old']:.0f} | {err['old']} | "
              f"{r['eta']:.0f} | {err['eta']} |")


if __name__ == "__main__":
    main()
