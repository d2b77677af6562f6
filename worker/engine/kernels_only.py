"""The fast engine without references: the kernels under test in fast-engine waves, digests only.

The same waves, arenas, gradients, bound kernel calls and od2 observation as worker.engine.fast
(so the digests are run_case's and run_params', bit for bit), minus everything a reference needs:
no bundles, no float64 or same-precision gradients, no reference steps, no metric maxima. Results
look like worker.engine.trajectory.run_params's: digests, empty metric series. Two users:

* **the co-run** (worker.engine.corun): each build runs the changed cases here and writes their
  parameters after every step into a parameter file (worker.engine.params_file). The parameters of
  a wave are gathered on the device into a [steps, elements] float32 history by the observation
  (inside its CUDA graph). After the wave they are put in the file's order on the device, copied
  once into a pinned host buffer the host keeps, and written into the file per case with pwrite.
* **the reference cache's first pass** (worker.engine.reference_cache): cases whose digest
  series the parent already holds metrics for run here first; only those whose series turns out
  new run again through the full engine (`run_cases_known`).

A case the wave could not run (its kernel or binding raised) runs alone with run_params, as the
one-case co-run would run it, writing its own rows of the parameter file.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping

import numpy as np
import torch

from service.core.results import CaseResult, CaseSpec, Trajectory
from worker.engine import fast, params_file
from worker.engine.reference_cache import series_key
from worker.engine.trajectory import FamilyAdapter, bundled_families, run_params

OnResult = Callable[[int, CaseResult], None]
# Where one case's parameters go: (first step, [n, size] float32 rows after those steps). A numpy
# [steps, size] array is taken too (array_sink); the host passes params_file.RegionWriter.
ParamsSink = Callable[[int, np.ndarray], None]


def array_sink(array: np.ndarray) -> ParamsSink:
    def write(first_step: int, rows: np.ndarray) -> None:
        array[first_step:first_step + rows.shape[0]] = rows
    return write


def _sink(target: np.ndarray | ParamsSink) -> ParamsSink:
    return array_sink(target) if isinstance(target, np.ndarray) else target


class _Staging:
    """A host buffer for the waves' device -> host copies, kept by the process and grown as needed:
    pinned (page-locked) on CUDA, so the copy runs at the bus's speed and touches no new page (a
    fresh pageable buffer per wave pays a page fault per page and a staged copy). Pinning falls back to a kept pageable buffer where the driver refuses it."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def take(self, elements: int, device: torch.device) -> torch.Tensor:
        if self.buffer is None or self.buffer.numel() < elements:
            self.buffer = None  # the old one goes before the larger one is made
            size = max(elements, 1 << 20)
            pin = device.type == "cuda"
            try:
                self.buffer = torch.empty(size, dtype=torch.float32, pin_memory=pin)
            except RuntimeError:  # pinned memory refused (limits): pageable, still kept
                self.buffer = torch.empty(size, dtype=torch.float32)
        return self.buffer[:elements]


_staging = _Staging()


class _KernelsOnlyWave(fast._Wave):
    with_references = False
    merge_padding_fraction = fast.KERNELS_ONLY_MERGE_PADDING_FRACTION

    def __init__(self, cases: list[CaseSpec], device: torch.device, families: Mapping[str, FamilyAdapter],
                 initial: dict, closed_cache: dict, params_out: list[ParamsSink] | None,
                 params_seconds: dict[str, float] | None = None, *, bind: bool = True) -> None:
        self.params_out = params_out  # per wave case: where its [steps, size] float32 rows go
        self.params_seconds = params_seconds  # where writing them went (seconds added per wave)
        super().__init__(cases, device, families, False, initial, closed_cache, bind=bind)

    def _make_bundles(self, width_class, batch_low_precision_refs) -> None:  # noqa: ANN001
        """No references, so no bundles."""

    def _allocate_observation(self) -> None:
        super()._allocate_observation()
        self.gather: list[tuple[object, torch.Tensor]] = []  # (arena, flat indices of its valid elements)
        self.param_at: dict[int, int] = {}  # wave case -> its first column in the history
        if self.params_out is None:
            return
        at = 0
        for arena in self.param_arenas:
            self.gather.append((arena, (~arena.padding).reshape(-1).nonzero().squeeze(1)))
            for row, case in enumerate(arena.cases):
                self.param_at[arena.wave_index[row]] = at
                at += case.size
        self.param_hist = torch.zeros((self.steps, at), dtype=torch.float32, device=self.device)

    def observe(self) -> None:
        if self.gather:  # this step's parameters, exact in float32, into the wave's history
            gathered = torch.cat([arena.param.reshape(-1).index_select(0, flat).to(torch.float32)
                                  for arena, flat in self.gather])
            self.param_hist.index_copy_(0, self.step_index, gathered.unsqueeze(0))
        super().observe()

    def _results(self, started: float) -> dict[int, CaseResult]:
        if self.params_out is not None:
            began = time.perf_counter()
            written = [index for index in range(len(self.cases)) if index not in self.broken]
            # Each case's [steps, size] block made contiguous on the device (file order), then one
            # copy to the host: the device reorders at its own bandwidth, the bus moves it once.
            blocks = [self.param_hist[:self.cases[i].steps, self.param_at[i]:self.param_at[i] + self.cases[i].size]
                      .reshape(-1) for i in written]
            if blocks:
                flat = torch.cat(blocks)
                host = _staging.take(flat.numel(), self.device)
                host.copy_(flat)
                del flat
                rows = host.numpy()
            copied = time.perf_counter()
            at = 0
            for index in written:
                case = self.cases[index]
                self.params_out[index](0, rows[at:at + case.steps * case.size].reshape(case.steps, case.size))
                at += case.steps * case.size
            if self.params_seconds is not None:
                self.params_seconds["device_to_host"] += copied - began
                self.params_seconds["into_file"] += time.perf_counter() - copied
        return super()._results(started)

    def _trajectory(self, index: int, steps: int, f64: torch.Tensor, i64: torch.Tensor,
                    digests: list[str]) -> Trajectory:
        return Trajectory(ref64_max_abs=[], ref64_max_rel=[], nonfinite_count=[], digests=digests)


class ReadyWaves:
    """The kernels-only waves of `cases`, set up before any build is loaded: a spare kernel host's
    for the cases its parent expects (worker/engine/host/spare.py). Each wave has its
    arenas, initial parameters, every case opened by `families` with its states laid out, its
    observation and (CUDA) its gradient graphs; only the binding of each step to the build
    (`_Wave.bind_steps`) is left. A warm
    run's first pass over exactly these cases (run_cases_known) takes them instead of setting its
    waves up, which is most of a warm battery's setup otherwise.

    Only adapters whose open does not call the build may be set up ahead: the spare uses the
    bundled families (worker.adapters.bundled), and a wave is handed only to a run whose adapter
    gives those same family objects. The values are the ones the run would make itself (the same
    code on the same cases; tests/worker/engine/test_host_reserve.py compares every digest)."""

    def __init__(self, cases: list[CaseSpec], device: torch.device | str,
                 families: Mapping[str, FamilyAdapter]) -> None:
        self.device, self.families = torch.device(device), families
        self.waves: dict[tuple[int, ...], _KernelsOnlyWave] = {}
        initial: dict = {}
        closed_cache: dict = {}
        limit = fast.DEFAULT_MAX_WAVE_ELEMENTS.get(self.device.type, fast.DEFAULT_MAX_WAVE_ELEMENTS["cpu"])
        try:
            for indices in fast.plan_wave_indices(cases, limit):
                wave = self.waves[tuple(indices)] = _KernelsOnlyWave(
                    [cases[i] for i in indices], self.device, families, initial, closed_cache, None, bind=False)
                wave.capture_gradients_ahead()
        except BaseException:
            self.close()
            raise

    def take(self, indices: list[int], families: Mapping[str, FamilyAdapter]) -> "_KernelsOnlyWave | None":
        """The wave set up for exactly these case indices (of the cases it was made for), once;
        None when there is none or the run's adapter families are not the ones it opened with."""
        if families is not self.families:
            return None
        return self.waves.pop(tuple(indices), None)

    def close(self) -> None:
        """Close what no run took: input work stopped, every handle closed, the memory let go."""
        waves, self.waves = list(self.waves.values()), {}
        for wave in waves:
            wave.inputs.close()
            wave.close_handles(quiet=True)


class _Rows:
    """A run_params sink (a binary file's write) that hands each step's row to a ParamsSink."""

    def __init__(self, sink: ParamsSink | None, size: int) -> None:
        self.sink, self.size, self.step = sink, size, 0

    def write(self, data: bytes) -> int:
        if self.sink is not None:
            self.sink(self.step, np.frombuffer(data, dtype=np.float32).reshape(1, self.size))
        self.step += 1
        return len(data)


def run_kernels_only(cases: list[CaseSpec], device: torch.device | str, *,
                     families: Mapping[str, FamilyAdapter] | None = None,
                     params_out: list[np.ndarray | ParamsSink] | None = None,
                     params_seconds: dict[str, float] | None = None,
                     on_result: OnResult | None = None,
                     rerun_broken: bool = True, use_graphs: bool | None = None,
                     max_wave_elements: int | None = None,
                     profile: dict[str, float] | None = None,
                     ready: ReadyWaves | None = None) -> list[CaseResult | None]:
    """Each case's digests (run_params's result) in `cases` order; `params_out[i]`, when given,
    receives case i's parameters after each step: a [steps, size] float32 array, or a ParamsSink; `params_seconds`
    ({"device_to_host": 0.0, "into_file": 0.0}) gains where writing them went, wave by wave.
    `rerun_broken=False` leaves a case the wave could not run unanswered (None) instead of running
    it alone (the reference cache's first pass: the full engine runs it next anyway). `profile`
    gains the host seconds per phase of the waves (fast.run_waves; bench/warm_battery_profile.py).
    `ready`: waves set up ahead for exactly `cases` (ReadyWaves), taken where they match."""
    device = torch.device(device)
    use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
    if max_wave_elements is None:
        max_wave_elements = fast.DEFAULT_MAX_WAVE_ELEMENTS.get(device.type, fast.DEFAULT_MAX_WAVE_ELEMENTS["cpu"])
    families = bundled_families() if families is None else families
    unknown = sorted({c.family for c in cases} - set(families))
    if unknown:
        raise ValueError(f"kernel families {unknown} have no adapter (known: {sorted(families)})")
    sinks = None if params_out is None else [_sink(target) for target in params_out]

    def alone(index: int, case: CaseSpec) -> CaseResult | None:
        if not rerun_broken:
            return None
        try:
            return run_params(case, device, _Rows(None if sinks is None else sinks[index], case.size),
                              families=families)
        except Exception as error:  # noqa: BLE001 - the kernel host's rule: a kernel error breaks its case
            return CaseResult(case=case, status="broken", message=f"{type(error).__name__}: {error}")

    def make_wave(indices: list[int], wave_cases: list[CaseSpec], initial: dict, closed_cache: dict) -> _KernelsOnlyWave:
        taken = ready.take(indices, families) if ready is not None and sinks is None else None
        if taken is not None:
            started = time.perf_counter()
            taken.inputs.prefetch(1)  # its steps' gradient inputs: the prepared ones, or made from now
            taken.bind_steps()
            fast._timed("setup_bind", started)
            if profile is not None:
                profile["ready waves taken"] = profile.get("ready waves taken", 0) + 1
            return taken
        wave_sinks = None if sinks is None else [sinks[i] for i in indices]
        return _KernelsOnlyWave(wave_cases, device, families, initial, closed_cache, wave_sinks, params_seconds)

    return fast.run_waves(cases, max_wave_elements, use_graphs, on_result, profile, make_wave=make_wave,
                          run_alone=alone)


# A known series' answer: (case index, its series key, the kernels-only result with its digests).
OnKnown = Callable[[int, str, CaseResult], None]


def run_cases_known(cases: list[CaseSpec], device: torch.device | str, known: dict[int, set[str]], *,
                    families: Mapping[str, FamilyAdapter] | None = None,
                    on_result: OnResult | None = None, on_known: OnKnown | None = None,
                    profile: dict[str, float] | None = None, ready: ReadyWaves | None = None) -> list[CaseResult]:
    """Every case's result, with the reference work skipped where it is known already.

    `known[i]`: series keys (reference_cache.series_key) of digest series whose metrics the parent
    holds for case i in this environment. Those cases run kernels-only first; a case whose digests
    form a known series is answered with digests only (the parent fills in the metrics); every
    other case runs through the full fast engine, as without a cache. `on_known`, when given,
    takes the known-series answers instead of `on_result` (the kernel host answers those with the
    series key alone: the parent holds the digests already). `profile` gains both passes' host
    seconds per wave phase. `ready`: kernels-only waves set up ahead for exactly `cases`
    (ReadyWaves), used when every case is known (the first pass then runs `cases` as they are)."""
    results: list[CaseResult | None] = [None] * len(cases)
    first = sorted(known)

    def answer(index: int, result: CaseResult) -> None:
        results[index] = result
        if on_result:
            on_result(index, result)

    def first_pass(position: int, result: CaseResult) -> None:
        index = first[position]
        if result.status != "ok":
            return
        key = series_key(result.trajectory.digests)
        if key not in known[index]:
            return
        if on_known is None:
            answer(index, result)
            return
        results[index] = result
        on_known(index, key, result)

    if first:
        whole = len(first) == len(cases)  # first == 0..n-1: the waves planned are those of `cases`
        run_kernels_only([cases[i] for i in first], device, families=families, on_result=first_pass,
                         rerun_broken=False, profile=profile, ready=ready if whole else None)
    rest = [index for index, result in enumerate(results) if result is None]
    fast.run_cases_fast([cases[i] for i in rest], torch.device(device), families=families,
                        on_result=lambda position, result: answer(rest[position], result), profile=profile)
    return results


def run_request(request: dict, cases: list[CaseSpec], runnable: list[int], device: torch.device,
                families: Mapping[str, FamilyAdapter], emit: OnResult,
                profile: dict[str, float] | None = None, emit_known: OnKnown | None = None,
                ready: ReadyWaves | None = None) -> dict[str, float]:
    """The kernel host's `run_many` (worker/engine/host/batch.py) on the `runnable` indices of `cases`:
    with "params_out" (a file in the host's scratch) the co-run's kernels-only run writing it; with
    "known" ({case index: [series keys]}) the reference cache's two passes; else the fast engine.
    Returns, for a co-run's request, where its parameter writing went (run_kernels_only's
    `params_seconds`), else {}. `profile` gains the host seconds per wave phase. `emit_known`,
    when given, answers the cases whose digests form a known series (run_cases_known's `on_known`).
    `ready`: kernels-only waves set up ahead for exactly `cases` (ReadyWaves)."""
    subset = [cases[i] for i in runnable]

    def on_result(position: int, result: CaseResult) -> None:
        emit(runnable[position], result)

    if request.get("params_out"):
        fd, writers = params_file.create_for_writing(request["params_out"], cases)
        try:
            seconds = {"device_to_host": 0.0, "into_file": 0.0}
            if subset:
                run_kernels_only(subset, device, families=families, params_out=[writers[i] for i in runnable],
                                 params_seconds=seconds, on_result=on_result, profile=profile)
        finally:  # no fsync: the parent reads the same pages; writing them to disk is not needed
            os.close(fd)
        return seconds
    known = {int(index): set(keys) for index, keys in (request.get("known") or {}).items()}
    if known:
        position_of = {index: position for position, index in enumerate(runnable)}
        on_known = None if emit_known is None else (
            lambda position, key, result: emit_known(runnable[position], key, result))
        whole = len(runnable) == len(cases)  # subset == cases: the ready waves' indices hold
        run_cases_known(subset, device, {position_of[i]: keys for i, keys in known.items() if i in position_of},
                        families=families, on_result=on_result, on_known=on_known, profile=profile,
                        ready=ready if whole else None)
        return {}
    fast.run_cases_fast(subset, device, families=families, on_result=on_result, profile=profile)
    return {}
