"""Training impact (issue 46): does a changed commit's optimizer change what a model learns?

For a changed commit the worker trains small reference models with the commit's optimizer and with
its baseline's, everything else identical and deterministic (worker/training: the models, the data,
the loop; worker/jobs/training.py: the job). This module is what both sides share, with no torch:

  TrainingConfig     the optimizer as the changed cases ran it (optimizer, family, dtype, hyper)
  TrainingRunSpec    one training run: model, configuration, seed, steps, the one-ulp control
  TrainingRunAnswer  what a kernel host answers for one run (checked: the box wrote it)
  MODEL_SETS         which models, how many paired seeds and steps a job trains
  configs_from_cases the configurations a job trains, chosen from the changed cases
  ModelImpact        one model x configuration: the verdict, its figures, the loss curves
  TrainingImpact     a job as the API serves it

A verdict per model and configuration (worker/training/stats.py decides it; IMPACT_VERDICTS lists
them in order of severity): identical (the parameters never differed), within the one-ulp floor,
beyond the floor but within seed noise, beyond seed noise, diverged, or not judged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from service.core.results import CaseSpec, KernelFamily, OptimizerName, ParamDtype
from service.core.wording import percent

ModelName = Literal["mlp", "transformer"]
ModelSetName = Literal["quick", "standard"]
# Most to least reassuring; a job's headline is its most severe model verdict.
IMPACT_VERDICTS = ("identical", "within_floor", "within_noise", "beyond_noise", "diverged", "not_judged")
# The words every surface shows for a verdict (badges, the sentence, the CLI, the PR comment).
IMPACT_WORDS = {"identical": "identical", "within_floor": "within the one-ulp floor",
                "within_noise": "within seed noise", "beyond_noise": "beyond seed noise",
                "diverged": "diverged", "not_judged": "not judged"}
ImpactVerdict = Literal["identical", "within_floor", "within_noise", "beyond_noise", "diverged", "not_judged"]
JobStatus = Literal["queued", "running", "done", "failed", "not_needed"]
# A digest the host answers is the engine's od2 text ("od2:" + 32 hex digits); anything longer is
# not one (and would let a box inflate what the worker stores).
MAX_DIGEST_CHARS = 64
MAX_TRAINING_STEPS = 2000


class _Model(BaseModel):
    # As service.core.results': NaN / inf (a diverged run's loss) serialise as strings JSON accepts.
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="strings")


@dataclass(frozen=True)
class ModelSet:
    """What one job trains: each model, per configuration, `seeds` paired seeds x 3 runs (the
    commit, the baseline, the baseline from one-ulp-perturbed parameters) of `steps` steps."""

    models: tuple[str, ...]
    seeds: int
    steps: int
    max_configs: int


MODEL_SETS: dict[str, ModelSet] = {
    # The CPU worker's: within 90 s on 2 cores for one configuration (bench/training_impact.py).
    "quick": ModelSet(models=("mlp", "transformer"), seeds=6, steps=150, max_configs=2),
    # A GPU worker's: more seeds (the tests' power) and steps, more of the changed configurations.
    "standard": ModelSet(models=("mlp", "transformer"), seeds=8, steps=300, max_configs=4),
}


class TrainingConfig(_Model):
    """The optimizer as a changed case ran it: its kernels, state family, parameter dtype and every
    hyperparameter the kernel takes. A model's weights (2-D tensors) get these; its biases and
    norms a second param group without weight decay, as training code builds it."""

    optimizer: OptimizerName
    family: KernelFamily = "32bit"
    param_dtype: ParamDtype = "float32"
    hyper: dict[str, float | bool]

    @property
    def label(self) -> str:
        """adam · 32bit · fp32 · lr=0.1 · wd=0.1 (the case-name style: the figures that say which
        configuration, never the defaults every configuration shares)."""
        dtype = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[self.param_dtype]
        parts = [self.optimizer, self.family, dtype, f"lr={_short(self.hyper.get('lr'))}"]
        if self.hyper.get("weight_decay"):
            parts.append(f"wd={_short(self.hyper['weight_decay'])}")
        return " · ".join(parts)


def _short(value: float | bool | None) -> str:
    return "?" if value is None else f"{float(value):g}"


class TrainingRunSpec(_Model):
    """One training run in one kernel host (the request's `run`)."""

    model: ModelName
    config: TrainingConfig
    seed: int = Field(ge=0, lt=2**31)
    steps: int = Field(gt=0, le=MAX_TRAINING_STEPS)
    perturb_ulp: bool = Field(False, description="start from the seed's parameters each moved by one ulp "
                                                 "(the chaotic-floor control)")


class TrainingRunAnswer(_Model):
    """A host's answer for one run. The box wrote it: lengths, digest text and sizes are checked
    here before anything is kept; a loss may be NaN/inf (the run diverged)."""

    losses: list[float]
    digests: list[str]
    seconds: float = Field(ge=0.0)

    @field_validator("digests")
    @classmethod
    def _digest_text(cls, digests: list[str]) -> list[str]:
        for digest in digests:
            if len(digest) > MAX_DIGEST_CHARS or not digest.isascii():
                raise ValueError("a parameter digest is not the engine's digest text")
        return digests

    def check_length(self, steps: int) -> "TrainingRunAnswer":
        if len(self.losses) != steps or len(self.digests) != steps:
            raise ValueError(f"the host answered {len(self.losses)} losses and {len(self.digests)} digests "
                             f"for a run of {steps} steps")
        return self


def configs_from_cases(cases: list[CaseSpec], limit: int) -> list[TrainingConfig]:
    """The configurations a job trains: one per changed (optimizer, family, hyperparameter point),
    its float32 case where one changed (a model's loss in a low precision is a question of its own),
    ordered so that the first `limit` cover every changed hyperparameter point (lr, weight decay)
    before a second optimizer at any (whether a change matters depends on the point first: the
    decay reorder is within the floor at lr 0.1 / wd 0.1 and beyond it at lr 1e-3 / wd 1e-2). A
    layout case contributes its first group's hyperparameters."""
    chosen: dict[tuple, CaseSpec] = {}
    for case in cases:
        key = (case.optimizer, case.family, tuple(sorted(case.hyper.items())))
        held = chosen.get(key)
        if held is None or (held.param_dtype != "float32" and case.param_dtype == "float32"):
            chosen[key] = case
    by_point: dict[tuple, list[CaseSpec]] = {}
    # Within a point: the 32-bit family, float32, then the plainest case (gradient scaling and
    # skip-zeros are cases' probes of a kernel's corners, not how a model is trained).
    def order(key: tuple) -> tuple:
        hyper, case = dict(key[2]), chosen[key]
        unusual = (float(hyper.get("gnorm_scale", 1.0)) != 1.0) + bool(hyper.get("skip_zeros", False))
        return (key[1] != "32bit", key[1], case.param_dtype != "float32", unusual, key[0], key[2])

    for key in sorted(chosen, key=order):
        hyper = dict(key[2])
        point = (-float(hyper.get("weight_decay", 0.0)), -float(hyper.get("lr", 0.0)))
        by_point.setdefault(point, []).append(chosen[key])
    ordered: list[CaseSpec] = []
    queues = [by_point[point] for point in sorted(by_point)]
    while any(queues):
        for queue in queues:
            if queue:
                ordered.append(queue.pop(0))
    return [TrainingConfig(optimizer=c.optimizer, family=c.family, param_dtype=c.param_dtype, hyper=dict(c.hyper))
            for c in ordered[:limit]]


class Interval(_Model):
    low: float
    high: float


class ImpactFigures(_Model):
    """worker/training/stats.py's figures of one model x configuration (ImpactStats.as_json)."""

    verdict: ImpactVerdict
    seeds: int
    window: int
    baseline_mean: float | None = None
    shift: float | None = None
    shift_ci: Interval | None = None
    relative_shift: float | None = None
    relative_ci: Interval | None = None
    final_shift: float | None = None
    final_shift_ci: Interval | None = None
    seed_spread: float | None = None
    floor_rms: float | None = None
    change_rms: float | None = None
    p_floor: float | None = None
    p_noise: float | None = None
    diverged_commit: int = 0
    diverged_baseline: int = 0
    reason: str | None = None


class LossCurves(_Model):
    """Every run's loss at every step, per seed, at full precision (NaN where it diverged)."""

    commit: list[list[float]]
    baseline: list[list[float]]
    floor: list[list[float]]


class ModelImpact(_Model):
    model: ModelName
    config: TrainingConfig
    figures: ImpactFigures
    first_divergent_step: int | None = Field(None, description="1-based: the first step where the commit's "
                                                               "parameters differ from the baseline's, any seed")
    floor_first_divergent_step: int | None = None
    curves: LossCurves | None = None
    seconds: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.model} · {self.config.label}"


class TrainingProgress(_Model):
    runs_done: int = 0
    runs_total: int = 0
    phase: str | None = None


class TrainingImpact(_Model):
    """A training-impact job of a run against its baseline run, as stored and served."""

    id: int
    run_id: int
    baseline_run_id: int | None
    status: JobStatus
    model_set: ModelSetName
    device: str | None = None
    progress: TrainingProgress = TrainingProgress()
    results: list[ModelImpact] = []
    error: str | None = None
    seconds: float | None = None

    @property
    def worst(self) -> ImpactVerdict | None:
        return worst_verdict([result.figures.verdict for result in self.results])


def worst_verdict(verdicts: list[str]) -> str | None:
    """The most severe of `verdicts` (IMPACT_VERDICTS' order; not_judged only when nothing else)."""
    judged = [v for v in verdicts if v != "not_judged"]
    if not judged:
        return "not_judged" if verdicts else None
    return max(judged, key=IMPACT_VERDICTS.index)


def worst_first(results: list[ModelImpact]) -> list[ModelImpact]:
    """The results most severe first (IMPACT_VERDICTS' order; not judged last), stable otherwise."""
    def rank(result: ModelImpact) -> int:
        verdict = result.figures.verdict
        return -1 if verdict == "not_judged" else IMPACT_VERDICTS.index(verdict)
    return sorted(results, key=rank, reverse=True)


def impact_sentence(result: ModelImpact) -> str:
    """One line a maintainer reads: the verdict, the figure that backs it and the first step the
    parameters differ."""
    figures = result.figures
    step = (f"; parameters differ from step {result.first_divergent_step}"
            if result.first_divergent_step is not None else "")
    if figures.verdict == "identical":
        return "identical: the parameters never differ"
    if figures.verdict in ("diverged", "not_judged"):
        return f"{IMPACT_WORDS[figures.verdict]}: {figures.reason or 'no reason given'}{step}"
    ci = figures.relative_ci
    # "final loss": the mean loss of the last `window` steps (worker/training/stats.py window_for)
    shift = f"final loss {percent(figures.relative_shift)}" + (
        f" (95 % CI {percent(ci.low)} … {percent(ci.high)})" if ci is not None else "")
    words = "beyond the floor, within seed noise" if figures.verdict == "within_noise" else IMPACT_WORDS[figures.verdict]
    return f"{words}: {shift} over {figures.seeds} seeds{step}"
