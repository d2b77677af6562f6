"""How the dashboard says things: numbers, times and the verdict in one sentence."""

from __future__ import annotations

from datetime import datetime, timezone

from service.core.wording import number
from service.domain.dashboard_queries import ChangedCase, RunPage
from service.core.verdicts import change_size_by_scale


# The dashboard's number filter is the one formatter (service.core.wording.number); `sci` is its
# older filter name, kept so templates written with it show the same text.
sci = number


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
    sentence = _outcome_sentence(page)
    if page.verdict is None:
        return sentence
    # Cases set aside are said after the verdict, never in it.
    aside = page.counts.get("not_applicable", 0)
    unsteady = page.counts.get("nondeterministic", 0)
    if unsteady and page.verdict.outcome != "nondeterministic":
        sentence += (f" Also {_plural(unsteady, 'case')} did not reproduce on the same build "
                     "(nondeterministic, listed below).")
    if aside:
        sentence += (f" {_plural(aside, 'case')} not applicable on this device (the adapter's reasons below), "
                     "not judged.")
    return sentence


def _outcome_sentence(page: RunPage) -> str:
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
        if run.status == "error":
            return (f"optdrift error, not the commit's: {short_error(run.error)}. optdrift could not do this run "
                    "(source fetch, lost worker, database, disk or sandbox); it was retried, and resubmitting the "
                    "commit or `optdrift retry` runs it again. No verdict on the commit.")
        if run.status == "cancelled":
            return "The run was cancelled."
        return "Finished; the verdict waits for its baseline run to finish."
    against = (f"commit {page.baseline_commit_sha}" if page.baseline_commit_sha
               else f"run {verdict.baseline_run_id}" if verdict.baseline_run_id else None)
    # Judged cases only: not-applicable ones were set aside before the run.
    total = sum(n for name, n in page.counts.items() if name != "not_applicable")
    if verdict.outcome == "nondeterministic":
        cases = page.nondeterministic
        steps = sorted({c.first_divergent_step for c in cases if c.first_divergent_step})
        return (f"Nondeterministic: {_plural(len(cases), 'case')} of {total} did not reproduce on the same build "
                + (f"(repeats differ from step {steps[0]})" if steps else "(repeats differ)")
                + ". A finding about the kernel itself, not a change against the baseline; the repeat figures "
                  "are listed below.")
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
        parts.append("; ".join(moves).capitalize() + " (over the steps that differ).")
    sizes = size_sentence(changed)
    if sizes:
        parts.append(sizes)
    disagreeing = sum(1 for c in changed if c.final_direction and c.final_direction != c.direction)
    if disagreeing:
        parts.append(f"The final step alone reads otherwise for {_plural(disagreeing, 'case')} (marked below).")
    if verdict.acknowledged:
        parts.append(f"Acknowledged as intended by {verdict.acknowledged_by or 'a maintainer'}: "
                     f"{verdict.acknowledgement_note}")
    return " ".join(parts)


def size_sentence(changed: list[ChangedCase]) -> str:
    """How far the changed cases moved, per kernel family and dtype, each in its own scale (the
    one grouping every verdict text uses: service.core.verdicts.change_size_by_scale), never one figure
    across scales; an 8-bit group's distance is said to be its quantization error."""
    groups = change_size_by_scale([
        {"case_id": c.case_id, "verdict": c.verdict, "family": c.family, "param_dtype": c.dtype,
         "direction": c.direction, "baseline_peak_ref64_distance": c.baseline_peak,
         "commit_peak_ref64_distance": c.commit_peak,
         "max_abs_diff_per_step": [c.max_abs_diff] if c.max_abs_diff is not None else None}
        for c in changed])
    if not groups:
        return ""
    parts = []
    for group in groups:
        text = (f"{group.label}, {_plural(group.cases, 'case')}: {sci(group.baseline_peak, 2)} → "
                f"{sci(group.commit_peak, 2)}, {group.scale_text}")
        if group.quantized:
            text += " (with 8-bit states the distance to float64 is their quantization error, large by design)"
        parts.append(text)
    return "Peak distance to float64 per family and dtype, each in its own scale: " + "; ".join(parts) + "."
