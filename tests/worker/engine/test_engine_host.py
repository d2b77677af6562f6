"""Kernel hosts for real: one build per subprocess; a crash, a hang or a kernel error costs one case.

Faults are injected with the host's test-only OPTDRIFT_TEST_HOST_FAULT variable (see
worker/engine/host/faults.py): "abort:TEXT" calls os.abort() and "hang:TEXT" sleeps when a case id
contains TEXT.
"""

import os

import pytest

from service.core.results import GradientStreamSpec
from worker.battery import OPTIMIZER_HYPER_DEFAULTS, make_case
from worker.engine.host import FAULT_ENV, KernelHost

pytestmark = pytest.mark.slow


def _case(optimizer, seed, **hyper):
    return make_case(optimizer=optimizer, family="32bit", param_dtype="float32",
                     hyper={**OPTIMIZER_HYPER_DEFAULTS[optimizer], "lr": 0.1, "weight_decay": 0.1, **hyper},
                     gradient=GradientStreamSpec(kind="closed"), seed=seed, size=300, steps=5)


def _host(build, fault=None, **kwargs):
    env = dict(os.environ)
    env.pop(FAULT_ENV, None)
    if fault:
        env[FAULT_ENV] = fault
    return KernelHost(build.library_path, device="cpu", env=env, **kwargs)


def test_host_results_are_deterministic_and_fingerprinted(kernels_build):
    cases = [_case("adam", 0), _case("lion", 1)]
    with _host(kernels_build) as first, _host(kernels_build) as second:
        a = [first.run(c) for c in cases]
        b = [second.run(c) for c in cases]
        assert first.environment.device_kind == "cpu" and first.environment.class_key.startswith("cpu-")
    for x, y in zip(a, b):
        assert x.status == y.status == "ok"
        assert x.trajectory.digests == y.trajectory.digests
        assert len(set(x.trajectory.digests)) == 5  # the state moves every step
        # fp32 kernel vs float64 AdamW / Lion: well inside 1e-4 after 5 steps at lr=0.1
        # (float32 rounding ~6e-8 relative per op on values up to ~32).
        assert 0 < x.trajectory.ref64_max_abs[-1] < 1e-4
    assert a[0].trajectory.digests != a[1].trajectory.digests


def test_a_crashing_case_is_broken_and_the_host_restarts_for_the_rest(kernels_build):
    cases = [_case("adam", 0), _case("adam", 1), _case("adam", 2)]
    with _host(kernels_build, fault=f"abort:{cases[1].case_id}") as host:
        results = [host.run(c) for c in cases]
        assert host.restarts == 1
    assert [r.status for r in results] == ["ok", "broken", "ok"]
    assert "SIGABRT" in results[1].message
    # The restarted host gives the same bits as an undisturbed one.
    with _host(kernels_build) as clean:
        assert clean.run(cases[2]).trajectory.digests == results[2].trajectory.digests


def test_a_hanging_case_times_out_and_the_run_goes_on(kernels_build):
    cases = [_case("momentum", 0), _case("momentum", 1)]
    with _host(kernels_build, fault=f"hang:{cases[0].case_id}", case_timeout_s=5) as host:
        results = [host.run(c) for c in cases]
    assert results[0].status == "broken" and "timed out after 5 s" in results[0].message
    assert results[1].status == "ok"


def test_a_kernel_error_is_a_broken_case_naming_the_argument(kernels_build):
    bad = _case("lion", 0, beta1=1.5)  # CaseSpec does not range-check; the kernel's checks do
    with _host(kernels_build) as host:
        result = host.run(bad)
        assert result.status == "broken" and "beta1" in result.message
        assert host.run(_case("adam", 0)).status == "ok"  # same host, still healthy
        assert host.restarts == 0


def test_a_library_that_cannot_load_is_broken_not_a_crash(tmp_path):
    from worker.build import BuildResult

    missing = BuildResult(ok=True, digest="x", library_path=str(tmp_path / "nope.so"))
    with _host(missing, startup_timeout_s=60) as host:
        result = host.run(_case("adam", 0))
    assert result.status == "broken" and "did not start" in result.message and "nope.so" in result.message


@pytest.mark.parametrize("lie, says", [
    ("garbage", "not JSON"),
    ("flood", "a line over"),
    ("foreign", "answered for case"),
    ("series", "no valid result"),  # a known series claimed when none was asked for
])
def test_a_host_that_lies_costs_only_its_case(kernels_build, lie, says):
    """The host runs submitted code: its answers are checked like any untrusted input. A line that
    is not JSON, a line without end (memory), a result for a case nobody asked for: that case is
    broken with the reason, the others stand, in the one-case and the fast path alike."""
    cases = [_case("adam", 0), _case("adam", 1), _case("adam", 2)]
    with _host(kernels_build, fault=f"{lie}:{cases[1].case_id}") as host:
        one_by_one = [host.run(c) for c in cases]
    with _host(kernels_build, fault=f"{lie}:{cases[1].case_id}") as host:
        fast = host.run_many(cases)
    for results in (one_by_one, fast):
        assert [r.status for r in results] == ["ok", "broken", "ok"], [r.message for r in results]
        assert says in results[1].message and results[1].case == cases[1]


def test_no_wait_goes_past_the_run_deadline(kernels_build):
    """A run's time budget (worker/jobs/run.py RunBudget) reaches into the host: a hanging case ends at
    the deadline, not after the per-case timeout, and what is asked afterwards is not run."""
    import time

    cases = [_case("adam", 0), _case("adam", 1)]
    started = time.monotonic()
    with _host(kernels_build, fault=f"hang:{cases[0].case_id}", case_timeout_s=120,
               deadline=time.monotonic() + 8) as host:
        results = [host.run(c) for c in cases]
    assert time.monotonic() - started < 30
    assert [r.status for r in results] == ["broken", "broken"]
    assert "time budget ran out during this case" in results[0].message
    assert results[1].message == "not run: the run's time budget ran out"


def test_the_params_only_corun_reproduces_run_case_bit_for_bit(kernels_build, tmp_path):
    """The co-run's kernels-only path (worker.engine.trajectory.run_params) must step exactly as run_case:
    the same digests every step, the same parameters written, for open- and closed-loop gradients
    and an 8-bit case; only the references are skipped."""
    from service.core.results import GradientStreamSpec as Stream

    cases = [_case("adam", 0), _case("lion", 1),
             make_case(optimizer="adam", family="32bit", param_dtype="float32",
                       hyper={**OPTIMIZER_HYPER_DEFAULTS["adam"], "lr": 0.1, "weight_decay": 0.1},
                       gradient=Stream(kind="open", zero_fraction=0.25), seed=3, size=777, steps=6),
             make_case(optimizer="adam", family="8bit_blockwise", param_dtype="float32",
                       hyper={**OPTIMIZER_HYPER_DEFAULTS["adam"], "lr": 1e-2, "weight_decay": 1e-2},
                       gradient=Stream(kind="open"), seed=4, size=600, steps=4)]
    with _host(kernels_build) as full, _host(kernels_build) as params_only:
        for case in cases:
            full.submit(case, tmp_path / "full.f32")
            reference = full.collect()
            params_only.submit(case, tmp_path / "params.f32", params_only=True)
            fast = params_only.collect()
            assert reference.status == fast.status == "ok", (reference.message, fast.message)
            assert fast.trajectory.digests == reference.trajectory.digests
            assert fast.trajectory.ref64_max_abs == []  # no references were run
            written = (tmp_path / "params.f32").read_bytes()
            assert len(written) == case.steps * case.size * 4
            assert written == (tmp_path / "full.f32").read_bytes()


def test_run_many_pauses_between_bursts_of_answers(kernels_build):
    """on_pause() comes whenever no answer is ready: between the fast runner's waves, so a caller
    storing results in batches (worker/jobs/run.py StoredResults) writes each wave as it ends."""
    from worker.battery import load_battery

    cases = load_battery("quick").expand()
    events: list[str] = []
    with _host(kernels_build) as host:
        results = host.run_many(cases, on_result=lambda i, r: events.append("result"),
                                on_pause=lambda: events.append("pause"))
    assert len(results) == len(cases) and events.count("result") == len(cases)
    first, last = events.index("result"), len(events) - 1 - events[::-1].index("result")
    assert "pause" in events[first:last], "no pause between the first and the last answer"


def test_hosts_started_together_overlap_their_starts_and_a_failed_one_reports_on_its_first_case(kernels_build, tmp_path):
    """start_together spawns every host before waiting for any, and a host that cannot start is
    left stopped, so its first case starts it again and reads broken with why."""
    import time

    case = _case("adam", 0)
    with _host(kernels_build) as first, _host(kernels_build) as second, \
            KernelHost(str(tmp_path / "missing.so"), device="cpu") as broken:
        started = time.monotonic()
        KernelHost.start_together([first, second])
        together = time.monotonic() - started
        assert first.running() and second.running()
        # Started one after the other, the call would last at least the sum of the two hosts'
        # spawn-to-ready times; spawned together, their starts overlap (an order, not a speed).
        assert together < first.startup_s["spawn to ready"] + second.startup_s["spawn to ready"]
        assert first.run(case).status == second.run(case).status == "ok"
        assert first.restarts == second.restarts == 0
        KernelHost.start_together([broken])
        assert not broken.running()
        result = broken.run(case)
        assert result.status == "broken" and "missing.so" in (result.message or "")
