"""The mutation catalogue (worker/sensitivity/catalogue/): complete, every patch applies to the
current csrc/ with no fuzz, its known entries are the ones worker/mutations.py makes, and every
mutant of a CUDA source compiles (recorded once with nvcc, one of them compiled again here)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from worker.mutations import comment_only, copy_tree, decay_after_update
from worker.sensitivity.catalogue import CatalogueError, apply_patch, load_catalogue, mutant_tree, select
from worker.sensitivity.cuda_compile import RECORD, compile_check, nvcc_units

REPO = Path(__file__).resolve().parents[3]
CSRC = REPO / "csrc"
CATALOGUE = load_catalogue()
BY_ID = {m.id: m for m in CATALOGUE}

# The defect classes issue 17 names; each needs at least one entry.
REQUIRED_CLASSES = {"decay", "bias_correction", "eps", "beta", "sign", "precision", "lr", "quant8", "tail",
                    "writeback", "ademamix", "gnorm_scale", "skip_zeros"}


def test_the_catalogue_has_forty_defects_over_every_class_and_twelve_refactors():
    defects = [m for m in CATALOGUE if m.kind == "defect"]
    refactors = [m for m in CATALOGUE if m.kind == "refactor"]
    assert len(defects) >= 40 and len(refactors) >= 12
    assert REQUIRED_CLASSES <= {m.mutant_class for m in defects}
    assert all(m.mutant_class == "refactor" and "bit-identical" in m.expect for m in refactors)
    # CPU and CUDA sources both: a shared header reaches both builds, cpu/ and cuda/ files one each.
    assert {frozenset({"cpu"}), frozenset({"cuda"}), frozenset({"cpu", "cuda"})} <= {m.reaches for m in defects}


def test_every_patch_applies_cleanly_to_the_current_kernels(tmp_path):
    tree = copy_tree(CSRC, tmp_path / "csrc")
    for mutant in CATALOGUE:
        apply_patch(mutant, tree, dry_run=True)
    # and really changes the tree: applied to a copy, the text differs
    mutated = mutant_tree(BY_ID["eps/adam_inside_sqrt"], CSRC, tmp_path / "mutated")
    assert (mutated / "optimizer_math.h").read_text() != (CSRC / "optimizer_math.h").read_text()


def test_a_patch_that_no_longer_matches_fails_with_the_entry_named(tmp_path):
    tree = copy_tree(CSRC, tmp_path / "csrc")
    math = tree / "optimizer_math.h"
    math.write_text(math.read_text().replace("sqrtf(exp_avg_sq) * inv_sqrt_bias_correction2 + eps",
                                             "sqrtf(exp_avg_sq) * inv_sqrt_bias_correction2 + eps * 1.0f"))
    with pytest.raises(CatalogueError, match="eps/adam_inside_sqrt.*does not apply cleanly"):
        apply_patch(BY_ID["eps/adam_inside_sqrt"], tree, dry_run=True)


def test_the_catalogue_entries_of_worker_mutations_are_the_same_change(tmp_path):
    expected = decay_after_update(copy_tree(CSRC, tmp_path / "by_mutations"))
    patched = mutant_tree(BY_ID["decay/after_update"], CSRC, tmp_path / "by_patch")
    assert (patched / "optimizer_math.h").read_text() == (expected / "optimizer_math.h").read_text()
    expected = comment_only(copy_tree(CSRC, tmp_path / "comment_by_mutations"))
    patched = mutant_tree(BY_ID["refactor/comment_ops"], CSRC, tmp_path / "comment_by_patch")
    assert (patched / "ops.cpp").read_text() == (expected / "ops.cpp").read_text()


def test_bad_catalogues_list_every_problem(tmp_path):
    folder = tmp_path / "catalogue"
    (folder / "eps").mkdir(parents=True)
    shutil.copy(BY_ID["eps/adam_inside_sqrt"].patch_path, folder / "eps" / "stray.patch")
    (folder / "catalogue.toml").write_text(
        '[[mutant]]\nid = "eps/missing"\nkind = "defect"\nexpect = "x"\n\n'
        '[[mutant]]\nid = "Bad Id"\nkind = "defect"\nexpect = "x"\n\n'
        '[[mutant]]\nid = "eps/stray"\nkind = "feature"\nexpect = ""\n')
    with pytest.raises(CatalogueError) as raised:
        load_catalogue(folder)
    message = str(raised.value)
    for fragment in ("eps/missing", "patch", "'<class>/<name>'", "kind must be one of", "`expect`"):
        assert fragment in message
    with pytest.raises(CatalogueError, match="no such class or mutant id"):
        select(CATALOGUE, ["eps/nothing_like_this"])
    assert {m.id for m in select(CATALOGUE, ["eps"])} == {m.id for m in CATALOGUE if m.mutant_class == "eps"}


def test_every_cuda_source_mutant_was_compile_checked_with_nvcc():
    """The record (python -m worker.sensitivity.cuda_compile) holds every mutant of a csrc/cuda/ file,
    compiled for sm_90 from its current patch."""
    record = json.loads(RECORD.read_text())
    cuda_source_mutants = [m for m in CATALOGUE if nvcc_units(m)]
    assert len(cuda_source_mutants) >= 12
    for mutant in cuda_source_mutants:
        entry = record.get(mutant.id)
        assert entry is not None, f"{mutant.id} was never compile-checked: python -m worker.sensitivity.cuda_compile"
        assert entry["patch_sha256"] == mutant.patch_sha256, f"{mutant.id} changed since its compile check"
        assert entry["ok"], f"{mutant.id} does not compile: {entry['error']}"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_a_cuda_mutant_compiles_with_nvcc_and_a_broken_one_does_not(tmp_path):
    """One live compile (the smallest unit, ~30-60 s here), and a patch that cannot compile."""
    assert compile_check(BY_ID["writeback/adam_states_swapped_cuda"])["ok"]
    broken_folder = tmp_path / "catalogue"
    (broken_folder / "tail").mkdir(parents=True)
    patch = BY_ID["tail/cuda_tail_loop_dropped"].patch.replace("i < packed_count * kPack;", "i < packed_count * kPack")
    (broken_folder / "tail" / "no_semicolon.patch").write_text(patch)
    (broken_folder / "catalogue.toml").write_text(
        '[[mutant]]\nid = "tail/no_semicolon"\nkind = "defect"\nexpect = "does not compile"\n')
    [broken] = load_catalogue(broken_folder)
    result = compile_check(broken)
    assert not result["ok"] and "apply_cuda.cuh" in result["error"]
