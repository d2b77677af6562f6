"""The kernels' own speed per run on the CPU path (real kernel host, real build, real PostgreSQL):
timing every bundled kernel through the adapter, storing the samples, the comparison with the
baseline in the API and the dashboard. The noise model itself: tests/service/core/test_kernel_speed_noise.py;
the worker end to end: tests/scenarios/test_kernel_speed_e2e.py; the CUDA path: bench/gpu/h200_kernel_speed.sh.

Verdicts here are asserted on synthetic stored samples only: wall-clock timings on this shared
2-core machine move by tens of percent between processes, so no test may judge real CPU timings.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from service.domain import kernel_speed, projects, runs, submissions
from tests.service_fixtures import make_archive

OPTIMIZERS = ("adam", "ademamix", "lion", "momentum", "rmsprop", "adagrad")
N = 4096


@pytest.fixture(scope="module")
def host_answers(kernels_build) -> dict:  # noqa: ANN001
    """`time_kernels` answers of one kernel host on the bundled build (CPU): the whole plan, small
    (4096 elements, 5 samples), then a spent budget and two bad plans."""
    from worker.engine.host import KernelHost

    asked = {"timed": {"sizes": [N], "repeats": 5, "warmup": 1, "budget_s": 60},
             "spent": {"sizes": [N], "budget_s": 0},
             "unknown_field": {"sizes": [N], "repetitions": 3},
             "bad_size": {"sizes": [-1]}}
    answers = {}
    with KernelHost(kernels_build.library_path, device="cpu") as host:
        for name, plan in asked.items():
            answers[name] = host.ask({"op": "time_kernels", "plan": plan}, timeout_s=120)
            assert answers[name] is not None, host.stderr_tail()
    return answers


def test_every_bundled_kernel_is_timed_through_its_adapter(host_answers) -> None:  # noqa: ANN001
    timed = host_answers["timed"]
    found = {(t["kernel"], t["param_dtype"]): t for t in timed["timings"]}
    assert set(found) == {(f"{o}/{f}", d) for o in OPTIMIZERS for f in ("32bit", "8bit_blockwise")
                          for d in ("float32", "bfloat16")}
    assert timed["device"] == "cpu" and timed["not_timed"] == 0 and timed["not_applicable"] == 0
    for timing in found.values():
        assert timing["error"] is None, timing
        assert len(timing["samples_s"]) == len(timing["copy_samples_s"]) == 5
        assert all(0 < s < 1 for s in timing["samples_s"] + timing["copy_samples_s"])
    # Nominal bytes: param read+written, grad read, each state read+written. Adam fp32: 2 fp32 states.
    assert found[("adam/32bit", "float32")]["bytes_moved"] == (2 * 4 + 4 + 2 * 2 * 4) * N
    assert found[("adam/32bit", "bfloat16")]["bytes_moved"] == (2 * 2 + 2 + 2 * 2 * 4) * N
    # 8-bit: a uint8 code per element and a float32 absmax per 256-element block, per state.
    assert found[("adam/8bit_blockwise", "float32")]["bytes_moved"] == (2 * 4 + 4) * N + 2 * 2 * (N + 4 * N // 256)


def test_the_budget_and_a_bad_plan(host_answers) -> None:  # noqa: ANN001
    spent = host_answers["spent"]
    assert spent["timings"] == [] and spent["not_timed"] == 24  # out of budget: nothing half-timed
    assert "unknown plan field(s) ['repetitions']" in host_answers["unknown_field"]["error"]
    assert "sizes must be positive integers" in host_answers["bad_size"]["error"]


def test_the_slowed_mutant_does_more_work_and_keeps_the_trajectory(kernels) -> None:  # noqa: ANN001
    """The mutant bench/gpu/h200_kernel_speed.sh must flag (worker/speed/mutant.py): its adam/32bit
    step makes an extra pass over the parameter, gives the bundled step's values, and times through
    the same code as the real kernels; other kernels stay the originals."""
    import torch

    from worker.adapters.bundled import FAMILIES, BundledAdapter
    from worker.engine.lifecycle import family_for
    from worker.speed import timing
    from worker.speed.mutant import SlowedFamily, slowed_families

    mutated = slowed_families(FAMILIES, ["adam/32bit"], fraction=1.0)
    assert isinstance(mutated["32bit"], SlowedFamily) and mutated["8bit_blockwise"] is FAMILIES["8bit_blockwise"]
    case = timing._timing_case("adam", "32bit", "float32", N)
    params = []
    for families in (FAMILIES, mutated):
        family = family_for(families, case)
        param = torch.linspace(-1, 1, N)
        handle = family.open(case, param, torch.device("cpu"))
        family.bind(handle, param, torch.full((N,), 1e-2))(1)
        family.close(handle)
        params.append(param)
    assert torch.equal(params[0], params[1])
    answer = timing.time_kernels(timing.TimingPlan(sizes=(N,), repeats=5, warmup=1, optimizers=("adam", "lion"),
                                                   families=("32bit",), dtypes=("float32",)),
                                 torch.device("cpu"), BundledAdapter(), mutated)
    assert [(t["kernel"], t["error"], len(t["samples_s"])) for t in answer["timings"]] == \
        [("adam/32bit", None, 5), ("lion/32bit", None, 5)]
    with pytest.raises(ValueError, match="no family '4bit'"):
        slowed_families(FAMILIES, ["adam/4bit"], fraction=1.0)


# ----------------------------------------------------------------------------- service side
def _answer(medians: dict[str, float], seed: int, *, error: str | None = None) -> dict:
    """A `time_kernels` answer with 50 samples per kernel: the median times 1 % lognormal jitter."""
    rng = np.random.default_rng(seed)
    timings = []
    for kernel, median in medians.items():
        optimizer, family = kernel.split("/")
        timings.append({"kernel": kernel, "optimizer": optimizer, "family": family, "param_dtype": "float32",
                        "size": N, "samples_s": list(median * rng.lognormal(0, 0.01, 50)),
                        "bytes_moved": 28 * N, "copy_samples_s": list(0.5 * median * rng.lognormal(0, 0.01, 50)),
                        "error": None})
    if error:
        timings.append({"kernel": "lion/32bit", "optimizer": "lion", "family": "32bit", "param_dtype": "float32",
                        "size": N, "samples_s": [], "bytes_moved": 0, "copy_samples_s": [], "error": error})
    return {"timings": timings, "device": "synthetic", "not_timed": 0, "not_applicable": 0}


def _done_run(session, settings, sha: str, parents: list[str]):  # noqa: ANN001, ANN202
    project = projects.ensure(session=session, name="speedp")
    run = submissions.submit_commit(session=session, settings=settings, project=project, sha=sha,
                                    parents=parents, archive=make_archive({"a.cpp": sha})).runs[0]
    assert runs.claim(session=session, run_id=run.id, worker="w")
    runs.set_status(session=session, run_id=run.id, worker="w", status="done")
    session.refresh(run)
    return run


@pytest.fixture
def two_runs(db_session, api_settings):  # noqa: ANN001, ANN202
    base = _done_run(db_session, api_settings, "base", [])
    child = _done_run(db_session, api_settings, "child", ["base"])
    kernel_speed.store(session=db_session, run_id=base.id,
                       answer=_answer({"adam/32bit": 100e-6, "momentum/32bit": 50e-6}, seed=1))
    # adam 30 % slower; momentum unchanged; lion failed in this run
    kernel_speed.store(session=db_session, run_id=child.id,
                       answer=_answer({"adam/32bit": 130e-6, "momentum/32bit": 50e-6}, seed=2, error="RuntimeError: boom"))
    db_session.commit()
    return base, child


def test_samples_are_stored_at_full_precision_and_replaced_on_a_retry(db_session, api_settings) -> None:  # noqa: ANN001
    run = _done_run(db_session, api_settings, "solo", [])
    answer = _answer({"adam/32bit": 100e-6}, seed=3)
    answer["timings"][0]["samples_s"][0] = 0.1 + 0.2  # not 0.3: a rounding store would lose it
    for _ in range(2):
        assert kernel_speed.store(session=db_session, run_id=run.id, answer=answer) == 1
    [row] = kernel_speed.rows(session=db_session, run_id=run.id)
    db_session.expire(row)
    assert row.samples_s == answer["timings"][0]["samples_s"] and row.samples_s[0] == 0.1 + 0.2
    assert row.median_s == float(np.median(answer["timings"][0]["samples_s"]))
    assert row.copy_fraction == pytest.approx(0.5, rel=0.01)  # copy time / kernel time
    assert kernel_speed.run_speed(session=db_session, run=run).verdict == "no-baseline"


def test_the_api_names_the_slower_kernel_apart_from_the_trajectory_verdict(api, two_runs) -> None:  # noqa: ANN001
    base, child = two_runs
    body = api.get(f"/api/v1/runs/{child.id}/speed").json()
    assert body["verdict"] == "slower" and body["baseline_run_id"] == base.id
    assert body["threshold"] == 0.05 and body["confidence"] == 0.99
    by_kernel = {k["kernel"]: k for k in body["kernels"]}
    adam = by_kernel["adam/32bit"]
    assert adam["verdict"] == "slower" and adam["ratio_low"] > 1.05
    assert adam["ratio"] == pytest.approx(1.3, rel=0.02)  # 1 % jitter, 50 samples
    assert by_kernel["momentum/32bit"]["verdict"] == "same"
    assert by_kernel["lion/32bit"]["verdict"] == "error" and by_kernel["lion/32bit"]["error"] == "RuntimeError: boom"
    assert adam["bandwidth_bytes_per_s"] == pytest.approx(28 * N / adam["median_s"])
    assert "1 of 2 kernels slower" in body["summary"] and "adam/32bit" in body["summary"]
    # the trajectory side is untouched: the run has no verdict row from speed
    assert api.get(f"/api/v1/runs/{child.id}").json()["verdict"] is None
    assert api.get(f"/api/v1/runs/{base.id}/speed").json()["verdict"] == "no-baseline"

    history = api.get("/api/v1/projects/speedp/speed/history",
                      params={"kernel": "adam/32bit", "param_dtype": "float32", "size": N}).json()
    assert [p["run_id"] for p in history["data"]] == [base.id, child.id]
    assert [p["sha"] for p in history["data"]] == ["base", "child"]
    assert history["data"][1]["median_s"] / history["data"][0]["median_s"] == pytest.approx(1.3, rel=0.02)
    kernels = api.get("/api/v1/projects/speedp/speed/kernels").json()["data"]
    assert {(k["kernel"], k["size"]) for k in kernels} == {("adam/32bit", N), ("momentum/32bit", N)}
    assert api.get("/api/v1/runs/2147483647/speed").status_code == 404
    assert api.get("/api/v1/projects/speedp/speed/history").status_code == 422  # kernel is required


def test_the_dashboard_shows_the_speed_table_and_a_kernel_history(api, two_runs) -> None:  # noqa: ANN001
    base, child = two_runs
    page = api.get(f"/runs/{child.id}/speed").text
    assert 'data-kernel="adam/32bit" data-dtype="float32" data-size="4096" data-verdict="slower"' in page
    assert 'data-kernel="momentum/32bit" data-dtype="float32" data-size="4096" data-verdict="same"' in page
    assert "RuntimeError: boom" in page and f'href="/runs/{base.id}/speed"' in page
    assert f'href="/runs/{child.id}/speed"' in api.get(f"/runs/{child.id}").text  # linked from the run page
    history = api.get("/projects/speedp/speed", params={"kernel": "adam/32bit", "param_dtype": "float32",
                                                         "size": N}).text
    assert "Plotly.newPlot" in history and f'data-run-id="{base.id}"' in history and f'data-run-id="{child.id}"' in history
    assert "No timing of momentum/9bit" in api.get("/projects/speedp/speed", params={"kernel": "momentum/9bit"}).text
    # the commit list's speed column: the run's speed verdict, linked to its table
    commits = api.get("/projects/speedp").text
    assert f'<a href="/runs/{child.id}/speed"><span class="badge badge-changed-farther" title="kernel speed: slower"' in commits
    assert f'<a href="/runs/{base.id}/speed"><span class="badge badge-neutral" title="kernel speed: no-baseline"' in commits


def test_numbers_on_the_page_are_the_stored_ones(db_session, two_runs) -> None:  # noqa: ANN001
    _, child = two_runs
    speed = kernel_speed.run_speed(session=db_session, run=child)
    adam = next(k for k in speed.kernels if k.kernel == "adam/32bit")
    [row] = [r for r in kernel_speed.rows(session=db_session, run_id=child.id) if r.kernel == "adam/32bit"]
    assert adam.median_s == row.median_s and adam.samples == 50
    assert math.isclose(adam.spread_s, float(np.subtract(*np.percentile(row.samples_s, [75, 25]))))


def test_when_a_run_is_timed() -> None:
    """On by default on a CUDA worker (120 s), off on a CPU worker; OPTDRIFT_SPEED_BUDGET_S=0 turns
    it off anywhere; a project's `kernel_speed = false` turns it off for its runs, before any host starts."""
    from types import SimpleNamespace

    from service.core.project_config import parse_config
    from service.settings import Settings
    from worker.jobs import timing
    from worker.speed import record

    assert record.budget_s(Settings(worker_device="cuda")) == 120.0
    assert record.budget_s(Settings(worker_device="cuda", speed_budget_s=0)) == 0.0
    assert record.budget_s(Settings(worker_device="cpu")) == 0.0
    assert record.budget_s(Settings(worker_device="cpu", speed_budget_s=30)) == 30.0
    assert record.plan(Settings(), 30.0) == {"sizes": [1 << 20, 1 << 26], "repeats": 50, "budget_s": 30.0}
    off = SimpleNamespace(config=parse_config('[project]\nkernel_speed = false\n'))
    # None: not timed, and nothing else touched (no database, build or host is needed to say so)
    assert timing.time_and_store(run_id=1, job=off, built=None, policy=None,
                                 settings=Settings(worker_device="cuda")) is None
    assert parse_config("").kernel_speed is True


def test_the_speed_table_fits_80_columns_and_cuts_nothing() -> None:
    """`optdrift speed` in an 80-column terminal: every value whole (no '…'), no line over 80, an
    error in full below the table; from 110 columns the baseline's median is added."""
    from rich.console import Console

    from service.cli.speed import speed_table

    timed = dict(kernel="ademamix/8bit_blockwise", param_dtype="bfloat16", size=1 << 26, error=None, ratio=1.0123,
                 ratio_low=0.9987, ratio_high=1.0245, median_s=1234.456e-6, spread_s=1.2e-6,
                 bandwidth_bytes_per_s=3.1e12, copy_fraction=0.82, baseline_median_s=1222.0e-6, verdict="slower")
    failed = dict(timed, kernel="adam/32bit", error="RuntimeError: CUDA error: invalid configuration argument")
    speed = dict(run_id=3, verdict="slower", summary="1 of 48 kernels slower", kernels=[timed, failed])
    for width, baseline_shown in ((80, False), (120, True)):
        console = Console(width=width, record=True)
        console.print(speed_table(speed, width=width))
        text = console.export_text()
        assert "…" not in text and max(map(len, text.splitlines())) <= width
        for value in ("2^26", "1234.5 ± 0.1 %", "3100 (82 %)", "1.012 (0.999–1.024)", "slower",
                      "adam/32bit bf16 n=2^26: RuntimeError: CUDA error: invalid configuration argument"):
            assert value in text, (value, text)
        # the kernel's whole name (what the history API takes), folded onto a second line at 80 columns
        first_words = [line.split()[0] for line in text.splitlines() if line.strip()]
        assert "ademamix/8bit_blockwise" in text or any(
            a + b == "ademamix/8bit_blockwise" for a, b in zip(first_words, first_words[1:])), text
        assert ("1222.0" in text) == baseline_shown


def test_a_timing_stops_for_a_waiting_run(kernels_build) -> None:  # noqa: ANN001
    """A run submitted right after a verdict must not wait behind the previous run's kernel timing:
    while the host times, the worker asks whether a run waits, and on yes kills the host, so the
    request ends without its answer, and measure() raises TimingYielded (the task queues it again).
    The plan (2^20 elements, 50 samples, 48 kernels) takes far longer on this CPU than the first
    check, which already says yes."""
    from pathlib import Path

    from worker import pipeline
    from worker.engine.host import KernelHost
    from worker.speed import record

    long_plan = {"sizes": [1 << 20], "repeats": 50, "budget_s": 600}
    asked: list[int] = []

    def run_waiting() -> bool:
        asked.append(1)
        return True

    with KernelHost(kernels_build.library_path, device="cpu") as host:
        host.start()
        with record._interrupted_when(run_waiting, host) as yielded:
            answer = host.ask({"op": "time_kernels", "plan": long_plan}, timeout_s=600)
        assert yielded.is_set() and answer is None and not host.running() and asked == [1]

    # Through measure(): no run waits when the host is taken; one comes while it times.
    answers = iter([False, True])
    asked.clear()

    def run_comes() -> bool:
        asked.append(1)
        return next(answers)

    job = pipeline.prepare(Path(__file__).resolve().parents[3] / "csrc", requested_battery="quick")
    with pytest.raises(record.TimingYielded):
        record.measure(job, kernels_build, pipeline.Policy(device="cpu"), timing_plan=long_plan,
                       should_yield=run_comes)
    assert len(asked) == 2


def test_a_run_that_came_while_the_timing_built_gets_the_spare(kernels_build, monkeypatch) -> None:  # noqa: ANN001
    """A run that came while the timing fetched and built its tree: measure() yields before it takes
    a host, so the spare stays for the run and no timing kernel starts."""
    from pathlib import Path

    from worker import pipeline
    from worker.engine import host, host_reserve
    from worker.speed import record

    def no_host(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("a host was taken or started although a run waits")

    monkeypatch.setattr(host_reserve, "take", no_host)
    monkeypatch.setattr(host.KernelHost, "__init__", no_host)
    job = pipeline.prepare(Path(__file__).resolve().parents[3] / "csrc", requested_battery="quick")
    with pytest.raises(record.TimingYielded):
        record.measure(job, kernels_build, pipeline.Policy(device="cpu", warm_host=True),
                       timing_plan={"sizes": [1 << 10], "repeats": 3, "budget_s": 60}, should_yield=lambda: True)


def test_a_timing_waits_for_waiting_runs_and_for_the_co_run_this_worker_queued(monkeypatch) -> None:
    """The H200 run of 2026-12-01 (round 6) stored a flagged commit's co-run detail 2.8 s later
    because an earlier run's re-queued timing ran first. Timings now wait for runs and for a co-run
    this worker process queued (until it starts, for CORUN_FIRST_S at most: another worker may take it)."""
    from worker.jobs import follow_ups

    monkeypatch.setattr(follow_ups, "_corun_sent", {})
    assert follow_ups.timing_waits_for(0) is None
    assert follow_ups.timing_waits_for(2) == "2 run(s) waiting"
    clock = [1000.0]
    monkeypatch.setattr(follow_ups.time, "monotonic", lambda: clock[0])
    follow_ups._corun_sent[7] = clock[0]  # as send_corun records it
    assert follow_ups.timing_waits_for(0) == "the co-run of run(s) [7] goes first"
    clock[0] += follow_ups.CORUN_FIRST_S + 1  # never started here (another worker took it)
    assert follow_ups.timing_waits_for(0) is None and follow_ups._corun_sent == {}
    follow_ups._corun_sent[8] = clock[0]
    follow_ups.corun_started(8)  # what the co-run task does when it starts
    assert follow_ups.timing_waits_for(0) is None
