"""Run a battery on one build, or co-run it on a commit build and a baseline build.

Co-running: for each case, both kernel hosts run it at the same time, each writing its parameters
after every step to a temporary float32 file; when the digests differ, the per-step
max |commit - baseline| is computed from the two files step by step, then both files are deleted.
Disk and memory stay bounded by one case, and no case is run twice. This process never imports
torch (numpy only), so it is safe in a Celery worker's parent process.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

from service.results import CaseResult, CaseSpec, RunResult
from worker.battery import BatterySpec
from worker.engine.host import KernelHost

Progress = Callable[[int, int, CaseResult], None]


def per_step_max_abs_diff(commit_file: Path, baseline_file: Path, steps: int, size: int) -> list[float]:
    """max_i |commit_i - baseline_i| per step from two (steps x size) float32 files, in float64."""
    commit = np.memmap(commit_file, dtype="<f4", mode="r", shape=(steps, size))
    baseline = np.memmap(baseline_file, dtype="<f4", mode="r", shape=(steps, size))
    # A non-finite parameter on both sides (a float16 case gone to inf) has no difference: NaN, kept.
    with np.errstate(invalid="ignore"):
        diffs = [float(np.max(np.abs(commit[s].astype(np.float64) - baseline[s].astype(np.float64))))
                 for s in range(steps)]
    del commit, baseline
    return diffs


def _run_result(battery: BatterySpec, host: KernelHost, build_digest: str | None,
                cases: list[CaseResult]) -> RunResult:
    return RunResult(battery_name=battery.name, battery_version=battery.version, battery_digest=battery.digest,
                     environment=host.environment, build_digest=build_digest, cases=cases)


def run_battery(battery: BatterySpec, library_path: str | Path, *, build_digest: str | None = None,
                device: str = "auto", case_timeout_s: float = 300.0, cases: list[CaseSpec] | None = None,
                progress: Progress | None = None, adapter: str = "bundled", fast: bool = False) -> RunResult:
    """Every case of `battery` (or the given subset) on one build, driven by `adapter` (worker.adapters).
    `fast`: the kernel host's fast runner (worker.engine.fast; the same results, bit for bit)."""
    cases = battery.expand() if cases is None else cases
    results = []
    with KernelHost(library_path, device=device, case_timeout_s=case_timeout_s, adapter=adapter) as host:
        if fast:
            arrived: list[int] = []

            def on_result(index: int, result: CaseResult) -> None:
                arrived.append(index)
                if progress:
                    progress(len(arrived), len(cases), result)

            return _run_result(battery, host, build_digest, host.run_many(cases, on_result=on_result))
        for index, case in enumerate(cases):
            results.append(host.run(case))
            if progress:
                progress(index + 1, len(cases), results[-1])
        return _run_result(battery, host, build_digest, results)


def corun_battery(battery: BatterySpec, commit_library: str | Path, baseline_library: str | Path, *,
                  commit_digest: str | None = None, baseline_digest: str | None = None,
                  device: str = "auto", case_timeout_s: float = 300.0, cases: list[CaseSpec] | None = None,
                  progress: Progress | None = None, adapter: str = "bundled",
                  between_cases: Callable[[], None] | None = None, params_only: bool = False,
                  ) -> tuple[RunResult, RunResult, dict[str, list[float]]]:
    """(commit run, baseline run, per-step max |commit - baseline| of the cases whose digests differ).
    `between_cases()` runs before each case (the worker's co-run yields to waiting runs there).
    `params_only`: the kernels alone in both hosts, no references (the results then carry digests
    and no metric series): what the per-step diffs of already-stored runs need, many times faster."""
    cases = battery.expand() if cases is None else cases
    commit_results, baseline_results, diffs = [], [], {}
    with (KernelHost(commit_library, device=device, case_timeout_s=case_timeout_s, adapter=adapter) as commit_host,
          KernelHost(baseline_library, device=device, case_timeout_s=case_timeout_s, adapter=adapter) as baseline_host,
          tempfile.TemporaryDirectory(prefix="optdrift-corun-") as workdir):
        commit_file, baseline_file = Path(workdir) / "commit.f32", Path(workdir) / "baseline.f32"
        for index, case in enumerate(cases):
            if between_cases:
                between_cases()
            baseline_host.submit(case, baseline_file, params_only=params_only)
            commit_host.submit(case, commit_file, params_only=params_only)
            baseline_result, commit_result = baseline_host.collect(), commit_host.collect()
            if (commit_result.status == "ok" and baseline_result.status == "ok"
                    and commit_result.trajectory.digests != baseline_result.trajectory.digests):
                diffs[case.case_id] = per_step_max_abs_diff(commit_file, baseline_file, case.steps, case.size)
            for leftover in (commit_file, baseline_file):
                leftover.unlink(missing_ok=True)
            commit_results.append(commit_result)
            baseline_results.append(baseline_result)
            if progress:
                progress(index + 1, len(cases), commit_result)
        return (_run_result(battery, commit_host, commit_digest, commit_results),
                _run_result(battery, baseline_host, baseline_digest, baseline_results), diffs)
