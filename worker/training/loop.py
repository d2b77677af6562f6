"""One training run of a reference model through the library's optimizer (a kernel host's "train").

The model's tensors are views of one flat parameter vector laid out as a layout case lays them out
(CaseSpec.layout: aligned, guard elements between them), in two param groups: weights with the
configuration's weight decay, biases and norm gains without. The library's optimizer is opened
ONCE over every tensor through its family adapter's group lifecycle (open_group / step_group) and
stepped once per step, as a training loop steps it; so a defect in state shared across tensors
(step counters, bias-correction powers, chunking) acts on the model as it would in training.

Per step: the loss of the step's batch (float32, from the parameters upcast), its gradient (cast
to the parameters' dtype, what the optimizer receives in training), one optimizer step, and the
digest of the whole flat vector after it (od2, worker.engine.digest: the guards included, so a
write past a tensor's end shows). Losses and digests stay on the device until the run ends (one
synchronisation per run, not per step).

Determinism is what the comparison rests on: deterministic algorithms are on for the run (an op
without a deterministic implementation raises instead of drifting), cuBLAS gets the workspace
setting that makes it deterministic, and nothing depends on timing. Two runs of one build and
spec give the same losses and digests bit for bit (tests/worker/training/test_loop.py, on the CPU
and on CUDA).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping

import torch

from service.core.results import CaseSpec, ParamLayout, TensorGroupSpec
from service.core.training import TrainingRunAnswer, TrainingRunSpec
from worker.engine import lifecycle
from worker.engine.digest import digest_lanes, format_digest
from worker.training.data import DataOrder, init_generator
from worker.training.models import MODELS, ReferenceModel

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# cuBLAS is deterministic with a fixed workspace (CUDA's documentation, "Results reproducibility").
CUBLAS_DETERMINISTIC = ":4096:8"


def model_case(spec: TrainingRunSpec, model: ReferenceModel) -> tuple[CaseSpec, list[int]]:
    """The layout case of the model's tensors under the run's configuration, and for each model
    tensor (in model order) its slot index in the case (decayed group first)."""
    decayed = [i for i, t in enumerate(model.tensors) if t.decay]
    plain = [i for i, t in enumerate(model.tensors) if not t.decay]
    hyper = dict(spec.config.hyper)
    no_decay = {**hyper, "weight_decay": 0.0} if "weight_decay" in hyper else hyper
    groups = [TensorGroupSpec(sizes=[model.tensors[i].numel for i in decayed], hyper=hyper),
              TensorGroupSpec(sizes=[model.tensors[i].numel for i in plain], hyper=no_decay)]
    layout = ParamLayout(groups=groups)
    case = CaseSpec(case_id=f"train.{model.name}.{spec.config.optimizer}.s{spec.seed}", optimizer=spec.config.optimizer,
                    family=spec.config.family, param_dtype=spec.config.param_dtype, hyper=hyper, seed=spec.seed,
                    size=layout.flat_size, steps=spec.steps, layout=layout)
    slot_of = {tensor: slot for slot, tensor in enumerate(decayed + plain)}
    return case, [slot_of[i] for i in range(len(model.tensors))]


def initial_flat(spec: TrainingRunSpec, model: ReferenceModel, case: CaseSpec, slot_of: list[int],
                 device: torch.device) -> torch.Tensor:
    """The seed's initial parameters in the flat vector (guards zero), in the configuration's dtype;
    moved one ulp each (a seeded direction per element) for the floor control."""
    dtype = TORCH_DTYPES[spec.config.param_dtype]
    generator = init_generator(spec.seed)
    flat = torch.zeros(case.size, dtype=dtype)
    slots = case.tensor_slots()
    for tensor, slot_index in zip(model.tensors, slot_of):
        slot = slots[slot_index]
        flat[slot.offset:slot.stop] = tensor.initial(generator).flatten().to(dtype)
    if spec.perturb_ulp:
        up = torch.rand(case.size, generator=generator) < 0.5
        toward = torch.where(up, torch.tensor(float("inf"), dtype=dtype), torch.tensor(float("-inf"), dtype=dtype))
        moved = torch.nextafter(flat, toward)
        covered = torch.zeros(case.size, dtype=torch.bool)
        for slot in slots:
            covered[slot.offset:slot.stop] = True
        flat = torch.where(covered, moved, flat)
    return flat.to(device)


@contextlib.contextmanager
def deterministic():  # noqa: ANN201
    """Deterministic algorithms on for the run, as they were after it."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC)
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


def train(spec: TrainingRunSpec, families: Mapping[str, object], device: torch.device) -> TrainingRunAnswer:
    """Train the spec's model with the library's optimizer (families: the loaded adapter's family
    table); every step's loss and parameter digest."""
    started = time.perf_counter()
    model = MODELS[spec.model]
    case, slot_of = model_case(spec, model)
    family = lifecycle.family_for(families, case)
    flat = initial_flat(spec, model, case, slot_of, device)
    slots = case.tensor_slots()
    spans = [(slots[s].offset, slots[s].stop) for s in slot_of]          # model order
    slot_spans = [(slot.offset, slot.stop) for slot in slots]            # the optimizer's order
    views = [flat[start:stop] for start, stop in slot_spans]
    order = DataOrder(spec.seed, spec.steps, batch=model.batch, draw=model.draw)
    dtype = flat.dtype
    losses, lanes = [], []
    with deterministic():
        handle = lifecycle.open_group_case(family, case, views, device)
        try:
            for step in range(1, spec.steps + 1):
                master = flat.detach().to(torch.float32, copy=True).requires_grad_(True)
                params = {t.name: master[start:stop].view(t.shape) for t, (start, stop) in zip(model.tensors, spans)}
                loss = model.loss(params, order.step(step).to(device))
                loss.backward()
                grad = master.grad.to(dtype)
                family.step_group(handle, views, [grad[start:stop] for start, stop in slot_spans], step)
                losses.append(loss.detach())
                lanes.append(digest_lanes([flat]))
        finally:
            lifecycle.close_all([(family, handle)])
    loss_values = torch.stack(losses).double().cpu().tolist()
    digests = [format_digest(a, b) for a, b in torch.stack(lanes).cpu().tolist()]
    return TrainingRunAnswer(losses=loss_values, digests=digests, seconds=time.perf_counter() - started)
