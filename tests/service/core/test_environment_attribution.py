"""The looks-like call of a build variant's changed case (service/core/environment_attribution.py):
the numerical class of worker/attribution combined with what differs between the two builds, and
a label that names its evidence (the flag, the ulps, the compilers). Pure: run details as a worker
records them (worker/jobs/run.py: toolchain, build_variant, build_flags)."""

from __future__ import annotations

import pytest

from service.core.environment_attribution import BuildSide, build_difference, is_fast_math_flag, looks_like

GCC = {"cxx": "/usr/bin/g++-12", "cxx_version": "g++ (Debian 12.2.0-14) 12.2.0"}
TREE = {"cflags": ["-O3"], "cuda_cflags": ["--fmad=false"], "defines": []}


def side(environment: str, *, cflags: tuple[str, ...] = (), cuda_cflags: tuple[str, ...] = (),
         compiler: str | None = None, toolchain: dict | None = None) -> BuildSide:
    variant = ({"compiler": compiler, "cflags": list(cflags), "cuda_cflags": list(cuda_cflags), "cuda_archs": None}
               if cflags or cuda_cflags or compiler else None)
    return BuildSide.from_detail(environment, {"toolchain": toolchain or GCC, "build_variant": variant,
                                               "build_flags": TREE})


BASE = side("cpu")
ROUNDING = {"class": "rounding-level", "first_divergent_step": 1, "first_step_ulps": 1.0, "peak_ulps": 19.0,
            "variant": None}
SEMANTIC = {"class": "semantic", "first_divergent_step": 1, "first_step_ulps": 3.0e4, "peak_ulps": 2.5e5,
            "variant": None, "label": "unexplained"}


@pytest.mark.parametrize("flag", ["-mfma", "-ffp-contract=fast"])
def test_rounding_level_with_a_contraction_flag_looks_like_fma_contraction_and_names_it(flag: str) -> None:
    call = looks_like(ROUNDING, BASE, side("cpu+fma", cflags=(flag,)))
    assert (call.numerical_class, call.kind) == ("rounding-level", "fma-contraction")
    assert call.label.startswith("looks like FMA contraction: rounding-level")
    assert f"cpu+fma builds with {flag}, cpu without" in call.label
    assert "1.000e+00 ulp at step 1" in call.label and "1.900e+01 ulp at most" in call.label
    assert call.evidence["flags"] == [flag] and call.evidence["flags_added"] == [flag]


def test_nvcc_contraction_and_a_flag_the_variant_removes_are_named_from_the_right_side() -> None:
    fmad = looks_like(ROUNDING, side("gpu.sm90"), side("gpu.sm90+fmad", cuda_cflags=("--fmad=true",)))
    assert fmad.kind == "fma-contraction" and "gpu.sm90+fmad builds with --fmad=true" in fmad.label
    # Asked the other way round (A the variant): the flag is A's, and the label says so.
    reverse = looks_like(ROUNDING, side("cpu+fma", cflags=("-mfma",)), BASE)
    assert reverse.kind == "fma-contraction" and "cpu+fma builds with -mfma, cpu without" in reverse.label
    assert reverse.evidence["flags_removed"] == ["-mfma"]


@pytest.mark.parametrize(("flag", "words"), [("-ffast-math", "a fast-math reciprocal"),
                                             ("-freciprocal-math", "a fast-math reciprocal"),
                                             ("--use_fast_math", "a fast-math reciprocal"),
                                             ("-prec-div=false", "a fast-math reciprocal"),
                                             ("-ftz=true", "flush-to-zero of subnormals")])
def test_a_fast_math_flag_is_named_with_what_it_approximates(flag: str, words: str) -> None:
    assert is_fast_math_flag(flag)
    call = looks_like(ROUNDING, BASE, side("cpu+fast", cflags=(flag,)))
    assert call.kind == "fast-math" and call.label.startswith(f"looks like {words}: rounding-level")
    assert flag in call.label


def test_settings_that_turn_fast_math_off_are_not_fast_math() -> None:
    assert not any(is_fast_math_flag(f) for f in ("-prec-div=true", "-ftz=false", "-O3", "-fno-fast-math"))


def test_another_compiler_rounding_level_names_both_compilers() -> None:
    clang = side("cpu+clang", compiler="clang++", toolchain={"cxx": "/usr/bin/clang-14",
                                                               "cxx_version": "Debian clang version 14.0.6"})
    call = looks_like(ROUNDING, BASE, clang)
    assert call.kind == "another-compiler"
    assert call.label.startswith("rounding-level (another compiler)")
    assert "cpu built by g++ (Debian 12.2.0-14) 12.2.0, cpu+clang by Debian clang version 14.0.6" in call.label
    assert build_difference(BASE, clang).compilers == (GCC["cxx_version"], "Debian clang version 14.0.6")


def test_beyond_rounding_is_said_plainly_whatever_flag_differs() -> None:
    call = looks_like(SEMANTIC, BASE, side("cpu+fma", cflags=("-mfma",)))
    assert (call.numerical_class, call.kind) == ("semantic", "beyond-rounding")
    assert call.label.startswith("beyond rounding (semantic): 2.500e+05 ulp at its peak from step 1")
    assert "FMA contraction" not in call.label and "not a rounding difference" in call.label
    assert "cpu+fma builds with -mfma, cpu without" in call.label  # what differs, for the reader


def test_fast_math_beyond_rounding_says_beyond_rounding_first() -> None:
    call = looks_like(SEMANTIC, BASE, side("cpu+fast", cflags=("-ffast-math",)))
    assert call.kind == "fast-math"
    assert call.label.startswith("beyond rounding (semantic)") and "taken past a rounding" in call.label


def test_rounding_level_with_nothing_that_explains_it_says_what_differs_or_that_nothing_does() -> None:
    same = looks_like(ROUNDING, BASE, side("cpu.other"))
    assert same.kind == "rounding-level" and "no flag or compiler differs" in same.label
    o2 = looks_like(ROUNDING, BASE, side("cpu+o2", cflags=("-O2",)))
    assert o2.kind == "rounding-level" and "cpu+o2 builds with -O2, cpu without" in o2.label


def test_a_case_not_analysed_is_not_attributed_with_the_reason() -> None:
    sampled = {"class": "unknown", "note": "only a sample is analysed", "sampled_out": True}
    assert looks_like(sampled, BASE, side("cpu+fma", cflags=("-mfma",))).label == \
        "not attributed: only a sample is analysed"
    failed = looks_like({"error": "the case did not run on both builds again"}, BASE, BASE)
    assert failed.kind == "not-attributed" and "did not run on both builds" in failed.label


ONE_WAY = {"class": "semantic", "scale": "rounding-level", "first_divergent_step": 1, "first_step_ulps": 0.0,
           "peak_ulps": 1.0, "variant": None, "label": "unexplained",
           "note": "within rounding on its 1031 elements; 9 elements moved, too few for the drift test; the same "
                   "case at n=16384 reads semantic: a drift below one ulp, one way: 121 of the 122 elements"}


def test_a_contraction_whose_roundings_fall_one_way_is_said_to_drift_never_plain_rounding() -> None:
    # Within rounding in size, one way in sign (the drift test or its probe): a contraction can
    # bias a float16 trajectory below one ulp. It is what it looks like, and it drifts.
    call = looks_like(ONE_WAY, side("gpu.sm90"), side("gpu.sm90+fmad", cuda_cflags=("--fmad=true",)))
    assert (call.numerical_class, call.kind) == ("semantic", "fma-contraction") and call.evidence["one_way"]
    assert call.label.startswith("looks like FMA contraction: within rounding but drifting one way")
    assert "rounding-level" not in call.label.split(";")[0]
    fast = looks_like(ONE_WAY, BASE, side("cpu+fast", cflags=("-ffast-math",)))
    assert fast.kind == "fast-math" and "drifting one way" in fast.label
    # Beyond rounding in size stays beyond rounding, whatever flag differs; so does a named variant.
    assert looks_like({**ONE_WAY, "scale": "semantic"}, BASE, side("cpu+fma", cflags=("-mfma",))).kind == "beyond-rounding"
    assert looks_like({**ONE_WAY, "variant": "decay_after_update"}, BASE,
                      side("cpu+fma", cflags=("-mfma",))).kind == "beyond-rounding"
    # A call its probe made rests on the probe: a drift there is one way, beyond rounding there is not.
    drifting_probe = {**ONE_WAY, "probe": {"class": "semantic", "scale": "rounding-level"}}
    assert looks_like(drifting_probe, BASE, side("cpu+fma", cflags=("-mfma",))).kind == "fma-contraction"
    larger_probe = {**ONE_WAY, "probe": {"class": "semantic", "scale": "semantic"}}
    assert looks_like(larger_probe, BASE, side("cpu+fma", cflags=("-mfma",))).kind == "beyond-rounding"
    # With nothing that could explain it, a one-way drift is beyond rounding, plainly.
    assert looks_like(ONE_WAY, BASE, side("cpu+x", cflags=("-DX",))).kind == "beyond-rounding"



def test_a_headline_counts_the_one_way_drifts_apart():
    from service.core.wording import headline_kind, looks_like_headline

    gpu, fmad = side("gpu.sm90"), side("gpu.sm90+fmad", cuda_cflags=("--fmad=true",))
    calls = [looks_like(ROUNDING, gpu, fmad)] * 3 + [looks_like(ONE_WAY, gpu, fmad)]
    line = looks_like_headline([(headline_kind(c.kind, c.evidence), tuple(c.evidence["flags"])) for c in calls])
    assert line == ("looks like FMA contraction, --fmad=true (3); "
                    "looks like FMA contraction, drifting one way, --fmad=true (1)")
