"""Attribution that reads the state as well as the parameters (issue 37), on tests/fixtures/lowbit's
pure-PyTorch 8-bit blockwise AdamW run in this process (bench/attribution_lowbit.py measures the
whole labelled set): a quantizer change is "quantization", never rounding-level; a same-math
reorder is rounding-level; the float32 first step allows a reorder's roundings of both builds."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from worker.attribution import states as state_compare
from worker.attribution.analysis import ROUNDING_ULPS_FIRST_STEP, ROUNDING_ULPS_PER_STEP, analyze, rounding_allowance

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import attribution_lowbit as labelled  # noqa: E402

STEPS = 6


def _case(family: str, dtype: str, kind: str, lr: float = 0.1, wd: float = 0.1):  # noqa: ANN202
    return next(c for c in labelled.cases(STEPS) if c.family == family and c.param_dtype == dtype
                and c.gradient.kind == kind and c.hyper["lr"] == lr and c.hyper["weight_decay"] == wd
                and c.size == 4096)


def _attribute(case, mutant: str, with_states: bool = True) -> dict:  # noqa: ANN001
    base_params, base_states, base_digests = labelled.trajectory(case, {})
    params, states, digests = labelled.trajectory(case, labelled.MUTANTS[mutant][0])
    first = next(t for t, (a, b) in enumerate(zip(digests, base_digests), start=1) if a != b)
    return analyze(case, params, base_params, first, states=(states, base_states) if with_states else None)


@pytest.mark.parametrize("kind", ["open", "closed"])
def test_rounding_codes_down_is_quantization_not_rounding_level(kind):
    found = _attribute(_case("8bit_blockwise", "float32", kind), "round_down")
    # Step 1's parameters are the same (updated from the float32 states before requantizing);
    # the codes moved, at far more elements than one rounding moves.
    assert found["first_divergent_step"] == 1 and found["first_step_ulps"] == 0
    assert found["class"] == "quantization", found
    assert "codes moved by up to 1 at" in found["note"]


def test_another_block_size_is_quantization_by_its_layout():
    found = _attribute(_case("8bit_blockwise", "float32", "open"), "block128")
    assert found["class"] == "quantization"
    assert found["note"].startswith("the state's block layout differs from step 1")


@pytest.mark.parametrize("family", ["8bit_blockwise", "32bit"])
@pytest.mark.parametrize("kind", ["open", "closed"])
def test_a_same_math_reorder_is_rounding_level(family, kind):
    found = _attribute(_case(family, "float32", kind), "reorder")
    assert found["class"] == "rounding-level", found
    # More than the per-step allowance at the first step (both builds' roundings of the update),
    # within the float32 first-step allowance.
    assert found["first_step_ulps"] <= ROUNDING_ULPS_FIRST_STEP["float32"]


def test_the_reorder_needs_the_float32_first_step_allowance():
    # Without it (2 ulps at the first step) the same reorder read semantic: its first step moves
    # 4-8 scale ulps.
    found = _attribute(_case("32bit", "float32", "open"), "reorder")
    assert found["first_step_ulps"] > ROUNDING_ULPS_PER_STEP
    assert list(rounding_allowance(2, 4, "float32")) == [0.0, 8.0, 10.0, 12.0]
    assert list(rounding_allowance(2, 4, "bfloat16")) == [0.0, 2.0, 4.0, 6.0]


def test_decay_after_the_update_stays_semantic_on_a_quantized_state():
    found = _attribute(_case("8bit_blockwise", "float32", "open"), "decay_after")
    assert found["class"] == "semantic" and found["variant"] == "decay_after_update", found


def test_without_states_a_change_that_leaves_the_parameters_equal_is_quantization():
    # What the service's co-run gives today (parameters only): the digest differs at step 1 while
    # the parameters are equal, so the state alone changed: never rounding-level.
    found = _attribute(_case("8bit_blockwise", "float32", "closed"), "round_down", with_states=False)
    assert found["class"] == "quantization" and "states not read" in found["note"]
    assert found["states_read"] is False


def test_states_compare_counts_codes_and_own_ulps():
    base = [{"m.codes": np.array([10, 20, 30, 40], dtype=np.uint8), "m.scale": np.array([1.0], dtype=np.float32)}]
    moved = [{"m.codes": np.array([11, 20, 30, 40], dtype=np.uint8),
              "m.scale": np.array([np.nextafter(np.float32(1.0), np.float32(2.0))], dtype=np.float32)}]
    step = state_compare.compare(moved, base)[0]
    assert (step.code_steps, step.code_fraction, step.float_ulps) == (1, 0.25, 1.0)
    assert not state_compare.quantization_event_is_rounding(step)  # a quarter of the codes moved
    relaid = [{"m.codes": base[0]["m.codes"], "m.scale": np.array([1.0, 1.0], dtype=np.float32)}]
    assert not state_compare.compare(relaid, base)[0].same_layout


def test_a_quantization_call_reads_as_its_class_not_unexplained():
    from service.core import attribution_view

    detail = {"attribution": {"c1": {"class": "quantization", "variant": None, "first_step_ulps": 0.0,
                                     "peak_ulps": 4e8, "note": "codes moved by up to 1 at 48.0% of them at step 1"}}}
    assert attribution_view.by_case(detail)["c1"].text == "quantization: codes moved by up to 1 at 48.0% of them at step 1"
    headline = attribution_view.headline(detail)
    assert "quantization (1)" in headline and "unexplained" not in headline and "rounding-level" not in headline


def test_a_change_of_the_state_alone_is_never_rounding_level():
    # States written to each other's slot (writeback/adam_states_swapped_cpu): the digests differ
    # from step 1, the parameters never do. Without the states nothing bounds it: not rounding-level;
    # and nothing shows a different rule either (no element moved, the states unread): not semantic
    # (issue 47), but not attributed, with the reason.
    case = _case("32bit", "float32", "open")
    params, _, _ = labelled.trajectory(case, {})
    found = analyze(case, params, params.copy(), 1)
    assert found["class"] == "unknown" and found["moved_elements"] == 0, found
    assert found["note"].startswith("the state changed and the parameters did not") and "not read" in found["note"]


def _one_bf16_ulp_apart(values: np.ndarray, elements: list[int]) -> np.ndarray:
    """`values` (bfloat16 values held as float32) with the given elements one bfloat16 ulp away,
    alternately up and down (a contraction's roundings go either way)."""
    out = values.copy()
    for k, i in enumerate(elements):
        ulp_bf16 = np.float32(2.0 ** (np.floor(np.log2(abs(out[i]))) - 7))
        out[i] = out[i] + (ulp_bf16 if k % 2 == 0 else -ulp_bf16)
    return out


def test_a_state_moved_by_the_parameters_it_reads_is_not_the_state_s_own_change():
    # A contraction moves three bfloat16 parameters by one ulp at step 1 and a float32 moment by
    # one of its ulps. From step 2 the moments read those parameters (weight decay, the gradient)
    # and differ by ~1e-3 of their value, thousands of float32 ulps: the parameters' difference
    # carried in, not the state's arithmetic. Rounding-level; judging the later states as the
    # state's own change called it semantic.
    case = _case("32bit", "bfloat16", "open")
    params, states, _ = labelled.trajectory(case, {})
    commit = np.stack([_one_bf16_ulp_apart(row, [0, 1, 2]) for row in params])
    moved = [{name: values.copy() for name, values in leaves.items()} for leaves in states]
    name = next(n for n, v in moved[0].items() if v.dtype == np.float32 and v.size == case.size and v[0] != 0)
    moved[0][name][0] = np.nextafter(moved[0][name][0], np.float32(np.inf))
    for leaves in moved[1:]:
        leaves[name][0] *= np.float32(1 + 1e-3)
    found = analyze(case, commit, params, 1, states=(moved, states))
    assert found["states_read"] and found["class"] == "rounding-level", found
    # The same state change with the parameters equal until the last step is the state's own.
    late = params.copy()
    late[-1] = commit[-1]
    found = analyze(case, late, params, 1, states=(moved, states))
    assert found["class"] != "rounding-level", found


def test_a_state_kept_in_another_convention_is_not_rounding_level_and_says_why():
    # lr folded into the momentum buffer (catalogue lr/momentum_lr_in_buffer): the parameters move
    # within rounding, the state holds lr x buffer. Rounding-level bounds states as well: not it.
    case = _case("32bit", "float32", "open")
    params, states, _ = labelled.trajectory(case, {})
    commit = np.stack([np.where(np.arange(row.size) == 0, np.nextafter(row, np.float32(np.inf)), row)
                       for row in params]).astype(np.float32)
    scaled = [{name: (values * np.float32(0.1) if values.dtype == np.float32 and values.size == case.size else values)
               for name, values in leaves.items()} for leaves in states]
    found = analyze(case, commit, params, 1, states=(scaled, states))
    assert found["class"] != "rounding-level", found
    assert found["note"].startswith("the parameters stay within rounding, the state does not: at step 1 "), found["note"]


def test_a_state_element_that_cancels_is_judged_in_the_leaf_s_ulps_not_its_own():
    # momentum's buffer = g + wd*p: where the two nearly cancel, one rounding of wd*p (an FMA) moves
    # the element by one ulp of wd*p, hundreds of its own. Measured on the leaf's scale it is one ulp.
    base = np.array([1.0, 0.5, 3.0e-6], dtype=np.float32)
    moved = base.copy()
    moved[2] = base[2] + np.float32(2.0 ** -23)  # one ulp of 1.0, ~40 of 3e-6's own
    (step,) = state_compare.compare([{"momentum_buffer": moved}], [{"momentum_buffer": base}])
    assert step.float_ulps == 1.0
    # A change of the rule (lr folded into the buffer) is far beyond the leaf's ulps all the same.
    (scaled,) = state_compare.compare([{"momentum_buffer": base * np.float32(0.1)}], [{"momentum_buffer": base}])
    assert scaled.float_ulps > 1e6
