"""`optdrift compare --commit X --env A --env B`: one commit as two environments ran it (issue 36).

B's trajectories are judged against A's as a commit is judged against its parent, with what differs
between the two environments' fingerprints named first. For a base environment and its build
variant, each changed case then shows what it looks like ("looks like FMA contraction: ... -mfma"),
once the worker has co-run the two builds (service/domain/environment_attribution.py); `--run`
waits for that as `submit --wait` waits for the co-run detail (`--no-detail` does not). Exit codes as `submit`'s: 0 unchanged, 1
changed, 3 broken, 5 nondeterministic; 2 bad input (an environment not registered, no run there),
4 optdrift or service error."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from service.cli.common import DEFAULT_URL, EXIT_BY_VERDICT

EXIT_CODES = ("Exit codes: 0 unchanged; 1 changed (B moved trajectories against A); 2 bad input or usage (an "
              "environment not registered or without a run of the commit); 3 broken; 4 optdrift or service error "
              "(or a run not done yet); 5 nondeterministic.")
# An environment comparison always has run A to compare with: a no-baseline verdict of B's run
# (no ancestor in B's environment) is no gate here (EXIT_BY_VERDICT, service/cli/common.py).
MAX_ROWS = 40
# The attribution's states that are still coming (service/domain/environment_compare.py).
ATTRIBUTION_COMING = ("expected", "queued", "running")
PROGRESS_EVERY_S = 15.0


def compare(
    project: Annotated[str, typer.Option(help="project name")],
    commit: Annotated[str, typer.Option(help="a sha, unique sha prefix or release tag")],
    env: Annotated[list[str], typer.Option("--env", help="an environment; give two: A (compared against), then B")],
    battery: Annotated[str | None, typer.Option(help="default: the battery of A's run")] = None,
    output: Annotated[str, typer.Option("--format", help="text or json")] = "text",
    run: Annotated[bool, typer.Option(
        "--run", help="first run the commit's stored tree in whichever of the two environments has no run of it "
                      "(a submit token), and wait for it: the upgrade check, e.g. release R on a new toolchain")] = False,
    timeout: Annotated[float, typer.Option(help="seconds to wait for those runs")] = 3600.0,
    detail: Annotated[bool, typer.Option(
        "--detail/--no-detail", help="with --run and a build variant whose trajectories differ from its base "
                                     "environment's: also wait for the attribution of the changed cases (max ulps, "
                                     "what they look like); --no-detail compares as soon as both runs are done")] = True,
    detail_timeout: Annotated[float, typer.Option(
        "--detail-timeout", min=0, help="seconds to wait for that attribution; past it the comparison is "
                                        "printed and the attribution follows")] = 600.0,
    skip_unknown_commit: Annotated[bool, typer.Option(
        "--skip-unknown-commit", help="a commit the service was never sent is not an error: say so and exit 0 "
                                      "(the Action's pull_request flow: github.sha is the merge commit GitHub "
                                      "made, which nothing submits)")] = False,
    url: Annotated[str, typer.Option("--url", help="the optdrift API (env OPTDRIFT_URL)")] = DEFAULT_URL,
) -> None:
    """Did environment B (another toolchain, torch, driver or device) move the commit's trajectories
    against environment A? With --run: rebuild the commit (or release) where it has not run yet,
    then compare."""
    from service.cli import common as cli
    from service.cli.client import OptdriftClient

    cli.check_format(output)
    if len(env) != 2:
        raise cli.fail(f"--env: give exactly two environments, A then B (got {len(env)})", cli.EXIT_USAGE)
    client = OptdriftClient(url)
    params = {"commit": commit, "a": env[0], "b": env[1], **({"battery": battery} if battery else {})}
    with cli.expected_failures(url):
        unknown = _unknown_commit(client, project=project, commit=commit)
        if unknown and skip_unknown_commit:
            import sys

            print(f"notice: {unknown}; nothing compared (--skip-unknown-commit)", file=sys.stderr)
            if output == "json":
                print(json.dumps({"skipped": unknown, "comparison": {"verdict": "skipped"}, "run_url": None}))
            raise typer.Exit(cli.EXIT_OK)
        if unknown:
            raise cli.fail(f"{unknown}: submit it first (optdrift submit), or name a commit or release tag the "
                           "service has (--commit; the Action's `release` input)", cli.EXIT_USAGE)
        if run:
            _run_where_missing(client, project=project, commit=commit, environments=env, battery=battery,
                               timeout_s=timeout)
        answer = client.request("GET", f"/api/v1/projects/{project}/environment-comparison", params=params)
        if run and detail and answer.get("attribution_status") in ATTRIBUTION_COMING:
            answer = _wait_for_attribution(client, f"/api/v1/projects/{project}/environment-comparison", params,
                                           answer, timeout_s=detail_timeout)
    verdict = answer["comparison"]["verdict"]
    if output == "json":
        print(json.dumps({**answer, "run_url": client.dashboard_url(answer["b"]["run_id"])}, indent=2))
    else:
        _print(answer)
    raise typer.Exit(EXIT_BY_VERDICT.get(verdict, cli.EXIT_OPTDRIFT_ERROR))


def _unknown_commit(client, *, project: str, commit: str) -> str | None:  # noqa: ANN001
    """Why `commit` cannot be compared because the service has never been sent it (on a pull
    request, github.sha is the merge commit GitHub made, which nothing submits), or None when the
    project has it. An unknown project stays the error it is (ApiError: exit 2)."""
    from service.cli.client import ApiError

    client.request("GET", f"/api/v1/projects/{project}")
    try:
        client.request("GET", f"/api/v1/projects/{project}/commits/{commit}")
    except ApiError as error:
        if error.status_code != 404:
            raise
        return f"commit {commit} is not known to project {project}: it was never submitted"
    return None


def _run_where_missing(client, *, project: str, commit: str, environments: list[str], battery: str | None,  # noqa: ANN001
                       timeout_s: float) -> None:
    """Submit the commit's stored tree (its source digest: nothing is uploaded again) to the
    environments without a run of it, and wait for those runs, saying so on stderr."""
    import sys

    stored = client.request("GET", f"/api/v1/projects/{project}/commits/{commit}")
    have = {r["environment"] for r in stored["runs"] if not battery or r["battery"] == battery}
    missing = [name for name in environments if name not in have]
    if not missing:
        return
    form = {"sha": stored["sha"], "source_digest": stored["source_digest"], "parents": " ".join(stored["parents"]),
            "environments": ",".join(missing), **({"battery": battery} if battery else {})}
    submitted = client.request("POST", f"/api/v1/projects/{project}/commits", data=form)
    new = [r for r in submitted["runs"] if r["environment"] in missing]
    print(f"running {stored['sha'][:12]} in {', '.join(missing)} (runs {', '.join(str(r['id']) for r in new)}); "
          "waiting for them", file=sys.stderr, flush=True)

    def progress(runs: list[dict]) -> None:
        states = ", ".join(f"{r['environment']} {r['status']}" for r in runs)
        print(f"  {states}", file=sys.stderr, flush=True)

    client.wait([r["id"] for r in new], on_update=_every(15.0, progress), timeout_s=timeout_s)


def _wait_for_attribution(client, path: str, params: dict, answer: dict, *, timeout_s: float) -> dict:  # noqa: ANN001
    """Poll the comparison until the worker's attribution of the changed cases is done or failed (or
    `timeout_s` passed), a line on stderr when it starts and every PROGRESS_EVERY_S; the last answer."""
    import sys
    import time

    changed = sum(1 for case in answer["comparison"]["cases"] if case["verdict"] == "changed")
    print(f"waiting for the attribution of {changed} changed cases ({answer['b']['environment']}'s build co-run with "
          f"{answer['a']['environment']}'s); --no-detail skips this", file=sys.stderr, flush=True)
    report = _every(PROGRESS_EVERY_S, lambda state: print(f"  attribution {state}", file=sys.stderr, flush=True))
    deadline = time.monotonic() + timeout_s
    while answer.get("attribution_status") in ATTRIBUTION_COMING and time.monotonic() < deadline:
        report(answer["attribution_status"])
        time.sleep(1.0)
        answer = client.request("GET", path, params=params)
    return answer


def _every(seconds: float, report):  # noqa: ANN001, ANN202
    """`report`, called at most once per `seconds` (a poll answers every second)."""
    import time

    last = [0.0]

    def maybe(value) -> None:  # noqa: ANN001
        if time.monotonic() - last[0] >= seconds:
            last[0] = time.monotonic()
            report(value)

    return maybe


def _print(answer: dict) -> None:
    from rich.table import Table

    from service.cli.report import make_console
    from service.core.wording import headline_kind, looks_like_headline, number

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
    attributed = any(case.get("attribution") for case in moved)
    if moved:
        table = Table(title=f"{comparison['verdict']}: {len(moved)} of {len(comparison['cases'])} cases")
        columns = ("case", "verdict", "first step", "to float64 A → B", "direction")
        for column in columns + (("max ulps", "looks like") if attributed else ()):
            table.add_column(column, overflow="fold")
        for case in moved[:MAX_ROWS]:
            cells = [case["case_id"], case["verdict"], str(case.get("first_divergent_step") or "—"),
                     f"{number(case.get('baseline_final_ref64_distance'))} → "
                     f"{number(case.get('commit_final_ref64_distance'))}", case.get("direction") or "—"]
            if attributed:
                cells += [number(case.get("max_ulps")), (case.get("attribution") or {}).get("label") or "—"]
            table.add_row(*cells)
        if len(moved) > MAX_ROWS:
            table.caption = f"... and {len(moved) - MAX_ROWS} more (--format json lists them all)"
        console.print(table)
    console.print(comparison["summary"], markup=False, highlight=False)
    status = answer.get("attribution_status", "none")
    if attributed:
        console.print("attribution: " + (looks_like_headline(
            [(headline_kind(case["attribution"]["looks_like"], case["attribution"]["evidence"]),
              tuple(case["attribution"]["evidence"].get("flags") or ()))
             for case in moved if case.get("attribution")]) or ""), markup=False, highlight=False)
    elif status != "none":
        console.print(f"attribution {status}" + (f": {answer['attribution_note']}" if answer.get("attribution_note")
                                                 else ""), markup=False, highlight=False)
