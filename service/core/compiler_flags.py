"""Which compiler flags a build may carry: an allow-list of flag shapes (issue 43).

A tree's `build.cflags` / `build.cuda_cflags` / `build.defines` (service/core/project_config.py) and
an operator's build variants (service/core/environments.py) reach the compilers of a build that may
write the shared caches. torch writes them unquoted into a ninja file that `/bin/sh -c` runs, and a
compiler has many options that run programs or read files (`-wrapper sh,x`, `-fplugin=`, `-B`,
`-specs=`, `@file`, `-include`, `-Xlinker`, nvcc's `-Xcompiler` and `-ccbin`). A deny-list misses
the next one, so a flag passes only when it has one of the shapes below; everything else is
refused with the field, the flag and what is allowed.

The rules every shape keeps (tests/service/core/test_compiler_flags.py proves each):
* one list item is one whole flag: no shape is an option that takes the NEXT item as its value
  (`-std` `c++17`, `-Xcompiler` `-wrapper`, nvcc's bare `-O`/`-Werror`), so no item is read as
  anything but the flag it was checked as;
* only the characters `A-Z a-z 0-9 _ . + = , -`: no shell metacharacter (the ninja line is a shell
  command), no `/` (no path), no `@` (no response file), no whitespace;
* commas only inside nvcc's own list syntax (-gencode, -Xcompiler=, -Xptxas=), whose items are
  checked one by one; never after `-W` (`-Wl,` `-Wa,` `-Wp,` are pass-throughs to other programs).

Decisions:
* `-Ofast` is allowed: it is -O3 with -ffast-math's family, all of which are allowed one by one;
  refusing it would make nothing safer. `-O` without a level is refused (nvcc reads the next item).
* `-I`, `-isystem`, `-iquote`, `-include`, `-imacros`: refused. A header outside the build's staged
  copy of the tree is outside the build digest, so a cached library would not say what compiled it;
  a tree includes its own headers relative to the source file (`#include "sub/x.h"`).
* `-L`, `-l`, `-Wl,`, `-Xlinker`: refused. These flags compile; they do not link, and a library
  from outside the tree would be outside the digest too.
* nvcc's `-Xcompiler=a,b` (and `--compiler-options=`) is allowed when every item is an allowed host
  flag: it is the only way to give the host half of a .cu file a flag. `-Xptxas=` takes a named set
  of ptxas options. Their bare forms (value in the next item) are refused.
* `-fopenmp` is allowed: it compiles the tree's own pragmas and runs nothing at build time.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

Compiler = Literal["host", "nvcc"]

# What any accepted flag is made of (the second rule above).
SAFE_CHARACTERS = re.compile(r"^[A-Za-z0-9_.+=,-]+$")
_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
# A macro's value: a number, a word or a version; no shell, path or list character.
_DEFINE_VALUE = r"[A-Za-z0-9_.+-]*"
_STANDARD = r"(?:c|gnu)(?:89|90|99|9x|11|1x|17|18|2x|23|2y)|(?:c|gnu)\+\+(?:98|03|0x|11|1y|14|1z|17|2a|20|2b|23|2c|26)"
# -Wl -Wa -Wp without their comma are not warnings either.
_WARNING = r"-W(?![lap]$)(?:no-)?[a-z][a-z0-9+-]*(?:=[a-z0-9_+-]+)?"

# The host compiler's (gcc's, clang's) -f flags: code generation and floating-point semantics, the
# settings a trajectory drifts with. Nothing here names a file, a plugin or a program.
HOST_F_FLAGS = frozenset({
    "-ffast-math", "-fno-fast-math", "-ffp-contract=off", "-ffp-contract=on", "-ffp-contract=fast",
    "-fmath-errno", "-fno-math-errno", "-ffinite-math-only", "-fno-finite-math-only",
    "-fsigned-zeros", "-fno-signed-zeros", "-ftrapping-math", "-fno-trapping-math",
    "-freciprocal-math", "-fno-reciprocal-math", "-fassociative-math", "-fno-associative-math",
    "-funsafe-math-optimizations", "-fno-unsafe-math-optimizations", "-frounding-math", "-fno-rounding-math",
    "-fexcess-precision=fast", "-fexcess-precision=standard", "-ffp-model=precise", "-ffp-model=strict",
    "-ffp-model=fast", "-fdenormal-fp-math=ieee", "-fdenormal-fp-math=preserve-sign",
    "-fdenormal-fp-math=positive-zero", "-funroll-loops", "-fno-unroll-loops", "-ftree-vectorize",
    "-fno-tree-vectorize", "-fvectorize", "-fno-vectorize", "-fslp-vectorize", "-fno-slp-vectorize",
    "-fstrict-aliasing", "-fno-strict-aliasing", "-fomit-frame-pointer", "-fno-omit-frame-pointer",
    "-fPIC", "-fpic", "-fvisibility=hidden", "-fvisibility=default", "-fopenmp", "-fopenmp-simd",
    "-fno-semantic-interposition", "-fno-builtin",
})

# nvcc's own options, in both the `--long` and the single-dash spelling nvcc accepts.
_NVCC_BOOLEAN = r"(?:true|false)"
_NVCC_OWN = (rf"--?(?:fmad|ftz|prec-div|prec-sqrt)={_NVCC_BOOLEAN}"
             r"|--?use_fast_math|--?expt-relaxed-constexpr|--?expt-extended-lambda|--?extended-lambda"
             r"|--?restrict|--?extra-device-vectorization|--?generate-line-info|-lineinfo|-G"
             r"|--?maxrregcount=[0-9]{1,3}")
_SM = r"[0-9]{2,3}[af]?"
_NVCC_ARCH = (rf"(?:-arch|--gpu-architecture)=(?:sm|compute)_{_SM}|(?:-code|--gpu-code)=(?:sm|compute)_{_SM}"
              rf"|(?:-gencode|--generate-code)=arch=compute_{_SM},code=(?:sm|compute)_{_SM}")
# ptxas options that report or tune register allocation; none reads or writes a file.
PTXAS_OPTIONS = frozenset({
    "-v", "--verbose", "-O0", "-O1", "-O2", "-O3", "-warn-spills", "--warn-on-spills", "-warn-lmem-usage",
    "--warn-on-local-memory-usage", "-warn-double-usage", "--warn-on-double-precision-use",
    "-dlcm=ca", "-dlcm=cg", "--allow-expensive-optimizations=true", "--allow-expensive-optimizations=false",
})


@dataclass(frozen=True)
class Shape:
    name: str  # how the error message and the docs name it
    pattern: re.Pattern[str]


def _shape(name: str, pattern: str) -> Shape:
    return Shape(name, re.compile(rf"^(?:{pattern})$"))


def _named(name: str, flags: Iterable[str]) -> Shape:
    return _shape(name, "|".join(re.escape(flag) for flag in sorted(flags)))


_COMMON = (
    _shape("-O0..-O3, -Os, -Oz, -Og, -Ofast", r"-O(?:[0-3]|s|z|g|fast)"),
    _shape("-D<name>[=value]", rf"-D{_IDENTIFIER}(?:={_DEFINE_VALUE})?"),
    _shape("-U<name>", rf"-U{_IDENTIFIER}"),
    _shape("-std=<c or c++ standard>", rf"-std=(?:{_STANDARD})"),
)
HOST_SHAPES: tuple[Shape, ...] = (
    *_COMMON,
    # No comma: -Wl, -Wa, -Wp, hand their items to the linker, assembler and preprocessor.
    _shape("-W<warning>", _WARNING),
    # Target words (-mavx2, -mno-fma, -march=native). -mllvm hands the next item to LLVM.
    _shape("-m<target> (-march=, -mtune=, -mavx2, -mno-fma, ...)",
           r"-m(?!llvm)(?:no-)?[a-z0-9][a-z0-9.-]*(?:=[a-z0-9_.+-]+)?"),
    _named("the named -f flags (HOST_F_FLAGS)", HOST_F_FLAGS),
    _shape("-g, -g0..-g3, -ggdb, -gdwarf-4/5, -gline-tables-only",
           r"-g(?:[0-3]?|gdb[0-3]?|dwarf(?:-[2-5])?|line-tables-only)"),
)
_XPTXAS = rf"(?:-Xptxas|--ptxas-options)=(?:{'|'.join(re.escape(o) for o in sorted(PTXAS_OPTIONS))})" \
          rf"(?:,(?:{'|'.join(re.escape(o) for o in sorted(PTXAS_OPTIONS))}))*"
NVCC_SHAPES: tuple[Shape, ...] = (
    *_COMMON,
    # nvcc's -Werror takes the next item as its kinds: only -Werror=<kind>.
    _shape("-W<warning> (-Werror=<kind>, not a bare -Werror)", rf"(?!-Werror$){_WARNING}"),
    _shape("-g", r"-g"),
    _shape("nvcc's --fmad= --ftz= --prec-div= --prec-sqrt= (true|false), --use_fast_math, "
           "--expt-relaxed-constexpr, --expt-extended-lambda, --restrict, -lineinfo, -G, --maxrregcount=N",
           _NVCC_OWN),
    _shape("-arch=sm_XX, -code=sm_XX, -gencode=arch=compute_XX,code=sm_XX", _NVCC_ARCH),
    _shape("-Xptxas=<" + " ".join(sorted(PTXAS_OPTIONS)) + ">", _XPTXAS),
    # Checked item by item against the host shapes in flag_problem.
    _shape("-Xcompiler=<allowed host flags, comma-separated>", r"(?:-Xcompiler|--compiler-options)=[^,]+(?:,[^,]+)*"),
)
SHAPES: Mapping[Compiler, tuple[Shape, ...]] = {"host": HOST_SHAPES, "nvcc": NVCC_SHAPES}

_ALLOWED_SUMMARY = {
    "host": "-O0..-O3/-Os/-Ofast, -D<name>[=value], -U<name>, -std=<standard>, -W<warning> (no commas), "
            "-m<target> (-march=native, -mavx2, -mno-fma), -g*, and the -f flags " + ", ".join(sorted(HOST_F_FLAGS)),
    "nvcc": "-O0..-O3, -D<name>[=value], -U<name>, -std=<standard>, -W<warning>, -g, -G, -lineinfo, "
            "--fmad=/--ftz=/--prec-div=/--prec-sqrt=true|false, --use_fast_math, --expt-relaxed-constexpr, "
            "--expt-extended-lambda, --restrict, --maxrregcount=N, -arch=sm_XX, "
            "-gencode=arch=compute_XX,code=sm_XX, -Xptxas=-v (and a few ptxas options), "
            "-Xcompiler=<allowed host flags>",
}


def matching_shapes(flag: str, compiler: Compiler) -> list[Shape]:
    """The shapes of `compiler`'s allow-list that `flag` has (a flag the list takes has exactly one)."""
    return [shape for shape in SHAPES[compiler] if shape.pattern.match(flag)]


# Allowed shapes written without their value: the compiler would take the next item as the value.
_VALUE_IN_NEXT_ITEM = frozenset({
    "-std", "-D", "-U", "-Werror", "-arch", "-code", "-gencode", "--gpu-architecture", "--gpu-code",
    "--generate-code", "-Xptxas", "--ptxas-options", "--fmad", "-fmad", "--ftz", "-ftz", "--prec-div",
    "-prec-div", "--prec-sqrt", "-prec-sqrt", "--maxrregcount", "-maxrregcount",
})


def _why_refused(flag: str) -> str:
    """A reason for the flags a tree is likely to try, beyond 'not on the list'."""
    if any(c.isspace() for c in flag) or "\x00" in flag:
        return "one list item is one flag, without whitespace or NUL"
    if flag.startswith(("-I", "-isystem", "-iquote", "-idirafter", "-include", "-imacros")):
        return "include folders and forced includes are refused (a header outside the tree is outside the " \
               "build digest); include the tree's headers relative to the source file"
    if flag in ("-Xcompiler", "--compiler-options"):
        return "its flags would be the next item; write -Xcompiler=<flag>,<flag> in one item, each an " \
               "allowed host flag"
    if flag in _VALUE_IN_NEXT_ITEM:
        return "its value would be the next item; write both in one item (-std=c++17, --fmad=true, -DNAME=1)"
    if not SAFE_CHARACTERS.match(flag):
        return "a flag is made of letters, digits and _ . + = , - only (no shell, path or '@' character)"
    return ""


def flag_problem(flag: str, compiler: Compiler) -> str | None:
    """Why `flag` may not be given to `compiler` ('host': gcc/clang, 'nvcc'), or None if it may."""
    if SAFE_CHARACTERS.match(flag) and len(matching_shapes(flag, compiler)) == 1:
        if flag.startswith(("-Xcompiler=", "--compiler-options=")):
            for item in flag.partition("=")[2].split(","):
                if flag_problem(item, "host") is not None:
                    return f"-Xcompiler's item {item[:80]!r} is not an allowed host flag: allowed are " \
                           f"{_ALLOWED_SUMMARY['host']}"
        return None
    reason = _why_refused(flag)
    return f"{reason + '; ' if reason else ''}allowed are {_ALLOWED_SUMMARY[compiler]}"


def refused_flag_message(flags: Iterable[str], field: str, compiler: Compiler) -> str | None:
    """The error for the first refused flag of `flags` (`field[i] 'flag' is not ...`), None if all pass."""
    for index, flag in enumerate(flags):
        problem = flag_problem(flag, compiler)
        if problem is not None:
            return f"{field}[{index}] {flag[:120]!r} is not an allowed compiler flag: {problem}; remove it"
    return None


def check_flags(flags: Iterable[str], field: str, compiler: Compiler) -> None:
    """Raise ValueError naming the field, the flag and what is allowed, for the first refused flag."""
    message = refused_flag_message(flags, field, compiler)
    if message is not None:
        raise ValueError(message)


def define_problem(name: str, value: str) -> str | None:
    """Why `defines = { name = value }` may not be compiled (its -Dname=value flag), or None."""
    if not re.fullmatch(_IDENTIFIER, name):
        return f"build.defines: {name[:80]!r} is not a C identifier (letters, digits, '_', not starting with a digit)"
    if not re.fullmatch(_DEFINE_VALUE, value):
        return (f"build.defines.{name} = {value[:80]!r}: a value is a number or word of letters, digits and "
                "_ . + - (no whitespace, shell, path or list character); remove it")
    return None


def build_flags_problem(build: object, variant: object | None = None) -> str | None:
    """The first refused flag of a build (a BuildConfig: cflags, cuda_cflags, defines) and of a
    build variant (cflags, cuda_cflags), with where it came from; None if every flag is allowed.
    The worker calls this right before it builds, whatever validation the objects went through."""
    for owner, source in (("build", build), ("build variant", variant)):
        if source is None:
            continue
        for field, compiler in (("cflags", "host"), ("cuda_cflags", "nvcc")):
            flags = [str(flag) for flag in getattr(source, field, None) or ()]
            message = refused_flag_message(flags, f"{owner}.{field}", compiler)
            if message is not None:
                return message
    for name, value in dict(getattr(build, "defines", None) or {}).items():
        if (problem := define_problem(str(name), str(value))) is not None:
            return problem
    return None
