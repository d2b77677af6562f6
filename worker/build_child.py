"""The child process of worker.build: compile one BuildSpec with torch's extension builder + ninja.

Runs in its own process group under a timeout; everything it prints goes to the build log. A
failed compile exits non-zero; the parent turns the log into a structured BuildResult.
"""

from __future__ import annotations

import sys

from worker.build import BuildSpec


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


def main(spec_json: str) -> int:
    spec = BuildSpec.model_validate_json(spec_json)
    from torch.utils import cpp_extension

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
