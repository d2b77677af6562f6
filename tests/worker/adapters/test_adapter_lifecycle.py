"""The adapter lifecycle (docs/PROJECTS.md "The adapter contract"): both engines drive every
adapter through open -> step -> state_for_digest -> close and give the same digests; state the
library owns is what is digested; the wrong shortcuts of issue 20 fail loudly, naming the adapter.

The library-owned fixture is tests/fixtures/ownedopt (a pure-PyTorch optimizer library whose
objects own their state, step counter and beta powers) with its adapter and the wrong adapters.
Digests are compared as strings: exact, no tolerance.
"""

from __future__ import annotations

import io
import shutil
import sys
from pathlib import Path

import pytest
import torch

from service.core.project_config import load_project_config
from service.core.verdicts import compare_case
from worker.adapters import get_adapter
from worker.adapters.base import AdapterContractError
from worker.battery import BatterySpec
from worker.engine.conformance import check_adapter, compare_engines, engine_results, mismatches
from worker.engine.digest import digest_tensors
from worker.engine.fast import run_cases_fast
from worker.engine.gradients import GradientStream, initial_parameters
from worker.engine.trajectory import run_case, run_params

FIXTURES = Path(__file__).resolve().parents[3] / "tests" / "fixtures"
OWNEDOPT = FIXTURES / "ownedopt"
FIXTURE_MODULES = {"tinyopt": "tests.fixtures.adapters.tinyopt", "capiopt": "tests.fixtures.adapters.capiopt"}
sys.path.insert(0, str(OWNEDOPT))

import ownedopt_optdrift  # noqa: E402
import wrong_adapters  # noqa: E402

CPU = torch.device("cpu")

# Every optimizer and family at a size past one 256-block, the 32-bit family in bf16 at a size
# inside one, and two betas in one wave; each adapter keeps what it supports.
SMALL = BatterySpec.model_validate({"name": "lifecycle-test", "version": 1, "groups": [
    {"optimizers": ["adam", "ademamix", "lion", "momentum", "rmsprop", "adagrad"],
     "families": ["32bit", "8bit_blockwise"], "sizes": [300], "steps": 3,
     "gradients": [{"kind": "open", "zero_fraction": 0.25}], "points": [{"lr": 0.1, "weight_decay": 0.1}]},
    {"optimizers": ["adam", "ademamix", "lion", "momentum", "rmsprop", "adagrad"],
     "param_dtypes": ["bfloat16"], "sizes": [5], "steps": 3, "points": [{"lr": 0.1, "weight_decay": 0.1}]},
    {"optimizers": ["adam", "lion"], "sizes": [5], "steps": 3, "points": [{"lr": 0.01, "beta1": 0.8, "beta2": 0.95}]},
]}).expand()
# ownedopt: AdamW over 6 steps (a counter two ahead reaches the resync count 8 at step 4), two betas.
OWNED = BatterySpec.model_validate({"name": "ownedopt-test", "version": 1, "groups": [
    {"optimizers": ["adam"], "sizes": [5, 300], "seeds": [0, 1], "steps": 6,
     "gradients": [{"kind": "open"}, {"kind": "closed"}],
     "points": [{"lr": 0.1, "weight_decay": 0.1}, {"lr": 0.01, "beta1": 0.8, "beta2": 0.99}]},
]}).expand()


def _ownedopt(folder: Path = OWNEDOPT / "lib") -> ownedopt_optdrift.OwnedoptAdapter:
    adapter = ownedopt_optdrift.OwnedoptAdapter()
    adapter.load(str(folder))
    return adapter


def _command_build(name: str, build_cache_dir: Path, tmp_path: Path) -> str:
    from worker.build.project import build_project

    tree = tmp_path / name
    shutil.copytree(FIXTURES / name, tree, ignore=shutil.ignore_patterns("commits", "build"))
    result = build_project(tree, load_project_config(tree), cache_dir=build_cache_dir, cuda_archs=[])
    assert result.ok, result.error
    return str(result.library_path)


def _loaded(name: str, request: pytest.FixtureRequest, tmp_path: Path):  # noqa: ANN202
    if name == "bundled":
        request.getfixturevalue("kernels")  # the shared build, loaded into this process
        return get_adapter("bundled")
    if name == "ownedopt":
        return _ownedopt()
    # The fixture adapters in this process by module path (a kernel host gets them by their
    # registered names, worker/adapters/registry.py).
    adapter = get_adapter(FIXTURE_MODULES.get(name, name))
    if name == "bitsandbytes":
        pytest.importorskip("bitsandbytes")
        adapter.load("installed")
    else:
        project = {"tinyopt": "cmake_project", "capiopt": "capi_project"}[name]
        adapter.load(_command_build(project, request.getfixturevalue("build_cache_dir"), tmp_path))
    return adapter


# ----------------------------------------------------------------------------- both engines agree
@pytest.mark.parametrize("name", ["bundled", "bitsandbytes", "tinyopt", "capiopt", "ownedopt"])
def test_every_adapter_in_the_tree_gives_identical_digests_on_both_engines(name, request, tmp_path):
    adapter = _loaded(name, request, tmp_path)
    cases = [c for c in (OWNED if name == "ownedopt" else SMALL) if adapter.unsupported(c, CPU) is None]
    assert len(cases) >= 3, f"{name} runs too few of the test battery's cases to compare the engines"
    pairs = engine_results(cases, CPU, adapter.families())
    assert mismatches(pairs) == []
    # ... and they ran: every case ok with a digest per step (not two identical failures).
    assert all(r.status == "ok" and len(r.trajectory.digests) == r.case.steps for _, r in pairs)


def test_library_owned_state_is_what_is_digested():
    """The digest is over the parameter and the library's own tensors, counter and beta powers
    included: the library driven by hand gives the engines' digests at every step."""
    adapter = _ownedopt()
    case = OWNED[0]
    param = initial_parameters(case.seed, case.size)
    stream = GradientStream(case.gradient, seed=case.seed, size=case.size, device="cpu", grad_dtype=torch.float32)
    h = case.hyper
    optimizer = adapter.library.AdamW([param], lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                                      weight_decay=h["weight_decay"])
    by_hand = []
    for step in range(1, case.steps + 1):
        optimizer.step([stream.kernel_gradient(step, param)])
        by_hand.append(digest_tensors([param, *optimizer.state[0].values()]))
    assert int(optimizer.state[0]["step"]) == case.steps
    assert run_case(case, CPU, families=adapter.families()).trajectory.digests == by_hand
    fast = run_cases_fast(OWNED, CPU, families=adapter.families())
    assert fast[0].trajectory.digests == by_hand


def test_a_mutant_that_only_miscounts_steps_is_flagged_from_step_1(tmp_path):
    """The mutant counts two per step. Its parameters agree with the library's until the beta
    powers are resynced from the counter (count 8 = step 4); its digests differ from step 1,
    because the counter is digested, and the verdict logic calls every case changed at step 1."""
    mutant_lib = tmp_path / "mutant"
    shutil.copytree(OWNEDOPT / "lib", mutant_lib)
    source = (mutant_lib / "ownedopt.py").read_text()
    assert source.count('s["step"] += 1') == 1
    (mutant_lib / "ownedopt.py").write_text(source.replace('s["step"] += 1', 's["step"] += 2'))
    good, mutant = _ownedopt(), _ownedopt(mutant_lib)

    baseline = run_cases_fast(OWNED, CPU, families=good.families())
    commit = run_cases_fast(OWNED, CPU, families=mutant.families())
    verdicts = [compare_case(c, b) for c, b in zip(commit, baseline)]
    assert [(v.verdict, v.first_divergent_step) for v in verdicts] == [("changed", 1)] * len(OWNED)

    case, size = OWNED[1], OWNED[1].size
    params = []
    for adapter in (good, mutant):
        out = io.BytesIO()
        run_params(case, CPU, out, families=adapter.families())
        params.append(torch.frombuffer(bytearray(out.getvalue()), dtype=torch.float32).reshape(case.steps, size))
    assert torch.equal(params[0][:3], params[1][:3])      # steps 1-3: the parameters alone see nothing
    assert not torch.equal(params[0][3], params[1][3])    # step 4: the resync from the wrong count


# ----------------------------------------------------------------------------- the wrong shortcuts
def test_one_shared_library_optimizer_fails_loudly_on_both_engines():
    library = _ownedopt().library
    with pytest.raises(AdapterContractError, match=r"wrong_adapters\.SharedOptimizer returned the same handle"):
        run_cases_fast(OWNED, CPU, families={"32bit": wrong_adapters.SharedOptimizer(library)})
    family = {"32bit": wrong_adapters.SharedOptimizer(library)}
    run_case(OWNED[0], CPU, families=family)
    with pytest.raises(AdapterContractError, match=r"SharedOptimizer returned the same handle .* \(closed"):
        run_case(OWNED[1], CPU, families=family)


def test_a_shared_optimizer_behind_distinct_handles_fails_the_conformance_check():
    """Distinct wrappers pass the handle check; in the fast engine every case then steps with the
    betas of the case opened last, so the engines disagree, on exactly the other betas' cases."""
    family = {"32bit": wrong_adapters.SharedOptimizerBehindWrappers(_ownedopt().library)}
    few = [c for c in OWNED if c.size == 5 and c.gradient.kind == "open"]  # both betas, 4 cases
    with pytest.raises(AdapterContractError, match=r"adapter SharedOptimizerBehindWrappers: the one-case and "
                                                   r"fast engines disagree on 2 of 4 cases"):
        check_adapter("SharedOptimizerBehindWrappers", few, CPU, family)
    mismatched = {m.case_id for m in compare_engines(OWNED, CPU, family)}
    # The 8 cases of one betas point disagree; the other point's (the last opened) are right.
    assert len(mismatched) == 8
    assert len({c.hyper["beta1"] for c in OWNED if c.case_id in mismatched}) == 1


def test_a_shared_step_counter_behind_distinct_handles_fails_loudly():
    class SharedCounter(ownedopt_optdrift.OwnedAdamW):
        def __init__(self, library) -> None:  # noqa: ANN001
            super().__init__(library)
            self.counter = torch.zeros((), dtype=torch.int64)

        def open(self, case, param, device):  # noqa: ANN001, ANN201
            handle = super().open(case, param, device)
            handle.state[0]["step"] = self.counter
            return handle

    with pytest.raises(AdapterContractError, match=r"SharedCounter: state 'step' of case .* shares memory"):
        run_cases_fast(OWNED, CPU, families={"32bit": SharedCounter(_ownedopt().library)})


def test_optimizers_found_by_address_fail_loudly_when_an_address_is_reused():
    """One case per wave: a wave's arena is freed before the next one is made the same size, so
    the next case's parameter gets the finished case's address, and the adapter hands back that
    case's optimizer; the engine refuses it instead of stepping it. A case that ran gave the
    right digests."""
    good = run_cases_fast(OWNED, CPU, families=_ownedopt().families())
    family = {"32bit": wrong_adapters.KeyedByAddress(_ownedopt().library)}
    reused = []
    for case, expected in zip(OWNED, good):
        try:
            result = run_cases_fast([case], CPU, families=family)[0]
        except AdapterContractError as error:
            assert "wrong_adapters.KeyedByAddress returned the same handle" in str(error)
            reused.append(case.case_id)
            continue
        assert result.trajectory.digests == expected.trajectory.digests
    assert reused, "no parameter address was reused: the test did not reach the shortcut's failure"


# ----------------------------------------------------------------------------- lifecycle duties
class _Recording(ownedopt_optdrift.OwnedAdamW):
    """ownedopt, recording which handles are open; its `fail_on` case raises in step 2."""

    def __init__(self, library, fail_on: str | None = None) -> None:  # noqa: ANN001
        super().__init__(library)
        self.fail_on, self.open_now, self.most_open, self.opened, self.closed = fail_on, set(), 0, 0, 0

    def open(self, case, param, device):  # noqa: ANN001, ANN201
        handle = super().open(case, param, device)
        handle.case_id = case.case_id
        self.open_now.add(id(handle))
        self.opened += 1
        self.most_open = max(self.most_open, len(self.open_now))
        return handle

    def step(self, handle, param, grad, step) -> None:  # noqa: ANN001
        if handle.case_id == self.fail_on and step == 2:
            raise RuntimeError("ownedopt: injected failure")
        super().step(handle, param, grad, step)

    def close(self, handle) -> None:  # noqa: ANN001
        self.open_now.discard(id(handle))
        self.closed += 1
        super().close(handle)


def test_every_opened_handle_is_closed_also_after_a_failing_step():
    family = _Recording(_ownedopt().library, fail_on=OWNED[2].case_id)
    results = run_cases_fast(OWNED, CPU, families={"32bit": family})
    assert results[2].status == "broken" and "injected failure" in results[2].message
    assert [r.status for i, r in enumerate(results) if i != 2] == ["ok"] * (len(OWNED) - 1)
    # The wave opened all 16, the broken case's re-run with run_case one more; all closed.
    assert family.opened == len(OWNED) + 1 and family.closed == family.opened and not family.open_now


def test_a_family_that_declares_one_case_at_a_time_runs_on_the_one_case_engine():
    class OneAtATime(_Recording):
        fast_engine = False

    family, few = OneAtATime(_ownedopt().library), OWNED[:4]
    results = run_cases_fast(few, CPU, families={"32bit": family})
    assert family.most_open == 1 and family.opened == len(few)
    expected = run_cases_fast(few, CPU, families=_ownedopt().families())
    assert [r.trajectory.digests for r in results] == [r.trajectory.digests for r in expected]


def test_an_adapter_written_before_the_lifecycle_still_runs_as_handed_over_states():
    class OldMomentum:  # init_states / step(case, param, grad, states, step), no handle
        def init_states(self, case, param):  # noqa: ANN001, ANN201
            return {"buf": torch.zeros_like(param)}

        def step(self, case, param, grad, states, step) -> None:  # noqa: ANN001
            states["buf"].mul_(0.9).add_(grad)
            param.sub_(0.01 * states["buf"])

    case = OWNED[1]
    param = initial_parameters(case.seed, case.size)
    stream = GradientStream(case.gradient, seed=case.seed, size=case.size, device="cpu", grad_dtype=torch.float32)
    buf, by_hand = torch.zeros_like(param), []
    for step in range(1, case.steps + 1):
        buf.mul_(0.9).add_(stream.kernel_gradient(step, param))
        param.sub_(0.01 * buf)
        by_hand.append(digest_tensors([param, buf]))
    pairs = engine_results(OWNED[:4], CPU, {"32bit": OldMomentum()})
    assert mismatches(pairs) == [] and pairs[1][1].trajectory.digests == by_hand


def test_the_adapter_check_command_passes_ownedopt_and_fails_a_shared_optimizer(tmp_path):
    from typer.testing import CliRunner

    from service.cli import app

    battery = tmp_path / "battery.json"
    battery.write_text(BatterySpec.model_validate({"name": "check", "version": 1, "groups": [
        {"optimizers": ["adam"], "sizes": [5], "steps": 3,
         "points": [{"lr": 0.1, "weight_decay": 0.1}, {"lr": 0.01, "beta1": 0.8, "beta2": 0.99}]}]}).model_dump_json())
    common = ["--library", str(OWNEDOPT / "lib"), "--adapter-path", str(OWNEDOPT), "--battery", str(battery)]
    good = CliRunner().invoke(app, ["adapter-check", "--adapter", "ownedopt_optdrift", *common])
    assert good.exit_code == 0, good.output
    assert "both engines agree on all 2 cases (2 betas" in good.output
    bad = CliRunner().invoke(app, ["adapter-check", "--adapter", "wrong_adapters", *common])
    assert bad.exit_code == 1, bad.output
    assert "adapter wrong_adapters: the one-case and fast engines disagree on 1 of 2 cases" in bad.output


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu/h200_adapter_lifecycle.sh)")
def test_library_owned_state_gives_identical_digests_on_both_engines_cuda():
    """On a GPU the fast engine replays its observation as a CUDA graph: the library-owned state
    copied into the digest rows after each step must still be what the graph digests."""
    pairs = engine_results(OWNED, torch.device("cuda"), _ownedopt().families())
    assert mismatches(pairs) == []
    assert all(r.status == "ok" and len(r.trajectory.digests) == r.case.steps for _, r in pairs)
