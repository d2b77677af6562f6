"""Service and worker configuration: one pydantic-settings class, environment prefix OPTDRIFT_.

Nothing here is built at import time; call get_settings() (cached) where a value is needed, so
tests and the CLI can set environment variables first and clear the cache with
get_settings.cache_clear().

With no configuration at all, optdrift runs on its *embedded default*: everything lives under
OPTDRIFT_HOME (default ``$XDG_DATA_HOME/optdrift``, i.e. ``~/.local/share/optdrift``) — a SQLite
database, a filesystem message broker (kombu's ``filesystem://`` transport, no server), the
content-addressed source store and the build cache.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.core.battery_limits import BatteryLimits
from service.core.environments import BuildVariant, check_variants


def _default_home() -> Path:
    data_home = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data_home) / "optdrift"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="OPTDRIFT_", extra="ignore")

    home: Path = Field(default_factory=_default_home, description="Folder for embedded-mode data.")
    database_url: str | None = Field(
        default=None, description="SQLAlchemy URL; default sqlite:///<home>/optdrift.db."
    )
    broker_url: str | None = Field(
        default=None, description="Celery broker URL; default filesystem:// under <home>/broker."
    )
    store_dir: Path | None = Field(default=None, description="Source archive store; default <home>/store.")
    build_cache_dir: Path | None = Field(default=None, description="Build cache; default <home>/builds.")
    # The kernel hosts' inductor/Triton cache (<build cache>/compile, one folder per build digest:
    # worker/engine/compile_cache.py): its folders together; the least recently used go first.
    compile_cache_max_bytes: int = Field(default=20 * 1024 ** 3, gt=0)
    public_url: str = Field(
        default="http://127.0.0.1:8000",
        description="Where workers reach the API to fetch sources (workers may be on other hosts).",
    )

    # Upload limits: an archive over these is refused with 413/422 before anything is stored.
    max_upload_bytes: int = 64 * 1024 * 1024
    max_archive_members: int = 20_000
    max_extracted_bytes: int = 512 * 1024 * 1024

    default_battery: str = "quick"
    # The environment class this worker serves and whose Celery queue it consumes ("cpu",
    # "gpu.sm90", ...). Runs are only ever compared with runs of the same class.
    worker_environment: str = "cpu"
    worker_device: str = "cpu"
    # Build variants this worker also serves on its machine (service/core/environments.py), as
    # JSON: {"clang": {"compiler": "clang++"}, "fma": {"cflags": ["-mfma"]}}. A run of environment
    # `<worker_environment>+<name>` is built with the variant; the worker consumes those queues too.
    build_variants: dict[str, BuildVariant] = {}

    @field_validator("build_variants")
    @classmethod
    def _variant_names(cls, variants: dict[str, BuildVariant]) -> dict[str, BuildVariant]:
        return check_variants(variants)
    # Run batteries through worker.fast_engine (grouped references, device-side metrics and
    # digests): bit-identical results, many times faster on a GPU. False: one case at a time.
    fast_engine: bool = True
    # Keep one kernel host started ahead of the next run (worker.engine.host_reserve): its start,
    # mostly importing torch, would otherwise be most of a warm run. None: on for a CUDA worker, off
    # for a CPU worker (where the spare's import would share the cores with the run's verdict).
    warm_host: bool | None = None
    # Issue 46: after a changed run's co-run, train the reference models with the commit's and the
    # baseline's optimizer (worker/jobs/training.py). "auto": the quick model set on a CPU worker,
    # the standard one on a CUDA worker; "off": only on request (POST /api/v1/runs/{id}/training).
    training_impact: Literal["auto", "quick", "standard", "off"] = "auto"
    # Kernel hosts a training-impact job trains in, both builds together (worker/training/runner.py
    # HostPool). None: 2 on a CPU worker (one per side); on a CUDA worker, whose small-model steps
    # are bound by each host's kernel launches on its CPU core, not by the GPU, three quarters of its
    # cores, at most 12 (docs/TRAINING.md: on a 16-core H100 worker 4, 8, 12 and 16 hosts took
    # 126, 69, 57 and 59 s for one standard job; bench/gpu/h200_training_hosts.sh).
    training_hosts: int | None = Field(None, ge=2, le=32)
    # The kernels' own speed per commit (worker/speed, docs/PERFORMANCE.md): seconds a run may
    # spend timing its kernels after the battery. None: 120 on a CUDA worker, off on a CPU worker;
    # 0: off. A project turns it off with `kernel_speed = false` in its optdrift.toml [project].
    speed_budget_s: float | None = None
    speed_sizes: list[int] = [1 << 20, 1 << 26]
    speed_repeats: int = 50

    heartbeat_interval_s: float = 10.0
    # A running run whose heartbeat is older than this is presumed dead and re-queued.
    stale_after_s: float = 180.0
    max_attempts: int = 3
    # The watchdog (worker/jobs/watchdog.py): a phase of a job (build, kernel host, co-run) still
    # going this long past its own limit is stopped, its boxes killed; a job thread still blocked
    # watchdog_grace_s after that ends its worker process, its run `error` and never re-sent.
    # A cancel or a SIGTERM stops a running job the same way, within a second or two.
    watchdog_slack_s: float = Field(default=120.0, ge=0)
    watchdog_grace_s: float = Field(default=15.0, gt=0)
    # How often the API re-sends runs that never reached the broker and reaps dead ones (0: never).
    maintenance_interval_s: float = 15.0
    # Redis visibility timeout: longer than the longest run, or Redis re-delivers a running task.
    visibility_timeout_s: int = 6 * 3600
    case_timeout_s: float = 600.0

    # Server-side budgets (docs/security/SANDBOX.md, "Budgets"): a submitted tree's optdrift.toml may ask for less,
    # never more. A run past its total budget ends broken with the reason and the worker moves on.
    # verify runs (contributors' on-demand code, the lowest trust) get the smaller verify_* caps.
    max_build_s: float = 1800.0
    max_run_s: float = 3 * 3600.0
    verify_max_build_s: float = 900.0
    verify_case_timeout_s: float = 180.0
    verify_max_run_s: float = 1800.0

    # The sandbox every build and kernel host runs in (worker/sandbox/, bubblewrap). Where it
    # cannot be made, the worker says so at start and refuses verify runs unless this is set.
    allow_unsandboxed: bool = False
    # Extra read-only paths the sandbox shows (a toolchain outside /usr and /opt), os.pathsep-separated.
    sandbox_ro_paths: str = ""
    # Adapters registered beside the built-in ones, "name=/abs/folder/module.py" or "name=dotted.module",
    # comma-separated (worker/adapters/registry.py; the tests register their fixture adapters).
    extra_adapters: str = ""
    # An optdrift failure (source fetch, sandbox, a worker bug) is retried after this many seconds,
    # doubling each attempt (at most max_attempts), then the run ends `error`.
    retry_backoff_s: float = 10.0
    # A baseline co-run that yielded to waiting runs is queued again this many seconds later.
    corun_retry_s: float = 30.0

    # Authentication (service/domain/auth.py). Writes always need a token; reads only with this.
    protect_reads: bool = False
    # Verify runs per UTC day for a verify-scope token created without its own quota.
    verify_daily_quota: int = 20
    # The token a worker fetches sources with; default: <home>/worker-token (written by `serve`).
    worker_token: SecretStr | None = None
    # Seconds a client is told to wait (Retry-After) while the database is unreachable.
    database_retry_after_s: int = 5
    # GitHub credentials and webhook secrets are encrypted at rest (service/notify/sealing.py)
    # with this Fernet key (comma-separated keys: the first encrypts, all decrypt, for rotation),
    # or the one in secrets_key_file; neither set: <home>/secrets-key, made 0600 on first start.
    secrets_key: SecretStr | None = None
    secrets_key_file: Path | None = None
    # The secret GitHub signs webhook deliveries with (X-Hub-Signature-256): the GitHub App's webhook
    # secret, or a repository webhook's. Unset: POST /api/v1/github/events refuses every delivery
    # (service/notify/pull_requests.py, docs/INTEGRATIONS.md "Pull requests from forks").
    github_webhook_secret: SecretStr | None = None

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{self.home / 'optdrift.db'}"

    @property
    def resolved_broker_url(self) -> str:
        return self.broker_url or "filesystem://"

    @property
    def uses_filesystem_broker(self) -> bool:
        return self.resolved_broker_url.startswith("filesystem://")

    @property
    def broker_folder(self) -> Path:
        return self.home / "broker"

    @property
    def resolved_store_dir(self) -> Path:
        return self.store_dir or self.home / "store"

    @property
    def resolved_training_model_set(self) -> str | None:
        """The model set of the automatic training-impact job, or None when it is off."""
        if self.training_impact == "off":
            return None
        if self.training_impact == "auto":
            return "quick" if self.worker_device == "cpu" else "standard"
        return self.training_impact

    @property
    def resolved_training_hosts(self) -> int:
        if self.training_hosts is not None:
            return self.training_hosts
        # A host's training is one busy CPU core; past three quarters of the cores (and past 12 on
        # one GPU) more hosts only contend.
        return 2 if self.worker_device == "cpu" else max(2, min(12, (os.cpu_count() or 4) * 3 // 4))

    @property
    def resolved_build_cache_dir(self) -> Path:
        return self.build_cache_dir or self.home / "builds"

    @property
    def resolved_warm_host(self) -> bool:
        return self.worker_device != "cpu" if self.warm_host is None else self.warm_host

    @property
    def admin_token_file(self) -> Path:
        return self.home / "admin-token"

    @property
    def worker_token_file(self) -> Path:
        return self.home / "worker-token"

    @property
    def resolved_secrets_key_file(self) -> Path:
        return self.secrets_key_file or self.home / "secrets-key"

    def resolved_worker_token(self) -> str | None:
        if self.worker_token is not None:
            return self.worker_token.get_secret_value()
        try:
            return self.worker_token_file.read_text().strip() or None
        except OSError:
            return None

    # ---- API request and input limits (issue 13: service/api/request_guard.py, ----
    # ---- service/domain/patches.py, service/domain/submission_rules.py)        ----
    # A multipart body may be one upload (max_upload_bytes) plus this much for its form fields and
    # framing; past the sum the request is refused (413) before or while it is read.
    max_form_overhead_bytes: int = 64 * 1024
    # JSON and url-encoded bodies (projects, acknowledgements): FastAPI holds them whole in memory.
    max_json_body_bytes: int = 1024 * 1024
    # What a verify patch may write: any one file, and all files together (git binary literals
    # inflate, so a 6 MB patch could otherwise write 1 GiB).
    max_patch_file_bytes: int = 16 * 1024 * 1024
    max_patch_expanded_bytes: int = 64 * 1024 * 1024
    # Environments one commit submission may name (each is a run and a queue).
    max_environments_per_request: int = 16
    # What one run's battery may declare (service/core/battery_limits.py, docs/security/SERVICE.md "Bounded
    # batteries"), measured from its axis lengths before anything is expanded, at submission (422)
    # and again in the worker. verify_* for contributors' verify runs, lower. The shipped batteries
    # measure at most 8,978 bytes (the sensitivity pool), 1,092 cases, 100 steps, 2**20 elements,
    # 87,716 case-steps and 2.4e9 case-step-elements (all `standard`): a commit run has room for
    # 18x standard's cases, a verify run for standard itself with room to spare.
    max_battery_bytes: int = Field(default=1024 * 1024, ge=1)
    max_cases_per_run: int = Field(default=20_000, ge=1)
    max_steps_per_case: int = Field(default=10_000, ge=1)
    max_elements_per_case: int = Field(default=1 << 24, ge=1)
    max_case_steps_per_run: int = Field(default=1_000_000, ge=1)
    max_case_step_elements_per_run: int = Field(default=10 ** 11, ge=1)
    verify_max_battery_bytes: int = Field(default=256 * 1024, ge=1)
    verify_max_cases_per_run: int = Field(default=2_000, ge=1)
    verify_max_steps_per_case: int = Field(default=1_000, ge=1)
    verify_max_elements_per_case: int = Field(default=1 << 22, ge=1)
    verify_max_case_steps_per_run: int = Field(default=200_000, ge=1)
    verify_max_case_step_elements_per_run: int = Field(default=10 ** 10, ge=1)

    def battery_limits(self, kind: str) -> BatteryLimits:
        """The battery limits of a run of `kind` ("commit" or "verify"; anything else gets verify's)."""
        prefix = "" if kind == "commit" else "verify_"
        return BatteryLimits(
            kind="commit" if kind == "commit" else "verify",
            max_battery_bytes=getattr(self, f"{prefix}max_battery_bytes"),
            max_cases=getattr(self, f"{prefix}max_cases_per_run"),
            max_steps_per_case=getattr(self, f"{prefix}max_steps_per_case"),
            max_elements_per_case=getattr(self, f"{prefix}max_elements_per_case"),
            max_case_steps=getattr(self, f"{prefix}max_case_steps_per_run"),
            max_case_step_elements=getattr(self, f"{prefix}max_case_step_elements_per_run"),
        )
    # Slow clients (service/api/slow_clients.py): an idle keep-alive connection is closed after
    # keep_alive_timeout_s; a request's line and headers must arrive within
    # request_header_timeout_s; its body within request_body_timeout_s plus one second per
    # request_body_min_rate bytes received (Apache mod_reqtimeout's rule).
    keep_alive_timeout_s: int = Field(default=5, ge=1)
    request_header_timeout_s: float = Field(default=10.0, gt=0)
    request_body_timeout_s: float = Field(default=30.0, gt=0)
    request_body_min_rate: int = Field(default=500, ge=1)

    # ---- Where workers reach the API (issue 14: the embedded default finds itself) ----
    @property
    def api_url_file(self) -> Path:
        """`optdrift serve` writes the URL it listens on here, and removes it on exit."""
        return self.home / "api-url"

    @property
    def resolved_public_url(self) -> str:
        """Where a worker fetches sources: OPTDRIFT_PUBLIC_URL when set (workers on other hosts,
        or an API behind a proxy); else the URL a `serve` of the same OPTDRIFT_HOME listens on;
        else the default (http://127.0.0.1:8000)."""
        # An empty OPTDRIFT_PUBLIC_URL (a compose file's `${VAR:-}`) counts as unset.
        if "public_url" in self.model_fields_set and self.public_url.strip():
            return self.public_url
        try:
            written = self.api_url_file.read_text().strip()
        except OSError:
            written = ""
        return written or self.public_url

    # Verify runs a verify-scope token may have queued or running at once (service/domain/
    # verify_quota.py); more are refused with 429. Verify runs also wait behind commit runs.
    verify_max_active_per_token: int = Field(default=1, ge=1)


@lru_cache
def get_settings() -> Settings:
    return Settings()
