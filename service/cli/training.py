"""A run's training impact on the command line (issue 46): does the commit's optimizer change move a
reference model's loss, measured by the worker after the co-run (worker/jobs/training.py)?

`optdrift training RUN_ID` shows the run's latest job, or asks for one (POST) when it has none or
when --baseline / --model-set name another; --wait follows it to the end. `submit --wait` and
`verify` print the same lines after the verdict (`wait_and_print`), having waited for the job with
progress. A training verdict never changes any command's exit code: it says how much a change
matters, the trajectory verdict says whether there is one.
"""

from __future__ import annotations

import json
import os
import time
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from service.cli.exit_codes import EXIT_OK, EXIT_OPTDRIFT_ERROR, EXIT_USAGE
from service.cli.report import LINE_INTERVAL_S
from service.core.training import ModelImpact, impact_sentence
from service.core.training import worst_first as ordered_worst_first

EXIT_CODES = ("Exit codes: 0 shown or asked for (whatever the training verdict: it never changes an exit "
              "code); 2 bad input or a refused request (no such run, no baseline, a pair that cannot be "
              "compared, a token without submit or verify rights); 4 optdrift or service error (the job "
              "failed, or --wait ran out of time).")
DEFAULT_TIMEOUT_S = 1800.0


def worst_first(job: dict) -> list[ModelImpact]:
    """The job's model x configuration results, most severe verdict first (stable otherwise)."""
    return ordered_worst_first([ModelImpact.model_validate(result) for result in job.get("results") or []])


def job_phase(job: dict | None) -> str:
    """Where a job is, in words (progress lines and the bar's description)."""
    if job is None:
        return "waiting for the co-run, then the job"
    status, progress = job["status"], job.get("progress") or {}
    if status == "queued":
        return "queued (after the runs and co-runs waiting for its environment)"
    if status == "running":
        phase = progress.get("phase") or "starting"
        total = progress.get("runs_total") or 0
        return f"{phase}, {progress.get('runs_done', 0)}/{total} runs" if total and phase == "training" else phase
    return status.replace("_", " ")


def _command(run_id: int, *options: str) -> str:
    return f"`{' '.join(['optdrift training', str(run_id), *options])}`"


def impact_lines(run_id: int, job: dict | None, *, still_going: bool = False) -> list[str]:
    """The training-impact block of one run: a line per model x configuration (worst first) with
    its verdict and sentence, or what became of the job and what to do."""
    from service.cli.client import TRAINING_FINAL

    prefix = f"run {run_id}: training impact"
    if job is None and still_going:
        return [f"{prefix}: not opened yet (the worker opens it after the run's co-run); the verdict above "
                f"stands. Follow it with {_command(run_id, '--wait')} or on the run page"]
    if job is None:
        return [f"{prefix}: none was opened (the worker measures it after the co-run of a changed run "
                f"unless OPTDRIFT_TRAINING_IMPACT=off); ask for one with {_command(run_id)}"]
    status = job["status"]
    if still_going and status not in TRAINING_FINAL:
        return [f"{prefix}: still measuring ({job_phase(job)}); the verdict above stands. "
                f"Follow it with {_command(run_id, '--wait')} or on the run page"]
    if status == "not_needed":
        return [f"{prefix}: not needed: {job.get('error') or 'no trajectory differs'}"]
    if status == "failed":
        return [f"{prefix}: failed: {' '.join((job.get('error') or 'no reason given').split())}; "
                f"ask again with {_command(run_id, '--model-set', job['model_set'])}"]
    if status != "done":
        return [f"{prefix}: {job_phase(job)}"]
    where = f" on {job['device']}" if job.get("device") else ""
    lines = [f"{prefix} against run {job['baseline_run_id']} ({job['model_set']} model set{where}):"]
    for result in worst_first(job):
        lines.append(f"  {result.figures.verdict:<12} {result.label}: {impact_sentence(result)}")
    return lines


class _Lines:
    """Progress for a log: a line per run when its job's phase changes, at most every
    LINE_INTERVAL_S while its runs count up."""

    def __init__(self, console: Console):
        self.console, self.said = console, {}

    def update(self, jobs: dict[int, dict | None]) -> None:
        now = time.monotonic()
        for run_id, job in jobs.items():
            text = job_phase(job)
            stage = (job["status"], (job.get("progress") or {}).get("phase")) if job else None
            previous = self.said.get(run_id)
            if previous and previous[0] == stage and (previous[1] == text or now - previous[2] < LINE_INTERVAL_S):
                continue
            self.said[run_id] = (stage, text, now)
            self.console.print(f"run {run_id}: training impact {text}", highlight=False, soft_wrap=True)


def follow(client, runs: list[dict], console: Console, *, timeout_s: float) -> tuple[dict, list[int]]:  # noqa: ANN001
    """Wait for the runs' training-impact jobs (client.wait_for_training), showing progress: a live
    bar per run at a terminal, a line per change in a log."""
    if not console.is_terminal:
        return client.wait_for_training(runs, on_update=_Lines(console).update, timeout_s=timeout_s)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        tasks: dict[int, int] = {}

        def update(jobs: dict[int, dict | None]) -> None:
            for run_id, job in jobs.items():
                if run_id not in tasks:
                    tasks[run_id] = progress.add_task(f"run {run_id} training impact", total=None)
                counts = (job or {}).get("progress") or {}
                progress.update(tasks[run_id], completed=counts.get("runs_done", 0),
                                total=counts.get("runs_total") or None,
                                description=f"run {run_id} training impact: {job_phase(job)}")

        return client.wait_for_training(runs, on_update=update, timeout_s=timeout_s)


def wait_and_print(client, runs: list[dict], *, console: Console, progress_console: Console,  # noqa: ANN001
                   timeout_s: float, output: str) -> dict[int, dict | None]:
    """After the verdict (`submit --wait`, `verify`): wait for the training impact of the runs the
    worker measures one for, then print their lines (text) — or return the jobs for the JSON
    document. Never raises for the job's sake: the verdict and its exit code stand."""
    from service.cli.client import training_expected

    expected = {run["id"] for run in runs if training_expected(run)}
    if not expected:
        return {}
    jobs, still_going = follow(client, runs, progress_console, timeout_s=timeout_s)
    if output == "text":
        for run_id in sorted(expected):
            for line in impact_lines(run_id, jobs.get(run_id), still_going=run_id in still_going):
                console.print(line, markup=False, highlight=False, soft_wrap=True)
    return jobs


def training(
    run_id: Annotated[int, typer.Argument(help="the run's id (submit and verify print it)")],
    baseline: Annotated[Optional[int], typer.Option(
        "--baseline", help="the run to compare with (a finished run of the same project and environment); "
                           "default: the run's verdict's baseline")] = None,
    model_set: Annotated[Optional[str], typer.Option(
        "--model-set", help="quick (a CPU worker's: 6 seeds, 150 steps) or standard (8 seeds, 300 steps, "
                            "more configurations); default quick when asking")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="follow the job until its verdicts (progress on "
                                                     "stderr with --format json)")] = False,
    timeout: Annotated[float, typer.Option("--timeout", min=0, help="seconds --wait waits")] = DEFAULT_TIMEOUT_S,
    output: Annotated[str, typer.Option("--format", help="text (a line per model and configuration) or "
                                                         "json (the job as the API answers it)")] = "text",
    curves: Annotated[bool, typer.Option("--curves", help="with --format json: every run's loss at every "
                                                          "step too")] = False,
    url: Annotated[str, typer.Option("--url", help="the optdrift API (env OPTDRIFT_URL)")] =
        os.environ.get("OPTDRIFT_URL", "http://127.0.0.1:8000"),
) -> None:
    """A run's training impact: reference models (an MLP, a tiny transformer) trained with its
    optimizer and its baseline's over paired seeds, beside a one-ulp control; per model and
    configuration whether the final loss moved beyond the one-ulp floor and beyond seed noise.

    Shows the run's latest job. Asks for one (with a submit or verify token) when the run has none,
    or for the pair and model set that --baseline and --model-set name."""
    from service.cli.client import TRAINING_FINAL, OptdriftClient
    from service.cli.common import check_format, console, expected_failures, fail
    from service.cli.report import make_console

    check_format(output)
    if model_set is not None and model_set not in ("quick", "standard"):
        raise fail(f"--model-set {model_set}: use quick or standard", EXIT_USAGE)
    client = OptdriftClient(url)
    say = make_console(stderr=True) if output == "json" else console
    with expected_failures(url):
        job = None if baseline is not None or model_set is not None else client.training(run_id)
        if job is None:
            job = client.request_training(run_id, baseline_run_id=baseline, model_set=model_set or "quick")
            say.print(f"run {run_id}: asked for its training impact against run {job['baseline_run_id']} "
                      f"({job['model_set']} model set): {job['status'].replace('_', ' ')}",
                      markup=False, highlight=False, soft_wrap=True)
        if wait and job["status"] not in TRAINING_FINAL:
            job = _follow_job(client, job, say, timeout_s=timeout)
        if curves and output == "json":
            job = client.training_job(job["id"], curves=True)
    if output == "json":
        print(json.dumps(job, indent=2))
    else:
        for line in impact_lines(run_id, job):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(EXIT_OPTDRIFT_ERROR if job["status"] == "failed" else EXIT_OK)


def _follow_job(client, job: dict, console: Console, *, timeout_s: float, poll_s: float = 1.0) -> dict:  # noqa: ANN001
    """Poll one job until final, with the same progress as `follow`; TimeoutError past `timeout_s`."""
    from service.cli.client import TRAINING_FINAL

    deadline = time.monotonic() + timeout_s
    lines = _Lines(console)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task("", total=None)
        while True:
            counts = job.get("progress") or {}
            if console.is_terminal:
                progress.update(task, completed=counts.get("runs_done", 0), total=counts.get("runs_total") or None,
                                description=f"run {job['run_id']} training impact: {job_phase(job)}")
            else:
                lines.update({job["run_id"]: job})
            if job["status"] in TRAINING_FINAL:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {job['run_id']}'s training impact is still {job_phase(job)} after "
                                   f"{timeout_s:g} s (`optdrift training {job['run_id']}` shows it later)")
            time.sleep(poll_s)
            job = client.training_job(job["id"])
