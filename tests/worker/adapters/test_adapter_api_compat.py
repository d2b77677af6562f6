"""Adapters written against an earlier release's documented imports still work (issue 48).

tests/fixtures/adapters_110758d/ keeps adapters exactly as they were written at commit 110758d,
when the docs told adapter authors to import `CaseSpec` from `service.results` and the base
classes from `worker.adapters.base`. `service.results` has since moved to `service.core.results`;
a shim keeps the old path for at least one minor release, with a DeprecationWarning naming the new
import (docs/PROJECTS.md, "Public adapter API"). Each old adapter is imported and run through
`optdrift adapter-check` (both engines, every per-step digest compared exactly): it must load,
agree with itself on both engines, and the warning must name `service.core.results` and the public
module `worker.adapters.api`.

Without the shim every one of them fails at import (`No module named 'service.results'`), which
adapter-check reports as exit 2.
"""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from service.core.project_config import load_project_config
from worker.battery import BatterySpec

REPO = Path(__file__).resolve().parents[3]
FIXTURES = REPO / "tests" / "fixtures"
OLD_ADAPTERS = FIXTURES / "adapters_110758d"

# The cases each old adapter runs: two betas per optimizer, so cases with different
# hyperparameters share the fast engine's wave (where a shared library object would show).
BATTERIES = {
    "tinyopt_110758d": [{"optimizers": ["adam", "momentum"], "sizes": [300], "steps": 3,
                         "points": [{"lr": 0.1, "weight_decay": 0.1}, {"lr": 0.01, "beta1": 0.8, "beta2": 0.99}]}],
    "ownedopt_110758d": [{"optimizers": ["adam"], "sizes": [5, 300], "steps": 6,
                          "points": [{"lr": 0.1, "weight_decay": 0.1}, {"lr": 0.01, "beta1": 0.8, "beta2": 0.99}]}],
    "lion_pytorch_110758d": [{"optimizers": ["lion"], "sizes": [300], "steps": 3,
                              "points": [{"lr": 0.01, "weight_decay": 0.1}, {"lr": 0.01, "beta1": 0.8}]}],
    "bitsandbytes_110758d": [{"optimizers": ["adam", "momentum", "lion"], "families": ["32bit", "8bit_blockwise"],
                              "sizes": [300], "steps": 3,
                              "points": [{"lr": 0.1, "weight_decay": 0.1}, {"lr": 0.01, "beta1": 0.8}]}],
}
# The library each needs in this process; None: nothing beyond the test suite's own packages.
NEEDS = {"tinyopt_110758d": None, "ownedopt_110758d": None, "lion_pytorch_110758d": "lion_pytorch",
         "bitsandbytes_110758d": "bitsandbytes"}
SHIM_WARNING = re.compile(r"service\.results is deprecated.*service\.core\.results.*worker\.adapters\.api", re.S)


def _library(module: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """What the old adapter's load() takes: the tinyopt fixture project built as a run builds it,
    ownedopt's library folder, or the installed package."""
    if module == "tinyopt_110758d":
        from worker.build.project import build_project

        tree = tmp_path / "cmake_project"
        shutil.copytree(FIXTURES / "cmake_project", tree, ignore=shutil.ignore_patterns("commits", "build"))
        built = build_project(tree, load_project_config(tree), cache_dir=request.getfixturevalue("build_cache_dir"),
                              cuda_archs=[])
        assert built.ok, built.error
        return str(built.library_path)
    if module == "ownedopt_110758d":
        return str(FIXTURES / "ownedopt" / "lib")
    return "installed"


@pytest.mark.parametrize("module", sorted(BATTERIES))
def test_an_adapter_written_at_110758d_passes_adapter_check_with_a_deprecation_warning(
        module: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from service.cli import app

    if NEEDS[module] is not None:
        pytest.importorskip(NEEDS[module])
    library = _library(module, request, tmp_path)
    battery = tmp_path / "battery.json"
    battery.write_text(BatterySpec.model_validate({"name": f"compat-{module}", "version": 1,
                                                   "groups": BATTERIES[module]}).model_dump_json())
    # A fresh import of the old path in this test (the shim warns once per process, at import),
    # and adapter-check's addition to sys.path undone afterwards.
    for name in ("service.results", module):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = CliRunner().invoke(app, ["adapter-check", "--adapter", module, "--library", library,
                                          "--adapter-path", str(OLD_ADAPTERS), "--battery", str(battery)])
    assert result.exit_code == 0, result.output
    if module == "lion_pytorch_110758d":  # fast_engine = False: the one-case engine, twice
        assert re.search(r"the \d+ cases reproduced themselves", result.output), result.output
    else:
        agreed = re.search(r"both engines agree on all (\d+) cases", result.output)
        assert agreed and int(agreed.group(1)) >= 2, result.output
    shims = [w for w in caught if issubclass(w.category, DeprecationWarning) and SHIM_WARNING.search(str(w.message))]
    assert len(shims) == 1, [str(w.message) for w in caught]
    # The warning points at the adapter's own import line, so its author sees what to change, and
    # adapter-check prints it (Python hides a DeprecationWarning raised outside __main__).
    assert Path(shims[0].filename).name == f"{module}.py", shims[0].filename
    assert f"adapter-check: note: {shims[0].filename}:{shims[0].lineno}: service.results is deprecated: " \
        "import from service.core.results" in result.output, result.output


def test_the_old_names_are_the_new_objects() -> None:
    """What an old adapter gets from `service.results` is the very class the engines check
    against (isinstance, pydantic validation), not a copy."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = importlib.import_module("service.results")
    from service.core import results
    from worker.adapters import api

    assert old.CaseSpec is results.CaseSpec is api.CaseSpec
    assert old.ParamLayout is api.ParamLayout and old.Trajectory is results.Trajectory
    with pytest.raises(AttributeError, match="service.core.results"):
        old.NoSuchName  # noqa: B018


@pytest.mark.parametrize(("old", "new"), [("service.results", "service.core.results"),
                                          ("service.verdicts", "service.core.verdicts"),
                                          ("service.client", "service.cli.client")])
def test_each_moved_module_warns_once_naming_its_new_import(old: str, new: str) -> None:
    """In a fresh interpreter with DeprecationWarnings made errors, importing the old path fails
    with the warning (so it is raised, and names the new import); with them shown, it warns once
    however often it is imported."""
    as_error = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", f"import {old}"],
                              capture_output=True, text=True, cwd=REPO)
    assert as_error.returncode == 1 and "DeprecationWarning" in as_error.stderr, as_error.stderr
    assert f"{old} is deprecated" in as_error.stderr and f"import from {new}" in as_error.stderr, as_error.stderr
    twice = subprocess.run([sys.executable, "-W", "always::DeprecationWarning", "-c",
                            f"import {old}\nimport importlib\nimportlib.import_module('{old}')\nimport {old}"],
                           capture_output=True, text=True, cwd=REPO)
    assert twice.returncode == 0, twice.stderr
    assert twice.stderr.count(f"{old} is deprecated") == 1, twice.stderr


def test_an_old_adapter_runs_in_the_kernel_hosts_box() -> None:
    """A run imports the adapter in a kernel host inside the sandbox, which shows of `service` only
    its __init__, the pure core and the core's deprecated aliases (worker/sandbox/mounts.py): the
    110758d-style adapter imports `service.results` there and its case runs bit for bit as the
    same adapter does unboxed. Without the alias in the box the host fails at import."""
    from worker import sandbox
    from worker.battery import load_battery
    from worker.engine.host import KernelHost
    from worker.engine.trajectory import run_case

    if not sandbox.available():
        pytest.skip(f"bubblewrap cannot run here: {sandbox.status()[1]}")
    library = FIXTURES / "ownedopt" / "lib"
    case = next(c for c in load_battery("quick").expand() if c.optimizer == "adam" and c.family == "32bit"
                and c.param_dtype == "float32")
    with KernelHost(library, device="cpu", adapter="ownedopt_110758d", adapter_paths=[OLD_ADAPTERS],
                    case_timeout_s=120) as host:
        boxed = host.run(case)
    assert boxed.status == "ok", boxed.message
    from worker.adapters.api import ProjectAdapter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        sys.path.insert(0, str(OLD_ADAPTERS))
        try:
            old = importlib.import_module("ownedopt_110758d")
        finally:
            sys.path.remove(str(OLD_ADAPTERS))
    adapter = old.OwnedoptAdapter()
    assert isinstance(adapter, ProjectAdapter)
    adapter.load(str(library))
    unboxed = run_case(case, __import__("torch").device("cpu"), families=adapter.families())
    assert boxed.trajectory.digests == unboxed.trajectory.digests


def test_the_public_adapter_api_is_one_torch_free_module_with_a_version() -> None:
    """Everything in `__all__` is importable from worker.adapters.api and is the object the engines
    use; API_VERSION is semver; importing the module loads no torch (the service and the Celery
    parent read the registry)."""
    from service.core import results
    from worker.adapters import api, base
    from worker.build.cache import INSTALLED

    assert re.fullmatch(r"\d+\.\d+\.\d+", api.API_VERSION)
    for name in api.__all__:
        assert getattr(api, name) is not None, name
    expected = {"CaseSpec", "ParamLayout", "TensorSlot", "FamilyAdapter", "ProjectAdapter", "HandedOverStates",
                "StateDeclaration", "UnreadableState", "AdapterError", "AdapterContractError", "StateNotAsDeclared",
                "GroupLifecycleMissing", "INSTALLED"}
    assert expected <= set(api.__all__)
    assert api.CaseSpec is results.CaseSpec and api.HandedOverStates is base.HandedOverStates
    assert api.INSTALLED == INSTALLED
    loaded = subprocess.run([sys.executable, "-c", "import sys, worker.adapters.api as a; from worker.adapters.api "
                             "import *; print('torch' in sys.modules, a.API_VERSION)"],
                            capture_output=True, text=True, cwd=REPO, check=True).stdout.split()
    assert loaded == ["False", api.API_VERSION]


def test_optdrift_version_names_the_installed_package_and_the_adapter_api() -> None:
    from importlib.metadata import version

    from service.cli import app
    from worker.adapters.api import API_VERSION

    shown = CliRunner().invoke(app, ["--version"])
    assert shown.exit_code == 0, shown.output
    assert shown.output.splitlines() == [f"optdrift {version('optdrift')}", f"adapter API {API_VERSION}"]
