"""Known source mutations of the bundled kernels, for the demo and the tests.

`decay_after_update` re-introduces the PR-2040 bug in the 2-state rules (Adam, AdEMAMix): weight
decay applied *after* the update, p = (p - step*update) * (1 - lr*wd), which scales the update by an
extra (1 - lr*wd). The rules live in csrc/optimizer_math.h, shared by the CPU and CUDA
implementations, so one substitution changes both. With wd = 0 the factor is exactly 1.0f and both
orderings give the same float, so only weight-decayed Adam/AdEMAMix cases may change.

Every substitution must match exactly once: a silent no-op mutation would make a test vacuous.
"""

from __future__ import annotations

import shutil
from pathlib import Path

# (file relative to the kernel source root, text before, text after)
DECAY_AFTER_UPDATE = (
    ("optimizer_math.h",
     "param = param * decay_factor - step_size * (exp_avg / denom);",
     "param = (param - step_size * (exp_avg / denom)) * decay_factor;"),
    ("optimizer_math.h",
     "param = param * decay_factor - lr * (mixed / denom);",
     "param = (param - lr * (mixed / denom)) * decay_factor;"),
)
# Which optimizers the decay-after-update mutation can change (and only where weight_decay > 0).
DECAY_AFTER_UPDATE_OPTIMIZERS = frozenset({"adam", "ademamix"})


class MutationError(RuntimeError):
    pass


def copy_tree(source_dir: Path, dest: Path) -> Path:
    shutil.copytree(source_dir, dest, ignore=shutil.ignore_patterns("__pycache__", "build"))
    return dest


def _substitute(root: Path, relative: str, before: str, after: str) -> None:
    path = root / relative
    text = path.read_text()
    count = text.count(before)
    if count != 1:
        raise MutationError(f"expected exactly one {before!r} in {path}, found {count}: the kernel "
                            "source changed; update worker/mutations.py")
    path.write_text(text.replace(before, after))


def decay_after_update(root: Path) -> Path:
    """Apply the decay-after-update ordering to the kernel tree at `root` (in place)."""
    for relative, before, after in DECAY_AFTER_UPDATE:
        _substitute(root, relative, before, after)
    return root


def comment_only(root: Path, note: str = "A comment-only change: no trajectory may move.") -> Path:
    """Add a comment line to the ops schema file (in place): changes the digest, not the code."""
    path = root / "ops.cpp"
    path.write_text(f"// {note}\n" + path.read_text())
    return root
