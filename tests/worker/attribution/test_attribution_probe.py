"""worker/attribution/probe.py: a rounding-level call whose drift test had too few moved elements to
read systematic is underpowered, and is probed at PROBE_ELEMENTS; the probe's call stands for the
case where it finds more than rounding, the case's own figures are kept, and the note says which."""

from __future__ import annotations

from service.core.results import GradientStreamSpec
from worker.attribution.drift import FALSE_ALARM, TAILS, binomial_upper_tail
from worker.attribution.probe import PROBE_ELEMENTS, combine, probe_case, underpowered
from worker.battery import OPTIMIZER_HYPER_DEFAULTS, make_case

CASE = make_case(optimizer="adam", family="32bit", param_dtype="bfloat16",
                 hyper={**OPTIMIZER_HYPER_DEFAULTS["adam"], "lr": 0.1, "weight_decay": 0.1},
                 gradient=GradientStreamSpec(kind="open", zero_fraction=0.25), seed=0, size=1031, steps=10)


def _record(moved: int, allowance: float = 0.0, klass: str = "rounding-level") -> dict:
    tests = [{"direction": d, "moved": moved, "with": 0, "against": moved, "allowance": allowance,
              "p_value": 0.5 ** moved, "systematic": False} for d in ("step", "parameter")]
    return {"class": klass, "variant": None, "first_step_ulps": 1.0, "replayed_elements": 1031, "drift": tests}


def test_too_few_moved_elements_is_underpowered_and_enough_is_not():
    # The test must be able to see three moves in four one way: at p0 = 1/2 that takes 49 elements.
    assert binomial_upper_tail(48, 36, 0.5) > FALSE_ALARM / TAILS >= binomial_upper_tail(49, 37, 0.5)
    assert underpowered(_record(3)) and underpowered(_record(13)) and underpowered(_record(48))
    assert underpowered(_record(0))
    assert not underpowered(_record(49))
    # A shared-factor allowance raises p0, and with it the elements needed...
    assert underpowered(_record(49, allowance=6.0))
    # ...until it explains three moves in four by itself: then a test with enough moves is decided,
    # not small (a float32 FMA variant's cases: 13853 moved, allowance 16149)...
    assert not underpowered(_record(13853, allowance=16149.0)) and not underpowered(_record(60, allowance=60.0))
    # ...but too few moves are too few whatever the allowance (the one-element case: 1 moved, allowance 1).
    assert underpowered(_record(1, allowance=1.0)) and underpowered(_record(3, allowance=6.0))
    # One direction too small is enough to ask again.
    mixed = _record(500)
    mixed["drift"][1] = _record(5)["drift"][1]
    assert underpowered(mixed)
    assert not underpowered(_record(3, klass="semantic")) and not underpowered({"class": "rounding-level"})


def test_the_probe_is_the_same_case_with_more_elements():
    probe = probe_case(CASE)
    assert probe.size == PROBE_ELEMENTS and probe.case_id != CASE.case_id
    assert (probe.optimizer, probe.family, probe.param_dtype, probe.hyper, probe.gradient, probe.seed, probe.steps) == \
        (CASE.optimizer, CASE.family, CASE.param_dtype, CASE.hyper, CASE.gradient, CASE.seed, CASE.steps)
    assert probe_case(probe) is None


def test_a_probe_that_drifts_gives_its_call_and_the_case_keeps_its_figures():
    probe = probe_case(CASE)
    probed = {"class": "precision", "variant": "bias_correction_float32_powers", "label": "float32 powers",
              "kind": "precision", "note": "a drift below one ulp, one way: 180 of the 200 elements",
              "drift": _record(200)["drift"]}
    found = combine(_record(3), probe, probed, 1)
    assert (found["class"], found["variant"]) == ("precision", "bias_correction_float32_powers")
    assert found["first_step_ulps"] == 1.0 and found["probe"]["case_id"] == probe.case_id
    assert found["note"].startswith("within rounding on its 1031 elements; 3 elements moved, too few for the drift "
                                    "test; the same case at n=16384 reads bias_correction_float32_powers (precision): "
                                    "a drift below one ulp"), found["note"]


def test_a_probe_within_rounding_or_without_an_answer_leaves_the_call():
    probe = probe_case(CASE)
    found = combine(_record(3), probe, {"class": "rounding-level", "drift": _record(300)["drift"]}, 1)
    assert found["class"] == "rounding-level" and found["note"].endswith("is rounding-level too")
    for probed, missing, why in (({"error": "ValueError: x"}, None, "ValueError: x"),
                                 (None, "its digests did not differ", "its digests did not differ")):
        found = combine(_record(3), probe, probed, None, missing=missing)
        assert found["class"] == "rounding-level" and found["note"].endswith(why), found["note"]


def test_a_case_with_no_moved_element_never_takes_the_probe_s_semantic_call():
    # Issue 47: a bfloat16 adagrad case under --fmad=true read "semantic" at 0 ulp with 0 elements
    # moved: its own call was rounding-level (parameters never moved, the float32 state within
    # rounding), too few moves for the drift test, and the probe's one-way drift became its call.
    # The probe stays beside it, said; the case keeps its own call.
    probe = probe_case(CASE)
    probed = {"class": "semantic", "variant": None, "label": "unexplained",
              "note": "a drift below one ulp, one way: 180 of the 200 elements", "drift": _record(200)["drift"]}
    still = {**_record(0), "first_step_ulps": 0.0, "peak_ulps": 0.0}
    found = combine(still, probe, probed, 1)
    assert found["class"] == "rounding-level" and found["probe"]["class"] == "semantic", found
    assert found["note"].endswith("reads semantic, not this case's call: none of its own elements moved"), found["note"]
    # One moved element is a moved element: the probe's call stands for it, as before.
    moved = {**_record(1), "peak_ulps": 1.0}
    assert combine(moved, probe, probed, 1)["class"] == "semantic"
