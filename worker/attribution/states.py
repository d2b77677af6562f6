"""The optimizer state beside the parameters: where a changed case's divergence begins in the state.

A low-bit state is codes and scales (worker.engine.digest.plain_tensors reads any state as its
plain leaves: "exp_avg.codes", "exp_avg.scale", ...). Per step, the commit's and the baseline's
leaves are compared each in its own units:
  * integer leaves (codes): by how many codes an element moved (one code is the code's own ulp)
    and what fraction of the codes moved;
  * floating-point leaves (scales, float32 states): in ulps of the leaf's own dtype at its scale,
    the largest |value| the leaf has held so far, any element (worker/attribution/ulps.py). The
    leaf's, not the element's: a state is a sum of terms that can cancel (momentum's g + wd·p,
    Adagrad's sum from near-zero gradients), and a rounding of a term moves such an element by one
    ulp of the term, hundreds of its own (measured on CUDA with nvcc --fmad=true: 15-325 of the
    element's own ulps at step 1, docs/ENVIRONMENTS.md). A change of the state's rule moves
    elements by a fraction of their value, far beyond the leaf's ulps still (lr folded into the
    momentum buffer: ~1e7 of them);
  * the layout (leaf names, dtypes, sizes): a block size change gives another number of scales.

A rounding of the state's float arithmetic (a reordering before requantization) moves a code only
where the float value lands within one rounding of a midpoint between codes: by one code, at a
fraction of the elements of the order of u x (codes per unit) (2**-24 x 255 ~ 1.5e-5). So a
quantization event is rounding-level while no code moves by more than one and at most
ROUNDING_CODE_FRACTION of them move; more is the quantizer itself (rounding mode, map, absmax).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from worker.attribution.ulps import ulp

# 1 % of the codes: about 600 times the fraction one float32 rounding before requantization moves.
ROUNDING_CODE_FRACTION = 0.01
_FLOAT_DTYPES = {"float32", "float16", "bfloat16"}


@dataclass
class StepComparison:
    """One step: the layout, the codes and the floating-point leaves, commit against baseline."""

    same_layout: bool
    codes_differ: bool = False
    code_steps: int = 0              # the most codes any element moved
    code_fraction: float = 0.0       # the fraction of all codes that moved
    float_ulps: float = 0.0          # the largest floating-point leaf change, its own ulps of its scale
    differing: list[str] = field(default_factory=list)


def _layout(leaves: dict[str, np.ndarray]) -> list[tuple[str, str, int]]:
    return [(name, str(values.dtype), int(values.size)) for name, values in leaves.items()]


def compare(commit: list[dict[str, np.ndarray]], baseline: list[dict[str, np.ndarray]],
            dtypes: dict[str, str] | None = None) -> list[StepComparison]:
    """Per step (commit[t], baseline[t]: leaf name -> values), the comparison. `dtypes` names the
    torch dtype of a floating-point leaf held as float32 (bfloat16, float16); float32 otherwise."""
    dtypes = dtypes or {}
    scales: dict[str, float] = {}
    out = []
    for c_leaves, b_leaves in zip(commit, baseline):
        if _layout(c_leaves) != _layout(b_leaves):
            out.append(StepComparison(same_layout=False, differing=sorted(set(c_leaves) ^ set(b_leaves))
                                      or [n for n in c_leaves if c_leaves[n].size != b_leaves[n].size]))
            continue
        step = StepComparison(same_layout=True)
        moved = total = 0
        for name, c in c_leaves.items():
            b = b_leaves[name]
            if np.issubdtype(c.dtype, np.integer) or c.dtype == np.bool_:
                steps = np.abs(c.astype(np.int64) - b.astype(np.int64))
                moved += int(np.count_nonzero(steps))
                total += steps.size
                if steps.size and steps.max() > 0:
                    step.codes_differ = True
                    step.code_steps = max(step.code_steps, int(steps.max()))
                    step.differing.append(name)
                continue
            dtype = dtypes.get(name, "float32")
            if dtype not in _FLOAT_DTYPES:
                dtype = "float32"
            b64, c64 = b.astype(np.float64).reshape(-1), c.astype(np.float64).reshape(-1)
            finite = np.nan_to_num(np.abs(b64), nan=0.0, posinf=0.0)
            running = scales[name] = max(scales.get(name, 0.0), float(finite.max()) if finite.size else 0.0)
            with np.errstate(invalid="ignore"):
                change = np.abs(c64 - b64) / ulp(np.array([running]), dtype)[0]
            peak = float(np.nanmax(change)) if change.size else 0.0
            if not np.isfinite(c64).all() or not np.isfinite(b64).all():
                peak = float("inf") if not np.array_equal(c64, b64, equal_nan=True) else peak
            if peak > 0:
                step.differing.append(name)
            step.float_ulps = max(step.float_ulps, peak)
        step.code_fraction = moved / total if total else 0.0
        out.append(step)
    return out


def quantization_event_is_rounding(step: StepComparison) -> bool:
    """Codes moved as one rounding before requantization moves them (module doc)."""
    return step.same_layout and step.code_steps <= 1 and step.code_fraction <= ROUNDING_CODE_FRACTION


def states_of(named: list[tuple[str, object]]) -> dict[str, np.ndarray]:
    """A step's state leaves (name, plain torch tensor) as numpy arrays; floating-point leaves as
    float32 (exact for float16 / bfloat16), integer leaves as they are."""
    out = {}
    for name, tensor in named:
        values = tensor.detach().cpu()
        out[name] = values.float().numpy().reshape(-1) if values.is_floating_point() else values.numpy().reshape(-1)
    return out
