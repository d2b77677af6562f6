"""torch.library.opcheck on every multi-tensor op (csrc/multi_tensor.h; issue 45), every parameter
dtype: the schema's in-place annotations on the lists and the shared-state tensors match what the
kernels do, and the fakes registered by worker.adapters.bundled_ops.load_build agree with them."""

from __future__ import annotations

import pytest
import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = (1, 4097, 130)  # one element, a vector tail, and a tensor of group 1
GROUP_OF = [0, 0, 1]
HYPER = {"adam": (0.9, 0.999, 1e-8), "ademamix": (0.9, 0.999, 0.9999, 5.0, 1e-8), "lion": (0.9, 0.99),
         "momentum": (0.9,), "rmsprop": (0.99, 1e-8), "adagrad": (1e-10,)}
STATES = {"adam": 2, "ademamix": 3, "lion": 1, "momentum": 1, "rmsprop": 1, "adagrad": 1}


def sample_args(optimizer, dtype, device):
    generator = torch.Generator().manual_seed(0)
    tensors = lambda: [torch.randn(n, generator=generator).to(dtype).to(device) for n in SIZES]  # noqa: E731
    states = lambda: [torch.rand(n, generator=generator).to(device) for n in SIZES]  # noqa: E731 (>= 0)
    args = [tensors(), tensors(), *(states() for _ in range(STATES[optimizer])), torch.tensor([2, 2, 5])]
    if optimizer in ("adam", "ademamix"):
        args.append(torch.tensor([[2.0, 0.81, 0.998], [0.0, 0.0, 0.0]]))
    args.append(GROUP_OF)
    args.append([1e-1, 1e-2])  # lr
    args += [[value, value] for value in HYPER[optimizer]]
    args += [[1e-1, 0.0], [0.5, 1.0]]  # weight_decay, gnorm_scale
    if optimizer == "adam":
        args.append([True, False])  # skip_zeros
    return tuple(args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("optimizer", list(STATES))
def test_opcheck(kernels, optimizer, dtype, device):
    op = getattr(torch.ops.optdrift, f"{optimizer}_multi_step").default
    torch.library.opcheck(op, sample_args(optimizer, dtype, device))


def test_every_multi_tensor_op_is_checked(kernels):
    declared = {name for name in dir(torch.ops.optdrift) if name.endswith("_multi_step")}
    assert declared == {f"{optimizer}_multi_step" for optimizer in STATES} == {
        f"{optimizer}_multi_step" for optimizer in kernels.OPTIMIZER_STATES}
