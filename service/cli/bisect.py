"""`optdrift bisect`: for each case that changed between a good and a bad commit, the first commit
that changed it.

The history is bad's first-parent line back to good (service/cli/git_history.py); commits that leave
the source folder's tree as their parent had it are not candidates (same tree, same build, same
bits). The search is service/domain/bisection.py: each tested commit answers every case still open
at it, so cases that changed together cost one search. A commit is tested through the service
(its stored run for the battery and environment when there is one, else a submission of its
source folder) or, with `--local`, through the pipeline `optdrift check` runs (worker/pipeline.py:
the same configuration, build cache and kernel host), where commits of one build digest share
one battery run. Cases are compared with the good commit's by their per-step digests
(service.core.verdicts.compare_case).

Exit codes: 0 an answer (every changed case located, or none changed); 2 bad input (not a
repository, an unknown sha, good not before bad, a --case that matches nothing, an endpoint that
does not build); 4 optdrift or service error (unreachable, 5xx, a run in status error).
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from service.cli.report import make_console
from service.domain.bisection import (
    Bisection, Finding, case_results_from_api, collapse_unchanged, compare_with_good, differs, select_cases,
)
from service.cli.git_history import GitError, HistoryCommit, check_repository, export_tree, first_parent_chain, resolve
from service.core.results import CaseResult

BISECT_EXIT_CODES = ("Exit codes: 0 an answer (each changed case located, or none changed); 2 bad input "
                     "(repository, sha, --case, an endpoint that does not build); 4 optdrift or service error.")


class BisectInputError(ValueError):
    """The user's input cannot be bisected (exit 2): the message says which and what to do."""


class BisectServiceError(RuntimeError):
    """optdrift failed to test a commit, not the commit (exit 4)."""


@dataclass
class Tested:
    """What one commit gave: its cases' results (None: it does not build) and how they were had."""

    results: dict[str, CaseResult] | None
    how: str
    new_build: bool = False  # a build and battery run made for this bisection (not a stored/reused one)
    run_id: int | None = None
    error: str | None = None


@dataclass
class Report:
    good: str
    bad: str
    source: str
    commits_in_range: int
    candidates: int
    findings: list[dict] = field(default_factory=list)
    tested: list[dict] = field(default_factory=list)
    cases_compared: int = 0
    note: str = ""

    @property
    def builds(self) -> int:
        return sum(1 for t in self.tested if t["new_build"])

    def as_json(self) -> dict:
        bound = math.ceil(math.log2(self.candidates - 1)) if self.candidates > 2 else 0
        return {"exit_code": 0, "good": self.good, "bad": self.bad, "source": self.source,
                "commits_in_range": self.commits_in_range, "candidate_commits": self.candidates - 1,
                "log2_bound": bound, "builds": self.builds, "tested": self.tested,
                "cases_compared": self.cases_compared, "changed_cases": len(self.findings),
                "findings": self.findings, "note": self.note}


# ----------------------------------------------------------------------------- testers
class LocalTester:
    """Commits tested on this machine with the pipeline `optdrift check` runs; one battery run per
    distinct build digest (the engine is bit-reproducible on one machine: the digests say so)."""

    def __init__(self, *, repo: Path, source: str, battery: str | None, device: str, workdir: Path,
                 say) -> None:  # noqa: ANN001
        from worker import pipeline

        self.pipeline, self.repo, self.source, self.battery, self.workdir, self.say = (
            pipeline, repo, source, battery, workdir, say)
        self.policy = pipeline.Policy(device=device, cuda_archs=[] if device == "cpu" else None)
        self.by_build: dict[tuple[str, str], tuple[str, dict[str, CaseResult]]] = {}

    def test(self, commits: list[HistoryCommit]) -> dict[str, Tested]:
        return {commit.sha: self._one(commit) for commit in commits}

    def _one(self, commit: HistoryCommit) -> Tested:
        from service.core.project_config import ProjectConfigError
        from worker.battery import BatteryError

        tree = export_tree(self.repo, commit.sha, self.source, self.workdir / commit.sha)
        try:
            job = self.pipeline.prepare(tree, requested_battery=self.battery, local_battery_file=True)
        except (ProjectConfigError, BatteryError) as problem:
            self.say(f"  {commit.sha[:12]}: cannot run: {problem}")
            return Tested(None, "invalid configuration", error=str(problem))
        started = time.monotonic()
        built = self.pipeline.build(job, self.policy)
        if not built.ok:
            self.say(f"  {commit.sha[:12]}: does not build")
            return Tested(None, "does not build", error=built.error)
        key = (built.digest, job.battery.digest)
        if key in self.by_build:
            same_as, results = self.by_build[key]
            self.say(f"  {commit.sha[:12]}: the build of {same_as[:12]} (digest {built.digest[:12]}): its results")
            return Tested(results, f"same build as {same_as[:12]}")
        ran = self.pipeline.run(job, built, self.policy)
        results = {r.case.case_id: r for r in self.pipeline.run_result(job, built, ran).cases}
        self.by_build[key] = (commit.sha, results)
        self.say(f"  {commit.sha[:12]}: built ({'cached' if built.cached else f'{built.duration_s:.0f} s'}), "
                 f"{len(results)} cases run, {time.monotonic() - started:.1f} s")
        return Tested(results, f"build {built.digest[:12]}{' (cached)' if built.cached else ''}", new_build=True)


class ServiceTester:
    """Commits tested through the service: a commit's stored run for the battery and environment
    when it has one, else its source folder submitted (as CI would have); all commits of one round
    at once, so the workers run them side by side."""

    def __init__(self, *, client, project: str, repo: Path, source: str, battery: str | None,  # noqa: ANN001
                 environment: str | None, workdir: Path, console: Console, say) -> None:  # noqa: ANN001
        self.client, self.repo, self.source, self.workdir, self.console, self.say = (
            client, repo, source, workdir, console, say)
        self.project = self._get(f"/api/v1/projects/{project}")
        self.battery = battery or self.project["default_battery"]
        self.environment = environment or self.project["environments"][0]

    def _get(self, path: str, *, missing_ok: bool = False) -> dict | None:
        """GET path's JSON; a 4xx/5xx raises ApiError (the CLI's one-line errors), a 404 with
        `missing_ok` gives None."""
        from service.cli.client import ApiError

        response = self.client.http.get(path)
        if missing_ok and response.status_code == 404:
            return None
        if response.status_code >= 400:
            raise ApiError(response)
        return response.json()

    def _stored_run(self, sha: str) -> dict | None:
        commit = self._get(f"/api/v1/projects/{self.project['name']}/commits/{sha}", missing_ok=True)
        if commit is None:
            return None
        return next((run for run in commit["runs"] if run["environment"] == self.environment
                     and self.battery in (run["battery_requested"], run["battery"])), None)

    def _submit(self, commit: HistoryCommit) -> tuple[dict, bool]:
        tree = export_tree(self.repo, commit.sha, self.source, self.workdir / commit.sha)
        answer = self.client.submit_commit(
            project=self.project["name"], sha=commit.sha, source_dir=tree,
            parents=[commit.first_parent] if commit.first_parent else [], message=commit.subject,
            battery=self.battery, idempotency_key=f"{self.project['name']}:{commit.sha}:{self.battery}")
        runs = [run for run in answer["runs"] if run["environment"] == self.environment]
        if not runs:
            raise BisectInputError(f"the project {self.project['name']!r} has no {self.environment!r} "
                                   f"environment (it runs {', '.join(self.project['environments'])}); "
                                   "pass --environment")
        return runs[0], answer["created"]

    def test(self, commits: list[HistoryCommit]) -> dict[str, Tested]:
        from service.cli.report import wait_with_progress

        runs: dict[str, tuple[int, str, bool]] = {}
        for commit in commits:
            stored = self._stored_run(commit.sha)
            if stored is not None and stored["status"] != "error":
                runs[commit.sha] = (stored["id"], f"stored run {stored['id']}", False)
                continue
            run, created = self._submit(commit)
            runs[commit.sha] = (run["id"], f"{'submitted' if created else 'queued again'}: run {run['id']}", created)
            self.say(f"  {commit.sha[:12]}: {runs[commit.sha][1]} {self.client.dashboard_url(run['id'])}")
        final = {run["id"]: run for run in wait_with_progress(self.client, [r[0] for r in runs.values()],
                                                              self.console)}
        out = {}
        for sha, (run_id, how, created) in runs.items():
            run = final[run_id]
            if run["status"] in ("error", "cancelled"):
                raise BisectServiceError(
                    f"run {run_id} of {sha[:12]} ended in status {run['status']} (optdrift's failure, not the "
                    f"commit's): {' '.join((run.get('error') or 'no detail').split())}; `optdrift retry {run_id}`, "
                    "then bisect again (it reuses the stored runs)")
            if run["status"] == "failed":
                out[sha] = Tested(None, f"{how}: does not build or crashed", created, run_id,
                                  error=(run.get("verdict") or {}).get("summary") or run.get("error"))
                continue
            items = self.client.trajectories(run_id)  # every page of them
            out[sha] = Tested(case_results_from_api(items), how, created, run_id)
        return out


# ----------------------------------------------------------------------------- the search
def bisect_history(chain: list[HistoryCommit], tester, *, case_pattern: str | None, source: str,  # noqa: ANN001
                   say) -> Report:  # noqa: ANN001
    """Test good and bad, then midpoints until every case that differs at bad is located."""
    good, bad = chain[0], chain[-1]
    check_source_folder(chain, source)
    candidates = collapse_unchanged([c.tree for c in chain])  # positions -> chain indices
    report = Report(good=good.sha, bad=bad.sha, source=source, commits_in_range=len(chain) - 1,
                    candidates=len(candidates))
    if len(candidates) == 1:
        report.note = f"no commit between good and bad changed {source!r}: nothing can have changed"
        return report
    trees = [chain[i].tree for i in candidates]
    n = len(candidates) - 1
    say(f"bisecting {len(chain) - 1} commits, {n} of them change {source!r}: testing good and bad")
    ends = tester.test([good, bad])
    _log_tested(report, good, ends[good.sha])
    _log_tested(report, bad, ends[bad.sha])
    for commit, option in ((good, "--good"), (bad, "--bad")):
        if ends[commit.sha].results is None:
            raise BisectInputError(f"{option} {commit.sha[:12]} cannot be run ({ends[commit.sha].how}: "
                                   f"{_first_line(ends[commit.sha].error)}); bisect needs both ends to run")
    good_results, bad_results = ends[good.sha].results, ends[bad.sha].results
    shared = [case_id for case_id in bad_results if case_id in good_results]
    chosen = select_cases(shared, case_pattern)
    if case_pattern and not chosen:
        raise BisectInputError(f"--case {case_pattern!r} matches none of the {len(shared)} cases both ends ran "
                               f"(e.g. {shared[0] if shared else 'none'}); use a glob such as 'adam.*' or a substring")
    report.cases_compared = len(chosen)
    at_bad = {case_id: c for case_id, c in compare_with_good(bad_results, good_results, chosen).items()
              if c is not None and differs(c)}
    if not at_bad:
        report.note = f"none of the {len(chosen)} cases differs between good and bad"
        return report
    search = Bisection(n, at_bad)

    def record(position: int, tested: Tested) -> None:
        # Every candidate with this tree built the same thing: one test answers for all of them.
        comparisons = None if tested.results is None else compare_with_good(tested.results, good_results, at_bad)
        for other, tree in enumerate(trees):
            if tree == trees[position] and 0 < other < n:
                search.record(other, comparisons)

    record(n, ends[bad.sha])
    record(0, ends[good.sha])
    round_number = 0
    while not search.done:
        round_number += 1
        positions = search.next_commits()
        commits = [chain[candidates[p]] for p in positions]
        say(f"round {round_number}: {len(search.open_searches())} of {len(at_bad)} changed cases still open; "
            f"testing {', '.join(c.sha[:12] for c in commits)}")
        outcomes = tester.test(commits)
        for position, commit in zip(positions, commits):
            _log_tested(report, commit, outcomes[commit.sha])
            record(position, outcomes[commit.sha])
    report.findings = [_finding_json(f, chain, candidates) for f in search.findings()]
    return report


def check_source_folder(chain: list[HistoryCommit], source: str) -> None:
    for commit, option in ((chain[0], "--good"), (chain[-1], "--bad")):
        if commit.tree is None:
            raise BisectInputError(f"{option} {commit.sha[:12]} has no folder {source!r}; pass --source, the "
                                   "kernel source folder relative to the repository root")


def _first_line(text: str | None) -> str:
    return (text or "no detail").strip().splitlines()[-1] if (text or "").strip() else "no detail"


def _log_tested(report: Report, commit: HistoryCommit, tested: Tested) -> None:
    report.tested.append({"sha": commit.sha, "subject": commit.subject, "how": tested.how,
                          "run_id": tested.run_id, "new_build": tested.new_build,
                          "runs": tested.results is not None})


def _finding_json(finding: Finding, chain: list[HistoryCommit], candidates: list[int]) -> dict:
    first = chain[candidates[finding.first_differing]]
    # The first candidate after the last commit known same (those between build what it built).
    after_same = chain[candidates[finding.last_same + 1]]
    comparison = finding.comparison
    return {"case_id": finding.case_id, "optimizer": comparison.optimizer, "exact": finding.exact,
            # midpoints tested while this case was open (good and bad not counted)
            "midpoints_tested": finding.tests,
            "first_changed": first.sha, "subject": first.subject,
            # Not exact: commits between could not be run; the change is in this range.
            "range_from": None if finding.exact else after_same.sha,
            "last_same": chain[candidates[finding.last_same]].sha,
            "verdict": comparison.verdict, "first_divergent_step": comparison.first_divergent_step,
            "direction": comparison.direction,
            "good_final_ref64_distance": comparison.baseline_final_ref64_distance,
            "final_ref64_distance": comparison.commit_final_ref64_distance}


def print_report(console: Console, report: Report) -> None:
    document = report.as_json()
    if report.findings:
        table = Table(title=f"first commit that changed each case ({len(report.findings)} changed cases)")
        for column in ("case", "first changed at", "subject", "verdict vs good", "first step", "direction"):
            table.add_column(column, overflow="fold")
        for item in report.findings:
            where = item["first_changed"][:12] if item["exact"] else \
                f"{item['range_from'][:12]}..{item['first_changed'][:12]} (untestable between)"
            table.add_row(item["case_id"], where, item["subject"][:60], item["verdict"],
                          str(item["first_divergent_step"] or "-"), item["direction"] or "-")
        console.print(table)
        by_commit: dict[str, list[dict]] = {}
        for item in report.findings:
            by_commit.setdefault(item["first_changed"], []).append(item)
        for sha, items in by_commit.items():
            console.print(f"{sha[:12]} {items[0]['subject']!r}: first changed {len(items)} "
                          f"case{'s' if len(items) != 1 else ''}", highlight=False)
    if report.note:
        console.print(report.note, highlight=False)
    console.print(f"{report.commits_in_range} commits after good, {document['candidate_commits']} change the "
                  f"source; tested {len(report.tested)} commits (good and bad included; log2 bound "
                  f"{document['log2_bound']} midpoints per change point); {report.builds} new builds/runs",
                  highlight=False)


# ----------------------------------------------------------------------------- the command
def bisect(
    repo: Annotated[Path, typer.Option(help="a git clone of the project")],
    good: Annotated[str, typer.Option(help="a commit whose trajectories are the reference (sha, tag, branch)")],
    bad: Annotated[str, typer.Option(help="a later commit on its first-parent line where cases changed")],
    case: Annotated[Optional[str], typer.Option(
        help="only these cases: a glob on the case id ('adam.*'), or a substring")] = None,
    source: Annotated[str, typer.Option(help="the kernel source folder in the repository (what submit "
                                             "uploads)")] = "csrc",
    battery: Annotated[Optional[str], typer.Option(help="default: the tree's optdrift.toml battery, else the "
                                                        "project's")] = None,
    local: Annotated[bool, typer.Option("--local", help="no server: build and run each commit here, as "
                                                         "`optdrift check` does")] = False,
    project: Annotated[Optional[str], typer.Option(help="the service's project (not with --local)")] = None,
    environment: Annotated[Optional[str], typer.Option(help="the service environment to compare in "
                                                            "(default: the project's first)")] = None,
    device: Annotated[str, typer.Option(help="--local: auto, cpu or cuda")] = "auto",
    url: Annotated[str, typer.Option("--url", help="the optdrift API (env OPTDRIFT_URL)")] = "",
    output: Annotated[str, typer.Option("--format", help="text (tables) or json (one JSON document on "
                                                         "stdout, progress on stderr)")] = "text",
) -> None:
    """Find, for each case that changed between --good and --bad, the first commit that changed it
    (about log2(n) builds; commits whose source folder is unchanged are never built)."""
    from service.cli import common as cli

    cli.check_format(output)
    console = cli.console if output == "text" else make_console(stderr=True)

    def say(text: str) -> None:
        console.print(text, highlight=False, markup=False)

    url = url or cli.DEFAULT_URL
    if local:
        cli.needs_extra("bisect --local", "worker", cli.ENGINE_MODULES)
        if project:
            raise cli.fail("--project is for the service; --local runs here and needs none", cli.EXIT_USAGE)
        if device.startswith("cuda") and not cli.cuda_visible():
            raise cli.fail(f"--device {device}: no CUDA GPU is visible on this machine; use --device cpu, or "
                            "run on a machine with a GPU", cli.EXIT_USAGE)
    elif not project:
        raise cli.fail("--project is required (the service project whose runs to use), or pass --local "
                        "to build and run here", cli.EXIT_USAGE)
    try:
        root = check_repository(repo)
        chain = first_parent_chain(root, resolve(root, good, "--good"), resolve(root, bad, "--bad"), source)
        check_source_folder(chain, source)
    except (GitError, BisectInputError) as exc:
        raise cli.fail(str(exc), cli.EXIT_USAGE) from None
    with tempfile.TemporaryDirectory(prefix="optdrift-bisect-") as tmp, cli.expected_failures(url):
        try:
            if local:
                tester = LocalTester(repo=root, source=source, battery=battery, device=device, workdir=Path(tmp),
                                     say=say)
            else:
                from service.cli.client import OptdriftClient

                tester = ServiceTester(client=OptdriftClient(url), project=project, repo=root, source=source,
                                       battery=battery, environment=environment, workdir=Path(tmp),
                                       console=console, say=say)
            report = bisect_history(chain, tester, case_pattern=case, source=source, say=say)
        except (BisectInputError, GitError) as exc:
            raise cli.fail(str(exc), cli.EXIT_USAGE) from None
        except BisectServiceError as exc:
            raise cli.fail(str(exc), cli.EXIT_OPTDRIFT_ERROR) from None
    if output == "json":
        print(json.dumps(report.as_json(), indent=2))
    else:
        print_report(cli.console, report)
    raise typer.Exit(cli.EXIT_OK)
