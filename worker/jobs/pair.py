"""Two builds side by side on this worker, for the jobs that explain a change: a commit's build and
its baseline's (corun.py), or one commit built by a base environment's toolchain and by its build
variant's (environment_attribution.py). Both follow one path:

  hosts     two kernel hosts start ahead (the worker's spares) while the trees are fetched and built
  build     both builds through the one workspace (a digest-cache hit when their runs built here)
  co-run    the changed cases in the two hosts (worker.engine.corun_battery): per-step max |Δ|,
            trusted only where the re-run reproduces the stored trajectories bit for bit
  attribute rounding-level or semantic, in ulps of the case's scale (worker.attribution)

The sides are named "commit" (the one judged) and "baseline" (the one it is judged against), as the
engine and the attribution name them. A job gives its two jobs and policies; the pair holds the
hosts, libraries and compile caches and gives them back when the job ends.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from service.core.results import CaseSpec, RunComparison, RunResult
from service.core.verdicts import first_divergent_step
from service.settings import Settings
from worker import pipeline
from worker.attribution.record import attribute_or_note
from worker.jobs.workspace import Workspace

log = logging.getLogger(__name__)
SIDES = ("commit", "baseline")
T = TypeVar("T")


class Phases:
    """Seconds per named phase, for the stored detail (where a job's time went)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):  # noqa: ANN204
        began = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - began


class BuildPair:
    """The two sides' hosts, builds and compile caches for one job (a context manager: what it
    holds is given back on exit). The engine is imported here, in the task's process, never by the
    Celery parent."""

    def __init__(self, settings: Settings, *, phases: Phases, label: str) -> None:
        from worker.engine import host_reserve

        self.settings, self.phases, self.label = settings, phases, label
        self.slot_root = settings.resolved_build_cache_dir / "host-slots"
        # The two kernel hosts import torch and make their contexts (seconds) while the trees are
        # fetched and built: the worker's waiting spare and one more, given their builds after.
        self.spares = (host_reserve.spares(2, device=settings.worker_device, slot_root=self.slot_root)
                       if settings.resolved_warm_host else [None, None])
        self.libraries: dict[str, str] = {}
        self.build_digests: dict[str, str] = {}
        # Each build's compile cache (worker.engine.compile_cache), as its run's host had it: the
        # co-run's and the attribution's hosts load what the run compiled. Held until the pair ends.
        self.caches: dict[str, object] = {}
        self.adapter_paths: tuple[list[Path], list[Path]] = ([], [])
        self.kernels_split: dict[str, float] = {}

    def __enter__(self) -> "BuildPair":
        return self

    def __exit__(self, *exc: object) -> None:
        from worker.engine import compile_cache, host_reserve

        # Spares not given a build (the job stopped before: a run waits, a tree no longer builds)
        # wait again for that run; then the pool is filled up for the next.
        host_reserve.put_back(self.spares, device=self.settings.worker_device)
        if self.settings.resolved_warm_host:
            host_reserve.replenish(device=self.settings.worker_device, slot_root=self.slot_root)
        compile_cache.release(*self.caches.values())

    def build(self, workspace: Workspace, jobs: dict[str, pipeline.Job],
              policies: dict[str, pipeline.Policy]) -> str | None:
        """Both sides built (job and policy per side); None, or why a side did not build."""
        for side in SIDES:
            build = workspace.build(jobs[side], policies[side])
            if not build.ok:
                return f"the {side} no longer builds ({build.error})"
            self.libraries[side] = build.library_path
            self.build_digests[side] = build.digest
            self.caches[side] = pipeline.compile_cache_for(build.digest, policies[side])
        self.adapter_paths = (jobs["commit"].adapter_folders, jobs["baseline"].adapter_folders)
        return None

    def corun(self, *, battery, cases: list[CaseSpec], adapter: str,  # noqa: ANN001
              stored: dict[str, RunResult], then: Callable[[dict[str, list[float]]], T],
              between_cases: Callable[[], None] | None = None,
              not_reproduced: Callable[[dict[str, dict[str, "NotReproduced"]]], T] | None = None) -> T | None:
        """The cases co-run in the two builds' hosts; `then(diffs)` (the job stores them) while the
        hosts are still open, its answer returned. When a side's re-run does not reproduce its
        `stored` trajectories (kernels are deterministic in one environment: diffs of other
        trajectories explain nothing), no diffs: `not_reproduced({side: {case id: NotReproduced}})`
        is called instead and its answer returned (the co-run job makes it a finding of the run),
        or without it, None."""
        from worker.engine.corun import corun_battery
        from worker.engine.host import KernelHost

        settings = self.settings
        if between_cases:  # a run that came meanwhile gets the spares, still without a build
            between_cases()
        hosts = self.adopt_hosts(adapter)  # closed below, once the diffs are stored
        timings: dict[str, float] = {}
        try:
            reruns = corun_battery(battery, self.libraries["commit"], self.libraries["baseline"],
                                   device=settings.worker_device, cases=cases, case_timeout_s=settings.case_timeout_s,
                                   adapter=adapter, between_cases=between_cases, params_only=True,
                                   fast=settings.fast_engine, hosts=hosts, timings=timings,
                                   adapter_paths=self.adapter_paths, close_hosts=False)
            self.phases.seconds.update(hosts=timings.pop("hosts_s", 0.0), kernels=timings.pop("kernels_s", 0.0))
            self.kernels_split = timings
            unreproduced = {side: found for side, rerun in zip(SIDES, reruns[:2])
                            if side in stored and (found := not_reproduced_cases(rerun, stored[side]))}
            if unreproduced:
                log.warning("%s: the co-run did not reproduce stored trajectories (%s); diffs not stored",
                            self.label, "; ".join(f"{side}: {', '.join(sorted(found))}"
                                                  for side, found in unreproduced.items()))
                return not_reproduced(unreproduced) if not_reproduced else None
            return then(reruns[2])
        finally:
            # After the store, not before: two CUDA hosts' exits (tearing down a device context
            # each) do not delay it.
            closing = time.monotonic()
            KernelHost.close_together(list(hosts))
            log.info("%s: the co-run's hosts closed in %.2f s", self.label, time.monotonic() - closing)

    def adopt_hosts(self, adapter: str) -> tuple:
        """The two sides' kernel hosts (commit, baseline) with their builds loaded: the spares
        when they came up, else hosts that start on their first request. The caller closes them
        (KernelHost.close_together)."""
        with self.phases("adopt"):
            hosts = tuple(self.host(side, adapter, spare=spare)
                          for spare, side in zip(self.spares or [None, None], SIDES))
        self.spares = []  # the caller's now
        return hosts

    def host(self, side: str, adapter: str, *, spare=None):  # noqa: ANN001, ANN201
        """A kernel host of `side`'s build (`spare` with the build loaded when given and it comes up;
        else one that starts on its first request); the caller closes it."""
        from worker.engine import host_reserve

        settings = self.settings
        return host_reserve.open_host(self.libraries[side], device=settings.worker_device, adapter=adapter,
                                      adapter_paths=self.adapter_paths[SIDES.index(side)],
                                      case_timeout_s=settings.case_timeout_s, compile_cache=self.caches.get(side),
                                      spare=spare)

    def attribute(self, comparison: RunComparison, baseline: RunResult, cases: list[CaseSpec], adapter: str) -> dict:
        """case id -> attribution of the comparison's changed cases (worker/attribution/record.py),
        or {"error": ...}: it never costs the job what it stored before."""
        settings = self.settings
        return attribute_or_note(comparison, baseline, cases, self.libraries["commit"], self.libraries["baseline"],
                                 device=settings.worker_device, adapter=adapter,
                                 case_timeout_s=settings.case_timeout_s, adapter_paths=self.adapter_paths,
                                 compile_caches=(self.caches.get("commit"), self.caches.get("baseline")))


@dataclass(frozen=True)
class NotReproduced:
    """A case whose re-run's per-step digests differ from its stored run's, on the same build: the
    kernel does not reproduce itself (a race, an uninitialised read). `first_differing_step` is
    1-based; the two digests are those of that step (None past the end of a shorter trajectory, or
    where the re-run produced no trajectory at all: `rerun_status` says how it ended)."""

    first_differing_step: int
    stored_digest: str | None
    rerun_digest: str | None
    rerun_status: str

    def as_json(self) -> dict:
        return {"first_differing_step": self.first_differing_step, "stored_digest": self.stored_digest,
                "rerun_digest": self.rerun_digest, "rerun_status": self.rerun_status}


def not_reproduced_cases(rerun: RunResult, stored: RunResult) -> dict[str, NotReproduced]:
    """case id -> NotReproduced, for each re-run case whose stored run had a trajectory and whose
    re-run does not have the same digests. A case stored without a trajectory (broken there) was
    never a trajectory to reproduce and is left out."""
    originals = {c.case.case_id: c for c in stored.cases}
    found = {}
    for result in rerun.cases:
        original = originals.get(result.case.case_id)
        if original is None or original.trajectory is None:
            continue
        stored_digests = original.trajectory.digests
        rerun_digests = result.trajectory.digests if result.trajectory is not None else []
        if rerun_digests == stored_digests:
            continue
        step = first_divergent_step(rerun_digests, stored_digests) or 1
        found[result.case.case_id] = NotReproduced(
            first_differing_step=step,
            stored_digest=stored_digests[step - 1] if step <= len(stored_digests) else None,
            rerun_digest=rerun_digests[step - 1] if step <= len(rerun_digests) else None,
            rerun_status=result.status)
    return found
