"""`optdrift adapter-check`: does an adapter keep the lifecycle contract? (docs/PROJECTS.md, "The
adapter contract".) For the adapter's author, on their own machine: it loads the adapter and the
library into this process (no sandbox, no service), runs a few battery cases through both engines
and compares every per-step digest (worker.engine.conformance). Cases are picked round-robin over
the battery's hyperparameter points, so cases with different betas share a wave, where a shared
library object shows.

Then, per family, the group lifecycle (docs/PROJECTS.md "The group lifecycle"): one layout case
(conformance.group_check_case: one optimizer over tensors of 1, 257, 4096 and 1031 elements in two
param groups, the second without weight decay) through both engines, reported as present, missing
(not a failure: the family's layout cases read not_applicable, and the output says so) or not run
(why), with each state the family declares unreadable and what still sees a change in it.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Annotated, Optional

import typer

EXIT_CHANGED = 1
EXIT_CODES = ("Exit codes: 0 both engines agree on every case checked (a family without a group lifecycle is "
              "reported, not a failure); 1 they disagree or the adapter broke the contract, its group lifecycle "
              "included (the message names the adapter and the cases); 2 bad input or usage.")


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


def one_engine_families(cases: list, families) -> list[str]:  # noqa: ANN001
    """The families of `cases` that declare `fast_engine = False`: the fast engine hands their cases
    to the one-case engine, so for them the check compares that engine with itself."""
    return sorted({case.family for case in cases if not getattr(families.get(case.family), "fast_engine", True)})


def _from_tree(source: Path, battery: str | None, device: str) -> tuple[str, str, list[str], list, str]:
    """(adapter, library, adapter folders, cases, battery name) of the project tree `source`, built
    as a run builds it (its optdrift.toml: build, adapter, adapter_path, battery)."""
    from service.cli.common import EXIT_USAGE, fail
    from service.core.project_config import ProjectConfigError
    from worker import pipeline
    from worker.battery import BatteryError

    try:
        job = pipeline.prepare(source, requested_battery=battery, local_battery_file=True)
    except (ProjectConfigError, BatteryError) as error:
        raise fail(f"adapter-check: {error}", EXIT_USAGE) from error
    typer.echo(f"adapter-check: building {source} as its optdrift.toml says ({job.config.build.kind})")
    built = pipeline.build(job, pipeline.Policy(device=device, cuda_archs=[] if device == "cpu" else None))
    if not built.ok:
        raise fail(f"adapter-check: {source} does not build:\n{built.error}", EXIT_USAGE)
    return job.config.adapter, str(built.library_path), [str(p) for p in job.adapter_folders], job.cases, \
        job.battery.name


def _import_telling_deprecations(adapter: str, get_adapter):  # noqa: ANN001, ANN202
    """get_adapter(adapter), printing each DeprecationWarning its import raised (an old import path
    that still works: docs/PROJECTS.md, "Public adapter API"), which Python hides by default outside
    __main__, so the adapter's author sees what to change; the warnings are then raised again as
    they were, for whoever listens."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeprecationWarning)
        project = get_adapter(adapter)
    for warning in caught:
        if issubclass(warning.category, DeprecationWarning):
            typer.echo(f"adapter-check: note: {warning.filename}:{warning.lineno}: {warning.message}")
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return project


def adapter_check(
    source: Annotated[Optional[Path], typer.Option(
        help="the project's tree: built as a run builds it, with its optdrift.toml's adapter, adapter_path "
             "and battery (the options below override them)")] = None,
    adapter: Annotated[Optional[str], typer.Option(help="built-in adapter name or importable module "
                                                        "(default: the tree's)")] = None,
    library: Annotated[Optional[str], typer.Option(help="what the adapter loads: a built .so, a folder, or "
                                                        "'installed' (default: the tree's build)")] = None,
    adapter_path: Annotated[list[Path], typer.Option(help="folder to import the adapter from; repeatable")] = [],  # noqa: B006
    battery: Annotated[Optional[str], typer.Option(help="a built-in battery name or a battery JSON file "
                                                        "(default: the tree's, else quick)")] = None,
    max_cases: Annotated[int, typer.Option(min=2, help="cases to run through both engines")] = 12,
    device: Annotated[str, typer.Option(help="cpu or cuda")] = "cpu",
) -> None:
    """Run a few cases of the battery through both engines with the adapter and compare every digest."""
    from service.cli.common import ENGINE_MODULES, EXIT_USAGE
    from service.cli.common import fail as _fail, needs_extra as _needs_extra

    _needs_extra("adapter-check", "worker", ENGINE_MODULES)
    import torch

    from worker.adapters import AdapterError, get_adapter
    from worker.adapters.base import AdapterContractError
    from worker.battery import load_battery
    from worker.engine.conformance import check_adapter

    cases, folders = None, [str(folder.resolve()) for folder in adapter_path]
    if source is not None:
        if not source.is_dir():
            raise _fail(f"adapter-check: --source {source} is not a folder; pass the project's tree", EXIT_USAGE)
        tree_adapter, built_library, tree_folders, cases, battery = _from_tree(source, battery, device)
        adapter, library, folders = adapter or tree_adapter, library or built_library, folders + tree_folders
    if adapter is None or library is None:
        raise _fail("adapter-check: give --source (the project's tree, built here) or both --adapter and "
                    "--library", EXIT_USAGE)
    sys.path[:0] = folders
    try:
        project = _import_telling_deprecations(adapter, get_adapter)
        project.load(library)
        if cases is None:
            cases = load_battery(battery or "quick").expand()
    except (AdapterError, ValueError, OSError) as error:  # ValueError: an unknown or invalid battery
        raise _fail(f"adapter-check: {error}", EXIT_USAGE) from error
    target = torch.device(device)
    runnable = [c for c in cases if project.unsupported(c, target) is None]
    if not runnable:
        raise _fail(f"adapter-check: adapter {adapter} supports none of battery {battery or 'quick'}'s cases on "
                    f"{device}; name a battery with cases it runs (--battery)", EXIT_USAGE)
    picked = pick_cases(runnable, max_cases)
    families = project.families()
    try:
        check_adapter(adapter, picked, target, families)
    except AdapterContractError as error:
        raise _fail(f"adapter-check: {error}", EXIT_CHANGED) from error
    alone = one_engine_families(picked, families)
    compared = [c for c in picked if c.family not in alone]
    if not compared:
        typer.echo(f"adapter-check: {adapter}: only ONE engine could be checked: its famil"
                   f"{'y' if len(alone) == 1 else 'ies'} {', '.join(alone)} declare fast_engine = False, so the "
                   f"fast engine runs their cases one at a time too; the {len(picked)} cases reproduced themselves "
                   "on it, which says nothing about cases open side by side")
    else:
        note = (f"; {len(picked) - len(compared)} more of famil{'y' if len(alone) == 1 else 'ies'} {', '.join(alone)} "
                "(fast_engine = False) ran on the one-case engine only") if alone else ""
        typer.echo(f"adapter-check: {adapter}: both engines agree on all {len(compared)} cases "
                   f"({len({c.hyper.get('beta1') for c in compared})} betas, {sum(c.steps for c in compared)} steps)"
                   + note)
    _check_group_lifecycles(adapter, picked, runnable, target, project)


def _check_group_lifecycles(adapter: str, picked: list, runnable: list, target, project) -> None:  # noqa: ANN001
    """The group lifecycle of every family the battery's runnable cases use: one layout case each
    (picked cases first as its model), reported per family; exit 1 when it broke the contract."""
    from service.cli.common import fail as _fail
    from worker.adapters.base import AdapterContractError
    from worker.engine.conformance import GROUP_CHECK_SIZES, check_group_lifecycle

    sizes = " | ".join(", ".join(str(n) for n in group) for group in GROUP_CHECK_SIZES)
    typer.echo(f"adapter-check: {adapter}: group lifecycle (one optimizer over tensors of {sizes} elements in "
               f"{len(GROUP_CHECK_SIZES)} param groups, the last without weight decay), per family:")
    wrong_claims = []
    for family_name in sorted({case.family for case in runnable}):
        candidates = [c for c in picked if c.family == family_name] + \
            [c for c in runnable if c.family == family_name and c not in picked]
        try:
            report = check_group_lifecycle(adapter, family_name, candidates, target, project.families(),
                                           project.unsupported)
        except AdapterContractError as error:
            raise _fail(f"adapter-check: {error}", EXIT_CHANGED) from error
        if report.status == "yes":
            typer.echo(f"  {family_name}: yes: {report.how}; {report.detail} (the fast engine runs a layout case "
                       f"alone through the same group lifecycle: two fresh runs of it) [{report.case.case_id}]")
        elif report.status == "missing":
            typer.echo(f"  {family_name}: missing: {report.detail} (not a failure: this family's layout cases read "
                       "not_applicable with that reason)")
        else:
            typer.echo(f"  {family_name}: not run: {report.detail}")
        for entry, unmatched in report.unreadable:
            typer.echo(f"    unreadable state {entry.name!r}: {entry.why}; a change in it is seen through "
                       f"{', '.join(entry.seen_through)} from step {entry.from_step} (declared by the adapter; "
                       "adapter-check checks that these figures are digested, not that a change in the state moves "
                       "them)")
            if unmatched:
                wrong_claims.append(f"{family_name}: {entry.name!r} is said to be seen through {', '.join(unmatched)}, "
                                    "which the layout case does not digest")
    if wrong_claims:
        raise _fail(f"adapter-check: adapter {adapter} declares unreadable state seen through figures nobody reads: "
                    + "; ".join(wrong_claims) + " (name \"parameters\" or a state_for_digest name, e.g. \"t*.exp_avg\")",
                    EXIT_CHANGED)
