"""State families as data (service/core/families.py, issue 37): the table every family name comes
from, its quantization steps, and the stored names it keeps."""

from __future__ import annotations

import typing

import pytest

from service.core.families import FAMILIES, FAMILY_NAMES, QUANTIZED, label, quantization_step
from service.core.results import CaseSpec, KernelFamily
from service.core.verdicts import case_scale


def test_the_result_models_accept_exactly_the_tables_families():
    assert set(typing.get_args(KernelFamily)) == set(FAMILY_NAMES)


def test_stored_names_are_kept():
    # rows stored before the table say these two; they must keep meaning the same family
    assert FAMILIES["32bit"].reference == "float64" and not FAMILIES["32bit"].quantized
    assert FAMILIES["8bit_blockwise"].block_size == 256 and FAMILIES["8bit_blockwise"].bits == 8
    assert QUANTIZED == set(FAMILY_NAMES) - {"32bit"}


def test_a_4bit_case_says_4bit_and_its_id_parses():
    case = CaseSpec(case_id="adam.4bit_blockwise.fp32.x", optimizer="adam", family="4bit_blockwise", hyper={},
                    seed=0, size=8192, steps=1)
    assert label(case.family) == "4-bit blockwise"
    assert case_scale({"case_id": case.case_id}) == ("4bit_blockwise", "float32")
    assert case_scale({"case_id": "adam.8bit_blockwise.bf16.x"}) == ("8bit_blockwise", "bfloat16")
    with pytest.raises(ValueError):
        CaseSpec(case_id="x", optimizer="adam", family="3bit", hyper={}, seed=0, size=1, steps=1)


def test_quantization_steps():
    # blockwise: absmax over the code steps (signed codes: 127 at 8 bits, 7 at 4 bits); exact
    assert quantization_step("8bit_blockwise", 1.27) == pytest.approx(0.01, rel=1e-15)
    assert quantization_step("4bit_blockwise", 7.0) == 1.0
    # fp8: one ulp at the magnitude; e4m3 keeps 3 mantissa bits, e5m2 two; exact powers of two
    assert quantization_step("fp8_e4m3", 1.0) == 0.125 and quantization_step("fp8_e4m3", 1.9) == 0.125
    assert quantization_step("fp8_e5m2", 1.0) == 0.25
    assert quantization_step("fp8_e4m3", 0.0) == 2.0 ** -9  # subnormal spacing: 2**(-6-3)
    assert quantization_step("32bit", 1.0) == 2.0 ** -23


def test_the_quantized_figures_are_stored_with_the_series():
    # service/domain/trajectories.py packs the per-step series a later comparison reads back;
    # the step figures must survive it (direction is judged on them), older layouts lack them.
    from service.core.results import Trajectory
    from service.domain.trajectories import pack_series, unpack_series

    trajectory = Trajectory(ref64_max_abs=[1.0], ref64_max_rel=[1.0], nonfinite_count=[0], digests=["od2:a"],
                            quant_ref_steps=[0.5], quant_ref_max_abs=[2.0 ** -20])
    series = unpack_series(*pack_series(trajectory))
    assert series["quant_ref_steps"] == [0.5] and series["quant_ref_max_abs"] == [2.0 ** -20]
    assert Trajectory(digests=["od2:a"], **series) == trajectory
    older = Trajectory(ref64_max_abs=[1.0], ref64_max_rel=[1.0], nonfinite_count=[0], digests=["od2:a"])
    assert "quant_ref_steps" not in unpack_series(*pack_series(older))
