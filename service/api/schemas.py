"""API schemas (pydantic), separate from the ORM models: what clients send and receive."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from typing import Annotated

from pydantic import (
    AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator,
)

from service.core.results import ComparisonFigures
from service.core.environments import ENVIRONMENT_PATTERN
from service.domain.errors import BadInputError
from service.domain.project_configuration import EffectiveConfiguration
from service.domain.submission_rules import check_battery


# A queue name: `cpu`, `gpu.sm90`, ...
# An environment (`cpu`, `gpu.sm90`) or one of its build variants (`cpu+clang`, service/core/environments.py).
EnvironmentName = Annotated[str, Field(min_length=1, max_length=100, pattern=ENVIRONMENT_PATTERN)]


def _battery_allowed(value: str) -> str:
    try:
        return check_battery(value)
    except BadInputError as exc:  # pydantic turns a ValueError into the field's 422
        raise ValueError(str(exc)) from exc


ProjectName = Annotated[str, Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
BuildKind = Annotated[str, Field(pattern=r"^(torch-extension|command)$")]
BatteryName = Annotated[str, AfterValidator(_battery_allowed)]
# Not stored: whether an environment no live worker serves is registered anyway (with a warning).
_ALLOW_UNSERVED = ("register environments no live worker serves (their worker starts later); the answer's "
                   "`warnings` name the worker setting that serves each (service/domain/registration_rules.py)")
_REGISTERED_NOTE = ("registered defaults: a tree's optdrift.toml overrides each of them for its own runs "
                    "(GET /api/v1/projects/{project} shows what the newest commit's runs use)")


class ProjectCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: ProjectName
    build_kind: BuildKind = Field("torch-extension", description=_REGISTERED_NOTE)
    build_command: str | None = None
    adapter: str = "bundled"
    default_battery: BatteryName = "quick"
    # Registered environments: submissions may only name these (each is a run and a worker queue).
    environments: list[EnvironmentName] = Field(default_factory=lambda: ["cpu"], min_length=1,
                                                max_length=32)
    allow_unserved: bool = Field(False, description=_ALLOW_UNSERVED)


class ProjectUpdate(BaseModel):
    """The registered fields to change; those left out stay as they are."""

    model_config = ConfigDict(extra="forbid")
    build_kind: BuildKind | None = None
    build_command: str | None = None
    adapter: str | None = Field(None, min_length=1)
    default_battery: BatteryName | None = None
    environments: list[EnvironmentName] | None = Field(None, min_length=1, max_length=32)
    allow_unserved: bool = Field(False, description=_ALLOW_UNSERVED)

    @model_validator(mode="after")
    def _only_build_command_may_be_cleared(self) -> "ProjectUpdate":
        cleared = sorted(name for name in self.model_fields_set
                         if getattr(self, name) is None and name != "build_command")
        if cleared:
            raise ValueError(f"{', '.join(cleared)} cannot be null; leave a field out to keep it")
        return self


class ProjectPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)
    id: int
    name: str
    build_kind: str
    build_command: str | None
    adapter: str
    default_battery: str
    environments: list[str]
    created_at: datetime


class ProjectRegistered(ProjectPublic):
    """A created or changed project, with what registration warns of (environments no live worker
    serves yet, each with the worker setting that serves it)."""

    warnings: list[str] = Field(default_factory=list)


class ProjectDetail(ProjectPublic):
    """One project, with what its runs are really configured with."""

    configuration: EffectiveConfiguration


class ProjectsPublic(BaseModel):
    data: list[ProjectPublic]


class BuildProgress(BaseModel):
    """Where a building run's build has got to: read from its log by the worker (ninja's [n/m],
    CMake's [ 45%], compile lines counted; worker.build.progress), stored at most once a second."""

    phase: Literal["building"]
    done: int | None = Field(description="units compiled (ninja's steps, compile lines), or the percentage for "
                                         "unit percent; None: the build has said nothing countable yet")
    total: int | None = Field(description="units in all (ninja's m in [n/m]); 100 for unit percent; None: unknown")
    unit: Literal["units", "percent"]
    text: str = Field(description="as the run page says it: 'building: 12/40 units', 'building: 45 %', "
                                  "'building: 3 units compiled', 'building'")

    @classmethod
    def of(cls, stored: dict | None) -> "BuildProgress | None":
        """From what the worker stored (service.domain.runs.build_progress_of); None for nothing stored."""
        if not stored:
            return None
        done, total, unit = stored.get("done"), stored.get("total"), stored.get("unit", "units")
        if done is None:
            text = "building"
        elif unit == "percent":
            text = f"building: {done} %"
        elif total:
            text = f"building: {done}/{total} units"
        else:
            text = f"building: {done} units compiled"
        try:
            return cls(phase="building", done=done, total=total, unit=unit, text=text)
        except ValueError:  # pydantic's ValidationError: a stored shape this version does not know
            return None


class Progress(BaseModel):
    cases_done: int
    cases_total: int | None
    build: BuildProgress | None = Field(None, description="while the run builds: its build's progress; absent "
                                                          "otherwise (a cached build, or the build is over)")

    @model_serializer(mode="wrap")
    def _build_only_while_building(self, handler):  # noqa: ANN001, ANN202
        # Absent rather than null outside the build: a run's progress reads as it did before builds
        # reported theirs (clients comparing {cases_done, cases_total} keep working).
        data = handler(self)
        if data.get("build") is None:
            data.pop("build", None)
        return data


class NotApplicableCase(BaseModel):
    """A case the adapter cannot run on this device: set aside with its reason, not judged."""

    case_id: str
    optimizer: str
    reason: str | None


class NondeterministicCase(BaseModel):
    """A case whose repeats on the same build differ from its first run."""

    case_id: str
    optimizer: str
    runs: int = Field(description="runs in all, the first included")
    differing: int = Field(description="repeats whose digests differ from the first run's")
    first_divergent_step: int | None = Field(description="1-based; first step where a repeat differs")
    nondeterminism: Literal["introduced", "pre-existing"] | None = Field(
        None, description="introduced: the baseline build reproduced itself (this commit's change, "
                          "judged); pre-existing: the baseline does not either (shown, not judged); "
                          "null: the baseline build was not repeated")
    baseline_runs: int | None = Field(None, description="runs of the case on the baseline build, in all")
    baseline_differing: int | None = Field(None, description="... of which differ from the baseline's first")


class DirectionDisagreement(BaseModel):
    """A changed case whose direction over the trajectory differs from the final step's."""

    case_id: str
    optimizer: str
    direction: str = Field(description="judged over the steps that differ (peak and mean distance)")
    final_direction: str = Field(description="judged at the final step alone")


class CaseAttributionPublic(BaseModel):
    """What kind of change a changed case shows (issue 17; service/core/attribution_view.py)."""

    case_id: str
    kind: str = Field(description="semantic | precision (an intermediate's precision, beyond a rounding) | "
                                  "rounding-level | unknown (not attributed)")
    looks_like: str | None = Field(description="the catalogued variant the commit follows, 'unexplained' or none")
    variant: str | None
    text: str = Field(description="the attribution in one line")
    first_step_ulps: float | None = Field(description="max |commit − baseline| at the first divergent step, in "
                                                      "ulps of each element's scale (its largest |p| so far)")
    peak_ulps: float | None
    change_vs_baseline_distance: float | None = Field(description="max |commit − baseline| over the baseline's "
                                                                  "own peak distance to the float64 reference")
    residual_ulps: float | None = Field(description="what the variant leaves unexplained, in scale ulps")
    distance_to_variant: float | None
    distance_to_reference: float | None
    next_best: str | None
    next_best_ratio: float | None
    reverts: str | None = Field(None, description="the catalogued variant (a defect) the baseline followed and "
                                                  "the commit reverts to the algorithm")
    baseline_variant: str | None = Field(None, description="the catalogued variant the baseline follows, where the "
                                                           "change was matched from it (a transition)")
    build_change: str | None = Field(None, description="what differs between the commit's build and the "
                                                       "baseline's: flags, defines, compilers")


class BaselinePublic(BaseModel):
    """What a verdict compared with (issue 44: every result says so)."""

    run_id: int
    commit_sha: str | None = Field(description="the baseline run's commit")
    environment: str
    battery: str
    commits_back: int | None = Field(description="first-parent commits between the two: 1 for the parent; "
                                                 "null for an explicit base (verify, --baseline)")


class AcknowledgedViaPublic(BaseModel):
    """The acknowledgement a person gave to the same change on another commit (a PR's merge sha)."""

    run_id: int
    commit_sha: str | None
    acknowledged_by: str | None
    note: str | None


class VerdictPublic(BaseModel):
    run_id: int
    run_kind: Literal["commit", "verify"] = Field(description="commit: CI's run of a commit; verify: a "
                                                  "contributor's tree (never in CI's feeds)")
    commit_sha: str | None = Field(description="the commit the run judged; null for a verify run")
    cases_total: int = Field(description="cases the verdict judged")
    cases_shown: int = Field(description="cases in detail.cases here: all of them, or the first "
                                         "that matter (broken, changed, ...) when there are more")
    cases_url: str = Field(description="every case, page by page (limit, offset)")
    baseline_run_id: int | None
    baseline: BaselinePublic | None = Field(None, description="the run compared with: commit, run, environment, "
                                                              "how many commits back")
    baseline_note: str | None = Field(None, description="which baseline was chosen and why, or why there is none "
                                                        "and what to do")
    no_baseline_allowed: bool = Field(False, description="the submission accepted having no baseline "
                                                         "(allow_no_baseline): a no-baseline verdict passes CI as "
                                                         "neutral; otherwise it fails CI")
    outcome: str
    flagged: bool
    changed_cases: int
    first_divergent_step: int | None
    summary: str
    acknowledged: bool
    acknowledged_by: str | None
    acknowledgement_note: str | None
    acknowledged_at: datetime | None
    acknowledged_via: AcknowledgedViaPublic | None = Field(
        None, description="set when this verdict was acknowledged automatically: the same change as this "
                          "acknowledged run's (the same source against the same baseline source, or the "
                          "same changed cases' digests)")
    created_at: datetime
    # Cases per case verdict, every verdict named (zeros too): unchanged, changed, broken, new,
    # not_applicable, nondeterministic. not_applicable and nondeterministic never count as broken.
    counts: dict[str, int]
    not_applicable: list[NotApplicableCase]
    nondeterministic: list[NondeterministicCase]
    direction_disagreements: list[DirectionDisagreement]
    # Issue 17: per changed case, rounding-level or semantic and which variant (after the co-run).
    attribution: list[CaseAttributionPublic] = []
    attribution_summary: str | None = None
    # Every figure the surfaces show (counts, directions, first steps, sizes per family and dtype):
    # the stored field, derived from the stored cases for verdicts stored before it was.
    figures: ComparisonFigures
    # The full comparison (service.core.results.RunComparison) with per-case detail.
    detail: dict[str, Any]


class RunPublic(BaseModel):
    id: int
    project: str
    kind: str
    commit_sha: str | None
    base_sha: str | None
    source_digest: str
    battery: str = Field(description="the battery that ran (once the worker has read the tree), else the one asked for")
    battery_requested: str = Field(description="the battery the submission asked for (or the project's default)")
    battery_origin: str | None = Field(None, description="where the battery that ran was named: the submission, "
                                                         "the tree's optdrift.toml, or the project's default")
    battery_hash: str | None
    environment: str
    status: str
    # Whose fault a run that did not finish is: "commit" for failed (its build failed or its kernels
    # crashed: verdict broken), "optdrift" for error (fetch, lost worker, database, disk, sandbox:
    # retried, never a verdict on the commit); None otherwise.
    fault: Literal["commit", "optdrift"] | None = None
    attempt: int
    # Attempts that ended with their worker lost mid-run (two: the run is not handed out again).
    workers_lost: int = 0
    worker: str | None
    progress: Progress
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    heartbeat_at: datetime | None
    dispatched: bool
    cancel_requested: bool
    build_digest: str | None
    build_cached: bool | None
    error: str | None
    verdict: VerdictPublic | None
    report_url: str
    # Set while the run is queued and cannot start, e.g. "no live worker serves environment gpu.sm90; ...".
    waiting_for: str | None = None
    # What made and ran its kernels (docs/ENVIRONMENTS.md): the machine's fingerprint (device,
    # driver, CUDA, torch, CPU instruction set), the compilers' own version lines (torch-extension
    # builds) and the build variant its environment names; None until the worker has built it.
    fingerprint: dict[str, Any] | None = None
    toolchain: dict[str, Any] | None = None
    build_variant: dict[str, Any] | None = None


class CommitPublic(BaseModel):
    project: str
    sha: str
    parents: list[str]
    ref: str | None
    release_tag: str | None
    message: str | None
    source_digest: str
    created_at: datetime
    runs: list[RunPublic]


class CommitsPublic(BaseModel):
    data: list[CommitPublic]
    count: int


class SubmissionPublic(BaseModel):
    created: bool = Field(description="false when this repeats an earlier submission")
    commit: CommitPublic | None
    runs: list[RunPublic]


class SourcePublic(BaseModel):
    digest: str
    size_bytes: int
    member_count: int


class VerdictsPublic(BaseModel):
    data: list[VerdictPublic]
    count: int | None = Field(None, description="verdicts in all (paged lists), of which `data` is one page")


class CasesPublic(BaseModel):
    """One page of a run's case comparisons (service.core.results.CaseComparison), stored order."""

    run_id: int
    count: int = Field(description="cases in all")
    limit: int
    offset: int
    data: list[dict[str, Any]] = Field(description="each case's comparison, with its `attribution` "
                                                   "(null until the co-run's attribution has it)")
    attribution_detail: dict[str, Any] | None = Field(
        None, description="the verdict's stored detail.attribution for this page's cases (and its `error`); "
                          "null before the co-run has stored one")


class AcknowledgeRequest(BaseModel):
    note: str = Field(min_length=1, description="why this change is intended")
    by: str | None = None


class TrajectoryPublic(BaseModel):
    case_id: str
    case_index: int
    case: dict[str, Any]
    status: str
    error: str | None
    steps: int
    # Per-step series at full precision (index i is after step i+1); NaN/Inf as strings.
    series: dict[str, list[float | int | str]]
    digests: list[str]


class TrajectoriesPublic(BaseModel):
    run_id: int
    count: int | None = Field(None, description="trajectories (cases) in all; `data` is one page")
    limit: int | None = None
    offset: int | None = None
    data: list[TrajectoryPublic]
