"""The CUDA path of the kernel timing (worker/speed/timing.py: CUDA events, an L2 flush between
samples, a same-bytes device-to-device copy as the yardstick). Skipped without a CUDA device; the
lead runs it on the H200 through bench/gpu/h200_kernel_speed.sh, which also runs the full bench.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _time(families, plan):  # noqa: ANN001, ANN202
    from worker.adapters.bundled import BundledAdapter
    from worker.speed import timing

    return timing.time_kernels(plan, torch.device("cuda"), BundledAdapter(), families)


def test_every_bundled_kernel_times_on_cuda_within_the_copy_bandwidth(kernels) -> None:  # noqa: ANN001
    from worker.adapters.bundled import FAMILIES
    from worker.speed.timing import TimingPlan
    from service.core.speed_noise import summarize

    answer = _time(FAMILIES, TimingPlan(sizes=(1 << 20,), repeats=20))
    assert len(answer["timings"]) == 24 and not answer["restart"]
    for timing in answer["timings"]:
        assert timing["error"] is None, timing
        kernel, copy = summarize(timing["samples_s"]), summarize(timing["copy_samples_s"])
        # A step moves at least its nominal bytes, so it cannot beat a plain copy of them by more
        # than timing noise (20 % allowed: events resolve ~0.5 us on a ~10 us step).
        assert copy.median_s / kernel.median_s < 1.2, timing["kernel"]
        assert timing["bytes_moved"] / copy.median_s > 200e9  # any HBM card copies faster than 200 GB/s


def test_the_slowed_mutant_is_flagged_and_a_rerun_is_not(kernels) -> None:  # noqa: ANN001
    from worker.adapters.bundled import FAMILIES
    from worker.speed.mutant import slowed_families
    from worker.speed.timing import TimingPlan
    from service.core.speed_noise import compare

    plan = TimingPlan(sizes=(1 << 24,), repeats=50, optimizers=("adam",), families=("32bit",), dtypes=("float32",))
    base, again = _time(FAMILIES, plan), _time(FAMILIES, plan)
    # a full extra pass over the parameter: +8 of 28 bytes per element, about +29 %
    slowed = _time(slowed_families(FAMILIES, ["adam/32bit"], fraction=1.0), plan)
    samples = [a["timings"][0]["samples_s"] for a in (base, again, slowed)]
    assert compare(samples[1], samples[0]).verdict != "slower"
    result = compare(samples[2], samples[0])
    assert result.verdict == "slower" and result.ratio > 1.15, result
