"""Prometheus metrics, read from the database at scrape time (every API replica answers the same,
and nothing is lost when an API restarts): a registry built per scrape.

Phase durations come from the run rows' timestamps (the worker records no phase times):
  queue wait  created_at -> started_at (the last start, for a retried run)
  build       started_at -> the first stored case (source fetch, build, and the first case)
  battery     the first stored case -> finished_at
  co-run      `corun_seconds` in the verdict's detail, where the worker records it
Histograms are cumulative over every run in the database, so their counters only grow (as
Prometheus expects) while runs are kept; `rate()`/`histogram_quantile()` in Grafana give the
recent figures (docker/grafana-dashboard.json).
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta, timezone

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString
from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from service.db.models import Run, Trajectory, Verdict
from service.db.worker_presence import WorkerPresence
from service.domain.workers import PRESENCE_STALE_S

# Seconds: from a cached build's moments to a standard battery's hours.
DURATION_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0, 14400.0,
                    float("inf"))
# cases per second: over the runs finished within this window
RATE_WINDOW = timedelta(hours=1)


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    if start.tzinfo is None:
        start = start.replace(tzinfo=timezone.utc)
    if end.tzinfo is None:
        end = end.replace(tzinfo=timezone.utc)
    return max((end - start).total_seconds(), 0.0)


class _DurationHistograms:
    """Per-environment histograms filled from observed values (a custom collector: the counts
    are recomputed each scrape, not incremented)."""

    def __init__(self, name: str, documentation: str):
        self.name, self.documentation = name, documentation
        self.values: dict[str, list[float]] = defaultdict(list)

    def observe(self, environment: str, seconds: float | None) -> None:
        if seconds is not None:
            self.values[environment].append(seconds)

    def collect(self):  # noqa: ANN201
        family = HistogramMetricFamily(self.name, self.documentation, labels=["environment"])
        for environment, values in sorted(self.values.items()):
            buckets = [(floatToGoString(bound),
                        sum(1 for value in values if value <= bound)) for bound in DURATION_BUCKETS]
            family.add_metric([environment], buckets, sum(values))
        yield family


class _ScrapeCounter:
    """A counter whose totals are read from the database at each scrape. Built as a metric family
    without a `_created` sample: a `Counter` object made per scrape would report its own creation
    time, which moves on every scrape although nothing was counted (Prometheus would read each
    scrape as a counter reset)."""

    def __init__(self, name: str, documentation: str, labels: list[str]):
        self.name, self.documentation, self.labels = name, documentation, labels
        self.totals: dict[tuple[str, ...], float] = {}

    def set_total(self, total: float, **labels: str) -> None:
        self.totals[tuple(labels[name] for name in self.labels)] = total

    def collect(self):  # noqa: ANN201
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labels)
        for label_values, total in sorted(self.totals.items()):
            family.add_metric(list(label_values), total)
        yield family


def build_registry(session: Session, *, now: datetime | None = None) -> CollectorRegistry:
    now = now or datetime.now(timezone.utc)
    registry = CollectorRegistry()

    runs_gauge = Gauge("optdrift_runs", "Runs by status", ["status"], registry=registry)
    for status, count in session.execute(select(Run.status, func.count()).group_by(Run.status)):
        runs_gauge.labels(status=status).set(count)
    verdicts_gauge = Gauge("optdrift_verdicts", "Verdicts by outcome", ["outcome", "flagged"], registry=registry)
    for outcome, flagged, count in session.execute(
            select(Verdict.outcome, Verdict.flagged, func.count()).group_by(Verdict.outcome, Verdict.flagged)):
        verdicts_gauge.labels(outcome=outcome, flagged=str(bool(flagged)).lower()).set(count)
    undispatched = session.scalar(
        select(func.count()).select_from(Run).where(Run.status == "queued", Run.dispatched_at.is_(None)))
    Gauge("optdrift_runs_undispatched", "Queued runs the broker has not taken yet",
          registry=registry).set(undispatched or 0)

    environments = set(session.scalars(select(Run.environment).distinct()))
    live = {name: 0 for name in environments}
    cutoff = now - timedelta(seconds=PRESENCE_STALE_S)
    # A worker serves its environment and each build variant its presence detail lists (`cpu+fma`
    # runs wait for it too, service/domain/workers.py live_workers): counted under each of them.
    for environment, detail in session.execute(
            select(WorkerPresence.environment, WorkerPresence.detail).where(WorkerPresence.seen_at >= cutoff)):
        variants = (detail or {}).get("variants") or []
        for served in (environment, *(f"{environment}+{variant}" for variant in variants)):
            live[served] = live.get(served, 0) + 1
    workers_gauge = Gauge("optdrift_live_workers", "Workers seen within the presence window, per environment",
                          ["environment"], registry=registry)
    for environment, count in live.items():
        workers_gauge.labels(environment=environment).set(count)

    depth = Gauge("optdrift_queue_depth", "Runs queued and not started, per environment", ["environment"],
                  registry=registry)
    for environment in environments:
        depth.labels(environment=environment).set(0)
    for environment, count in session.execute(
            select(Run.environment, func.count()).where(Run.status == "queued").group_by(Run.environment)):
        depth.labels(environment=environment).set(count)

    first_case = (select(Trajectory.run_id, func.min(Trajectory.created_at).label("first_case_at"))
                  .group_by(Trajectory.run_id).subquery())
    queue_wait = _DurationHistograms("optdrift_run_queue_wait_seconds",
                                     "Submission to start (created_at -> started_at), per environment")
    build = _DurationHistograms("optdrift_run_build_seconds",
                                "Start to the first stored case (fetch, build, first case), per environment")
    battery = _DurationHistograms("optdrift_run_battery_seconds",
                                  "First stored case to the end of the run, per environment")
    cases_done: dict[str, int] = defaultdict(int)
    recent_cases: dict[str, int] = defaultdict(int)
    recent_seconds: dict[str, float] = defaultdict(float)
    rows = session.execute(
        select(Run.environment, Run.created_at, Run.started_at, Run.finished_at, Run.cases_done,
               first_case.c.first_case_at).outerjoin(first_case, first_case.c.run_id == Run.id))
    for environment, created_at, started_at, finished_at, done, first_case_at in rows:
        queue_wait.observe(environment, _seconds(created_at, started_at))
        build.observe(environment, _seconds(started_at, first_case_at))
        battery_s = _seconds(first_case_at, finished_at)
        battery.observe(environment, battery_s)
        cases_done[environment] += done or 0
        if battery_s and finished_at is not None and _seconds(finished_at, now) <= RATE_WINDOW.total_seconds():
            recent_cases[environment] += done or 0
            recent_seconds[environment] += battery_s
    corun = _DurationHistograms("optdrift_corun_seconds",
                                "Baseline co-run of a run's changed cases, per environment (where the "
                                "worker records corun_seconds)")
    corun_s = Verdict.detail["corun_seconds"].as_float()
    for environment, seconds in session.execute(
            select(Run.environment, corun_s).join(Verdict, Verdict.run_id == Run.id).where(corun_s.is_not(None))):
        corun.observe(environment, float(seconds))
    for collector in (queue_wait, build, battery, corun):
        registry.register(collector)

    cases_counter = _ScrapeCounter("optdrift_cases_done",
                                   "Cases run, per environment (rate() gives cases per second)", ["environment"])
    rate = Gauge("optdrift_cases_per_second",
                 f"Cases per second of battery time over the runs finished in the last {RATE_WINDOW}",
                 ["environment"], registry=registry)
    for environment in environments:
        cases_counter.set_total(cases_done[environment], environment=environment)
        seconds = recent_seconds[environment]
        rate.labels(environment=environment).set(recent_cases[environment] / seconds if seconds else 0.0)

    builds = _ScrapeCounter("optdrift_builds", "Builds per environment, by whether the build cache had them",
                            ["environment", "cached"])
    ratio = Gauge("optdrift_build_cache_hit_ratio", "Share of builds served from the build cache",
                  ["environment"], registry=registry)
    hits = func.sum(case((Run.build_cached.is_(True), 1), else_=0))
    for environment, hit_count, total in session.execute(
            select(Run.environment, hits, func.count()).where(Run.build_cached.is_not(None))
            .group_by(Run.environment)):
        hit_count = int(hit_count or 0)
        builds.set_total(hit_count, environment=environment, cached="true")
        builds.set_total(total - hit_count, environment=environment, cached="false")
        ratio.labels(environment=environment).set(hit_count / total if total else 0.0)
    registry.register(cases_counter)
    registry.register(builds)
    return registry

