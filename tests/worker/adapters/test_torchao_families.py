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
