"""The host CPU's instruction-set features: what a native build (-march=native) compiles for.

`-march=native` (and -mtune=native, -mcpu=native) makes the compiler emit whatever the *build*
machine's CPU supports: a library built on an AVX-512 host may use instructions another host lacks
(SIGILL), or, worse, a different vector path with other rounding. So a build whose flags depend on
the host keys its cache on these features (worker.build.extension, worker.build.project), and the
CPU environment's fingerprint carries their digest (worker.engine.environment), so two CPUs that
would build differently are two environments.

The features are the CPU's flags from /proc/cpuinfo, restricted on x86 to instruction-set
extensions (what the compiler's -march=native resolves from cpuid), so kernel-reported flags that
do not change code generation (`hypervisor`, `constant_tsc`, ...) do not split the cache. On other
architectures (aarch64 "Features") every flag counts. No torch.
"""

from __future__ import annotations

import hashlib
import platform
import re
from collections.abc import Iterable
from functools import lru_cache

# Flags in /proc/cpuinfo that are instruction-set extensions a compiler may target.
_X86_ISA = re.compile(
    r"^(mmx|mmxext|sse\w*|ssse3|pni|avx\w*|fma\w*|f16c|bmi\d|popcnt|abm|lzcnt|movbe|aes|vaes|pclmulqdq|"
    r"vpclmulqdq|sha_ni|gfni|adx|rdrand|rdseed|amx\w*|xsave\w*|cx8|cx16|cmov|fxsr|lahf_lm|3dnow\w*|"
    r"prfchw|clflushopt|clwb|clzero|wbnoinvd|serialize|waitpkg|movdiri|movdir64b|ptwrite|pku|rdpid|"
    r"pconfig|tsxldtrk|hle|rtm|fsgsbase|xop|tbm|sse4a|mwaitx|uintr|enqcmd|cldemote|avx_vnni\w*|"
    r"rdpru|invpcid|sgx\w*|shstk|ibt|kl|widekl|hreset|cmpccxadd|prefetchi|raoint)$")
# Compiler flags whose output depends on the machine that compiles.
NATIVE_FLAG = re.compile(r"^-m(arch|tune|cpu)=native$")


def _cpuinfo_flags(text: str) -> list[str]:
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return value.split()
    return []


def isa_features(cpuinfo: str | None = None) -> tuple[str, ...]:
    """The sorted instruction-set features of this CPU (or of the given /proc/cpuinfo text)."""
    if cpuinfo is None:
        return _host_isa_features()
    flags = _cpuinfo_flags(cpuinfo)
    if platform.machine() in ("x86_64", "AMD64", "i686", "i386"):
        flags = [f for f in flags if _X86_ISA.match(f)]
    return tuple(sorted(set(flags)))


@lru_cache(maxsize=1)
def _host_isa_features() -> tuple[str, ...]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            return isa_features(handle.read())
    except OSError:  # not Linux: the machine name alone, which still separates architectures
        return ()


def isa_digest(features: Iterable[str] | None = None) -> str:
    """A short, stable name for a feature set: `<machine>-<sha256[:16]>` of the sorted features."""
    chosen = isa_features() if features is None else tuple(sorted(set(features)))
    return f"{platform.machine()}-{hashlib.sha256(' '.join(chosen).encode()).hexdigest()[:16]}"


def depends_on_host(flags: Iterable[str]) -> bool:
    """Whether compiling with `flags` makes code for the compiling machine's CPU."""
    return any(NATIVE_FLAG.match(flag) for flag in flags)
