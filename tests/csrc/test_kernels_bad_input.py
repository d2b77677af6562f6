"""Bad calls into the bundled kernels fail with an error naming the bad argument (TORCH_CHECK in
csrc/checks.h), never a silent wrong result or a crash."""

from __future__ import annotations

import pytest
import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
N = 8
# Made on the test's device: Tensor.to() turns a strided view into a contiguous copy, so a
# non-contiguous CPU tensor moved to CUDA would no longer be non-contiguous.
NON_CONTIGUOUS = object()


def adam_call(kernels, device, **overrides):
    """Calls optdrift::adam_step with valid arguments except the overridden ones."""
    tensors = {
        "param": torch.zeros(N, device=device), "grad": torch.ones(N, device=device),
        "exp_avg": torch.zeros(N, device=device), "exp_avg_sq": torch.zeros(N, device=device),
    }
    scalars = {"step": 1, "lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
               "weight_decay": 0.0, "gnorm_scale": 1.0}
    for name, value in overrides.items():
        (tensors if name in tensors else scalars)[name] = value
    torch.ops.optdrift.adam_step(
        tensors["param"], tensors["grad"], tensors["exp_avg"], tensors["exp_avg_sq"],
        scalars["step"], scalars["lr"], scalars["beta1"], scalars["beta2"], scalars["eps"],
        scalars["weight_decay"], scalars["gnorm_scale"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"param": torch.zeros(N, dtype=torch.float64)}, "'param'"),
        ({"param": torch.zeros(N, dtype=torch.int32)}, "'param'"),
        ({"grad": torch.ones(N, dtype=torch.float16)}, "'grad'"),
        ({"exp_avg": torch.zeros(N, dtype=torch.float16)}, "'exp_avg'"),
        ({"exp_avg_sq": torch.zeros(N, dtype=torch.bfloat16)}, "'exp_avg_sq'"),
        ({"grad": torch.ones(N + 1)}, "'grad'"),
        ({"exp_avg": torch.zeros(N - 1)}, "'exp_avg'"),
        ({"exp_avg_sq": NON_CONTIGUOUS}, "'exp_avg_sq'"),
        ({"param": NON_CONTIGUOUS}, "'param'"),
        ({"lr": -1e-3}, "'lr'"),
        ({"lr": float("nan")}, "'lr'"),
        ({"beta1": 1.0}, "'beta1'"),
        ({"beta1": -0.1}, "'beta1'"),
        ({"beta2": 1.5}, "'beta2'"),
        ({"eps": 0.0}, "'eps'"),
        ({"eps": -1e-8}, "'eps'"),
        ({"weight_decay": -0.1}, "'weight_decay'"),
        ({"step": 0}, "'step'"),
        ({"gnorm_scale": -1.0}, "'gnorm_scale'"),
    ],
    ids=lambda value: None if isinstance(value, dict) else value.strip("'"),
)
def test_adam_rejects(kernels, device, overrides, named):
    overrides = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                 for k, v in overrides.items()}
    overrides = {k: torch.zeros(2 * N, device=device)[::2] if v is NON_CONTIGUOUS else v
                 for k, v in overrides.items()}
    with pytest.raises(RuntimeError, match=named) as error:
        adam_call(kernels, device, **overrides)
    assert "optdrift::adam_step" in str(error.value)


@pytest.mark.parametrize("device", DEVICES)
def test_rejected_call_changes_nothing(kernels, device):
    param = torch.ones(N, device=device)
    with pytest.raises(RuntimeError, match="'eps'"):
        adam_call(kernels, device, param=param, eps=0.0)
    assert torch.equal(param, torch.ones(N, device=device))


# One representative bad hyperparameter per remaining op, so each op's checks are wired up.
OTHER_OPS = {
    "ademamix_step": (lambda p, g, s: (p, g, s(), s(), s(), 1, 1e-3, 0.9, 0.999, 0.9999, 5.0,
                                        1e-8, 0.0), {10: -1.0}, "'alpha'"),
    "lion_step": (lambda p, g, s: (p, g, s(), 1e-3, 0.9, 0.99, 0.0), {5: 1.0}, "'beta2'"),
    "momentum_step": (lambda p, g, s: (p, g, s(), 1, 1e-3, 0.9, 0.0), {5: 1.0}, "'momentum'"),
    "rmsprop_step": (lambda p, g, s: (p, g, s(), 1e-3, 0.99, 1e-8, 0.0), {4: 1.0}, "'alpha'"),
    "adagrad_step": (lambda p, g, s: (p, g, s(), 1e-3, 1e-10, 0.0), {4: 0.0}, "'eps'"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op_name", list(OTHER_OPS))
def test_other_ops_reject(kernels, op_name, device):
    build_args, bad, named = OTHER_OPS[op_name]
    op = getattr(torch.ops.optdrift, op_name)
    make_state = lambda: torch.zeros(N, device=device)  # noqa: E731
    args = list(build_args(torch.zeros(N, device=device), torch.ones(N, device=device),
                           make_state))
    op(*args)  # the valid call works
    for index, value in bad.items():
        args[index] = value
    with pytest.raises(RuntimeError, match=named):
        op(*args)
    # and a state of the wrong dtype is named too
    args = list(build_args(torch.zeros(N, device=device), torch.ones(N, device=device),
                           lambda: torch.zeros(N, device=device, dtype=torch.float16)))
    with pytest.raises(RuntimeError, match="state argument"):
        op(*args)


def test_ademamix_alpha_above_one_is_valid(kernels):
    # AdEMAMix's alpha is a mixing weight (5-10 in the paper), not an averaging coefficient.
    s = lambda: torch.zeros(N)  # noqa: E731
    torch.ops.optdrift.ademamix_step(torch.zeros(N), torch.ones(N), s(), s(), s(), 1, 1e-3, 0.9,
                                     0.999, 0.9999, 8.0, 1e-8, 0.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("moved", ["grad", "exp_avg", "param"])
def test_mixed_devices_name_the_argument(kernels, moved):
    overrides = {moved: torch.zeros(N, device="cpu")}
    base = "cuda"
    with pytest.raises(RuntimeError, match="'grad'|'exp_avg'|'param'") as error:
        adam_call(kernels, base, **overrides)
    assert "device" in str(error.value) or "on cpu" in str(error.value)


def test_meta_device_mismatch_named_by_fake(kernels):
    # Without a GPU, a meta tensor is the other device at hand: the fake implementation
    # (registered by load_build) runs and must name the argument too.
    with pytest.raises(RuntimeError, match="'grad'"):
        adam_call(kernels, "cpu", grad=torch.ones(N, device="meta"))
