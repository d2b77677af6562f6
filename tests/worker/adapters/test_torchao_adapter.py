"""torchao's low-bit optimizers (worker/adapters/torchao.py) in a kernel host, installed torchao
(the [test] extra pins torchao==0.18.0), with the build's compile cache (worker/engine/compile_cache.py).

The battery (tests/fixtures/torchao_project/battery.json): _AdamW (fp32) and AdamW8bit cases at
8192 elements, and an 8-bit case at 1024 elements where torchao silently keeps fp32 states, which
must read not_applicable (the family's declared uint8 codes) rather than run as 8-bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.battery import load_battery
from worker.build.cache import INSTALLED
from worker.engine import compile_cache

pytestmark = pytest.mark.slow
pytest.importorskip("torchao")

BATTERY = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "torchao_project" / "battery.json"
CASES = load_battery(str(BATTERY)).expand()


def _run(cache) -> list:  # noqa: ANN001
    from worker.engine.host import KernelHost

    with KernelHost(INSTALLED, device="cpu", adapter="torchao", compile_cache=cache, startup_timeout_s=300,
                    case_timeout_s=600) as host:
        return [host.run(case) for case in CASES]


def test_torchao_cases_run_and_a_fallen_back_8bit_case_is_not_applicable(tmp_path: Path):
    cache = compile_cache.for_build(tmp_path, "torchao-installed", trusted=True)
    results = {r.case.case_id: r for r in _run(cache)}
    small = [c.case_id for c in CASES if c.family == "8bit_blockwise" and c.size < 4096]
    assert small and all(results[c].status == "not_applicable" for c in small), \
        {c: (results[c].status, results[c].message) for c in small}
    assert "fell back" in results[small[0]].message
    ran = [r for r in results.values() if r.case.case_id not in small]
    assert all(r.status == "ok" for r in ran), [(r.case.case_id, r.status, r.message) for r in ran]
    # The 8-bit state is digested as it is: its digests differ from the fp32 twin's from step 1.
    by_twin = {}
    for r in ran:
        twin = r.case.case_id.split("#")[0].replace(f".{r.case.family}.", ".")
        by_twin.setdefault(twin, {})[r.case.family] = r
    pairs = [pair for pair in by_twin.values() if len(pair) == 2]
    assert len(pairs) == 4 and all(pair["32bit"].trajectory.digests[0] != pair["8bit_blockwise"].trajectory.digests[0]
                                   for pair in pairs)
    # What the host compiled was kept in the build's compile cache.
    assert any(p.is_file() for p in cache.folder.rglob("*"))
    # A second host of the same build gives the same digests from the cache.
    again = {r.case.case_id: r for r in _run(cache)}
    for case_id, result in results.items():
        if result.status == "ok":
            assert again[case_id].trajectory.digests == result.trajectory.digests, case_id
