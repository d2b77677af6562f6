"""The one place a verdict becomes words and numbers, for every surface: the stored summary
(RunComparison.summary), the dashboard, the CLI report, the notifier's check runs, comments and
webhooks, `optdrift check`. Every figure it writes is a field (ComparisonFigures, CaseComparison):
nothing reads these words back.

Numbers: `number(x)` writes SIGNIFICANT_DIGITS significant digits and always the power of ten
(`1.255e-02`, never `1.255` or `0.01255`), so a figure keeps its scale in any cell and reads the
same on every surface; 0, NaN, +inf, -inf as such; "—" (or `missing`) for no value. `ratio(x)` is
`×` + number(x); `size(x, unit)` appends a unit. Display only: stored values keep full precision.
tests/service/core/test_wording.py checks the table, that no figure loses its exponent, and that no other module
formats a float with a precision spec of its own.

In a Jinja template (service/dashboard/routes.py and speed_pages.py register it):

    templates.env.filters["number"] = wording.number      # {{ case.max_abs_diff | number }}
    {{ value | number(3) }}                                # three significant digits

`sci` is the same filter under its older name. The dashboard's JavaScript mirrors `number` as
`optdrift.number` (service/dashboard/static/dashboard.js; plots put its text in `customdata` for
their hover); tests/service/core/test_wording.py runs both on one table of values and checks they agree.
"""

from __future__ import annotations

import math
from collections import Counter

from service.core.results import CaseComparison, ComparisonFigures, RepeatCheck, ScaleGroup

# Four digits: enough to tell two distances to float64 apart when a change moved them a little, and
# what the commit page showed before (it had 1.255e-02 where the CLI had 0.0126).
SIGNIFICANT_DIGITS = 4
MISSING = "—"


def number(value: float | int | None, digits: int = SIGNIFICANT_DIGITS, missing: str = MISSING) -> str:
    """`value` for display: `digits` significant digits and its power of ten, always written
    (1.255e-02, -3.000e+04, 0 for exactly zero, NaN, +inf, -inf; `missing` for None)."""
    if value is None:
        return missing
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+inf" if value > 0 else "-inf"
    if value == 0:
        return "0"
    return f"{value:.{max(1, digits) - 1}e}"


def compact_number(value: float | int | None, missing: str = MISSING) -> str:
    """`value` in 3 significant digits with its power of ten, the exponent unpadded, for a narrow
    terminal's table (service/core/terminal_tables.py): 1.19e-5, -3.00e+4; otherwise as `number`
    (0, NaN, +inf, -inf, `missing`). float() reads it back."""
    if value is None or value == 0 or math.isnan(float(value)) or math.isinf(float(value)):
        return number(value, missing=missing)
    mantissa, exponent = f"{float(value):.2e}".split("e")
    return f"{mantissa}e{int(exponent):+d}"


def percent(fraction: float | None, missing: str = MISSING) -> str:
    """A relative change as a signed percentage in 3 significant digits: +0.714 %, -3.4 %, +1.59e-04 %
    (a training impact's shift of the loss: service/core/training.py)."""
    if fraction is None:
        return missing
    if not math.isfinite(fraction):
        return number(fraction, missing=missing)
    return f"{fraction * 100:+.3g} %"


def ratio(value: float | None, digits: int = SIGNIFICANT_DIGITS, missing: str = MISSING) -> str:
    """A factor: ×1.440e+03."""
    return missing if value is None else "×" + number(value, digits)


def size(value: float | None, unit: str, digits: int = SIGNIFICANT_DIGITS, missing: str = MISSING) -> str:
    """A figure with its unit: 3.000e+00 ulp."""
    return missing if value is None else f"{number(value, digits)} {unit}"


def plural(count: int, word: str) -> str:
    """'1 case', '3 cases', '2 trajectories'."""
    if count == 1:
        return f"1 {word}"
    return f"{count} {word[:-1] + 'ies' if word.endswith('y') else word + 's'}"


def listed(items: list[str], shown: int = 3) -> str:
    return "; ".join(items[:shown]) + (f" (+{len(items) - shown} more)" if len(items) > shown else "")


def first_line(text: str | None) -> str:
    return text.splitlines()[0] if text else ""


def before_after(before: float | None, after: float | None, missing: str = MISSING) -> str:
    """'9.000e-06 → 1.300e-02' (a distance before, in the baseline, → after, in the commit)."""
    if before is None and after is None:
        return missing
    return f"{number(before, missing=missing)} → {number(after, missing=missing)}"


# ----------------------------------------------------------------------------- sizes per scale
def scale_label(group: ScaleGroup) -> str:
    return f"{group.family} {group.dtype}"


def scale_move(group: ScaleGroup) -> str:
    """The move in the cases' own scale: 'unchanged in scale (×9.861e-01)' or '×1.444e+03' or
    '×1.000e+00 to ×1.444e+03 per case'."""
    if group.ratio_low is None or group.ratio_high is None:
        return "no distance to compare"
    low, high = ratio(group.ratio_low), ratio(group.ratio_high)
    spread = low if low == high else f"{low} to {high} per case"
    return f"unchanged in scale ({spread})" if group.same_scale else spread


def scale_line(group: ScaleGroup) -> str:
    """One line: '32bit float32 (12 cases): peak distance to float64 9.000e-06 → 1.300e-02,
    ×1.444e+03 (12 farther); largest |commit - baseline| 1.250e-02'."""
    moves = ", ".join(f"{n} {d}" for d, n in sorted(group.directions.items()))
    text = (f"{scale_label(group)} ({plural(group.cases, 'case')}): peak distance to float64 "
            f"{before_after(group.baseline_peak, group.commit_peak, '-')}, {scale_move(group)}"
            + (f" ({moves})" if moves else ""))
    if group.largest_diff is not None:
        text += f"; largest |commit - baseline| {number(group.largest_diff)}"
    if group.quantized:
        text += ("; with 8-bit states this distance is their quantization error, large by design: "
                 "only its change in scale says something")
    return text


def scale_sentence(groups: list[ScaleGroup]) -> str:
    """The dashboard's sentence: every group in its own scale, never one figure across them."""
    if not groups:
        return ""
    parts = []
    for group in groups:
        text = (f"{scale_label(group)}, {plural(group.cases, 'case')}: "
                f"{before_after(group.baseline_peak, group.commit_peak)}, {scale_move(group)}")
        if group.quantized:
            text += " (with 8-bit states the distance to float64 is their quantization error, large by design)"
        parts.append(text)
    return "Peak distance to float64 per family and dtype, each in its own scale: " + "; ".join(parts) + "."


# ----------------------------------------------------------------------------- the stored summary
def summary(verdict: str, cases: list[CaseComparison], figures: ComparisonFigures, *,
            other_battery: bool = False) -> str:
    """The verdict's few lines (RunComparison.summary): what a person reads in ten seconds. Every
    figure in it is also a field of `figures` or of a case; nothing reads these words back."""
    counts = Counter(c.verdict for c in cases)
    lines = [f"{verdict.upper()}: " + ", ".join(f"{n} {v}" for v, n in sorted(counts.items()))
             + f" of {len(cases)} cases"]
    if other_battery:
        lines.append("warning: the baseline ran a different battery; only shared case ids are compared")
    for name, part in (("broken", _broken_line), ("nondeterministic", _nondeterministic_line),
                       ("not_applicable", _not_applicable_line)):
        line = part([c for c in cases if c.verdict == name])
        if line:
            lines.append(line)
    changed = [c for c in cases if c.verdict == "changed"]
    if changed:
        lines += _changed_lines(changed, figures)
    moved = [c for c in cases if c.reference_changed]
    if moved:
        lines.append(reference_changed_line(moved))
    return "\n".join(lines)


REFERENCE_CHANGED = "reference changed"


def reference_changed_line(cases: list[CaseComparison]) -> str:
    """The cases whose references (torch, torch.optim) differ from the baseline's: not the commit's
    doing; their verdicts stand (kernel against kernel), their directions are not judged."""
    by_optimizer = Counter(c.optimizer for c in cases)
    return (f"{REFERENCE_CHANGED} since the baseline (torch or torch.optim differs), not this commit's doing: "
            + ", ".join(f"{o} {n}" for o, n in sorted(by_optimizer.items()))
            + f" ({plural(len(cases), 'case')}); their verdicts compare the kernels alone, "
              "their distance to the references is not compared")


def _broken_line(cases: list[CaseComparison]) -> str:
    return "broken: " + listed([f"{c.case_id}: {first_line(c.message)}" for c in cases]) if cases else ""



def nondeterministic_case(check: RepeatCheck) -> str:
    """One nondeterministic case's message: its repeats, and its blame when the baseline was repeated."""
    text = (f"{check.differing} of {check.runs - 1} repeats on the same build differ from the first run, "
            f"from step {check.first_divergent_step}")
    if check.origin == "introduced":
        return (f"{text}; became nondeterministic in this commit (the baseline build reproduced itself "
                f"{check.baseline_runs} times)")
    if check.origin == "pre-existing":
        return (f"{text}; nondeterministic before this commit too ({check.baseline_differing} of "
                f"{check.baseline_runs - 1} repeats of the baseline build differ)")
    return text


# The run-level headings, by blame (CaseComparison.nondeterminism).
NONDETERMINISTIC_HEADINGS = {
    "introduced": "became nondeterministic in this commit (the baseline build reproduces itself)",
    "pre-existing": "nondeterministic before this commit too (shown, not blamed)",
    None: "nondeterministic (repeats on the same build differ; the baseline build was not repeated)",
}


def _nondeterministic_line(cases: list[CaseComparison]) -> str:
    lines = []
    for origin, heading in NONDETERMINISTIC_HEADINGS.items():
        group = [c for c in cases if c.nondeterminism == origin]
        if group:
            lines.append(f"{heading}: " + listed([
                f"{c.case_id}: {c.repeat_check.differing} of {c.repeat_check.runs - 1} repeats "
                f"differ from step {c.repeat_check.first_divergent_step}" for c in group]))
    return "\n".join(lines)


def _not_applicable_line(cases: list[CaseComparison]) -> str:
    if not cases:
        return ""
    # Grouped by reason: an adapter gives one reason for a whole family of cases (no bf16 kernel).
    reasons = Counter(first_line(c.message) or "no reason given" for c in cases)
    return (f"not applicable on this device, not judged: {plural(len(cases), 'case')} — "
            + listed([f"{reason} ({n})" for reason, n in reasons.most_common()]))



def _changed_lines(changed: list[CaseComparison], figures: ComparisonFigures) -> list[str]:
    by_optimizer = Counter(c.optimizer for c in changed)
    lines = ["changed: " + ", ".join(f"{o} {n}" for o, n in sorted(by_optimizer.items())),
             "first divergent step: " + ", ".join(f"step {s} ({n} cases)"
                                                  for s, n in sorted(figures.first_steps.items())[:4])]
    if figures.scales:
        lines.append("size, per family and dtype (each in its own scale, never compared across them):")
        lines += [f"  {scale_line(group)}" for group in figures.scales]
    moves = ", ".join(f"{n} {d}" for d, n in sorted(figures.directions.items()) if n)
    unjudged = sum(1 for c in changed if c.reference_changed)
    if unjudged:
        moves = ", ".join(filter(None, [moves, f"{unjudged} not judged ({REFERENCE_CHANGED})"]))
    text = f"vs float64 reference: {moves} (peak and mean distance over the steps that differ"
    if figures.final_ratio_low is not None:
        text += (f"; final distance commit/baseline from {ratio(figures.final_ratio_low)} "
                 f"to {ratio(figures.final_ratio_high)}")
    lines.append(text + ")")
    disagreeing = [c for c in changed if c.final_direction and c.direction != c.final_direction]
    if disagreeing:
        lines.append(f"final step alone reads otherwise for {plural(len(disagreeing), 'case')}: "
                     + listed([_disagreement(c) for c in disagreeing]))
    return lines


def _disagreement(case: CaseComparison) -> str:
    return (f"{case.case_id}: {case.direction} over the trajectory (peak "
            f"{before_after(case.baseline_peak_ref64_distance, case.commit_peak_ref64_distance)}), "
            f"{case.final_direction} at the final step "
            f"({before_after(case.baseline_final_ref64_distance, case.commit_final_ref64_distance)})")


# ----------------------------------------------------------------------------- the changed verdict in prose
def direction_moves(directions: dict[str, int]) -> str:
    """'3 moved farther from the float64 reference; 1 moved closer to it' (capitalized), '' for none."""
    words = {"farther": "moved farther from the float64 reference", "closer": "moved closer to it",
             "same": "stayed at the same distance"}
    moves = [f"{directions[d]} {words[d]}" for d in ("farther", "closer", "same") if directions.get(d)]
    return "; ".join(moves).capitalize()


def changed_sentence(figures: ComparisonFigures, against: str | None) -> str:
    """The dashboard's and the notifier's sentence for a changed verdict, from its figures."""
    first = figures.first_divergent_step
    parts = [f"Changed: {plural(figures.changed, 'trajectory')} of {figures.judged} differ from {against}'s"
             + (f", first at step {first}" if first else "") + "."]
    moves = direction_moves(figures.directions)
    # Every changed case counted: those without a direction (references moved, figures missing) too.
    not_judged = figures.changed - sum(figures.directions.get(d, 0) for d in ("farther", "closer", "same"))
    if not_judged > 0:
        moves = (moves + "; " if moves else "") + f"{not_judged} not judged"
    if moves:
        parts.append(moves + " (over the steps that differ).")
    sizes = scale_sentence(figures.scales)
    if sizes:
        parts.append(sizes)
    if figures.final_disagreeing:
        parts.append(f"The final step alone reads otherwise for {plural(figures.final_disagreeing, 'case')} "
                     "(marked below).")
    if figures.reference_changed:
        parts.append(reference_changed_sentence(figures))
    return " ".join(parts)


def reference_changed_sentence(figures: ComparisonFigures) -> str:
    """The dashboard's and the notifier's sentence for cases whose references moved."""
    return (f"The {REFERENCE_CHANGED} for {plural(figures.reference_changed, 'case')} (torch or torch.optim "
            "differs from the baseline's): not this commit's doing; those cases' directions are not judged.")


# ----------------------------------------------------------------------------- a build variant's change
# What each fast-math family flag approximates (service/core/environment_attribution.py decides
# which flags are of the family; the first one named decides the words).
_FAST_MATH_WORDS = {"ftz": "flush-to-zero of subnormals", "prec-sqrt": "an approximate square root",
                    "fassociative-math": "fast-math reassociation"}
FAST_MATH_RECIPROCAL = "a fast-math reciprocal"


def fast_math_words(flag: str) -> str:
    """'a fast-math reciprocal' (-ffast-math, -freciprocal-math, --use_fast_math, -prec-div=false),
    'flush-to-zero of subnormals' (-ftz=true), ..."""
    name = flag.lstrip("-").partition("=")[0]
    return _FAST_MATH_WORDS.get(name, FAST_MATH_RECIPROCAL)


def _which_build_has(flags: list[str], added: tuple[str, ...], a: str, b: str) -> str:
    """'cpu+fma builds with -mfma, cpu without' per flag."""
    return "; ".join(f"{b} builds with {flag}, {a} without" if flag in added else f"{a} builds with {flag}, {b} without"
                     for flag in flags)


def _ulps_from(first_step: int | None, first_step_ulps: float | None, peak_ulps: float | None) -> str:
    """'1.000e+00 ulp at step 1, 2.000e+01 ulp at most (ulps of the case's scale)'."""
    at = f" at step {first_step}" if first_step else " at the first divergent step"
    return f"{size(first_step_ulps, 'ulp')}{at}, {size(peak_ulps, 'ulp')} at most (ulps of the case's scale)"


def environment_looks_like(kind: str, *, numerical_class: str, a: str, b: str, flags: list[str],
                           flags_added: tuple[str, ...], compilers: tuple[str | None, str | None] | None,
                           first_step: int | None, first_step_ulps: float | None, peak_ulps: float | None,
                           variant_label: str | None = None, note: str | None = None,
                           one_way: bool = False) -> str:
    """The label of one case of B against A (service.core.environment_attribution.looks_like), naming
    its evidence: the flag that differs and the ulps, or the compilers. A change beyond rounding is
    said to be so, never called a rounding; one within rounding whose roundings fall one way
    (`one_way`) is said to drift."""
    ulps = _ulps_from(first_step, first_step_ulps, peak_ulps)
    which = _which_build_has(flags, flags_added, a, b)
    size_words = "within rounding but drifting one way (a bias below one ulp)" if one_way else "rounding-level"
    if kind == "fma-contraction":
        return f"looks like FMA contraction: {size_words}, {ulps}; {which}"
    if kind == "fast-math" and (numerical_class == "rounding-level" or one_way):
        return f"looks like {fast_math_words(flags[0])}: {size_words}, {ulps}; {which}"
    compilers_text = (f"{a} built by {compilers[0] or 'an unrecorded compiler'}, {b} by "
                      f"{compilers[1] or 'an unrecorded compiler'}" if compilers else "")
    differs = "; ".join(part for part in (compilers_text, which) if part)
    if kind == "another-compiler":
        return f"{size_words} (another compiler): {ulps}; {differs}"
    if kind == "rounding-level":
        return f"rounding-level: {ulps}; " + (differs or "no flag or compiler differs between the two builds")
    if kind == "not-attributed":
        return f"not attributed: {note}" if note else "not attributed"
    what = numerical_class + (f", follows {variant_label}" if variant_label else "")
    beyond = (f"beyond rounding ({what}): {size(peak_ulps, 'ulp')} at its peak from step {first_step or '?'} "
              "(ulps of the case's scale)")
    if kind == "fast-math":
        return f"{beyond}; {which}: looks like {fast_math_words(flags[0])} taken past a rounding"
    return f"{beyond}: not a rounding difference of the same arithmetic" + (f" ({differs})" if differs else "")


LOOKS_LIKE_HEADINGS = {"fma-contraction": "looks like FMA contraction", "fast-math": "looks like fast math",
                       "another-compiler": "rounding-level (another compiler)", "rounding-level": "rounding-level",
                       "beyond-rounding": "beyond rounding", "not-attributed": "not attributed"}


ONE_WAY = ":one-way"


def headline_kind(kind: str, evidence: dict | None) -> str:
    """A call's key in a headline: its kind, marked when its roundings fall one way (evidence
    "one_way", service.core.environment_attribution), so those are counted apart."""
    return kind + ONE_WAY if (evidence or {}).get("one_way") else kind


def _heading(kind: str) -> str:
    base = kind.removesuffix(ONE_WAY)
    heading = LOOKS_LIKE_HEADINGS.get(base, base)
    return heading + ", drifting one way" if kind.endswith(ONE_WAY) else heading


def looks_like_headline(calls: list[tuple[str, tuple[str, ...]]]) -> str | None:
    """One line for a variant's changed cases, most common call first, each with the flags it rests
    on: 'looks like FMA contraction, -mfma (38); looks like FMA contraction, drifting one way, -mfma (2);
    not attributed (4)'; None without calls. Kinds from headline_kind."""
    if not calls:
        return None
    counted = Counter(calls)
    return "; ".join(f"{_heading(kind)}{', ' + ' '.join(flags) if flags else ''} ({n})"
                     for (kind, flags), n in counted.most_common())


def tensor_summary(tensors: list, first_divergent_step: int | None = None) -> str:
    """A changed layout case's per-tensor rows (service.core.results.TensorComparison) in one line:
    which tensors changed, from which step, which way, and whether the guard elements between the
    tensors were written (a kernel writing past a tensor's end). A case whose digest changed
    before any tensor's did (`first_divergent_step`) changed first in the optimizer's shared state
    (step counters, bias-correction powers), which no tensor owns: said so."""
    changed = [t for t in tensors if t.index is not None and t.first_divergent_step is not None]
    same = [t for t in tensors if t.index is not None and t.first_divergent_step is None]
    guards = next((t for t in tensors if t.index is None), None)
    parts = [f"t{t.index} (group {t.group}, n={t.size}) from step {t.first_divergent_step}"
             + (f", {t.direction}" if t.direction else "") for t in changed]
    text = f"{len(changed)} of {len(changed) + len(same)} tensors changed"
    text += (": " + "; ".join(parts)) if parts else ""
    firsts = [t.first_divergent_step for t in tensors if t.first_divergent_step is not None]
    if first_divergent_step is not None and (not firsts or first_divergent_step < min(firsts)):
        text += (f"; the optimizer's shared state (step counters, bias-correction powers) changed first, "
                 f"from step {first_divergent_step}")
    if same:
        text += "; bit-identical: " + " ".join(f"t{t.index}" for t in same)
    if guards is not None and guards.first_divergent_step is not None:
        text += f"; guard elements between tensors WRITTEN from step {guards.first_divergent_step} (out of bounds)"
    return text
