"""/metrics through the API on the real PostgreSQL: run rows with known timestamps (a factory
below) give known histogram buckets, queue depths, live workers, cases per second and the
build-cache hit ratio; the Grafana dashboard in docker/ asks only for metrics /metrics has."""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta, timezone
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from service.db.models import Project, Run, SourceArchive, Trajectory, Verdict
from service.db.worker_presence import WorkerPresence

REPO_ROOT = Path(__file__).resolve().parents[3]
NOW = datetime.now(timezone.utc)


def _project(session) -> Project:  # noqa: ANN001
    project = Project(name="metrics", environments=["cpu", "gpu.sm90"])
    session.add_all([project, SourceArchive(digest="d" * 64, size_bytes=1, member_count=1)])
    session.flush()
    return project


def make_run(session, project: Project, *, environment: str, status: str, created_s_ago: float,  # noqa: ANN001
             queue_s: float | None = None, build_s: float | None = None, battery_s: float | None = None,
             cases: int = 0, build_cached: bool | None = None, corun_s: float | None = None) -> Run:
    """A run created `created_s_ago` seconds ago that waited `queue_s`, built for `build_s` (to its
    first stored case) and ran its battery for `battery_s`."""
    created = NOW - timedelta(seconds=created_s_ago)
    started = created + timedelta(seconds=queue_s) if queue_s is not None else None
    first_case = started + timedelta(seconds=build_s) if build_s is not None else None
    finished = first_case + timedelta(seconds=battery_s) if battery_s is not None else None
    run = Run(project_id=project.id, source_digest="d" * 64, battery="quick", environment=environment,
              status=status, created_at=created, started_at=started, finished_at=finished,
              cases_done=cases, cases_total=cases or None, build_cached=build_cached)
    session.add(run)
    session.flush()
    if first_case is not None:
        session.add(Trajectory(run_id=run.id, case_id="c0", case_index=0, case={}, status="ok", steps=1,
                               series_layout=[], series_data=b"", created_at=first_case))
    if corun_s is not None:
        session.add(Verdict(run_id=run.id, outcome="changed", flagged=True, detail={"corun_seconds": corun_s}))
    session.flush()
    return run


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_metrics_per_environment_from_run_timestamps(api, db_session) -> None:  # noqa: ANN001
    project = _project(db_session)
    # cpu: two finished runs (queue 10 s / 100 s, build 20 s / 400 s, battery 50 s each, 100 cases
    # each: 2 cases/s), one cached build of the two; one queued run.
    make_run(db_session, project, environment="cpu", status="done", created_s_ago=600, queue_s=10,
             build_s=20, battery_s=50, cases=100, build_cached=True, corun_s=42.0)
    make_run(db_session, project, environment="cpu", status="done", created_s_ago=1200, queue_s=100,
             build_s=400, battery_s=50, cases=100, build_cached=False)
    make_run(db_session, project, environment="cpu", status="queued", created_s_ago=5)
    # gpu.sm90: two queued runs and no live worker
    for _ in range(2):
        make_run(db_session, project, environment="gpu.sm90", status="queued", created_s_ago=5)
    now = datetime.now(timezone.utc)  # not NOW: the presence window is seconds, collection may be longer ago
    db_session.add_all([WorkerPresence(name="w1", environment="cpu", seen_at=now),
                        WorkerPresence(name="w2", environment="cpu", seen_at=now),
                        WorkerPresence(name="gone", environment="gpu.sm90", seen_at=now - timedelta(hours=1))])
    db_session.flush()

    text = api.get("/metrics").text
    samples = _samples(text)

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("optdrift_queue_depth", environment="cpu") == 1
    assert value("optdrift_queue_depth", environment="gpu.sm90") == 2
    assert value("optdrift_live_workers", environment="cpu") == 2
    assert value("optdrift_live_workers", environment="gpu.sm90") == 0  # seen an hour ago: gone
    # queue wait 10 s and 100 s: one at <= 15, both at <= 120
    assert value("optdrift_run_queue_wait_seconds_bucket", environment="cpu", le="15.0") == 1
    assert value("optdrift_run_queue_wait_seconds_bucket", environment="cpu", le="120.0") == 2
    assert value("optdrift_run_queue_wait_seconds_count", environment="cpu") == 2
    assert value("optdrift_run_queue_wait_seconds_sum", environment="cpu") == 110
    # build 20 s and 400 s
    assert value("optdrift_run_build_seconds_bucket", environment="cpu", le="30.0") == 1
    assert value("optdrift_run_build_seconds_bucket", environment="cpu", le="600.0") == 2
    assert value("optdrift_run_battery_seconds_sum", environment="cpu") == 100
    assert value("optdrift_run_battery_seconds_bucket", environment="cpu", le="60.0") == 2
    assert value("optdrift_corun_seconds_sum", environment="cpu") == 42.0
    assert value("optdrift_cases_per_second", environment="cpu") == 2.0
    assert value("optdrift_cases_done_total", environment="cpu") == 200
    assert value("optdrift_build_cache_hit_ratio", environment="cpu") == 0.5
    assert value("optdrift_builds_total", environment="cpu", cached="true") == 1
    # the families that were there before stay
    assert value("optdrift_runs", status="queued") == 3


def test_the_grafana_dashboard_reads_metrics_that_exist(api) -> None:  # noqa: ANN001
    dashboard = json.loads((REPO_ROOT / "docker" / "grafana-dashboard.json").read_text())
    exposed = {family.name for family in text_string_to_metric_families(api.get("/metrics").text)}
    # a histogram's family is named without _bucket/_sum/_count, a counter's without _total
    exposed |= {f"{name}{suffix}" for name in exposed for suffix in ("_bucket", "_sum", "_count", "_total")}
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    assert len(expressions) >= 8
    used = {name for expr in expressions for name in re.findall(r"\boptdrift_[a-z0-9_]+", expr)}
    assert used, expressions
    assert used <= exposed, used - exposed
    for wanted in ("optdrift_run_queue_wait_seconds_bucket", "optdrift_run_build_seconds_bucket",
                   "optdrift_run_battery_seconds_bucket", "optdrift_corun_seconds_bucket",
                   "optdrift_queue_depth", "optdrift_live_workers", "optdrift_build_cache_hit_ratio"):
        assert wanted in used, wanted


def test_two_scrapes_with_no_new_runs_are_identical(api, db_session) -> None:  # noqa: ANN001
    """Counters are rebuilt from the database at each scrape: they carry no `_created` sample (a
    creation time per scrape would change every scrape and read as a counter reset)."""
    project = _project(db_session)
    make_run(db_session, project, environment="cpu", status="done", created_s_ago=600, queue_s=10,
             build_s=20, battery_s=50, cases=100, build_cached=True)
    db_session.flush()
    first = api.get("/metrics").text
    second = api.get("/metrics").text
    assert "optdrift_cases_done_total" in first and "optdrift_builds_total" in first
    assert "_created" not in first
    assert first == second
