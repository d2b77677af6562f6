"""What a build variant's change looks like: the numerical class of a changed case (worker/attribution:
rounding-level, semantic, precision, quantization) combined with what differs between the two
builds (flags, compilers), as recorded in each run's environment detail (`toolchain`,
`build_variant`, `build_flags`).

The call is never more than the evidence: "looks like FMA contraction" needs both a change bounded
by a few roundings from its first step *and* a contraction flag that differs between the builds
(`-mfma`, `-ffp-contract=...`, nvcc's `--fmad=...`); the label names that flag and the ulps. A
change beyond rounding is said to be so, whatever flag differs: a flag that explains roundings
explains nothing larger. Pure (no I/O); its words are service.core.wording's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from service.core import wording

# The numerical classes of worker/attribution/analysis.py that are bounded by roundings.
ROUNDING_CLASS = "rounding-level"
BEYOND_ROUNDING_CLASSES = ("semantic", "precision", "quantization")

# What a looks-like call is (`kind`), from the strongest evidence down.
FMA_CONTRACTION = "fma-contraction"
FAST_MATH = "fast-math"
ANOTHER_COMPILER = "another-compiler"
ROUNDING_ONLY = "rounding-level"          # rounding-level; no contraction, fast-math or compiler difference
BEYOND_ROUNDING = "beyond-rounding"
NOT_ATTRIBUTED = "not-attributed"


def is_contraction_flag(flag: str) -> bool:
    """Flags that decide whether `a*b+c` becomes one fused rounding: FMA instructions for the host
    compiler (`-mfma`, `-mno-fma`, an `-march` that may bring them), gcc/clang's contraction mode,
    nvcc's `--fmad`."""
    return (flag in ("-mfma", "-mno-fma") or flag.startswith(("-ffp-contract=", "--fmad=", "-fmad=", "-march=")))


# Fast-math family flags, each with what it approximates (service.core.wording says it).
_FAST_MATH_PREFIXES = ("-ffast-math", "-Ofast", "-freciprocal-math", "-funsafe-math-optimizations",
                       "-fassociative-math", "--use_fast_math", "-use_fast_math")
_FAST_MATH_SETTINGS = {"prec-div": "false", "prec-sqrt": "false", "ftz": "true"}


def is_fast_math_flag(flag: str) -> bool:
    """-ffast-math and its parts for gcc/clang; --use_fast_math, -prec-div=false, -prec-sqrt=false
    and -ftz=true for nvcc (one or two leading dashes)."""
    if flag in _FAST_MATH_PREFIXES:
        return True
    name, _, value = flag.lstrip("-").partition("=")
    return _FAST_MATH_SETTINGS.get(name) == value.lower()


@dataclass(frozen=True)
class BuildSide:
    """What made one environment's build, as its run recorded it."""

    environment: str
    compiler: str | None            # the host compiler's --version line (or the variant's compiler name)
    nvcc: str | None                # nvcc's release line; None for a CPU build
    cflags: tuple[str, ...] = ()    # the tree's host flags, then the variant's
    cuda_cflags: tuple[str, ...] = ()
    defines: tuple[str, ...] = ()   # the tree's build.defines as the -Dname=value flags they compile as

    @classmethod
    def from_detail(cls, environment: str, detail: dict[str, Any] | None) -> "BuildSide":
        """From a run's environment detail (worker/jobs/run.py writes toolchain, build_variant and,
        for a torch-extension build, build_flags)."""
        detail = detail or {}
        toolchain = detail.get("toolchain") or {}
        variant = detail.get("build_variant") or {}
        tree = detail.get("build_flags") or {}
        return cls(environment=environment,
                   compiler=toolchain.get("cxx_version") or variant.get("compiler"),
                   nvcc=toolchain.get("nvcc_version"),
                   cflags=tuple(tree.get("cflags") or ()) + tuple(variant.get("cflags") or ()),
                   cuda_cflags=tuple(tree.get("cuda_cflags") or ()) + tuple(variant.get("cuda_cflags") or ()),
                   defines=define_flags(tree.get("defines")))

    @property
    def flags(self) -> tuple[str, ...]:
        return self.cflags + self.cuda_cflags + self.defines


def define_flags(defines: dict[str, Any] | None) -> tuple[str, ...]:
    """build.defines as they reach the compilers (BuildConfig.define_flags): -Dname=value, sorted."""
    return tuple(f"-D{name}={value}" for name, value in sorted((defines or {}).items()))


@dataclass(frozen=True)
class BuildDifference:
    """What differs between build A and build B: flags B has and A has not (`added`), flags A has
    and B has not (`removed`), and the compilers where they differ."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    compilers: tuple[str | None, str | None] | None = None   # (A's, B's) host compilers, or nvcc's

    @property
    def contraction(self) -> tuple[str, ...]:
        return tuple(f for f in self.added + self.removed if is_contraction_flag(f))

    @property
    def fast_math(self) -> tuple[str, ...]:
        return tuple(f for f in self.added + self.removed if is_fast_math_flag(f))


def build_difference(a: BuildSide, b: BuildSide) -> BuildDifference:
    """The flags each build has that the other has not (in their order), and the compilers when
    their version lines differ (the host compiler's first, else nvcc's)."""
    compilers = None
    if a.compiler != b.compiler:
        compilers = (a.compiler, b.compiler)
    elif a.nvcc != b.nvcc:
        compilers = (a.nvcc, b.nvcc)
    return BuildDifference(added=tuple(f for f in b.flags if f not in a.flags),
                           removed=tuple(f for f in a.flags if f not in b.flags), compilers=compilers)


def build_change(commit: BuildSide, baseline: BuildSide) -> dict[str, Any] | None:
    """What differs between a commit's build and its baseline's, JSON-ready for a verdict's detail
    (service/core/attribution_view.py words it): the flags (defines included) the commit's build
    has and the baseline's has not (`flags_added`) and the reverse (`flags_removed`), and the
    compilers where their version lines differ; None when the builds were made alike."""
    difference = build_difference(baseline, commit)
    if not difference.added and not difference.removed and difference.compilers is None:
        return None
    return {"flags_added": list(difference.added), "flags_removed": list(difference.removed),
            "compilers": None if difference.compilers is None else {"baseline": difference.compilers[0],
                                                                     "commit": difference.compilers[1]}}


def build_change_of_runs(commit_detail: dict[str, Any] | None,
                         baseline_detail: dict[str, Any] | None) -> dict[str, Any] | None:
    """build_change from the two runs' environment details (their recorded toolchain, variant and
    tree flags); None when either has recorded no build."""
    if not commit_detail or not baseline_detail:
        return None
    return build_change(BuildSide.from_detail("commit", commit_detail), BuildSide.from_detail("baseline", baseline_detail))


@dataclass(frozen=True)
class LooksLike:
    """One changed case of B against A: the numerical class, the looks-like call (`kind`), the
    label a reader reads, and the evidence behind it (flags, compilers, ulps)."""

    numerical_class: str
    kind: str
    label: str
    evidence: dict[str, Any] = field(default_factory=dict)


def _ulps(stored: dict, key: str) -> float | None:
    value = stored.get(key)
    return float(value) if isinstance(value, (int, float)) else None


def looks_like(stored: dict, a: BuildSide, b: BuildSide) -> LooksLike:
    """The call for one case, from its stored attribution (worker/attribution/analysis.py's dict,
    or {"error": ...}, or a sampled-out entry) and the two builds."""
    difference = build_difference(a, b)
    numerical = "unknown" if "error" in stored else str(stored.get("class") or "unknown")
    evidence: dict[str, Any] = {
        "flags_added": list(difference.added), "flags_removed": list(difference.removed),
        "compilers": None if difference.compilers is None else {"a": difference.compilers[0],
                                                                  "b": difference.compilers[1]},
        "first_divergent_step": stored.get("first_divergent_step"),
        "first_step_ulps": _ulps(stored, "first_step_ulps"), "peak_ulps": _ulps(stored, "peak_ulps"),
        # why the analysis called it so (a drift, a state beyond rounding, a probe), in its words
        "note": stored.get("error") or stored.get("note"),
    }
    # A semantic call whose size is within rounding (the analysis's `scale`) and names no variant
    # rests on a one-way drift below one ulp (worker/attribution/drift.py); one its probe made rests
    # on the probe's size (worker/attribution/probe.py: the same case at more elements).
    probe = stored.get("probe") if isinstance(stored.get("probe"), dict) else None
    one_way = (stored.get("scale") == ROUNDING_CLASS and not stored.get("variant")
               and (probe is None or probe.get("class") in (None, ROUNDING_CLASS) or probe.get("scale") == ROUNDING_CLASS))
    evidence["one_way"] = bool(one_way and numerical in BEYOND_ROUNDING_CLASSES)
    if numerical == ROUNDING_CLASS:
        if difference.fast_math:
            kind, named = FAST_MATH, difference.fast_math
        elif difference.contraction:
            kind, named = FMA_CONTRACTION, difference.contraction
        elif difference.compilers is not None:
            kind, named = ANOTHER_COMPILER, difference.added + difference.removed
        else:
            kind, named = ROUNDING_ONLY, difference.added + difference.removed
    elif numerical in BEYOND_ROUNDING_CLASSES and one_way and (difference.fast_math or difference.contraction
                                                                or difference.compilers is not None):
        # Within rounding in size, but its roundings fall one way (the drift test, or its probe):
        # a contraction or a fast-math rewrite can bias a low-precision trajectory below one ulp.
        # Said as what it looks like, and as one-way: never as a plain rounding.
        kind, named = ((FAST_MATH, difference.fast_math) if difference.fast_math
                       else (FMA_CONTRACTION, difference.contraction) if difference.contraction
                       else (ANOTHER_COMPILER, difference.added + difference.removed))
    elif numerical in BEYOND_ROUNDING_CLASSES:
        kind, named = ((FAST_MATH, difference.fast_math) if difference.fast_math
                       else (BEYOND_ROUNDING, difference.added + difference.removed))
    else:
        kind, named = NOT_ATTRIBUTED, ()
    evidence["flags"] = list(named)
    label = wording.environment_looks_like(
        kind, numerical_class=numerical, a=a.environment, b=b.environment, flags=list(named),
        flags_added=difference.added, compilers=difference.compilers,
        first_step=evidence["first_divergent_step"], first_step_ulps=evidence["first_step_ulps"],
        peak_ulps=evidence["peak_ulps"], variant_label=stored.get("label") if stored.get("variant") else None,
        note=stored.get("error") or stored.get("note"), one_way=evidence["one_way"])
    return LooksLike(numerical_class=numerical, kind=kind, label=label, evidence=evidence)
