"""`optdrift sensitivity`: run the mutation catalogue against a battery and show what it catches.

Each mutant (worker/sensitivity/catalogue/) is built through the digest cache and ccache and run
through the pipeline `optdrift check` uses, against the unmutated build's results
(worker/sensitivity/engine.py). Local only: the builds and kernel hosts run on this machine.

Exit codes: 0 every defect caught and no refactor flagged; 1 a defect escaped or a refactor was
flagged; 2 bad input (catalogue, battery, --only, device); 3 a mutant or the unmutated tree does
not build.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from service.cli.report import make_console

EXIT_CODES = ("Exit codes: 0 every defect caught, no refactor flagged; 1 a defect escaped or a refactor "
              "flagged; 2 bad input; 3 a mutant (or the unmutated tree) does not build.")


def sensitivity(
    catalogue: Annotated[Optional[Path], typer.Option(
        help="the catalogue folder (catalogue.toml + patches); default: the bundled one")] = None,
    battery: Annotated[str, typer.Option(help="quick, standard, ci or a battery JSON file")] = "ci",
    device: Annotated[str, typer.Option(help="cpu or cuda (only the mutants whose patch reaches it run)")] = "cpu",
    only: Annotated[Optional[list[str]], typer.Option(
        help="a class (eps) or an id (eps/adam_inside_sqrt); repeat for several")] = None,
    source: Annotated[Optional[Path], typer.Option(help="the kernel tree the patches apply to; default: csrc")] = None,
    fallback_battery: Annotated[str, typer.Option(
        help="the larger battery searched for the cheapest case that catches an escaped mutant; 'none' to skip")]
        = "standard",
    json_out: Annotated[Optional[Path], typer.Option(
        help="write the report as JSON after every mutant; an existing report of the same battery resumes")] = None,
    output: Annotated[str, typer.Option("--format", help="text (tables) or json (the report on stdout)")] = "text",
    build_jobs: Annotated[int, typer.Option(
        min=0, help="mutant builds made ahead of (and while) the mutant being judged runs its battery; "
                    "0: each built when judged. Same builds either way; more jobs pay on more cores")] = 1,
    attribute: Annotated[int, typer.Option(
        min=0, help="attribute up to this many changed cases of each caught defect (what kind of change "
                    "each is) and score the calls against the catalogue's `attribution`; 0: off")] = 0,
) -> None:
    """Apply each catalogued mutant, build it, run the battery against the unmutated build, and print
    the detection matrix, the catch rate per class, the false positives and the escaped mutants."""
    from service.cli.common import ENGINE_MODULES, needs_extra as _needs_extra

    _needs_extra("sensitivity", "worker", ENGINE_MODULES)
    if output not in ("text", "json"):
        raise typer.BadParameter(f"--format {output!r}: use text or json", param_hint="--format")
    if device not in ("cpu", "cuda"):
        raise typer.BadParameter(f"--device {device!r}: use cpu or cuda", param_hint="--device")
    console = make_console(stderr=output == "json")
    from worker.battery import BatteryError
    from worker.sensitivity.catalogue import DEFAULT_CATALOGUE, CatalogueError
    from worker.sensitivity.engine import BUNDLED_CSRC, SensitivityRun
    from worker.sensitivity.report import exit_code, print_report

    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            console.print("error: --device cuda: no CUDA GPU is visible here; use --device cpu", markup=False)
            raise typer.Exit(2)
    run = SensitivityRun(battery=battery, device=device, catalogue=catalogue or DEFAULT_CATALOGUE,
                         only=only or None, source=source or BUNDLED_CSRC,
                         fallback_battery=None if fallback_battery == "none" else fallback_battery,
                         checkpoint=json_out, build_jobs=build_jobs, attribute=attribute,
                         progress=lambda line: console.print(line, markup=False, highlight=False))
    try:
        report = run.run()
    except (CatalogueError, BatteryError, FileNotFoundError) as problem:
        console.print(f"error: {problem}", markup=False, highlight=False)
        raise typer.Exit(2) from None
    except ValueError as problem:  # an unknown battery name (worker.battery.load_battery)
        console.print(f"error: {problem}", markup=False, highlight=False)
        raise typer.Exit(2) from None
    except RuntimeError as problem:  # the unmutated tree does not build
        console.print(f"error: {problem}", markup=False, highlight=False)
        raise typer.Exit(3) from None
    print_report(report, console)
    if output == "json":
        print(json.dumps(report.model_dump(mode="json"), indent=1))
    raise typer.Exit(exit_code(report))
