"""torchao's 4-bit and FP8 optimizers as their own state families (issue 37, worker/adapters/torchao.py):
AdamW4bit cases claim and carry "4bit_blockwise", AdamWFp8's "fp8_e4m3", each with its codes
declared, so a size where torchao silently keeps fp32 states reads not_applicable for that family."""

from __future__ import annotations

import pytest

from service.core.results import GradientStreamSpec
from worker.battery import OPTIMIZER_HYPER_DEFAULTS, make_case
from worker.build.cache import INSTALLED

pytestmark = pytest.mark.slow
pytest.importorskip("torchao")

HYPER = {**OPTIMIZER_HYPER_DEFAULTS["adam"], "lr": 0.1, "weight_decay": 0.1}


def _case(family: str, size: int):
    return make_case(optimizer="adam", family=family, param_dtype="float32", hyper=HYPER,
                     gradient=GradientStreamSpec(), seed=0, size=size, steps=2)


def test_4bit_and_fp8_cases_carry_their_family_and_a_fallen_back_one_is_not_applicable():
    from worker.engine.host import KernelHost

    cases = [_case(family, size) for family in ("4bit_blockwise", "fp8_e4m3") for size in (8192, 1024)]
    with KernelHost(INSTALLED, device="cpu", adapter="torchao", startup_timeout_s=300, case_timeout_s=600) as host:
        results = {(r.case.family, r.case.size): r for r in (host.run(case) for case in cases)}
    for family in ("4bit_blockwise", "fp8_e4m3"):
        ran, small = results[(family, 8192)], results[(family, 1024)]
        assert ran.status == "ok" and ran.case.family == family, (ran.status, ran.message)
        assert ran.case.case_id.startswith(f"adam.{family}.")
        assert small.status == "not_applicable" and "fell back" in small.message, (small.status, small.message)


def test_the_library_s_own_default_block_size_reaches_the_optimizer():
    """The adapter sets only what the case sets: a torchao commit that changes AdamW8bit's default
    block size (issue 37's 256 -> 128) must change what the cases run, not be overridden by a block
    size the adapter imposes. A subclass with another default stands for that commit."""
    import torch
    from torchao.optim import AdamW8bit

    from worker.adapters.torchao import TorchaoFamily

    class DefaultBlock128(AdamW8bit):
        def __init__(self, params, *args, block_size: int = 128, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
            super().__init__(params, *args, block_size=block_size, **kwargs)

    for optimizer_class, block in ((AdamW8bit, 256), (DefaultBlock128, 128)):
        family = TorchaoFamily("8bit_blockwise", optimizer_class)
        handle = family.open(_case("8bit_blockwise", 8192), torch.zeros(8192), torch.device("cpu"))
        assert handle.optimizer.block_size == block
        family.close(handle)


def test_torchao_8bit_states_sit_on_the_quantization_aware_reference_in_its_own_steps():
    """The 8-bit family names torchao's codec (its own dynamic maps, its default block size), so a
    case records its states' distance to the quantization-aware float64 reference in quantization
    steps (worker.engine.quant_series), which its direction is judged on. The released library is
    that reference to float32 rounding: at most 1e-4 of a step on average (measured ~2e-6 at six
    steps; a wrong map or block size puts it a quarter of a step or more away). 4-bit and FP8 name none."""
    import torch
    from torchao.optim import AdamW8bit

    from worker.adapters.torchao import TorchaoFamily
    from worker.engine.trajectory import run_case

    case = make_case(optimizer="adam", family="8bit_blockwise", param_dtype="float32",
                     hyper={**HYPER, "lr": 0.01, "weight_decay": 0.01}, gradient=GradientStreamSpec(kind="open"),
                     seed=0, size=8192, steps=4)
    family = TorchaoFamily("8bit_blockwise", AdamW8bit)
    assert family.quantization_codec(case).block_size == 256
    result = run_case(case, torch.device("cpu"), families={"8bit_blockwise": family})
    assert result.status == "ok", result.message
    steps = result.trajectory.quant_ref_steps
    assert steps and len(steps) == case.steps and all(0 <= s <= 1e-4 for s in steps), steps
    assert TorchaoFamily("4bit_blockwise", AdamW8bit).quantization_codec(case) is None
