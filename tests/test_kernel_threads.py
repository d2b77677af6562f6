"""One step's kernel calls spread over threads (worker.engine.fast.KERNEL_THREADS) give run_case's
results exactly, and only for families that declare `concurrent_steps`.

Exactness, not tolerance: every per-step series through repr, every digest as a string. The CUDA
variant runs on a GPU and skips without one (bench/gpu/h200_warm_profile.sh runs it on the H200).
"""

from __future__ import annotations

import threading

import pytest
import torch

from worker.adapters.bundled import ThirtyTwoBitAdapter
from worker.adapters.bundled_8bit import EightBitBlockwiseAdapter
from worker.engine import fast
from worker.engine.fast import run_cases_fast
from worker.engine.trajectory import run_case
from tests.test_fast_engine import GROUPED, _assert_identical

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="needs a CUDA device"))]


def _calling_threads(monkeypatch) -> set[int]:  # noqa: ANN001
    """The threads that made kernel calls, recorded as the calls are made."""
    seen: set[int] = set()
    real = fast._Wave._call_kernels

    def recorded(self, indices, step, stream=None):  # noqa: ANN001, ANN202
        if indices:
            seen.add(threading.get_ident())
        return real(self, indices, step, stream)

    monkeypatch.setattr(fast._Wave, "_call_kernels", recorded)
    return seen


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_calls_over_threads_equal_run_case(kernels, device: str, monkeypatch) -> None:
    monkeypatch.setattr(fast, "KERNEL_THREADS", 3)
    threads = _calling_threads(monkeypatch)
    cases = GROUPED.expand()
    spread = run_cases_fast(cases, torch.device(device))
    assert len(threads) == 3, f"the calls were made by {len(threads)} thread(s), not 3"
    _assert_identical([run_case(c, torch.device(device)) for c in cases], spread)


class _SerialThirtyTwoBit(ThirtyTwoBitAdapter):
    concurrent_steps = False


def test_a_family_that_does_not_declare_concurrent_steps_is_called_from_one_thread(kernels, monkeypatch) -> None:
    monkeypatch.setattr(fast, "KERNEL_THREADS", 3)
    threads = _calling_threads(monkeypatch)
    cases = GROUPED.expand()
    families = {"32bit": _SerialThirtyTwoBit(), "8bit_blockwise": EightBitBlockwiseAdapter()}
    # A wave holding one non-concurrent family keeps every call of the wave in the calling thread.
    results = run_cases_fast(cases, torch.device("cpu"), families=families)
    assert threads == {threading.get_ident()}
    assert all(r.status == "ok" for r in results)
