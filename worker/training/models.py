"""The reference models, as functions of their parameter tensors.

A model here is a list of named tensors (shape, param group, initialisation) and a loss computed
from them: no nn.Module, because the parameters are views of ONE flat vector that the library's
optimizer steps in place (loop.py), exactly as a layout case lays tensors out (CaseSpec.layout).
Weights (2-D) are in the decayed group; biases and norm gains in the group without weight decay,
as training code (nanoGPT, the Hugging Face trainers) splits them.

Everything a forward pass computes is float32, from the parameters upcast (a bfloat16 or float16
configuration keeps its parameters and gradients in that dtype: the optimizer's case, not a mixed-
precision recipe). Attention is written out (matmul, mask, softmax) rather than a fused kernel so
that its backward is deterministic on every device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from worker.training import data


@dataclass(frozen=True)
class TensorDef:
    name: str
    shape: tuple[int, ...]
    decay: bool
    std: float = 0.0          # normal(0, std) when > 0
    fill: float = 0.0         # else this constant (1.0 for norm gains)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def initial(self, generator: torch.Generator) -> torch.Tensor:
        if self.std > 0:
            return torch.randn(self.shape, generator=generator) * self.std
        return torch.full(self.shape, self.fill)


@dataclass(frozen=True)
class ReferenceModel:
    name: str
    tensors: tuple[TensorDef, ...]
    batch: int
    draw: int                 # batch indices are drawn from range(draw)
    loss_fn: Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor]

    def loss(self, params: dict[str, torch.Tensor], indices: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(params, indices)

    @property
    def parameters(self) -> int:
        return sum(t.numel for t in self.tensors)


# ---- the MLP: 16 -> 64 -> 64 -> 8 classes, GELU, on the teacher's labels
_MLP_WIDTHS = (data.MLP_INPUTS, 64, 64, data.MLP_CLASSES)


def _mlp_tensors() -> tuple[TensorDef, ...]:
    tensors = []
    for layer, (fan_in, fan_out) in enumerate(zip(_MLP_WIDTHS, _MLP_WIDTHS[1:])):
        tensors.append(TensorDef(f"w{layer}", (fan_out, fan_in), decay=True, std=fan_in ** -0.5))
        tensors.append(TensorDef(f"b{layer}", (fan_out,), decay=False))
    return tuple(tensors)


def _mlp_loss(params: dict[str, torch.Tensor], indices: torch.Tensor) -> torch.Tensor:
    inputs, labels = _device_data("mlp", indices.device)
    x = inputs[indices]
    layers = len(_MLP_WIDTHS) - 1
    for layer in range(layers):
        x = F.linear(x, params[f"w{layer}"], params[f"b{layer}"])
        if layer < layers - 1:
            x = F.gelu(x)
    return F.cross_entropy(x, labels[indices])


# ---- the transformer: decoder-only, 2 layers, width 32, 2 heads, context 32, tied embeddings
D_MODEL, HEADS, LAYERS, CONTEXT = 32, 2, 2, 32


def _transformer_tensors() -> tuple[TensorDef, ...]:
    std = 0.02
    tensors = [TensorDef("tok", (data.VOCAB, D_MODEL), decay=True, std=std),
               TensorDef("pos", (CONTEXT, D_MODEL), decay=True, std=std)]
    for layer in range(LAYERS):
        p = f"l{layer}."
        tensors += [
            TensorDef(p + "ln1.g", (D_MODEL,), decay=False, fill=1.0),
            TensorDef(p + "ln1.b", (D_MODEL,), decay=False),
            TensorDef(p + "qkv", (3 * D_MODEL, D_MODEL), decay=True, std=std),
            # Residual projections scaled down by depth (GPT-2's initialisation).
            TensorDef(p + "proj", (D_MODEL, D_MODEL), decay=True, std=std / math.sqrt(2 * LAYERS)),
            TensorDef(p + "ln2.g", (D_MODEL,), decay=False, fill=1.0),
            TensorDef(p + "ln2.b", (D_MODEL,), decay=False),
            TensorDef(p + "fc", (4 * D_MODEL, D_MODEL), decay=True, std=std),
            TensorDef(p + "fc.b", (4 * D_MODEL,), decay=False),
            TensorDef(p + "out", (D_MODEL, 4 * D_MODEL), decay=True, std=std / math.sqrt(2 * LAYERS)),
            TensorDef(p + "out.b", (D_MODEL,), decay=False),
        ]
    tensors += [TensorDef("lnf.g", (D_MODEL,), decay=False, fill=1.0), TensorDef("lnf.b", (D_MODEL,), decay=False)]
    return tuple(tensors)


def _transformer_loss(params: dict[str, torch.Tensor], indices: torch.Tensor) -> torch.Tensor:
    stream = _device_data("transformer", indices.device)[0]
    window = indices.unsqueeze(1) + torch.arange(CONTEXT + 1, device=indices.device)
    tokens = stream[window]
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    batch, length = inputs.shape
    x = params["tok"][inputs] + params["pos"][:length]
    mask = torch.ones(length, length, dtype=torch.bool, device=indices.device).triu(1)
    head = D_MODEL // HEADS
    for layer in range(LAYERS):
        p = f"l{layer}."
        h = F.layer_norm(x, (D_MODEL,), params[p + "ln1.g"], params[p + "ln1.b"])
        q, k, v = F.linear(h, params[p + "qkv"]).split(D_MODEL, dim=-1)
        q, k, v = (t.view(batch, length, HEADS, head).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(head)
        attention = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
        y = (attention @ v).transpose(1, 2).reshape(batch, length, D_MODEL)
        x = x + F.linear(y, params[p + "proj"])
        h = F.layer_norm(x, (D_MODEL,), params[p + "ln2.g"], params[p + "ln2.b"])
        x = x + F.linear(F.gelu(F.linear(h, params[p + "fc"], params[p + "fc.b"])), params[p + "out"],
                         params[p + "out.b"])
    x = F.layer_norm(x, (D_MODEL,), params["lnf.g"], params["lnf.b"])
    logits = x @ params["tok"].t()
    return F.cross_entropy(logits.reshape(-1, data.VOCAB), targets.reshape(-1))


_device_cache: dict[tuple[str, str], tuple[torch.Tensor, ...]] = {}


def _device_data(model: str, device: torch.device) -> tuple[torch.Tensor, ...]:
    key = (model, str(device))
    if key not in _device_cache:
        made = (data.token_stream(),) if model == "transformer" else data.classification_set()
        _device_cache[key] = tuple(t.to(device) for t in made)
    return _device_cache[key]


MODELS: dict[str, ReferenceModel] = {
    "mlp": ReferenceModel("mlp", _mlp_tensors(), batch=64, draw=data.MLP_SAMPLES, loss_fn=_mlp_loss),
    "transformer": ReferenceModel("transformer", _transformer_tensors(), batch=16,
                                  draw=data.STREAM_TOKENS - CONTEXT - 1, loss_fn=_transformer_loss),
}
