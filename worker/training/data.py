"""The reference models' data: fixed datasets generated from fixed seeds, and each run seed's order.

Nothing is downloaded or kept in the repository: both datasets are generated here, on the CPU, from
constants, so every worker makes the same bytes (given its torch: the baseline cache keys on it).

* A token stream for the transformer: a Markov source over VOCAB tokens whose every token has a
  few likely successors (structure a small model learns within a few hundred steps: the loss
  falls from ln(VOCAB) toward the source's entropy). STREAM_TOKENS tokens.
* A classification set for the MLP: Gaussian inputs labelled by a fixed random teacher network.

The run seed fixes the data ORDER (which windows / which samples each step sees) and the model's
initialisation (models.py); the datasets are the same for every seed.
"""

from __future__ import annotations

from functools import lru_cache

import torch

VOCAB = 64
STREAM_TOKENS = 1 << 16
SUCCESSORS = 4
STREAM_SEED = 20_460          # fixed: the corpus is part of the model set's definition
MLP_INPUTS, MLP_CLASSES, MLP_SAMPLES = 16, 8, 4096
MLP_DATA_SEED = 20_461


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


@lru_cache(maxsize=1)
def token_stream() -> torch.Tensor:
    """STREAM_TOKENS int64 tokens of the Markov source (CPU; made once per process)."""
    g = _generator(STREAM_SEED)
    contexts = VOCAB
    successors = torch.randint(0, VOCAB, (contexts, SUCCESSORS), generator=g)
    # Skewed weights: each token's successors unequally likely (entropy well below ln(SUCCESSORS)).
    weights = torch.rand(contexts, SUCCESSORS, generator=g, dtype=torch.float64) ** 3
    cumulative = (weights / weights.sum(dim=1, keepdim=True)).cumsum(dim=1).tolist()
    chosen = torch.rand(STREAM_TOKENS, generator=g, dtype=torch.float64).tolist()
    table = successors.tolist()
    tokens = [0, 1]
    for u in chosen[2:]:
        row = tokens[-1]
        bounds = cumulative[row]
        pick = next((i for i, bound in enumerate(bounds) if u < bound), SUCCESSORS - 1)
        tokens.append(table[row][pick])
    return torch.tensor(tokens, dtype=torch.int64)


@lru_cache(maxsize=1)
def classification_set() -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs [MLP_SAMPLES, MLP_INPUTS] float32, labels [MLP_SAMPLES] int64), CPU, made once."""
    g = _generator(MLP_DATA_SEED)
    inputs = torch.randn(MLP_SAMPLES, MLP_INPUTS, generator=g)
    hidden = torch.randn(MLP_INPUTS, 32, generator=g) / MLP_INPUTS ** 0.5
    readout = torch.randn(32, MLP_CLASSES, generator=g)
    labels = (torch.tanh(inputs @ hidden * 2.0) @ readout).argmax(dim=1)
    return inputs, labels


class DataOrder:
    """One run seed's batches: step s (1-based) always gets the same batch for the same seed,
    whatever the optimizer does (the order is drawn up front, never from the model's state)."""

    def __init__(self, seed: int, steps: int, *, batch: int, draw: int) -> None:
        # Seeds of the order and of the initialisation are apart: seed k's order is not seed k+1's init.
        g = _generator(2 * seed + 1)
        self.indices = torch.randint(0, draw, (steps, batch), generator=g)

    def step(self, step: int) -> torch.Tensor:
        return self.indices[step - 1]


def init_generator(seed: int) -> torch.Generator:
    """The generator a run seed's initial parameters are drawn from (models.py)."""
    return _generator(2 * seed)
