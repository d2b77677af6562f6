"""service/core/wording.py: the one number formatter, its JavaScript mirror in the dashboard, and
that no other module formats a verdict's floats its own way."""

from __future__ import annotations

import json
import math
import random
import re
import shutil
import subprocess
from decimal import Decimal
from pathlib import Path

import pytest

from service.core.wording import SIGNIFICANT_DIGITS, number, ratio, size

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD_JS = ROOT / "service" / "dashboard" / "static" / "dashboard.js"

# value -> what every surface shows for it (four significant digits, the power of ten always written).
TABLE = [
    (1.255e-02, "1.255e-02"),          # issue 34's clipped cell: never "1.255"
    (8.582e-06, "8.582e-06"),
    (2.508e-05, "2.508e-05"),
    (0.0, "0"), (-0.0, "0"),
    (1.0, "1.000e+00"), (-1.0, "-1.000e+00"),
    (-3.0e4, "-3.000e+04"), (3.66e4, "3.660e+04"),
    (123456789.0, "1.235e+08"),
    (1e-300, "1.000e-300"), (1.7976931348623157e308, "1.798e+308"),
    (5e-324, "4.941e-324"),            # the smallest subnormal
    (2.2250738585072014e-308, "2.225e-308"),
    (9.9995, "9.999e+00"),             # 9.9995 is 9.99949999... in binary: rounds down
    (9.99951, "1.000e+01"),            # the carry moves the exponent
    (1.0625, "1.062e+00"), (-2.5, "-2.500e+00"), (1.03125, "1.031e+00"),  # exact ties: to even
    (0.125, "1.250e-01"), (1 / 3, "3.333e-01"), (-2 / 3, "-6.667e-01"),
    (math.nan, "NaN"), (math.inf, "+inf"), (-math.inf, "-inf"),
    (None, "—"),
    (7, "7.000e+00"),                  # ints are numbers too
]
FIGURE = re.compile(r"^-?\d(\.\d+)?e[+-]\d{2,3}$")


@pytest.mark.parametrize(("value", "text"), TABLE)
def test_number_table(value: float | None, text: str) -> None:
    assert number(value) == text


def _random_values(count: int) -> list[float]:
    rng = random.Random(35)
    values = [rng.uniform(1, 10) * 10.0 ** rng.randint(-320, 307) * rng.choice((1, -1)) for _ in range(count)]
    return [v for v in values if math.isfinite(v) and v != 0]


def test_number_never_clips_the_power_of_ten() -> None:
    # Every finite non-zero figure carries its exponent and reads back as the value to within the
    # rounding at four significant digits (half a unit in the fourth digit: at most relative 5e-4 of
    # the value; a figure that lost its power of ten would be off by that power).
    for value in _random_values(3000) + [v for v, _ in TABLE if isinstance(v, float) and math.isfinite(v) and v]:
        text = number(value)
        assert FIGURE.match(text), (value, text)
        # Decimal, not float: the largest double's figure (1.798e+308) is past float's range.
        assert abs(Decimal(text) - Decimal(value)) <= Decimal("5e-4") * abs(Decimal(value)), (value, text)


def test_digits_missing_ratio_and_size() -> None:
    assert number(1.254e-02, 3) == "1.25e-02" and number(1.254e-02, 1) == "1e-02" and number(1.5, 0) == "2e+00"
    assert number(None, missing="-") == "-"
    assert ratio(1444.4) == "×1.444e+03" and ratio(None) == "—"
    assert size(2.0, "ulp") == "2.000e+00 ulp" and size(None, "ulp", missing="- ulp") == "- ulp"


@pytest.mark.skipif(shutil.which("node") is None, reason="node runs the dashboard's JavaScript")
def test_the_dashboard_javascript_writes_the_same_text() -> None:
    values = [v for v, _ in TABLE if v is not None and not (isinstance(v, float) and not math.isfinite(v))]
    values += _random_values(2000)
    # JSON has no NaN/Infinity: the script maps these names back to the values.
    names = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "null": None}
    script = f"""
const fs = require("fs"), vm = require("vm");
const context = {{}};
vm.createContext(context);
vm.runInContext(fs.readFileSync({json.dumps(str(DASHBOARD_JS))}, "utf8") + ";this.optdrift = optdrift;", context);
const special = {{ nan: NaN, inf: Infinity, "-inf": -Infinity, null: null }};
const values = {json.dumps([repr(v) for v in values] + list(names))};
const out = values.map((v) => [3, 4, 1].map((d) => context.optdrift.number(v in special ? special[v] : Number(v), d)));
process.stdout.write(JSON.stringify(out));
"""
    answer = subprocess.run(["node", "-e", script], capture_output=True, text=True, timeout=60, check=True)
    python = [[number(v, d) for d in (3, 4, 1)] for v in values + list(names.values())]
    mismatches = [(v, p, j) for v, p, j in zip(values + list(names), python, json.loads(answer.stdout)) if p != j]
    assert not mismatches, mismatches[:10]


# Where a float may be written with a precision spec of its own: the formatter itself (no module
# writes a machine format with an e/g precision spec; JSON keeps repr precision).
ALLOWED = {"service/core/wording.py"}
# f"{x:.3g}", f"{x:.2e}", f"{x:.{n}e}", format(x, ".3g"), "%.3e" % x, Jinja's '%.3g' % x, plotly's %{y:.3e}.
PRECISION_SPEC = re.compile(r"""\{[^{}'"]*:[+\- ]?[0-9]*\.(?:[0-9]+|\{[^{}]*\})[eEgG]\}"""
                            r"""|format\([^()]*,\s*['"][^'"]*\.[0-9]+[eEgG]['"]\)"""
                            r"""|['"][^'"]*%[+\- ]?[0-9]*\.[0-9]+[eEgG][^'"]*['"]\s*%""")


def display_formats(root: Path) -> list[str]:
    """file:line of every float written with a precision spec of e or g outside ALLOWED."""
    found = []
    for folder in ("service", "worker"):
        for path in sorted((root / folder).rglob("*")):
            if path.suffix not in (".py", ".html", ".js") or "vendor" in path.parts:
                continue
            name = path.relative_to(root).as_posix()
            if name in ALLOWED:
                continue
            for number_, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
                if PRECISION_SPEC.search(line):
                    found.append(f"{name}:{number_}: {line.strip()}")
    return found


def test_no_other_module_formats_a_float_for_display() -> None:
    # Before service.core.wording, verdicts.py (:.3g, :.3e, :.2e), dashboard/wording.py, cli/report.py,
    # notify/report.py, attribution_view.py, release_matrix.py, worker/check.py, the attribution's
    # notes and dashboard.js each had their own (this test lists 22 lines on 5e4ffb7).
    assert display_formats(ROOT) == []


def test_the_format_search_finds_each_kind_of_spec(tmp_path: Path) -> None:
    probe = tmp_path / "service" / "probe.py"
    probe.parent.mkdir(parents=True)
    lines = ['a = f"{x:.3g}"', 'b = f"{x:.2e} and {y}"', 'c = format(x, ".3g")', 'd = "%.3e" % x',
             "e = '%{y:.3e}'", 'f = f"{x:.{digits}e}"', 'ok = f"{x:.1f} s"', 'ok = f"{n:d}"', 'ok = f"{x!r}"']
    probe.write_text("\n".join(lines) + "\n")
    (tmp_path / "worker").mkdir()
    assert [hit.split(": ", 1)[1] for hit in display_formats(tmp_path)] == lines[:6]


def test_every_surface_writes_a_figure_the_same_way() -> None:
    # The CLI's tables, the release matrix, `optdrift check` and the attribution words all show
    # 1.255e-02 for the same value (issue 34's clipped cell read "1.255" on one page, "0.0126" on another).
    from service.cli.report import size_cells
    from service.core.attribution_view import case_attribution
    from service.core.results import ScaleGroup
    from service.dashboard.release_matrix import factor_text
    from service.core.terminal_tables import Figure  # the cells of check's and the CLI's tables

    value = 1.255e-02
    group = ScaleGroup(family="32bit", dtype="float32", cases=1, baseline_peak=8.582e-06, commit_peak=value,
                       ratio_low=value / 8.582e-06, ratio_high=value / 8.582e-06, largest_diff=value)
    assert size_cells([group]) == ("1.255e-02", "8.582e-06 → 1.255e-02")
    assert factor_text(value) == "×1.255e-02" and factor_text(None) == "—"
    assert Figure.of(value).full == Figure.of(value, missing="").full == "1.255e-02"
    rounding = case_attribution("c", {"class": "rounding-level", "first_step_ulps": value, "peak_ulps": 2.0})
    assert rounding.text == "rounding-level: 1.255e-02 ulp at the first divergent step, 2.000e+00 ulp at most"
