"""How much work a battery declares, measured without expanding it, and the limits it must stay under.

A battery group is a cartesian product (worker/battery.py): its case count is the product of its axis
lengths, so a 1 KiB file can declare 64,800 cases and a 1 MiB one 6.5e10. Expanding such a battery
builds every case in memory; running it fills the database and makes every page that lists its cases
enormous. So the count is taken from the axis lengths alone (each group's product of seven lengths,
summed, stopping at the first group where a running total passes its limit: a 6.5e10-case battery is
refused in microseconds, no list built), and the file's bytes are bounded before it is parsed.

What is bounded, per run (docs/security/SERVICE.md "Bounded batteries"):
- bytes of the battery file (before it is parsed);
- cases declared (sum over groups of the product of their axis lengths: an upper bound of
  len(BatterySpec.expand()), equal to it when no two combinations make the same case);
- steps of one case, and elements (the `size`) of one case;
- case-steps (sum of steps over the cases: the trajectory rows' length, what the database stores)
  and case-step-elements (sum of steps × size: the kernel work).

Verify runs (a contributor's tree, the lowest trust) get lower limits than commit runs; the operator
sets both through service.settings (OPTDRIFT_MAX_CASES_PER_RUN, OPTDRIFT_VERIFY_MAX_CASES_PER_RUN...).

This module reads the battery's *raw JSON* (a dict, not yet validated): the API measures a tree's
battery here without importing worker/ (torch), and the worker measures the same way before it
validates and expands. Shapes the battery schema would refuse (an axis that is not a list, steps that
are not an integer) count as one value here and are left to the schema's own error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# The axes of a group whose lengths multiply (worker/battery.py CaseGroup), in its order.
CASE_AXES = ("optimizers", "families", "param_dtypes", "points", "gradients", "seeds", "sizes")
# Axes with a default of one value when a group leaves them out.
_DEFAULTED_AXES = {"families", "param_dtypes", "points", "gradients", "seeds"}


@dataclass(frozen=True)
class BatteryLimits:
    """Limits for one kind of run; `kind` and `setting_prefix` name them in messages."""

    kind: str                      # "commit" or "verify"
    max_battery_bytes: int
    max_cases: int
    max_steps_per_case: int
    max_elements_per_case: int
    max_case_steps: int
    max_case_step_elements: int

    def setting(self, field: str) -> str:
        """The environment variable an operator sets to change `field` for this kind of run."""
        prefix = "OPTDRIFT_VERIFY_" if self.kind == "verify" else "OPTDRIFT_"
        return prefix + _SETTING_NAMES[field]


_SETTING_NAMES = {
    "max_battery_bytes": "MAX_BATTERY_BYTES",
    "max_cases": "MAX_CASES_PER_RUN",
    "max_steps_per_case": "MAX_STEPS_PER_CASE",
    "max_elements_per_case": "MAX_ELEMENTS_PER_CASE",
    "max_case_steps": "MAX_CASE_STEPS_PER_RUN",
    "max_case_step_elements": "MAX_CASE_STEP_ELEMENTS_PER_RUN",
}

_WHAT = {
    "max_battery_bytes": "bytes in its file",
    "max_cases": "cases",
    "max_steps_per_case": "steps in one case",
    "max_elements_per_case": "elements (size) in one case",
    "max_case_steps": "case-steps (steps summed over its cases)",
    "max_case_step_elements": "case-step-elements (steps × size summed over its cases)",
}


class BatteryLimitError(ValueError):
    """A battery past one of its run's limits. The message names the battery, the value, the limit
    and the setting that holds it, and says what to do."""

    def __init__(self, *, battery: str, limits: BatteryLimits, field: str, value: int, at_least: bool = False):
        self.battery, self.field, self.value = battery, field, value
        self.limit = getattr(limits, field)
        amount = f"at least {value:,}" if at_least else f"{value:,}"
        super().__init__(
            f"battery {battery[:120]!r} has {amount} {_WHAT[field]}; a {limits.kind} run may have at most "
            f"{self.limit:,} ({limits.setting(field)}): declare fewer values per axis (each group's case "
            f"count is the product of its optimizers, families, param_dtypes, points, gradients, seeds and "
            f"sizes), fewer steps or smaller sizes, or ask the operator to raise the limit")


@dataclass(frozen=True)
class BatteryLoad:
    """What a battery declares, each figure at most its limit (measure_battery refuses otherwise)."""

    cases: int
    max_steps_per_case: int
    max_elements_per_case: int
    case_steps: int
    case_step_elements: int


def check_battery_bytes(size: int, *, battery: str, limits: BatteryLimits) -> None:
    """Refuse a battery file before reading it when it has more bytes than the run's limit."""
    if size > limits.max_battery_bytes:
        raise BatteryLimitError(battery=battery, limits=limits, field="max_battery_bytes", value=size)


def _axis_length(group: dict, axis: str) -> int:
    values = group.get(axis)
    if values is None:
        return 1 if axis in _DEFAULTED_AXES else 0
    return len(values) if isinstance(values, list) else 1


def _int_or_zero(value: Any) -> int:  # noqa: ANN401
    # bool is an int in Python; the schema refuses it, so it counts for nothing here.
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _layout_elements(layout: Any) -> int:  # noqa: ANN401
    """A raw layout's flat length (service.core.results.ParamLayout.flat_size), read defensively:
    anything malformed counts for nothing (the schema says what is wrong). One pass over its sizes."""
    from service.core.results import layout_next_offset

    groups = layout.get("groups") if isinstance(layout, dict) else None
    offset = 0
    for group in groups if isinstance(groups, list) else ():
        sizes = group.get("sizes") if isinstance(group, dict) else None
        for size in sizes if isinstance(sizes, list) else ():
            offset = layout_next_offset(offset, _int_or_zero(size))
    return offset


def _case_sizes(group: dict) -> list:
    """A group's sizes axis: its `sizes`, or the flat length of each of its `layouts`."""
    if isinstance(group.get("layouts"), list) and not group.get("sizes"):
        return [_layout_elements(layout) for layout in group["layouts"]]
    return group.get("sizes") if isinstance(group.get("sizes"), list) else []


def measure_battery(raw: Any, *, battery: str, limits: BatteryLimits) -> BatteryLoad:  # noqa: ANN401
    """What the battery `raw` (its parsed JSON) declares, or BatteryLimitError for the first limit it
    passes. Never builds a case: the work is one pass over the groups and their sizes lists, and
    stops at the group where a running total passes its limit."""
    groups = raw.get("groups") if isinstance(raw, dict) else None
    if not isinstance(groups, list):
        return BatteryLoad(0, 0, 0, 0, 0)  # no groups: the schema says what is wrong
    cases = case_steps = case_step_elements = max_steps = max_elements = 0
    for index, group in enumerate(groups):
        if not isinstance(group, dict):
            continue
        more_groups = index < len(groups) - 1  # a total stopped here is a lower bound
        steps = _int_or_zero(group.get("steps"))
        if steps > limits.max_steps_per_case:
            raise BatteryLimitError(battery=battery, limits=limits, field="max_steps_per_case", value=steps)
        sizes = _case_sizes(group)
        group_max_size = max((_int_or_zero(size) for size in sizes), default=0)
        if group_max_size > limits.max_elements_per_case:
            raise BatteryLimitError(battery=battery, limits=limits, field="max_elements_per_case",
                                    value=group_max_size)
        max_steps, max_elements = max(max_steps, steps), max(max_elements, group_max_size)
        # The group's count: seven lengths multiplied (exact, whatever its size: Python's integers
        # do not overflow), never a list of its combinations.
        group_cases = math.prod(_axis_length(group, axis) for axis in CASE_AXES if axis != "sizes") * len(sizes)
        cases += group_cases
        if cases > limits.max_cases:
            raise BatteryLimitError(battery=battery, limits=limits, field="max_cases", value=cases,
                                    at_least=more_groups)
        case_steps += group_cases * steps
        if case_steps > limits.max_case_steps:
            raise BatteryLimitError(battery=battery, limits=limits, field="max_case_steps", value=case_steps,
                                    at_least=more_groups)
        # Each size appears in (cases / len(sizes)) cases, each of `steps` steps.
        per_size = group_cases // len(sizes) if sizes else 0
        case_step_elements += per_size * steps * sum(_int_or_zero(size) for size in sizes)
        if case_step_elements > limits.max_case_step_elements:
            raise BatteryLimitError(battery=battery, limits=limits, field="max_case_step_elements",
                                    value=case_step_elements, at_least=more_groups)
    return BatteryLoad(cases=cases, max_steps_per_case=max_steps, max_elements_per_case=max_elements,
                       case_steps=case_steps, case_step_elements=case_step_elements)
