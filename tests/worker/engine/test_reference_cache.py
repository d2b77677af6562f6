"""References computed once (worker.engine.reference_cache): a warm run is a cold run, bit for bit.

Exactness, not tolerance: every per-step series of every case is compared through repr (NaN
matches NaN, -0.0 does not match 0.0) and every digest as a string, between runs through the real
pipeline (worker.pipeline.run: a sandboxed kernel host, the fast engine) without a cache, with an
empty one, and with a warm one, on the CPU. The commit whose trajectories partly changed (the
decay-after-update copy) runs against a cache that holds only the baseline's series: its
unchanged cases come from the cache, its changed ones are computed.
"""

from __future__ import annotations

import sqlite3

import pytest
import torch

from service.core.results import CaseResult, EnvironmentFingerprint, Trajectory
from service.core.project_config import load_project_config
from worker import pipeline
from worker.battery import load_battery
from worker.engine import reference_cache
from worker.engine.reference_cache import ReferenceCache, environment_key, series_key
from worker.engine.fast import run_cases_fast
from worker.engine.kernels_only import run_cases_known
from tests.worker.engine.test_fast_engine import GROUPED

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _job(csrc_under_test):
    battery = load_battery("quick")
    cases = battery.expand()
    # Changed (Adam/AdEMAMix at weight decay) and unchanged cases, 32- and 8-bit, 16-bit dtypes.
    cases = cases[::7]
    return pipeline.Job(source_dir=csrc_under_test, config=load_project_config(csrc_under_test), battery=battery,
                        battery_origin="test", cases=cases)


def _series(ran):
    return [(r.case.case_id, r.status, repr(r.trajectory.model_dump()) if r.trajectory else r.message)
            for r in ran.results]


class _Spy:
    """What the cache gave a run: how many series it held and how many it reused."""

    def __init__(self, monkeypatch):
        self.reused: list[int] = []
        store = ReferenceCache.store
        # Every reuse marked however recent its last mark, so what is marked is what was reused.
        monkeypatch.setattr(reference_cache, "USED_REFRESH_S", -1.0)

        def spying_store(cache, environment, results, reused=()):  # noqa: ANN001
            reused = list(reused)
            self.reused.append(len(reused))
            return store(cache, environment, results, reused)

        monkeypatch.setattr(ReferenceCache, "store", spying_store)


def test_warm_references_give_the_cold_results_bit_for_bit(kernels_build, decay_build, csrc_under_test, tmp_path,
                                                           monkeypatch):
    spy = _Spy(monkeypatch)
    job = _job(csrc_under_test)
    folder = tmp_path / "references"

    def run(build, cache=None, trusted=True):
        policy = pipeline.Policy(device="cpu", reference_cache=cache, trusted=trusted)
        return _series(pipeline.run(job, build, policy))

    # An empty cache holds no series, so the host computes every reference as without one.
    cold_base, cold_commit = run(kernels_build, folder), run(decay_build)
    assert spy.reused == [0]
    assert cold_base != cold_commit  # the commit really changed some cases
    stored, _ = ReferenceCache(folder, writable=False).size()
    assert stored == len(job.cases)
    assert run(kernels_build, folder) == cold_base  # warm: every case from the cache but the layout
    # cases, which the kernels-only first pass (waves) does not run: they compute their references
    assert spy.reused[-1] == sum(case.layout is None for case in job.cases)
    # The commit against the baseline's series: unchanged cases reused, changed ones computed.
    assert run(decay_build, folder, trusted=False) == cold_commit
    unchanged = sum(a == b for a, b, case in zip(cold_base, cold_commit, job.cases) if case.layout is None)
    assert spy.reused[-1] == unchanged and 0 < unchanged < len(job.cases)
    assert ReferenceCache(folder, writable=False).size()[0] == stored  # an untrusted run adds nothing


def test_the_metrics_of_a_known_series_come_from_the_cache_and_only_trusted_runs_write(tmp_path):
    # A forged entry shows that a hit takes the stored metrics (the host's digests-only answer is
    # filled from the cache, never recomputed), and where the rule "only trusted runs write" matters.
    case = load_battery("quick").expand()[0]
    environment = _environment("cpu-a")
    computed = _trajectory(case.steps)
    ReferenceCache(tmp_path, writable=True).store(environment, [CaseResult(case=case, status="ok", trajectory=computed)])
    forged = computed.model_copy(update={"ref64_max_abs": [123.0] * case.steps})
    forgery = [CaseResult(case=case, status="ok", trajectory=forged)]
    assert ReferenceCache(tmp_path, writable=False).store(environment, forgery) == 0
    [held] = ReferenceCache(tmp_path, writable=False).lookup(environment, [case])[0].values()
    assert repr(held.model_dump()) == repr(computed.model_dump())  # the untrusted store changed nothing
    hit = CaseResult(case=case, status="ok", trajectory=computed.model_copy(
        update={"ref64_max_abs": [], "ref64_max_rel": [], "same_precision_max_abs": None, "nonfinite_count": []}))
    [result] = reference_cache.run_many(_LyingHost(hit), [case], ReferenceCache(tmp_path, writable=False))
    assert repr(result.trajectory.model_dump()) == repr(computed.model_dump())
    ReferenceCache(tmp_path, writable=True).store(environment, forgery)
    [result] = reference_cache.run_many(_LyingHost(hit), [case], ReferenceCache(tmp_path, writable=False))
    assert result.trajectory.ref64_max_abs == [123.0] * case.steps


def _environment(class_key: str) -> EnvironmentFingerprint:
    return EnvironmentFingerprint(device_kind="cpu", device_name="x", torch_version="2.13.0", python_version="3.12",
                                  platform="Linux-x86_64", class_key=class_key)


def _trajectory(steps: int) -> Trajectory:
    return Trajectory(ref64_max_abs=[0.5] * steps, ref64_max_rel=[float("nan")] * steps,
                      same_precision_max_abs=[-0.0] * steps, nonfinite_count=[3] * steps,
                      digests=[f"od2:{step:032x}" for step in range(steps)])


def test_another_environment_or_engine_finds_nothing(tmp_path, monkeypatch):
    case = load_battery("quick").expand()[0]
    cache = ReferenceCache(tmp_path, writable=True)
    cache.store(_environment("cpu-a"), [CaseResult(case=case, status="ok", trajectory=_trajectory(case.steps))])
    held = cache.lookup(_environment("cpu-a"), [case])
    assert repr(held[0][series_key(_trajectory(case.steps).digests)].model_dump()) == \
        repr(_trajectory(case.steps).model_dump())  # NaN, -0.0 and counts round-trip exactly
    assert cache.lookup(_environment("cpu-b"), [case]) == {}  # another device class or torch
    other = case.model_copy(update={"seed": case.seed + 1})
    assert cache.lookup(_environment("cpu-a"), [other]) == {}  # another case
    before = environment_key(_environment("cpu-a"))
    monkeypatch.setattr(reference_cache, "engine_version", lambda: "edited references")
    assert environment_key(_environment("cpu-a")) != before  # the reference code changed
    assert cache.lookup(_environment("cpu-a"), [case]) == {}


def test_a_case_keeps_its_most_recent_series_only(tmp_path, monkeypatch):
    monkeypatch.setattr(reference_cache, "MAX_SERIES_PER_CASE", 2)
    case = load_battery("quick").expand()[0]
    cache = ReferenceCache(tmp_path, writable=True)
    keys = []
    for variant in range(3):
        trajectory = _trajectory(case.steps).model_copy(update={"digests": [f"od2:{variant:02x}{s:030x}" for s in range(case.steps)]})
        keys.append(series_key(trajectory.digests))
        cache.store(_environment("cpu-a"), [CaseResult(case=case, status="ok", trajectory=trajectory)])
    assert set(cache.lookup(_environment("cpu-a"), [case])[0]) == set(keys[1:])


class _LyingHost:
    """A kernel host (it runs submitted code) that answers digests without metrics for a series
    nobody told it of: the parent must not take that as a cache hit."""

    environment = _environment("cpu-a")

    def __init__(self, answer):
        self.answer = answer

    def run_many(self, cases, on_result=None, known=None, on_pause=None, on_request_sent=None):  # noqa: ANN001
        known(self.environment)
        return [self.answer]


def test_a_host_claiming_an_unknown_series_gets_a_broken_case(tmp_path):
    case = load_battery("quick").expand()[0]
    cache = ReferenceCache(tmp_path, writable=True)
    digests_only = _trajectory(case.steps).model_copy(update={"ref64_max_abs": [], "ref64_max_rel": [],
                                                               "nonfinite_count": []})
    [result] = reference_cache.run_many(_LyingHost(CaseResult(case=case, status="ok", trajectory=digests_only)),
                                        [case], cache)
    assert result.status == "broken" and "protocol violation" in result.message
    assert cache.size()[0] == 0


def _fault_host(build, fault=None):  # noqa: ANN001
    import os

    from worker.engine.host import FAULT_ENV, KernelHost

    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    if fault:
        env[FAULT_ENV] = fault
    return KernelHost(build.library_path, device="cpu", env=env)


def test_a_sandboxed_host_answers_known_series_by_key_and_a_false_key_breaks_only_its_case(
        kernels_build, tmp_path, monkeypatch):
    """A warm run through a real kernel host: each known series comes back as its key alone
    (the parent holds its digests and metrics) and the results equal the cold run's, bit for
    bit. A host (it runs submitted code) naming a key it was not told of gets that case broken
    as a protocol violation; every other case stands."""
    from worker.engine.host import client as host_module  # the module whose run_many resolves known series

    cases = load_battery("quick").expand()[:12]
    cache = ReferenceCache(tmp_path, writable=True)
    with _fault_host(kernels_build) as host:
        cold = reference_cache.run_many(host, cases, cache)
    by_key: list[int] = []
    resolve = host_module.known_series_result
    monkeypatch.setattr(host_module, "known_series_result",
                        lambda answer, index, known_result: by_key.append(index) or resolve(answer, index, known_result))
    with _fault_host(kernels_build) as host:
        warm = reference_cache.run_many(host, cases, cache)
    assert sorted(by_key) == list(range(len(cases)))  # every case answered by its key alone
    assert [repr(r.model_dump(exclude={"duration_s"})) for r in warm] == \
        [repr(r.model_dump(exclude={"duration_s"})) for r in cold]
    by_key.clear()
    with _fault_host(kernels_build, fault=f"series:{cases[3].case_id}") as host:
        lied = reference_cache.run_many(host, cases, cache)
    assert lied[3].status == "broken" and "protocol violation" in lied[3].message
    assert [repr(r.model_dump(exclude={"duration_s"})) for i, r in enumerate(lied) if i != 3] == \
        [repr(r.model_dump(exclude={"duration_s"})) for i, r in enumerate(cold) if i != 3]
    assert ReferenceCache(tmp_path, writable=False).size()[0] == len(cases)  # the lie stored nothing


def test_an_unreadable_cache_is_skipped_not_fatal(tmp_path):
    case = load_battery("quick").expand()[0]
    (tmp_path / reference_cache.FILE_NAME).write_bytes(b"not a database" * 100)
    cache = ReferenceCache(tmp_path, writable=True)
    with pytest.raises(sqlite3.DatabaseError):
        cache.size()
    computed = CaseResult(case=case, status="ok", trajectory=_trajectory(case.steps))
    assert reference_cache.run_many(_LyingHost(computed), [case], cache) == [computed]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_known_series_skip_the_references_in_the_host(kernels, device):
    # The host side in-process (the `kernels` build loaded here): a case whose digest series is
    # known is answered with digests only; a case with only other known series, or none, runs
    # through the full engine and gives run_cases_fast's result exactly.
    cases = [c for c in GROUPED.expand() if c.seed == 0][::5]
    full = run_cases_fast(cases, torch.device(device))
    known = {i: {series_key(r.trajectory.digests)} for i, r in enumerate(full) if i % 2 == 0}
    known[1] = {"0" * 32}
    got = run_cases_known(cases, device, known)
    for index, (expected, result) in enumerate(zip(full, got)):
        assert result.trajectory.digests == expected.trajectory.digests, expected.case.case_id
        if index % 2 == 0:
            assert result.trajectory.ref64_max_abs == [] and result.trajectory.nonfinite_count == []
        else:
            assert repr(result.trajectory.model_dump()) == repr(expected.trajectory.model_dump())


class _DigestsOnlyHost:
    """A kernel host that answers every case it was told of with the known series' digests only
    (as a warm kernels-only pass does)."""

    environment = _environment("cpu-a")

    def __init__(self, digests):
        self.digests, self.sent = digests, 0

    def run_many(self, cases, on_result=None, known=None, on_pause=None, on_request_sent=None):  # noqa: ANN001
        assert known(self.environment)
        on_request_sent()
        self.sent += 1
        return [CaseResult(case=case, status="ok", trajectory=Trajectory(
            ref64_max_abs=[], ref64_max_rel=[], nonfinite_count=[], digests=self.digests)) for case in cases]


def test_a_series_reused_again_soon_keeps_its_mark_and_an_older_mark_is_renewed(tmp_path):
    case = load_battery("quick").expand()[0]
    cache = ReferenceCache(tmp_path, writable=True)
    trajectory = _trajectory(case.steps)
    cache.store(_environment("cpu-a"), [CaseResult(case=case, status="ok", trajectory=trajectory)])

    def used() -> float:
        with sqlite3.connect(cache.path) as connection:
            return connection.execute("SELECT used FROM series").fetchone()[0]

    host = _DigestsOnlyHost(trajectory.digests)
    marked = used()
    [result] = reference_cache.run_many(host, [case], cache)
    assert repr(result.trajectory) == repr(trajectory)  # filled from the cache
    assert used() == marked  # reused within USED_REFRESH_S of its mark: nothing written
    with sqlite3.connect(cache.path) as connection:
        connection.execute("UPDATE series SET used = ?", (marked - reference_cache.USED_REFRESH_S - 1,))
    [result] = reference_cache.run_many(host, [case], cache)
    assert repr(result.trajectory) == repr(trajectory) and used() > marked  # an old mark is renewed
