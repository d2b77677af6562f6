"""Compiler flags are an allow-list of shapes (issue 43): a tree's build.cflags / cuda_cflags /
defines and an operator's build variants pass only flags of the shapes in
service/core/compiler_flags.py; every exploit shape the review found, and every option that would
take the next list item as its value, is refused with the field, the flag and what is allowed."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings, strategies as st

from service.core.compiler_flags import (
    HOST_F_FLAGS, SAFE_CHARACTERS, build_flags_problem, flag_problem, matching_shapes,
)
from service.core.environments import BuildVariant
from service.core.project_config import BuildConfig, ProjectConfigError, parse_config
from service.settings import Settings


def _extension(build_lines: str):  # noqa: ANN202
    return parse_config(f'[build]\nkind = "torch-extension"\n{build_lines}\n')


# ---------------------------------------------------------------- what passes
HOST_ALLOWED = [
    "-O0", "-O2", "-O3", "-Os", "-Ofast", "-Og", "-DUSE_AVX2=1", "-DNDEBUG", "-DX=", "-DVERSION=1.2-rc+3", "-UX",
    "-std=c++17", "-std=gnu++20", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-variable", "-Werror",
    "-Werror=format", "-Wframe-larger-than=4096", "-march=native", "-mtune=generic", "-march=x86-64-v3",
    "-mcpu=native", "-mavx2", "-mfma", "-mno-fma", "-mavx512f", "-mprefer-vector-width=256",
    "-g", "-g0", "-g3", "-ggdb", "-gdwarf-5", *sorted(HOST_F_FLAGS),
]
NVCC_ALLOWED = [
    "-O3", "-DUSE_CUDA=1", "-UX", "-std=c++17", "-g", "-G", "-lineinfo", "--generate-line-info",
    "--fmad=true", "--fmad=false", "-fmad=true", "--use_fast_math", "-use_fast_math", "--ftz=true", "-ftz=false",
    "--prec-div=false", "-prec-sqrt=true", "--expt-relaxed-constexpr", "--expt-extended-lambda", "--restrict",
    "--maxrregcount=64", "-arch=sm_90", "-arch=sm_90a", "-code=sm_80", "-gencode=arch=compute_90,code=sm_90",
    "--generate-code=arch=compute_80,code=compute_80", "-Xptxas=-v", "-Xptxas=-v,-O3,--warn-on-spills",
    "-Xcompiler=-O3", "-Xcompiler=-march=native,-ffp-contract=off", "--compiler-options=-fPIC",
    "-Werror=all-warnings", "-Wno-deprecated-gpu-targets",
]


@pytest.mark.parametrize("flag", HOST_ALLOWED)
def test_host_flags_of_the_allowed_shapes_pass(flag: str) -> None:
    assert flag_problem(flag, "host") is None, flag_problem(flag, "host")


@pytest.mark.parametrize("flag", NVCC_ALLOWED)
def test_nvcc_flags_of_the_allowed_shapes_pass(flag: str) -> None:
    assert flag_problem(flag, "nvcc") is None, flag_problem(flag, "nvcc")


def test_the_flags_the_repository_uses_pass() -> None:
    """The docs' and tests' trees and variants (PROJECTS.md, ENVIRONMENTS.md, bench/gpu) and the
    recipe's own flags (worker/build/extension.py) are all inside the allow-list."""
    from worker.build.extension import DEFAULT_CFLAGS, DEFAULT_CUDA_CFLAGS

    config = _extension('cflags = ["-march=native"]\ncuda_cflags = ["-Xptxas=-v", "--use_fast_math"]\n'
                        'defines = { USE_AVX2 = "1" }')
    assert config.build.cflags == ["-march=native"] and config.build.define_flags() == ["-DUSE_AVX2=1"]
    assert all(flag_problem(flag, "host") is None for flag in DEFAULT_CFLAGS)
    assert all(flag_problem(flag, "nvcc") is None for flag in DEFAULT_CUDA_CFLAGS)
    documented = json.loads('{"fma": {"cflags": ["-mfma"]}, "nocontract": {"cflags": ["-ffp-contract=off"]}, '
                            '"clang": {"compiler": "clang++"}, "fmad": {"cuda_cflags": ["--fmad=true"]}, '
                            '"ptx80": {"cuda_archs": ["8.0+PTX"]}, "fastmath": {"cuda_cflags": ["--use_fast_math"]}, '
                            '"o2": {"cflags": ["-O2"]}, "fast": {"cflags": ["-ffast-math"]}}')
    assert set(Settings(build_variants=documented).build_variants) == set(documented)


# ---------------------------------------------------------------- what is refused, and the words
# (list items, field) -> the flag the message must name.
EXPLOITS = [
    (["-O2", "-wrapper", "sh,src/wrap.h"], "cflags", "-wrapper"),
    (["sh,src/wrap.h"], "cflags", "sh,src/wrap.h"),
    (["-fplugin=./x.so"], "cflags", "-fplugin=./x.so"),
    (["-fplugin-arg-x-y=1"], "cflags", "-fplugin-arg-x-y=1"),
    (["-B."], "cflags", "-B."),
    (["-Bsrc"], "cflags", "-Bsrc"),
    (["-specs=x"], "cflags", "-specs=x"),
    (["--specs=x"], "cflags", "--specs=x"),
    (["@args.txt"], "cflags", "@args.txt"),
    (["-include", "x.h"], "cflags", "-include"),
    (["-includex.h"], "cflags", "-includex.h"),
    (["-imacros", "x.h"], "cflags", "-imacros"),
    (["-Wl,-rpath,."], "cflags", "-Wl,-rpath,."),
    (["-Wa,-ahl=x"], "cflags", "-Wa,-ahl=x"),
    (["-Wp,-MD,x"], "cflags", "-Wp,-MD,x"),
    (["-Xlinker", "-rpath"], "cflags", "-Xlinker"),
    (["-Xclang", "-load"], "cflags", "-Xclang"),
    (["-mllvm", "-O2"], "cflags", "-mllvm"),
    (["-o", "x"], "cflags", "-o"),
    (["-Isrc"], "cflags", "-Isrc"),
    (["-isystem", "src"], "cflags", "-isystem"),
    (["-L."], "cflags", "-L."),
    (["-lm"], "cflags", "-lm"),
    (["-fprofile-use=x"], "cflags", "-fprofile-use=x"),
    (["-fdump-tree-all"], "cflags", "-fdump-tree-all"),
    (["-save-temps"], "cflags", "-save-temps"),
    (["-DX=1;sh<src/w.h"], "cflags", "-DX=1;sh<src/w.h"),  # ninja runs the line through /bin/sh
    (["-DX=`sh<w`"], "cflags", "-DX=`sh<w`"),
    (["-DX=a,b"], "cflags", "-DX=a,b"),
    (["-Xcompiler", "-wrapper"], "cuda_cflags", "-Xcompiler"),
    (["-Xcompiler=-wrapper,sh,srcwrap"], "cuda_cflags", "-Xcompiler=-wrapper,sh,srcwrap"),
    (["-Xcompiler=-O3,-fplugin=x"], "cuda_cflags", "-Xcompiler=-O3,-fplugin=x"),
    (["--compiler-options=-B."], "cuda_cflags", "--compiler-options=-B."),
    (["-ccbin=."], "cuda_cflags", "-ccbin=."),
    (["-ccbin", "src"], "cuda_cflags", "-ccbin"),
    (["--compiler-bindir=src"], "cuda_cflags", "--compiler-bindir=src"),
    (["--options-file=x"], "cuda_cflags", "--options-file=x"),
    (["-Xptxas=-o,x"], "cuda_cflags", "-Xptxas=-o,x"),
    (["-Xnvlink=x"], "cuda_cflags", "-Xnvlink=x"),
    (["-odir=x"], "cuda_cflags", "-odir=x"),
    (["-march=native"], "cuda_cflags", "-march=native"),  # not nvcc's: host flags go through -Xcompiler=
    (["-lineinfo"], "cflags", "-lineinfo"),  # gcc reads it as -l ineinfo
]


@pytest.mark.parametrize(("items", "field", "flag"), EXPLOITS, ids=[e[2] for e in EXPLOITS])
def test_each_exploit_shape_is_refused_naming_the_field_index_and_flag(items: list[str], field: str,
                                                                       flag: str) -> None:
    with pytest.raises(ProjectConfigError) as refused:
        _extension(f"{field} = {json.dumps(items)}")
    index = items.index(flag)
    message = str(refused.value)
    assert f"build.{field}[{index}] {flag!r} is not an allowed compiler flag" in message, message
    assert "allowed are" in message and message.endswith("remove it")


def test_the_message_says_what_is_allowed_for_each_compiler() -> None:
    host = flag_problem("-wrapper", "host")
    assert host is not None and "-O0..-O3" in host and "-march=native" in host and "-ffp-contract=off" in host
    nvcc = flag_problem("-ccbin=.", "nvcc")
    assert nvcc is not None and "--fmad=" in nvcc and "-gencode=arch=compute_XX,code=sm_XX" in nvcc
    assert "include the tree's headers relative to the source file" in flag_problem("-Isrc", "host")
    assert "write -Xcompiler=<flag>,<flag> in one item" in flag_problem("-Xcompiler", "nvcc")
    assert "-Xcompiler's item '-wrapper' is not an allowed host flag" in \
        flag_problem("-Xcompiler=-wrapper,sh", "nvcc")


# Options that read their value from the NEXT argument. Written bare, each would make the next list
# item (checked as a flag of its own) something else: a file, a program, a folder.
GCC_CLANG_TAKE_NEXT_ITEM = [
    "-o", "-x", "-I", "-L", "-l", "-D", "-U", "-B", "-T", "-u", "-z", "-include", "-imacros", "-isystem",
    "-iquote", "-idirafter", "-iprefix", "-isysroot", "-MF", "-MT", "-MQ", "-aux-info", "--param", "-Xlinker",
    "-Xassembler", "-Xpreprocessor", "-Xclang", "-mllvm", "-specs", "-wrapper", "-std",
]
NVCC_TAKES_NEXT_ITEM = [
    "-o", "-x", "-I", "-L", "-l", "-D", "-U", "-include", "-isystem", "-Xlinker", "-std", "-O", "-Werror", "-m",
    "-arch", "-code", "-gencode", "--gpu-architecture", "--generate-code", "-Xptxas", "--ptxas-options",
    "-Xcompiler", "--compiler-options", "-Xnvlink", "-Xarchive", "-Xfatbin", "-ccbin", "--compiler-bindir",
    "-odir", "--output-directory", "-optf", "--options-file", "--fmad", "-fmad", "--ftz", "--prec-div",
    "--prec-sqrt", "--maxrregcount", "-maxrregcount", "-t", "--threads",
]


@pytest.mark.parametrize("option", GCC_CLANG_TAKE_NEXT_ITEM)
def test_no_host_option_that_takes_the_next_item_is_allowed_bare(option: str) -> None:
    assert flag_problem(option, "host") is not None


@pytest.mark.parametrize("option", NVCC_TAKES_NEXT_ITEM)
def test_no_nvcc_option_that_takes_the_next_item_is_allowed_bare(option: str) -> None:
    assert flag_problem(option, "nvcc") is not None


def test_a_value_glued_with_equals_is_the_way_to_write_one() -> None:
    assert "write both in one item" in flag_problem("-std", "host")
    assert flag_problem("-std=c++17", "host") is None and flag_problem("--fmad=true", "nvcc") is None


@pytest.mark.parametrize(("name", "value", "words"), [
    ("X", "1;sh<src/w.h", "build.defines.X"), ("X", "`id`", "build.defines.X"), ("X", "a b", "build.defines.X"),
    ("X", "a,b", "build.defines.X"), ("X", "../x", "build.defines.X"), ("1BAD", "1", "not a C identifier"),
])
def test_a_define_becomes_an_allowed_d_flag_or_is_refused(name: str, value: str, words: str) -> None:
    with pytest.raises(ProjectConfigError, match=re.escape(words)):
        _extension(f"defines = {{ {json.dumps(name)} = {json.dumps(value)} }}")


# ---------------------------------------------------------------- operator build variants
def test_a_variant_is_held_to_the_same_allow_list_with_the_field_named() -> None:
    with pytest.raises(ValueError, match=r"build variant cflags\[0\] '-wrapper' is not an allowed compiler flag"):
        BuildVariant(cflags=("-wrapper", "sh,x"))
    with pytest.raises(ValueError, match=r"build variant cuda_cflags\[1\] '-Xcompiler' is not an allowed"):
        BuildVariant(cuda_cflags=("--fmad=true", "-Xcompiler", "-wrapper"))
    with pytest.raises(ValueError, match=r"build variant cflags\[0\] '-Wl,-z,now'"):
        Settings(build_variants={"hardened": {"cflags": ["-Wl,-z,now"]}})
    assert BuildVariant(cflags=("-O2", "-mfma"), cuda_cflags=("--fmad=true",)).cflags == ("-O2", "-mfma")


def test_the_worker_s_recheck_names_a_flag_that_skipped_validation() -> None:
    """build_flags_problem is what worker.build.project.build_project calls first; objects made
    with model_construct skip every validator."""
    assert build_flags_problem(BuildConfig(cflags=["-O2"]), BuildVariant(cflags=("-mfma",))) is None
    tree = BuildConfig.model_construct(cflags=["-O2", "-wrapper", "sh,src/wrap.h"], cuda_cflags=[], defines={})
    assert build_flags_problem(tree).startswith("build.cflags[1] '-wrapper' is not an allowed compiler flag")
    nvcc = BuildConfig.model_construct(cflags=[], cuda_cflags=["-ccbin=."], defines={})
    assert build_flags_problem(nvcc).startswith("build.cuda_cflags[0] '-ccbin=.'")
    define = BuildConfig.model_construct(cflags=[], cuda_cflags=[], defines={"X": "1;sh<w"})
    assert build_flags_problem(define).startswith("build.defines.X")
    variant = BuildVariant.model_construct(cflags=("-B.",), cuda_cflags=(), compiler=None, cuda_archs=None)
    assert build_flags_problem(BuildConfig(), variant).startswith("build variant.cflags[0] '-B.'")


# ---------------------------------------------------------------- properties of the accepted set
# Prefixes that lead into allowed shapes and into refused ones, so that random suffixes land near
# every boundary of the list.
_PREFIXES = ["-O", "-D", "-U", "-std=", "-W", "-Wl,", "-Wno-", "-m", "-mllvm", "-march=", "-f", "-ffp-contract=",
             "-fplugin", "-g", "-gencode=arch=compute_", "-arch=sm_", "-Xptxas=", "-Xcompiler=", "--fmad=",
             "--", "-", "-B", "-I", "-l", "-o", "-specs", "-include", "@", "-wrapper", "-ccbin", ""]
_ALPHABET = "abcdefghilmnopstuwxzADEFINOSTUWX0123456789_.+=,-/@;$`<>|& \"'"
_flags = st.one_of(
    st.builds(lambda prefix, rest: prefix + rest, st.sampled_from(_PREFIXES), st.text(_ALPHABET, max_size=14)),
    st.sampled_from(HOST_ALLOWED + NVCC_ALLOWED).flatmap(lambda flag: st.builds(
        lambda cut, extra: flag[:cut] + extra, st.integers(0, len(flag)), st.text(_ALPHABET, max_size=4))),
    # nvcc's pass-through lists, of allowed host flags and of words that are not flags.
    st.builds(lambda option, items: option + ",".join(items), st.sampled_from(["-Xcompiler=", "--compiler-options="]),
              st.lists(st.one_of(st.sampled_from(HOST_ALLOWED), st.text("abcdefw-=.", min_size=1, max_size=8)),
                       min_size=1, max_size=3)),
)
_LIST_SHAPES = ("-gencode=", "--generate-code=", "-Xptxas=", "--ptxas-options=", "-Xcompiler=", "--compiler-options=")
_REFUSED_PREFIXES = ("-wrapper", "-fplugin", "-B", "-specs", "--specs", "@", "-include", "-imacros", "-I", "-L",
                     "-l", "-o", "-Wl,", "-Wa,", "-Wp,", "-Xlinker", "-Xclang", "-mllvm", "-ccbin", "--compiler-bindir",
                     "-isystem", "-iquote", "--options-file", "-optf", "-Xnvlink")


@settings(max_examples=400, deadline=None)
@given(flag=_flags, compiler=st.sampled_from(["host", "nvcc"]))
def test_an_accepted_flag_has_exactly_one_shape_and_no_dangerous_character(flag: str, compiler: str) -> None:
    if flag_problem(flag, compiler) is not None:
        return
    assert len(matching_shapes(flag, compiler)) == 1
    assert SAFE_CHARACTERS.match(flag)  # no shell, path, response-file or whitespace character
    assert not flag.startswith(_REFUSED_PREFIXES) or flag.startswith("-lineinfo") and compiler == "nvcc"
    if "," in flag:  # commas only in nvcc's own list syntax, never after -W
        assert compiler == "nvcc" and flag.startswith(_LIST_SHAPES)
    if flag.startswith(("-Xcompiler=", "--compiler-options=")):
        assert all(flag_problem(item, "host") is None for item in flag.partition("=")[2].split(","))
