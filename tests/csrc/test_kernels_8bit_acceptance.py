"""Acceptance: a copy of csrc whose Adam/AdEMAMix apply weight decay after the update (the PR-2040
ordering, worker.mutations.decay_after_update, which asserts each substitution matched) is flagged
by the one-step closed-form check of the 8-bit kernels at lr=0.1, wd=0.1, and the bundled kernels
are not.

Why one step: from a zero state the 8-bit state quantizes exactly and the parameter update uses the
float32 state, so the kernel must equal the closed form p(1 - lr wd) - lr g/(|g| + eps) up to its
float32 rounding, bounded per element in worker/references/blockwise8.py (here <= 8.6e-7 for |p| ~ 4).
The wrong ordering sits lr·wd·|lr·u| = 0.1·0.1·0.1 = 1.0e-3 away (u = g/(|g|+eps) ~ ±1), three
orders of magnitude outside that bound.

Each build runs in its own process (`python -m worker.references.closed_form_8bit --json`): two builds of the
same op namespace cannot share one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from worker.mutations import copy_tree, decay_after_update

REPO_ROOT = Path(__file__).resolve().parents[2]


def closed_form_rows(csrc: Path, build_cache_dir: Path, device: str) -> dict[str, dict]:
    completed = subprocess.run(
        [sys.executable, "-m", "worker.references.closed_form_8bit", "--csrc", str(csrc), "--device", device, "--json"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=1500,
        env={**__import__("os").environ, "OPTDRIFT_BUILD_CACHE": str(build_cache_dir)},
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return {row["optimizer"]: row for row in json.loads(completed.stdout.strip().splitlines()[-1])}


DEVICES = ["cpu"] + (["cuda"] if __import__("torch").cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_decay_after_update_copy_is_flagged_and_bundled_kernels_are_not(tmp_path, build_cache_dir, csrc_under_test, device):
    good = closed_form_rows(csrc_under_test, build_cache_dir, device)
    mutated = decay_after_update(copy_tree(csrc_under_test, tmp_path / "csrc"))
    bad = closed_form_rows(mutated, build_cache_dir, device)

    for optimizer, row in good.items():
        assert row["within_bound"], f"bundled {optimizer}: {row}"
        assert row["bound"] < 1e-6 or optimizer in ("rmsprop", "adagrad"), row  # see the module doc
    for optimizer in ("adam", "ademamix"):
        row = bad[optimizer]
        assert not row["within_bound"], f"mutated {optimizer} was not flagged: {row}"
        # It sits the predicted ordering gap from the closed form (~1.0e-3) ...
        assert abs(row["distance"] - row["ordering"]) <= 2 * row["bound"], row
        assert 0.9e-3 < row["distance"] < 1.1e-3, row
        # ... and on the decay-after-update formula, to within its rounding.
        assert row["to_wrong"] <= 2 * row["bound"], row
        assert row["distance"] > 1000 * good[optimizer]["bound"], (row, good[optimizer])
    for optimizer in ("lion", "momentum", "rmsprop", "adagrad"):
        assert bad[optimizer]["within_bound"], f"the mutation must not touch {optimizer}: {bad[optimizer]}"
