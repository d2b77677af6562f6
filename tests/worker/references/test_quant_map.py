"""Properties of the dynamic quantization maps (worker/references/quant_map.py), checked against the
definition in its docstring rather than against a stored table."""

from __future__ import annotations

import torch

from worker.references.quant_map import MAP_SIZE, dequantize, dynamic_map, dynamic_map_values, new_state, num_blocks, zero_code


def test_maps_are_256_strictly_increasing_float32_values_in_range():
    for signed in (True, False):
        qmap = dynamic_map(signed=signed)
        assert qmap.dtype == torch.float32 and qmap.shape == (MAP_SIZE,)
        assert bool((qmap[1:] > qmap[:-1]).all()), "sorted without repeats"
        assert float(qmap.max()) == 1.0
        assert float(qmap.min()) >= (-1.0 if signed else 0.0)


def test_maps_contain_exact_zero_and_one():
    for signed in (True, False):
        values = dynamic_map(signed=signed).tolist()
        assert values.count(0.0) == 1 and values.count(1.0) == 1


def test_unsigned_map_is_non_negative_and_starts_at_zero():
    qmap = dynamic_map(signed=False)
    assert float(qmap[0]) == 0.0 and bool((qmap >= 0).all())


def test_signed_map_is_symmetric_apart_from_its_extra_code_plus_one():
    values = dynamic_map(signed=True).tolist()
    negatives = sorted(-v for v in values if v < 0)
    positives = sorted(v for v in values if v > 0)
    assert len(negatives) == 127 and len(positives) == 128
    # Removing the extra code (+1) leaves an exactly symmetric set: float32 negation is exact.
    assert positives[:-1] == negatives and positives[-1] == 1.0
    assert -1.0 not in values  # the dynamic map has no -1 (see worker/references/quant_map.py)


def test_decades_hold_codes_halving_with_each_extra_exponent_bit():
    # Decade z (values in 10**-z * [0.1, 1)) holds 2**(6-z) magnitudes signed, 2**(7-z) unsigned.
    for signed, top in ((True, 6), (False, 7)):
        values = [v for v in dynamic_map_values(signed=signed) if 0 < v < 1]
        for z in range(7):
            in_decade = [v for v in values if 0.1 * 10.0 ** -z < v < 10.0 ** -z]
            assert len(in_decade) == 2 ** (top - z), (signed, z)
            # Equal slices of [0.1, 1]: values in a decade are evenly spaced, midpoints of slices.
            step = 0.9 * 10.0 ** -z / 2 ** (top - z)
            assert abs(in_decade[0] - (0.1 * 10.0 ** -z + step / 2)) < 1e-15
            gaps = [b - a for a, b in zip(in_decade, in_decade[1:])]
            assert all(abs(gap - step) < 1e-12 * 10.0 ** -z for gap in gaps)


def test_largest_signed_magnitudes_are_the_midpoints_of_the_top_slices():
    values = dynamic_map_values(signed=True)
    assert values[0] == -(1 - 0.9 / 128)          # -0.99296875: the most negative code
    assert values[-2] == 1 - 0.9 / 128
    smallest_positive = min(v for v in values if v > 0)
    assert abs(smallest_positive - 0.55e-6) < 1e-20   # decade 6 has one slice: its midpoint


def test_zero_state_and_dequantize():
    qmap = dynamic_map(signed=True)
    codes, absmax = new_state(300, qmap, "cpu")
    assert absmax.shape == (num_blocks(300),) == (2,)
    assert int(codes[0]) == zero_code(qmap) and float(qmap[zero_code(qmap)]) == 0.0
    assert bool((dequantize(codes, absmax.fill_(3.0), qmap) == 0).all())
    top = torch.full((300,), MAP_SIZE - 1, dtype=torch.uint8)
    values = dequantize(top, torch.tensor([2.0, 5.0]), qmap)
    assert values[:256].eq(2.0).all() and values[256:].eq(5.0).all()


def test_zero_code_is_read_again_after_the_map_changes_in_place():
    # zero_code remembers each map's code (a GPU map's read waits for the device); a map changed in
    # place since must be read again, not answered from memory.
    qmap = dynamic_map(signed=True)
    first = zero_code(qmap)
    assert zero_code(qmap) == first
    qmap.copy_(qmap.roll(1))
    assert zero_code(qmap) == first + 1
    assert zero_code(dynamic_map(signed=True)) == first  # a fresh map is its own entry
