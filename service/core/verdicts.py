"""Compare a commit's run with its baseline's: per-case and run verdicts (no torch here).

Per case:
  broken     the commit's case crashed / hung / errored, or produced NaN/Inf where the baseline
             did not (or, with no baseline, at all);
  new        no baseline result for this case;
  unchanged  every per-step digest equal (parameters and states bit for bit);
  changed    otherwise: the first step whose digest differs, the per-step max |commit - baseline|
             (from the co-run, when available), and the direction: closer / farther / same to the
             float64 reference, judged over the steps where the two differ by the peak and the mean
             per-step distance (a move within rounding at the parameter's precision is "same": the
             smaller same-precision distance, and for float16/bfloat16 anything within a factor
             of 2). The final-step judgement is kept beside it (final_direction), since a change can
             wander off the reference and come back by the last step.
  not_applicable   the adapter cannot run the case on this device: listed, not judged;
  nondeterministic repeats of the case on the same build differ from its first run.
Sizes (how far a change moved the trajectories) are reported per kernel family and parameter dtype
(`change_size_by_scale`), never as one figure across them: an 8-bit case's distance to float64 is
its states' quantization error, ~1e4 times an fp32 case's by design.
Run: broken if a case is broken (or the build failed), else nondeterministic if a case does not
reproduce itself, else no-baseline when there is nothing to compare with, else changed if a case
changed, else unchanged.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from service.core.results import CaseComparison, CaseResult, RunComparison, RunResult

# Reference distances (final, peak or mean) within this relative margin of each other are "same": a one-ulp
# change moves the distance by far less, a real algorithmic change (the decay ordering) by a factor.
DIRECTION_RELATIVE_MARGIN = 0.01
# At 16-bit precision the final distance to float64 is the parameters' own rounding (a max over
# elements of fractions of an ulp), which moves by tens of percent when any bit does (measured on
# the quick battery's decay reorder: fp16 distances 2.31e-2 -> 2.13e-2 and 2.25e-2 -> 2.08e-2,
# their same-precision reference non-finite); only a change of the distance's order says anything
# there: within a factor of 2 is "same".
DIRECTION_RELATIVE_MARGIN_16BIT = 1.0
_MARGIN_BY_DTYPE = {"float16": DIRECTION_RELATIVE_MARGIN_16BIT, "bfloat16": DIRECTION_RELATIVE_MARGIN_16BIT}


def direction(commit_distance: float, baseline_distance: float, rounding_floor: float = 0.0,
              relative_margin: float = DIRECTION_RELATIVE_MARGIN) -> str:
    """closer / farther / same: a distance of the commit to the float64 reference (final, peak or
    mean over steps) against the baseline's same figure. A move must exceed the relative margin (a factor of 1 + margin either way) and
    `rounding_floor`, the size of a difference that rounding at the parameter's precision
    explains on its own (compare_case takes it from the same-precision distances)."""
    if abs(commit_distance - baseline_distance) <= rounding_floor:
        return "same"
    if commit_distance * (1.0 + relative_margin) < baseline_distance:
        return "closer"
    if commit_distance > baseline_distance * (1.0 + relative_margin):
        return "farther"
    return "same"


def _final(values: list[float]) -> float:
    return values[-1]


def _peak(values: list[float]) -> float:
    # NaN anywhere makes the peak NaN (max() would keep or drop it depending on its position).
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def _mean(values: list[float]) -> float:
    return math.fsum(values) / len(values)


def rounding_floor(commit: CaseResult, baseline: CaseResult, reduce=_final, start: int = 0) -> float:  # noqa: ANN001
    """The smaller same-precision distance (|kernel − torch at the parameter's precision|) of the
    two runs, reduced over steps `start:` like the distances it is a band for (final step, peak or
    mean): how far apart two correct implementations land from rounding alone. The smaller one, so
    a side made far from torch by a real defect does not widen the band; non-finite values (a
    float16 torch.optim Adam reference divides 0 by 0 where eps rounds to 0) say nothing and are
    left out."""
    reduced = [reduce(r.trajectory.same_precision_max_abs[start:]) for r in (commit, baseline)
               if r.trajectory is not None and (r.trajectory.same_precision_max_abs or [])[start:]]
    finite = [x for x in reduced if math.isfinite(x)]
    return min(finite) if finite else 0.0


def trajectory_direction(peak: str, mean: str) -> str:
    """One direction from the peak's and the mean's. Farther when either is: a change that takes
    the parameters farther from float64 at their worst or on average is the one a maintainer must
    see, even if the other measure improved; closer when either is and neither is farther."""
    if "farther" in (peak, mean):
        return "farther"
    if "closer" in (peak, mean):
        return "closer"
    return "same"


def _first_nonfinite_step(result: CaseResult) -> int | None:
    counts = result.trajectory.nonfinite_count if result.trajectory else []
    return next((i + 1 for i, n in enumerate(counts) if n), None)


def digest_scheme(digest: str) -> str:
    """The scheme of a stored digest: its "name:" prefix (worker/digest.py, e.g. od2), or
    blake2b-128 for the first digests, which had none. Digests of two schemes never compare."""
    head, sep, _ = digest.partition(":")
    return head if sep else "blake2b-128"


def first_divergent_step(commit_digests: list[str], baseline_digests: list[str]) -> int | None:
    for index, (a, b) in enumerate(zip(commit_digests, baseline_digests)):
        if a != b:
            return index + 1
    if len(commit_digests) != len(baseline_digests):
        return min(len(commit_digests), len(baseline_digests)) + 1
    return None


def compare_case(commit: CaseResult, baseline: CaseResult | None,
                 max_abs_diff_per_step: list[float] | None = None) -> CaseComparison:
    base = {"case_id": commit.case.case_id, "optimizer": commit.case.optimizer, "family": commit.case.family,
            "param_dtype": commit.case.param_dtype}
    if commit.status == "not_applicable":
        return CaseComparison(**base, verdict="not_applicable", message=commit.message)
    if commit.status == "broken":
        return CaseComparison(**base, verdict="broken", message=commit.message)
    if commit.repeat_check is not None and commit.repeat_check.differing:
        check = commit.repeat_check
        return CaseComparison(**base, verdict="nondeterministic", repeat_check=check,
                              first_divergent_step=check.first_divergent_step,
                              message=f"{check.differing} of {check.runs - 1} repeats on the same build differ "
                                      f"from the first run, from step {check.first_divergent_step}")
    nonfinite_step = _first_nonfinite_step(commit)
    if nonfinite_step is not None and (baseline is None or baseline.status != "ok"
                                       or _first_nonfinite_step(baseline) is None):
        return CaseComparison(**base, verdict="broken", first_divergent_step=nonfinite_step,
                              message=f"NaN/Inf in parameters or states from step {nonfinite_step}")
    commit_distance = commit.trajectory.ref64_max_abs[-1]
    if baseline is None:
        return CaseComparison(**base, verdict="new", commit_final_ref64_distance=commit_distance)
    if baseline.status == "not_applicable":
        # The baseline could not run it (a kernel added since): nothing to compare with, not a change.
        return CaseComparison(**base, verdict="new", commit_final_ref64_distance=commit_distance,
                              message=f"not applicable in the baseline: {baseline.message}")
    if baseline.status != "ok":
        return CaseComparison(**base, verdict="changed", first_divergent_step=1,
                              commit_final_ref64_distance=commit_distance,
                              message=f"baseline was broken: {baseline.message}")
    schemes = {digest_scheme(d) for d in commit.trajectory.digests[:1] + baseline.trajectory.digests[:1]}
    if len(schemes) > 1:
        # Different digest definitions say nothing about the bits: not comparable, like no baseline.
        return CaseComparison(**base, verdict="new", commit_final_ref64_distance=commit_distance,
                              message=f"baseline digests use another scheme ({' vs '.join(sorted(schemes))}); "
                                      "re-run the baseline to compare")
    step = first_divergent_step(commit.trajectory.digests, baseline.trajectory.digests)
    if step is None:
        return CaseComparison(**base, verdict="unchanged")
    return CaseComparison(**base, verdict="changed", first_divergent_step=step,
                          max_abs_diff_per_step=max_abs_diff_per_step, **_directions(commit, baseline, step))


def _directions(commit: CaseResult, baseline: CaseResult, step: int) -> dict:
    """The distances to the float64 reference of both runs and the directions they give: at the
    final step, and at the peak and the mean over the steps from the first divergent one (before
    it the two are bit-identical, so their distances are equal and would only dilute the mean)."""
    margin = _MARGIN_BY_DTYPE.get(commit.case.param_dtype, DIRECTION_RELATIVE_MARGIN)
    ours, theirs = commit.trajectory.ref64_max_abs, baseline.trajectory.ref64_max_abs
    shared = min(len(ours), len(theirs))
    start = step - 1 if step <= shared else 0  # diverged only in length: judge the whole of both

    def judge(reduce) -> tuple[float, float, str]:  # noqa: ANN001
        mine, base = reduce(ours[start:shared]), reduce(theirs[start:shared])
        return mine, base, direction(mine, base, rounding_floor(commit, baseline, reduce, start), margin)

    commit_final, baseline_final = ours[-1], theirs[-1]
    final = direction(commit_final, baseline_final, rounding_floor(commit, baseline), margin)
    commit_peak, baseline_peak, peak = judge(_peak)
    commit_mean, baseline_mean, mean = judge(_mean)
    return {"commit_final_ref64_distance": commit_final, "baseline_final_ref64_distance": baseline_final,
            "commit_peak_ref64_distance": commit_peak, "baseline_peak_ref64_distance": baseline_peak,
            "commit_mean_ref64_distance": commit_mean, "baseline_mean_ref64_distance": baseline_mean,
            "direction": trajectory_direction(peak, mean), "final_direction": final}


def compare_runs(commit: RunResult, baseline: RunResult | None,
                 diffs: dict[str, list[float]] | None = None) -> RunComparison:
    """The verdict of `commit` against `baseline` (None: no-baseline). `diffs` maps case ids to the
    per-step max |commit - baseline| from a co-run."""
    diffs = diffs or {}
    head = {"battery_digest": commit.battery_digest, "commit_build_digest": commit.build_digest,
            "baseline_build_digest": baseline.build_digest if baseline else None}
    if not commit.build_ok:
        first_lines = "\n".join((commit.build_error or "unknown build error").strip().splitlines()[-15:])
        return RunComparison(verdict="broken", summary=f"BROKEN: the source does not build:\n{first_lines}", **head)

    baseline_cases = {c.case.case_id: c for c in baseline.cases} if baseline else {}
    cases = [compare_case(c, baseline_cases.get(c.case.case_id), diffs.get(c.case.case_id)) for c in commit.cases]
    counts = Counter(c.verdict for c in cases)
    # not_applicable cases are listed and counted, never part of the verdict.
    if counts["broken"]:
        verdict = "broken"
    elif counts["nondeterministic"]:
        verdict = "nondeterministic"
    elif baseline is None:
        verdict = "no-baseline"
    elif counts["changed"]:
        verdict = "changed"
    else:
        verdict = "unchanged"
    comparison = RunComparison(verdict=verdict, counts=dict(counts), cases=cases,
                               summary=summarize(verdict, cases, commit, baseline), **head)
    return comparison


def _listed(items: list[str], shown: int = 3) -> str:
    return "; ".join(items[:shown]) + (f" (+{len(items) - shown} more)" if len(items) > shown else "")


def _cases(count: int) -> str:
    return f"{count} case" + ("" if count == 1 else "s")


def _first_line(text: str | None) -> str:
    return text.splitlines()[0] if text else ""


def summarize(verdict: str, cases: list[CaseComparison], commit: RunResult, baseline: RunResult | None) -> str:
    total = len(cases)
    counts = Counter(c.verdict for c in cases)
    lines = [f"{verdict.upper()}: " + ", ".join(f"{n} {v}" for v, n in sorted(counts.items())) + f" of {total} cases"]
    if baseline is not None and baseline.battery_digest != commit.battery_digest:
        lines.append("warning: the baseline ran a different battery; only shared case ids are compared")
    broken = [c for c in cases if c.verdict == "broken"]
    if broken:
        lines.append("broken: " + _listed([f"{c.case_id}: {_first_line(c.message)}" for c in broken]))
    unsteady = [c for c in cases if c.verdict == "nondeterministic"]
    if unsteady:
        lines.append("nondeterministic (repeats on the same build differ; not a change against the baseline): "
                     + _listed([f"{c.case_id}: {c.repeat_check.differing} of {c.repeat_check.runs - 1} repeats "
                                f"differ from step {c.repeat_check.first_divergent_step}" for c in unsteady]))
    not_applicable = [c for c in cases if c.verdict == "not_applicable"]
    if not_applicable:
        # Grouped by reason: an adapter gives one reason for a whole family of cases (no bf16 kernel).
        reasons = Counter(_first_line(c.message) or "no reason given" for c in not_applicable)
        lines.append(f"not applicable on this device, not judged: {_cases(len(not_applicable))} — "
                     + _listed([f"{reason} ({n})" for reason, n in reasons.most_common()]))
    changed = [c for c in cases if c.verdict == "changed"]
    if changed:
        by_optimizer = Counter(c.optimizer for c in changed)
        lines.append("changed: " + ", ".join(f"{o} {n}" for o, n in sorted(by_optimizer.items())))
        steps = Counter(c.first_divergent_step for c in changed)
        lines.append("first divergent step: " + ", ".join(f"step {s} ({n} cases)" for s, n in sorted(steps.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))[:4]))
        groups = change_size_by_scale(changed)
        if groups:
            lines.append("size, per family and dtype (each in its own scale, never compared across them):")
            lines += [f"  {group.text}" for group in groups]
        directions = Counter(c.direction for c in changed if c.direction)
        ratios = [(c.commit_final_ref64_distance / c.baseline_final_ref64_distance, c.case_id) for c in changed
                  if c.commit_final_ref64_distance is not None and c.baseline_final_ref64_distance]
        # service.domain.dashboard_queries.direction_counts reads the counts before the parenthesis.
        text = "vs float64 reference: " + ", ".join(f"{n} {d}" for d, n in sorted(directions.items()))
        text += " (peak and mean distance over the steps that differ"
        if ratios:
            low, high = min(ratios), max(ratios)
            text += f"; final distance commit/baseline from {low[0]:.3g}x to {high[0]:.3g}x"
        lines.append(text + ")")
        disagreeing = [c for c in changed if c.final_direction and c.direction != c.final_direction]
        if disagreeing:
            lines.append(f"final step alone reads otherwise for {_cases(len(disagreeing))}: " + _listed([
                f"{c.case_id}: {c.direction} over the trajectory (peak {c.baseline_peak_ref64_distance:.3e} -> "
                f"{c.commit_peak_ref64_distance:.3e}), {c.final_direction} at the final step "
                f"({c.baseline_final_ref64_distance:.3e} -> {c.commit_final_ref64_distance:.3e})"
                for c in disagreeing]))
    return "\n".join(lines)


# Families whose states are quantized: their distance to float64 is the quantization error, by design.
QUANTIZED_FAMILY_PREFIX = "8bit"
# A group whose every case's peak distance to float64 moved by less than this factor either way has
# not changed in scale (what an 8-bit case's quantization-sized distance can say).
SAME_SCALE_FACTOR = 2.0
_DTYPE_BY_SHORT = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
_FAMILIES = ("32bit", "8bit_blockwise")


def case_scale(case: Mapping[str, Any]) -> tuple[str, str]:
    """(family, param dtype) of a verdict's case: recorded on it, or for verdicts stored before they
    were, read from a battery case id (worker/battery.make_case: "optimizer.family.fp32.…");
    ("unknown family", "unknown dtype") when neither says."""
    family, dtype = case.get("family"), case.get("param_dtype")
    if family and dtype:
        return family, dtype
    parts = str(case.get("case_id", "")).split(".")
    if len(parts) > 2 and parts[1] in _FAMILIES and parts[2] in _DTYPE_BY_SHORT:
        return family or parts[1], dtype or _DTYPE_BY_SHORT[parts[2]]
    return family or "unknown family", dtype or "unknown dtype"


def _finite(value: Any) -> float | None:  # noqa: ANN401
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _sci(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


@dataclass(frozen=True)
class ScaleGroup:
    """The changed cases of one (kernel family, parameter dtype): one scale, so one figure."""

    family: str
    dtype: str
    cases: int
    baseline_peak: float | None     # the group's largest peak distance to float64, before (baseline)
    commit_peak: float | None       # ... and after (commit)
    ratio_low: float | None         # per case: commit's peak distance / baseline's, smallest and largest
    ratio_high: float | None
    largest_diff: float | None      # the group's largest per-step |commit − baseline| (after the co-run)
    directions: tuple[tuple[str, int], ...]

    @property
    def label(self) -> str:
        return f"{self.family} {self.dtype}"

    @property
    def quantized(self) -> bool:
        return self.family.startswith(QUANTIZED_FAMILY_PREFIX)

    @property
    def same_scale(self) -> bool:
        return (self.ratio_low is not None and self.ratio_high is not None
                and 1 / SAME_SCALE_FACTOR <= self.ratio_low and self.ratio_high <= SAME_SCALE_FACTOR)

    @property
    def distance_text(self) -> str:
        """'9.00e-06 → 1.30e-02' (the group's peak distance to float64, before → after)."""
        if self.baseline_peak is None and self.commit_peak is None:
            return "-"
        return f"{_sci(self.baseline_peak)} → {_sci(self.commit_peak)}"

    @property
    def scale_text(self) -> str:
        """The move in the cases' own scale: 'unchanged in scale (×0.99)' or '×1.4e+03'."""
        if self.ratio_low is None or self.ratio_high is None:
            return "no distance to compare"
        spread = (f"×{self.ratio_low:.3g}" if f"{self.ratio_low:.3g}" == f"{self.ratio_high:.3g}"
                  else f"×{self.ratio_low:.3g} to ×{self.ratio_high:.3g} per case")
        return f"unchanged in scale ({spread})" if self.same_scale else spread

    @property
    def text(self) -> str:
        """One line: '32bit float32 (12 cases): peak distance to float64 9.00e-06 → 1.30e-02, ×1.44e+03
        (12 farther); largest |commit - baseline| 1.25e-02'."""
        moves = ", ".join(f"{n} {d}" for d, n in self.directions)
        text = (f"{self.label} ({_cases(self.cases)}): peak distance to float64 {self.distance_text}, "
                f"{self.scale_text}" + (f" ({moves})" if moves else ""))
        if self.largest_diff is not None:
            text += f"; largest |commit - baseline| {self.largest_diff:.2e}"
        if self.quantized:
            text += ("; with 8-bit states this distance is their quantization error, large by design: "
                     "only its change in scale says something")
        return text


def change_size_by_scale(cases: Iterable[CaseComparison | Mapping[str, Any]]) -> list[ScaleGroup]:
    """The size of a change per (kernel family, parameter dtype) over its changed cases, in a stable
    order: each group's figures are taken within it and never across groups (an 8-bit case's distance
    to float64 is its quantization error, ~1e4 times an fp32 case's, so a max across them names the
    8-bit figure whatever the fp32 cases did). Takes CaseComparison objects (the worker) or their JSON
    (the API's verdict detail: the CLI)."""
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for case in cases:
        row = case.model_dump() if isinstance(case, CaseComparison) else case
        if row.get("verdict") == "changed":
            groups.setdefault(case_scale(row), []).append(row)
    result = []
    for (family, dtype), rows in sorted(groups.items()):
        before = [v for row in rows if (v := _finite(row.get("baseline_peak_ref64_distance"))) is not None]
        after = [v for row in rows if (v := _finite(row.get("commit_peak_ref64_distance"))) is not None]
        ratios = [a / b for row in rows
                  if (b := _finite(row.get("baseline_peak_ref64_distance")))
                  and (a := _finite(row.get("commit_peak_ref64_distance"))) is not None]
        diffs = [d for row in rows for d in (_finite(v) for v in row.get("max_abs_diff_per_step") or [])
                 if d is not None]
        directions = Counter(row.get("direction") for row in rows if row.get("direction"))
        result.append(ScaleGroup(
            family=family, dtype=dtype, cases=len(rows), baseline_peak=max(before) if before else None,
            commit_peak=max(after) if after else None, ratio_low=min(ratios) if ratios else None,
            ratio_high=max(ratios) if ratios else None, largest_diff=max(diffs) if diffs else None,
            directions=tuple(sorted(directions.items()))))
    return result
