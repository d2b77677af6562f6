"""Which optimizer configurations a training-impact job trains (service/core/training.py
configs_from_cases), from the changed cases of a real battery: the decay reorder changes every
weight-decayed Adam and AdEMAMix case of the quick battery, in every dtype and family."""

from __future__ import annotations

from service.core.training import MODEL_SETS, configs_from_cases
from worker.battery import load_battery


def _decay_reorder_changes():  # noqa: ANN202
    battery = load_battery("quick")
    return [case for case in battery.expand()
            if case.optimizer in ("adam", "ademamix") and case.hyper.get("weight_decay")]


def test_every_changed_point_before_a_second_optimizer_and_float32_first() -> None:
    changed = _decay_reorder_changes()
    points = {(c.hyper["lr"], c.hyper["weight_decay"]) for c in changed}
    assert len(points) >= 2 and {c.param_dtype for c in changed} > {"float32"}
    quick = configs_from_cases(changed, MODEL_SETS["quick"].max_configs)
    # The quick set's two: one optimizer at each changed point, not two optimizers at one.
    assert len(quick) == 2 and len({(c.hyper["lr"], c.hyper["weight_decay"]) for c in quick}) == 2
    everything = configs_from_cases(changed, 100)
    assert {c.optimizer for c in everything} == {"adam", "ademamix"}
    # One configuration per (optimizer, family, point): float32 where it changed, no dtype twice.
    keys = [(c.optimizer, c.family, tuple(sorted(c.hyper.items()))) for c in everything]
    assert len(keys) == len(set(keys))
    float32_keys = {(c.optimizer, c.family, tuple(sorted(c.hyper.items()))) for c in changed
                    if c.param_dtype == "float32"}
    for config, key in zip(everything, keys):
        assert config.param_dtype == "float32" or key not in float32_keys, config
    # 32-bit families before the quantized ones at the same point; the plain float32 case first
    # (not a gradient-scaling or skip-zeros probe in float16).
    for config in quick:
        assert (config.family, config.param_dtype) == ("32bit", "float32"), config
        assert config.hyper["gnorm_scale"] == 1.0 and not config.hyper.get("skip_zeros"), config


def test_nothing_changed_trains_nothing() -> None:
    assert configs_from_cases([], 4) == []
