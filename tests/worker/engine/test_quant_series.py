"""Both engines record a quantized case's figures against the quantization-aware float64 reference
(worker/engine/quant_series.py): the fast engine (worker.engine.fast, what the service's workers
run) gives run_case's series bit for bit, for the bundled 8-bit Adam cases (the bundled adapter
names its dynamic-map codec), and the reference cache keeps them with the other metric series.
Exactness, not tolerance: series compared as lists of floats."""

from __future__ import annotations

import pytest
import torch

from service.core.results import CaseResult, EnvironmentFingerprint, GradientStreamSpec
from worker.battery import OPTIMIZER_HYPER_DEFAULTS, make_case
from worker.engine.fast import run_cases_fast
from worker.engine.reference_cache import ReferenceCache
from worker.engine.trajectory import run_case

CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _case(optimizer: str = "adam", family: str = "8bit_blockwise", dtype: str = "float32", size: int = 1031,
          gradient: GradientStreamSpec | None = None, seed: int = 0, steps: int = 5, **hyper: object):
    return make_case(optimizer=optimizer, family=family, param_dtype=dtype,
                     hyper={**OPTIMIZER_HYPER_DEFAULTS[optimizer], "lr": 0.1, "weight_decay": 0.1, **hyper},
                     gradient=gradient or GradientStreamSpec(), seed=seed, size=size, steps=steps)


# 8-bit Adam across what changes the figure's inputs: block tails, closed loop, zeroed and skipped
# gradients with gnorm_scale, 16-bit parameters, cases of several lengths in one wave; then cases
# that record none (32-bit; 8-bit optimizers the margin was not measured on).
QUANTIZED = [
    _case(), _case(size=257, gradient=GradientStreamSpec(kind="closed"), seed=1),
    _case(size=4097, gradient=GradientStreamSpec(kind="open", zero_fraction=0.5), skip_zeros=True, gnorm_scale=0.5),
    _case(dtype="bfloat16", size=300, steps=3), _case(size=1, steps=4),
]
UNQUANTIZED = [_case(family="32bit"), _case(optimizer="lion"), _case(optimizer="rmsprop", family="8bit_blockwise")]


@pytest.mark.parametrize("device", [CPU, pytest.param(torch.device("cuda"), marks=needs_cuda)])
def test_the_fast_engine_records_run_cases_figures_bit_for_bit(kernels, device):
    cases = QUANTIZED + UNQUANTIZED
    fast = run_cases_fast(cases, device)
    slow = [run_case(case, device) for case in cases]
    for f, s in zip(fast, slow):
        assert f.status == s.status == "ok", (f.message, s.message)
        assert f.trajectory.quant_ref_steps == s.trajectory.quant_ref_steps, f.case.case_id
        assert f.trajectory.quant_ref_max_abs == s.trajectory.quant_ref_max_abs, f.case.case_id
    for result in fast[:len(QUANTIZED)]:
        figures = result.trajectory.quant_ref_steps
        # the correct kernels: a few codes at float32-rounding boundaries (a hundredth of a step)
        assert len(figures) == result.case.steps and max(figures) < 0.01, (result.case.case_id, figures)
    assert all(r.trajectory.quant_ref_steps is None for r in fast[len(QUANTIZED):])


def test_the_reference_cache_keeps_the_quantized_figures(kernels, tmp_path):
    result: CaseResult = run_case(QUANTIZED[0], CPU)
    plain: CaseResult = run_case(UNQUANTIZED[0], CPU)
    environment = EnvironmentFingerprint(device_kind="cpu", device_name="x", torch_version="2.13.0",
                                         python_version="3.12", platform="Linux-x86_64", class_key="cpu-test")
    cache = ReferenceCache(tmp_path, writable=True)
    assert cache.store(environment, [result, plain]) == 2
    held = cache.lookup(environment, [result.case, plain.case])
    assert list(held[0].values()) == [result.trajectory] and list(held[1].values()) == [plain.trajectory]
