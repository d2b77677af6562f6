"""Adapters from anywhere (issue 20): any importable module name (no dot needed), a folder of the
project's tree named by `adapter_path`, whole import errors, and the adapter's describe() carried
by the kernel host's ready line, stored with the run and shown on the run page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from service.core.project_config import ProjectConfigError, parse_config
from worker.adapters import AdapterError, get_adapter

TREE_ADAPTER = '''
from worker.adapters.base import ProjectAdapter

class FromTheTree(ProjectAdapter):
    name = "from_tree"
    def load(self, library):
        self.library = library
    def families(self):
        return {}
    def describe(self):
        return {**super().describe(), "version": "1.2.3", "library": self.library}
'''
LONG_REASON = "the library's Python bindings need libfoo >= 2.4, found 2.1 at /opt/foo/lib/libfoo.so " * 3
BROKEN_ADAPTER = f"raise ImportError({LONG_REASON!r})\n"


@pytest.fixture
def adapter_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "tree" / "tools"
    folder.mkdir(parents=True)
    (folder / "from_tree_adapter.py").write_text(TREE_ADAPTER)
    (folder / "broken_adapter.py").write_text(BROKEN_ADAPTER)
    (folder / "typo_adapter.py").write_text("def oops(:\n")
    return folder


def test_a_module_name_without_a_dot_is_an_adapter(adapter_folder: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(adapter_folder))
    adapter = get_adapter("from_tree_adapter")
    adapter.load("installed")
    assert adapter.describe() == {"adapter": "from_tree", "module": "from_tree_adapter", "version": "1.2.3",
                                  "library": "installed"}
    with pytest.raises(AdapterError, match="unknown adapter 'nowhere_adapter'.*adapter_path"):
        get_adapter("nowhere_adapter")


def test_import_errors_are_whole_and_say_where(adapter_folder: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(adapter_folder))
    with pytest.raises(AdapterError) as broken:
        get_adapter("broken_adapter")
    assert LONG_REASON in str(broken.value) and "broken_adapter.py:1" in str(broken.value)
    with pytest.raises(AdapterError, match=r"SyntaxError.*typo_adapter.py:1"):
        get_adapter("typo_adapter")


def test_adapter_names_and_paths_are_validated():
    config = parse_config('[project]\nadapter = "from_tree_adapter"\nadapter_path = ["tools"]\n')
    assert config.adapter == "from_tree_adapter" and config.adapter_path == ["tools"]
    with pytest.raises(ProjectConfigError, match="adapter_path"):
        parse_config('[project]\nadapter_path = ["../outside"]\n')
    with pytest.raises(ProjectConfigError, match="importable module name"):
        parse_config('[project]\nadapter = "my-adapter.py"\n')


@pytest.mark.slow
def test_the_kernel_host_reports_the_adapters_description(adapter_folder: Path):
    pytest.importorskip("torch")
    from worker.engine.host import KernelHost

    with KernelHost("installed", device="cpu", adapter="from_tree_adapter", adapter_paths=[adapter_folder],
                    startup_timeout_s=120) as host:
        host.start()
        assert host.adapter_description == {"adapter": "from_tree", "module": "from_tree_adapter",
                                            "version": "1.2.3", "library": "installed"}


@pytest.mark.slow
def test_a_host_whose_adapter_fails_to_import_says_why_in_full(adapter_folder: Path):
    pytest.importorskip("torch")
    from worker.engine.host import KernelHost, KernelHostError

    with KernelHost("installed", device="cpu", adapter="broken_adapter", adapter_paths=[adapter_folder]) as host:
        with pytest.raises(KernelHostError) as failed:
            host.start()
    assert LONG_REASON in str(failed.value)


@pytest.mark.slow
def test_a_host_that_cannot_start_is_not_started_again_for_every_case(adapter_folder: Path):
    """An adapter that cannot be imported fails every start the same way: after two failed starts
    the other cases are answered broken at once, with the reason, instead of a start each."""
    pytest.importorskip("torch")
    from service.core.results import CaseSpec
    from worker.engine.host import STARTS_BEFORE_GIVING_UP, KernelHost

    cases = [CaseSpec(case_id=f"adam-{seed}", optimizer="adam", hyper={"lr": 0.1, "weight_decay": 0.1},
                      seed=seed, size=8, steps=2) for seed in range(6)]
    with KernelHost("installed", device="cpu", adapter="broken_adapter", adapter_paths=[adapter_folder]) as host:
        results = host.run_many(cases)
    assert host.start_attempts == STARTS_BEFORE_GIVING_UP
    assert [r.status for r in results] == ["broken"] * len(cases)
    assert all(LONG_REASON in r.message for r in results)
    assert "not started again" in results[-1].message


def test_the_run_page_shows_the_adapters_description(db_session, api_settings, api):  # noqa: ANN001
    from service.domain import runs
    from tests.service.domain.test_db_runs import _commit_run

    run = _commit_run(db_session, api_settings, "adaptersha", [])
    assert runs.claim(session=db_session, run_id=run.id, worker="w")
    runs.set_status(session=db_session, run_id=run.id, worker="w", status="done", environment_detail={
        "adapter": {"adapter": "from_tree", "module": "from_tree_adapter", "version": "1.2.3"}})
    db_session.expire_all()  # set_status wrote with an UPDATE; the page reads through this session
    page = api.get(f"/runs/{run.id}")
    assert page.status_code == 200
    assert 'id="adapter"' in page.text and "version: <code>1.2.3</code>" in page.text
    # the row's heading says "adapter"; its cell starts with the name, not "adapter: " again
    cell = re.search(r'<td id="adapter">(.*?)</td>', page.text).group(1)
    assert "adapter:" not in cell, cell
    assert cell.startswith("<code>from_tree</code> (module: <code>from_tree_adapter</code>"), cell


def test_the_trees_root_is_an_adapter_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """An adapter module at the top of the submitted tree: `adapter_path = ["."]`, put on the
    host's sys.path as the tree itself (worker/pipeline.py: source_dir / folder)."""
    config = parse_config('[project]\nadapter = "root_adapter"\nadapter_path = ["."]\n')
    assert config.adapter_path == ["."]
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "root_adapter.py").write_text(TREE_ADAPTER)
    monkeypatch.syspath_prepend(str(tree / config.adapter_path[0]))
    assert get_adapter("root_adapter").name == "from_tree"


TREE_BUNDLED = '''
from worker.adapters.bundled import BundledAdapter

class TreeBundled(BundledAdapter):
    name = "tree_bundled"
'''


@pytest.mark.slow
def test_the_attribution_reruns_load_a_tree_adapter_from_its_adapter_path(tmp_path, kernels_build, decay_build):
    """The attribution's re-run (worker/attribution/pair_run.py) starts its kernel hosts with the
    trees' adapter folders, as the run's hosts had them: an adapter that lives only in the tree
    loads, and the decay reorder's parameters are recorded from step 1 (without the folders the
    hosts cannot import it and nothing is recorded)."""
    from service.core.results import GradientStreamSpec
    from worker.attribution.pair_run import record_parameters
    from worker.battery import OPTIMIZER_HYPER_DEFAULTS, make_case

    tools = tmp_path / "tree" / "tools"
    tools.mkdir(parents=True)
    (tools / "tree_bundled_adapter.py").write_text(TREE_BUNDLED)
    cases = [make_case(optimizer="adam", family="32bit", param_dtype="float32",
                       hyper={**OPTIMIZER_HYPER_DEFAULTS["adam"], "lr": 0.1, "weight_decay": 0.1},
                       gradient=GradientStreamSpec(kind="open"), seed=seed, size=257, steps=3) for seed in (0, 1)]
    recorded = record_parameters(decay_build.library_path, kernels_build.library_path, cases, tmp_path,
                                 device="cpu", adapter="tree_bundled_adapter", adapter_paths=([tools], [tools]))
    assert sorted(recorded) == sorted(c.case_id for c in cases)
    assert all(step == 1 for _, _, step in recorded.values())
    without = record_parameters(decay_build.library_path, kernels_build.library_path, cases, tmp_path / "again",
                                device="cpu", adapter="tree_bundled_adapter")
    assert without == {}
