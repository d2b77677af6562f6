"""`optdrift compare --commit X --env A --env B`: one commit as two environments ran it (issue 36).

B's trajectories are judged against A's as a commit is judged against its parent, with what differs
between the two environments' fingerprints named first. Exit codes as `submit`'s: 0 unchanged, 1
changed, 3 broken, 5 nondeterministic; 2 bad input (an environment not registered, no run there),
4 optdrift or service error."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from service.cli.common import DEFAULT_URL

EXIT_CODES = ("Exit codes: 0 unchanged; 1 changed (B moved trajectories against A); 2 bad input or usage (an "
              "environment not registered or without a run of the commit); 3 broken; 4 optdrift or service error "
              "(or a run not done yet); 5 nondeterministic.")
EXIT_BY_VERDICT = {"unchanged": 0, "no-baseline": 0, "changed": 1, "broken": 3, "nondeterministic": 5}
MAX_ROWS = 40


def compare(
    project: Annotated[str, typer.Option(help="project name")],
    commit: Annotated[str, typer.Option(help="a sha, unique sha prefix or release tag")],
    env: Annotated[list[str], typer.Option("--env", help="an environment; give two: A (compared against), then B")],
    battery: Annotated[str | None, typer.Option(help="default: the battery of A's run")] = None,
    output: Annotated[str, typer.Option("--format", help="text or json")] = "text",
    url: Annotated[str, typer.Option("--url", help="the optdrift API (env OPTDRIFT_URL)")] = DEFAULT_URL,
) -> None:
    """Did environment B (another toolchain, torch, driver or device) move the commit's trajectories
    against environment A?"""
    from service.cli import common as cli
    from service.cli.client import OptdriftClient

    cli.check_format(output)
    if len(env) != 2:
        raise cli.fail(f"--env: give exactly two environments, A then B (got {len(env)})", cli.EXIT_USAGE)
    client = OptdriftClient(url)
    params = {"commit": commit, "a": env[0], "b": env[1], **({"battery": battery} if battery else {})}
    with cli.expected_failures(url):
        answer = client._check(client.http.get(f"/api/v1/projects/{project}/environment-comparison", params=params))
    verdict = answer["comparison"]["verdict"]
    if output == "json":
        print(json.dumps(answer, indent=2))
    else:
        _print(answer)
    raise typer.Exit(EXIT_BY_VERDICT.get(verdict, cli.EXIT_OPTDRIFT_ERROR))


def _print(answer: dict) -> None:
    from rich.table import Table

    from service.cli.report import make_console
    from service.core.wording import number

    console = make_console()
    a, b, comparison = answer["a"], answer["b"], answer["comparison"]
    console.print(f"{answer['project']} {answer['commit']}: {b['environment']} (run {b['run_id']}) against "
                  f"{a['environment']} (run {a['run_id']}), battery {answer['battery']}", markup=False, highlight=False)
    if answer["fingerprint_changes"]:
        console.print("environments differ in: " + "; ".join(
            f"{c['field']} {c['a']} → {c['b']}" for c in answer["fingerprint_changes"]), markup=False, highlight=False)
    console.print("same build digest in both" if answer["same_build"] else
                  "different build digests (sources, flags or toolchain differ)", markup=False, highlight=False)
    moved = [case for case in comparison["cases"] if case["verdict"] != "unchanged"]
    if moved:
        table = Table(title=f"{comparison['verdict']}: {len(moved)} of {len(comparison['cases'])} cases")
        for column in ("case", "verdict", "first step", "to float64 A → B", "direction"):
            table.add_column(column, overflow="fold")
        for case in moved[:MAX_ROWS]:
            table.add_row(case["case_id"], case["verdict"], str(case.get("first_divergent_step") or "—"),
                          f"{number(case.get('baseline_final_ref64_distance'))} → "
                          f"{number(case.get('commit_final_ref64_distance'))}", case.get("direction") or "—")
        if len(moved) > MAX_ROWS:
            table.caption = f"... and {len(moved) - MAX_ROWS} more (--format json lists them all)"
        console.print(table)
    console.print(comparison["summary"], markup=False, highlight=False)
