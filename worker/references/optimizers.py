"""Reference optimizers a kernel trajectory is measured against.

`make_reference(case, dtype, device, init)` gives an object with `.param` and `.step(step, grad)`.
With dtype float64 it is the float64 reference; with the parameter dtype it is the
same-precision reference (what torch would give you at that precision, states in that dtype).

* torch.optim where it has the algorithm, configured to the kernels' conventions (csrc/ops.cpp):
  adam -> AdamW (decoupled decay applied before the update, Loshchilov & Hutter Alg. 2),
  momentum -> SGD(momentum, dampening 0, coupled L2 decay), rmsprop -> RMSprop (not centred,
  coupled decay), adagrad -> Adagrad (lr_decay 0, initial accumulator 0, coupled decay).
* Written from the papers (torch.optim has neither): Lion and AdEMAMix, below.

Kernel conventions every reference reproduces:
* gnorm_scale multiplies the gradient before anything else uses it.
* skip_zeros (adam): an element whose gradient is exactly 0 is left untouched, parameter and states
  (weight decay included). torch.optim is elementwise, so running its step and restoring those
  elements afterwards is exactly that.
"""

from __future__ import annotations

import inspect

import torch

from service.core.results import CaseSpec


def torch_optim_class(optimizer: str, hyper: dict, *, foreach: bool = False) -> tuple[type, dict]:
    """The torch.optim class and keyword arguments of one param group that follow the kernels'
    conventions for `optimizer` at `hyper` (module docstring)."""
    h = hyper
    common = {"foreach": foreach, "lr": h["lr"], "weight_decay": h["weight_decay"]}
    if optimizer == "adam":
        return torch.optim.AdamW, {"betas": (h["beta1"], h["beta2"]), "eps": h["eps"], **common}
    if optimizer == "momentum":
        return torch.optim.SGD, {"momentum": h["momentum"], "dampening": 0.0, **common}
    if optimizer == "rmsprop":
        return torch.optim.RMSprop, {"alpha": h["alpha"], "eps": h["eps"], "momentum": 0.0, "centered": False,
                                     **common}
    if optimizer == "adagrad":
        return torch.optim.Adagrad, {"eps": h["eps"], "lr_decay": 0.0, "initial_accumulator_value": 0.0, **common}
    raise ValueError(f"torch.optim has no {optimizer!r}")


class TorchOptimReference:
    def __init__(self, case: CaseSpec, init: torch.Tensor):
        h = case.hyper
        self.param = torch.nn.Parameter(init.clone(), requires_grad=False)
        self.gnorm_scale = float(h["gnorm_scale"])
        self.skip_zeros = bool(h.get("skip_zeros", False))
        optim_class, kwargs = torch_optim_class(case.optimizer, h)
        self.optim = optim_class([self.param], **kwargs)
        # torch.optim's own step body without the wrappers around it (profiler record_function,
        # step hooks, grad-mode switching): the same computation, ~half the host time per call
        # (worker.engine.fast makes ~10^4 of them a battery). `step` below runs under no_grad,
        # which is the mode the grad-mode wrapper would set for a non-differentiable optimizer.
        self._step_body = inspect.unwrap(type(self.optim).step)

    @torch.no_grad()
    def step(self, step: int, grad: torch.Tensor) -> None:
        if self.gnorm_scale != 1.0:
            grad = grad * self.gnorm_scale
        skipped = (grad == 0) if self.skip_zeros else None
        if skipped is not None:
            before = [self.param.detach().clone()] + [t.clone() for t in self._state_tensors()]
        self.param.grad = grad
        self._step_body(self.optim)
        if skipped is not None:
            for saved, live in zip(before, [self.param.data] + self._state_tensors()):
                live[skipped] = saved[skipped]

    def _state_tensors(self) -> list[torch.Tensor]:
        state = self.optim.state.get(self.param, {})
        return [v for k, v in sorted(state.items()) if k != "step" and torch.is_tensor(v) and v.shape == self.param.shape]


class LionReference:
    """Lion, Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms" (arXiv:2302.06675),
    Algorithm 2 (with decoupled weight decay):
        c  = beta1*m + (1-beta1)*g
        p  = p - lr*(sign(c) + wd*p)        i.e. p*(1 - lr*wd) - lr*sign(c), decay from the old p
        m  = beta2*m + (1-beta2)*g
    sign(0) = 0.
    """

    def __init__(self, case: CaseSpec, init: torch.Tensor):
        h = case.hyper
        self.lr, self.beta1, self.beta2 = h["lr"], h["beta1"], h["beta2"]
        self.wd, self.gnorm_scale = h["weight_decay"], h["gnorm_scale"]
        self.param = init.clone()
        self.exp_avg = torch.zeros_like(init)

    @torch.no_grad()
    def step(self, step: int, grad: torch.Tensor) -> None:
        g = grad * self.gnorm_scale
        interpolated = self.beta1 * self.exp_avg + (1.0 - self.beta1) * g
        self.param = self.param * (1.0 - self.lr * self.wd) - self.lr * torch.sign(interpolated)
        self.exp_avg = self.beta2 * self.exp_avg + (1.0 - self.beta2) * g


class AdEMAMixReference:
    """AdEMAMix, Pagliardini, Ablin & Grangier 2024, "The AdEMAMix Optimizer: Better, Faster,
    Older" (arXiv:2409.03137), Algorithm 1 with constant alpha and beta3 (no warm-up schedulers):
        m1 = beta1*m1 + (1-beta1)*g          (fast EMA, bias-corrected)
        m2 = beta3*m2 + (1-beta3)*g          (slow EMA, not bias-corrected)
        nu = beta2*nu + (1-beta2)*g^2
        p  = p - lr*( (m1/(1-beta1^t) + alpha*m2) / (sqrt(nu/(1-beta2^t)) + eps) + wd*p )
    The decay term uses the previous p, so p = p*(1 - lr*wd) - lr*update.
    """

    def __init__(self, case: CaseSpec, init: torch.Tensor):
        h = case.hyper
        self.lr, self.beta1, self.beta2, self.beta3 = h["lr"], h["beta1"], h["beta2"], h["beta3"]
        self.alpha, self.eps, self.wd, self.gnorm_scale = h["alpha"], h["eps"], h["weight_decay"], h["gnorm_scale"]
        self.param = init.clone()
        self.exp_avg_fast = torch.zeros_like(init)
        self.exp_avg_slow = torch.zeros_like(init)
        self.exp_avg_sq = torch.zeros_like(init)

    @torch.no_grad()
    def step(self, step: int, grad: torch.Tensor) -> None:
        g = grad * self.gnorm_scale
        self.exp_avg_fast = self.beta1 * self.exp_avg_fast + (1.0 - self.beta1) * g
        self.exp_avg_slow = self.beta3 * self.exp_avg_slow + (1.0 - self.beta3) * g
        self.exp_avg_sq = self.beta2 * self.exp_avg_sq + (1.0 - self.beta2) * g * g
        fast_hat = self.exp_avg_fast / (1.0 - self.beta1 ** step)
        sq_hat = self.exp_avg_sq / (1.0 - self.beta2 ** step)
        update = (fast_hat + self.alpha * self.exp_avg_slow) / (torch.sqrt(sq_hat) + self.eps)
        self.param = self.param * (1.0 - self.lr * self.wd) - self.lr * update


_PAPER_REFERENCES = {"lion": LionReference, "ademamix": AdEMAMixReference}


class LayoutReference:
    """The reference of a layout case (several tensors in param groups under one optimizer).

    `.param` is the flat vector (the engines' layout, worker.engine.lifecycle.tensor_views); its
    guard elements are never stepped. Where torch.optim has the algorithm it is ONE torch.optim
    optimizer with the case's param groups over one parameter per tensor, each a view of the flat
    vector (torch.optim updates in place), so the reference is torch.optim as a model's training
    loop runs it. Lion and AdEMAMix are the papers' updates per tensor with their group's
    hyperparameters (elementwise, with no state shared between tensors: one object per tensor is
    the same algorithm). gnorm_scale and skip_zeros are applied per group, as the kernels do."""

    def __init__(self, case: CaseSpec, init: torch.Tensor, *, foreach: bool = False):
        self.slots = case.tensor_slots()
        self.param = init.clone()
        self.hyper = [case.group_hyper(slot.group) for slot in self.slots]
        self.paper = case.optimizer in _PAPER_REFERENCES
        if self.paper:
            self.parts = [_PAPER_REFERENCES[case.optimizer](case.tensor_case(slot), self.param[slot.offset:slot.stop])
                          for slot in self.slots]
            return
        self.params = [torch.nn.Parameter(self.param[slot.offset:slot.stop], requires_grad=False)
                       for slot in self.slots]
        groups = []
        for index in range(len(case.layout.groups) if case.layout is not None else 1):
            _, kwargs = torch_optim_class(case.optimizer, case.group_hyper(index), foreach=foreach)
            members = [p for slot, p in zip(self.slots, self.params) if slot.group == index]
            groups.append({"params": members, **kwargs})
        optim_class, defaults = torch_optim_class(case.optimizer, case.group_hyper(0), foreach=foreach)
        self.optim = optim_class(groups, **defaults)
        self._step_body = inspect.unwrap(type(self.optim).step)

    @torch.no_grad()
    def step(self, step: int, grad: torch.Tensor) -> None:
        grads = []
        for slot, hyper in zip(self.slots, self.hyper):
            g = grad[slot.offset:slot.stop]
            scale = float(hyper["gnorm_scale"])
            grads.append(g * scale if scale != 1.0 else g)
        if self.paper:
            for slot, part, g in zip(self.slots, self.parts, grads):
                part.step(step, g)
                self.param[slot.offset:slot.stop] = part.param
            return
        saved = []
        for index, (p, g, hyper) in enumerate(zip(self.params, grads, self.hyper)):
            if hyper.get("skip_zeros", False):
                skipped = g == 0
                state = self._state_tensors(p)
                saved.append((skipped, [p.detach().clone(), *(t.clone() for t in state)], [p.data, *state]))
            p.grad = g
        self._step_body(self.optim)
        for skipped, before, live in saved:
            for old, now in zip(before, live):
                now[skipped] = old[skipped]

    def _state_tensors(self, p: torch.Tensor) -> list[torch.Tensor]:
        state = self.optim.state.get(p, {})
        return [v for k, v in sorted(state.items()) if k != "step" and torch.is_tensor(v) and v.shape == p.shape]


def make_reference(case: CaseSpec, init: torch.Tensor):
    """A reference started from `init` (its dtype and device are the reference's)."""
    if case.layout is not None:
        return LayoutReference(case, init)
    if case.optimizer in _PAPER_REFERENCES:
        return _PAPER_REFERENCES[case.optimizer](case, init)
    return TorchOptimReference(case, init)
