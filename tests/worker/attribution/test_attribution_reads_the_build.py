"""Issue 47: attribution reads the build and the baseline.

* A baseline that already follows a catalogued variant (DeepSpeed's CPU Adam: bias corrections from
  float32 powers) and a commit that replaces it (running float32 powers, DeepSpeed 0.19.0) is the
  precision change it is, matched from the baseline's rule, not "semantic, unexplained".
* A commit that goes back from a catalogued defect to the algorithm says "reverts: ...".
* Coupled <-> decoupled weight decay is named either way (bitsandbytes 0.50.0 moved Lion's kernel
  from coupled to decoupled decay).
* A flags-only change (the same csrc built with -march=native -ffp-contract=fast) is rounding-level
  and its verdict names the flags (service side: tests/service/test_attribution_build_change.py).
* No element moved and the states unread: never semantic.

The fast tests use the float64 rules rounded to float32 at each step as stand-ins for two kernels
(as tests/worker/attribution/test_attribution_variants.py does); the slow ones build the bundled
kernels with the change written into csrc/optimizer_math.h and re-run them through kernel hosts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.attribution import variants
from worker.attribution.analysis import analyze, analyze_files, analyze_layout
from worker.battery import load_battery

QUICK = {c.case_id.split("#")[0]: c for c in load_battery("quick").expand() if c.layout is None}
ADAM = "adam.32bit.fp32.lr=0.1.wd=0.1.open.n4097.s0.t20"
LION = "lion.32bit.fp32.lr=0.01.wd=0.1.open.n4097.s0.t20"
ADAGRAD = "adagrad.32bit.fp32.lr=0.01.wd=0.1.open.n4097.s0.t20"
POWERS = "bias_correction_float32_powers"
RUNNING = "bias_correction_float32_running_powers"


def _rounded(case, commit_rule: str, baseline_rule: str) -> tuple[np.ndarray, np.ndarray]:  # noqa: ANN001
    """(commit, baseline): the two rules' float64 trajectories rounded to float32 at each step."""
    paths = variants.replay(case, [variants.BY_NAME[commit_rule], variants.BY_NAME[baseline_rule]])
    return paths[commit_rule].to(torch.float32).numpy(), paths[baseline_rule].to(torch.float32).numpy()


def _first_step(commit: np.ndarray, baseline: np.ndarray) -> int:
    return next(t for t in range(commit.shape[0]) if (commit[t] != baseline[t]).any()) + 1


@pytest.mark.parametrize("case_name, steps, commit_rule, baseline_rule, expected", [
    # DeepSpeed 0.19.0: the running product replaces the float32 pow; from the exact rule neither
    # explains the difference of the two (each carries the same cancellation of 1 − βᵗ).
    (ADAM, 20, RUNNING, POWERS, ("precision", RUNNING, f"{POWERS}->{RUNNING}", None)),
    # A fix of a catalogued defect: back to the algorithm.
    (ADAM, 5, "reference", "decay_after_update", ("semantic", "reference", "decay_after_update->reference",
                                                   "decay_after_update")),
    # bitsandbytes 0.50.0: Lion's decay from coupled (L2 in the gradient) to decoupled.
    (LION, 20, "reference", "decay_coupled", ("semantic", "reference", "decay_coupled->reference", "decay_coupled")),
    # ... and the other way round, and both ways on an optimizer whose algorithm couples it.
    (LION, 20, "decay_coupled", "reference", ("semantic", "decay_coupled", None, None)),
    (ADAGRAD, 20, "decay_decoupled", "reference", ("semantic", "decay_decoupled", None, None)),
    (ADAGRAD, 20, "reference", "decay_decoupled", ("semantic", "reference", "decay_decoupled->reference",
                                                   "decay_decoupled")),
    # A baseline that is the algorithm admits no transition: decay applied twice is named so, not
    # "reverts: weight decay not applied" (whose prediction is the same to first order).
    (ADAM, 5, "decay_twice", "reference", ("semantic", "decay_twice", None, None)),
])
def test_the_change_is_matched_from_the_rule_the_baseline_follows(case_name, steps, commit_rule, baseline_rule,  # noqa: ANN001
                                                                  expected):  # noqa: ANN001
    case = QUICK[case_name].model_copy(update={"steps": steps})
    commit, baseline = _rounded(case, commit_rule, baseline_rule)
    found = analyze(case, commit, baseline, _first_step(commit, baseline))
    klass, variant, transition, reverts = expected
    assert (found["class"], found["variant"], found.get("transition"), found.get("reverts")) == \
        (klass, variant, transition, reverts), found["candidates"]
    if reverts:
        assert f"reverts: {variants.BY_NAME[reverts].label}" in found["label"], found["label"]
        # the baseline follows the rule it reverts far better than it follows the algorithm
        assert found["baseline_residual_ulps"] * 4 <= found["baseline_reference_ulps"], found


def test_decay_coupling_is_named_by_its_direction():
    by_label = {}
    for case_name, commit_rule, baseline_rule in ((LION, "reference", "decay_coupled"),
                                                  (ADAGRAD, "reference", "decay_decoupled")):
        case = QUICK[case_name].model_copy(update={"steps": 10})
        commit, baseline = _rounded(case, commit_rule, baseline_rule)
        by_label[baseline_rule] = analyze(case, commit, baseline, _first_step(commit, baseline))["label"]
    assert by_label["decay_coupled"].startswith("weight decay decoupled (AdamW-style) where the baseline coupled it")
    assert by_label["decay_decoupled"].startswith("weight decay coupled into the gradient (L2) where the baseline "
                                                  "decoupled it")


def test_the_attribution_words_a_transition_and_a_revert():
    from service.core import attribution_view

    case = QUICK[ADAM].model_copy(update={"steps": 5})
    commit, baseline = _rounded(case, "reference", "decay_after_update")
    reverted = analyze(case, commit, baseline, 1)
    detail = {"attribution": {"c1": reverted}}
    text = attribution_view.by_case(detail)["c1"].text
    assert text.startswith("semantic: reverts: weight decay applied after the update — "), text
    assert "that variant" not in text  # the commit follows the reference itself
    assert "reverts: weight decay applied after the update (1)" in attribution_view.headline(detail)
    assert "looks like" not in attribution_view.headline(detail)


def test_no_moved_element_is_never_semantic_in_a_layout_case_either():
    from service.core.results import CaseSpec  # noqa: F401 - the layout case below is one
    from worker.battery import BatterySpec

    (case,) = BatterySpec.model_validate({"name": "l", "version": 1, "groups": [{
        "optimizers": ["adagrad"], "steps": 3, "points": [{"lr": 0.01, "weight_decay": 0.1}],
        "layouts": [{"groups": [{"sizes": [65]}, {"sizes": [33]}]}]}]}).expand()
    values = np.random.default_rng(0).standard_normal((case.steps, case.size)).astype(np.float32)
    found = analyze_layout(case, values, values.copy(), None, None, None)
    assert found["class"] == "unknown" and found["moved_elements"] == 0, found
    # The flat path the same (a bfloat16 case whose float32 state changed under --fmad=true and
    # whose parameters never moved by one ulp): not attributed, and why.
    flat = QUICK["adagrad.32bit.fp32.lr=0.01.wd=0.1.open.n4097.s0.t20"].model_copy(update={"steps": 3})
    same = variants.replay(flat, [variants.CORRECT])["reference"].to(torch.float32).numpy()
    found = analyze(flat, same, same.copy(), 2)
    assert (found["class"], found["moved_elements"]) == ("unknown", 0) and "not read" in found["note"], found


# ----------------------------------------------------------------------------- the bundled kernels, built
# make_adam_rule's bias corrections, exact (the bundled kernels), from a float32 pow (DeepSpeed's CPU
# Adam before 0.19.0, catalogue precision/adam_bias_correction_powf), and from running float32
# products (0.19.0: βᵗ kept between steps, one float multiply each).
EXACT_POWERS = ("  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));\n"
                "  const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step));\n"
                "  AdamRule rule;\n")
FLOAT32_POW = ("  const double bias_correction1 = 1.0f - std::pow(static_cast<float>(beta1), static_cast<float>(step));\n"
               "  const double bias_correction2 = 1.0f - std::pow(static_cast<float>(beta2), static_cast<float>(step));\n"
               "  AdamRule rule;\n")
RUNNING_POWERS = ("  float beta1_power = 1.0f, beta2_power = 1.0f;  // kept between steps: one multiply each\n"
                  "  for (int64_t i = 0; i < step; ++i) {\n"
                  "    beta1_power *= static_cast<float>(beta1);\n"
                  "    beta2_power *= static_cast<float>(beta2);\n"
                  "  }\n"
                  "  const double bias_correction1 = 1.0f - beta1_power;\n"
                  "  const double bias_correction2 = 1.0f - beta2_power;\n"
                  "  AdamRule rule;\n")
# Lion with coupled decay (bitsandbytes before 0.50.0): wd·p added to the gradient, no decoupled
# factor; decay_factor carries wd itself.
LION_COUPLED = (
    ("    const float grad = raw_grad * gnorm_scale;\n    float& exp_avg = state[0];\n    const float interpolated",
     "    const float grad = raw_grad * gnorm_scale + decay_factor * param;\n    float& exp_avg = state[0];\n"
     "    const float interpolated"),
    ("    param = param * decay_factor - lr * direction;\n", "    param = param - lr * direction;\n"),
    ("  rule.decay_factor = static_cast<float>(1.0 - lr * weight_decay);\n  rule.gnorm_scale = static_cast<float>("
     "gnorm_scale);\n  return rule;\n}\n\ninline MomentumRule",
     "  rule.decay_factor = static_cast<float>(weight_decay);\n  rule.gnorm_scale = static_cast<float>("
     "gnorm_scale);\n  return rule;\n}\n\ninline MomentumRule"),
)
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast")


def _built(tree_root, cache, substitutions=(), extra_cflags=None):  # noqa: ANN001, ANN202
    from worker.build import build_extension
    from worker.build.extension import DEFAULT_CFLAGS

    math_h = tree_root / "optimizer_math.h"
    text = math_h.read_text()
    for before, after in substitutions:
        assert text.count(before) == 1, f"{before!r} is not in {math_h} once: the kernel source changed"
        text = text.replace(before, after)
    math_h.write_text(text)
    result = build_extension(tree_root, cache_dir=cache, cuda_archs=[], extra_cflags=extra_cflags or DEFAULT_CFLAGS)
    assert result.ok, result.error
    return result.library_path


@pytest.fixture(scope="module")
def builds(tmp_path_factory, csrc_under_test, build_cache_dir, kernels_build, decay_build):  # noqa: ANN001, ANN201
    from worker.mutations import copy_tree

    def tree(name: str):  # noqa: ANN202
        return copy_tree(csrc_under_test, tmp_path_factory.mktemp(name) / "csrc")

    return {"exact": kernels_build.library_path, "decay_after_update": decay_build.library_path,
            "float32_pow": _built(tree("pow"), build_cache_dir, [(EXACT_POWERS, FLOAT32_POW)]),
            "running_powers": _built(tree("running"), build_cache_dir, [(EXACT_POWERS, RUNNING_POWERS)]),
            "lion_coupled": _built(tree("lion"), build_cache_dir, LION_COUPLED),
            "flags": _built(tree("flags"), build_cache_dir, extra_cflags=FLAGS)}


def _attributed(tmp_path, commit_library: str, baseline_library: str, case) -> dict:  # noqa: ANN001
    from worker.attribution.pair_run import record_parameters, states_path

    tmp_path.mkdir(parents=True, exist_ok=True)
    (commit_file, baseline_file, step), = record_parameters(commit_library, baseline_library, [case], tmp_path,
                                                            device="cpu", states=True).values()
    assert step is not None, "the two builds did not differ on this case"
    return analyze_files(case, str(commit_file), str(baseline_file), step,
                         states_files=(str(states_path(commit_file)), str(states_path(baseline_file))))


@pytest.mark.slow
def test_deepspeed_like_running_powers_from_a_float32_pow_baseline_read_as_precision(tmp_path, builds):  # noqa: ANN001
    found = _attributed(tmp_path, builds["running_powers"], builds["float32_pow"], QUICK[ADAM])
    assert (found["class"], found["variant"], found["baseline_variant"]) == ("precision", RUNNING, POWERS), found
    assert "where the baseline had the bias corrections from float32 powers" in found["label"]
    # Beyond rounding (not a flags-level change), and explained to within the match allowance.
    assert found["scale"] == "semantic" and found["residual_ulps"] * 4 <= found["peak_ulps"], found


@pytest.mark.slow
def test_a_fix_of_a_catalogued_defect_says_it_reverts_it(tmp_path, builds):  # noqa: ANN001
    found = _attributed(tmp_path, builds["exact"], builds["decay_after_update"], QUICK[ADAM])
    assert (found["class"], found["variant"], found["reverts"]) == ("semantic", "reference", "decay_after_update")
    assert found["label"] == "reverts: weight decay applied after the update"


@pytest.mark.slow
def test_lion_decay_coupling_is_named_both_ways(tmp_path, builds):  # noqa: ANN001
    decoupled = _attributed(tmp_path / "a", builds["exact"], builds["lion_coupled"], QUICK[LION])
    assert (decoupled["class"], decoupled["reverts"]) == ("semantic", "decay_coupled"), decoupled
    assert decoupled["label"].startswith("weight decay decoupled (AdamW-style) where the baseline coupled it")
    coupled = _attributed(tmp_path / "b", builds["lion_coupled"], builds["exact"], QUICK[LION])
    assert (coupled["class"], coupled["variant"]) == ("semantic", "decay_coupled"), coupled


@pytest.mark.slow
def test_a_flags_only_change_is_rounding_level_and_its_verdict_names_the_flags(tmp_path, builds):  # noqa: ANN001
    from service.core import attribution_view
    from service.core.environment_attribution import build_change_of_runs
    from worker.build.extension import DEFAULT_CFLAGS

    found = _attributed(tmp_path, builds["flags"], builds["exact"], QUICK[ADAM])
    assert found["class"] == "rounding-level", found
    # What each run records of its build (worker/jobs/run.py: build_flags, toolchain); one machine.
    toolchain = {"cxx_version": "c++ (GCC) 12"}
    change = build_change_of_runs({"toolchain": toolchain, "build_flags": {"cflags": list(FLAGS)}},
                                  {"toolchain": toolchain, "build_flags": {"cflags": list(DEFAULT_CFLAGS)}})
    assert change == {"flags_added": ["-march=native", "-ffp-contract=fast"], "flags_removed": [], "compilers": None}
    detail = {"attribution": {QUICK[ADAM].case_id: found}, "build_change": change}
    text = attribution_view.by_case(detail)[QUICK[ADAM].case_id].text
    assert text.startswith("rounding-level: ") and text.endswith("; build flags changed: + -march=native "
                                                                 "-ffp-contract=fast"), text
    assert "build flags changed: + -march=native -ffp-contract=fast" in attribution_view.headline(detail)


def test_check_names_the_two_trees_build_flags_beside_a_rounding_level_change(tmp_path):  # noqa: ANN001
    # `optdrift check` reads each tree's optdrift.toml (build.cflags, build.defines) as a service run
    # records them, and words them as the service's verdict does.
    import io

    from rich.console import Console

    from worker import pipeline
    from service.cli.check import print_attribution
    from worker.check import build_change_of_jobs

    for name, build in (("old", 'cflags = ["-O3", "-g"]'),
                        ("new", 'cflags = ["-O3", "-march=native", "-fopenmp"]\ndefines = { __AVX512__ = "1" }')):
        (tmp_path / name).mkdir()
        (tmp_path / name / "optdrift.toml").write_text(f"[build]\n{build}\n")
    job, base_job = (pipeline.prepare(tmp_path / name, requested_battery="ci", local_battery_file=True)
                     for name in ("new", "old"))
    change = build_change_of_jobs(job, base_job)
    assert change == {"flags_added": ["-march=native", "-fopenmp", "-D__AVX512__=1"], "flags_removed": ["-g"],
                      "compilers": None}
    assert build_change_of_jobs(base_job, base_job) is None
    out = io.StringIO()
    rounding = {"class": "rounding-level", "variant": None, "first_step_ulps": 4.0, "peak_ulps": 9.0}
    print_attribution({QUICK[ADAM].case_id: rounding}, Console(file=out, width=400), build_change=change)
    assert "build flags changed: + -march=native -fopenmp -D__AVX512__=1, - -g" in out.getvalue().splitlines()[-1]
