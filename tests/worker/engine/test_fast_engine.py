"""The fast battery runner gives exactly run_case's results, and the od2 digest is what it says.

Exactness, not tolerance: every per-step series is compared through repr (so NaN matches NaN and
-0.0 does not match 0.0) and every digest as a string. Tests named *cuda* run the same checks on a
GPU and skip without one (bench/gpu/h200_fast.sh runs them on the H200).
"""

from __future__ import annotations

import pytest
import torch

from service.core.results import CaseResult, CaseSpec, Trajectory
from service.core.verdicts import compare_case
from worker.engine import digest as od2
from worker.battery import BatterySpec, load_battery
from worker.engine.fast import ALIGN, bundle_count, plan_waves, reference_key, run_cases_fast, width_classes
from worker.engine.trajectory import run_case

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Many cases per group: every optimizer x family x dtype, sizes around the 256-element block and
# the vector width, open/closed/zeroed gradients, two seeds, skip_zeros with gnorm_scale.
GROUPED = BatterySpec.model_validate({"name": "grouped-test", "version": 1, "groups": [
    {"optimizers": ["adam", "ademamix", "lion", "momentum", "rmsprop", "adagrad"],
     "families": ["32bit", "8bit_blockwise"], "param_dtypes": ["float32", "bfloat16", "float16"],
     "sizes": [1, 257, 1031], "seeds": [0, 1], "steps": 3,
     "gradients": [{"kind": "open", "zero_fraction": 0.25}, {"kind": "closed"}],
     "points": [{"lr": 0.1, "weight_decay": 0.1}]},
    {"optimizers": ["adam"], "sizes": [7, 4097], "seeds": [0, 3], "steps": 4,
     "gradients": [{"kind": "open", "zero_fraction": 0.5}],
     "points": [{"lr": 0.1, "weight_decay": 0.1, "skip_zeros": True, "gnorm_scale": 0.5}]},
]})


def _python_od2(tensors: list[torch.Tensor]) -> str:
    """The od2 definition in plain Python integers (the docstring of worker/engine/digest.py)."""
    mask = (1 << 64) - 1

    def mix(z: int) -> int:
        z &= mask
        z ^= z >> 30
        z = (z * 0xBF58476D1CE4E5B9) & mask
        z ^= z >> 27
        z = (z * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    lane_a = lane_b = 0
    for slot, tensor in enumerate(tensors):
        raw = tensor.contiguous().cpu().view(torch.uint8).numpy().tobytes()
        size = tensor.element_size()
        for j in range(tensor.numel()):
            x = int.from_bytes(raw[j * size:(j + 1) * size], "little")
            salt = mix(j * 0x9E3779B97F4A7C15 + (slot + 1) * 0xC2B2AE3D27D4EB4F)
            lane_a = (lane_a + x * (salt | 1)) & mask
            lane_b = (lane_b + mix(x ^ salt)) & mask
    return f"od2:{lane_a:016x}{lane_b:016x}"


def _sample_tensors(device: str = "cpu") -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    tensors = [torch.randn(1037, generator=gen).to(torch.bfloat16), torch.randn(1037, generator=gen),
               torch.randint(0, 256, (1037,), dtype=torch.uint8, generator=gen),
               torch.randn(5, dtype=torch.float64, generator=gen), -torch.rand(33, generator=gen).half()]
    return [t.to(device) for t in tensors]


def _assert_identical(slow: list[CaseResult], fast: list[CaseResult]) -> None:
    assert [r.case.case_id for r in slow] == [r.case.case_id for r in fast]
    differing = []
    for s, f in zip(slow, fast):
        if (s.status, s.message) != (f.status, f.message):
            differing.append(f"{s.case.case_id}: {s.status} {s.message!r} vs {f.status} {f.message!r}")
            continue
        if s.trajectory is None:
            continue
        a, b = s.trajectory.model_dump(), f.trajectory.model_dump()
        differing += [f"{s.case.case_id}: {name}" for name in a if repr(a[name]) != repr(b[name])]
    assert not differing, f"{len(differing)} differences, first: {differing[:5]}"


# ----------------------------------------------------------------------------- od2 digest
def test_od2_matches_its_written_definition():
    tensors = _sample_tensors()
    assert od2.digest_tensors(tensors) == _python_od2(tensors)


def test_od2_sees_one_ulp_and_a_swap():
    tensors = _sample_tensors()
    before = od2.digest_tensors(tensors)
    bumped = [t.clone() for t in tensors]
    bits = bumped[1].view(torch.int32)
    bits[500] += 1  # one ulp of one float32 element
    assert od2.digest_tensors(bumped) != before
    swapped = [t.clone() for t in tensors]
    swapped[1][[3, 4]] = swapped[1][[4, 3]]
    assert od2.digest_tensors(swapped) != before
    # The same values in another tensor slot are another digest.
    assert od2.digest_tensors([tensors[1], tensors[0]]) != od2.digest_tensors([tensors[0], tensors[1]])


def test_a_whole_digest_history_is_formatted_as_digest_by_digest():
    # The fast engine formats a wave's lanes in one hex conversion; each string must be
    # format_digest's, negative lanes (two's complement, masked to 64 bits) and extremes included.
    gen = torch.Generator().manual_seed(11)
    lanes = torch.randint(-2**63, 2**63 - 1, (2, 4, 6), dtype=torch.int64, generator=gen)
    lanes[0, 0, 0], lanes[1, 0, 0], lanes[0, 1, 1], lanes[1, 3, 5] = -1, -2**63, 0, 2**63 - 1
    series = od2.format_digest_series(lanes[0], lanes[1])
    assert series == [[od2.format_digest(int(lanes[0, row, step]), int(lanes[1, row, step])) for step in range(6)]
                      for row in range(4)]
    assert series[0][0] == "od2:ffffffffffffffff8000000000000000"


@needs_cuda
def test_od2_cuda_equals_cpu():
    assert od2.digest_tensors(_sample_tensors("cuda")) == od2.digest_tensors(_sample_tensors("cpu"))


def test_verdict_never_compares_two_digest_schemes():
    case = load_battery("quick").expand()[0]

    def result(digests: list[str]) -> CaseResult:
        return CaseResult(case=case, status="ok", trajectory=Trajectory(
            ref64_max_abs=[0.0] * len(digests), ref64_max_rel=[0.0] * len(digests),
            nonfinite_count=[0] * len(digests), digests=digests))

    legacy = result(["0" * 32])
    current = result(["od2:" + "0" * 32])
    comparison = compare_case(current, legacy)
    assert comparison.verdict == "new" and "scheme" in comparison.message
    assert compare_case(current, result(["od2:" + "0" * 32])).verdict == "unchanged"
    assert compare_case(current, result(["od2:" + "1" * 32])).verdict == "changed"


# ----------------------------------------------------------------------------- grouping
def test_width_classes_merge_narrow_rows_only_while_padding_stays_small():
    # standard's own sizes (v2 also holds the ci battery's nine small cases, sizes 1, 257 and 1031)
    sizes = [c.size for c in load_battery("standard").expand() if c.size in (1, 4097, 65536, 1 << 20)]
    # at half padding: size 1 (512-wide rows) joins the 4097 rows (4608); neither joins 65536,
    # whose class would then be mostly padding; 2**20 stays alone.
    assert width_classes(sizes, 0.5) == {512: 4608, 4608: 4608, 65536: 65536, 1 << 20: 1 << 20}
    # at three quarters (the CUDA setting: launches cost more than padding there) all but 2**20 merge
    assert width_classes(sizes, 0.75) == {512: 65536, 4608: 65536, 65536: 65536, 1 << 20: 1 << 20}
    assert width_classes(sizes, 0.0) == {w: w for w in (512, 4608, 65536, 1 << 20)}
    classes = width_classes(sizes)
    assert width_classes([1, 1, 1, 65536], 0.5) == {512: 512, 65536: 65536}
    assert width_classes([1, 65536, 65536, 65536], 0.5) == {512: 65536, 65536: 65536}
    assert all(w % ALIGN == 0 for w in classes.values())


def test_waves_cover_every_case_once_and_keep_reference_keys_together():
    cases = GROUPED.expand()
    waves = plan_waves(cases, max_wave_elements=1 << 30)
    # one wave per step count (a wave runs as long as its longest case)
    assert [sorted(w) for w in waves] == [[i for i, c in enumerate(cases) if c.steps == steps] for steps in (3, 4)]
    small = plan_waves(cases, max_wave_elements=20 * ALIGN)
    assert sorted(i for w in small for i in w) == list(range(len(cases)))
    assert len(small) > 1
    for wave in small:  # one step count per wave; a reference key's cases are contiguous
        assert len({cases[i].steps for i in wave}) == 1
        keys = [reference_key(cases[i]) for i in wave]
        assert keys == sorted(keys, key=keys.index)


# ----------------------------------------------------------------------------- bit identity
def test_fast_equals_run_case_on_the_quick_battery(kernels):
    cases = load_battery("quick").expand()
    slow = [run_case(case, torch.device("cpu")) for case in cases]
    _assert_identical(slow, run_cases_fast(cases, torch.device("cpu")))


def test_fast_equals_run_case_on_grouped_cases(kernels):
    cases = GROUPED.expand()
    assert bundle_count(cases) < len(cases) / 20  # the batching is really exercised
    slow = [run_case(case, torch.device("cpu")) for case in cases]
    _assert_identical(slow, run_cases_fast(cases, torch.device("cpu")))


def test_fast_equals_run_case_with_every_width_merged_into_one_class(kernels, monkeypatch):
    # The CUDA setting merges narrow rows into wide classes (padding of 1-element rows to 4608);
    # on the CPU nothing is merged by default, so force it here to check the merged layout too.
    from worker.engine import fast as fast_engine

    monkeypatch.setitem(fast_engine.MERGE_PADDING_FRACTION, "cpu", 1.0)
    cases = [c for c in GROUPED.expand() if c.seed == 0]
    assert len(set(fast_engine.width_classes([c.size for c in cases], 1.0).values())) == 1
    slow = [run_case(case, torch.device("cpu")) for case in cases]
    _assert_identical(slow, run_cases_fast(cases, torch.device("cpu")))


def test_a_kernel_error_breaks_its_cases_as_run_case_reports_them(kernels):
    good = GROUPED.expand()[:2]
    # beta1 = 1.5 passes CaseSpec (no range there) but the kernel's argument check refuses it.
    bad = [CaseSpec(**{**c.model_dump(), "case_id": c.case_id + "-bad", "optimizer": "lion",
                       "hyper": {"lr": 0.1, "beta1": 1.5, "beta2": 0.99, "weight_decay": 0.0, "gnorm_scale": 1.0}})
           for c in GROUPED.expand() if c.optimizer == "lion" and c.family == "32bit"][:2]
    fast = run_cases_fast(good + bad, torch.device("cpu"))
    assert [r.status for r in fast] == ["ok", "ok", "broken", "broken"]
    assert "beta1" in fast[2].message
    slow_messages = []
    for case in bad:
        try:
            run_case(case, torch.device("cpu"))
        except Exception as error:  # noqa: BLE001
            slow_messages.append(f"{type(error).__name__}: {error}")
    assert [r.message for r in fast[2:]] == slow_messages


@needs_cuda
def test_fast_equals_run_case_on_grouped_cases_cuda(kernels):
    device = torch.device("cuda")
    cases = GROUPED.expand()
    slow = [run_case(case, device) for case in cases]
    _assert_identical(slow, run_cases_fast(cases, device))
    _assert_identical(slow, run_cases_fast(cases, device, use_graphs=False))


@needs_cuda
def test_observation_capture_survives_other_threads_pinning_memory_cuda(kernels):
    # The gradient threads pin host memory while the main thread captures the observation graph;
    # in CUDA's default (global) capture mode that invalidates the capture. Pin in a loop on
    # another thread for the whole run to make the overlap certain.
    import threading

    device = torch.device("cuda")
    stop = threading.Event()

    def pin() -> None:
        held = []  # held blocks cannot come from the allocator's cache: each one is a new cudaHostAlloc
        while not stop.is_set():
            held.append(torch.empty(1 << 18).pin_memory())
            if len(held) > 64:
                held.clear()

    cases = [c for c in GROUPED.expand() if c.family == "32bit"][:24]
    slow = [run_case(case, device) for case in cases]
    thread = threading.Thread(target=pin, daemon=True)
    thread.start()
    try:
        fast = run_cases_fast(cases, device)
    finally:
        stop.set()
        thread.join()
    _assert_identical(slow, fast)


# ----------------------------------------------------------------------------- through the kernel host
def test_kernel_host_fast_mode_equals_one_case_at_a_time(kernels_build):
    from worker.engine.corun import run_battery

    battery = load_battery("quick")
    cases = battery.expand()[:30]
    slow = run_battery(battery, kernels_build.library_path, device="cpu", cases=cases)
    seen = []
    fast = run_battery(battery, kernels_build.library_path, device="cpu", cases=cases, fast=True,
                       progress=lambda done, total, result: seen.append(done))
    _assert_identical(slow.cases, fast.cases)
    assert seen == list(range(1, len(cases) + 1))
    assert fast.environment == slow.environment


def test_kernel_host_fast_mode_crash_falls_back_case_by_case(kernels_build, monkeypatch):
    from worker.engine.host import FAULT_ENV
    from worker.engine.corun import run_battery

    battery = load_battery("quick")
    cases = battery.expand()[:6]
    victim = cases[3].case_id
    monkeypatch.setenv(FAULT_ENV, f"abort:{victim}")
    fast = run_battery(battery, kernels_build.library_path, device="cpu", cases=cases, fast=True)
    statuses = {r.case.case_id: r.status for r in fast.cases}
    assert statuses.pop(victim) == "broken"
    assert set(statuses.values()) == {"ok"}
    assert "crashed" in next(r.message for r in fast.cases if r.case.case_id == victim)
