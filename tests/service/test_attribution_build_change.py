"""Issue 47: a verdict names what differs between the commit's build and its baseline's (flags,
defines, compilers, as each run recorded them: worker/jobs/run.py's environment detail), beside a
rounding-level change and in the attribution's headline, through the real database and the API's
presenter. DeepSpeed 0.14.3 against 0.14.2 changed only its build flags."""

from __future__ import annotations

from sqlalchemy import select

from service import run_store
from service.api.presenters import verdict_public
from service.core.verdict_detail import CorunRecord
from service.core.verdicts import compare_runs
from service.db.models import Verdict
from tests.service.test_run_store import _claimed, _commit_run, _result

TOOLCHAIN = {"cxx_version": "c++ (GCC) 12.2.0", "nvcc_version": None}
BASELINE_BUILD = {"cflags": ["-O3", "-g"], "cuda_cflags": [], "defines": {}}
COMMIT_BUILD = {"cflags": ["-O3", "-march=native", "-fopenmp"], "cuda_cflags": [], "defines": {"__AVX512__": "1"}}
ROUNDING = {"class": "rounding-level", "variant": None, "first_step_ulps": 1.0, "peak_ulps": 2.0, "scale": "rounding-level"}


def _judged(session, settings, builds: tuple[dict, dict]):  # noqa: ANN001, ANN202
    """A baseline run and its child whose case c1 changed, each recording its build flags."""
    baseline = _commit_run(session, settings, "a", [])
    child = _commit_run(session, settings, "b", ["a"])
    for run, c1_digests, build in ((baseline, ["1", "2", "3"], builds[0]), (child, ["1", "2", "9"], builds[1])):
        claimed = _claimed(session, run)
        claimed.start_cases(2)
        claimed.store_batch([(0, _result("c0", ["1", "2", "3"])), (1, _result("c1", c1_digests))], cases_done=2)
        claimed.record(battery_hash="h")
        claimed.finish({"toolchain": TOOLCHAIN, "build_flags": build})
        run_store.judge(run.id, worker="w", settings=settings, session=session)
    return baseline, child


def test_a_flags_only_change_is_named_in_the_verdict(db_session, api_settings) -> None:  # noqa: ANN001
    baseline, child = _judged(db_session, api_settings, (BASELINE_BUILD, COMMIT_BUILD))
    verdict = db_session.scalar(select(Verdict).where(Verdict.run_id == child.id))
    assert verdict.detail["build_change"] == {"flags_added": ["-march=native", "-fopenmp", "-D__AVX512__=1"],
                                              "flags_removed": ["-g"], "compilers": None}
    # The co-run's diffs replace the detail: the difference stays beside them, and beside the attribution.
    inputs = run_store.corun_inputs(child.id, session=db_session)
    comparison = compare_runs(inputs.commit_result, inputs.baseline_result, {"c1": [0.0, 0.0, 1e-7]})
    assert run_store.store_corun_diffs(child.id, comparison=comparison, corun_record=CorunRecord(), session=db_session)
    db_session.refresh(verdict)
    assert verdict.detail["build_change"]["flags_added"] == ["-march=native", "-fopenmp", "-D__AVX512__=1"]
    run_store.add_attribution(child.id, {"c1": ROUNDING}, session=db_session)
    db_session.refresh(verdict)
    assert verdict.detail["build_change"]["flags_added"] == ["-march=native", "-fopenmp", "-D__AVX512__=1"]

    public = verdict_public(verdict)
    flags = "build flags changed: + -march=native -fopenmp -D__AVX512__=1, - -g"
    (case,) = public.attribution
    assert case.kind == "rounding-level" and case.text.endswith(f"; {flags}"), case.text
    assert case.build_change == flags
    assert f"rounding-level (1); {flags}" in public.attribution_summary


def test_builds_made_alike_name_nothing(db_session, api_settings) -> None:  # noqa: ANN001
    baseline, child = _judged(db_session, api_settings, (BASELINE_BUILD, BASELINE_BUILD))
    run_store.add_attribution(child.id, {"c1": ROUNDING}, session=db_session)
    verdict = db_session.scalar(select(Verdict).where(Verdict.run_id == child.id))
    assert "build_change" not in verdict.detail
    public = verdict_public(verdict)
    assert public.attribution[0].text == "rounding-level: 1.000e+00 ulp at the first divergent step, 2.000e+00 ulp at most"
    assert "build flags" not in public.attribution_summary
