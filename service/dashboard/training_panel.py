"""The commit / verify page's training-impact section (issue 46): per model x optimizer
configuration, the loss curves of the commit and its baseline with the two controls shaded, the
verdict and its sentence; or the job's state (queued / running with its progress, failed with its
error, not needed) while there is no verdict yet.

The bands are computed here from the stored per-seed losses (service.core.training.LossCurves),
since the job stores every run's loss and not these summaries:

  seed spread    per step, the baseline's mean loss ± one sample standard deviation over the seeds
                 (what a different init and data order does to the loss)
  one-ulp floor  per step, the baseline's mean loss ± the root mean square over the seeds of
                 (floor − baseline): how far a one-ulp change of the initial parameters moves it

A diverged run's NaN / inf losses are left out of a step's figures; a step with no finite value is
a gap (JSON has no NaN). Every string of a result (labels, reasons, errors) reaches the page through
the template's autoescape; the JSON the plots read holds numbers only.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from service.core.training import (
    IMPACT_VERDICTS, IMPACT_WORDS, LossCurves, ModelImpact, TrainingImpact, impact_sentence, worst_verdict,
)
from service.db.training_models import (
    TRAINING_FAILED, TRAINING_NOT_NEEDED, TRAINING_QUEUED, TRAINING_RUNNING, TrainingImpactJob,
)
from service.domain.training_impacts import view

# Panels drawn: every model x configuration of the standard model set (2 models x 4 configurations);
# past it, results are listed by their sentence alone.
MAX_PANELS = 8

# A verdict's badge: its words (impact_sentence leads with the same) and its CSS class. The colour
# repeats the words: green where nothing beyond a one-ulp change happened, amber within seed noise,
# red beyond it, black for a diverged model, grey where no verdict was reached.
VERDICT_BADGES: dict[str, tuple[str, str]] = {
    verdict: (IMPACT_WORDS[verdict], f"impact-{verdict.replace('_', '-')}") for verdict in IMPACT_VERDICTS}
assert set(VERDICT_BADGES) == set(IMPACT_VERDICTS), "a verdict without a badge"


def verdict_badge(verdict: str | None) -> tuple[str, str]:
    return VERDICT_BADGES.get(verdict or "not_judged", VERDICT_BADGES["not_judged"])


@dataclass(frozen=True)
class CurveBands:
    """Per step (1-based `steps`), the commit's and the baseline's mean loss over the seeds and the
    two control bands around the baseline's mean; None where a step has no finite figure."""

    steps: list[int]
    commit_mean: list[float | None]
    baseline_mean: list[float | None]
    spread_low: list[float | None]
    spread_high: list[float | None]
    floor_low: list[float | None]
    floor_high: list[float | None]


def _at(runs: list[list[float]], step: int) -> list[float]:
    return [run[step] for run in runs if step < len(run) and math.isfinite(run[step])]


def _mean(values: list[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


def _sample_std(values: list[float]) -> float | None:
    if len(values) < 2:
        return None
    mean = math.fsum(values) / len(values)
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _floor_rms(baseline: list[list[float]], floor: list[list[float]], step: int) -> float | None:
    """RMS over the seeds of (floor − baseline) at `step`, paired by seed (both finite)."""
    differences = [f[step] - b[step] for b, f in zip(baseline, floor)
                   if step < len(b) and step < len(f) and math.isfinite(b[step]) and math.isfinite(f[step])]
    return math.sqrt(math.fsum(d * d for d in differences) / len(differences)) if differences else None


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def curve_bands(curves: LossCurves) -> CurveBands:
    length = max((len(run) for runs in (curves.commit, curves.baseline, curves.floor) for run in runs), default=0)
    commit_mean, baseline_mean, spread_low, spread_high, floor_low, floor_high = [], [], [], [], [], []
    for step in range(length):
        base = _mean(_at(curves.baseline, step))
        spread = _sample_std(_at(curves.baseline, step))
        rms = _floor_rms(curves.baseline, curves.floor, step)
        commit_mean.append(_finite(_mean(_at(curves.commit, step))))
        baseline_mean.append(_finite(base))
        spread_low.append(_finite(base - spread) if base is not None and spread is not None else None)
        spread_high.append(_finite(base + spread) if base is not None and spread is not None else None)
        floor_low.append(_finite(base - rms) if base is not None and rms is not None else None)
        floor_high.append(_finite(base + rms) if base is not None and rms is not None else None)
    return CurveBands(list(range(1, length + 1)), commit_mean, baseline_mean, spread_low, spread_high,
                      floor_low, floor_high)


@dataclass(frozen=True)
class TrainingPanel:
    """One model x configuration: what its card says and, where the curves are stored, what it draws."""

    model: str
    config_label: str
    verdict: str
    badge_text: str
    badge_css: str
    sentence: str
    seeds: int
    first_divergent_step: int | None
    bands: CurveBands | None


def panel(result: ModelImpact) -> TrainingPanel:
    text, css = verdict_badge(result.figures.verdict)
    return TrainingPanel(model=result.model, config_label=result.config.label, verdict=result.figures.verdict,
                         badge_text=text, badge_css=css, sentence=impact_sentence(result),
                         seeds=result.figures.seeds, first_divergent_step=result.first_divergent_step,
                         bands=curve_bands(result.curves) if result.curves is not None else None)


@dataclass
class TrainingSection:
    """What the page's "Training impact" section shows. `state`: none (no job: a one-line note where
    the run changed, else nothing), queued, running, failed, not_needed or done."""

    state: str
    job: TrainingImpact | None = None
    panels: list[TrainingPanel] = field(default_factory=list)
    listed: list[TrainingPanel] = field(default_factory=list)   # past MAX_PANELS: their sentence alone
    worst: str | None = None
    worst_text: str | None = None
    worst_css: str | None = None
    changed: bool = False

    @property
    def shown(self) -> bool:
        return self.state != "none" or self.changed

    def as_json(self) -> str:
        """The drawn panels' numbers for dashboard.js, safe inside a <script> element: numbers and
        step indices only (no stored string reaches the plotting code)."""
        payload = [{"panel": index, "first_divergent_step": p.first_divergent_step, "seeds": p.seeds,
                    **({"steps": p.bands.steps, "commit_mean": p.bands.commit_mean,
                        "baseline_mean": p.bands.baseline_mean, "spread_low": p.bands.spread_low,
                        "spread_high": p.bands.spread_high, "floor_low": p.bands.floor_low,
                        "floor_high": p.bands.floor_high} if p.bands is not None else {})}
                   for index, p in enumerate(self.panels, start=1)]
        return json.dumps(payload, allow_nan=False).replace("<", "\\u003c")


def section(row: TrainingImpactJob | None, *, changed: bool) -> TrainingSection:
    """The section of a run whose latest job is `row` (None: it has none). `changed`: the run's
    verdict found changed trajectories (the case a job is opened for after the co-run)."""
    if row is None:
        return TrainingSection(state="none", changed=changed)
    job = view(row, curves=True)
    if job.status in (TRAINING_QUEUED, TRAINING_RUNNING, TRAINING_FAILED, TRAINING_NOT_NEEDED):
        return TrainingSection(state=job.status, job=job, changed=changed)
    # done (TRAINING_DONE); a state this page does not know yet shows its results the same way.
    # The most severe first: the card a reader must see is never the last one.
    ordered = sorted(job.results, key=lambda r: -IMPACT_VERDICTS.index(r.figures.verdict)
                     if r.figures.verdict != "not_judged" else 0)
    panels = [panel(result) for result in ordered]
    worst = worst_verdict([result.figures.verdict for result in job.results])
    text, css = verdict_badge(worst) if worst else (None, None)
    return TrainingSection(state=job.status, job=job, panels=panels[:MAX_PANELS], listed=panels[MAX_PANELS:],
                           worst=worst, worst_text=text, worst_css=css, changed=changed)
