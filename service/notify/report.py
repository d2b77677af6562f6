"""The text a maintainer reads on GitHub: a check run's output and the PR comment (Markdown).

Both are built from the dashboard's own view of a run (service.domain.dashboard_queries.run_page),
so GitHub and the run page never disagree about which cases changed and by how much.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from service.core.training import TrainingImpact, impact_sentence, worst_first
from service.core.wording import number
from service.domain.dashboard_queries import ChangedCase, RunPage
from service.notify.conclusions import Conclusion

# GitHub refuses a check run summary/text or a comment body past 65535 characters; keep well under.
MAX_BODY_CHARS = 60_000
# A comment lists at most this many cases per (optimizer, family) group; the rest are counted.
MAX_CASES_PER_GROUP = 25


def comment_marker(project: str) -> str:
    """The hidden line that identifies our comment on a PR (one per project), so a later run edits
    it instead of adding another."""
    return f"<!-- optdrift:pr-comment project={project} -->"


def _direction(case: ChangedCase) -> str:
    if case.direction is None:
        return "–"
    arrow = {"closer": "closer to float64", "farther": "farther from float64", "same": "same distance"}
    text = arrow.get(case.direction, case.direction)
    if case.final_direction and case.final_direction != case.direction:
        text += f" (final step: {case.final_direction})"
    return text


@dataclass(frozen=True)
class CaseGroup:
    optimizer: str
    family: str
    cases: list[ChangedCase]


def group_changed(cases: list[ChangedCase]) -> list[CaseGroup]:
    """Changed and broken cases grouped by (optimizer, kernel family), in a stable order."""
    groups: dict[tuple[str, str], list[ChangedCase]] = defaultdict(list)
    for case in cases:
        groups[(case.optimizer, case.family or "32bit")].append(case)
    return [CaseGroup(optimizer=o, family=f, cases=sorted(c, key=lambda x: x.case_id))
            for (o, f), c in sorted(groups.items())]


def changed_tables(page: RunPage, dashboard_url: str) -> str:
    """The changed cases of one run: a table per (optimizer, family)."""
    lines: list[str] = []
    for group in group_changed(page.changed):
        lines += [f"**{group.optimizer} · {group.family}** — {len(group.cases)} case(s)", "",
                  "| case | verdict | first divergent step | max \\|Δ\\| | direction |",
                  "|---|---|---:|---:|---|"]
        for case in group.cases[:MAX_CASES_PER_GROUP]:
            lines.append(f"| `{case.case_id}` | {case.verdict} | {case.first_divergent_step or '–'} "
                         f"| {number(case.max_abs_diff, missing='–')} | {_direction(case)} |")
        if len(group.cases) > MAX_CASES_PER_GROUP:
            lines.append(f"| … {len(group.cases) - MAX_CASES_PER_GROUP} more on "
                         f"[the run page]({dashboard_url}) | | | | |")
        lines.append("")
    return "\n".join(lines)


def _counts_line(page: RunPage) -> str:
    counts = {k: v for k, v in sorted(page.counts.items()) if v}
    parts = [f"{count} {name.replace('_', ' ')}" for name, count in counts.items()]
    return ", ".join(parts) if parts else "no cases compared"


def _cell(text: str) -> str:
    """Text in one Markdown table cell: no pipe or line break can end the cell early."""
    return " ".join(text.replace("|", "\\|").split())


def _clip(text: str) -> str:
    if len(text) <= MAX_BODY_CHARS:
        return text
    return text[:MAX_BODY_CHARS] + "\n\n… cut here (GitHub's limit); the run page has every case."


def compared_with(page: RunPage) -> str:
    """Which run the verdict compared with (issue 44: every result says so), or why none."""
    verdict, baseline = page.verdict, page.baseline_run
    if verdict is None:
        return "not compared yet"
    if baseline is None:
        return f"no baseline: {verdict.baseline_note}" if verdict.baseline_note else "no baseline"
    sha = (page.baseline_commit_sha or "")[:12] or "a verify tree"
    back = verdict.baseline_commits_back
    distance = f", {back} commits back" if back and back > 1 else ""
    return f"`{sha}` (run {baseline.id}, {baseline.environment}, battery {baseline.battery}{distance})"


def training_lines(training: TrainingImpact | None) -> list[str]:
    """The run's training impact (issue 46), a Markdown list item per line: per model x
    configuration its verdict and sentence, worst first, once the job is done; how far it has come
    while it is queued or running; why there is none when it failed. Nothing without a job, or
    when it was not needed (no trajectory differs)."""
    if training is None or training.status == "not_needed":
        return []
    if training.status in ("queued", "running"):
        progress = training.progress
        counted = f" ({progress.runs_done}/{progress.runs_total} runs)" if progress.runs_total else ""
        return [f"- Training impact: measuring{counted}"]
    if training.status == "failed":
        return [f"- Training impact: not measured: {_cell(training.error or 'the job failed')[:300]}"]
    return [f"- Training impact · {result.label}: {impact_sentence(result)}"
            for result in worst_first(training.results)]


def check_output(*, page: RunPage, conclusion: Conclusion, run_url: str,
                 training: TrainingImpact | None = None) -> dict[str, str]:
    """The check run's `output` object: title, summary (with the training impact's lines), and the
    changed cases as text."""
    impact = training_lines(training)
    summary = "\n".join([
        f"**{conclusion.title}**", "",
        page.summary.strip() or "(no summary)", "",
        f"Compared with: {compared_with(page)}.",
        *([f"Acknowledged{' by ' + page.verdict.acknowledged_by if page.verdict.acknowledged_by else ''}: "
           f"{' '.join((page.verdict.acknowledgement_note or '').split())}"]
          if page.verdict is not None and page.verdict.acknowledged else []),
        f"Cases: {_counts_line(page)}. Not applicable on this device: {len(page.not_applicable)}.",
        *(["", *impact, ""] if impact else []),
        f"Run {page.run.id} ({page.run.environment}, battery {page.run.battery}): {run_url}",
    ])
    output = {"title": f"optdrift: {conclusion.title}", "summary": _clip(summary)}
    if page.changed:
        output["text"] = _clip(changed_tables(page, run_url))
    return output


def in_progress_output(*, environment: str, battery: str, run_url: str) -> dict[str, str]:
    return {"title": "optdrift: running",
            "summary": f"Building and stepping the {battery} battery on {environment}: {run_url}"}


@dataclass(frozen=True)
class CommentRun:
    page: RunPage
    conclusion: Conclusion | None
    run_url: str
    training: TrainingImpact | None = None


def pr_comment(*, project: str, sha: str, runs: list[CommentRun]) -> str:
    """The PR comment: one section per run of the head commit, changed cases grouped by optimizer
    and family, and the count of cases the adapter cannot run on that device."""
    lines = [comment_marker(project), f"### optdrift · `{project}` at `{sha[:12]}`", "",
             "| environment | battery | verdict | compared with | changed | not applicable | run |",
             "|---|---|---|---|---:|---:|---|"]
    for item in runs:
        verdict = item.conclusion.title if item.conclusion else item.page.run.status
        lines.append(f"| {item.page.run.environment} | {item.page.run.battery} | {verdict} "
                     f"| {_cell(compared_with(item.page))} "
                     f"| {len(item.page.changed)} | {len(item.page.not_applicable)} "
                     f"| [run {item.page.run.id}]({item.run_url}) |")
    lines.append("")
    for item in runs:
        if item.page.changed:
            lines += [f"#### {item.page.run.environment}: changed cases", "",
                      changed_tables(item.page, item.run_url)]
        impact = training_lines(item.training)
        if impact:  # does the change matter for a model's loss (issue 46)
            if not item.page.changed:
                lines += [f"#### {item.page.run.environment}: training impact", ""]
            lines += [*impact, ""]
    lines.append("<sub>Updated in place on every run of this pull request's head commit. A change "
                 "you meant: `optdrift ack RUN --note \"why\"`.</sub>")
    return _clip("\n".join(lines))
