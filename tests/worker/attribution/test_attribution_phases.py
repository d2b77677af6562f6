"""The attribution's four phases, each on its own (worker/attribution/analysis.py: reading ->
rounding test -> variant match -> drift), on small real trajectories: Adam's float64 reference
and its catalogued variants replayed over a case's gradients (worker/attribution/variants.py) and
rounded to the parameter dtype, as two kernels that implement them would write them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from service.core.results import GradientStreamSpec
from worker.attribution import variants
from worker.attribution.drift_call import judge_drift
from worker.attribution.matching import match_variants
from worker.attribution.reading import read_trajectories
from worker.attribution.rounding import judge_rounding
from worker.attribution.ulps import ulp
from worker.battery import OPTIMIZER_HYPER_DEFAULTS, make_case
from worker.engine.gradients import initial_parameters


def _case(dtype: str = "float32", steps: int = 4, size: int = 256, lr: float = 0.1, wd: float = 0.1):  # noqa: ANN202
    return make_case(optimizer="adam", family="32bit", param_dtype=dtype,
                     hyper=dict(OPTIMIZER_HYPER_DEFAULTS["adam"], lr=lr, weight_decay=wd),
                     gradient=GradientStreamSpec(kind="open"), seed=0, size=size, steps=steps)


def _paths(case, variant: str) -> tuple[np.ndarray, np.ndarray]:  # noqa: ANN001
    """(commit, baseline): `variant`'s and the algorithm's trajectories rounded to the case's dtype."""
    paths = variants.replay(case, [variants.CORRECT, variants.BY_NAME[variant]])
    dtype = variants._DTYPES[case.param_dtype]
    return paths[variant].to(dtype).float().numpy(), paths["reference"].to(dtype).float().numpy()


def _reference(case) -> np.ndarray:  # noqa: ANN001
    return variants.replay(case, [variants.CORRECT])["reference"].to(variants._DTYPES[case.param_dtype]).float().numpy()


def _one_ulp_up(rows: np.ndarray, from_step: int) -> np.ndarray:
    """Every float32 element one ulp of its own larger from `from_step` on: a rounding's size."""
    out = rows.copy()
    out[from_step - 1:] = np.nextafter(out[from_step - 1:], np.float32(np.inf))
    return out


# Reading: the change in ulps of each element's scale.

def test_reading_counts_a_change_in_ulps_of_the_element_s_scale_not_its_own():
    # Element 0 cancels down to 2**-20 of its start at step 3, where the commit differs from the
    # baseline by one ulp of the start's magnitude: one rounding of the arithmetic that handled it,
    # a million of the tiny value's own ulps.
    case = _case(steps=3)
    start = initial_parameters(case.seed, case.size).float().numpy()
    baseline = np.stack([start, start, start])
    baseline[2, 0] = start[0] * np.float32(2.0 ** -20)
    commit = baseline.copy()
    one_scale_ulp = np.float32(ulp(start[0], "float32"))
    commit[2, 0] = baseline[2, 0] + one_scale_ulp
    reading = read_trajectories(case, commit, baseline, 3)
    assert reading.ulps == [0.0, 0.0, 1.0]
    assert reading.max_abs_diff == float(one_scale_ulp)
    assert reading.first_step_ulps_elementwise() == 2 ** 20  # its own ulps: what the scale avoids
    assert reading.elements is None and reading.comparisons is None and not reading.quantized


def test_reading_compares_the_states_and_takes_code_leaves_as_quantized():
    case = _case(steps=2)
    baseline = _reference(case)
    codes = [{"m.codes": np.array([3, 4], dtype=np.uint8)}, {"m.codes": np.array([3, 5], dtype=np.uint8)}]
    moved = [{"m.codes": np.array([3, 4], dtype=np.uint8)}, {"m.codes": np.array([3, 7], dtype=np.uint8)}]
    reading = read_trajectories(case, baseline, baseline.copy(), 2, states=(moved, codes))
    assert reading.quantized
    assert [c.code_steps for c in reading.comparisons] == [0, 2]


# The rounding test: within each dtype's rounding allowance, or not.

def test_a_one_ulp_change_is_within_rounding_and_a_one_percent_change_is_not():
    case = _case()
    baseline = _reference(case)
    rounded = judge_rounding(read_trajectories(case, _one_ulp_up(baseline, 2), baseline, 2))
    assert rounded.within_rounding and rounded.scale == "rounding-level" and rounded.settled is None
    assert 0 < rounded.judged_peak <= 1.0
    scaled = baseline.copy()
    scaled[1:] *= np.float32(1.01)
    semantic = judge_rounding(read_trajectories(case, scaled, baseline, 2))
    assert not semantic.within_rounding and semantic.scale == "semantic" and semantic.settled is None
    assert semantic.judged_peak > 1e4


def test_the_rounding_test_settles_a_change_nothing_shows():
    # The digests differ and no parameter moved, the states unread: not attributed, saying why.
    case = _case()
    baseline = _reference(case)
    test = judge_rounding(read_trajectories(case, baseline, baseline.copy(), 1))
    assert not test.within_rounding
    assert test.settled["class"] == "unknown" and test.settled["moved_elements"] == 0


# The variant match: the variant that explains commit − baseline, or none.

@pytest.mark.parametrize("variant", ["decay_after_update", "eps_inside_sqrt"])
def test_the_match_names_the_variant_the_commit_follows(variant):
    case = _case()
    commit, baseline = _paths(case, variant)
    reading = read_trajectories(case, commit, baseline, 1)
    match = match_variants(reading, judge_rounding(reading))
    assert (match.fields["class"], match.fields["variant"]) == ("semantic", variant), match.fields["candidates"]
    assert match.fields["candidates"][0]["variant"] == variant
    assert match.naming is match.residuals  # replayed to the last step: the drift may be named


def test_the_match_names_no_variant_for_a_rounding_or_an_uncatalogued_change():
    case = _case()
    baseline = _reference(case)
    reading = read_trajectories(case, _one_ulp_up(baseline, 2), baseline, 2)
    assert match_variants(reading, judge_rounding(reading)).fields["class"] == "rounding-level"
    scaled = baseline.copy()
    scaled[1:] *= np.float32(1.01)
    reading = read_trajectories(case, scaled, baseline, 2)
    found = match_variants(reading, judge_rounding(reading)).fields
    assert (found["class"], found["variant"], found["label"]) == ("semantic", None, "unexplained")


# The drift: a case within rounding whose flipped roundings go one way.

def _drift(commit: np.ndarray, baseline: np.ndarray, case) -> dict:  # noqa: ANN001
    reading = read_trajectories(case, commit, baseline, 1)
    rounding = judge_rounding(reading)
    assert rounding.within_rounding  # the phase's premise: every change within rounding
    return judge_drift(reading, match_variants(reading, rounding)).fields


def test_decay_after_the_update_below_one_bfloat16_ulp_drifts_one_way_and_is_named():
    # lr = wd = 1e-2: each update shortened by ~1e-4 of itself, ~1/4000 of a bfloat16 ulp.
    case = _case("bfloat16", steps=20, size=4096, lr=1e-2, wd=1e-2)
    fields = _drift(*_paths(case, "decay_after_update"), case)
    assert any(test["systematic"] for test in fields["drift"]), fields["drift"]
    assert (fields["class"], fields["variant"]) == ("semantic", "decay_after_update"), fields
    assert fields["note"].startswith("a drift below one ulp, one way")


def test_unbiased_one_ulp_flips_do_not_drift():
    # A reorder's roundings: at each step 2 % of the elements one bfloat16 ulp up or down, at random.
    case = _case("bfloat16", steps=20, size=4096, lr=1e-2, wd=1e-2)
    baseline = _reference(case)
    rng = np.random.default_rng(0)
    commit = baseline.copy()
    for row in commit:
        flipped = rng.random(row.size) < 0.02
        away = torch.from_numpy(np.where(rng.random(row.size) < 0.5, np.inf, -np.inf).astype(np.float32))
        moved = torch.nextafter(torch.from_numpy(row).bfloat16(), away.bfloat16()).float().numpy()
        row[flipped] = moved[flipped]
    fields = _drift(commit, baseline, case)
    assert min(test["moved"] for test in fields["drift"]) > 100  # the flips were there to count
    assert not any(test["systematic"] for test in fields["drift"]), fields["drift"]
    assert set(fields) == {"drift"}  # no call made
