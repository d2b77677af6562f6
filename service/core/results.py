"""Result models shared by the trajectory engine (worker) and the service: no torch here.

Everything a run produces is described by these pydantic models, so the worker can hand a run to
the service as JSON and the service can store, compare and show it without importing the engine.

Floats are kept at full precision. pydantic serialises floats with the shortest text that parses
back to the same float64 (so a JSON round trip is bit-exact, -0.0 included), and NaN / ±Infinity
are written as the strings "NaN" / "Infinity" / "-Infinity" (valid JSON, which PostgreSQL's jsonb
accepts, unlike bare NaN) and parsed back into floats.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

# The optimizers of service.core.optimizers.OPTIMIZERS, in its order (equal to its OPTIMIZER_NAMES:
# tests/service/core/test_optimizers.py). Stored rows keep these names.
OptimizerName = Literal["adam", "ademamix", "lion", "momentum", "rmsprop", "adagrad"]
# The state families of service.core.families.FAMILIES (its table says what each is; equal to its
# FAMILY_NAMES: tests/service/core/test_families.py). Stored rows keep these names.
KernelFamily = Literal["32bit", "8bit_blockwise", "4bit_blockwise", "fp8_e4m3", "fp8_e5m2", "paged_8bit_blockwise"]
ParamDtype = Literal["float32", "float16", "bfloat16"]
GradientKind = Literal["open", "closed"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="strings")


class GradientStreamSpec(_Model):
    """How the gradients of a case are produced (see worker/engine/gradients.py).

    open: a fixed seeded stream, independent of the parameters (isolates the update rule).
    closed: the gradient of a seeded quadratic 0.5*sum(h*(p-c)^2) at the current parameters
    (as in training: a difference feeds back into later gradients and grows).
    """

    kind: GradientKind = "open"
    zero_fraction: float = Field(0.0, ge=0.0, le=1.0, description="share of elements forced to exactly 0 each step")
    scale: float = Field(1.0, gt=0.0, description="open loop: gradient std; closed loop: curvature scale")


# A layout case's tensors live in one flat buffer (the engines' parameter vector), each starting
# at a multiple of LAYOUT_ALIGN elements (256 bytes of float32: what a caching allocator gives a
# separate tensor, so vectorised kernels see the alignment they would in a model) with at least
# one guard element after it. The guards are never handed to the library: they keep their initial
# values, are digested with the rest, and so a kernel that writes past a tensor's end (a chunk
# boundary off by one) changes the digest even where no neighbouring tensor is hit.
LAYOUT_ALIGN = 64
MAX_LAYOUT_TENSORS = 64
MAX_LAYOUT_GROUPS = 16


class TensorGroupSpec(_Model):
    """One param group of a layout case: its tensors' element counts, in order, and its
    hyperparameters (the kernel schema's float/bool arguments, every one filled in)."""

    sizes: list[int] = Field(min_length=1, max_length=MAX_LAYOUT_TENSORS)
    hyper: dict[str, float | bool]


class TensorSlot(BaseModel):
    """Where one tensor of a layout case lives in the flat parameter vector."""

    model_config = ConfigDict(frozen=True)

    index: int = Field(description="0-based, over the whole case, groups in order")
    group: int
    offset: int = Field(description="first element in the flat vector")
    size: int

    @property
    def stop(self) -> int:
        return self.offset + self.size


class ParamLayout(_Model):
    """Several tensors in param groups, all under ONE optimizer instance of the library, stepped
    through its own step() once per step (docs/ENGINE.md "Layout cases")."""

    groups: list[TensorGroupSpec] = Field(min_length=1, max_length=MAX_LAYOUT_GROUPS)

    @model_validator(mode="after")
    def _bounded(self) -> "ParamLayout":
        count = sum(len(group.sizes) for group in self.groups)
        if count > MAX_LAYOUT_TENSORS:
            raise ValueError(f"a layout has at most {MAX_LAYOUT_TENSORS} tensors, this one {count}")
        bad = [size for group in self.groups for size in group.sizes if size <= 0]
        if bad:
            raise ValueError(f"layout tensor sizes must be > 0, got {bad}")
        return self

    def slots(self) -> list[TensorSlot]:
        slots, offset = [], 0
        for group_index, group in enumerate(self.groups):
            for size in group.sizes:
                slots.append(TensorSlot(index=len(slots), group=group_index, offset=offset, size=size))
                offset = layout_next_offset(offset, size)
        return slots

    @property
    def flat_size(self) -> int:
        offset = 0
        for group in self.groups:
            for size in group.sizes:
                offset = layout_next_offset(offset, size)
        return offset

    @property
    def tensor_count(self) -> int:
        return sum(len(group.sizes) for group in self.groups)

    @property
    def elements(self) -> int:
        """Parameter elements the library steps (the guards not counted)."""
        return sum(sum(group.sizes) for group in self.groups)


def layout_next_offset(offset: int, size: int) -> int:
    """The next tensor's offset after one of `size` elements at `offset`: past at least one guard
    element, rounded up to LAYOUT_ALIGN."""
    end = offset + size + 1
    return -(-end // LAYOUT_ALIGN) * LAYOUT_ALIGN


class CaseSpec(_Model):
    """One case: everything needed to reproduce a trajectory bit for bit on one environment.

    A layout case (`layout` set) is an optimizer over several tensors in param groups; `size` is
    then its flat vector's length (layout.flat_size: the tensors, aligned, with guard elements) and
    `hyper` its first group's. A case without a layout serialises without the key, so every stored
    case, case hash and battery digest from before layouts existed is unchanged."""

    case_id: str = Field(description="stable, unique within a battery; readable label + short hash")
    optimizer: OptimizerName
    family: KernelFamily = "32bit"
    param_dtype: ParamDtype = "float32"
    # Exactly the kernel schema's float/bool arguments for this optimizer (lr, beta1, ..., gnorm_scale,
    # skip_zeros), all filled in, so the case does not depend on anyone's defaults.
    hyper: dict[str, float | bool]
    gradient: GradientStreamSpec = GradientStreamSpec()
    seed: int = Field(ge=0)
    size: int = Field(gt=0)
    steps: int = Field(gt=0)
    layout: ParamLayout | None = None

    @model_validator(mode="after")
    def _layout_size(self) -> "CaseSpec":
        if self.layout is not None and self.size != self.layout.flat_size:
            raise ValueError(f"a layout case's size is its flat vector's length, {self.layout.flat_size}; "
                             f"got {self.size}")
        return self

    @model_serializer(mode="wrap")
    def _without_absent_layout(self, handler):  # noqa: ANN001, ANN202
        data = handler(self)
        if isinstance(data, dict) and data.get("layout") is None:
            data.pop("layout", None)
        return data

    def tensor_slots(self) -> list[TensorSlot]:
        """The case's tensors: one slot covering the whole parameter for a one-tensor case."""
        if self.layout is None:
            return [TensorSlot(index=0, group=0, offset=0, size=self.size)]
        return self.layout.slots()

    def group_hyper(self, group: int) -> dict[str, float | bool]:
        return dict(self.hyper) if self.layout is None else dict(self.layout.groups[group].hyper)

    def tensor_case(self, slot: TensorSlot) -> "CaseSpec":
        """One tensor of a layout case as a one-tensor case (its size, its group's hyperparameters):
        what a per-tensor step of a library's functional API, and the per-tensor references, take."""
        return self.model_copy(update={"case_id": f"{self.case_id}[t{slot.index}]", "size": slot.size,
                                       "hyper": self.group_hyper(slot.group), "layout": None})


class Trajectory(_Model):
    """Per-step series of one case, index i = after step i+1 (steps are 1-based)."""

    # max_i |p_i - r64_i| against the float64 reference, which follows its own trajectory.
    ref64_max_abs: list[float]
    # max_i |p_i - r64_i| / max(|r64_i|, 2**-126): relative error, floored so zeros stay finite.
    ref64_max_rel: list[float]
    # max_i |p_i - r_i| against the same algorithm run in the parameter dtype (torch.optim where it
    # has the algorithm). None when the case has no same-precision reference.
    same_precision_max_abs: list[float] | None = None
    # Quantized families: the mean over the states' elements of |state - the quantization-aware
    # float64 reference's| in quantization steps (worker.references.blockwise_quant.state_steps);
    # direction is judged on it (service.core.verdicts). None where not measured.
    quant_ref_steps: list[float] | None = None
    # ... and max_i |p_i - that reference's p_i|: the parameters against the same reference.
    quant_ref_max_abs: list[float] | None = None
    # NaN/Inf elements in the parameters plus all optimizer states after the step.
    nonfinite_count: list[int]
    # per-step digest of parameter then state bits (schema order) after the step, prefixed by its
    # scheme ("od2:...", worker/engine/digest.py); unprefixed ones are the older blake2b-128.
    digests: list[str]
    # Layout cases only (None otherwise, and then absent from the JSON): per step, one digest per
    # tensor (its slice of the parameters and its own "t<i>." states), then one of the guard
    # elements between the tensors; and per step, per tensor, max |p - r64| over its elements. What
    # the verdict's per-tensor rows (CaseComparison.tensors) are made of.
    tensor_digests: list[list[str]] | None = None
    tensor_ref64_max_abs: list[list[float]] | None = None

    @model_serializer(mode="wrap")
    def _without_absent_tensor_series(self, handler):  # noqa: ANN001, ANN202
        data = handler(self)
        if isinstance(data, dict):
            for key in ("tensor_digests", "tensor_ref64_max_abs"):
                if data.get(key) is None:
                    data.pop(key, None)
        return data


# not_applicable: the adapter declares it cannot run the case on this device (a kernel the library
# does not have); set aside with the adapter's reason, never part of a verdict.
CaseStatus = Literal["ok", "broken", "not_applicable"]


class RepeatCheck(_Model):
    """The same case run again on the same build and worker: a kernel that does not reproduce
    itself is nondeterministic. With `baseline_runs`, its baseline's build was repeated on it too:
    whether the commit introduced the nondeterminism or found it there (docs/ENGINE.md)."""

    runs: int = Field(description="runs in all, the first included")
    differing: int = Field(description="repeats whose digests differ from the first run's")
    first_divergent_step: int | None = Field(None, description="1-based; first step where a repeat differs")
    # Blame (docs/ENGINE.md, Nondeterminism): a case that does not reproduce itself in a commit is
    # run again on its BASELINE build. None: not done (no finished baseline, or the case reproduced).
    baseline_runs: int | None = Field(None, description="runs of the case on the baseline build, in all")
    baseline_differing: int | None = Field(None, description="... of which differ from the baseline's first")

    @property
    def origin(self) -> "NondeterminismOrigin | None":
        """introduced: the baseline reproduces itself every time (the commit made the case
        nondeterministic); pre-existing: the baseline does not either; None: not blamed."""
        if not self.differing or self.baseline_runs is None:
            return None
        return "pre-existing" if self.baseline_differing else "introduced"


NondeterminismOrigin = Literal["introduced", "pre-existing"]


class CaseResult(_Model):
    case: CaseSpec
    status: CaseStatus
    message: str | None = Field(None, description="why the case is broken or not applicable")
    trajectory: Trajectory | None = None
    duration_s: float = 0.0
    repeat_check: RepeatCheck | None = None


class EnvironmentFingerprint(_Model):
    """What a result is only reproducible within. `class_key` names the comparable class."""

    device_kind: Literal["cpu", "cuda"]
    device_name: str
    compute_capability: str | None = None
    cpu_capability: str | None = Field(None, description="torch's CPU vector ISA (AVX2, AVX512...)")
    cpu_isa: str | None = Field(None, description="digest of the CPU's instruction-set features, what a "
                                "-march=native build compiles for (worker.build.host_cpu)")
    driver_version: str | None = None
    cuda_version: str | None = None
    torch_version: str
    python_version: str
    platform: str
    class_key: str
    references: dict[str, str] | None = Field(
        None, description="per optimizer, the digest of the references the host measures against "
                          "(torch, torch.optim's code as loaded, ours: worker/references/digest.py)")


class RunResult(_Model):
    """A battery run of one build on one environment."""

    battery_name: str
    battery_version: int
    battery_digest: str
    environment: EnvironmentFingerprint | None = None
    build_digest: str | None = None
    build_ok: bool = True
    build_error: str | None = Field(None, description="the compiler's message when the build failed")
    cases: list[CaseResult] = []
    reference_digests: dict[str, str] = Field({}, description="case id -> digest of the case's references "
                                                              "(none recorded: {})")


# ----------------------------------------------------------------------------- comparison
CaseVerdict = Literal["unchanged", "changed", "broken", "new", "not_applicable", "nondeterministic"]
Direction = Literal["closer", "farther", "same"]
RunVerdictName = Literal["unchanged", "changed", "broken", "no-baseline", "nondeterministic"]


class TensorComparison(_Model):
    """One tensor of a changed layout case (or its guard elements: index None), compared."""

    index: int | None = Field(description="the tensor's index in the case (CaseSpec.tensor_slots); None: the guard "
                                          "elements between tensors, which no correct kernel writes")
    group: int | None = None
    size: int = Field(description="elements")
    first_divergent_step: int | None = Field(None, description="1-based; None: bit-identical at every step")
    commit_peak_ref64_distance: float | None = None
    baseline_peak_ref64_distance: float | None = None
    direction: Direction | None = Field(None, description="this tensor's distance to float64, peak and mean over "
                                                          "the steps from its first divergent one")


class CaseComparison(_Model):
    case_id: str
    optimizer: OptimizerName
    # The case's kernel family and parameter dtype: its scale (sizes are summarized per family and
    # dtype, never across them). None in verdicts stored before they were recorded.
    family: KernelFamily | None = None
    param_dtype: ParamDtype | None = None
    verdict: CaseVerdict
    message: str | None = None
    first_divergent_step: int | None = Field(None, description="1-based; the first step whose digest differs")
    # max_i |commit_i - baseline_i| per step (needs both trajectories: the baseline co-run).
    max_abs_diff_per_step: list[float] | None = None
    # Quantized cases with quant_ref_steps on both sides: the peak over the differing steps of that
    # figure (quantization steps), the one their direction is judged on.
    commit_peak_quant_steps: float | None = None
    baseline_peak_quant_steps: float | None = None
    commit_final_ref64_distance: float | None = None
    baseline_final_ref64_distance: float | None = None
    # Over the steps where the two trajectories differ (from first_divergent_step on): the largest
    # and the mean per-step distance to the float64 reference. A change can wander off and come
    # back, so the final step alone can read "same" for a case that was far off on the way.
    commit_peak_ref64_distance: float | None = None
    baseline_peak_ref64_distance: float | None = None
    commit_mean_ref64_distance: float | None = None
    baseline_mean_ref64_distance: float | None = None
    direction: Direction | None = Field(None, description="judged over the trajectory (peak and mean distance)")
    final_direction: Direction | None = Field(None, description="judged at the final step alone; shown where "
                                                                "it disagrees with `direction`")
    repeat_check: RepeatCheck | None = None
    nondeterminism: NondeterminismOrigin | None = Field(
        None, description="a nondeterministic case's blame: introduced (the baseline build reproduces "
                          "itself: a change of this commit) or pre-existing (the baseline does not either)")
    reference_changed: bool = Field(False, description="the case's references (torch, torch.optim) differ from "
                                                       "the baseline's: its verdict stands, its direction is not judged")
    tensors: list[TensorComparison] | None = Field(
        None, description="a changed layout case: each tensor (and the guard elements) compared, so a change "
                          "confined to some tensors (a second param group, the tensors after the first) says so")


# Families whose states are quantized: their distance to float64 is the quantization error, by design.
QUANTIZED_FAMILY_PREFIX = "8bit"
# A group whose every case's peak distance to float64 moved by less than this factor either way has
# not changed in scale (what an 8-bit case's quantization-sized distance can say).
SAME_SCALE_FACTOR = 2.0


class ScaleGroup(_Model):
    """The changed cases of one (kernel family, parameter dtype): one scale, so one figure
    (service.core.verdicts.change_size_by_scale)."""

    family: str
    dtype: str
    cases: int
    baseline_peak: float | None = Field(None, description="the group's largest peak distance to float64, baseline")
    commit_peak: float | None = Field(None, description="... and commit")
    ratio_low: float | None = Field(None, description="per case: commit's peak distance / baseline's, smallest")
    ratio_high: float | None = Field(None, description="... and largest")
    largest_diff: float | None = Field(None, description="the largest per-step |commit - baseline| (co-run)")
    directions: dict[str, int] = Field({}, description="changed cases per direction, only those that occur")

    @property
    def quantized(self) -> bool:
        """8-bit states: the distance to float64 is their quantization error, large by design."""
        return self.family.startswith(QUANTIZED_FAMILY_PREFIX)

    @property
    def same_scale(self) -> bool:
        """Every case's peak distance to float64 moved by less than SAME_SCALE_FACTOR either way."""
        return (self.ratio_low is not None and self.ratio_high is not None
                and 1 / SAME_SCALE_FACTOR <= self.ratio_low and self.ratio_high <= SAME_SCALE_FACTOR)


class ComparisonFigures(_Model):
    """Every figure a surface shows about a comparison (dashboard, CLI, notifier, check runs), as
    fields: read from here, never parsed back from the summary's words."""

    judged: int = Field(description="cases judged (all but not_applicable)")
    changed: int = Field(description="cases whose verdict is changed")
    unchanged: int
    directions: dict[str, int] = Field(description="changed cases per direction over the trajectory: "
                                                   "closer, farther, same (zeros included)")
    final_disagreeing: int = Field(description="changed cases whose final-step direction reads otherwise")
    first_divergent_step: int | None = Field(None, description="the earliest over the changed cases")
    first_steps: dict[int, int] = Field({}, description="changed cases per first divergent step")
    final_ratio_low: float | None = Field(None, description="commit's final distance to float64 / "
                                                            "baseline's, smallest over the changed cases")
    final_ratio_high: float | None = None
    scales: list[ScaleGroup] = Field([], description="the size of the change per family and dtype")
    nondeterministic_introduced: int = Field(0, description="cases this commit made nondeterministic")
    nondeterministic_pre_existing: int = Field(0, description="cases nondeterministic in the baseline too "
                                                              "(shown, not blamed)")
    reference_changed: int = Field(0, description="cases whose references differ from the baseline's (torch "
                                                  "or torch.optim changed): directions not judged")


class RunComparison(_Model):
    verdict: RunVerdictName
    summary: str = Field(description="a few lines a person reads in ten seconds")
    # None in verdicts stored before the figures were (service.core.verdicts.figures_of derives them
    # from the stored cases).
    figures: ComparisonFigures | None = None
    battery_digest: str
    commit_build_digest: str | None = None
    baseline_build_digest: str | None = None
    counts: dict[str, int] = Field({}, description="cases per verdict that occurred (the API adds the zeros)")
    cases: list[CaseComparison] = []
