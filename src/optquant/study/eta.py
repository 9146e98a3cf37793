"""A study's ETA from the cost model, corrected by the measured time of every finished job.

Counting jobs makes a poor clock: a study's jobs differ a thousandfold in cost (a PTQ job takes a second, a
QAT run at the largest size minutes), and the slow QAT stage comes after the fast PTQ jobs. So the plan is
priced per cell (stage class fp/cl/ptq/outliers/qat × optimizer × size) from the start (`plan_cells`: its
expected job count and a prior cost per job, `PRIOR`, scaled by the study's probe). Each costs.jsonl record
(study/executor.py) then replaces a prior by measurement, in this order: the mean of the cell's last three
jobs (the best LR's runs, under the machine's current load); for CL and QAT, its FP twin's mean times the
CL/FP or QAT/FP ratio measured in other cells; the prior scaled by the measured/prior ratio of the same class
and size (with the same optimizer, then any); with a probe, the probed prior itself (a size's ratio does not
carry to another size, whose fixed costs differ: the smallest size's first jobs ran 1.5× their prior where the
others ran 0.9–1.0×); without one, the ratio of the same class and optimizer, then class, then all jobs. A job
of a later step of the table ends the earlier ones (their counts become what ran: extensions that never came
are dropped), and the PTQ counts are recomputed from the FP runs that actually finished.

remaining wall time = remaining worker-seconds / measured parallelism (worker-seconds done per second of
wall time, between 1 and `workers`) − the time since the last completion; the display counts down
between completions. `replay` runs the same estimator, and tqdm's own job-count ETA for comparison,
over a recorded costs.jsonl (tests/test_eta.py, benchmarks/eta.py).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from optquant.study.plan import STEPS, phases, planned
from optquant.study_spec import StudySpec, run_config

# The prior seconds of a job for one worker: a fixed part (per training step, or per PTQ/outlier job: Python,
# the optimizer's per-tensor work, loading a model) plus its FLOPs at an effective rate. Fitted to the default
# study recorded on the idle 2-core machine (tests/data/costs-cpu.jsonl); a probe (study/probe.py) rescales it
# to the machine that runs the study, the first finished jobs to its load. What matters beyond the level is its
# shape across sizes: a FLOPs-only prior made the smallest size's jobs (mostly fixed cost) predict the
# largest's 3× too slow.
PRIOR = {"fp": (0.0096, 2.5e10), "ptq": (0.12, 1.8e10)}  # (fixed s, FLOP/s)
QAT_OVER_FP = 1.3  # prior QAT/FP cost ratio (QuEST's quantizers), corrected once a QAT run finishes
RECENT = 3  # a cell's estimate is the mean of its last RECENT jobs
PRIOR_WEIGHT_S = 60.0  # the parallelism prior counts as this many seconds of observed wall time


@dataclass
class Cell:
    planned: float  # jobs expected (corrected as the study runs)
    prior: float  # seconds per job before any measurement
    done: int = 0
    seconds: float = 0.0  # measured worker-seconds of the done jobs
    recent: list[float] = field(default_factory=list)  # the last RECENT jobs' seconds

    @property
    def mean(self) -> float:
        """Seconds per job from the latest jobs: they run at the LR the later ones use (not a diverged or
        early-stopped sweep point) and under the machine's current load."""
        return sum(self.recent) / len(self.recent) if self.recent else math.nan


def _step_prior(b) -> float:
    """Prior seconds of one FP training step of budget `b` (a dryrun RunCost)."""
    return PRIOR["fp"][0] + b.flops / b.steps / PRIOR["fp"][1]


def probe_scale(budgets: dict, probe: dict | None) -> float:
    """This machine's speed relative to the prior: the median over the probed (optimizer, size) of probed over
    prior seconds per training step (1: no probe, an old study.json)."""
    ratios = sorted(t / _step_prior(budgets[(o, s)]) for o, row in ((probe or {}).get("step") or {}).items()
                    for s, t in row.items() if (o, s) in budgets and t > 0)
    return ratios[len(ratios) // 2] if ratios else 1.0


def plan_cells(spec: StudySpec, probe: dict | None = None) -> dict[tuple[str, str, str], Cell]:
    """(class, optimizer, size) → its expected jobs and prior seconds per job: the table of stages (study/plan.py
    `planned`, each row at its `expected` share: one LR extension round per search, half of any other upper
    bound), its FLOPs and steps at `PRIOR`, scaled by the probe (study/probe.py, in study.json; `probe_scale`)."""
    from optquant.cost import DEFAULT_GPU, EVAL_FORWARDS, eval_flops
    from optquant.study.dryrun import cl_fraction, run_costs

    budgets, runs = run_costs(spec, DEFAULT_GPU), defaultdict(Counter)
    for st, jobs in planned(spec, expected=True):
        runs[st.kind].update(jobs)
    out, k = {}, probe_scale(budgets, probe)
    for (o, s), b in budgets.items():
        cfg = run_config(spec, s, o)
        forward = {kind: k * (PRIOR["ptq"][0] + eval_flops(cfg, b.n_params, n) / PRIOR["ptq"][1])
                   for kind, n in EVAL_FORWARDS.items()}
        train = k * (b.steps * PRIOR["fp"][0] + b.flops / PRIOR["fp"][1])
        # cl_fraction is an upper bound (a CL run stops at its crossing, on average halfway through the interval);
        # a robust run is a full-budget run (the methods' cost aside)
        prior = {"fp": train, "cl": train * cl_fraction(spec, o, s, b) / 2, **forward, "qat": train * QAT_OVER_FP,
                 "robust": train}
        out |= {(kind, o, s): Cell(runs[kind][(o, s)], p) for kind, p in prior.items()}
    return {k: c for k, c in out.items() if c.planned > 0}


class CostETA:
    """The remaining wall time of a study, from its planned cells and the jobs measured so far."""

    def __init__(self, spec: StudySpec, start: float, probe: dict | None = None):
        self.spec, self.start, self.t_last = spec, start, start
        self.cells = plan_cells(spec, probe)
        self.probed = bool((probe or {}).get("step"))
        self.workers = max(1, spec.workers if spec.executor == "local" else 1)
        self.busy, self.phase, self.jobs = 0.0, 0, 0

    # ---------------------------------------------------------------- measurements
    def record(self, r: dict) -> None:
        """One costs.jsonl line: a job of class r["stage"] at (optimizer, size) took r["seconds"]."""
        key = (r.get("stage"), r.get("optimizer"), r.get("size"))
        cell = self.cells.setdefault(key, Cell(0.0, self._class_mean(key[0])))
        cell.done, cell.seconds = cell.done + 1, cell.seconds + float(r["seconds"])
        cell.recent = [*cell.recent, float(r["seconds"])][-RECENT:]
        cell.planned = max(cell.planned, cell.done)
        self.busy, self.jobs, self.t_last = self.busy + float(r["seconds"]), self.jobs + 1, max(self.t_last, r["end"])
        self._advance(at if (at := phases(key[0])[0]) >= 0 else self.phase)

    def skip(self, cls: str, now: float) -> None:
        """A job of class `cls` answered from its files (a resumed study): one planned job fewer."""
        open_cells = [c for (k, *_), c in self.cells.items() if k == cls and c.planned > c.done]
        if open_cells:
            max(open_cells, key=lambda c: c.planned - c.done).planned -= 1
        self.jobs, self.t_last = self.jobs + 1, max(self.t_last, now)

    def _advance(self, at: int) -> None:
        """A job of a later step ran: the earlier steps are over (their counts become what ran), and the
        PTQ/outlier counts follow from the table's rows for them over the jobs that ran (the FP runs done,
        less the expected runs of the rows whose models the PTQ stage leaves out)."""
        if at <= self.phase:
            return
        self.phase = at
        counts: dict[str, Counter] = defaultdict(Counter)
        for (cls, o, s), c in self.cells.items():
            if phases(cls)[1] < at:
                c.planned = c.done
            counts[cls][(o, s)] = c.planned
        for st, jobs in planned(self.spec, expected=True):
            if st.kind == "fp" and not st.analysed:
                counts["fp"].subtract(jobs)
        counts["analysed"] = +counts["fp"]  # (+: the counts above 0)
        later: Counter = Counter()  # the PTQ/outlier jobs of the steps not begun (the robust arm's PTQ is one)
        for st in (st for step in STEPS[at:] for st in step.stages if st.kind in ("ptq", "outliers")):
            later.update({(st.kind, *k): n for k, n in st.jobs(self.spec, counts).items()})
        for key, n in later.items():
            if (cell := self.cells.get(key)) is not None:
                cell.planned = (cell.done if phases(key[0])[0] < at else 0) + n

    # ---------------------------------------------------------------- estimates
    def _class_mean(self, cls: str) -> float:
        done = [c for (k, *_), c in self.cells.items() if k == cls and c.done]
        return sum(c.seconds for c in done) / sum(c.done for c in done) if done else 1.0

    def _scale(self, cls: str | None, opt: str | None, size: str | None = None) -> float:
        """Measured seconds over prior seconds of the done jobs of that class, optimizer and size (None: any)."""
        done = [c for (k, o, s), c in self.cells.items() if c.done and c.prior > 0
                and (cls is None or k == cls) and (opt is None or o == opt) and (size is None or s == size)]
        prior = sum(c.prior * c.done for c in done)
        return sum(c.seconds for c in done) / prior if prior > 0 else math.nan

    def _twin_ratio(self, cls: str) -> float:
        """Geometric mean over the cells with both of (class mean) / (its FP twin's mean)."""
        logs = [math.log(c.mean / f.mean) for (k, o, s), c in self.cells.items() if k == cls and c.done
                if (f := self.cells.get(("fp", o, s))) is not None and f.done and c.mean > 0 and f.mean > 0]
        return math.exp(sum(logs) / len(logs)) if logs else math.nan

    def per_job(self, key: tuple[str, str, str]) -> float:
        cell = self.cells[key]
        if cell.done:
            return cell.mean
        cls, o, s = key
        fp = self.cells.get(("fp", o, s))
        if cls in ("cl", "qat") and fp is not None and fp.done:
            ratio = self._twin_ratio(cls)
            return fp.mean * (ratio if math.isfinite(ratio) else cell.prior / fp.prior)
        wider = () if self.probed else ((cls, o), (cls, None), (None, o), (None, None))  # other sizes' ratios
        for scale in (self._scale(*where) for where in ((cls, o, s), (cls, None, s), *wider)):
            if math.isfinite(scale):
                return cell.prior * scale
        return cell.prior

    def remaining_work(self) -> float:
        """Worker-seconds of the jobs still to run."""
        return sum(max(c.planned - c.done, 0.0) * self.per_job(k) for k, c in self.cells.items())

    def parallelism(self) -> float:
        span = self.t_last - self.start
        p = (self.busy + self.workers * PRIOR_WEIGHT_S) / (span + PRIOR_WEIGHT_S)
        return min(max(p, 1.0), float(self.workers))

    def eta(self, now: float) -> float:
        """Seconds of wall time left, counting down from the last completion."""
        return max(self.remaining_work() / self.parallelism() - (now - self.t_last), 0.0)

    def fraction(self, now: float) -> float:
        """Share of the estimated whole study's wall time that has passed."""
        elapsed = now - self.start
        return elapsed / (elapsed + self.eta(now)) if elapsed > 0 else 0.0

    def total_jobs(self) -> int:
        return round(sum(max(c.planned, c.done) for c in self.cells.values()))


def replay(spec: StudySpec, records: list[dict], start: float | None = None, probe: dict | None = None) -> list[dict]:
    """Feed a recorded costs.jsonl in order of completion; at the start (the probed prior alone) and after each job:
    the time, jobs done, the true remaining time (to the last job's end), this module's ETA (priced by
    `probe`, the study.json's) and tqdm's job-count ETA as `optquant study` showed it before (total = the
    planned jobs, grown when exceeded; tqdm's EMA rate, smoothing 0.3)."""
    from tqdm.std import EMA

    records = sorted(records, key=lambda r: r["end"])
    start = min(r["start"] for r in records) if start is None else start
    end, est = records[-1]["end"], CostETA(spec, start, probe=probe)
    total = round(sum(c.planned for c in est.cells.values()))
    dn, dt, last_t, last_n = EMA(0.3), EMA(0.3), start, 0
    out = [{"t": 0.0, "jobs": 0, "true": end - start, "eta": est.eta(start), "old": math.nan}]  # the prior's
    for i, r in enumerate(records, 1):
        est.record(r)
        t = r["end"]
        total = max(total, i)
        if t - last_t >= 0.1:  # tqdm's mininterval
            dn(i - last_n)
            dt(t - last_t)
            last_t, last_n = t, i
        rate = dn() / dt() if dt() else math.nan
        old = (total - i) / rate if rate and math.isfinite(rate) else math.nan
        out.append({"t": t - start, "jobs": i, "true": end - t, "eta": est.eta(t), "old": old})
    return out
