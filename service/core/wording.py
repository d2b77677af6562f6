"""The one place a verdict becomes words and numbers: the number formatter every surface uses
(the CLI report, the dashboard, the notifier's check runs, comments and webhooks, `optdrift check`).

Numbers: `number(x)` writes a float with SIGNIFICANT_DIGITS significant digits and always its
power of ten (`1.255e-02`, never `1.255` or `0.01255`), so a cell that clips still shows a wrong
looking figure rather than a plausible one, and every surface shows the same text for the same
value. `ratio(x)` is `×` + number(x); `size(x, unit)` appends a unit. Missing values are "—".
The stored values keep full precision; this is display only.

In a Jinja template (service/dashboard/routes.py registers it):

    templates.env.filters["number"] = wording.number      # {{ case.max_abs_diff | number }}
    {{ value | number(3) }}                                # three significant digits

The old `sci` filter is the same function. The dashboard's JavaScript mirrors `number` as
`optdrift.number` (service/dashboard/static/dashboard.js); tests/test_wording.py checks that both
give the same text on a table of values.
"""

from __future__ import annotations

import math

# Four significant digits tell 1.255e-02 from 1.256e-02 (a one-ulp move at float32 scale is not
# visible at any figure; a change of the algorithm moves the first digit or the exponent).
SIGNIFICANT_DIGITS = 4
MISSING = "—"


def number(value: float | int | None, digits: int = SIGNIFICANT_DIGITS, missing: str = MISSING) -> str:
    """`value` for display: `digits` significant digits and its power of ten, always written
    (1.255e-02, -3.000e+04, 0 for exactly zero, NaN, +inf, -inf; `missing` for None)."""
    if value is None:
        return missing
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+inf" if value > 0 else "-inf"
    if value == 0:
        return "0"
    return f"{value:.{max(1, digits) - 1}e}"


def ratio(value: float | None, digits: int = SIGNIFICANT_DIGITS, missing: str = MISSING) -> str:
    """A factor: ×1.440e+03."""
    return missing if value is None else "×" + number(value, digits)


def size(value: float | None, unit: str, digits: int = SIGNIFICANT_DIGITS, missing: str = MISSING) -> str:
    """A figure with its unit: 3.000e+00 ulp."""
    return missing if value is None else f"{number(value, digits)} {unit}"
