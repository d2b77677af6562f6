"""The adapter registry: names resolve to fresh adapters, bad names say what to use."""

from __future__ import annotations

import pytest

from worker.adapters import BUILTIN_ADAPTERS, AdapterError, ProjectAdapter, get_adapter


def test_builtin_names_resolve_to_their_adapters():
    for name in BUILTIN_ADAPTERS:
        adapter = get_adapter(name)
        assert isinstance(adapter, ProjectAdapter) and adapter.name == name
    assert get_adapter("bundled") is not get_adapter("bundled")  # one per host, never shared


def test_a_dotted_module_path_is_an_out_of_tree_adapter():
    assert get_adapter("worker.adapters.tinyopt").name == "tinyopt"


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

    adapter = get_adapter("tinyopt")
    lion = make_case(optimizer="lion", family="32bit", param_dtype="float32", hyper=OPTIMIZER_HYPER_DEFAULTS["lion"],
                     gradient=GradientStreamSpec(), seed=0, size=4, steps=1)
    assert "no lion" in adapter.unsupported(lion, torch.device("cpu"))
    adam16 = make_case(optimizer="adam", family="32bit", param_dtype="float16", hyper=OPTIMIZER_HYPER_DEFAULTS["adam"],
                       gradient=GradientStreamSpec(), seed=0, size=4, steps=1)
    assert "float32" in adapter.unsupported(adam16, torch.device("cpu"))
