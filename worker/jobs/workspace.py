"""ONE workspace for every job (the run, the co-run, the timing): a private folder, the source
fetched into it over HTTP (content-addressed, worker/source_fetch.py), prepared and built through
the pipeline (worker/pipeline.py) under the operator's caps for the run's kind.

The build time limit is the same for every job that builds a run's tree: a verify run's tree (a
contributor's code, the lowest trust) gets the smaller of OPTDRIFT_VERIFY_MAX_BUILD_S and
OPTDRIFT_MAX_BUILD_S, a commit run's tree OPTDRIFT_MAX_BUILD_S (build_limit_s).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from service.core.environments import BuildVariant, split as split_environment
from service.run_store import archive_limits
from service.settings import Settings
from worker import pipeline
from worker.build import BuildResult
from worker.source_fetch import fetch_source


def build_limit_s(settings: Settings, *, untrusted: bool) -> float:
    """How long the build of a run's tree may take: a verify run's tree gets the verify cap too."""
    return min(settings.verify_max_build_s, settings.max_build_s) if untrusted else settings.max_build_s


class VariantNotServed(RuntimeError):
    """A run of a build variant this worker is not configured with (its queue reached it anyway)."""


def build_variant(settings: Settings, environment: str) -> BuildVariant | None:
    """The build variant `environment` names on this worker (None: the plain environment)."""
    _base, name = split_environment(environment)
    if name is None:
        return None
    if name not in settings.build_variants:
        served = ", ".join(sorted(settings.build_variants)) or "none"
        raise VariantNotServed(f"environment {environment!r} names the build variant {name!r}, which this worker "
                               f"is not configured with (OPTDRIFT_BUILD_VARIANTS; it serves: {served})")
    return settings.build_variants[name]


class Workspace:
    """A job's folder (deleted when the job ends), the trees fetched into it, and their builds."""

    def __init__(self, settings: Settings, *, prefix: str) -> None:
        self.settings = settings
        self._folder = tempfile.TemporaryDirectory(prefix=prefix)
        self.root = Path(self._folder.name)

    def __enter__(self) -> "Workspace":
        return self

    def __exit__(self, *exc: object) -> None:
        self._folder.cleanup()

    def fetch(self, digest: str, *, name: str = "src") -> Path:
        """The source archive `digest` from the service, unpacked into the folder `name`."""
        settings = self.settings
        return fetch_source(base_url=settings.resolved_public_url, digest=digest, dest=self.root / name,
                            limits=archive_limits(settings), max_bytes=settings.max_upload_bytes,
                            token=settings.resolved_worker_token())

    def prepare(self, source_dir: Path, *, project: Any, battery: str | None, kind: str = "commit") -> pipeline.Job:
        """The tree's configuration and battery (pipeline.prepare; raises the tree's errors), within
        the battery limits of a run of `kind` (commit: the default, for baselines and follow-ups of
        runs that passed their own kind's limits already)."""
        return pipeline.prepare(source_dir, project=project, requested_battery=battery,
                                limits=self.settings.battery_limits(kind))

    def policy(self, *, untrusted: bool, environment: str, warm: bool = False, **limits: Any) -> pipeline.Policy:
        """The pipeline's policy for a run of this trust: the worker's device and caches, the build
        time limit of the run's kind, the build variant its `environment` names (`cpu+clang`:
        OPTDRIFT_BUILD_VARIANTS' clang), and `limits` (case_timeout_s, deadline, reference_cache).
        `warm`: take kernel hosts started ahead where the worker keeps them (host_reserve)."""
        settings = self.settings
        variant = build_variant(settings, environment)
        warm_hosts = ({"warm_host": settings.resolved_warm_host,
                       "host_slot_root": settings.resolved_build_cache_dir / "host-slots"} if warm else {})
        return pipeline.Policy(
            device=settings.worker_device, fast_engine=settings.fast_engine,
            cache_dir=settings.resolved_build_cache_dir,
            cuda_archs=[] if settings.worker_device == "cpu" else None, trusted=not untrusted,
            max_build_s=build_limit_s(settings, untrusted=untrusted), build_variant=variant,
            compile_cache_max_bytes=settings.compile_cache_max_bytes, **warm_hosts, **limits)

    def build(self, job: pipeline.Job, policy: pipeline.Policy) -> BuildResult:
        """The tree built per its configuration (a digest-cache hit when built before); never
        raises for a failed build."""
        return pipeline.build(job, policy)
