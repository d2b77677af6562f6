"""What the co-run benches share: the device they run on, and the two builds they compare (the
bundled kernels and the decay-after-update copy of PR 2040, worker/mutations.py)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.build import BuildResult, build_extension  # noqa: E402
from worker.mutations import copy_tree, decay_after_update  # noqa: E402

CSRC = Path(__file__).resolve().parents[1] / "csrc"


def resolve_device(name: str) -> str:
    """"auto": CUDA when torch sees a device, else the CPU; any other name as given."""
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def build_baseline_and_decay(device: str) -> tuple[BuildResult, BuildResult]:
    """(the bundled kernels, the decay-after-update copy), built for `device` through the digest
    cache; raises RuntimeError with the compiler's message when one does not build."""
    archs = [] if device == "cpu" else None
    with tempfile.TemporaryDirectory() as tmp:
        mutant = decay_after_update(copy_tree(CSRC, Path(tmp) / "mutant"))
        builds = build_extension(CSRC, cuda_archs=archs), build_extension(mutant, cuda_archs=archs)
    for name, build in zip(("the bundled kernels", "the decay copy"), builds):
        if not build.ok:
            raise RuntimeError(f"{name} do not build: {build.error}")
    return builds
