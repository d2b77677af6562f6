"""How the dashboard says things: numbers, times and the verdict in one sentence."""

from __future__ import annotations

import math
from datetime import datetime, timezone

from service.domain.dashboard_queries import RunPage


def sci(value: float | None, digits: int = 3) -> str:
    """Scientific notation for display (the JSON/CSV links carry the full-precision values)."""
    if value is None:
        return "—"
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("+inf" if value > 0 else "−inf")
    return f"{value:.{digits}e}"


def when(moment: datetime | None) -> str:
    if moment is None:
        return "—"
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def short_error(error: str | None, limit: int = 240) -> str:
    """The line of a long build/run error that says what went wrong (the full text is in the
    build log and the run JSON)."""
    if not error:
        return "no reason recorded"
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    telling = next((line for line in lines if "error:" in line.lower()), lines[0] if lines else error)
    return telling if len(telling) <= limit else telling[:limit - 1] + "…"


def _plural(count: int, word: str) -> str:
    if count == 1:
        return f"1 {word}"
    return f"{count} {word[:-1] + 'ies' if word.endswith('y') else word + 's'}"


def verdict_sentence(page: RunPage) -> str:
    run, verdict = page.run, page.verdict
    if verdict is None:
        if run.status == "queued":
            return "Queued: waiting for a worker."
        if run.status == "building":
            return "Building the kernels."
        if run.status == "running":
            total = run.cases_total or 0
            return f"Running: {run.cases_done} of {total} cases done. This page updates by itself."
        if run.status == "failed":
            return f"The run failed: {short_error(run.error)} (full text: the build log below)."
        if run.status == "cancelled":
            return "The run was cancelled."
        return "Finished; the verdict waits for its baseline run to finish."
    against = (f"commit {page.baseline_commit_sha}" if page.baseline_commit_sha
               else f"run {verdict.baseline_run_id}" if verdict.baseline_run_id else None)
    total = sum(page.counts.values())
    if verdict.outcome == "unchanged":
        return (f"Unchanged: all {total} trajectories are bit-identical to {against}'s at every step "
                "(parameters and optimizer state).")
    if verdict.outcome == "no-baseline":
        return (f"No baseline: nothing earlier ran this battery in {run.environment}, so there is nothing "
                f"to compare with; {total} cases were recorded.")
    if verdict.outcome == "broken":
        broken = page.counts.get("broken", 0)
        if broken:
            return (f"Broken: {_plural(broken, 'case')} crashed, hung or produced NaN/Inf"
                    + (f" (compared with {against})." if against else "."))
        return f"Broken: {short_error(run.error)} (full text: the build log below)."
    changed = [c for c in page.changed if c.verdict == "changed"]
    farther = sum(1 for c in changed if c.direction == "farther")
    closer = sum(1 for c in changed if c.direction == "closer")
    same = sum(1 for c in changed if c.direction == "same")
    first = verdict.first_divergent_step
    parts = [f"Changed: {_plural(len(changed), 'trajectory')} of {total} differ from {against}'s"
             + (f", first at step {first}" if first else "") + "."]
    moves = []
    if farther:
        moves.append(f"{farther} moved farther from the float64 reference")
    if closer:
        moves.append(f"{closer} moved closer to it")
    if same:
        moves.append(f"{same} stayed at the same distance")
    if moves:
        parts.append("; ".join(moves).capitalize() + ".")
    if verdict.acknowledged:
        parts.append(f"Acknowledged as intended by {verdict.acknowledged_by or 'a maintainer'}: "
                     f"{verdict.acknowledgement_note}")
    return " ".join(parts)
