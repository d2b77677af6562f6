"""The compile cache beyond a run's own host (worker/engine/compile_cache.py): the co-run's and the
attribution's hosts use the build's folder, and a box sees its own digest's folder alone.

The fixture adapter `compiled_adam` (tests/fixtures/adapters/compiled_adam.py) compiles its AdamW
step with torch.compile when it loads and reports, from inside the host, inductor's FX graph cache
counters (a hit: the compiled code came from the cache folder), whether it could plant a file in the
folder the box shows, and what the box shows beside that folder.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.engine import compile_cache
from worker.engine.compile_cache import CompileCache

pytestmark = pytest.mark.slow
torch = pytest.importorskip("torch")


def _described(cache: CompileCache | None) -> dict[str, str]:
    from worker.engine.host import KernelHost

    with KernelHost("installed", device="cpu", adapter="compiled_adam", compile_cache=cache,
                    startup_timeout_s=300) as host:
        host.start()
        return dict(host.adapter_description or {})


def _compiled_files(cache: CompileCache) -> list[Path]:
    return [p for p in cache.folder.rglob("*") if p.is_file() and "fxgraph" in p.parts]


def _adam_case():  # noqa: ANN202
    from worker.battery import BUILTIN_BATTERIES

    return next(c for c in BUILTIN_BATTERIES["quick"]().expand()
                if c.optimizer == "adam" and c.family == "32bit" and c.param_dtype == "float32")


def test_the_co_run_and_attribution_hosts_compile_into_the_builds_cache(tmp_path: Path):
    """Cold caches of two builds: after the co-run (worker.engine.corun.corun_battery, as `check` and
    the service's co-run start it) each build's folder holds what its host compiled, and the next host
    of that build (a run's) loads it; the attribution's hosts (worker.attribution.pair_run) likewise."""
    from worker.attribution.pair_run import record_parameters
    from worker.battery import BUILTIN_BATTERIES
    from worker.engine.corun import corun_battery

    case = _adam_case()
    caches = (compile_cache.for_build(tmp_path, "c" * 64, trusted=True),
              compile_cache.for_build(tmp_path, "b" * 64, trusted=True))
    try:
        corun_battery(BUILTIN_BATTERIES["quick"](), "installed", "installed", device="cpu", cases=[case],
                      adapter="compiled_adam", params_only=True, compile_caches=caches)
        assert all(_compiled_files(cache) for cache in caches), [list(c.folder.rglob("*")) for c in caches]
        warm = _described(caches[0])
        assert int(warm.get("fx_graph_fxgraph_cache_hit", 0)) >= 1, warm
        assert int(warm.get("fx_graph_fxgraph_cache_miss", 0)) == 0, warm
    finally:
        compile_cache.release(*caches)

    attribution = (compile_cache.for_build(tmp_path, "a" * 64, trusted=True),
                   compile_cache.for_build(tmp_path, "9" * 64, trusted=True))
    try:
        files = record_parameters("installed", "installed", [case], tmp_path, device="cpu",
                                  adapter="compiled_adam", compile_caches=attribution)
        assert case.case_id in files
        assert all(_compiled_files(cache) for cache in attribution)
    finally:
        compile_cache.release(*attribution)


def test_a_verify_box_sees_only_its_own_digest_read_only(tmp_path: Path):
    from worker import sandbox

    if not sandbox.available():
        pytest.skip("bubblewrap cannot run here: the box's binds are what this test is about")
    other = compile_cache.for_build(tmp_path, "e" * 64, trusted=True)
    _described(other)  # another build's trusted host fills its folder
    other.release()
    before = {p: p.stat().st_mtime_ns for p in other.folder.rglob("*")}

    own = compile_cache.for_build(tmp_path, "f" * 64, trusted=False)
    try:
        seen = _described(own)
    finally:
        own.release()
    assert seen["plant"].startswith("refused"), seen  # read-only
    assert seen["neighbours"] == "f" * 64, seen  # no other digest, no lock files
    assert {p: p.stat().st_mtime_ns for p in other.folder.rglob("*")} == before

    # A trusted box writes its own folder, and sees no other either.
    trusted = compile_cache.for_build(tmp_path, "0" * 64, trusted=True)
    try:
        seen = _described(trusted)
    finally:
        trusted.release()
    assert seen["plant"] == "written" and seen["neighbours"] == "0" * 64, seen
