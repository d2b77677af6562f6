"""`optdrift speed RUN_ID`: a run's kernel speed against its baseline, as a table or JSON.

The speed verdict is judged apart from the trajectory verdict: `submit --wait` and `check` exit
with the trajectory's code whatever the speed. This command exits 0 whatever the speed too, unless
`--fail-on-slowdown` is given: then a run whose speed verdict is `slower` exits 6 (its own code,
so CI can tell a slowdown from a changed trajectory, 1).
"""

from __future__ import annotations

import json
import os
from typing import Annotated

import typer

EXIT_SLOWER = 6
EXIT_CODES = ("Exit codes: 0 shown (any speed, unless --fail-on-slowdown); 6 a kernel slower than its "
              "baseline with --fail-on-slowdown; 2 bad input or usage; 4 optdrift or service error.")


def _elements(size: int) -> str:
    """2^26 rather than 67108864: the timed sizes are powers of two, and the column stays narrow."""
    return f"2^{size.bit_length() - 1}" if size > 0 and size & (size - 1) == 0 else str(size)


_SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def speed_table(speed: dict, *, width: int = 80):  # noqa: ANN201
    """The per-kernel table, and below it each kernel that could not be timed with its error. It fits
    an 80-column terminal; from 120 columns it adds the baseline's median (the ratio already compares
    with it). Values never wrap; a long kernel name folds onto a second line there."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    wide = width >= 120
    table = Table(title=f"run {speed['run_id']} kernel speed: {speed['verdict']} — {speed['summary']}",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 0))
    columns = ["kernel", "dtype", "n", "µs ± IQR", "GB/s (copy)", *(["base µs"] if wide else []),
               "ratio (95 %)", "speed"]
    for name in columns:
        table.add_column(name, justify="left" if name in ("kernel", "dtype", "speed") else "right",
                         overflow="fold", no_wrap=name != "kernel")
    errors = []
    for k in speed["kernels"]:
        kernel = k["kernel"]  # whole: the name the history API and the dashboard take
        cells = [kernel, _SHORT.get(k["param_dtype"], k["param_dtype"]), _elements(k["size"])]
        if k["error"]:
            table.add_row(*cells, *["—"] * (len(columns) - 4), "error")
            errors.append(Text(f"{kernel} {cells[1]} n={cells[2]}: {k['error']}"))
            continue
        cells += [f"{k['median_s'] * 1e6:.1f} ± {100 * k['spread_s'] / k['median_s']:.1f} %",
                  f"{k['bandwidth_bytes_per_s'] / 1e9:.0f}"
                  + (f" ({100 * k['copy_fraction']:.0f} %)" if k["copy_fraction"] is not None else "")]
        if wide:
            cells.append(f"{k['baseline_median_s'] * 1e6:.1f}" if k["baseline_median_s"] else "—")
        cells += [f"{k['ratio']:.3f} ({k['ratio_low']:.3f}–{k['ratio_high']:.3f})" if k["ratio"] is not None else "—",
                  k["verdict"]]
        table.add_row(*cells)
    return Group(table, *errors) if errors else table


def speed(
    run_id: Annotated[int, typer.Argument(help="the run's id (submit and verify print it)")],
    fail_on_slowdown: Annotated[bool, typer.Option(
        "--fail-on-slowdown", help=f"exit {EXIT_SLOWER} when a kernel is slower than its baseline beyond the "
                                   "noise model (off: the exit code ignores speed)")] = False,
    output: Annotated[str, typer.Option("--format", help="text (a table) or json")] = "text",
    url: Annotated[str, typer.Option("--url", help="the optdrift API (env OPTDRIFT_URL)")] =
        os.environ.get("OPTDRIFT_URL", "http://127.0.0.1:8000"),
) -> None:
    """A run's kernel speed against its baseline's: per kernel median, spread, bandwidth as a
    fraction of a same-bytes copy, the ratio of medians with its bootstrap interval, the verdict."""
    from service.cli.common import EXIT_USAGE, console
    from service.cli.common import expected_failures as _expected_failures, fail as _fail
    from service.cli.client import OptdriftClient

    if output not in ("text", "json"):
        raise _fail(f"--format {output!r}: use text or json", EXIT_USAGE)
    client = OptdriftClient(url)
    with _expected_failures(url):
        result = client.speed(run_id)
    if output == "json":
        print(json.dumps(result, indent=2))
    else:
        console.print(speed_table(result, width=console.width))
    raise typer.Exit(EXIT_SLOWER if fail_on_slowdown and result["verdict"] == "slower" else 0)
