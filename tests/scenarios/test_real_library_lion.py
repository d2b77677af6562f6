"""Issue 20's acceptance, a real library: lion-pytorch 0.2.5 from PyPI, through its adapter
(worker/adapters/lion_pytorch.py), its own optdrift.toml and battery (tests/fixtures/lion_project),
as a git repository whose tree is the library's own files (tests/lion_project.py):

    base ── comment ──┬── decay     decay: weight decay applied after the sign update
                      └── mixup     mixup: the momentum is averaged with beta1 instead of beta2

Through `optdrift check` (the real CLI, its exit codes): comment → unchanged against base (exit 0);
decay → changed (1), exactly the weight-decayed cases, from step 1; mixup → changed (1), exactly
the cases with beta1 != beta2, from step 1 although the parameters first differ at step 2 — the
library's own momentum is digested. Why those steps is computed below from each case's own data,
not assumed. Through the service (tests/scenarios/test_external_project.py, on its running service, to
spare a second one): a first commit → no-baseline with the not-applicable cases listed, then
decay → changed from step 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from service.core.results import CaseSpec
from tests.lion_project import FIXTURE, LionHistory, make_history
from tests.service_fixtures import REPO_ROOT
from worker.adapters import AdapterError, get_adapter
from worker.adapters.base import AdapterContractError
from worker.battery import load_battery
from worker.build.cache import INSTALLED
from worker.engine.gradients import GradientStream, initial_parameters
from worker.references.optimizers import LionReference

CPU = torch.device("cpu")
CASES = load_battery(str(FIXTURE / "battery.json")).expand()
SPECS = {case.case_id: case for case in CASES}


def runnable(case: CaseSpec) -> bool:
    return case.optimizer == "lion" and case.family == "32bit" and case.hyper["gnorm_scale"] == 1.0


RUNNABLE = {c.case_id for c in CASES if runnable(c)}
NOT_APPLICABLE = {c.case_id for c in CASES} - RUNNABLE
DECAYED = {c.case_id for c in CASES if runnable(c) and c.hyper["weight_decay"] > 0}
MIXED_BETAS = {c.case_id for c in CASES if runnable(c) and c.hyper["beta1"] != c.hyper["beta2"]}


def test_the_battery_has_its_controls():
    assert len(NOT_APPLICABLE) == 3 and DECAYED and MIXED_BETAS
    assert DECAYED < RUNNABLE and MIXED_BETAS < RUNNABLE  # wd = 0 and beta1 = beta2 must stay unchanged


def _stream(case: CaseSpec) -> GradientStream:
    return GradientStream(case.gradient, seed=case.seed, size=case.size, device=CPU, grad_dtype=torch.float32)


@pytest.fixture(scope="module")
def installed_lion():
    adapter = get_adapter("lion_pytorch")
    adapter.load(INSTALLED)
    return adapter


# ----------------------------------------------------------------------------- the adapter
def test_the_library_matches_our_lion_reference(installed_lion):
    """lion-pytorch's update (decoupled_weight_decay=False) is worker/references/optimizers.py's
    LionReference: the parameters are bit-identical over every runnable case's 10 steps at float32
    (both compute p (1 - lr wd) - lr sign(c) elementwise; no |c| here is within rounding of 0).
    The momentum is rounded differently (the library's add(alpha=) against the reference's two
    products), so it is held to 4 float32 ulps of its largest magnitude (each step rounds each
    side at most twice, and beta2 < 1 shrinks earlier differences)."""
    family = installed_lion.families()["32bit"]
    for case in (c for c in CASES if runnable(c)):
        param = initial_parameters(case.seed, case.size)
        reference, stream = LionReference(case, param.clone()), _stream(case)
        handle = family.open(case, param, CPU)
        try:
            for step in range(1, case.steps + 1):
                grad = stream.kernel_gradient(step, param)
                family.step(handle, param, grad, step)
                reference.step(step, grad)
                assert torch.equal(param, reference.param), (case.case_id, step)
                momentum = family.state_for_digest(handle)["exp_avg"]
                tolerance = 4 * torch.finfo(torch.float32).eps * reference.exp_avg.abs().max()
                assert (momentum - reference.exp_avg).abs().max() <= tolerance, (case.case_id, step)
        finally:
            family.close(handle)


def test_the_digest_reads_the_librarys_own_state(installed_lion):
    family = installed_lion.families()["32bit"]
    case = next(c for c in CASES if c.case_id in DECAYED)
    param = initial_parameters(case.seed, case.size)
    handle = family.open(case, param, CPU)
    family.step(handle, param, _stream(case).kernel_gradient(1, param), 1)
    # The very tensor the library updates (not a copy), and the library updates the engine's param.
    assert family.state_for_digest(handle)["exp_avg"] is handle.optimizer.state[handle.param]["exp_avg"]
    assert handle.param.data_ptr() == param.data_ptr()
    with pytest.raises(AdapterContractError, match="another parameter tensor"):
        family.step(handle, param.clone(), param, 2)
    family.close(handle)
    assert not handle.optimizer.state


def test_both_engines_give_identical_digests(installed_lion):
    """The contract's conformance check (worker/engine/conformance.py). The library makes its state
    in its first step, so the family declares fast_engine = False and the fast engine hands its
    cases to run_case: the same digests, every case run to its last step."""
    from worker.engine.conformance import engine_results, mismatches

    pairs = engine_results([c for c in CASES if runnable(c)], CPU, installed_lion.families())
    assert mismatches(pairs) == []
    assert all(r.status == "ok" and len(r.trajectory.digests) == r.case.steps for _, r in pairs)


def test_the_adapter_says_what_it_cannot_run(installed_lion):
    reasons = {c.case_id: installed_lion.unsupported(c, CPU) for c in CASES}
    assert {i for i, reason in reasons.items() if reason} == NOT_APPLICABLE
    assert installed_lion.describe()["version"] == "lion-pytorch 0.2.5"


def test_a_build_folder_without_the_package_is_refused(tmp_path: Path):
    with pytest.raises(AdapterError, match="holds no lion_pytorch package"):
        get_adapter("lion_pytorch").load(str(tmp_path))


# ----------------------------------------------------------------------------- where the defects must show
def test_where_each_defect_must_show():
    """From each case's own starting point and first gradient, at float32:
    * decay: the correct order gives p1 = p0 (1 - lr wd) - lr s, the defect (p0 - lr s)(1 - lr wd),
      s = sign((1 - beta1) g1) (the momentum starts at 0): they differ by lr^2 wd s, which is
      above float32 rounding for some element at step 1 whenever wd > 0 (1e-3 at lr = wd = 0.1;
      1e-8 at lr 1e-3, wd 1e-2 — seen where |p| < ~0.1); with wd = 0 both multiply by exactly 1.
    * mixup: the parameter at step 1 is the same (the interpolation is (1 - beta1) g1 either way)
      but the momentum after it is (1 - beta1) g1 instead of (1 - beta2) g1: the digest, which
      covers the library's momentum, differs at step 1 exactly when beta1 != beta2. The
      parameters follow at step 2, where the interpolation beta1 m1 + (1 - beta1) g2 changes sign
      for some element (g2 is the same: closed streams see the same p1)."""
    for case in (c for c in CASES if runnable(c)):
        h = case.hyper
        p0 = initial_parameters(case.seed, case.size)
        g1 = _stream(case).kernel_gradient(1, p0)
        s = torch.sign((1 - h["beta1"]) * g1)
        decay = 1.0 - h["lr"] * h["weight_decay"]
        before, after = p0 * decay - h["lr"] * s, (p0 - h["lr"] * s) * decay
        assert bool((before != after).any()) == (case.case_id in DECAYED), case.case_id
        momentum, mixed = (1 - h["beta2"]) * g1, (1 - h["beta1"]) * g1
        assert bool((momentum != mixed).any()) == (case.case_id in MIXED_BETAS), case.case_id
        g2 = _stream(case).kernel_gradient(2, before)
        signs = [torch.sign(h["beta1"] * m + (1 - h["beta1"]) * g2) for m in (momentum, mixed)]
        assert bool((signs[0] != signs[1]).any()) == (case.case_id in MIXED_BETAS), case.case_id


# ----------------------------------------------------------------------------- `optdrift check`
@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> LionHistory:
    return make_history(tmp_path_factory.mktemp("lion-pytorch"))


def check(history: LionHistory, name: str, baseline: str | None, home: Path) -> tuple[int, dict, str]:
    """The real CLI without a server: (exit code, the --json-out document, its whole stdout and stderr)."""
    json_out = home / f"{name}.json"
    args = ["check", "--source", str(history[name].tree), "--device", "cpu", "--json-out", str(json_out)]
    if baseline is not None:
        args += ["--baseline", str(history[baseline].tree)]
    script = Path(sys.executable).with_name("optdrift")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "service.cli"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "COLUMNS": "400", "OPTDRIFT_HOME": str(home),
           "OPTDRIFT_BUILD_CACHE_DIR": str(home / "builds"), "OPTDRIFT_DATABASE_URL": "",
           "OPTDRIFT_BROKER_URL": "", "OPTDRIFT_URL": "http://127.0.0.1:9", "OPTDRIFT_PUBLIC_URL": ""}
    answer = subprocess.run([*command, *args], cwd=REPO_ROOT, capture_output=True, text=True, env=env,
                            timeout=300, check=False)
    output = f"exit {answer.returncode}\nstdout:\n{answer.stdout}\nstderr:\n{answer.stderr}"
    assert json_out.exists(), output
    return answer.returncode, json.loads(json_out.read_text()), output


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lion-check-home")


def _by_verdict(comparison: dict) -> dict[str, set[str]]:
    verdicts: dict[str, set[str]] = {}
    for case in comparison["cases"]:
        verdicts.setdefault(case["verdict"], set()).add(case["case_id"])
    return verdicts


def test_check_comment_only_is_unchanged(history, home):
    code, document, output = check(history, "comment", "base", home)
    comparison = document["comparison"]
    assert (comparison["verdict"], code) == ("unchanged", 0), output
    assert _by_verdict(comparison) == {"unchanged": RUNNABLE, "not_applicable": NOT_APPLICABLE}
    # Each side says which library produced it: its build's copy of lion-pytorch 0.2.5.
    for side in ("commit", "baseline"):
        adapter = document["adapter"][side]
        assert adapter["version"] == "lion-pytorch 0.2.5", adapter
        assert adapter["library"].endswith("/build/site/lion_pytorch"), adapter
    assert "version: lion-pytorch 0.2.5" in output  # and the CLI says so


def _changed(history: LionHistory, home: Path, name: str, expected: set[str]) -> dict[str, dict]:
    code, document, output = check(history, name, "comment", home)
    comparison = document["comparison"]
    assert (comparison["verdict"], code) == ("changed", 1), output
    verdicts = _by_verdict(comparison)
    assert verdicts["changed"] == expected and verdicts["unchanged"] == RUNNABLE - expected, output
    changed = {c["case_id"]: c for c in comparison["cases"] if c["verdict"] == "changed"}
    assert all(case["first_divergent_step"] == 1 for case in changed.values()), output
    return changed


def test_check_decay_after_update_is_changed_from_step_1(history, home):
    changed = _changed(history, home, "decay", DECAYED)
    for case_id, case in changed.items():
        diffs = case["max_abs_diff_per_step"]
        assert diffs[0] > 0, case_id
        if ".lr=0.1.wd=0.1." in case_id:
            # |(p0 - lr s)(1 - lr wd) - (p0 (1 - lr wd) - lr s)| = lr^2 wd = 1e-3 where g1 != 0, seen
            # through float32 parameters: each side rounds twice, at most a half ulp of the largest
            # |p| each time, so within 4 eps max|p0| (max|p0| = 26.8 here: 1.3e-5).
            spec = SPECS[case_id]
            tolerance = 4 * torch.finfo(torch.float32).eps * float(initial_parameters(spec.seed, spec.size).abs().max())
            assert abs(diffs[0] - 1e-3) <= tolerance, (case_id, diffs[0])


def test_check_momentum_with_beta1_is_changed_from_step_1_in_the_librarys_state(history, home):
    changed = _changed(history, home, "mixup", MIXED_BETAS)
    for case_id, case in changed.items():
        diffs = case["max_abs_diff_per_step"]
        # Step 1 is flagged by the library's momentum alone: the parameters are still equal; they
        # differ from step 2 (test_where_each_defect_must_show).
        assert diffs[0] == 0.0 and diffs[1] > 0, (case_id, diffs)
