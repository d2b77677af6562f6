"""The catalogue's shared-state defects of the multi-tensor ops (issue 45), each built and run on
the CPU: invisible to one-tensor cases (the one-tensor ops are untouched) and visible on the layout
cases named in its catalogue entry, from the step named there. One build per process: each mutant
runs its cases in a child process and prints, per case, the digests of every step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from worker.build import build_extension
from worker.sensitivity.catalogue import load_catalogue, mutant_tree

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
WIDE = {"groups": [{"sizes": [1, 257, 4096]}, {"sizes": [1031], "point": {"weight_decay": 0.0}}]}
PAIR = {"groups": [{"sizes": [257, 257]}, {"sizes": [1031], "point": {"lr": 0.01}}]}
ALONE = {"groups": [{"sizes": [1]}, {"sizes": [4096], "point": {"weight_decay": 0.0}}]}  # one tensor per group
# (layout, optimizer) -> first divergent step, per mutant; None: bit-identical. Measured on the CPU and
# on an H100 (docs/KERNELS.md, "Multi-tensor entry points"); every unlisted cell is None.
EXPECTED = {
    "shared_state/step_counter_per_tensor": {("WIDE", "adam"): 1, ("WIDE", "lion"): 1, ("PAIR", "adam"): 1,
                                             ("PAIR", "lion"): 1},
    "shared_state/beta_powers_recomputed_per_tensor": {("WIDE", "adam"): 3, ("PAIR", "adam"): 3},
    "shared_state/beta_powers_advanced_per_tensor": {("WIDE", "adam"): 1, ("PAIR", "adam"): 1},
    "shared_state/group_hyper_from_first_group": {("WIDE", "adam"): 1, ("WIDE", "lion"): 1, ("PAIR", "adam"): 1,
                                                  ("PAIR", "lion"): 1, ("ALONE", "adam"): 1, ("ALONE", "lion"): 1},
    "shared_state/state_buffer_shared_by_size": {("PAIR", "adam"): 1, ("PAIR", "lion"): 1},
    "tail/multi_chunk_end_late": {(layout, optimizer): 1 for layout in ("WIDE", "PAIR", "ALONE")
                                  for optimizer in ("adam", "lion")},
    "tail/multi_chunk_end_early": {(layout, optimizer): 1 for layout in ("WIDE", "PAIR", "ALONE")
                                   for optimizer in ("adam", "lion")},
}

CHILD = r"""
import json, sys, torch
from worker.adapters import bundled_ops
from worker.battery import BatterySpec
from worker.engine.trajectory import run_case
bundled_ops.load_build(sys.argv[1])
layouts = json.loads(sys.argv[2])
groups = [{"optimizers": ["adam", "lion"], "layouts": [layout], "steps": 5,
           "points": [{"lr": 0.1, "weight_decay": 0.1}]} for layout in layouts.values()]
groups.append({"optimizers": ["adam", "lion"], "sizes": [4096], "steps": 5, "points": [{"lr": 0.1, "weight_decay": 0.1}]})
names = {json.dumps(layout, sort_keys=True): name for name, layout in layouts.items()}
out = {}
for group in groups:
    for case in BatterySpec.model_validate({"name": "m", "version": 1, "groups": [group]}).expand():
        label = "ONE" if case.layout is None else names[json.dumps(group["layouts"][0], sort_keys=True)]
        result = run_case(case, torch.device("cpu"))
        out[f"{label} {case.optimizer}"] = result.trajectory.digests
print(json.dumps(out))
"""


def _digests(library: Path) -> dict[str, list[str]]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", CHILD, str(library), json.dumps({"WIDE": WIDE, "PAIR": PAIR,
                                                                                 "ALONE": ALONE})],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _first_divergent(a: list[str], b: list[str]) -> int | None:
    return next((step for step, (x, y) in enumerate(zip(a, b), 1) if x != y), None)


@pytest.fixture(scope="module")
def baseline(kernels_build) -> dict[str, list[str]]:
    return _digests(kernels_build.library_path)


@pytest.mark.parametrize("mutant_id", sorted(EXPECTED))
def test_a_shared_state_defect_reaches_the_layouts_it_names_and_no_one_tensor_case(
        mutant_id, baseline, csrc_under_test, build_cache_dir, tmp_path):
    (mutant,) = [m for m in load_catalogue() if m.id == mutant_id]
    built = build_extension(mutant_tree(mutant, csrc_under_test, tmp_path / "csrc"), cache_dir=build_cache_dir,
                            cuda_archs=[])
    assert built.ok, built.error
    mutated = _digests(built.library_path)
    observed = {tuple(key.split()): _first_divergent(mutated[key], baseline[key]) for key in baseline}
    expected = {key: EXPECTED[mutant_id].get(key) for key in observed}
    assert observed == expected
    assert observed[("ONE", "adam")] is None and observed[("ONE", "lion")] is None
