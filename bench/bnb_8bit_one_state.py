"""One step of bitsandbytes' 8-bit blockwise RMSprop and Adagrad (Adam as a control), element by
element: is the adapter or bitsandbytes' kernel responsible for a distance to float64?

    python bench/bnb_8bit_one_state.py [--device cuda] [--sizes 256 4097] [--show 4]
    python bench/bnb_8bit_one_state.py --battery-models   # no bitsandbytes needed

For each optimizer, hyperparameter point and size, one step from a zero state on the battery's
own inputs (initial_parameters and the open-loop gradient of seed 0, as the standard battery's
1-step cases use), run three ways on `--device`:

* `adapter`: worker.adapters.bitsandbytes' 8-bit family (what optdrift measures);
* `class`:   bitsandbytes' own optimizer class (bnb.optim.RMSprop8bit / Adagrad8bit / Adam8bit,
             min_8bit_size=0 so that every size takes the 8-bit blockwise path);
* `ref64`:   the engine's float64 reference (worker.references.optimizers: torch.optim).

and two float64 models of the 1-state update from a zero state, which differ only in the
numerator of the parameter update (s1 = (1 - alpha) d^2 for RMSprop, d^2 for Adagrad, with
d = g + wd p the coupled-decay gradient in both):

* `model_d`: p - lr d / (sqrt(s1) + eps)   (torch.optim; bnb's CPU backend),
* `model_g`: p - lr g / (sqrt(s1) + eps)   (the raw gradient in the numerator, as the parameter
             update of bnb's CUDA kOptimizerStatic8bit1StateBlockwise reads it; docs/BITSANDBYTES.md),
(with gnorm_scale s: d = s g + wd p, and model_g's numerator is the unscaled g).

Per row, the first elements and the worst ones (largest |adapter - ref64|) with p0, g, the state
after the step (dequantized: qmap[code] * absmax of its block), and the four p1. The summary line
of each row says which of them the adapter matches. `adapter == class` to the bit means the
adapter drives bitsandbytes exactly as its own optimizer does, so any distance is bitsandbytes'.

`--battery-models` evaluates both models, in float32 as the kernels compute, on the standard
battery's own float32 1-step 8-bit RMSprop/Adagrad cases at the typical and discriminating points
and prints max |model - ref64| per optimizer and point: the figures an H200 table shows for those
cases if the kernel computes that model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from service.core.results import GradientStreamSpec  # noqa: E402
from worker.adapters import get_adapter  # noqa: E402
from worker.battery import OPTIMIZER_HYPER_DEFAULTS, make_case  # noqa: E402
from worker.engine.gradients import GradientStream, initial_parameters  # noqa: E402
from worker.references.optimizers import make_reference  # noqa: E402

# (lr, weight_decay, gnorm_scale): the standard battery's typical and discriminating points; a
# decay-free control at the discriminating lr, where the two models coincide; and gnorm_scale 0.5
# without decay, where they differ again if the kernel's numerator is the unscaled gradient
# (model_g then moves twice as far as torch.optim). bnb's classes always pass gnorm_scale 1, so
# that row has no `class` column.
POINTS = {"typical": (1e-3, 1e-2, 1.0), "discriminating": (0.1, 0.1, 1.0), "no-decay": (0.1, 0.0, 1.0),
          "gnorm-0.5": (0.1, 0.0, 0.5)}
OPTIMIZERS = ("rmsprop", "adagrad", "adam")
BLOCK = 256


def _class_step(bnb, case, p0: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """One step through bitsandbytes' own 8-bit optimizer class; (p1, its state dict)."""
    h = case.hyper
    param = torch.nn.Parameter(p0.clone())
    param.grad = g.clone()
    if case.optimizer == "rmsprop":
        optim = bnb.optim.RMSprop8bit([param], lr=h["lr"], alpha=h["alpha"], eps=h["eps"],
                                      weight_decay=h["weight_decay"], min_8bit_size=0)
    elif case.optimizer == "adagrad":
        optim = bnb.optim.Adagrad8bit([param], lr=h["lr"], eps=h["eps"], weight_decay=h["weight_decay"],
                                      min_8bit_size=0)
    else:
        optim = bnb.optim.Adam8bit([param], lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                                   weight_decay=h["weight_decay"], min_8bit_size=0)
    optim.step()
    state = optim.state[param]
    if state["state1"].dtype != torch.uint8:
        raise RuntimeError(f"bnb's {type(optim).__name__} took the 32-bit path for {case.size} elements")
    return param.detach(), state


def _dequantize(codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """Blockwise dequantization, written here so that it does not depend on bnb's own."""
    values = qmap[codes.long()].to(torch.float64)
    scale = absmax.to(torch.float64).repeat_interleave(BLOCK)[: codes.numel()]
    return values * scale


def _models(case, p0: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(model_d, model_g) in float64 for one 1-state step from zero (see the module docstring)."""
    h = case.hyper
    p, g = p0.to(torch.float64), g.to(torch.float64)
    d = h["gnorm_scale"] * g + h["weight_decay"] * p
    s1 = (1 - h["alpha"]) * d * d if case.optimizer == "rmsprop" else d * d
    denominator = s1.sqrt() + h["eps"]
    return p - h["lr"] * d / denominator, p - h["lr"] * g / denominator


def run_row(bnb, adapter, device: torch.device, optimizer: str, point: str, size: int, show: int) -> dict:
    lr, wd, gnorm_scale = POINTS[point]
    hyper = {**OPTIMIZER_HYPER_DEFAULTS[optimizer], "lr": lr, "weight_decay": wd, "gnorm_scale": gnorm_scale}
    case = make_case(optimizer=optimizer, family="8bit_blockwise", param_dtype="float32", hyper=hyper,
                     gradient=GradientStreamSpec(kind="open"), seed=0, size=size, steps=1)
    p0 = initial_parameters(case.seed, size).to(torch.float32).to(device)
    stream = GradientStream(case.gradient, seed=case.seed, size=size, device=device, grad_dtype=torch.float32)
    g = stream.kernel_gradient(1, p0)

    family = adapter.families()["8bit_blockwise"]
    p_adapter = p0.clone()
    states = family.init_states(case, p_adapter)
    family.step_states(case, p_adapter, g.clone(), states, 1)
    with_class = gnorm_scale == 1.0  # bnb's classes pass gnorm_scale 1 only
    if with_class:
        p_class, class_state = _class_step(bnb, case, p0, g)

    reference = make_reference(case, p0.to(torch.float64).cpu())
    reference.step(1, stream.reference_gradient(1, reference.param).cpu())
    ref64 = reference.param.detach()

    signed_map = family.maps(p0.device)[0].cpu()
    s1_adapter = _dequantize(states["state1"].cpu(), states["absmax1"].cpu(), signed_map)
    cpu = lambda t: t.detach().to(torch.float64).cpu()  # noqa: E731
    p0c, gc, pa = cpu(p0), cpu(g), cpu(p_adapter)
    columns = {"p0": p0c, "g": gc, "s1 (adapter)": s1_adapter, "p1 adapter": pa}
    summary = {"optimizer": optimizer, "point": point, "size": size, "lr": lr, "wd": wd, "gnorm": gnorm_scale}
    if with_class:
        pc = cpu(p_class)
        s1_class = _dequantize(class_state["state1"].cpu(), class_state["absmax1"].cpu(), class_state["qmap1"].cpu())
        columns["p1 class"] = pc
        summary.update({"adapter-class": (pa - pc).abs().max().item(),
                        "state adapter-class": (s1_adapter - s1_class).abs().max().item(),
                        "class-ref64": (pc - ref64).abs().max().item()})
    columns["p1 ref64"] = ref64
    summary["adapter-ref64"] = (pa - ref64).abs().max().item()
    if optimizer in ("rmsprop", "adagrad"):
        model_d, model_g = _models(case, p0c, gc)
        columns["model_d"], columns["model_g"] = model_d, model_g
        summary["adapter-model_d"] = (pa - model_d).abs().max().item()
        summary["adapter-model_g"] = (pa - model_g).abs().max().item()
        summary["ref64-model_d"] = (ref64 - model_d).abs().max().item()

    worst = torch.argsort((pa - ref64).abs(), descending=True)[:show].tolist()
    first = list(range(min(show, size)))
    print(f"\n== {optimizer} 8-bit blockwise, {point} (lr={lr:g}, wd={wd:g}, gnorm_scale={gnorm_scale:g}), "
          f"n={size}, device {device}")
    print(f"{'elem':>6} " + " ".join(f"{name:>14}" for name in columns))
    for label, indices in (("first", first), ("worst", worst)):
        print(f"  {label}")
        for i in indices:
            print(f"{i:>6} " + " ".join(f"{col[i].item():14.6e}" for col in columns.values()))
    print("  " + ", ".join(f"max|{k}| {v:.3e}" for k, v in summary.items() if k.count("-")))
    return summary


def verdict(rows: list[dict]) -> list[str]:
    lines = []
    same = all(r["adapter-class"] == 0 and r["state adapter-class"] == 0 for r in rows if "adapter-class" in r)
    lines.append("adapter == bnb's own class, p1 and state, to the bit, in every row: "
                 + ("YES (the adapter drives bnb as its optimizer classes do)" if same
                    else "NO (look at the rows whose adapter-class is not 0)"))
    for optimizer in ("rmsprop", "adagrad"):
        for r in rows:
            if r["optimizer"] != optimizer or (r["wd"] == 0 and r["gnorm"] == 1):
                continue  # the models coincide there
            closer = "model_g (raw g in the numerator)" if r["adapter-model_g"] < r["adapter-model_d"] \
                else "model_d (decayed gradient in the numerator, torch.optim)"
            lines.append(f"{optimizer:8} {r['point']:14} n={r['size']:<5}: adapter is closer to {closer}: "
                         f"|adapter-model_g| {r['adapter-model_g']:.2e}, |adapter-model_d| {r['adapter-model_d']:.2e}, "
                         f"|adapter-ref64| {r['adapter-ref64']:.2e}")
    return lines


def battery_models() -> list[str]:
    from worker.battery import load_battery

    points = {(lr, wd): name for name, (lr, wd, gnorm) in POINTS.items() if gnorm == 1.0 and wd > 0}
    worst: dict[tuple[str, str, str], float] = {}
    for case in load_battery("standard").expand():
        h = case.hyper
        if (case.family != "8bit_blockwise" or case.optimizer not in ("rmsprop", "adagrad") or case.steps != 1
                or case.param_dtype != "float32" or (h["lr"], h["weight_decay"]) not in points
                or h["gnorm_scale"] != 1.0):
            continue
        p = initial_parameters(case.seed, case.size).to(torch.float32)
        stream = GradientStream(case.gradient, seed=case.seed, size=case.size, device="cpu", grad_dtype=torch.float32)
        g = stream.kernel_gradient(1, p)
        reference = make_reference(case, p.to(torch.float64))
        reference.step(1, stream.reference_gradient(1, reference.param))
        d = h["gnorm_scale"] * g + h["weight_decay"] * p  # float32, as the kernels
        s1 = (1 - h["alpha"]) * d * d if case.optimizer == "rmsprop" else d * d
        for model, numerator in (("model_d", d), ("model_g", g)):
            p1 = p - h["lr"] * (numerator / (s1.sqrt() + h["eps"]))
            key = (case.optimizer, points[(h["lr"], h["weight_decay"])], model)
            distance = (p1.to(torch.float64) - reference.param.detach()).abs().max().item()
            worst[key] = max(worst.get(key, 0.0), distance)
    return [f"{o:8} {point:14} {model}: max |model - ref64| {v:.4e}" for (o, point, model), v in sorted(worst.items())]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 4097])
    parser.add_argument("--show", type=int, default=4, help="first and worst elements printed per row")
    parser.add_argument("--battery-models", action="store_true",
                        help="only the two models on the standard battery's 1-step cases (CPU, no bnb)")
    args = parser.parse_args(argv)
    if args.battery_models:
        print("\n".join(battery_models()))
        return 0
    import bitsandbytes as bnb

    device = torch.device(args.device)
    adapter = get_adapter("bitsandbytes")
    adapter.load("installed")
    print(f"bitsandbytes {bnb.__version__} from {Path(bnb.__file__).parent}, torch {torch.__version__}, "
          f"device {device}" + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    rows = [run_row(bnb, adapter, device, optimizer, point, size, args.show)
            for optimizer in OPTIMIZERS for point in POINTS for size in args.sizes]
    print("\n== verdict")
    for line in verdict(rows):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
