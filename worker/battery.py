"""Batteries: declarative, versioned, canonically hashed lists of cases.

A battery is a list of groups; each group is a cartesian product
optimizers × families × parameter dtypes × hyperparameter points × gradient streams × seeds × sizes,
run for a number of steps. Expanding a battery gives `service.core.results.CaseSpec`s with every kernel
argument filled in, so a stored case never depends on defaults that might change later.

Validation collects every problem of a spec into one pydantic ValidationError (unknown optimizer,
lr < 0, steps <= 0, a size beyond the configured limit, a hyperparameter no optimizer of its group
takes...), so a person fixes a battery file in one pass.

No torch here: the service may validate and hash batteries too.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from typing import Any

from pathlib import Path

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_serializer,
                      model_validator)

from service.core.battery_limits import (
    BatteryLimitError, BatteryLimits, BatteryLoad, check_battery_bytes, measure_battery,
)
from service.core.optimizers import OPTIMIZERS
from service.core.results import (MAX_LAYOUT_GROUPS, MAX_LAYOUT_TENSORS, CaseSpec, GradientStreamSpec, KernelFamily,
                                  OptimizerName, ParamDtype, ParamLayout, TensorGroupSpec)

# The kernel schema's float/bool arguments per optimizer (csrc/ops.cpp), with the defaults a case
# gets when its point does not set them: service.core.optimizers' table (torch.optim / the papers).
OPTIMIZER_HYPER_DEFAULTS: dict[str, dict[str, float | bool]] = {
    name: dict(row.hyper) for name, row in OPTIMIZERS.items()}

DEFAULT_MAX_CASE_SIZE = 1 << 24
_DTYPE_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def max_case_size(info: ValidationInfo | None = None) -> int:
    """The size limit: validation context `max_case_size`, else OPTDRIFT_MAX_CASE_SIZE, else 2**24."""
    if info is not None and info.context and "max_case_size" in info.context:
        return int(info.context["max_case_size"])
    return int(os.environ.get("OPTDRIFT_MAX_CASE_SIZE", DEFAULT_MAX_CASE_SIZE))


class HyperPoint(BaseModel):
    """One point in hyperparameter space; unset fields take the optimizer's default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: float | None = Field(None, ge=0.0)
    weight_decay: float | None = Field(None, ge=0.0)
    beta1: float | None = Field(None, ge=0.0, lt=1.0)
    beta2: float | None = Field(None, ge=0.0, lt=1.0)
    beta3: float | None = Field(None, ge=0.0, lt=1.0)
    alpha: float | None = Field(None, ge=0.0)
    eps: float | None = Field(None, ge=0.0)
    momentum: float | None = Field(None, ge=0.0, lt=1.0)
    gnorm_scale: float | None = Field(None, gt=0.0)
    skip_zeros: bool | None = None

    def set_fields(self) -> dict[str, float | bool]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


class LayoutGroup(BaseModel):
    """One param group of a battery layout: its tensors' sizes and what its hyperparameters change
    from the case's point (a group without weight decay for biases and norms, a larger lr...)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sizes: list[int] = Field(min_length=1, max_length=MAX_LAYOUT_TENSORS)
    point: HyperPoint = HyperPoint()


class LayoutSpec(BaseModel):
    """A parameter layout: several tensors in param groups, all under one optimizer instance of
    the library, stepped through its own step() once per step (docs/ENGINE.md "Layout cases")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    groups: list[LayoutGroup] = Field(min_length=1, max_length=MAX_LAYOUT_GROUPS)

    def to_layout(self, hyper: dict[str, float | bool], defaults: dict[str, float | bool]) -> ParamLayout:
        return ParamLayout(groups=[
            TensorGroupSpec(sizes=list(group.sizes),
                            hyper={**hyper, **{k: v for k, v in group.point.set_fields().items() if k in defaults}})
            for group in self.groups])


class CaseGroup(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    optimizers: list[OptimizerName] = Field(min_length=1)
    families: list[KernelFamily] = Field(default=["32bit"], min_length=1)
    param_dtypes: list[ParamDtype] = Field(default=["float32"], min_length=1)
    points: list[HyperPoint] = Field(default=[HyperPoint()], min_length=1)
    gradients: list[GradientStreamSpec] = Field(default=[GradientStreamSpec()], min_length=1)
    seeds: list[int] = Field(default=[0], min_length=1)
    # One tensor per case of each size, or (`layouts`) one optimizer over several tensors per case.
    sizes: list[int] = Field(default=[])
    steps: int = Field(gt=0)
    layouts: list[LayoutSpec] | None = Field(None, min_length=1)

    @model_serializer(mode="wrap")
    def _without_absent_layouts(self, handler):  # noqa: ANN001, ANN202
        # A group without layouts serialises as it did before they existed: battery digests stay.
        data = handler(self)
        if isinstance(data, dict) and data.get("layouts") is None:
            data.pop("layouts", None)
        return data

    @model_validator(mode="after")
    def _sizes_or_layouts(self, info: ValidationInfo) -> "CaseGroup":
        if bool(self.sizes) == bool(self.layouts):
            raise ValueError("a group has either `sizes` (one tensor per case) or `layouts` (several tensors "
                             "under one optimizer per case), not both and not neither")
        limit = max_case_size(info)
        for index, layout in enumerate(self.layouts or ()):
            tensors = sum(len(group.sizes) for group in layout.groups)
            bad = [size for group in layout.groups for size in group.sizes if size <= 0 or size > limit]
            if tensors > MAX_LAYOUT_TENSORS or bad:
                raise ValueError(f"layout {index}: at most {MAX_LAYOUT_TENSORS} tensors, each of 1..{limit} elements "
                                 f"(got {tensors} tensors, bad sizes {bad[:5]})")
            flat = ParamLayout(groups=[TensorGroupSpec(sizes=g.sizes, hyper={}) for g in layout.groups]).flat_size
            if flat > limit:
                raise ValueError(f"layout {index}: its flat vector of {flat} elements passes the size limit {limit} "
                                 "(OPTDRIFT_MAX_CASE_SIZE)")
        return self

    @field_validator("seeds")
    @classmethod
    def _seeds_non_negative(cls, seeds: list[int]) -> list[int]:
        bad = [s for s in seeds if s < 0]
        if bad:
            raise ValueError(f"seeds must be >= 0, got {bad}")
        return seeds

    @field_validator("sizes")
    @classmethod
    def _sizes_in_range(cls, sizes: list[int], info: ValidationInfo) -> list[int]:
        limit = max_case_size(info)
        bad = [s for s in sizes if s <= 0 or s > limit]
        if bad:
            raise ValueError(f"sizes must be in 1..{limit} (the configured limit, OPTDRIFT_MAX_CASE_SIZE), got {bad}")
        return sizes

    @field_validator("points")
    @classmethod
    def _points_apply_to_group(cls, points: list[HyperPoint], info: ValidationInfo) -> list[HyperPoint]:
        # Runs after `optimizers` (declaration order); skipped when those were invalid, whose error
        # is then reported on its own.
        optimizers = info.data.get("optimizers")
        if not optimizers:
            return points
        taken = set().union(*(OPTIMIZER_HYPER_DEFAULTS[o] for o in optimizers))
        problems = []
        for index, point in enumerate(points):
            unused = sorted(set(point.set_fields()) - taken)
            if unused:
                problems.append(f"point {index} sets {unused}, which none of {optimizers} takes")
        if problems:
            raise ValueError("; ".join(problems))
        return points

    @field_validator("layouts")
    @classmethod
    def _layout_points_apply_to_group(cls, layouts: list[LayoutSpec] | None,
                                      info: ValidationInfo) -> list[LayoutSpec] | None:
        optimizers = info.data.get("optimizers")
        if not optimizers or not layouts:
            return layouts
        taken = set().union(*(OPTIMIZER_HYPER_DEFAULTS[o] for o in optimizers))
        problems = [f"layout {i} group {g} sets {sorted(set(group.point.set_fields()) - taken)}, which none of "
                    f"{optimizers} takes"
                    for i, layout in enumerate(layouts) for g, group in enumerate(layout.groups)
                    if set(group.point.set_fields()) - taken]
        if problems:
            raise ValueError("; ".join(problems))
        return layouts


class BatterySpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    version: int = Field(ge=1)
    description: str = ""
    groups: list[CaseGroup] = Field(min_length=1)

    @property
    def digest(self) -> str:
        """sha256 of the spec as sorted-key JSON (name and version included)."""
        return hashlib.sha256(canonical_json(self.model_dump(mode="json")).encode()).hexdigest()

    def expand(self) -> list[CaseSpec]:
        """Every case of the battery, in a stable order, without duplicates."""
        cases: dict[str, CaseSpec] = {}
        for group in self.groups:
            shapes: list[int | LayoutSpec] = list(group.sizes) or list(group.layouts or ())
            for optimizer, family, dtype, point, gradient, seed, shape in itertools.product(
                group.optimizers, group.families, group.param_dtypes, group.points,
                group.gradients, group.seeds, shapes,
            ):
                defaults = OPTIMIZER_HYPER_DEFAULTS[optimizer]
                hyper = dict(defaults)
                hyper.update({k: v for k, v in point.set_fields().items() if k in defaults})
                layout = shape.to_layout(hyper, defaults) if isinstance(shape, LayoutSpec) else None
                case = make_case(optimizer=optimizer, family=family, param_dtype=dtype,
                                 hyper=layout.groups[0].hyper if layout else hyper, gradient=gradient, seed=seed,
                                 size=layout.flat_size if layout else shape, steps=group.steps, layout=layout)
                cases.setdefault(case.case_id, case)
        return list(cases.values())


def canonical_json(value: Any) -> str:
    # json.dumps writes floats with repr (shortest round-trip), so the text pins every bit.
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _canonical_hyper(hyper: dict[str, float | bool]) -> dict[str, float | bool]:
    return {k: (bool(v) if isinstance(v, bool) else float(v)) for k, v in sorted(hyper.items())}


def layout_label(layout: ParamLayout, hyper: dict[str, float | bool]) -> str:
    """'L[1+257+4096|1031:wd=0.0]': each group's tensor sizes, and what its hyperparameters change
    from the case's (its first group's)."""
    groups = []
    for group in layout.groups:
        text = "+".join(str(size) for size in group.sizes)
        changed = [f"{'wd' if k == 'weight_decay' else k}={v!r}" for k, v in sorted(group.hyper.items())
                   if hyper.get(k) != v]
        groups.append(text + (":" + ",".join(changed) if changed else ""))
    return "L[" + "|".join(groups) + "]"


def make_case(*, optimizer: str, family: str, param_dtype: str, hyper: dict[str, float | bool],
              gradient: GradientStreamSpec, seed: int, size: int, steps: int,
              layout: ParamLayout | None = None) -> CaseSpec:
    """A CaseSpec whose id is a readable label plus a hash of the whole description. A layout case's
    body carries the layout (a one-tensor case's body is what it always was: its hash unchanged)."""
    hyper = _canonical_hyper(hyper)
    body = {"optimizer": optimizer, "family": family, "param_dtype": param_dtype, "hyper": hyper,
            "gradient": gradient.model_dump(mode="json"), "seed": seed, "size": size, "steps": steps}
    if layout is not None:
        layout = ParamLayout(groups=[TensorGroupSpec(sizes=g.sizes, hyper=_canonical_hyper(g.hyper))
                                     for g in layout.groups])
        body["layout"] = layout.model_dump(mode="json")
    content_hash = hashlib.sha256(canonical_json(body).encode()).hexdigest()[:8]
    defaults = OPTIMIZER_HYPER_DEFAULTS[optimizer]
    parts = [optimizer, family, _DTYPE_SHORT[param_dtype], f"lr={hyper['lr']!r}", f"wd={hyper['weight_decay']!r}"]
    parts += [f"{k}={v!r}" for k, v in hyper.items()
              if k not in ("lr", "weight_decay") and v != defaults[k]]
    stream = gradient.kind + (f"+z{gradient.zero_fraction!r}" if gradient.zero_fraction else "")
    stream += f"*{gradient.scale!r}" if gradient.scale != 1.0 else ""
    parts += [stream, layout_label(layout, hyper) if layout is not None else f"n{size}", f"s{seed}", f"t{steps}"]
    return CaseSpec(case_id=".".join(parts) + "#" + content_hash, **body)


# ----------------------------------------------------------------------------- built-ins
# The optimizers the built-in batteries exercise, written out rather than read from
# service.core.optimizers: a battery's name and version stand for its cases, so a new optimizer joins
# them with a version bump (tests/service/core/test_optimizers.py fails until every row is here).
_ALL = ["adam", "ademamix", "lion", "momentum", "rmsprop", "adagrad"]
_TWO_STATE = ["adam", "ademamix"]
_ONE_STATE = ["lion", "momentum", "rmsprop", "adagrad"]
_OPEN = {"kind": "open"}
_CLOSED = {"kind": "closed"}
_DISCRIMINATING = {"lr": 0.1, "weight_decay": 0.1}   # ordering gap ~ lr²·wd is far above fp32 noise
_TYPICAL = {"lr": 1e-3, "weight_decay": 1e-2}


# 8-bit blockwise cases (issue 6). One step from a zero state at the discriminating point is the
# closed-form case: the state quantizes exactly, so step 1 equals torch.optim's float64 step 1 to
# float32 rounding (~1e-6) and a decay-ordering change shows as ~1e-3. Longer runs carry the
# quantization error (~1e-3 a step) and are watched by digest (codes and absmax included).
_EIGHT_BIT = ["8bit_blockwise"]
_EIGHT_BIT_QUICK = [
    {"optimizers": _ALL, "families": _EIGHT_BIT, "sizes": [4097], "steps": 1, "points": [_DISCRIMINATING]},
    {"optimizers": _ALL, "families": _EIGHT_BIT, "param_dtypes": ["float32", "bfloat16"], "sizes": [1031],
     "steps": 10, "gradients": [{"kind": "open", "zero_fraction": 0.25}],
     "points": [_DISCRIMINATING, {"lr": 0.1, "weight_decay": 0.0}]},
]
_EIGHT_BIT_STANDARD = [
    {"optimizers": _ALL, "families": _EIGHT_BIT, "param_dtypes": ["float32", "float16", "bfloat16"],
     "sizes": [1, 4097, 65536], "steps": 1, "seeds": [0, 1], "points": [_DISCRIMINATING, _TYPICAL]},
    {"optimizers": _ALL, "families": _EIGHT_BIT, "param_dtypes": ["float32", "float16", "bfloat16"],
     "sizes": [4097, 65536], "steps": 100, "gradients": [_OPEN, _CLOSED, {"kind": "open", "zero_fraction": 0.25}],
     "points": [_TYPICAL, _DISCRIMINATING, {"lr": 1e-3, "weight_decay": 0.0}]},
    {"optimizers": ["adam"], "families": _EIGHT_BIT, "sizes": [4097], "steps": 100,
     "gradients": [{"kind": "open", "zero_fraction": 0.5}],
     "points": [{**_DISCRIMINATING, "skip_zeros": True, "gnorm_scale": 0.5}]},
]


# Layout cases (issue 45): several tensors under ONE optimizer, as a model's training loop has them.
# Group 0: a size-1 tensor, two odd tensors of equal size (a state buffer shared between equal
# shapes), a block multiple; group 1 (biases and norms): another lr and no weight decay (a group's
# hyperparameters applied to another). Shared step counters and bias-correction powers differ
# only from the second tensor of a step on, and a chunk boundary only where one tensor ends.
_LAYOUT_SMALL = {"groups": [{"sizes": [1, 257, 257, 4096]},
                            {"sizes": [1031], "point": {"lr": 0.01, "weight_decay": 0.0}}]}
# GPU: tensors past a CUDA chunk (65536 elements) and a large one, so chunk lists span tensors.
_LAYOUT_LARGE = {"groups": [{"sizes": [1, 4097, 65536, 65537, 262147]},
                            {"sizes": [257, 100_003], "point": {"lr": 1e-4, "weight_decay": 0.0}}]}


def _quick() -> BatterySpec:
    # CPU: the whole `optdrift check` (two hosts, co-run) must stay under a minute on 2 cores.
    return BatterySpec.model_validate({
        "name": "quick", "version": 3,
        "description": "CPU smoke battery: discriminating and typical Adam/AdEMAMix points with wd=0 "
                       "controls, the 1-state optimizers, fp16/bf16 with exact zeros and gnorm_scale, size 1, "
                       "and every optimizer over five tensors in two param groups.",
        "groups": [
            {"optimizers": _TWO_STATE, "sizes": [4097], "steps": 20, "gradients": [_OPEN, _CLOSED],
             "points": [_DISCRIMINATING, {"lr": 0.1, "weight_decay": 0.0}, _TYPICAL,
                        {"lr": 1e-3, "weight_decay": 0.0}]},
            {"optimizers": _ONE_STATE, "sizes": [4097], "steps": 20, "gradients": [_OPEN, _CLOSED],
             "points": [{"lr": 1e-2, "weight_decay": 0.1}, {"lr": 1e-2, "weight_decay": 0.0}]},
            {"optimizers": _ALL, "param_dtypes": ["float16", "bfloat16"], "sizes": [1031], "steps": 10,
             "gradients": [{"kind": "open", "zero_fraction": 0.25}],
             "points": [{"lr": 0.1, "weight_decay": 0.1, "gnorm_scale": 0.5}]},
            {"optimizers": _ALL, "sizes": [1], "steps": 10, "points": [_DISCRIMINATING]},
            {"optimizers": ["adam"], "sizes": [4097], "steps": 20,
             "gradients": [{"kind": "open", "zero_fraction": 0.5}],
             "points": [{"lr": 0.1, "weight_decay": 0.1, "skip_zeros": True}]},
            *_EIGHT_BIT_QUICK,
            # v2 (issue 37): an 8-bit size that is a multiple of the block (a tail count can be wrong
            # only there; worker/sensitivity/ci_selection.py's coverage rules).
            {"optimizers": ["adam"], "families": _EIGHT_BIT, "sizes": [512], "steps": 4,
             "gradients": [{"kind": "open", "zero_fraction": 0.25}], "points": [{"lr": 0.1, "weight_decay": 0.1}]},
            # v3 (issue 45): every optimizer over a layout of five tensors in two param groups.
            {"optimizers": _ALL, "layouts": [_LAYOUT_SMALL], "steps": 10, "gradients": [_OPEN, _CLOSED],
             "points": [_DISCRIMINATING]},
        ],
    })


def _standard() -> BatterySpec:
    # GPU: >= 500 cases of >= 100 steps.
    dtypes = ["float32", "float16", "bfloat16"]
    return BatterySpec.model_validate({
        "name": "standard", "version": 4,
        "description": "GPU battery: typical, discriminating and wd=0 points for every optimizer and dtype, "
                       "sizes 1/4097/65536/2**20, exact zeros, gnorm_scale != 1, several seeds.",
        "groups": [
            {"optimizers": _ALL, "param_dtypes": dtypes, "sizes": [1, 4097, 65536], "steps": 100,
             "gradients": [_OPEN, _CLOSED],
             "points": [_TYPICAL, _DISCRIMINATING, {"lr": 1e-3, "weight_decay": 0.0},
                        {"lr": 0.1, "weight_decay": 0.0}]},
            {"optimizers": _ALL, "param_dtypes": dtypes, "sizes": [4097], "steps": 100, "seeds": [1, 2],
             "gradients": [{"kind": "open", "zero_fraction": 0.25}], "points": [_TYPICAL, _DISCRIMINATING]},
            {"optimizers": _ALL, "sizes": [4097], "steps": 100, "seeds": [0, 1],
             "gradients": [{"kind": "open", "zero_fraction": 0.1}, _CLOSED],
             "points": [{"lr": 1e-2, "weight_decay": 1e-2, "gnorm_scale": 0.25}]},
            {"optimizers": ["adam"], "param_dtypes": dtypes, "sizes": [4097, 65536], "steps": 100,
             "gradients": [{"kind": "open", "zero_fraction": 0.5}],
             "points": [{**_TYPICAL, "skip_zeros": True}, {**_DISCRIMINATING, "skip_zeros": True}]},
            {"optimizers": _TWO_STATE, "sizes": [1 << 20], "steps": 100, "points": [_TYPICAL]},
            *_EIGHT_BIT_STANDARD,
            # v2: the ci battery's cases at 100 steps, so standard catches every catalogued defect on the
            # recorded evidence (a trajectory's first steps do not depend on how many follow);
            # docs/SENSITIVITY.md.
            *({**case, "steps": 100} for case in _CI_CASES),
            # v4 (issue 45): layout cases, every optimizer and dtype, small and large layouts (chunk
            # lists spanning tensors on the GPU), and the bundled 8-bit family's per-tensor loop.
            {"optimizers": _ALL, "param_dtypes": dtypes, "layouts": [_LAYOUT_SMALL], "steps": 100,
             "gradients": [_OPEN, _CLOSED], "points": [_TYPICAL, _DISCRIMINATING]},
            {"optimizers": _ALL, "param_dtypes": dtypes, "layouts": [_LAYOUT_LARGE], "steps": 100,
             "gradients": [_OPEN, _CLOSED], "points": [_TYPICAL]},
            {"optimizers": _ALL, "families": _EIGHT_BIT, "layouts": [_LAYOUT_SMALL], "steps": 100,
             "points": [_TYPICAL, _DISCRIMINATING]},
        ],
    })


def _ci_case(optimizer: str, family: str, dtype: str, point: dict, gradient: dict, *, size: int | None = None,
             layout: dict | None = None, steps: int) -> dict:
    shape = {"sizes": [size]} if layout is None else {"layouts": [layout]}
    return {"optimizers": [optimizer], "families": [family], "param_dtypes": [dtype], "points": [point],
            "gradients": [gradient], **shape, "steps": steps}


# The smallest subset of the candidate pool (worker/sensitivity/batteries/pool.json) that catches every
# defect of the mutation catalogue: chosen by worker/sensitivity/ci_selection.py from the recorded
# catalogue run (worker/sensitivity/recorded/cpu_pool.json); docs/SENSITIVITY.md.
# Regenerate both when the catalogue or the kernels change; tests/worker/sensitivity/test_sensitivity_batteries.py checks it.
# v2 (issue 37): the catalogue's block-multiple tail count and AdEMAMix's float32 1/(1 - beta1^t), and
# the coverage rules (ci_selection.coverage_rules: a block-multiple 8-bit size, >= 5 steps of Adam and AdEMAMix).
_CI_CASES = [
    _ci_case("adagrad", "32bit", "float32", {"lr": 0.1, "weight_decay": 0.1}, {"kind": "open", "zero_fraction": 0.25}, size=1, steps=4),
    _ci_case("adam", "32bit", "float32", {"lr": 0.1, "weight_decay": 0.1}, {"kind": "open", "zero_fraction": 0.25}, size=1, steps=4),
    _ci_case("adam", "8bit_blockwise", "float32", {"gnorm_scale": 0.5, "lr": 0.1, "skip_zeros": True, "weight_decay": 0.1}, {"kind": "open", "zero_fraction": 0.5}, size=257, steps=4),
    _ci_case("lion", "32bit", "bfloat16", {"gnorm_scale": 0.5, "lr": 0.1, "weight_decay": 0.1}, {"kind": "open", "zero_fraction": 0.25}, size=257, steps=4),
    _ci_case("momentum", "32bit", "bfloat16", {"gnorm_scale": 0.5, "lr": 0.1, "weight_decay": 0.1}, {"kind": "open", "zero_fraction": 0.25}, size=257, steps=4),
    _ci_case("rmsprop", "32bit", "bfloat16", {"gnorm_scale": 0.5, "lr": 0.1, "weight_decay": 0.1}, {"kind": "open", "zero_fraction": 0.25}, size=257, steps=4),
    _ci_case("adagrad", "8bit_blockwise", "float32", {"lr": 0.1, "weight_decay": 0.1}, {"kind": "open", "zero_fraction": 0.25}, size=512, steps=4),
    _ci_case("ademamix", "32bit", "float32", {"lr": 0.001, "weight_decay": 0.01}, {"kind": "closed"}, size=257, steps=8),
    _ci_case("lion", "8bit_blockwise", "bfloat16", {"lr": 0.1, "weight_decay": 0.0}, {"kind": "open", "zero_fraction": 0.25}, size=1031, steps=10),
    # v3 (issue 45): one Adam over four tensors in two param groups catches every shared-state defect
    # of the multi-tensor ops (the DeepSpeed 0.19.0 pattern from step 3) and meets the layout rule.
    _ci_case("adam", "32bit", "bfloat16", {"lr": 0.1, "weight_decay": 0.1}, {"kind": "open"},
             layout={"groups": [{"sizes": [1, 17, 17]}, {"sizes": [9], "point": {"lr": 0.01, "weight_decay": 0.0}}]},
             steps=5),
]


def _ci() -> BatterySpec:
    # CPU CI: a whole `optdrift check` in <= 15 s on 2 cores with warm builds (docs/SENSITIVITY.md).
    return BatterySpec.model_validate({
        "name": "ci", "version": 3,
        "description": "The fewest, cheapest cases that catch every defect of the mutation catalogue "
                       "(worker/sensitivity/catalogue): chosen from evidence, not by hand.",
        "groups": _CI_CASES,
    })


BUILTIN_BATTERIES = {"quick": _quick, "standard": _standard, "ci": _ci}


class BatteryError(ValueError):
    """A submitted battery name that is not a built-in battery nor a valid battery file in the tree.
    The message names the input and what to do; it never quotes a file outside the tree."""


MAX_BATTERY_FILE_BYTES = 1024 * 1024
MAX_BATTERY_NAME_CHARS = 255


def _tree_path_problem(name: str) -> str | None:
    """Why `name` cannot be a path inside a tree, or None."""
    if not name or len(name) > MAX_BATTERY_NAME_CHARS:
        return f"is empty or longer than {MAX_BATTERY_NAME_CHARS} characters"
    if "\0" in name or "\\" in name:
        return "contains a NUL or a backslash"
    if name.startswith("/"):
        return "is an absolute path"
    if ".." in name.split("/"):
        return "goes up a folder ('..')"
    return None


def battery_from_tree(tree: Path, name: str, *, limits: BatteryLimits | None = None) -> BatterySpec:
    """The battery a run names: a built-in one, or a JSON file inside the submitted `tree` (relative,
    no '..', no link out of the tree; extracted archives hold no links at all). Anything else is a
    BatteryError, never a read of another file: the name comes from the submitter. `limits`: the
    run's (service.core.battery_limits), checked on the file's bytes and raw JSON before validation."""
    if name in BUILTIN_BATTERIES:
        return BUILTIN_BATTERIES[name]()
    what = f"use a built-in battery ({', '.join(sorted(BUILTIN_BATTERIES))}) or the relative path of a JSON file in the tree"
    problem = _tree_path_problem(name)
    if problem:
        raise BatteryError(f"battery {name[:80]!r} {problem}: {what}")
    root = Path(tree).resolve()
    path = root / name
    resolved = path.resolve()
    if not resolved.is_relative_to(root) or path.is_symlink():
        raise BatteryError(f"battery {name!r} leads out of the tree: {what}")
    if not resolved.is_file():
        raise BatteryError(f"battery {name!r} is neither a built-in battery nor a file in the tree: {what}")
    return battery_from_file(resolved, shown_as=name, limits=limits)


def battery_from_file(path: Path, *, shown_as: str | None = None,
                      limits: BatteryLimits | None = None) -> BatterySpec:
    """A battery JSON file the caller may read (`battery_from_tree` decides that for submissions;
    `optdrift check` reads its user's own file). Every problem of the file in one BatteryError.
    With `limits`, its bytes are bounded before it is read and what it declares before it is
    validated (a 6.5e10-case battery is refused from its axis lengths, nothing built)."""
    name = shown_as or str(path)
    size = Path(path).stat().st_size
    if size > MAX_BATTERY_FILE_BYTES:
        raise BatteryError(f"battery file {name!r} is larger than {MAX_BATTERY_FILE_BYTES} bytes")
    try:
        if limits is not None:
            check_battery_bytes(size, battery=name, limits=limits)
        data = Path(path).read_bytes()
        if limits is not None:
            try:
                raw = json.loads(data)
            except ValueError as error:  # not JSON at all (UnicodeDecodeError is a ValueError too)
                raise BatteryError(f"battery file {name!r} is not valid JSON: {str(error)[:200]}") from None
            measure_battery(raw, battery=name, limits=limits)
    except BatteryLimitError as error:
        raise BatteryError(str(error)) from None
    try:
        return BatterySpec.model_validate_json(data)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}"
                             for e in error.errors(include_url=False, include_input=False, include_context=False))
        raise BatteryError(f"battery file {name!r} is not a valid battery: {problems[:2000]}") from None


def check_within_limits(battery: BatterySpec, *, limits: BatteryLimits, shown_as: str | None = None) -> BatteryLoad:
    """What `battery` declares, or BatteryError when it passes one of `limits`: the worker's check just
    before `expand()` (every battery, built-in ones too), from the axis lengths, nothing expanded."""
    try:
        return measure_battery(battery.model_dump(mode="json"), battery=shown_as or battery.name, limits=limits)
    except BatteryLimitError as error:
        raise BatteryError(str(error)) from None


def load_battery(name_or_path: str) -> BatterySpec:
    """A built-in battery by name, or a battery JSON file."""
    if name_or_path in BUILTIN_BATTERIES:
        return BUILTIN_BATTERIES[name_or_path]()
    if os.path.isfile(name_or_path):
        with open(name_or_path, encoding="utf-8") as handle:
            return BatterySpec.model_validate_json(handle.read())
    raise ValueError(f"unknown battery {name_or_path!r}: use one of {sorted(BUILTIN_BATTERIES)} or a JSON file path")
