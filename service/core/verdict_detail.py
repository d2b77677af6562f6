"""A verdict's stored detail (the JSON of `Verdict.detail`), typed: the run's comparison and what
its baseline co-run adds beside it.

The detail is the comparison's JSON (service.core.results.RunComparison, as `compare_runs` made it),
then, once the co-run has been (worker/jobs/corun.py): where its time went (CorunRecord), its
attribution of the changed cases, or how it ended without diffs (CorunFinding, under `corun`); and
what differs between the two runs' builds (`build_change`, service.domain.verdict_store).

Stored details are served as they are and compared as text by their readers, so a detail read and
written again is the same JSON, key for key and in the same order: `stored()` gives back the keys a
detail was read with in their order, a key it did not have is left out (a detail stored before the
comparison had `figures` stays without), a key of another release is kept as it is, and each
change below adds or replaces a key as a dict update would (a key it had stays in its place, a new
one goes last).
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, PrivateAttr, model_validator

from service.core.results import RunComparison

# The detail's key for how the co-run ended when it stores no per-step diffs: its state
# "not_reproducible" (a re-run's digests differ from the stored run's, per case and side) or
# "given_up" (a side no longer builds, the co-run failed). Either way its detail is final: the
# CLI's --wait (service/cli/client.py corun_detail) stops waiting for it.
CORUN_FINDING = "corun"
CorunFinalState = Literal["not_reproducible", "given_up"]
CORUN_FINAL_STATES: tuple[str, ...] = get_args(CorunFinalState)


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def stored(self) -> dict[str, Any]:
        """As stored: the fields it was made with, in their declared order."""
        return self.model_dump(mode="json", exclude_unset=True)


class CorunWindow(_Part):
    """When and on which worker the co-run ran (several workers share a queue); ISO 8601 times."""

    worker: str
    started_at: str
    finished_at: str


class CorunRecord(_Part):
    """Where a co-run's time went, stored beside its diffs or its finding: its own seconds (fetch,
    builds, kernels; /metrics' histogram), its window, seconds per phase, and with diffs the split
    of its kernels phase (worker.engine.corun) and the model set of the training-impact job that
    follows ("off": none comes, so `submit --wait` does not wait for one)."""

    corun_seconds: float | None = None
    corun_window: CorunWindow | None = None
    corun_phases: dict[str, float] | None = None
    corun_kernels: dict[str, Any] | None = None  # as the engine reports it (worker.engine.corun)
    training_impact: str | None = None


class CaseNotReproduced(_Part):
    """One side of a case whose co-run re-run differs from its stored run (worker/jobs/pair.py
    NotReproduced): the first differing step (1-based) and both digests there."""

    first_differing_step: int
    stored_digest: str | None
    rerun_digest: str | None
    rerun_status: str


class CorunFinding(_Part):
    """How the co-run ended without per-step diffs: given up (`reason`), or not reproducible (how many
    cases, and the first of them: case id -> side -> CaseNotReproduced)."""

    state: CorunFinalState
    reason: str | None = None
    not_reproduced: int | None = None
    cases: dict[str, dict[str, CaseNotReproduced]] | None = None


class VerdictDetail(RunComparison):
    """`Verdict.detail`: the comparison's fields, then the co-run's (absent until it has been)."""

    # A key of another release (older or newer) is kept as stored.
    model_config = ConfigDict(extra="allow")

    corun_seconds: float | None = None
    corun_window: CorunWindow | None = None
    corun_phases: dict[str, float] | None = None
    corun_kernels: dict[str, Any] | None = None  # as the engine reports it (worker.engine.corun)
    training_impact: str | None = None
    corun: CorunFinding | None = None
    attribution: dict[str, Any] | None = None
    build_change: dict[str, Any] | None = None

    # The keys in the order the detail was read or made with (`stored()` keeps it).
    _keys: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _remember_key_order(cls, data: Any, handler: Any) -> "VerdictDetail":
        detail = handler(data)
        if isinstance(data, dict):
            detail._keys = tuple(data)
        return detail

    @classmethod
    def of(cls, comparison: RunComparison, corun: CorunRecord | None = None,
           finding: CorunFinding | None = None) -> "VerdictDetail":
        """A comparison's detail, with the co-run's record and its finding after it."""
        return cls.model_validate({**comparison.model_dump(mode="json"), **(corun.stored() if corun else {}),
                                   **({CORUN_FINDING: finding.stored()} if finding else {})})

    def stored(self) -> dict[str, Any]:
        """The JSON stored in `Verdict.detail`: the keys it was read with, in their order."""
        dumped = self.model_dump(mode="json", exclude_unset=True)
        order = [key for key in self._keys if key in dumped] + [key for key in dumped if key not in self._keys]
        return {key: dumped[key] for key in order}

    def _updated(self, changes: dict[str, Any], *, without: str | None = None) -> "VerdictDetail":
        stored = {key: value for key, value in self.stored().items() if key != without}
        return type(self).model_validate({**stored, **changes})

    @property
    def corun_final(self) -> bool:
        """The co-run ended without diffs (not reproducible, given up): nothing more comes."""
        return self.corun is not None and self.corun.state in CORUN_FINAL_STATES

    def awaiting_diffs(self) -> set[str]:
        """The changed cases still without per-step |commit - baseline| (what a co-run adds)."""
        return {case.case_id for case in self.cases if case.verdict == "changed" and not case.max_abs_diff_per_step}

    def given_up(self, reason: str) -> "VerdictDetail":
        """The co-run stores no diffs and will not try again, saying why; every other key stays."""
        return self._updated({CORUN_FINDING: CorunFinding(state="given_up", reason=reason).stored()})

    def with_attribution(self, attribution: dict[str, Any]) -> "VerdictDetail":
        """The changed cases' attribution (worker/attribution); every other key stays."""
        return self._updated({"attribution": attribution})

    def with_build_change(self, change: dict[str, Any] | None) -> "VerdictDetail":
        """What differs between the two runs' builds, last; none (the key dropped) when built alike."""
        return self._updated({"build_change": change} if change else {}, without="build_change")
