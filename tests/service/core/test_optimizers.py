"""Optimizers as data (service/core/optimizers.py, issue 48): the table every per-optimizer list
comes from, held to the op schemas it describes (csrc/ops.cpp) and to each consumer that reads it;
and what a new row does: the lists that read the table take it, the code that is science does not."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import typing

import pytest

from service.core.optimizers import EXPLICIT_HYPER, OPTIMIZER_NAMES, OPTIMIZERS, names_where, optimizer
from service.core.results import OptimizerName
from tests.service_fixtures import REPO_ROOT

OPS_CPP = REPO_ROOT / "csrc" / "ops.cpp"


def test_the_result_models_accept_exactly_the_tables_optimizers_in_its_order():
    assert typing.get_args(OptimizerName) == OPTIMIZER_NAMES


def test_stored_names_and_the_battery_defaults_are_kept():
    from worker.battery import OPTIMIZER_HYPER_DEFAULTS

    assert OPTIMIZER_NAMES == ("adam", "ademamix", "lion", "momentum", "rmsprop", "adagrad")
    assert OPTIMIZER_HYPER_DEFAULTS == {name: dict(row.hyper) for name, row in OPTIMIZERS.items()}
    # the exact values stored cases were made with (a case's hash covers every hyperparameter)
    assert OPTIMIZER_HYPER_DEFAULTS["adam"] == {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
                                                "weight_decay": 0.0, "gnorm_scale": 1.0, "skip_zeros": False}
    assert OPTIMIZER_HYPER_DEFAULTS["adagrad"]["eps"] == 1e-10 and OPTIMIZER_HYPER_DEFAULTS["lion"]["lr"] == 1e-4
    with pytest.raises(ValueError, match="no optimizer 'adamw'"):
        optimizer("adamw")


@pytest.mark.parametrize("battery", ["quick", "standard"])
def test_the_built_in_batteries_exercise_every_row(battery: str):
    # Their optimizer lists are written in worker/battery.py (a battery's version stands for its
    # cases): a new row fails here until it joins them, with a version bump.
    from worker.battery import BUILTIN_BATTERIES

    cases = BUILTIN_BATTERIES[battery]().expand()
    assert {(case.optimizer, case.family) for case in cases} >= {(name, family) for name in OPTIMIZER_NAMES
                                                                 for family in ("32bit", "8bit_blockwise")}
    assert {case.optimizer for case in cases if case.layout is not None} == set(OPTIMIZER_NAMES)


def test_a_battery_point_can_set_exactly_the_tables_hyperparameters():
    # HyperPoint (worker/battery.py) declares each hyperparameter's bounds by hand: a new one in a
    # row needs a field there, and a field no row takes is a point nothing reads.
    from worker.battery import HyperPoint

    assert set(HyperPoint.model_fields) == {name for row in OPTIMIZERS.values() for name in row.hyper}


def _schemas() -> dict[str, list[tuple[str, str, str | None]]]:
    """csrc/ops.cpp's op schemas: op name -> [(type, argument name, default or None)]."""
    # the schema strings joined, without their alias annotations (Tensor(a!) -> Tensor)
    text = re.sub(r"\([a-z]!\)", "", "".join(re.findall(r'"([^"]*)"', OPS_CPP.read_text())))
    schemas = {}
    for name, arguments in re.findall(r"(\w+)\(([^)]*)\) -> \(\)", text):
        parsed = []
        for argument in arguments.split(", "):
            kind, rest = argument.split(" ", 1)
            argument_name, _, default = rest.partition("=")
            parsed.append((kind, argument_name, default or None))
        schemas[name] = parsed
    return schemas


def _scalar_type(row, name: str) -> str:
    return "int" if name == "step" else ("bool" if isinstance(row.hyper[name], bool) else "float")


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_each_row_is_its_ops_schemas(name: str):
    # The table's states, maps and scalar order are what csrc/ops.cpp declares for all three ops;
    # a default the schema has is the table's.
    row, schemas = OPTIMIZERS[name], _schemas()
    scalars = [(_scalar_type(row, s), s) for s in row.scalar_order]
    one = schemas[f"{name}_step"]
    assert [(t, n) for t, n, _ in one] == [("Tensor", "param"), ("Tensor", "grad"),
                                          *(("Tensor", s) for s in row.state_names), *scalars]
    for _, argument, default in one:
        if default is not None:
            assert default in (repr(row.hyper[argument]), str(row.hyper[argument])), (argument, default)
    eight = schemas[f"{name}_8bit_blockwise_step"]
    assert [n for _, n, _ in eight] == ["param", "grad", *(f"{s}_{part}" for s in row.state_names
                                                         for part in ("codes", "absmax")),
                                        *(f"{kind}_map" for kind in row.state_maps), *row.scalar_order]
    multi = schemas[f"{name}_multi_step"]
    assert [n for _, n, _ in multi] == ["params", "grads", *(f"{s}s" for s in row.state_names), "steps",
                                        *(["beta_powers"] if row.bias_corrected else []), "group_of", *row.hyper]
    assert set(EXPLICIT_HYPER) <= set(row.hyper)


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_the_kernel_group_names_the_files_of_its_kernels(name: str):
    group = OPTIMIZERS[name].kernel_group
    assert f"{name}_step_cpu" in (REPO_ROOT / "csrc" / "cpu" / f"{group}.cpp").read_text()
    assert f"{name}_step" in (REPO_ROOT / "csrc" / "cuda" / f"{group}.cu").read_text()


def test_the_references_use_the_tables_torch_optim_classes():
    from worker.battery import OPTIMIZER_HYPER_DEFAULTS
    from worker.references import digest
    from worker.references.optimizers import torch_optim_class

    # worker/references/ is digested into every run's reference digests (a byte of it changed makes the
    # next comparison say "reference changed"), so its two lists are held to the table here, not read.
    assert digest.TORCH_OPTIM_CLASSES == {n: r.torch_optim_class for n, r in OPTIMIZERS.items() if r.torch_optim_class}
    assert set(digest.PAPER_OPTIMIZERS) == set(names_where(torch_optim_class=None))
    for name, row in OPTIMIZERS.items():
        if row.torch_optim_class is None:
            with pytest.raises(ValueError):
                torch_optim_class(name, OPTIMIZER_HYPER_DEFAULTS[name])
        else:
            assert torch_optim_class(name, OPTIMIZER_HYPER_DEFAULTS[name])[0].__name__ == row.torch_optim_class


def test_the_8bit_references_name_the_tables_states_and_optimizers():
    # The same folder, the same reason: held to the table, not read from it.
    from worker.references import blockwise8, closed_form_8bit

    assert blockwise8.STATE_SIGNED == {n: tuple((s.name, s.signed) for s in r.states) for n, r in OPTIMIZERS.items()}
    assert tuple(closed_form_8bit.OPTIMIZERS) == OPTIMIZER_NAMES


def test_the_attribution_variants_apply_by_the_table():
    from worker.attribution import variants

    assert variants.ALL == OPTIMIZER_NAMES
    assert variants.DECOUPLED == names_where(decay="decoupled")
    assert variants.COUPLED == names_where(decay="coupled")
    assert variants.TWO_MOMENT == names_where(bias_corrected=True)


def test_the_bundled_ops_lists_are_the_tables():
    from worker.adapters import bundled_ops

    assert bundled_ops.OPTIMIZER_STATES == {n: r.state_names for n, r in OPTIMIZERS.items()}
    assert bundled_ops.STATE_SIGNED_8BIT == {n: tuple(s.signed for s in r.states) for n, r in OPTIMIZERS.items()}
    assert bundled_ops.STEP_DEPENDENT == set(names_where(takes_step=True))
    assert bundled_ops.MULTI_BETA_POWERS == set(names_where(bias_corrected=True))
    for name, row in OPTIMIZERS.items():
        # the wrappers: step (where taken), lr and weight_decay required; the rest default to the table's
        accepted = bundled_ops.hyperparameters(name)
        assert accepted == {**({"step": True} if row.takes_step else {}),
                            **{h: h in EXPLICIT_HYPER for h in row.hyper}}
        defaults = bundled_ops._keyword_defaults(name)
        assert {h: defaults[h] for h in row.hyper if h not in EXPLICIT_HYPER} == \
            {h: v for h, v in row.hyper.items() if h not in EXPLICIT_HYPER}


# A copy of the table with one more row, imported before every consumer (a fresh process: the
# consumers read the table when imported). It reports which lists took the new optimizer.
_NEW_OPTIMIZER = r"""
import json, typing
from service.core import optimizers
row = optimizers._optimizer("sgd_sign", (("exp_avg", True),), {"lr": 1e-2, "weight_decay": 0.0, "gnorm_scale": 1.0},
                            takes_step=False, kernel_group="one_state", decay="decoupled", torch_optim_class=None)
optimizers.OPTIMIZERS["sgd_sign"] = row
optimizers.OPTIMIZER_NAMES = tuple(optimizers.OPTIMIZERS)
from service.core.results import OptimizerName
from worker import battery
from worker.adapters import bundled_ops
from worker.attribution import variants
from worker.references import digest
print(json.dumps({
    "results.OptimizerName": "sgd_sign" in typing.get_args(OptimizerName),
    "battery.OPTIMIZER_HYPER_DEFAULTS": "sgd_sign" in battery.OPTIMIZER_HYPER_DEFAULTS,
    "battery built-in batteries": "sgd_sign" in battery._ALL,
    "bundled_ops.OPTIMIZER_STATES": "sgd_sign" in bundled_ops.OPTIMIZER_STATES,
    "bundled_ops.STATE_SIGNED_8BIT": "sgd_sign" in bundled_ops.STATE_SIGNED_8BIT,
    "bundled_ops wrapper": callable(getattr(bundled_ops, "sgd_sign_step", None)),
    "bundled_ops fakes": all(callable(make("sgd_sign")) for make in
                             (bundled_ops._fake_32bit, bundled_ops._fake_8bit, bundled_ops._fake_multi)),
    "variants.ALL": "sgd_sign" in variants.ALL,
    "variants.DECOUPLED": "sgd_sign" in variants.DECOUPLED,
    "variants._Rule (the float64 rule)": hasattr(variants._Rule, "_sgd_sign"),
    "digest (references)": "sgd_sign" in digest.TORCH_OPTIM_CLASSES or "sgd_sign" in digest.PAPER_OPTIMIZERS,
}))
"""


def test_a_new_row_reaches_the_generated_lists_and_not_the_code():
    answer = subprocess.run([sys.executable, "-c", _NEW_OPTIMIZER], capture_output=True, text=True, cwd=REPO_ROOT,
                            check=True)
    reached = json.loads(answer.stdout)
    # what a new optimizer gets from its row alone
    generated = ["battery.OPTIMIZER_HYPER_DEFAULTS", "bundled_ops.OPTIMIZER_STATES",
                 "bundled_ops.STATE_SIGNED_8BIT", "bundled_ops wrapper", "bundled_ops fakes", "variants.ALL",
                 "variants.DECOUPLED"]
    # what it needs written (docs/EXTENDING.md, "A new kernel"): the literal (a typed surface,
    # tested equal to the table above), the built-in batteries (a version bump), the float64
    # rules, the references and their digest
    written = ["results.OptimizerName", "battery built-in batteries", "variants._Rule (the float64 rule)",
               "digest (references)"]
    assert {k for k, v in reached.items() if v} == set(generated), reached
    assert set(reached) == set(generated) | set(written)


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_each_generated_wrapper_makes_the_call_step_makes(kernels, name: str):
    # The typed wrapper (made from the row) and bundled_ops.step (bound from the op's own schema)
    # are two paths to one op call: from the same inputs they leave bit-identical tensors (the same
    # arithmetic on the same arguments; any tolerance would hide a swapped argument).
    import torch

    row = OPTIMIZERS[name]
    generator = torch.Generator().manual_seed(0)
    param, grad = torch.randn(257, generator=generator), torch.randn(257, generator=generator)
    hyper = {"lr": 0.1, "weight_decay": 0.1, "gnorm_scale": 0.5}
    results = []
    for path in ("wrapper", "step"):
        p, states = param.clone(), {state: torch.zeros(257) for state in row.state_names}
        for t in (1, 2, 3):
            if path == "wrapper":
                getattr(kernels, f"{name}_step")(p, grad, *states.values(), **hyper,
                                                 **({"step": t} if row.takes_step else {}))
            else:
                kernels.step(name, p, grad, states, step=t, hyper=hyper)
        results.append([p, *states.values()])
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert not torch.equal(results[0][0], param)  # the op ran
    with pytest.raises(TypeError, match="missing \\['lr'\\]"):
        getattr(kernels, f"{name}_step")(param, grad, *states.values(), weight_decay=0.0, step=1)


def test_every_op_of_every_row_has_its_generated_fake(kernels):
    # opcheck (tests/csrc/test_kernels_*opcheck.py) exercises a few calls; this says none is left out.
    from torch._library.simple_registry import singleton

    ops = [f"{name}_{kind}" for name in OPTIMIZER_NAMES for kind in ("step", "8bit_blockwise_step", "multi_step")]
    unfaked = [op for op in ops if singleton.find(f"optdrift::{op}").fake_impl.kernel is None]
    assert not unfaked, unfaked
