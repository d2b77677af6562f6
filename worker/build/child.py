"""The child process of worker.build: compile one BuildSpec with torch's extension builder + ninja.

Runs in its own process group under a timeout; everything it prints goes to the build log. A
failed compile exits non-zero; the parent turns the log into a structured BuildResult.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

from worker.build.extension import BuildSpec


def loaded_libstdcxx() -> str | None:
    """The libstdc++ shared library this process (torch) runs with, from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                if "/libstdc++.so" in path:
                    return path
    except OSError:
        pass
    return None


def route_through_ccache(ccache: str, *, cuda_home: str | None, wrapper_dir: Path) -> list[str]:
    """Make torch's ninja file call every compiler through `ccache`; returns lines for the log.

    nvcc: torch writes PYTORCH_NVCC into the ninja file as it is (a command line). The host
    compiler: torch takes CXX as one executable (newer versions shell-quote it, older ones check
    its name), so CXX becomes a two-line script named c++ that execs `ccache <real c++>`.
    (main() sets TORCH_NO_COMPILER_WRAPPER, so newer torch adds no second ccache of its own.)
    """
    host = shlex.split(os.environ.get("CXX", "c++"))
    if len(host) > 1 and Path(host[0]).name in ("ccache", "sccache"):
        host = host[1:]  # CXX="ccache c++" from an older setup: one compiler cache is enough
    host_path = shutil.which(host[0])
    if host_path is None:
        return [f"compiler cache: the host compiler {host[0]!r} is not on PATH; compiling without ccache"]
    wrapper_dir.mkdir(parents=True, exist_ok=True)
    wrapper = wrapper_dir / "c++"
    wrapper.write_text(f"#!/bin/sh\nexec {shlex.join([ccache, host_path, *host[1:]])} \"$@\"\n")
    wrapper.chmod(0o755)
    os.environ["CXX"] = str(wrapper)
    lines = [f"compiler cache: host compiler via {ccache} {host_path}"]
    nvcc = os.path.join(cuda_home, "bin", "nvcc") if cuda_home else None
    if nvcc and os.path.isfile(nvcc):
        os.environ["PYTORCH_NVCC"] = shlex.join([ccache, nvcc])
        lines.append(f"compiler cache: nvcc via {os.environ['PYTORCH_NVCC']}")
    lines.append(f"compiler cache: CCACHE_DIR={os.environ.get('CCACHE_DIR')} "
                 f"CCACHE_BASEDIR={os.environ.get('CCACHE_BASEDIR')}")
    return lines


def main(spec_json: str) -> int:
    spec = BuildSpec.model_validate_json(spec_json)
    from torch.utils import cpp_extension

    # worker.build decides about the compiler cache, not torch: newer torch otherwise puts a ccache
    # found on PATH in front of the compilers by itself, also when OPTDRIFT_CCACHE=0 turned it off.
    os.environ["TORCH_NO_COMPILER_WRAPPER"] = "1"
    if spec.ccache:
        scratch = Path(os.environ.get("TMPDIR") or spec.build_directory)
        for line in route_through_ccache(spec.ccache, cuda_home=cpp_extension.CUDA_HOME,
                                         wrapper_dir=scratch / "ccache-wrappers"):
            print(line, flush=True)

    # Link against the libstdc++ that torch itself uses, by path. Some toolchains (the H200's
    # /opt/gcc) otherwise link libstdc++ statically into the extension: the library then carries a
    # second, uninitialised copy of the C++ locale, and the first error message that formats a
    # number (TORCH_CHECK with a size) segfaults instead of throwing. Naming the shared library
    # before the driver's implicit -lstdc++ resolves every C++ runtime symbol from it.
    libstdcxx = loaded_libstdcxx()
    extra_ldflags = [libstdcxx] if libstdcxx else []
    print(f"linking the C++ runtime from {libstdcxx or 'the toolchain default'}", flush=True)

    print(f"optdrift build {spec.name}: {len(spec.sources)} sources, "
          f"CUDA archs {spec.cuda_archs or 'none (CPU-only)'}", flush=True)
    try:
        # is_python_module=False: the library only registers torch ops; loading it here once also
        # proves it links and its registrations succeed before the build is published.
        cpp_extension.load(
            name=spec.name,
            sources=spec.sources,
            extra_include_paths=spec.include_dirs,
            extra_cflags=spec.extra_cflags,
            extra_cuda_cflags=spec.extra_cuda_cflags,
            extra_ldflags=extra_ldflags,
            build_directory=spec.build_directory,
            with_cuda=bool(spec.cuda_archs),
            is_python_module=False,
            verbose=True,
        )
    except Exception as exc:  # the compiler output is already in the log; one line for the reason
        print(f"optdrift build failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
