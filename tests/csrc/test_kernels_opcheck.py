"""torch.library.opcheck on every bundled 32-bit op, every parameter dtype: the schema's in-place
annotations match what the kernels do, the fake (meta) implementations registered by
worker.adapters.bundled_ops.load_build agree with the real kernels, and the ops trace under AOT dispatch."""

from __future__ import annotations

import pytest
import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
N = 4097  # not a multiple of the CUDA vector width: the tail path is checked too


def sample_args(op_name, dtype, device):
    generator = torch.Generator().manual_seed(0)
    param = torch.randn(N, generator=generator).to(dtype).to(device)
    grad = torch.randn(N, generator=generator).to(dtype).to(device)
    state = lambda: torch.rand(N, generator=generator).to(device)  # noqa: E731  (>= 0: valid v)
    return {
        "adam_step": (param, grad, state(), state(), 3, 1e-1, 0.9, 0.999, 1e-8, 1e-1, 0.5, True),
        "ademamix_step": (param, grad, state(), state(), state(), 3, 1e-1, 0.9, 0.999, 0.9999,
                          5.0, 1e-8, 1e-1, 0.5),
        "lion_step": (param, grad, state(), 1e-1, 0.9, 0.99, 1e-1, 0.5),
        "momentum_step": (param, grad, state(), 3, 1e-1, 0.9, 1e-1, 0.5),
        "rmsprop_step": (param, grad, state(), 1e-1, 0.99, 1e-8, 1e-1, 0.5),
        "adagrad_step": (param, grad, state(), 1e-1, 1e-10, 1e-1, 0.5),
    }[op_name]


OPS = ["adam_step", "ademamix_step", "lion_step", "momentum_step", "rmsprop_step",
       "adagrad_step"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("op_name", OPS)
def test_opcheck(kernels, op_name, dtype, device):
    op = getattr(torch.ops.optdrift, op_name).default
    torch.library.opcheck(op, sample_args(op_name, dtype, device))


def test_every_schema_op_is_checked(kernels):
    # A new 32-bit op in csrc/ops.cpp must join this test (the 8-bit ops have their own).
    # (The multi-tensor ops have theirs in tests/csrc/test_kernels_multi_opcheck.py.)
    declared = {name for name in dir(torch.ops.optdrift)
                if name.endswith("_step") and "8bit" not in name and not name.endswith("_multi_step")}
    assert declared == set(OPS)
    assert set(kernels.OPTIMIZER_STATES) == {name.removesuffix("_step") for name in OPS}
