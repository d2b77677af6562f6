"""ORM rows -> API schemas (kept out of the routes so they stay thin)."""

from __future__ import annotations

import math
import typing
from dataclasses import asdict

from sqlalchemy.orm import object_session

from service.api.schemas import (
    AcknowledgedViaPublic, BaselinePublic, BuildProgress, CaseAttributionPublic, CommitPublic, DirectionDisagreement, NondeterministicCase, NotApplicableCase, Progress, RunPublic,
    TrajectoryPublic, VerdictPublic,
)
from service.db.models import ERROR, FAILED, Commit, Run, Trajectory, Verdict
from service.api.paging import VERDICT_CASES_SHOWN, cases_shown_first, cases_url, detail_for_cases
from service.core import attribution_view
from service.domain import runs
from service.domain.trajectories import unpack_series
from service.domain.workers import waiting_for
from service.core.results import CaseVerdict
from service.core.verdicts import figures_of


# Every case verdict, so the counts name each one (a CLI reads counts["not_applicable"] as is).
CASE_VERDICTS = typing.get_args(CaseVerdict)
# Whose fault a run that ended without its work done is (see RunPublic.fault).
FAULT_BY_STATUS = {FAILED: "commit", ERROR: "optdrift"}


def verdict_public(verdict: Verdict, *, cases_limit: int = VERDICT_CASES_SHOWN) -> VerdictPublic:
    """The verdict with at most `cases_limit` of its cases (service/api/paging.py: no answer grows with
    a run's case count; GET /runs/{id}/cases pages through them all), the lists below drawn from
    those, and its run's kind and commit: CI's feeds hold commit runs only."""
    stored_cases = verdict.detail.get("cases", [])
    cases = cases_shown_first(stored_cases, cases_limit)
    shown_detail = detail_for_cases(verdict.detail, cases)
    run = verdict.run
    return VerdictPublic(
        run_kind=run.kind, commit_sha=run.commit.sha if run.commit else None,
        cases_total=len(stored_cases), cases_shown=len(cases), cases_url=cases_url(verdict.run_id),
        counts={name: 0 for name in CASE_VERDICTS} | verdict.detail.get("counts", {}),
        not_applicable=[NotApplicableCase(case_id=c["case_id"], optimizer=c["optimizer"], reason=c.get("message"))
                        for c in cases if c["verdict"] == "not_applicable"],
        nondeterministic=[NondeterministicCase(case_id=c["case_id"], optimizer=c["optimizer"],
                                               nondeterminism=c.get("nondeterminism"), **c["repeat_check"])
                          for c in cases if c["verdict"] == "nondeterministic" and c.get("repeat_check")],
        # Verdicts stored before final_direction existed have none: nothing to disagree with.
        direction_disagreements=[
            DirectionDisagreement(case_id=c["case_id"], optimizer=c["optimizer"], direction=c["direction"],
                                  final_direction=c["final_direction"])
            for c in cases if c.get("final_direction") and c.get("direction")
            and c["direction"] != c["final_direction"]],
        run_id=verdict.run_id, baseline_run_id=verdict.baseline_run_id, outcome=verdict.outcome,
        flagged=verdict.flagged, changed_cases=verdict.changed_cases,
        first_divergent_step=verdict.first_divergent_step,
        summary=verdict.detail.get("summary", ""), acknowledged=verdict.acknowledged,
        acknowledged_by=verdict.acknowledged_by,
        acknowledgement_note=verdict.acknowledgement_note,
        acknowledged_at=verdict.acknowledged_at, created_at=verdict.created_at,
        baseline=baseline_public(verdict), baseline_note=verdict.baseline_note,
        no_baseline_allowed=bool(run.allow_no_baseline), acknowledged_via=acknowledged_via_public(verdict),
        figures=figures_of(verdict.detail), detail=shown_detail,
        attribution=attribution_public(shown_detail),
        attribution_summary=attribution_view.headline(verdict.detail),
    )


def baseline_public(verdict: Verdict) -> BaselinePublic | None:
    baseline = verdict.baseline_run
    if baseline is None:
        return None
    return BaselinePublic(run_id=baseline.id, commit_sha=baseline.commit.sha if baseline.commit else None,
                          environment=baseline.environment, battery=baseline.battery,
                          commits_back=verdict.baseline_commits_back)


def acknowledged_via_public(verdict: Verdict) -> AcknowledgedViaPublic | None:
    original = verdict.acknowledged_via_run
    if original is None:
        return None
    original_verdict = original.verdict
    return AcknowledgedViaPublic(
        run_id=original.id, commit_sha=original.commit.sha if original.commit else None,
        acknowledged_by=original_verdict.acknowledged_by if original_verdict else None,
        note=original_verdict.acknowledgement_note if original_verdict else None)


def attribution_public(detail: dict) -> list[CaseAttributionPublic]:
    return [CaseAttributionPublic(text=a.text, **{k: _finite(v) for k, v in asdict(a).items()})
            for a in attribution_view.by_case(detail).values()]


def _finite(value):  # noqa: ANN001, ANN202
    # An infinite ratio (an exact match) has no JSON number: none.
    return None if isinstance(value, float) and not math.isfinite(value) else value


def run_public(run: Run, waiting_cache: dict | None = None) -> RunPublic:
    return RunPublic(
        id=run.id, project=run.project.name, kind=run.kind,
        commit_sha=run.commit.sha if run.commit else None,
        base_sha=run.base_commit.sha if run.base_commit else None,
        # The battery that ran (the tree's optdrift.toml may name its own, worker/pipeline.py), and
        # where its name came from; the one the submission asked for until the worker has read it.
        source_digest=run.source_digest, battery=(run.environment_detail or {}).get("battery") or run.battery,
        battery_requested=run.battery, battery_origin=(run.environment_detail or {}).get("battery_origin"),
        battery_hash=run.battery_hash,
        environment=run.environment, status=run.status, fault=FAULT_BY_STATUS.get(run.status),
        attempt=run.attempt, workers_lost=run.workers_lost or 0, worker=run.worker,
        progress=Progress(cases_done=run.cases_done, cases_total=run.cases_total,
                          build=BuildProgress.of(runs.build_progress_of(run))),
        created_at=run.created_at, started_at=run.started_at, finished_at=run.finished_at,
        heartbeat_at=run.heartbeat_at, dispatched=run.dispatched_at is not None,
        cancel_requested=run.cancel_requested, build_digest=run.build_digest,
        build_cached=run.build_cached, error=run.error,
        verdict=verdict_public(run.verdict) if run.verdict else None,
        report_url=f"/api/v1/runs/{run.id}",
        waiting_for=_waiting_for(run, waiting_cache),
        fingerprint=(run.environment_detail or {}).get("fingerprint"),
        toolchain=(run.environment_detail or {}).get("toolchain"),
        build_variant=(run.environment_detail or {}).get("build_variant"),
    )


def _waiting_for(run: Run, cache: dict | None) -> str | None:
    session = object_session(run)
    if session is None:
        return None
    if cache is None:
        return waiting_for(session=session, run=run)
    # A list answer asks once per (status, environment), not once per listed run.
    key = (run.status, run.environment)
    if key not in cache:
        cache[key] = waiting_for(session=session, run=run)
    return cache[key]


def commit_public(commit: Commit, waiting_cache: dict | None = None) -> CommitPublic:
    return CommitPublic(
        project=commit.project.name, sha=commit.sha, parents=commit.parents, ref=commit.ref,
        release_tag=commit.release_tag, message=commit.message, source_digest=commit.source_digest,
        created_at=commit.created_at, runs=[run_public(run, waiting_cache) for run in commit.runs],
    )


def _json_float(value: float | int) -> float | int | str:
    # JSON has no NaN/Infinity: write them as strings, as service.core.results does.
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value


def trajectory_public(row: Trajectory) -> TrajectoryPublic:
    series = unpack_series(row.series_layout, row.series_data)
    return TrajectoryPublic(
        case_id=row.case_id, case_index=row.case_index, case=row.case, status=row.status,
        error=row.error, steps=row.steps,
        series={name: [_json_float(v) for v in values] for name, values in series.items()},
        digests=row.digests.split("\n") if row.digests else [],
    )
