"""Server-side figures for the commit / verify page (issue 34 item 1): the headline's figures and
the small multiples above the fold.

The headline's figures are the verdict's stored figures (service.core.verdicts.figures_of), never
parsed back from its sentence. The small multiples are one panel per optimizer · family, each
changed case drawn in its own scale: the one its table row states as "size relative to its scale"."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from service.core.case_names import case_name
from service.core.attribution_view import CaseAttribution
from service.core.families import QUANTIZED
from service.core.results import ComparisonFigures
from service.core.verdicts import figures_of
from service.domain.dashboard_queries import ChangedCase

# Panels above the fold: two rows of four at 1280 px. Groups past these are named under the plot.
MAX_PANELS = 8
# Lines in one panel: past a handful, a small panel is a blur; the rest of the group is in the table.
MAX_LINES_PER_PANEL = 6

ULP, BASELINE_DISTANCE = "ulp", "× baseline's distance to float64"


def headline_figures(run) -> ComparisonFigures | None:  # noqa: ANN001
    """The comparison's figures, or None before the run has a verdict."""
    if run.verdict is None or not run.verdict.detail:
        return None
    return figures_of(run.verdict.detail)


def is_eight_bit(case: ChangedCase) -> bool:
    """A quantized state family's case (service.core.families: 8-bit, 4-bit, FP8, paged)."""
    return case.family in QUANTIZED


@dataclass(frozen=True)
class CaseScale:
    """The unit a case's change is measured in, and the case's size in it: the figure its table row
    shows. `unit` is |Δ| per one of them, so per-step |Δ| / unit draws a curve whose peak is `size`."""

    label: str          # ULP or BASELINE_DISTANCE
    size: float
    unit: float


def case_scale(case: ChangedCase, attribution: CaseAttribution | None) -> CaseScale | None:
    """The table's choice (templates/run.html, column "size relative to its scale"): ulps of the
    parameter for a float case with an attribution; else the change relative to the baseline's own
    distance to float64 (an 8-bit case's distance is its quantization error, so ulps would mislead);
    else max |commit − baseline| / the baseline's peak distance, before the attribution exists.
    None when nothing sizes the case."""
    peak = case.max_abs_diff
    if attribution is not None and attribution.peak_ulps is not None and not is_eight_bit(case):
        return _scale(ULP, attribution.peak_ulps, peak)
    if attribution is not None and attribution.change_vs_baseline_distance is not None:
        return _scale(BASELINE_DISTANCE, attribution.change_vs_baseline_distance, peak)
    if peak is not None and case.baseline_peak:
        return _scale(BASELINE_DISTANCE, peak / case.baseline_peak, peak)
    return None


def _scale(label: str, size: float, peak_abs_diff: float | None) -> CaseScale | None:
    if not _positive(size) or not _positive(peak_abs_diff):
        return CaseScale(label, size, math.nan) if math.isfinite(size) else None
    return CaseScale(label, size, peak_abs_diff / size)


def _positive(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value > 0


@dataclass
class Line:
    case_id: str
    label: str          # the short case name the table shows
    steps: list[int]
    values: list[float | None]  # per-step |Δ| in the case's unit; None where a log axis cannot draw it
    size: float                 # the table's figure (the curve's peak)


@dataclass
class Panel:
    group: str                  # "adamw · 32bit"
    unit: str                   # ULP, BASELINE_DISTANCE, or both joined when the group mixes them
    lines: list[Line] = field(default_factory=list)
    more: int = 0               # changed cases of this group not drawn (they are in the table)


@dataclass
class SmallMultiples:
    panels: list[Panel]
    not_shown: list[tuple[str, str]]   # (group, the id of its first row in the table), past MAX_PANELS
    unsized: int                       # changed cases with no scale to draw them in yet

    @property
    def estimated(self) -> bool:
        """Some line is the change in distance to float64, the co-run's |commit − baseline| missing."""
        return any(DISTANCE_CHANGE in panel.unit for panel in self.panels)

    def as_json(self) -> str:
        """The panels for dashboard.js, safe inside a <script> element."""
        payload = [{"group": p.group, "unit": p.unit,
                    "lines": [{"case_id": line.case_id, "label": line.label, "steps": line.steps,
                               "values": line.values, "size": line.size} for line in p.lines]}
                   for p in self.panels]
        return json.dumps(payload, allow_nan=False).replace("<", "\\u003c")


def group_of(case: ChangedCase) -> str:
    return f"{case.optimizer} · {case.family or 'unknown family'}"


def short_name(case_id: str) -> str:
    """The case named by what it is (the hash only in the id, for links and tooltips)."""
    return case_name(case_id)


def row_id(index: int) -> str:
    """The id of the changed-cases table's row `index` (0-based), which a group past MAX_PANELS links to."""
    return f"changed-{index + 1}"


DISTANCE_CHANGE = "|Δ distance to float64| × baseline's peak distance"


def small_multiples(changed: list[ChangedCase], attribution: dict[str, CaseAttribution],
                    diffs: Callable[[str], list[float | None] | None],
                    distance_change: Callable[[str], list[float | None] | None]) -> SmallMultiples:
    """Panels in the table's order (largest change relative to its scale first), at most MAX_PANELS.

    `diffs(case_id)`: the co-run's per-step max |commit − baseline|, drawn in the case's scale
    (case_scale), so the curve's peak is the table's figure. Before the co-run has recorded it,
    `distance_change(case_id)`: per step |commit's − baseline's distance to float64| (a lower bound
    of |commit − baseline|, from the stored trajectories), over the baseline's peak distance."""
    panels: dict[str, Panel] = {}
    not_shown: dict[str, str] = {}
    unsized = 0
    for index, case in enumerate(changed):
        if case.verdict != "changed":
            continue
        group = group_of(case)
        if group in not_shown:
            continue
        if group not in panels and len(panels) >= MAX_PANELS:
            not_shown[group] = row_id(index)
            continue
        panel = panels.get(group)
        if panel is not None and len(panel.lines) >= MAX_LINES_PER_PANEL:
            panel.more += 1
            continue
        line = _line(case, attribution.get(case.case_id), diffs, distance_change)
        if line is None:
            unsized += 1
            continue
        line, unit = line
        panel = panels.setdefault(group, Panel(group=group, unit=""))
        panel.lines.append(line)
        panel.unit = " / ".join(dict.fromkeys(u for u in (panel.unit, unit) if u))
    return SmallMultiples(panels=list(panels.values()), not_shown=list(not_shown.items()), unsized=unsized)


def _line(case: ChangedCase, attribution: CaseAttribution | None, diffs: Callable, distance_change: Callable
          ) -> tuple[Line, str] | None:
    scale = case_scale(case, attribution)
    per_step = diffs(case.case_id) if scale is not None and math.isfinite(scale.unit) else None
    if per_step:
        unit, label, size = scale.unit, scale.label, scale.size
    else:
        per_step = distance_change(case.case_id) if _positive(case.baseline_peak) else None
        if not per_step:
            return None
        peak = max((v for v in per_step if v is not None and math.isfinite(v)), default=None)
        if peak is None:
            return None
        unit, label, size = case.baseline_peak, DISTANCE_CHANGE, peak / case.baseline_peak
    units = _units(per_step, unit, case, attribution) if label == ULP else [unit] * len(per_step)
    values = [v / u if _positive(v) else None for v, u in zip(per_step, units)]
    return Line(case.case_id, short_name(case.case_id), list(range(1, len(values) + 1)), values, size), label


def _units(per_step: list[float | None], peak_unit: float, case: ChangedCase,
           attribution: CaseAttribution | None) -> list[float]:
    """Per step, the size of one ulp in |Δ|. An ulp is of the largest |p| the element has had, so it
    only grows along the trajectory; the attribution measured the change at the first divergent step
    (first_step_ulps) and at most (peak_ulps, at the peak's ulp). Each step's ulp is taken between
    those two, as small as keeps the step within the peak's figure: the curve reads the table's
    first-step figure at the first divergent step and its peak figure at the peak, never above it
    (issue 47: one figure, not 2 ulp in the table and 4 on the plot)."""
    units = [peak_unit] * len(per_step)
    first = case.first_divergent_step
    ulps = attribution.first_step_ulps if attribution is not None else None
    peak_ulps = attribution.peak_ulps if attribution is not None else None
    if (not first or not _positive(ulps) or not _positive(peak_ulps) or first > len(per_step)
            or not _positive(per_step[first - 1])):
        return units
    first_unit = min(per_step[first - 1] / ulps, peak_unit)
    for index, value in enumerate(per_step):
        within_peak = value / peak_ulps if _positive(value) else 0.0
        units[index] = min(peak_unit, max(first_unit, within_peak))
    return units
