"""The kernels' own speed per run: stored timings, the comparison with the baseline, the history.

A run's kernels are compared with the kernels of the run the trajectory verdict uses as its
baseline (service.domain.baselines.choose), kernel by kernel (same kernel, parameter dtype and
size), with the noise model of service/core/speed_noise.py. The speed verdict is kept apart from the
trajectory verdict: a slower kernel never changes the run's outcome or the CLI's exit code unless
asked (`optdrift speed --fail-on-slowdown`).

Run verdicts: `slower` (some kernel's whole interval above 1 + threshold), `faster`, `same`,
`no-baseline` (no baseline run, or it has no timings), `not-timed` (this run has none).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db.models import DONE, Commit, Run
from service.db.speed_models import KernelSpeed


@dataclass
class KernelSpeedRow:
    """One kernel x dtype x size of a run, with its comparison against the baseline's."""

    kernel: str
    param_dtype: str
    size: int
    median_s: float | None
    spread_s: float | None
    samples: int
    bytes_moved: int
    bandwidth_bytes_per_s: float | None
    copy_fraction: float | None
    error: str | None = None
    baseline_median_s: float | None = None
    ratio: float | None = None  # median(commit) / median(baseline)
    ratio_low: float | None = None
    ratio_high: float | None = None
    verdict: str = "no-baseline"  # slower | faster | same | no-baseline | error


@dataclass
class RunSpeed:
    run_id: int
    verdict: str
    summary: str
    baseline_run_id: int | None
    threshold: float
    confidence: float
    device: str | None
    # What the worker said about the timing (environment_detail["kernel_speed"]): how many, how
    # long, what was left untimed, or why it failed; None where the worker did not time.
    note: str | None = None
    kernels: list[KernelSpeedRow] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def store(*, session: Session, run_id: int, answer: dict) -> int:
    """The kernel host's `time_kernels` answer (worker/speed/timing.py) as rows of `run_id`,
    replacing any earlier timing of the run (a retried run times again). Returns rows stored."""
    from service.core.speed_noise import summarize

    session.query(KernelSpeed).filter(KernelSpeed.run_id == run_id).delete()
    device = str(answer.get("device", ""))[:200]
    count = 0
    for timing in answer.get("timings", []):
        samples = [float(s) for s in timing.get("samples_s", [])]
        copies = [float(s) for s in timing.get("copy_samples_s", [])]
        error = timing.get("error")
        kernel_summary = copy_summary = None
        if not error:
            try:
                kernel_summary, copy_summary = summarize(samples), summarize(copies)
            except ValueError as problem:
                error = str(problem)
        session.add(KernelSpeed(
            run_id=run_id, kernel=str(timing["kernel"])[:100], optimizer=str(timing["optimizer"])[:40],
            family=str(timing["family"])[:40], param_dtype=str(timing["param_dtype"])[:20], size=int(timing["size"]),
            samples_s=samples if not error else [], copy_samples_s=copies if not error else [],
            median_s=kernel_summary.median_s if kernel_summary else None,
            spread_s=kernel_summary.spread_s if kernel_summary else None,
            bytes_moved=int(timing.get("bytes_moved", 0)),
            copy_median_s=copy_summary.median_s if copy_summary else None,
            copy_fraction=copy_summary.median_s / kernel_summary.median_s if kernel_summary else None,
            device=device, error=str(error)[:2000] if error else None))
        count += 1
    session.flush()
    return count


def rows(*, session: Session, run_id: int) -> list[KernelSpeed]:
    return list(session.scalars(select(KernelSpeed).where(KernelSpeed.run_id == run_id)
                                .order_by(KernelSpeed.size, KernelSpeed.kernel, KernelSpeed.param_dtype)))


# Comparisons by (this row's id, the baseline row's id): stored samples never change (a re-timed
# run gets new rows), and a bootstrap costs milliseconds, too much to redo for every row of a
# commit list on every view. Bounded; per process.
_COMPARISONS: OrderedDict[tuple[int, int], Any] = OrderedDict()
_COMPARISONS_MAX = 50_000
_comparisons_lock = threading.Lock()


def _compared(row: KernelSpeed, other: KernelSpeed):  # noqa: ANN202
    from service.core.speed_noise import compare

    key = (row.id, other.id)
    with _comparisons_lock:
        if key in _COMPARISONS:
            _COMPARISONS.move_to_end(key)
            return _COMPARISONS[key]
    result = compare(row.samples_s, other.samples_s)
    with _comparisons_lock:
        _COMPARISONS[key] = result
        while len(_COMPARISONS) > _COMPARISONS_MAX:
            _COMPARISONS.popitem(last=False)
    return result


def _key(row: KernelSpeed) -> tuple[str, str, int]:
    return (row.kernel, row.param_dtype, row.size)


def _baseline_run(session: Session, run: Run) -> Run | None:
    from service.domain import baselines

    choice = baselines.choose(session=session, run=run)
    if choice.run is None or choice.pending or choice.run.status != DONE:
        return None
    return choice.run


def run_speed(*, session: Session, run: Run) -> RunSpeed:
    """This run's timings against its baseline's, kernel by kernel."""
    from service.core.speed_noise import CONFIDENCE, SLOWDOWN_THRESHOLD, worst

    own = rows(session=session, run_id=run.id)
    baseline = _baseline_run(session, run)
    theirs = {_key(r): r for r in rows(session=session, run_id=baseline.id)} if baseline else {}
    result = RunSpeed(run_id=run.id, verdict="not-timed", summary="", threshold=SLOWDOWN_THRESHOLD,
                      confidence=CONFIDENCE, baseline_run_id=baseline.id if baseline else None,
                      device=own[0].device if own else None,
                      note=(run.environment_detail or {}).get("kernel_speed"))
    for row in own:
        entry = KernelSpeedRow(
            kernel=row.kernel, param_dtype=row.param_dtype, size=row.size, median_s=row.median_s,
            spread_s=row.spread_s, samples=len(row.samples_s), bytes_moved=row.bytes_moved,
            bandwidth_bytes_per_s=row.bytes_moved / row.median_s if row.median_s else None,
            copy_fraction=row.copy_fraction, error=row.error)
        other = theirs.get(_key(row))
        if row.error:
            entry.verdict = "error"
        elif other is not None and not other.error and other.samples_s:
            comparison = _compared(row, other)
            entry.baseline_median_s = other.median_s
            entry.ratio, entry.ratio_low, entry.ratio_high = comparison.ratio, comparison.low, comparison.high
            entry.verdict = comparison.verdict
        result.kernels.append(entry)
    judged = [k.verdict for k in result.kernels if k.verdict in ("slower", "faster", "same")]
    if not own:
        result.summary = "the kernels' speed was not timed for this run" + (f" ({result.note})" if result.note else "")
    elif not judged:
        result.verdict = "no-baseline"
        result.summary = (f"{len(own)} kernel timings; no baseline timings to compare with"
                          if baseline is None or not theirs else
                          f"{len(own)} kernel timings; none matches a baseline timing")
    else:
        result.verdict = worst(judged)
        slower = [k for k in result.kernels if k.verdict == "slower"]
        if slower:
            worst_kernel = max(slower, key=lambda k: k.ratio_low or 0.0)
            result.summary = (f"{len(slower)} of {len(judged)} kernels slower than run {baseline.id}; "
                              f"worst {worst_kernel.kernel} {worst_kernel.param_dtype} n={worst_kernel.size}: "
                              f"x{worst_kernel.ratio:.3f} ({worst_kernel.ratio_low:.3f}-{worst_kernel.ratio_high:.3f})")
        else:
            faster = sum(k.verdict == "faster" for k in result.kernels)
            result.summary = (f"no kernel slower than run {baseline.id} beyond {SLOWDOWN_THRESHOLD:.0%} "
                              f"({len(judged)} compared" + (f", {faster} faster" if faster else "") + ")")
    return result


def history(*, session: Session, project_id: int, kernel: str, param_dtype: str, size: int,
            environment: str | None = None, limit: int = 200) -> list[dict[str, Any]]:
    """The kernel's median and spread over the project's runs, oldest first (the last `limit`)."""
    query = (select(KernelSpeed, Run, Commit).join(Run, Run.id == KernelSpeed.run_id)
             .outerjoin(Commit, Commit.id == Run.commit_id)
             .where(Run.project_id == project_id, KernelSpeed.kernel == kernel,
                    KernelSpeed.param_dtype == param_dtype, KernelSpeed.size == size,
                    KernelSpeed.median_s.is_not(None)))
    if environment:
        query = query.where(Run.environment == environment)
    found = session.execute(query.order_by(Run.created_at.desc(), Run.id.desc()).limit(limit)).all()
    return [{"run_id": run.id, "sha": commit.sha if commit else None, "kind": run.kind,
             "environment": run.environment, "created_at": run.created_at.isoformat(),
             "median_s": speed.median_s, "spread_s": speed.spread_s, "copy_fraction": speed.copy_fraction,
             "device": speed.device}
            for speed, run, commit in reversed(found)]


def kernels_of_project(*, session: Session, project_id: int) -> list[tuple[str, str, int]]:
    """Every (kernel, dtype, size) the project's runs have timed (failed timings left out), for
    the history page's index."""
    found = session.execute(select(KernelSpeed.kernel, KernelSpeed.param_dtype, KernelSpeed.size)
                            .join(Run, Run.id == KernelSpeed.run_id)
                            .where(Run.project_id == project_id, KernelSpeed.median_s.is_not(None))
                            .distinct()).all()
    return sorted((k, d, s) for k, d, s in found)


def verdicts_for_runs(*, session: Session, run_ids: list[int]) -> dict[int, str]:
    """Run id -> speed verdict for those of `run_ids` that have timings (the commit list's speed
    column; an untimed run is absent)."""
    timed = list(session.scalars(select(Run).where(
        Run.id.in_(select(KernelSpeed.run_id).where(KernelSpeed.run_id.in_(run_ids)).distinct()))))
    return {run.id: run_speed(session=session, run=run).verdict for run in timed}
