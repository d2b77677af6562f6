"""Every family an adapter declares is a row of the state-family table (service/core/families.py,
issue 37): a name outside it would never match a case, and its results could carry no label."""

from __future__ import annotations

from service.core.families import FAMILIES
from worker.adapters import bundled, torchao
from worker.adapters.lion_pytorch import LionPytorchAdapter


def test_declared_families_are_the_tables():
    declared = {
        "bundled": set(bundled.FAMILIES),
        "torchao": set(torchao.TorchaoAdapter().families()),
        "bitsandbytes": {"32bit", "8bit_blockwise"},  # its supported_cases' declaration
        "lion_pytorch": set(LionPytorchAdapter().families()),
    }
    for adapter, names in declared.items():
        assert names and names <= set(FAMILIES), (adapter, names - set(FAMILIES))
    # torchao's low-bit classes carry their own families (4-bit no longer in the 8-bit slot)
    assert set(torchao.OPTIMIZER_BY_FAMILY) == {"32bit", "8bit_blockwise", "4bit_blockwise", "fp8_e4m3"}
