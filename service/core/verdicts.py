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
             A quantized family's case (service.core.families) with its states' distance to the
             quantization-aware float64 reference recorded (Trajectory.quant_ref_steps) is judged on
             that, in quantization steps, a move under QUANT_STEP_MARGIN being "same"; one without
             the figures on both sides (an adapter that names no codec, an optimizer the figure is
             not measured for, a result stored before) has no direction, and its message says so:
             its distance to float64 is its quantization error, not a commit's move.
  not_applicable   the adapter cannot run the case on this device: listed, not judged;
  nondeterministic repeats of the case on the same build differ from its first run.
Reference changed: where both runs recorded a digest of a case's references (torch, torch.optim's
code, ours: worker/references/digest.py) and the two differ, the case is marked reference_changed:
its verdict stands (kernel against kernel), its direction is not judged (each run's distance was
measured to its own reference), and the summary says so apart from the commit's changes.
Sizes (how far a change moved the trajectories) are reported per kernel family and parameter dtype
(`change_size_by_scale`), never as one figure across them: an 8-bit case's distance to float64 is
its states' quantization error, ~1e4 times an fp32 case's by design.
Run: broken if a case is broken (or the build failed), else nondeterministic if a case does not
reproduce itself and its baseline build does (or was not repeated: docs/ENGINE.md, Nondeterminism),
else no-baseline when there is nothing to compare with, else changed if a case
changed, else unchanged.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from service.core import wording
from service.core.families import FAMILIES, QUANTIZED
from service.core.results import (
    CaseComparison, CaseResult, ComparisonFigures, RunComparison, RunResult, ScaleGroup, TensorComparison,
)

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
# Quantized families (service.core.families.QUANTIZED) are judged on their states' distance to the
# quantization-aware float64 reference in quantization steps (Trajectory.quant_ref_steps): a correct
# implementation differs from it only at code boundaries (mean 0.002-0.004 steps on the low-bit
# fixture, tests/worker/references/test_quant_direction.py), a biased rounding by ~half a step on every
# element (rounding down: 0.4-0.8). A move of less than a quarter of a step is "same".
QUANT_STEP_MARGIN = 0.25
QUANT_DIRECTION_WITHHELD = ("direction not judged: the states are quantized, so the distance to float64 is "
                            "their quantization error, and {missing} recorded no distance to the "
                            "quantization-aware float64 reference (quant_ref_steps) to judge it on")


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
    """The scheme of a stored digest: its "name:" prefix (worker/engine/digest.py, e.g. od2), or
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
                              nondeterminism=check.origin, first_divergent_step=check.first_divergent_step,
                              message=wording.nondeterministic_case(check))
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
    figures = _directions(commit, baseline, step)
    tensors = tensor_comparisons(commit, baseline)
    if tensors and not figures.get("message"):
        figures["message"] = wording.tensor_summary(tensors, step)
    return CaseComparison(**base, verdict="changed", first_divergent_step=step,
                          max_abs_diff_per_step=max_abs_diff_per_step, **figures, tensors=tensors)


def tensor_comparisons(commit: CaseResult, baseline: CaseResult) -> list[TensorComparison] | None:
    """A changed layout case's tensors compared one by one (and its guard elements last): each
    one's first divergent step from its own digests, and where both runs measured them, its peak
    distance to float64 and direction over its differing steps (the case's margins and rounding
    floor). None where either run has no per-tensor digests (not a layout case, or stored before)."""
    ours, theirs = commit.trajectory.tensor_digests, baseline.trajectory.tensor_digests
    if not ours or not theirs or len(ours[0]) != len(theirs[0]):
        return None
    slots = commit.case.tensor_slots()
    distances = (commit.trajectory.tensor_ref64_max_abs, baseline.trajectory.tensor_ref64_max_abs)
    margin = _MARGIN_BY_DTYPE.get(commit.case.param_dtype, DIRECTION_RELATIVE_MARGIN)
    rows = []
    for column in range(len(ours[0])):
        slot = slots[column] if column < len(slots) else None
        step = first_divergent_step([row[column] for row in ours], [row[column] for row in theirs])
        row = {"index": slot.index if slot else None, "group": slot.group if slot else None,
               "size": slot.size if slot else commit.case.size - sum(s.size for s in slots),
               "first_divergent_step": step}
        if step is not None and slot is not None and all(distances):
            mine = [values[column] for values in distances[0]]
            base = [values[column] for values in distances[1]]
            shared = min(len(mine), len(base))
            start = step - 1 if step <= shared else 0
            floor_peak = rounding_floor(commit, baseline, _peak, start)
            floor_mean = rounding_floor(commit, baseline, _mean, start)
            peak = direction(_peak(mine[start:shared]), _peak(base[start:shared]), floor_peak, margin)
            mean = direction(_mean(mine[start:shared]), _mean(base[start:shared]), floor_mean, margin)
            row.update(commit_peak_ref64_distance=_peak(mine[start:shared]),
                       baseline_peak_ref64_distance=_peak(base[start:shared]),
                       direction=trajectory_direction(peak, mean))
        rows.append(TensorComparison(**row))
    return rows


def _directions(commit: CaseResult, baseline: CaseResult, step: int) -> dict:
    """The distances to the float64 reference of both runs and the directions they give: at the
    final step, and at the peak and the mean over the steps from the first divergent one (before
    it the two are bit-identical, so their distances are equal and would only dilute the mean)."""
    margin = _MARGIN_BY_DTYPE.get(commit.case.param_dtype, DIRECTION_RELATIVE_MARGIN)
    ours, theirs = commit.trajectory.ref64_max_abs, baseline.trajectory.ref64_max_abs
    quantized = _quant_directions(commit, baseline, step)
    if commit.case.family in QUANTIZED and not quantized:
        missing = " and ".join(side for side, result in (("the commit", commit), ("the baseline", baseline))
                               if not result.trajectory.quant_ref_steps)
        quantized = {"direction": None, "final_direction": None,
                     "message": QUANT_DIRECTION_WITHHELD.format(missing=missing)}
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
            "direction": trajectory_direction(peak, mean), "final_direction": final, **quantized}


def _quant_directions(commit: CaseResult, baseline: CaseResult, step: int) -> dict:
    """A quantized case with quant_ref_steps on both sides: its directions (final, and over the
    differing steps by peak and mean) against the quantization-aware float64 reference, since its
    distance to torch.optim in float64 is its quantization error and says nothing of a commit's
    move: the states in quantization steps (a move under QUANT_STEP_MARGIN is "same") and, where
    recorded, the parameters' distance to that reference (margins as for the float64 one); farther
    when either is. Anything else: nothing (the parameters' distances to float64 judge it)."""
    ours, theirs = commit.trajectory.quant_ref_steps, baseline.trajectory.quant_ref_steps
    if commit.case.family not in QUANTIZED or not ours or not theirs:
        return {}
    shared = min(len(ours), len(theirs))
    start = step - 1 if step <= shared else 0

    def judge(reduce) -> tuple[float, float, str]:  # noqa: ANN001
        mine, base = reduce(ours[start:shared]), reduce(theirs[start:shared])
        return mine, base, direction(mine, base, QUANT_STEP_MARGIN)

    commit_peak, baseline_peak, peak = judge(_peak)
    mean = judge(_mean)[2]
    final = direction(ours[-1], theirs[-1], QUANT_STEP_MARGIN)
    params_ours, params_theirs = commit.trajectory.quant_ref_max_abs, baseline.trajectory.quant_ref_max_abs
    if params_ours and params_theirs and len(params_ours) == len(ours) and len(params_theirs) == len(theirs):
        # A change of the parameter's update alone (the decay order) leaves the states where they
        # were: the parameters' distance to the same reference judges it, as for fp32 cases.
        # No same-precision floor: torch.optim's distance is the quantization error here, which
        # would hide any move; the relative margin alone (1 %, or 2x at 16 bits).
        margin = _MARGIN_BY_DTYPE.get(commit.case.param_dtype, DIRECTION_RELATIVE_MARGIN)
        param_peak = direction(_peak(params_ours[start:shared]), _peak(params_theirs[start:shared]), 0.0, margin)
        param_mean = direction(_mean(params_ours[start:shared]), _mean(params_theirs[start:shared]), 0.0, margin)
        peak, mean = trajectory_direction(peak, param_peak), trajectory_direction(mean, param_mean)
        final = trajectory_direction(final, direction(params_ours[-1], params_theirs[-1], 0.0, margin))
    return {"commit_peak_quant_steps": commit_peak, "baseline_peak_quant_steps": baseline_peak,
            "direction": trajectory_direction(peak, mean), "final_direction": final}


def reference_moved(case: CaseComparison, commit_digests: Mapping[str, str],
                    baseline_digests: Mapping[str, str]) -> CaseComparison:
    """The case as compared, marked reference_changed when both runs recorded its references'
    digest and the two differ (torch or torch.optim changed between them). Its verdict stays: it
    compares the kernels' own trajectories, which no reference enters. Its directions go: each
    run's distance was measured to its own reference, so the two distances are not comparable."""
    ours, theirs = commit_digests.get(case.case_id), baseline_digests.get(case.case_id)
    if ours is None or theirs is None or ours == theirs or case.verdict in ("not_applicable", "broken"):
        return case
    return case.model_copy(update={"reference_changed": True, "direction": None, "final_direction": None})


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
    if baseline is not None:
        cases = [reference_moved(case, commit.reference_digests, baseline.reference_digests) for case in cases]
    counts = Counter(c.verdict for c in cases)
    # not_applicable cases are listed and counted, never part of the verdict.
    if counts["broken"]:
        verdict = "broken"
    elif any(c.verdict == "nondeterministic" and c.nondeterminism != "pre-existing" for c in cases):
        # Introduced by this commit, or not blamed (no baseline build to repeat): the run's finding.
        # A case nondeterministic in the baseline too is shown, not blamed: the other cases judge.
        verdict = "nondeterministic"
    elif baseline is None:
        verdict = "no-baseline"
    elif counts["changed"]:
        verdict = "changed"
    else:
        verdict = "unchanged"
    figured = figures(cases)
    other_battery = baseline is not None and baseline.battery_digest != commit.battery_digest
    return RunComparison(verdict=verdict, counts=dict(counts), cases=cases, figures=figured,
                         summary=wording.summary(verdict, cases, figured, other_battery=other_battery), **head)


_DTYPE_BY_SHORT = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def case_scale(case: Mapping[str, Any]) -> tuple[str, str]:
    """(family, param dtype) of a verdict's case: recorded on it, or for verdicts stored before they
    were, read from a battery case id (worker/battery.make_case: "optimizer.family.fp32.…");
    ("unknown family", "unknown dtype") when neither says."""
    family, dtype = case.get("family"), case.get("param_dtype")
    if family and dtype:
        return family, dtype
    parts = str(case.get("case_id", "")).split(".")
    if len(parts) > 2 and parts[1] in FAMILIES and parts[2] in _DTYPE_BY_SHORT:
        return family or parts[1], dtype or _DTYPE_BY_SHORT[parts[2]]
    return family or "unknown family", dtype or "unknown dtype"


def _finite(value: Any) -> float | None:  # noqa: ANN401
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


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
        ratios = [a / b for row in rows if not row.get("reference_changed")  # distances to two references
                  if (b := _finite(row.get("baseline_peak_ref64_distance")))
                  and (a := _finite(row.get("commit_peak_ref64_distance"))) is not None]
        diffs = [d for row in rows for d in (_finite(v) for v in row.get("max_abs_diff_per_step") or [])
                 if d is not None]
        directions = Counter(row.get("direction") for row in rows if row.get("direction"))
        result.append(ScaleGroup(
            family=family, dtype=dtype, cases=len(rows), baseline_peak=max(before) if before else None,
            commit_peak=max(after) if after else None, ratio_low=min(ratios) if ratios else None,
            ratio_high=max(ratios) if ratios else None, largest_diff=max(diffs) if diffs else None,
            directions=dict(sorted(directions.items()))))
    return result


def _rows(cases: Iterable[CaseComparison | Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [case.model_dump() if isinstance(case, CaseComparison) else case for case in cases]


def figures(cases: Iterable[CaseComparison | Mapping[str, Any]]) -> ComparisonFigures:
    """Every figure the surfaces show about a comparison, from its cases (CaseComparison objects or
    their stored JSON): counts, directions, first steps, final-distance ratios, sizes per scale."""
    rows = _rows(cases)
    changed = [row for row in rows if row.get("verdict") == "changed"]
    directions = Counter(row.get("direction") for row in changed if row.get("direction"))
    steps = Counter(step for row in changed if (step := row.get("first_divergent_step")))
    ratios = [a / b for row in changed if not row.get("reference_changed")  # distances to two references
              if (b := _finite(row.get("baseline_final_ref64_distance")))
              and (a := _finite(row.get("commit_final_ref64_distance"))) is not None]
    return ComparisonFigures(
        judged=sum(1 for row in rows if row.get("verdict") != "not_applicable"), changed=len(changed),
        unchanged=sum(1 for row in rows if row.get("verdict") == "unchanged"),
        directions={name: directions.get(name, 0) for name in ("closer", "farther", "same")},
        final_disagreeing=sum(1 for row in changed if row.get("final_direction")
                              and row.get("final_direction") != row.get("direction")),
        first_divergent_step=min(steps) if steps else None, first_steps=dict(sorted(steps.items())),
        final_ratio_low=min(ratios) if ratios else None, final_ratio_high=max(ratios) if ratios else None,
        scales=change_size_by_scale(changed),
        nondeterministic_introduced=sum(1 for row in rows if row.get("nondeterminism") == "introduced"),
        nondeterministic_pre_existing=sum(1 for row in rows if row.get("nondeterminism") == "pre-existing"),
        reference_changed=sum(1 for row in rows if row.get("reference_changed")))


def figures_of(detail: Mapping[str, Any] | None) -> ComparisonFigures:
    """The figures of a stored verdict (its `detail`, RunComparison's JSON): the stored field, or
    for verdicts stored before it was, derived from the stored cases the same way."""
    stored = (detail or {}).get("figures")
    if stored:
        return ComparisonFigures.model_validate(stored)
    return figures((detail or {}).get("cases", []))
