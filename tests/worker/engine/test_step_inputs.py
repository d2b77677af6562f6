"""Gradient inputs made before the run comes (worker.engine.step_inputs): a wave takes a prepared
step only where everything its tensors depend on matches, and the values are the ones it would
have made itself, bit for bit; a spare kernel host prepares the cases its parent expects."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from worker import pipeline
from worker.battery import load_battery
from worker.engine import fast, host_reserve, reference_cache, step_inputs
from worker.engine.gradients import GradientStream, initial_parameters
from worker.engine.host import KernelHost
from tests.worker.engine.test_host_reserve import warm_job
from worker.engine.trajectory import run_case

CPU = torch.device("cpu")
# open-loop, closed-loop and zeroed gradients; 1, 10 and 20 steps (the cases a wave holds: a layout
# case runs alone and makes its own inputs)
QUICK = [case for case in load_battery("quick").expand() if case.layout is None]
WAVES = fast.plan_waves(QUICK, fast.DEFAULT_MAX_WAVE_ELEMENTS["cpu"])
INITIAL = list(dict.fromkeys((c.seed, c.size) for c in QUICK))
CLOSED = list({step_inputs._closed_key(c): c for c in QUICK if c.gradient.kind == "closed"}.values())


@pytest.fixture(autouse=True)
def _nothing_prepared_left():
    step_inputs.discard_prepared()
    yield
    step_inputs.discard_prepared()
    host_reserve.discard()


def _every_step(cases) -> list[tuple[torch.Tensor, torch.Tensor]]:  # noqa: ANN001
    inputs = step_inputs.StepInputs(cases, CPU)
    try:
        return [inputs.get(step) for step in range(1, inputs.steps + 1)]
    finally:
        inputs.close()


def _made_without_preparing() -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    assert not step_inputs._prepared
    return [_every_step([QUICK[i] for i in wave]) for wave in WAVES]


def test_prepared_steps_are_taken_and_are_the_values_a_wave_makes() -> None:
    made = _made_without_preparing()
    queued, done = step_inputs.prepare(QUICK, CPU, fast.DEFAULT_MAX_WAVE_ELEMENTS["cpu"])
    assert CLOSED
    assert queued == sum(max(QUICK[i].steps for i in wave) for wave in WAVES) + len(INITIAL) + len(CLOSED)
    assert done.result(timeout=120) == queued
    for seed, size in INITIAL:  # made once per (seed, size), for every dtype and wave
        assert step_inputs._initial[(seed, size)].done()
        assert torch.equal(step_inputs.initial_parameters(seed, size), initial_parameters(seed, size))
    for case in CLOSED:  # each closed-loop stream's constants, GradientStream's bit for bit
        assert step_inputs._closed[step_inputs._closed_key(case)].done()
        stream = GradientStream(case.gradient, seed=case.seed, size=case.size, device="cpu", grad_dtype=torch.float32)
        curvature, centre = step_inputs.closed_constants(case)
        assert torch.equal(curvature, stream.curvature32) and torch.equal(centre, stream.centre32)
    prepared = dict(step_inputs._prepared)
    taken = []
    for wave, expected in zip(WAVES, made):
        inputs = step_inputs.StepInputs([QUICK[i] for i in wave], CPU)
        inputs.prefetch(1)
        taken += [future for future in inputs._futures.values() if future in prepared.values()]
        got = [inputs.get(step) for step in range(1, inputs.steps + 1)]
        inputs.close()
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, expected))
    # every prepared step went to the wave that asks for it, and nothing is left behind
    assert len(taken) == queued - len(INITIAL) - len(CLOSED) and not step_inputs._prepared


def test_a_wave_whose_inputs_differ_makes_its_own() -> None:
    step_inputs.prepare(QUICK, CPU, fast.DEFAULT_MAX_WAVE_ELEMENTS["cpu"])[1].result(timeout=120)
    before = len(step_inputs._prepared)
    # The same seeds and sizes with another gradient scale: another stream, so nothing matches.
    rescaled = [c.model_copy(update={"gradient": c.gradient.model_copy(update={"scale": 2.0})}) for c in QUICK]
    wave = [rescaled[i] for i in WAVES[-1]]
    got = _every_step(wave)
    assert len(step_inputs._prepared) == before
    step_inputs.discard_prepared()
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, _every_step(wave)))


def test_preparing_stops_at_its_byte_budget() -> None:
    # Steps are prepared in plan order (wave by wave, step by step) while their bytes fit.
    planned = [(inputs, step) for inputs in (step_inputs.StepInputs([QUICK[i] for i in wave], CPU) for wave in WAVES)
               for step in range(1, inputs.steps + 1)]
    # the initial parameters and the closed-loop constants come first
    first_bytes = sum(4 * size for _, size in INITIAL) + sum(8 * case.size for case in CLOSED)
    budget = first_bytes + sum(inputs.step_bytes(step) for inputs, step in planned[:3]) + 1  # 3 steps, not 4
    queued, done = step_inputs.prepare(QUICK, CPU, fast.DEFAULT_MAX_WAVE_ELEMENTS["cpu"], max_bytes=budget)
    assert queued == len(INITIAL) + len(CLOSED) + 3 and done.result(timeout=60) == queued
    assert sorted(key for key in step_inputs._prepared) == sorted((inputs._contents[step], step)
                                                                   for inputs, step in planned[:3])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_the_fast_engine_with_prepared_inputs_equals_run_case(kernels, device: str) -> None:
    # On CUDA the prepared steps are pinned host memory, made by the idle threads before any wave.
    device = torch.device(device)
    step_inputs.prepare(QUICK, device, fast.DEFAULT_MAX_WAVE_ELEMENTS[device.type])[1].result(timeout=120)
    fast_results = fast.run_cases_fast(QUICK, device)
    assert not step_inputs._prepared  # the waves took them all
    slow = [run_case(case, device) for case in QUICK]
    assert [repr(r.trajectory) for r in fast_results] == [repr(r.trajectory) for r in slow]


def test_a_spare_prepares_the_cases_its_parent_expects(kernels_build, tmp_path: Path) -> None:
    cases = QUICK[:24]
    with KernelHost(kernels_build.library_path, device="cpu") as started:
        expected = [repr(r.trajectory) for r in started.run_many(cases)]
    host_reserve.expect(cases, device="cpu")
    host_reserve.replenish(device="cpu", slot_root=tmp_path, keep=1)
    spare = host_reserve.take(kernels_build.library_path, device="cpu", adapter="bundled", adapter_paths=[],
                              case_timeout_s=60, deadline=None)
    assert spare is not None
    with spare:
        # It read the expected cases from its slot, inside its sandbox, before its build came,
        # and its waves took every step it made.
        assert spare.startup_s["inputs queued"] <= spare.startup_s["build received"]
        assert [repr(r.trajectory) for r in spare.run_many(cases, profile=True)] == expected
        phases = spare.last_phases  # the host's seconds per wave phase, asked for with profile=True
        assert {"setup", "gradients", "kernels", "observe", "request"} <= set(phases)
        assert phases["request"] >= phases["setup"] + phases["kernels"] > 0
        waves = fast.plan_waves(cases, fast.DEFAULT_MAX_WAVE_ELEMENTS["cpu"])
        assert spare.last_inputs_taken == sum(max(cases[i].steps for i in wave) for wave in waves) > 0


def test_spares_prepare_a_built_in_battery_and_never_a_projects_own(kernels_build, tmp_path: Path) -> None:
    # The next spare runs whichever project comes next, and its code can read what the spare was
    # told to prepare: only a battery optdrift ships (public) is handed on that way.
    job, warm = warm_job(tmp_path, QUICK[:12])
    pipeline.run(job, kernels_build, warm)
    assert host_reserve._expected["cpu"] == job.cases
    newest = host_reserve._spares[-1][1]
    assert (newest._slot / "expected-cases.json").is_file()
    job.battery = job.battery.model_copy(update={"description": "the project's own battery, named quick"})
    pipeline.run(job, kernels_build, warm)
    assert host_reserve._expected["cpu"] == []
    newest = host_reserve._spares[-1][1]
    assert not (newest._slot / "expected-cases.json").exists()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_a_spare_sets_its_waves_up_ahead_and_a_warm_run_takes_them_bit_for_bit(kernels_build, tmp_path: Path,
                                                                              monkeypatch, device: str) -> None:
    """A spare told the cases to expect sets their kernels-only waves up before its build comes
    (worker.engine.kernels_only.ReadyWaves); a warm run over exactly those cases binds and runs
    them: every case's digests form its known series (so each is answered by its key alone) and
    every result equals a cold run's. A request with other cases leaves them (they were made for
    those cases only) and sets its own up."""
    from worker.engine.host import client as host_module  # the module whose run_many resolves known series

    cases = QUICK  # several waves (its step counts and width classes)
    cache = reference_cache.ReferenceCache(tmp_path / "references", writable=True)
    with KernelHost(kernels_build.library_path, device=device) as started:
        cold = [repr(r.model_dump(exclude={"duration_s"})) for r in reference_cache.run_many(started, cases, cache)]
    by_key: list[int] = []
    resolve = host_module.known_series_result
    monkeypatch.setattr(host_module, "known_series_result",
                        lambda answer, index, known_result: by_key.append(index) or resolve(answer, index, known_result))
    waves = fast.plan_waves(cases, fast.DEFAULT_MAX_WAVE_ELEMENTS[device])
    assert len(waves) > 1  # several waves set up ahead, and every one of them taken below
    for asked, taken in ((cases, len(waves)), (cases[:-1], 0)):
        host_reserve.expect(cases, device=device)
        host_reserve.replenish(device=device, slot_root=tmp_path, keep=1)
        spare = host_reserve.take(kernels_build.library_path, device=device, adapter="bundled", adapter_paths=[],
                                  case_timeout_s=60, deadline=None)
        assert spare is not None
        by_key.clear()
        with spare:
            time.sleep(0.5)  # its build usually comes after the waves are set up; a join waits otherwise
            warm = reference_cache.run_many(spare, asked, cache, profile=True)
            assert [repr(r.model_dump(exclude={"duration_s"})) for r in warm] == cold[:len(asked)]
            assert sorted(by_key) == list(range(len(asked)))  # no case left the kernels-only pass
            assert spare.last_phases.get("ready waves taken", 0) == taken, spare.last_phases
