"""Battery specs: validation in one error, canonical hashing, expansion, the built-ins' contents."""

import pytest
from pydantic import ValidationError

from worker.battery import OPTIMIZER_HYPER_DEFAULTS, BatterySpec, load_battery


def _spec(**group):
    return {"name": "t", "version": 1, "groups": [{"optimizers": ["adam"], "sizes": [8], "steps": 2, **group}]}


def test_invalid_battery_lists_every_wrong_field_in_one_error():
    bad = {"name": "bad", "version": 1, "groups": [
        {"optimizers": ["adamw", "lion"], "sizes": [0, 1 << 30], "steps": 0, "points": [{"lr": -1.0}]},
        {"optimizers": ["lion"], "sizes": [4], "steps": 1, "points": [{"momentum": 0.5}]},
    ]}
    with pytest.raises(ValidationError) as caught:
        BatterySpec.model_validate(bad, context={"max_case_size": 1 << 20})
    locations = {".".join(map(str, e["loc"])) for e in caught.value.errors()}
    assert locations == {"groups.0.optimizers.0", "groups.0.sizes", "groups.0.steps",
                         "groups.0.points.0.lr", "groups.1.points"}
    text = str(caught.value)
    assert "1073741824" in text and "momentum" in text


def test_size_limit_is_configurable(monkeypatch):
    BatterySpec.model_validate(_spec(sizes=[1000]))
    monkeypatch.setenv("OPTDRIFT_MAX_CASE_SIZE", "999")
    with pytest.raises(ValidationError, match="1..999"):
        BatterySpec.model_validate(_spec(sizes=[1000]))


def test_digest_is_canonical_and_sensitive():
    a = BatterySpec.model_validate(_spec(points=[{"lr": 0.1, "weight_decay": 0.1}]))
    # Same content, keys in another order and a float written differently -> same digest.
    b = BatterySpec.model_validate({"version": 1, "groups": [
        {"steps": 2, "points": [{"weight_decay": 0.1, "lr": 1e-1}], "sizes": [8], "optimizers": ["adam"]}],
        "name": "t"})
    assert a.digest == b.digest
    # One ulp in a hyperparameter, or the version -> another digest.
    c = BatterySpec.model_validate(_spec(points=[{"lr": 0.10000000000000002, "weight_decay": 0.1}]))
    d = BatterySpec.model_validate({**_spec(points=[{"lr": 0.1, "weight_decay": 0.1}]), "version": 2})
    assert len({a.digest, c.digest, d.digest}) == 3


def test_expansion_fills_every_kernel_argument_and_ids_are_unique():
    spec = BatterySpec.model_validate({"name": "t", "version": 1, "groups": [
        {"optimizers": ["adam", "lion"], "param_dtypes": ["float32", "bfloat16"], "sizes": [1, 5],
         "seeds": [0, 1], "steps": 3, "points": [{"lr": 0.1, "skip_zeros": True}]},
        {"optimizers": ["adam"], "param_dtypes": ["float32"], "sizes": [1], "seeds": [0], "steps": 3,
         "points": [{"lr": 0.1, "skip_zeros": True}]},  # duplicates cases of the first group
    ]})
    cases = spec.expand()
    assert len(cases) == 2 * 2 * 2 * 2
    assert len({c.case_id for c in cases}) == len(cases)
    for case in cases:
        assert set(case.hyper) == set(OPTIMIZER_HYPER_DEFAULTS[case.optimizer])
        assert case.hyper["lr"] == 0.1
    assert all(c.hyper["skip_zeros"] is True for c in cases if c.optimizer == "adam")
    assert cases[0].case_id.startswith("adam.32bit.fp32.lr=0.1.wd=0.0.skip_zeros=True.open.n1.s0.t3#")


def test_quick_battery_contents():
    cases = load_battery("quick").expand()
    points = {(c.optimizer, c.hyper["lr"], c.hyper["weight_decay"]) for c in cases}
    for optimizer in ("adam", "ademamix"):
        assert {(optimizer, 0.1, 0.1), (optimizer, 0.1, 0.0), (optimizer, 1e-3, 1e-2), (optimizer, 1e-3, 0.0)} <= points
    assert {c.optimizer for c in cases} == set(OPTIMIZER_HYPER_DEFAULTS)
    assert {c.param_dtype for c in cases} == {"float32", "float16", "bfloat16"}


def test_standard_battery_covers_the_issue_list():
    cases = load_battery("standard").expand()
    # 8-bit one-step cases are the closed-form checks (issue 6); every other case runs >= 100 steps.
    assert len(cases) >= 500 and min(c.steps for c in cases if c.steps != 1 or c.family == "32bit") >= 100
    sizes = {c.size for c in cases}
    assert {1, 4097} <= sizes and max(sizes) >= 65536
    points = {(c.hyper["lr"], c.hyper["weight_decay"]) for c in cases}
    assert {(1e-3, 1e-2), (0.1, 0.1), (1e-3, 0.0)} <= points
    assert {c.param_dtype for c in cases} == {"float32", "float16", "bfloat16"}
    assert any(c.hyper["gnorm_scale"] != 1.0 for c in cases)
    assert any(c.gradient.zero_fraction > 0 for c in cases)
    assert any(c.hyper.get("skip_zeros") for c in cases)
    assert len({c.seed for c in cases}) >= 3
    assert {c.gradient.kind for c in cases} == {"open", "closed"}


def test_unknown_battery_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown battery 'fast'"):
        load_battery("fast")
