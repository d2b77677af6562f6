"""The training loop (worker/training/loop.py) is what the training-impact comparison rests on: two
runs of one build and spec must be bit-identical (losses and per-step parameter digests), and the
one-ulp control and a different optimizer must not be. Tolerance: none — equality is the claim.

CPU here (CI); the CUDA variant runs on a GPU machine (skipped cleanly without one)."""

from __future__ import annotations

import pytest
import torch

from service.core.training import TrainingConfig, TrainingRunSpec
from worker.battery import OPTIMIZER_HYPER_DEFAULTS

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _spec(model: str, *, optimizer: str = "adam", steps: int = 40, perturb: bool = False, dtype: str = "float32",
          **hyper) -> TrainingRunSpec:
    config = TrainingConfig(optimizer=optimizer, param_dtype=dtype,
                            hyper={**OPTIMIZER_HYPER_DEFAULTS[optimizer], "weight_decay": 1e-2, **hyper})
    return TrainingRunSpec(model=model, config=config, seed=3, steps=steps, perturb_ulp=perturb)


def _train(spec: TrainingRunSpec, device: str):  # noqa: ANN202
    from worker.adapters.bundled import FAMILIES
    from worker.training.loop import train

    return train(spec, FAMILIES, torch.device(device))


def _two_runs_identical(device: str) -> None:
    for model in ("mlp", "transformer"):
        first, second = _train(_spec(model), device), _train(_spec(model), device)
        assert first.losses == second.losses and first.digests == second.digests, model
        assert len(set(first.digests)) == len(first.digests), "every step moves the parameters"
        # The model learns: the loss of the last steps is below the first step's.
        assert sum(first.losses[-5:]) / 5 < first.losses[0], (model, first.losses[0], first.losses[-5:])
        floor = _train(_spec(model, perturb=True), device)
        assert floor.losses[0] != first.losses[0] or floor.digests[0] != first.digests[0]
        assert all(a != b for a, b in zip(floor.digests, first.digests)), "one ulp everywhere differs at every step"


def test_two_training_runs_of_one_build_are_bit_identical_on_the_cpu(kernels) -> None:  # noqa: ANN001
    _two_runs_identical("cpu")


@cuda
def test_two_training_runs_of_one_build_are_bit_identical_on_cuda(kernels) -> None:  # noqa: ANN001
    _two_runs_identical("cuda")


def test_the_optimizer_is_one_instance_over_two_param_groups(kernels) -> None:  # noqa: ANN001
    """Weights get the configuration's weight decay, biases and norms none (the layout's two param
    groups), and the decay reaches the parameters from the first step."""
    from worker.training.loop import model_case
    from worker.training.models import MODELS

    case, slot_of = model_case(_spec("transformer"), MODELS["transformer"])
    assert [g.hyper["weight_decay"] for g in case.layout.groups] == [1e-2, 0.0]
    decayed = [t.name for t in MODELS["transformer"].tensors if t.decay]
    assert decayed[:2] == ["tok", "pos"] and "l0.ln1.g" not in decayed
    assert sorted(slot_of) == list(range(len(MODELS["transformer"].tensors)))
    with_decay = _train(_spec("mlp", steps=3, weight_decay=0.1, lr=0.1), "cpu")
    without = _train(_spec("mlp", steps=3, weight_decay=0.0, lr=0.1), "cpu")
    assert with_decay.losses[0] == without.losses[0]          # the same start and first batch
    assert with_decay.digests[0] != without.digests[0]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_low_precision_configuration_keeps_its_parameters_in_that_dtype(kernels, dtype: str) -> None:  # noqa: ANN001
    from worker.training.loop import initial_flat, model_case
    from worker.training.models import MODELS

    spec = _spec("mlp", dtype=dtype, steps=20)
    case, slot_of = model_case(spec, MODELS["mlp"])
    assert initial_flat(spec, MODELS["mlp"], case, slot_of, torch.device("cpu")).dtype == getattr(torch, dtype)
    first, second = _train(spec, "cpu"), _train(spec, "cpu")
    assert first.digests == second.digests and all(map(lambda x: x == x, first.losses))
