"""Fixtures shared by the whole suite.

Builds are expensive on a 2-core machine (tens of seconds), so every test shares one digest-keyed
build cache for the session (`OPTDRIFT_BUILD_CACHE`, default `.optdrift/test-build-cache` in the
repository, which CI keeps between its steps but a fresh clone starts without).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

# The service fixtures need the server packages (psycopg, sqlalchemy); a GPU host that only runs
# the kernel tests may not have them.
pytest_plugins = ["tests.service_fixtures"] if importlib.util.find_spec("psycopg") else []

REPO_ROOT = Path(__file__).resolve().parents[1]
BUNDLED_CSRC = REPO_ROOT / "csrc"
# The fixture projects' adapters are not the product's: the suite registers them as an operator
# would (worker/adapters/registry.py), for this process and every worker and kernel host it starts.
FIXTURE_ADAPTERS = REPO_ROOT / "tests" / "fixtures" / "adapters"
os.environ.setdefault("OPTDRIFT_EXTRA_ADAPTERS", f"tinyopt={FIXTURE_ADAPTERS / 'tinyopt.py'},"
                                                 f"capiopt={FIXTURE_ADAPTERS / 'capiopt.py'},"
                                                 f"compiled_adam={FIXTURE_ADAPTERS / 'compiled_adam.py'}")


# Every build the suite makes, in this process or a child, goes to one cache: a test that builds
# without naming a cache would otherwise use the user's (~/.cache/optdrift/builds), and its library
# (same digest, different bytes) could not be loaded beside the shared build in the same process.
os.environ.setdefault("OPTDRIFT_BUILD_CACHE", str(REPO_ROOT / ".optdrift" / "test-build-cache"))


def _build_cache_dir() -> Path:
    return Path(os.environ["OPTDRIFT_BUILD_CACHE"])


@pytest.fixture(scope="session")
def build_cache_dir() -> Path:
    path = _build_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def csrc_under_test() -> Path:
    """The kernel tree the kernel tests run on: the bundled csrc, or OPTDRIFT_TEST_CSRC.

    OPTDRIFT_TEST_CSRC lets a test run the kernel suite against a mutated copy (for example the
    decay-after-update bug) in a subprocess, to prove the suite discriminates.
    """
    return Path(os.environ.get("OPTDRIFT_TEST_CSRC", BUNDLED_CSRC))


@pytest.fixture(scope="session")
def kernels_build(csrc_under_test: Path, build_cache_dir: Path):
    from worker.build import build_extension

    result = build_extension(csrc_under_test, cache_dir=build_cache_dir)
    if not result.ok:
        pytest.fail(f"building {csrc_under_test} failed:\n{result.error}\n(log: {result.log_path})")
    return result


@pytest.fixture(scope="session")
def decay_build(tmp_path_factory, csrc_under_test: Path, build_cache_dir: Path):
    """The kernels with weight decay applied after the update (the PR-2040 reorder), built once;
    the same digest as the other tests' copies, so a cache hit after any of them builds it."""
    from worker.build import build_extension
    from worker.mutations import copy_tree, decay_after_update

    tree = decay_after_update(copy_tree(csrc_under_test, tmp_path_factory.mktemp("decay") / "csrc"))
    result = build_extension(tree, cache_dir=build_cache_dir, cuda_archs=[])
    assert result.ok, result.error
    return result


@pytest.fixture(scope="session", autouse=True)
def harness_library():
    """optdrift's compiled harness (worker/engine/harness.py), built before any test runs: a kernel
    host's parent builds it on first use, which would otherwise land inside whichever test starts
    the first host (tens of seconds; a cache hit after that)."""
    import torch

    from worker.engine import harness

    return harness.library_for("auto" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="session")
def harness_loaded(harness_library):
    """The harness library loaded into this test process (its ops and the C++ call loop)."""
    from worker.engine import harness

    assert harness_library is not None, "the harness library did not build (see the warning in the log)"
    return harness.load(harness_library)


@pytest.fixture(scope="session")
def kernels(kernels_build):
    """The kernel build loaded into this test process (one build per process)."""
    from worker.adapters import bundled_ops

    bundled_ops.load_build(kernels_build.library_path)
    return bundled_ops


# The files that take longest (minutes: the mutation catalogue, whole services, builds of every
# kernel unit with other flags or another compiler), longest first. .ci/run spreads the suite over
# two pytest-xdist workers by file (--dist loadfile), which hands files out in collection order: a
# long file started last leaves the other worker idle until it ends, so every file of a minute or
# more is named here, and the files left for the end are short. The first two start at once, one on
# each worker: the CI gate (every CPU mutant of the catalogue built and judged) and the build
# variants (the kernels built three more times, with other flags and with clang, through a service).
LONGEST_FIRST = (
    "test_sensitivity_ci_catalogue.py", "test_environment_variants.py", "test_real_library_torchao.py",
    "test_e2e_service.py", "test_faults.py", "test_scale_out_cpu.py", "test_kernel_speed_e2e.py",
    "test_hostile_corpus.py", "test_cuda_compiles.py", "test_external_project.py", "test_compile_cache.py",
    "test_attribution_reads_the_build.py", "test_multi_tensor_catalogue.py", "test_compile_cache_hosts.py",
    "test_kernels_discriminate.py", "test_case_history_browser.py", "test_engine_host.py", "test_build.py",
    "test_sensitivity.py", "test_bisect_service.py", "test_sensitivity_catalogue.py", "test_build_ccache.py",
    "test_verify_yield.py", "test_real_library_lion.py", "test_corun_nondeterminism.py",
    "test_verify_fairness.py", "test_wedged_worker.py", "test_sensitivity_attribution.py",
)


def pytest_configure(config: pytest.Config) -> None:
    # xdist otherwise hands files out by how many tests each holds, not in the order below.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture
def bubblewrap(monkeypatch, tmp_path: Path):  # noqa: ANN001, ANN201
    """A fresh OPTDRIFT_HOME (the box never shows it) and the sandbox probed anew; skipped where
    bubblewrap cannot make a box. Yields the home folder."""
    from service.settings import get_settings
    from worker import sandbox

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("OPTDRIFT_HOME", str(home))
    get_settings.cache_clear()
    sandbox.status.cache_clear()
    if not sandbox.available():
        pytest.skip(f"bubblewrap cannot run here: {sandbox.status()[1]}")
    yield home
    get_settings.cache_clear()
    sandbox.status.cache_clear()
