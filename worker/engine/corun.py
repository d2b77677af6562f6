"""Run a battery on one build, or co-run it on a commit build and a baseline build.

Co-running gives the per-step max |commit - baseline| of the cases whose digests differ. Two ways,
the same numbers (tests/worker/engine/test_corun_fast.py):

* **fast** (the worker's): the cases go in chunks (one step count, at most `chunk_bytes` of
  parameters per side; a case larger than that is a chunk of its own) to both kernel hosts at
  once; each runs its chunk in fast-engine waves, kernels only (worker.engine.kernels_only), and
  writes every step's parameters into a file in its scratch folder (worker.engine.params_file).
  While the hosts run chunk k, this process computes chunk k-1's diffs from the two files,
  vectorised in threads, and deletes them: disk and memory stay bounded by two chunks per side.
  `between_cases()` runs before each chunk (the worker yields to waiting runs there).
* **one case at a time** (`fast=False`): both hosts run one case, each writing its parameters to
  a temporary file, compared step by step, then deleted.

No case is run twice. This process never imports torch (numpy only), so it is safe in a Celery
worker's parent process.
"""

from __future__ import annotations

import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Callable

import numpy as np

from service.core.results import CaseResult, CaseSpec, RunResult
from worker import sandbox
from worker.battery import BatterySpec
from worker.engine import host_reserve, params_file
from worker.sandbox import boxfiles
from worker.engine.host import KernelHost

Progress = Callable[[int, int, CaseResult], None]
# Parameters per side and chunk: 1 GiB is the standard battery's 2.7 GB of changed cases (the decay
# reorder) in 4 chunks. Fewer, larger requests: each request costs both hosts a round trip and a
# wave setup, so larger chunks make the kernels phase shorter (bench/corun_chunks.py). The hosts
# hold a chunk's history on the device and in their file, this process maps it: up to two chunks
# per side at once. A chunk never exceeds the file size a sandboxed host may write
# (sandbox.HOST_LIMITS): past it the hosts cannot write their files and every case falls back to
# one at a time (the same diffs, many times slower).
DEFAULT_CHUNK_BYTES = 1024**3


def per_step_max_abs_diff(commit_file: Path, baseline_file: Path, steps: int, size: int) -> list[float]:
    """max_i |commit_i - baseline_i| per step from two (steps x size) float32 files, in float64."""
    commit = params_file.open_checked(commit_file, steps * size).reshape(steps, size)
    baseline = params_file.open_checked(baseline_file, steps * size).reshape(steps, size)
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
    with host_reserve.open_host(library_path, device=device, case_timeout_s=case_timeout_s, adapter=adapter) as host:
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
                  fast: bool = False, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                  adapter_paths: tuple[list[Path], list[Path]] = ([], []),
                  hosts: tuple[KernelHost, KernelHost] | None = None, timings: dict[str, float] | None = None,
                  close_hosts: bool = True, compile_caches: tuple = (None, None),
                  ) -> tuple[RunResult, RunResult, dict[str, list[float]]]:
    """(commit run, baseline run, per-step max |commit - baseline| of the cases whose digests differ).
    `between_cases()` runs before each case, or each chunk when `fast` (the worker's co-run yields
    to waiting runs there). `params_only`: the kernels alone in both hosts, no references (the
    results then carry digests and no metric series): what the per-step diffs of already-stored
    runs need, many times faster. `fast` (implies params_only): the fast engine's waves, in chunks
    of at most `chunk_bytes` of parameters per side (module docstring). `adapter_paths`: (the
    commit's, the baseline's) folders their adapter module is imported from (a tree's adapter_path).
    `hosts`: (the commit's, the baseline's) hosts of those builds, started ahead or not (the worker's
    co-run hands in spares: worker.engine.host_reserve.open_host); closed here either way unless
    `close_hosts=False` and they were handed in (the worker's co-run closes them after storing its
    diffs: a CUDA host's exit takes about a second). `timings` gains "hosts_s" (starting the hosts
    not yet running, together), "kernels_s" (the rest) and, when it closes them, "close_s"; when
    `fast`, the kernels' split too (_corun_fast). `compile_caches`: (the commit's, the baseline's)
    build compile caches (worker.engine.compile_cache) for the hosts started here; the caller
    releases them."""
    cases = battery.expand() if cases is None else cases
    if hosts is None:
        close_hosts = True  # started here: closed here
        hosts = tuple(host_reserve.open_host(library, device=device, case_timeout_s=case_timeout_s, adapter=adapter,
                                             adapter_paths=paths, compile_cache=cache)
                      for library, paths, cache in zip((commit_library, baseline_library), adapter_paths,
                                                       compile_caches))
    hosts = list(hosts)
    timings = {} if timings is None else timings
    began = time.monotonic()
    try:
        KernelHost.start_together(hosts)  # overlapped, and timed apart from the kernels
        timings["hosts_s"] = time.monotonic() - began
        try:
            return _corun(battery, hosts, cases, commit_digest, baseline_digest, progress, between_cases,
                          params_only, fast, chunk_bytes, timings)
        finally:
            timings["kernels_s"] = time.monotonic() - began - timings["hosts_s"]
    finally:
        if close_hosts:
            closing = time.monotonic()
            KernelHost.close_together(hosts)
            timings["close_s"] = time.monotonic() - closing


def _corun(battery: BatterySpec, hosts: list[KernelHost], cases: list[CaseSpec], commit_digest: str | None,
           baseline_digest: str | None, progress: Progress | None, between_cases: Callable[[], None] | None,
           params_only: bool, fast: bool, chunk_bytes: int, timings: dict[str, float],
           ) -> tuple[RunResult, RunResult, dict[str, list[float]]]:
    if fast:
        commit_results, baseline_results, diffs = _corun_fast(hosts, cases, chunk_bytes, between_cases, progress,
                                                              timings)
        return (_run_result(battery, hosts[0], commit_digest, commit_results),
                _run_result(battery, hosts[1], baseline_digest, baseline_results), diffs)
    commit_results, baseline_results, diffs = [], [], {}
    commit_host, baseline_host = hosts
    with tempfile.TemporaryDirectory(prefix="optdrift-corun-") as workdir:
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


def plan_chunks(cases: list[CaseSpec], max_bytes: int) -> list[list[int]]:
    """Indices of `cases` in chunks of one step count and at most `max_bytes` of float32
    parameters (steps x size x 4) each; a case larger than that is a chunk of its own."""
    chunks: list[list[int]] = []
    current: list[int] = []
    used = 0
    for index in sorted(range(len(cases)), key=lambda i: (cases[i].steps, i)):
        cost = cases[index].steps * cases[index].size * 4
        if current and (used + cost > max_bytes or cases[index].steps != cases[current[0]].steps):
            chunks.append(current)
            current, used = [], 0
        current.append(index)
        used += cost
    if current:
        chunks.append(current)
    return chunks


class _Chunk:
    """One chunk in flight: its cases, both sides' results, and where each case's parameters lie
    (the host's chunk file, or a file of its own where the host fell back to one case at a time)."""

    def __init__(self, number: int, indices: list[int], cases: list[CaseSpec], workdir: Path) -> None:
        self.number, self.indices, self.cases = number, indices, [cases[i] for i in indices]
        self.file_name = f"params-{number % 2}.f32"  # chunk k-1's file is read while k's is written
        self.workdir = workdir
        self.own_files: list[dict[int, Path]] = [{}, {}]  # per side: position -> its one-case file
        self.results: list[list[CaseResult]] = []

    def run_one(self, host: KernelHost, side: int) -> Callable[[int, CaseSpec], CaseResult]:
        """The fallback for a case the host's fast run did not answer: the one-case co-run's way."""
        def run(position: int, case: CaseSpec) -> CaseResult:
            path = self.workdir / f"side{side}-chunk{self.number}-case{position}.f32"
            host.submit(case, path, params_only=True)
            result = host.collect()
            self.own_files[side][position] = path
            return result
        return run

    def diffs(self, hosts: list[KernelHost]) -> dict[str, list[float]]:
        """Per-step max |commit - baseline| of this chunk's cases whose digests differ; its files go."""
        commit, baseline = self.results
        differing = [p for p, (a, b) in enumerate(zip(commit, baseline))
                     if a.status == "ok" and b.status == "ok" and a.trajectory.digests != b.trajectory.digests]
        layout = params_file.regions(self.cases)
        try:
            sides = []
            for side, host in enumerate(hosts):
                own = self.own_files[side]
                mapped = (self._taken_chunk_file(host, side) if any(p not in own for p in differing) else None)

                def rows(position: int, own=own, mapped=mapped) -> np.ndarray:  # noqa: ANN001
                    region = layout[position]
                    if position in own:
                        return params_file.open_checked(own[position], region.elements).reshape(region.steps, region.size)
                    return mapped[region.offset:region.offset + region.elements].reshape(region.steps, region.size)
                sides.append(rows)
            values = params_file.per_step_max_abs_diffs([(sides[0](p), sides[1](p)) for p in differing])
        finally:
            for side, host in enumerate(hosts):
                (host.scratch_path / self.file_name).unlink(missing_ok=True)
                (self.workdir / self._taken_name(side)).unlink(missing_ok=True)
                for path in self.own_files[side].values():
                    path.unlink(missing_ok=True)
        return {self.cases[p].case_id: series for p, series in zip(differing, values)}

    def _taken_name(self, side: int) -> str:
        return f"side{side}-chunk{self.number}.f32"

    def _taken_chunk_file(self, host: KernelHost, side: int) -> np.ndarray:
        """The chunk's parameter file the host wrote in its scratch, copied first into the worker's
        own folder (worker.sandbox.boxfiles: the host is alive and runs submitted code; it could
        swap the file for a link or a FIFO, or truncate a mapping under the worker) and mapped there."""
        elements = params_file.total_elements(self.cases)
        taken = self.workdir / self._taken_name(side)
        try:
            found = boxfiles.copy_out(host.scratch_path, self.file_name, taken, max_bytes=elements * 4,
                                      exact_bytes=elements * 4)
        except boxfiles.BoxFileRefused as refused:
            raise params_file.ParamsFileError(f"the kernel host's parameter file: {refused}") from None
        if not found:
            raise params_file.ParamsFileError(f"the kernel host left no parameter file {self.file_name}")
        return params_file.open_checked(taken, elements)


def _timed(into: dict[str, float], key: str, work: Callable, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
    """work(*args, **kwargs), its seconds added to into[key] (each parallel side adds to a key of
    its own)."""
    began = time.monotonic()
    try:
        return work(*args, **kwargs)
    finally:
        into[key] = into.get(key, 0.0) + time.monotonic() - began


def _host_request(into: dict[str, float], side: str, host: KernelHost, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
    """host.run_many(*args, **kwargs), timed into "<side>_host_s", with the host's own account of
    its parameter writing added into "<side>_<part>_s" (device_to_host, into_file)."""
    host.last_params_s = {}
    try:
        return _timed(into, f"{side}_host_s", host.run_many, *args, **kwargs)
    finally:
        for part in ("device_to_host", "into_file"):
            if part in host.last_params_s:
                key = f"{side}_{part}_s"
                into[key] = into.get(key, 0.0) + host.last_params_s[part]


def _corun_fast(hosts: list[KernelHost], cases: list[CaseSpec], chunk_bytes: int,
                between_cases: Callable[[], None] | None, progress: Progress | None,
                timings: dict[str, float] | None = None,
                ) -> tuple[list[CaseResult], list[CaseResult], dict[str, list[float]]]:
    """`timings` gains where the time went: "chunks", "commit_host_s" and "baseline_host_s" (each
    host's requests, parameter files written), of which the host says "<side>_device_to_host_s" and
    "<side>_into_file_s" went on its parameters, and "diff_s" (this process reading both files and
    computing the diffs; it overlaps the next chunk's requests but for the last chunk's)."""
    results: list[list[CaseResult | None]] = [[None] * len(cases), [None] * len(cases)]
    diffs: dict[str, list[float]] = {}
    timings = {} if timings is None else timings
    sides = ("commit", "baseline")
    done = 0
    with tempfile.TemporaryDirectory(prefix="optdrift-corun-") as workdir, \
            ThreadPoolExecutor(max_workers=3, thread_name_prefix="optdrift-corun") as pool:
        previous: _Chunk | None = None
        # A host's file holds one chunk: never more than a sandboxed host may write.
        chunk_bytes = min(chunk_bytes, sandbox.HOST_LIMITS.file_size_bytes)
        for number, indices in enumerate(plan_chunks(cases, chunk_bytes)):
            if between_cases:
                between_cases()
            chunk = _Chunk(number, indices, cases, Path(workdir))
            # Both hosts run this chunk while this process diffs the previous one; every future is
            # waited for before anything is raised, so no host is left mid-request.
            timings["chunks"] = number + 1
            running = [pool.submit(_host_request, timings, sides[side], host, chunk.cases,
                                   params_file=chunk.file_name, run_one=chunk.run_one(host, side))
                       for side, host in enumerate(hosts)]
            diffing = [pool.submit(_timed, timings, "diff_s", previous.diffs, hosts)] if previous else []
            wait(running + diffing)
            for future in diffing:
                diffs.update(future.result())
            chunk.results = [future.result() for future in running]
            for side in (0, 1):
                for position, index in enumerate(indices):
                    results[side][index] = chunk.results[side][position]
            for position in range(len(indices)):
                done += 1
                if progress:
                    progress(done, len(cases), chunk.results[0][position])
            previous = chunk
        if previous:
            diffs.update(_timed(timings, "diff_s", previous.diffs, hosts))
    return results[0], results[1], diffs
