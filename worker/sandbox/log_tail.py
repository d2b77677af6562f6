"""Bounded views of what submitted code wrote: a build log or a kernel host's stderr can be any size
(300 MB of output, one 100 MB line), and whatever is stored or shown of it must not be.

- `tail_text`: the last bytes of a file, read without reading the rest;
- `clip_lines`: every line cut to a width, and the whole to a size;
- `keep_tail`: a log file cut down in place to its last bytes (a failed build's log is kept for
  people to read, and a verify token's daily quota must not be able to fill the worker's disk).
"""

from __future__ import annotations

import os
from pathlib import Path

TRUNCATED = "[... {} earlier bytes not kept ...]\n"
MAX_LINE_CHARS = 400


def tail_text(path: str | Path | None, max_bytes: int) -> str:
    """The last `max_bytes` of the file as text (undecodable bytes replaced), with a note when
    earlier bytes were left out; "" when there is no such file."""
    if not path:
        return ""
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(0, size - max_bytes))
            data = handle.read(max_bytes)
    except OSError:
        return ""
    text = data.decode("utf-8", errors="replace")
    return (TRUNCATED.format(size - max_bytes) + text) if size > max_bytes else text


def clip_lines(text: str, *, max_line_chars: int = MAX_LINE_CHARS, max_chars: int = 8000) -> str:
    """Each line cut to `max_line_chars` (saying how much was cut), the whole to its last `max_chars`."""
    lines = []
    for line in text.splitlines():
        if len(line) > max_line_chars:
            line = f"{line[:max_line_chars]} [... {len(line) - max_line_chars} more characters]"
        lines.append(line)
    out = "\n".join(lines)
    return out if len(out) <= max_chars else "[...]\n" + out[-max_chars:]


def keep_tail(path: str | Path, max_bytes: int) -> None:
    """Cut the file at `path` down to its last `max_bytes` (with a note), in place."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError:
        return
    if size <= max_bytes:
        return
    kept = tail_text(path, max_bytes)
    path.write_text(kept, errors="replace")
