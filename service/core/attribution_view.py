"""The attribution of changed cases (worker/attribution, stored as verdict.detail["attribution"]) in
words, for the CLI, the API, the dashboard and `optdrift check`; numbers through service.core.wording.

A change is shown relative to the case's own scale: in ulps of the parameter (the largest |p| the
element has had) at the first divergent step and at its peak, and relative to the baseline's own
distance to the float64 reference. The headline ranks cases by those, never by absolute |Δ|, so an
8-bit case whose distance is the documented quantization error does not lead it.

What differs between the commit's build and the baseline's (detail["build_change"]: flags,
defines, compilers; service/core/environment_attribution.build_change) is named in the headline
and beside every rounding-level or unexplained case: a change of flags is what such a change most
often is. A matched transition (the baseline follows a catalogued variant, the commit the
algorithm or another setting) reads as its label, a revert as "reverts: ...".
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from service.core.wording import number, ratio, size


@dataclass(frozen=True)
class CaseAttribution:
    case_id: str
    kind: str                         # "semantic" | "precision" | "rounding-level" | "quantization" | "unknown"
    looks_like: str | None            # the variant's label, "unexplained", or None
    variant: str | None
    first_step_ulps: float | None     # scale ulps at the first divergent step
    peak_ulps: float | None
    change_vs_baseline_distance: float | None
    residual_ulps: float | None
    distance_to_variant: float | None
    distance_to_reference: float | None
    next_best: str | None
    next_best_ratio: float | None
    note: str | None
    reverts: str | None = None            # the catalogued variant the baseline followed and the commit no longer does
    baseline_variant: str | None = None   # the variant the baseline follows (a matched transition)
    build_change: str | None = None       # "build flags changed: + ..., - ..." (the run's, beside every case)

    @property
    def text(self) -> str:
        """One line: "semantic: weight decay applied after the update (6.3 ulp from it, next best 5e+04x)"."""
        if self.kind == "unknown":
            return f"not attributed: {self.note}" if self.note else "not attributed"
        if self.kind == "rounding-level":
            return _with_build(f"rounding-level: {_ulps(self.first_step_ulps)} at the first divergent step, "
                               f"{_ulps(self.peak_ulps)} at most", self.build_change)
        if self.kind == "quantization":
            return f"quantization: {self.note}" if self.note else "quantization"
        if self.variant is None:
            return _with_build(f"semantic, unexplained: {_ulps(self.peak_ulps)}; no catalogued variant fits",
                               self.build_change)
        if self.variant == "reference":  # a revert: the commit follows the algorithm itself
            text = f"{self.kind}: {self.looks_like} — {_number(self.distance_to_reference)} from the reference"
        else:
            text = f"{self.kind}: {self.looks_like} — {_number(self.distance_to_variant)} from that variant, " \
                   f"{_number(self.distance_to_reference)} from the reference"
        if self.next_best_ratio is not None and math.isfinite(self.next_best_ratio):
            text += f" (next best {ratio(self.next_best_ratio)} worse)"
        return text


def _with_build(text: str, build_change: str | None) -> str:
    """A rounding-level or unexplained change with the builds' difference beside it: a flag or a
    compiler change is what moves roundings without touching the source."""
    return f"{text}; {build_change}" if build_change else text


def build_change_text(change: dict | None) -> str | None:
    """ "build flags changed: + -march=native -fopenmp -D__AVX512__, - -g; compiler changed: A → B",
    from a verdict's detail["build_change"]; None when the builds were made alike (or unrecorded)."""
    if not isinstance(change, dict):
        return None
    added, removed = change.get("flags_added") or [], change.get("flags_removed") or []
    parts = []
    if added or removed:
        sides = ([f"+ {' '.join(added)}"] if added else []) + ([f"- {' '.join(removed)}"] if removed else [])
        parts.append("build flags changed: " + ", ".join(sides))
    compilers = change.get("compilers")
    if isinstance(compilers, dict):
        parts.append(f"compiler changed: {compilers.get('baseline') or 'unknown'} → {compilers.get('commit') or 'unknown'}")
    return "; ".join(parts) or None


def _number(value: float | None) -> str:
    return number(value, missing="-")


def _ulps(value: float | None) -> str:
    return size(value, "ulp", missing="- ulp")


def _float(value) -> float | None:  # noqa: ANN001
    if value is None:
        return None
    if isinstance(value, str):  # non-finite floats are stored as strings (JSON has none)
        return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}.get(value)
    return float(value)


def case_attribution(case_id: str, stored: dict, build_change: str | None = None) -> CaseAttribution:
    if "error" in stored:
        return CaseAttribution(case_id, "unknown", None, None, None, None, None, None, None, None, None, None,
                               stored["error"], build_change=build_change)
    variant = stored.get("variant")
    kind = stored.get("class") or "unknown"
    return CaseAttribution(
        case_id=case_id, kind=kind, variant=variant,
        looks_like=stored.get("label") if kind in ("semantic", "precision") else None,
        first_step_ulps=_float(stored.get("first_step_ulps")), peak_ulps=_float(stored.get("peak_ulps")),
        change_vs_baseline_distance=_float(stored.get("change_vs_baseline_distance")),
        residual_ulps=_float(stored.get("residual_ulps")), distance_to_variant=_float(stored.get("distance")),
        distance_to_reference=_float(stored.get("reference_distance")), next_best=stored.get("next_best"),
        next_best_ratio=_float(stored.get("next_best_ratio")), note=stored.get("note"),
        reverts=stored.get("reverts"), baseline_variant=stored.get("baseline_variant"), build_change=build_change)


def by_case(detail: dict | None) -> dict[str, CaseAttribution]:
    """case id -> attribution of a verdict's detail; {} before the co-run has added it."""
    stored = (detail or {}).get("attribution") or {}
    if "error" in stored and isinstance(stored["error"], str):
        return {}
    build = build_change_text((detail or {}).get("build_change"))
    return {case_id: case_attribution(case_id, value, build) for case_id, value in stored.items()
            if isinstance(value, dict)}


def attribution_error(detail: dict | None) -> str | None:
    stored = (detail or {}).get("attribution") or {}
    return stored.get("error") if isinstance(stored.get("error"), str) else None


def headline(detail: dict | None) -> str | None:
    """A line for the run: how many changes are semantic (and which variants) or rounding-level,
    and the largest change relative to the case's own scale."""
    cases = by_case(detail)
    if not cases:
        return None
    kinds = Counter(a.kind for a in cases.values())
    parts = []
    for kind in ("semantic", "precision"):
        # A revert's label already says what it is ("reverts: ..."); a variant's reads "looks like".
        named = Counter((a.looks_like, bool(a.reverts)) for a in cases.values() if a.kind == kind and a.variant)
        if named:
            parts.append(f"{kind} — " + "; ".join(f"{label if reverts else f'looks like {label}'} ({n})"
                                                  for (label, reverts), n in named.most_common(3)))
    unexplained = sum(1 for a in cases.values() if a.kind == "semantic" and not a.variant)
    if unexplained:
        parts.append(f"semantic, unexplained ({unexplained})")
    if kinds["quantization"]:
        parts.append(f"quantization ({kinds['quantization']})")
    if kinds["rounding-level"]:
        parts.append(f"rounding-level ({kinds['rounding-level']})")
    if kinds["unknown"]:
        parts.append(f"not attributed ({kinds['unknown']})")
    text = "attribution: " + ", ".join(parts)
    build = build_change_text((detail or {}).get("build_change"))
    if build:
        text += f"; {build}"
    relative = [(a.change_vs_baseline_distance, a.case_id) for a in cases.values()
                if a.change_vs_baseline_distance is not None and math.isfinite(a.change_vs_baseline_distance)]
    if relative:
        largest, where = max(relative)
        text += f"; largest change {ratio(largest)} the baseline's own distance to float64 ({where})"
    return text


def order_by_relative_change(rows: list, detail: dict | None) -> None:
    """Sort changed-case rows (anything with .case_id) in place, largest change relative to the
    baseline's own distance to float64 first, so the page leads with what matters rather than with an
    8-bit case's quantization-sized |Δ|; rows without an attribution keep their order, after."""
    cases = by_case(detail)
    if not cases:
        return

    def key(row) -> float:  # noqa: ANN001
        relative = cases[row.case_id].change_vs_baseline_distance if row.case_id in cases else None
        return -relative if relative is not None and not math.isnan(relative) else math.inf

    rows.sort(key=key)
