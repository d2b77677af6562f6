"""The codecs of the quantization-aware reference (worker/references/blockwise_quant.py): the unit a
quantized state's distance is measured in, for linear codes and for a dynamic map (the bundled
8-bit kernels' map, worker/references/quant_map.py), and the reference itself."""

from __future__ import annotations

import torch

from worker.adapters.bundled_8bit import EightBitBlockwiseAdapter
from worker.battery import OPTIMIZER_HYPER_DEFAULTS, make_case
from service.core.results import GradientStreamSpec
from worker.references.blockwise_quant import Codec, DynamicMapCodec, QuantAwareAdamW, QuantAwareReference, state_steps
from worker.references.quant_map import BLOCK_SIZE, dynamic_map

# Figures are ratios of float64 values built from float32 map entries: exact to ~1e-15 relative.
EXACT = 1e-12


def _dynamic() -> DynamicMapCodec:
    return DynamicMapCodec(dynamic_map(signed=True), dynamic_map(signed=False), BLOCK_SIZE)


def _on_map(codes: list[int], signed: bool, absmax: float) -> torch.Tensor:
    """A block whose first element is the absmax (map entry 1.0) and the rest the given codes."""
    qmap = dynamic_map(signed=signed).to(torch.float64)
    top = int((qmap == 1.0).nonzero())
    return qmap[torch.tensor([top, *codes])] * absmax


def test_one_code_off_reads_one_step_wherever_the_map_is_dense_or_sparse():
    codec = _dynamic()
    for signed in (True, False):
        qmap = dynamic_map(signed=signed).to(torch.float64)
        gaps = qmap[1:] - qmap[:-1]
        # codes whose gap below and gap above differ by up to 5x (decade boundaries) and the ends
        codes = [c for c in range(1, 254) if abs(gaps[c] / gaps[c - 1] - 1) > 0.5][:6] + [0, 1, 128, 253]
        reference = _on_map(codes, signed, absmax=3.0)
        for shift in (1, -1):
            moved = [min(max(c + shift, 0), 255) for c in codes]
            kernel = _on_map(moved, signed, absmax=3.0)
            apart = codec.steps_apart(kernel, reference, signed)
            expected = torch.tensor([0.0] + [float(m != c) for m, c in zip(moved, codes)], dtype=torch.float64)
            assert torch.allclose(apart, expected, rtol=0, atol=EXACT), (signed, shift, apart, expected)


def test_off_the_map_the_step_is_the_gap_of_the_interval_the_value_lies_in():
    codec = _dynamic()
    qmap = dynamic_map(signed=True).to(torch.float64)
    between = (qmap[200] + qmap[201]) / 2
    reference = torch.tensor([1.0, between], dtype=torch.float64)
    kernel = torch.tensor([1.0, qmap[201]], dtype=torch.float64)
    assert abs(codec.steps_apart(kernel, reference, True)[1].item() - 0.5) < EXACT


def test_a_zero_block_counts_its_error_in_absolute_units_and_partial_blocks_are_measured():
    codec = _dynamic()
    reference = torch.zeros(BLOCK_SIZE + 3, dtype=torch.float64)
    kernel = reference.clone()
    kernel[-1] = 0.25
    apart = codec.steps_apart(kernel, reference, True)
    assert apart.shape == (BLOCK_SIZE + 3,) and apart[-1].item() == 0.25 and apart[:-1].sum().item() == 0


def test_rounding_to_the_nearest_code_moves_a_value_by_at_most_half_a_step():
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(BLOCK_SIZE * 2 + 5, generator=generator, dtype=torch.float64)
    for codec in (_dynamic(), Codec.for_family("8bit_blockwise")):
        for signed, x in ((True, values), (False, values.square())):
            once = codec.roundtrip(x, signed)
            apart = codec.steps_apart(once, x, signed)
            # 0.5 up to the float32 rounding of the map's entries (a block's negative extreme lies past
            # the map's end, -0.99296875: its distance is measured in the end gap, float32 entries)
            assert once.shape == x.shape and apart.max().item() <= 0.5 + 1e-5
            assert apart.mean().item() > 0.1  # random values are rarely on a code: ~a quarter step on average


def test_the_linear_codec_reads_one_code_as_one_step():
    codec = Codec.for_family("8bit_blockwise")
    reference = torch.tensor([127.0, 10.0, -3.0] + [0.0] * 253, dtype=torch.float64)  # step 1 in this block
    kernel = reference + torch.tensor([0.0, 1.0, -1.0] + [0.0] * 253, dtype=torch.float64)
    assert state_steps({"exp_avg": kernel}, {"exp_avg": reference}, codec) == 2 / 256


def test_without_a_codec_the_reference_is_adamw_in_float64():
    generator = torch.Generator().manual_seed(1)
    start = torch.randn(300, generator=generator, dtype=torch.float64)
    ours = QuantAwareAdamW(start, None, lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    param = torch.nn.Parameter(start.clone())
    torch_adamw = torch.optim.AdamW([param], lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    for _ in range(5):
        grad = torch.randn(300, generator=generator, dtype=torch.float64)
        ours.step(grad)
        param.grad = grad
        torch_adamw.step()
    # the same formula in another association: float64 rounding over 5 steps
    assert torch.allclose(ours.p, param.detach(), rtol=1e-13, atol=1e-15)


def test_the_reference_keeps_elements_with_a_non_finite_gradient_as_the_kernels_do():
    reference = QuantAwareReference("adam", OPTIMIZER_HYPER_DEFAULTS["adam"], torch.ones(4), _dynamic())
    reference.step(torch.tensor([1.0, float("nan"), float("inf"), -1.0]))
    assert reference.p[1].item() == reference.p[2].item() == 1.0
    assert torch.isfinite(reference.states()["exp_avg"]).all()


def test_the_bundled_adapter_names_the_maps_it_hands_the_kernels():
    adapter = EightBitBlockwiseAdapter()
    case = make_case(optimizer="adam", family="8bit_blockwise", param_dtype="float32",
                     hyper=OPTIMIZER_HYPER_DEFAULTS["adam"], gradient=GradientStreamSpec(), seed=0, size=300, steps=1)
    codec = adapter.quantization_codec(case)
    signed_map, unsigned_map = adapter.maps(torch.device("cpu"))
    assert codec.signed_map is signed_map and codec.unsigned_map is unsigned_map and codec.block_size == BLOCK_SIZE
    handle = adapter.open(case, torch.zeros(300), torch.device("cpu"))
    states = adapter.dequantized_states(handle)
    assert set(states) == {"exp_avg", "exp_avg_sq"} and all(s.dtype == torch.float64 and not s.any()
                                                            for s in states.values())
