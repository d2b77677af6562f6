"""How the dashboard says things: numbers, times and the verdict in one sentence."""

from __future__ import annotations

import re
from collections.abc import Callable

from markupsafe import Markup
from datetime import datetime, timezone

from service.core import not_buildable, outcomes
from service.core.verdicts import change_size_by_scale
from service.core.wording import changed_sentence, first_line, number, plural, scale_sentence
from service.db.models import Run
from service.domain.dashboard_queries import ChangedCase, RunPage


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


def verdict_sentence(page: RunPage) -> str:
    sentence = _outcome_sentence(page)
    if page.verdict is None:
        return sentence
    # Cases set aside are said after the verdict, never in it.
    aside = page.counts.get("not_applicable", 0)
    unsteady = page.counts.get("nondeterministic", 0)
    if unsteady and page.verdict.outcome != outcomes.NONDETERMINISTIC:
        sentence += (f" Also {plural(unsteady, 'case')} did not reproduce on the same build "
                     "(nondeterministic, listed below).")
    if aside:
        sentence += (f" {plural(aside, 'case')} not applicable on this device (the adapter's reasons below), "
                     "not judged.")
    return sentence


def _outcome_sentence(page: RunPage) -> str:
    if page.verdict is None:
        return _status_sentence(page.run)
    return _VERDICT_SENTENCES.get(page.verdict.outcome, _changed)(page)


# ----------------------------------------------------------------------------- no verdict yet
def _running(run: Run) -> str:
    return f"Running: {run.cases_done} of {run.cases_total or 0} cases done. This page updates by itself."


def not_buildable_line(error: str | None, environment: str | None) -> str | None:
    """The tree's line refusing the toolchain (its first line) when a run's error is
    service.core.not_buildable's sentence ('not buildable in <environment>: <line>'); else None."""
    refusal = not_buildable.refusal_in(error)
    if refusal is None:
        return None
    said = not_buildable.sentence(environment or "", "")
    line = refusal.removeprefix(said) if refusal.startswith(said) else refusal.partition(": ")[2]
    return first_line(line.strip()) or first_line(refusal)


def _failed(run: Run) -> str:
    if (line := not_buildable_line(run.error, run.environment)) is not None:
        # Not the commit's fault: the tree says it does not support this toolchain (issue 47).
        return (f"Not buildable here: {line}. This tree refuses the toolchain of {run.environment} (its CUDA, "
                "compiler or torch), so nothing was checked (the build log below).")
    return f"The run failed: {short_error(run.error)} (full text: the build log below)."


def _optdrift_error(run: Run) -> str:
    return (f"optdrift error, not the commit's: {short_error(run.error)}. optdrift could not do this run "
            "(source fetch, lost worker, database, disk or sandbox); it was retried, and resubmitting the "
            "commit or `optdrift retry` runs it again. No verdict on the commit.")


_STATUS_SENTENCES: dict[str, Callable[[Run], str]] = {
    "queued": lambda run: "Queued: waiting for a worker.",
    "building": lambda run: "Building the kernels.",
    "running": _running,
    "failed": _failed,
    "error": _optdrift_error,
    "cancelled": lambda run: "The run was cancelled.",
}


def _status_sentence(run: Run) -> str:
    sentence = _STATUS_SENTENCES.get(run.status)
    return sentence(run) if sentence else "Finished; the verdict waits for its baseline run to finish."


# ----------------------------------------------------------------------------- a verdict
def _against(page: RunPage) -> str | None:
    if page.baseline_commit_sha:
        return f"commit {page.baseline_commit_sha}"
    return f"run {page.verdict.baseline_run_id}" if page.verdict.baseline_run_id else None


def _nondeterministic(page: RunPage) -> str:
    cases = page.nondeterministic
    steps = sorted({c.first_divergent_step for c in cases if c.first_divergent_step})
    return (f"Nondeterministic: {plural(len(cases), 'case')} of {page.figures.judged} did not reproduce on the "
            "same build " + (f"(repeats differ from step {steps[0]})" if steps else "(repeats differ)")
            + ". Each one's blame (introduced in this commit, or nondeterministic before it too) and "
              "repeat figures are listed below.")


def _unchanged(page: RunPage) -> str:
    return (f"Unchanged: all {page.figures.judged} trajectories are bit-identical to {_against(page)}'s at "
            "every step (parameters and optimizer state).")


def _no_baseline(page: RunPage) -> str:
    return (f"No baseline: nothing earlier ran this battery in {page.run.environment}, so there is nothing "
            f"to compare with; {page.figures.judged} cases were recorded.")


def _broken(page: RunPage) -> str:
    broken, against = page.counts.get("broken", 0), _against(page)
    if broken:
        return (f"Broken: {plural(broken, 'case')} crashed, hung or produced NaN/Inf"
                + (f" (compared with {against})." if against else "."))
    return f"Broken: {short_error(page.run.error)} (full text: the build log below)."


def _changed(page: RunPage) -> str:
    sentence = changed_sentence(page.figures, _against(page))
    verdict = page.verdict
    if verdict.acknowledged:
        sentence += (f" Acknowledged as intended by {verdict.acknowledged_by or 'a maintainer'}: "
                     f"{verdict.acknowledgement_note}")
    return sentence


# Each outcome's sentence is the builder its row of service/core/outcomes.py names (page_sentence).
_VERDICT_SENTENCES: dict[str, Callable[[RunPage], str]] = {
    row.name: globals()[row.page_sentence] for row in outcomes.OUTCOMES}


def size_sentence(changed: list[ChangedCase]) -> str:
    """How far the changed cases moved, per kernel family and dtype, each in its own scale (the
    one grouping every verdict text uses: service.core.verdicts.change_size_by_scale), never one figure
    across scales; an 8-bit group's distance is said to be its quantization error."""
    return scale_sentence(change_size_by_scale([
        {"case_id": c.case_id, "verdict": c.verdict, "family": c.family, "param_dtype": c.dtype,
         "direction": c.direction, "baseline_peak_ref64_distance": c.baseline_peak,
         "commit_peak_ref64_distance": c.commit_peak,
         "max_abs_diff_per_step": [c.max_abs_diff] if c.max_abs_diff is not None else None}
        for c in changed]))


def build_line(environment_detail: dict | None) -> str | None:
    """What built the kernels, in one line (issue 36: the run's toolchain and build variant, as the
    API returns them): "g++ (Debian 12.2.0-14) 12.2.0; nvcc release 12.4, V12.4.131 · variant:
    compiler clang++, cflags -O3"; None before the worker has built."""
    detail = environment_detail or {}
    toolchain, variant = detail.get("toolchain") or {}, detail.get("build_variant") or {}
    parts = []
    if toolchain.get("cxx_version"):
        parts.append(toolchain["cxx_version"] + (f"; nvcc {toolchain['nvcc_version']}"
                                                 if toolchain.get("nvcc_version") else ""))
    said = [f"{key.replace('_', ' ')} {' '.join(value) if isinstance(value, list | tuple) else value}"
            for key, value in variant.items() if value not in (None, [], ())]
    parts.append("build variant: " + (", ".join(said) if said else "the worker's default"))
    return " · ".join(parts) if toolchain or variant else None


# ----------------------------------------------------------------------------- any stored value, for people
_ABSOLUTE_PATH = re.compile(r"(?<![\w.])(?:/[^\s/:;,'\"()]+){2,}/?|[A-Za-z]:\\[^\s;,'\"()]+")


def without_paths(text: str) -> str:
    """`text` with every absolute path cut to its last part: a worker's file system layout (its home,
    its build folders) is nobody's business on a page, and says nothing about the run."""
    return _ABSOLUTE_PATH.sub(lambda m: "…/" + re.split(r"[/\\]", m.group(0).rstrip("/\\"))[-1], text)


def shown(value: object) -> str:
    """A stored value (a fingerprint's field, an adapter's describe(), a verdict's field) in words:
    never a Python repr (no {'a': 1}, no True/False/None), never a worker's path."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return number(value)
    if isinstance(value, dict):
        return "; ".join(f"{str(key).replace('_', ' ')}: {shown(item)}" for key, item in value.items()) or "—"
    if isinstance(value, (list, tuple, set)):
        return ", ".join(shown(item) for item in value) or "—"
    return without_paths(str(value))


def not_judged(figures) -> int:  # noqa: ANN001
    """Changed cases with no direction (references changed, or figures missing): with farther,
    closer and same they add up to the changed count the headline says."""
    directions = figures.directions or {}
    return max(0, figures.changed - sum(directions.get(d, 0) for d in ("farther", "closer", "same")))


def unbroken_words(text: str | None) -> Markup:
    """`text` with each word kept on one line (a flag such as -fopenmp never splits at its dash);
    lines break between words only."""
    return Markup(" ").join(Markup('<span class="nobreak">{}</span>').format(word) for word in (text or "").split(" "))
