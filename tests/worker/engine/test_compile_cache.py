"""The kernel hosts' persistent compile cache (worker/engine/compile_cache.py).

The fixture adapter `compiled_adam` (tests/fixtures/adapters/compiled_adam.py) compiles its AdamW
step with torch.compile when it loads and reports inductor's FX graph cache counters from inside
the host: a hit means the compiled code came from the cache folder, a miss that the host compiled
it. Counters, not timings: they say what happened whatever the machine's load.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.engine import compile_cache
from worker.engine.compile_cache import CompileCache

pytestmark = pytest.mark.slow

ENVIRONMENT = "cpu-x86_64-AVX2-abc123-torch2.13.0+cpu"


def _described(cache: CompileCache | None) -> dict[str, str]:
    from worker.engine.host import KernelHost

    with KernelHost("installed", device="cpu", adapter="compiled_adam", compile_cache=cache,
                    startup_timeout_s=300) as host:
        host.start()
        return dict(host.adapter_description or {})


def _files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


def test_two_build_digests_get_different_folders_and_a_verify_run_a_read_only_one(tmp_path: Path):
    first = compile_cache.for_build(tmp_path, "a" * 64, trusted=True)
    second = compile_cache.for_build(tmp_path, "b" * 64, trusted=True)
    untrusted = compile_cache.for_build(tmp_path, "a" * 64, trusted=False)
    assert first.folder == tmp_path.resolve() / "compile" / ("a" * 64) and first.folder.is_dir()
    assert second.folder != first.folder and second.folder.is_dir()
    assert untrusted.folder == first.folder and untrusted.writable is False and first.writable is True
    assert "--compile-cache-read-only" in untrusted.host_arguments()
    assert "--compile-cache-read-only" not in first.host_arguments()
    # Nothing to key a cache by, or a digest that is not one path component: no cache.
    assert compile_cache.for_build(tmp_path, None, trusted=True) is None
    assert compile_cache.for_build(tmp_path, "../elsewhere", trusted=True) is None


def test_a_second_host_of_the_same_build_loads_what_the_first_compiled(tmp_path: Path):
    pytest.importorskip("torch")
    cache = compile_cache.for_build(tmp_path, "c" * 64, trusted=True)
    cold = _described(cache)
    assert int(cold.get("fx_graph_fxgraph_cache_miss", 0)) >= 1, cold
    assert int(cold.get("fx_graph_fxgraph_cache_hit", 0)) == 0, cold
    # One folder per environment class inside the build's folder, and the compiled graph in it.
    (environment_folder,) = [p for p in cache.folder.iterdir() if p.is_dir()]
    assert Path(cold["inductor_cache"]) == environment_folder
    assert any(p.is_file() for p in (environment_folder / "fxgraph").rglob("*"))

    warm = _described(cache)
    assert int(warm.get("fx_graph_fxgraph_cache_hit", 0)) >= 1, warm
    assert int(warm.get("fx_graph_fxgraph_cache_miss", 0)) == 0, warm

    # Another build digest: its own folder, compiled from cold.
    other = _described(compile_cache.for_build(tmp_path, "d" * 64, trusted=True))
    assert int(other.get("fx_graph_fxgraph_cache_hit", 0)) == 0 and \
        int(other.get("fx_graph_fxgraph_cache_miss", 0)) >= 1, other


def test_a_verify_host_reads_the_cache_and_cannot_write_it(tmp_path: Path):
    pytest.importorskip("torch")
    from worker import sandbox

    trusted = compile_cache.for_build(tmp_path, "e" * 64, trusted=True)
    _described(trusted)  # a trusted host fills it
    before = _files(trusted.folder)

    untrusted = compile_cache.for_build(tmp_path, "e" * 64, trusted=False)
    seen = _described(untrusted)
    assert int(seen.get("fx_graph_fxgraph_cache_hit", 0)) >= 1, seen  # it reads what trusted hosts compiled
    assert not Path(seen["inductor_cache"]).is_relative_to(trusted.folder), seen  # it compiles into its copy
    if sandbox.available():  # the box's read-only bind; without bubblewrap only the copy above holds
        assert seen["plant"].startswith("refused"), seen
    assert _files(trusted.folder) == before

    # An untrusted host of a build no trusted host compiled: it compiles, and leaves nothing behind.
    fresh = compile_cache.for_build(tmp_path, "f" * 64, trusted=False)
    cold = _described(fresh)
    assert int(cold.get("fx_graph_fxgraph_cache_miss", 0)) >= 1, cold
    assert _files(fresh.folder) == {}


def test_without_a_compile_cache_every_host_compiles_from_cold():
    pytest.importorskip("torch")
    for _ in range(2):
        described = _described(None)
        assert int(described.get("fx_graph_fxgraph_cache_hit", 0)) == 0, described
        assert described["plant"] == "no compile cache"


def test_the_host_uses_the_folder_of_its_environment(tmp_path: Path):
    bound = tmp_path / "bound"
    bound.mkdir()
    used = compile_cache.use_in_host(bound, writable=True, class_key=ENVIRONMENT, scratch=tmp_path / "scratch")
    assert used == bound / compile_cache.environment_folder_name(ENVIRONMENT) and used.is_dir()
    assert "/" not in compile_cache.environment_folder_name("a/../b") and \
        compile_cache.environment_folder_name("a/../b") != ".."
    (used / "entry").write_text("compiled")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    copied = compile_cache.use_in_host(bound, writable=False, class_key=ENVIRONMENT, scratch=scratch)
    assert copied == scratch / compile_cache.SCRATCH_COPY and (copied / "entry").read_text() == "compiled"


def test_a_trusted_spare_keeps_what_it_compiled_and_an_untrusted_one_does_not(tmp_path: Path):
    pytest.importorskip("torch")
    from worker.engine.host import KernelHost

    for digest, trusted in (("1" * 64, True), ("2" * 64, False)):
        cache = compile_cache.for_build(tmp_path, digest, trusted=trusted)
        spare = KernelHost.spare(device="cpu", slot_root=tmp_path / "slots")
        try:
            spare.adopt_build("installed", adapter="compiled_adam", compile_cache=cache)
            described = dict(spare.adapter_description or {})
            assert int(described.get("fx_graph_fxgraph_cache_miss", 0)) >= 1, described
        finally:
            spare.close()
        kept = [p for p in cache.folder.rglob("*") if p.is_file()]
        assert bool(kept) is trusted, kept
    # The next host of the trusted spare's build loads what the spare compiled.
    warm = _described(compile_cache.for_build(tmp_path, "1" * 64, trusted=True))
    assert int(warm.get("fx_graph_fxgraph_cache_hit", 0)) >= 1, warm
