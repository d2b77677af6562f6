"""Builds: a commit's tree into a library a kernel host loads, cached by digest.

    cache.py      the digest-keyed cache every build kind shares (locks, staging, manifests)
    ccache.py     the compiler cache extension builds compile through
    extension.py  the `torch-extension` kind (the bundled csrc recipe)
    child.py      the extension compile's child process (in the sandbox)
    project.py    a project's configured build (`torch-extension` or `command`)

The names most callers need are importable from here.
"""

from worker.build.cache import INSTALLED, MANIFEST, MAX_KEPT_LOG_BYTES, BuildResult, LabelledHash, default_cache_dir
from worker.build.ccache import (
    EXTENSION_NAME_MACRO, CompilerCacheStats, ccache_env, ccache_version, find_ccache, read_ccache_stats_log,
)
from worker.build.extension import (
    BUILD_RECIPE_VERSION, DEFAULT_CFLAGS, DEFAULT_CUDA_CFLAGS, LIBRARY_PREFIX, BuildSpec, build_digest,
    build_extension, compiler_message, detect_cuda_archs, kernel_source_files,
)

__all__ = [
    "BUILD_RECIPE_VERSION", "DEFAULT_CFLAGS", "EXTENSION_NAME_MACRO", "DEFAULT_CUDA_CFLAGS", "INSTALLED", "LIBRARY_PREFIX", "MANIFEST",
    "MAX_KEPT_LOG_BYTES", "BuildResult", "BuildSpec", "CompilerCacheStats", "LabelledHash", "build_digest",
    "build_extension", "ccache_env", "ccache_version", "compiler_message", "default_cache_dir", "detect_cuda_archs",
    "find_ccache", "kernel_source_files", "read_ccache_stats_log",
]
