"""The adapter registry: names resolve to fresh adapters, bad names say what to use."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.adapters import BUILTIN_ADAPTERS, AdapterError, ProjectAdapter, get_adapter


def test_builtin_names_resolve_to_their_adapters():
    for name in BUILTIN_ADAPTERS:
        adapter = get_adapter(name)
        assert isinstance(adapter, ProjectAdapter) and adapter.name == name
    assert get_adapter("bundled") is not get_adapter("bundled")  # one per host, never shared


def test_a_dotted_module_path_is_an_out_of_tree_adapter():
    assert get_adapter("tests.fixtures.adapters.tinyopt").name == "tinyopt"


def test_fixture_adapters_are_not_built_in():
    """tinyopt and capiopt are the suite's, registered as an operator would (OPTDRIFT_EXTRA_ADAPTERS):
    the product names neither, and neither module ships in worker/."""
    import worker.adapters

    assert not {"tinyopt", "capiopt", "capi"} & set(BUILTIN_ADAPTERS)
    shipped = {path.stem for path in Path(worker.adapters.__file__).parent.glob("*.py")}
    assert not {"tinyopt", "capi", "capiopt"} & shipped


def test_bad_names_say_what_to_use():
    with pytest.raises(AdapterError, match="unknown adapter 'bnb'.*bitsandbytes"):
        get_adapter("bnb")
    with pytest.raises(AdapterError, match="cannot import module no.such_module"):
        get_adapter("no.such_module")
    with pytest.raises(AdapterError, match="exactly one ProjectAdapter subclass"):
        get_adapter("worker.adapters.base")


def test_tinyopt_refuses_what_it_does_not_implement():
    import torch

    from service.core.results import GradientStreamSpec
    from worker.battery import OPTIMIZER_HYPER_DEFAULTS, make_case

    adapter = get_adapter("tests.fixtures.adapters.tinyopt")
    lion = make_case(optimizer="lion", family="32bit", param_dtype="float32", hyper=OPTIMIZER_HYPER_DEFAULTS["lion"],
                     gradient=GradientStreamSpec(), seed=0, size=4, steps=1)
    assert "no lion" in adapter.unsupported(lion, torch.device("cpu"))
    adam16 = make_case(optimizer="adam", family="32bit", param_dtype="float16", hyper=OPTIMIZER_HYPER_DEFAULTS["adam"],
                       gradient=GradientStreamSpec(), seed=0, size=4, steps=1)
    assert "float32" in adapter.unsupported(adam16, torch.device("cpu"))


# ----------------------------------------------------------------------------- the operator's registrations
def test_registrations_name_a_module_file_or_an_installed_module(tmp_path):
    from worker.adapters.registry import parse

    module = tmp_path / "myopt_adapter.py"
    module.write_text("")
    found = parse(f" myopt={module} , other=mypkg.adapter ")
    assert (found["myopt"].module, found["myopt"].folders) == ("myopt_adapter", [tmp_path.resolve()])
    assert (found["other"].module, found["other"].folders) == ("mypkg.adapter", [])
    assert parse("") == {}


@pytest.mark.parametrize("text, says", [
    ("tinyopt", "is not name="),
    ("bundled=mypkg.adapter", "built-in adapter's name"),
    ("a=x.y,a=x.z", "registered twice"),
    ("rel=adapters/mine.py", "not an absolute path"),
    ("gone=/no/such/folder/mine.py", "not an absolute path"),
    ("odd=not a module", "neither a module file"),
])
def test_a_malformed_registration_names_the_setting_and_the_entry(text, says):
    from worker.adapters.registry import parse

    with pytest.raises(ValueError, match=f"OPTDRIFT_EXTRA_ADAPTERS: .*{says}"):
        parse(text)


def test_the_suite_registers_its_fixture_adapters_as_an_operator_would():
    """tests/conftest.py sets OPTDRIFT_EXTRA_ADAPTERS; the worker's settings read it, and a kernel
    host is given the module and its folder (never anything from a submitted tree)."""
    from worker.adapters.registry import host_form

    fixtures = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "adapters"
    assert host_form("tinyopt") == ("tinyopt", [fixtures.resolve()])
    assert host_form("capiopt") == ("capiopt", [fixtures.resolve()])
    assert host_form("bundled") == ("bundled", [])
    assert host_form("mypkg.adapter") == ("mypkg.adapter", [])
