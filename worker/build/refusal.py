"""A failed build whose tree refuses this machine's toolchain: "not buildable here", not broken.

An old release may state in its CMake or setup that it does not support the CUDA, compiler or torch
it meets (bitsandbytes 0.47.0's CMakeLists.txt: "CUDA Version > 12 is not supported"; nvcc's own
host_config.h: "#error -- unsupported GNU version!"). Its build fails, but the release is not
broken: it cannot be built in this environment, and says so (issue 47). `toolchain_refusal` finds
such a line in a failed build's log, conservatively — the refusal must be the build's *first* error
line (or, when that line is a heading such as CMake's "CMake Error at CMakeLists.txt:112 (message):",
one of the two lines after it), so a build that fails for another reason, and printed a
refusal-like warning or a second error on the way, stays a failure.

The log of a failed build was written by the build's box: it is read through
worker.sandbox.boxfiles (`refusal_of`).
"""

from __future__ import annotations

import re
from pathlib import Path

from worker.build.cache import MAX_KEPT_LOG_BYTES, BuildResult
from worker.sandbox import boxfiles, log_tail

_TOOL = r"(?:cuda|nvcc|cudatoolkit|gnu|gcc|g\+\+|clang|host compiler|compiler|c\+\+ compiler|torch|pytorch|rocm)"
REFUSALS = (
    # "Unsupported CUDA version 13.0", "unsupported GNU version! gcc versions later than 13 ..."
    re.compile(rf"\bunsupported\s+{_TOOL}\b", re.IGNORECASE),
    # "CUDA Version > 12 is not supported", "CUDA version 13.0 not supported", "torch 2.9 is not yet supported"
    re.compile(rf"\b{_TOOL}\b[^\n]{{0,60}}?\b(?:is\s+|are\s+)?not\s+(?:yet\s+)?supported\b", re.IGNORECASE),
    # "requires CUDA < 13", "requires torch<=2.8", "requires gcc version 12 or older"
    re.compile(rf"\brequires?\s+{_TOOL}\s*(?:version\s*)?(?:<|<=|==|older|below|at most|before|\d)", re.IGNORECASE),
    # "#error CUDA 13 is not supported by this release", "#error -- unsupported GNU version!"
    re.compile(rf"#\s*error\b[^\n]*\b{_TOOL}\b", re.IGNORECASE),
)
# The lines that report an error: CMake's "CMake Error at", a compiler's "error:", a setup's
# "RuntimeError: ...", "FATAL". Not a flag on a command line ("-Wno-error=dev", "-Werror"), nor
# ninja's "FAILED: <target>", which only names what failed.
_ERROR = re.compile(r"(?<![-\w])(?:fatal\s+)?error\b(?!=)|[a-z]Error:|\bFATAL\b|CMake Error", re.IGNORECASE)
_COMMAND_LINE = re.compile(r"^(?:\[\d+/\d+\]\s|FAILED:|\$ )|\s-c\s")
_WARNING = re.compile(r"\bwarning\b", re.IGNORECASE)
# Where the message of an error may follow it: CMake prints "CMake Error at X (message):" then the text.
FOLLOWING_LINES = 2
MAX_LINE_CHARS = 300


def is_refusal(line: str) -> bool:
    """Whether `line` says a tool's version is not supported (a warning saying so is not a refusal)."""
    if _WARNING.search(line) and not _ERROR.search(line):
        return False
    return any(pattern.search(line) for pattern in REFUSALS)


def toolchain_refusal(log: str) -> str | None:
    """The line by which a failed build's log refuses the toolchain, or None: the build's first
    error line must be a refusal, or the message of it (the FOLLOWING_LINES after a heading)."""
    lines = log.splitlines()
    first = next((i for i, line in enumerate(lines) if _ERROR.search(line) and not _COMMAND_LINE.search(line)),
                 None)
    if first is None:
        return None
    # A heading ("CMake Error at CMakeLists.txt:112 (message):") has its message on the lines after it.
    candidates = lines[first:first + 1 + FOLLOWING_LINES] if lines[first].rstrip().endswith(":") else [lines[first]]
    for line in candidates:
        if is_refusal(line):
            return log_tail.clip_lines(line.strip(), max_line_chars=MAX_LINE_CHARS, max_chars=MAX_LINE_CHARS)
    return None


def refusal_of(built: BuildResult) -> str | None:
    """The refusal in a failed build's log (read through boxfiles: the box wrote it), else in its
    error message; None for a build that succeeded or failed otherwise."""
    if built.ok:
        return None
    if built.log_path:
        log = Path(built.log_path)
        try:
            # kept to its last MAX_KEPT_LOG_BYTES (worker.build.cache); the slack for a last line
            text = boxfiles.read_text(log.parent, log.name, max_bytes=MAX_KEPT_LOG_BYTES + 65536)
        except boxfiles.BoxFileRefused:
            text = None
        if text and (line := toolchain_refusal(text)):
            return line
    return toolchain_refusal(built.error or "")
