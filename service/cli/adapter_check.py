"""`optdrift adapter-check`: does an adapter keep the lifecycle contract? (docs/PROJECTS.md, "The
adapter contract".) For the adapter's author, on their own machine: it loads the adapter and the
library into this process (no sandbox, no service), runs a few battery cases through both engines
and compares every per-step digest (worker.engine.conformance). Cases are picked round-robin over
the battery's hyperparameter points, so cases with different betas share a wave, where a shared
library object shows.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

EXIT_CHANGED = 1
EXIT_CODES = ("Exit codes: 0 both engines agree on every case checked; 1 they disagree or the adapter "
              "broke the contract (the message names the adapter and the cases); 2 bad input or usage.")


def pick_cases(cases: list, limit: int) -> list:  # noqa: ANN001
    """Up to `limit` cases, one per hyperparameter point in turn (round-robin), battery order within."""
    by_point: dict[tuple, list] = {}
    for case in cases:
        by_point.setdefault((case.optimizer, tuple(sorted(case.hyper.items()))), []).append(case)
    queues, picked = list(by_point.values()), []
    while len(picked) < limit and any(queues):
        for queue in queues:
            if queue and len(picked) < limit:
                picked.append(queue.pop(0))
    return picked


def adapter_check(
    adapter: Annotated[str, typer.Option(help="built-in adapter name or importable module")],
    library: Annotated[str, typer.Option(help="what the adapter loads: a built .so, a folder, or 'installed'")],
    adapter_path: Annotated[list[Path], typer.Option(help="folder to import the adapter from; repeatable")] = [],  # noqa: B006
    battery: Annotated[str, typer.Option(help="a built-in battery name or a battery JSON file")] = "quick",
    max_cases: Annotated[int, typer.Option(min=2, help="cases to run through both engines")] = 12,
    device: Annotated[str, typer.Option(help="cpu or cuda")] = "cpu",
) -> None:
    """Run a few cases of BATTERY through both engines with ADAPTER and compare every digest."""
    from service.cli.common import ENGINE_MODULES, EXIT_USAGE
    from service.cli.common import fail as _fail, needs_extra as _needs_extra

    _needs_extra("adapter-check", "worker", ENGINE_MODULES)
    import torch

    from worker.adapters import AdapterError, get_adapter
    from worker.adapters.base import AdapterContractError
    from worker.battery import load_battery
    from worker.engine.conformance import check_adapter

    sys.path[:0] = [str(folder.resolve()) for folder in adapter_path]
    try:
        project = get_adapter(adapter)
        project.load(library)
        spec = load_battery(battery)
    except (AdapterError, ValueError, OSError) as error:  # ValueError: an unknown or invalid battery
        raise _fail(f"adapter-check: {error}", EXIT_USAGE) from error
    target = torch.device(device)
    runnable = [c for c in spec.expand() if project.unsupported(c, target) is None]
    if not runnable:
        raise _fail(f"adapter-check: adapter {adapter} supports none of battery {battery}'s cases on {device}; "
                    "name a battery with cases it runs (--battery)", EXIT_USAGE)
    cases = pick_cases(runnable, max_cases)
    try:
        check_adapter(adapter, cases, target, project.families())
    except AdapterContractError as error:
        raise _fail(f"adapter-check: {error}", EXIT_CHANGED) from error
    typer.echo(f"adapter-check: {adapter}: both engines agree on all {len(cases)} cases "
               f"({len({c.hyper.get('beta1') for c in cases})} betas, {sum(c.steps for c in cases)} steps)")
