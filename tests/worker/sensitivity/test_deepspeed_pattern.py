"""Issue 45's proof: the DeepSpeed 0.19.0 pattern in the bundled kernels' multi-tensor entry point.

DeepSpeed 0.19.0 changed what a second call at the same step does with the running bias-correction
powers (kept instead of recomputed with pow): bit-identical for one tensor per optimizer, different
from step 3 whenever one optimizer steps several tensors. The catalogue holds that change as
`shared_state/beta_powers_recomputed_per_tensor` (a second tensor of a group at the same step
recomputes the powers with powf instead of reusing the float32 running product).

Through real kernel hosts on real builds: every case of the ci battery as it was before layout
cases existed (v2: one tensor under its own optimizer each) reads the mutant UNCHANGED — the
optimizer-per-tensor battery cannot see it — and the ci battery's layout case flags it from step 3.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from service.core.verdicts import compare_runs
from worker.battery import BUILTIN_BATTERIES
from worker.build import build_extension
from worker.engine.corun import run_battery
from worker.sensitivity.catalogue import load_catalogue, mutant_tree

pytestmark = pytest.mark.slow

MUTANT = "shared_state/beta_powers_recomputed_per_tensor"


@pytest.fixture(scope="module")
def deepspeed_pattern_build(tmp_path_factory, csrc_under_test: Path, build_cache_dir: Path):
    (mutant,) = [m for m in load_catalogue() if m.id == MUTANT]
    tree = mutant_tree(mutant, csrc_under_test, tmp_path_factory.mktemp("ds") / "csrc")
    result = build_extension(tree, cache_dir=build_cache_dir, cuda_archs=[])
    assert result.ok, result.error
    return result


def test_the_deepspeed_pattern_escapes_one_tensor_cases_and_the_layout_case_flags_it_from_step_3(
        kernels_build, deepspeed_pattern_build):
    ci = BUILTIN_BATTERIES["ci"]()
    cases = ci.expand()
    one_tensor = [c for c in cases if c.layout is None]
    layout = [c for c in cases if c.layout is not None]
    assert one_tensor and layout, "the ci battery holds both kinds of case"

    baseline = run_battery(ci, kernels_build.library_path, device="cpu")
    commit = run_battery(ci, deepspeed_pattern_build.library_path, device="cpu")
    verdicts = {c.case_id: c for c in compare_runs(commit, baseline).cases}

    # Today's kind of case (one tensor, its own optimizer): every one bit-identical.
    assert [verdicts[c.case_id].verdict for c in one_tensor] == ["unchanged"] * len(one_tensor)
    # The layout cases of Adam and AdEMAMix (two or more tensors in one group): changed from step 3,
    # in the second and later tensors of a group only (the first makes the running product).
    flagged = [verdicts[c.case_id] for c in layout if c.optimizer in ("adam", "ademamix")]
    assert flagged and all(v.verdict == "changed" for v in flagged), [(v.case_id, v.verdict) for v in flagged]
    assert {v.first_divergent_step for v in flagged} == {3}
    for verdict in flagged:
        # Step 3 is the second tensor's or a later one's: a group's first tensor makes the running
        # product (with AdEMAMix it follows from step 4 on, when the recomputed powers left in the
        # cache become the next step's running product — as in DeepSpeed before 0.19).
        # In bfloat16 the parameters can stay equal for a few steps while the group's powers (shared
        # state, digested with the case) already differ: then the summary says the shared state
        # changed first, from step 3.
        rows = {row.index: row.first_divergent_step for row in verdict.tensors}
        assert rows[0] is None or rows[0] > 3, verdict.message
        assert (any(step == 3 for index, step in rows.items() if index not in (0, None))
                or "shared state (step counters, bias-correction powers) changed first, from step 3" in verdict.message), \
            verdict.message
