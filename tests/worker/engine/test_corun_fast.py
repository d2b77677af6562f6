"""The fast co-run (worker.engine.corun, fast=True) gives the one-case co-run's numbers, bit for bit.

Exactness, not tolerance: the per-step diffs are compared through repr (NaN matches NaN, -0.0 does
not match 0.0) and every digest as a string. The commit is the decay-after-update copy of the
bundled kernels (worker.mutations), the baseline the bundled kernels, on the CPU; the cases are a
slice of the quick battery with Adam/AdEMAMix at weight decay (changed from step 1), other
optimizers (unchanged), 8-bit and 16-bit ones. Small chunks force several chunks, so the
pipelining (chunk k runs while chunk k-1 is diffed) and the alternating files are exercised.
"""

from __future__ import annotations

import dataclasses
import io
import os

import numpy as np
import pytest
import torch

from service.core.results import CaseSpec
from worker.battery import load_battery
from worker.engine import host_reserve, params_file
from worker.engine.corun import DEFAULT_CHUNK_BYTES, corun_battery, plan_chunks
from worker.engine.host import FAULT_ENV, KernelHost
from worker.engine.kernels_only import run_kernels_only
from worker.engine.trajectory import run_params
from tests.worker.engine.test_fast_engine import GROUPED

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cases(count: int):
    battery = load_battery("quick")
    cases = battery.expand()
    changed = [c for c in cases if c.optimizer in ("adam", "ademamix") and c.hyper["weight_decay"] > 0]
    others = [c for c in cases if c not in changed]
    # Both families, several dtypes and step counts, changed and unchanged cases.
    picked = changed[::max(1, len(changed) // (count // 2))][:count // 2] + others[::max(1, len(others) // (count // 2))][:count // 2]
    return battery, picked


@pytest.fixture(scope="module")
def one_case_corun(kernels_build, decay_build):
    """The one-case co-run (the reference for the fast one) of 12 cases: (battery, cases, its result)."""
    battery, cases = _cases(12)
    return battery, cases, corun_battery(battery, decay_build.library_path, kernels_build.library_path,
                                         device="cpu", cases=cases, params_only=True)


def _digests(run):
    return [(r.case.case_id, r.status, r.trajectory.digests if r.trajectory else None) for r in run.cases]


def test_fast_corun_equals_the_one_case_corun(kernels_build, decay_build, one_case_corun):
    battery, cases, (slow_commit, slow_base, slow_diffs) = one_case_corun
    chunks_started = []
    fast_commit, fast_base, fast_diffs = corun_battery(
        battery, decay_build.library_path, kernels_build.library_path, device="cpu", cases=cases, fast=True,
        chunk_bytes=200_000, between_cases=lambda: chunks_started.append(1))
    assert len(slow_diffs) >= 4 and len(slow_diffs) < len(cases)  # changed and unchanged cases both present
    assert sorted(fast_diffs) == sorted(slow_diffs)
    assert {k: repr(v) for k, v in fast_diffs.items()} == {k: repr(v) for k, v in slow_diffs.items()}
    assert any(value > 0 for series in fast_diffs.values() for value in series)
    assert _digests(fast_commit) == _digests(slow_commit)
    assert _digests(fast_base) == _digests(slow_base)
    assert len(chunks_started) == len(plan_chunks(cases, 200_000)) > 2  # yields between chunks


def test_the_corun_runs_on_spare_hosts_given_their_builds_and_says_where_its_time_went(
        kernels_build, decay_build, one_case_corun, tmp_path):
    """The worker's co-run starts two spare hosts while it fetches and builds the trees (the
    waiting spare first) and gives them their builds after (host_reserve.spares / open_host): the
    same numbers as hosts started with their builds, with no host started again."""
    battery, cases, (slow_commit, slow_base, slow_diffs) = one_case_corun
    host_reserve.replenish(device="cpu", slot_root=tmp_path, keep=1)
    _, waiting = host_reserve._spares[0]
    try:
        spares = host_reserve.spares(2, device="cpu", slot_root=tmp_path)
        assert spares[0] is waiting and host_reserve._spares == []  # the waiting spare is taken first
        assert spares[1] is not None and all(s.running() and s.library_path == "" for s in spares)
        hosts = tuple(host_reserve.open_host(build.library_path, device="cpu", case_timeout_s=60, spare=spare)
                      for spare, build in zip(spares, (decay_build, kernels_build)))
        assert hosts == tuple(spares)  # each spare took its build: no new host
        timings = {}
        commit, base, diffs = corun_battery(battery, decay_build.library_path, kernels_build.library_path,
                                            device="cpu", cases=cases, fast=True, hosts=hosts, timings=timings)
        assert {k: repr(v) for k, v in diffs.items()} == {k: repr(v) for k, v in slow_diffs.items()}
        assert _digests(commit) == _digests(slow_commit) and _digests(base) == _digests(slow_base)
        assert all("build received" in host.startup_s and host.start_attempts == 1 for host in hosts)
        assert not any(host.running() for host in hosts)  # the co-run closes the hosts it was given
        assert set(timings) == {"hosts_s", "kernels_s", "close_s", "chunks", "commit_host_s", "baseline_host_s",
                                "diff_s", "commit_device_to_host_s", "commit_into_file_s",
                                "baseline_device_to_host_s", "baseline_into_file_s"}
        for side in ("commit", "baseline"):  # the host's own account of its parameter writing
            assert 0 < timings[f"{side}_into_file_s"] + timings[f"{side}_device_to_host_s"] < timings[f"{side}_host_s"]
        assert timings["chunks"] == len(plan_chunks(cases, DEFAULT_CHUNK_BYTES))
        assert max(timings["commit_host_s"], timings["baseline_host_s"]) <= timings["kernels_s"]
    finally:
        host_reserve.discard()


def test_a_chunk_never_exceeds_the_file_a_sandboxed_host_may_write(kernels_build, decay_build, one_case_corun,
                                                                   monkeypatch):
    """At 4 GiB per chunk the H200's hosts could not write their parameter files (HOST_LIMITS caps a
    file at 2 GiB) and every case fell back to one at a time: chunks are cut to the limit."""
    from worker import sandbox

    battery, cases, (_, _, slow_diffs) = one_case_corun
    monkeypatch.setattr(sandbox, "HOST_LIMITS", dataclasses.replace(sandbox.HOST_LIMITS, file_size_bytes=400_000))
    timings = {}
    _, _, diffs = corun_battery(battery, decay_build.library_path, kernels_build.library_path, device="cpu",
                                cases=cases, fast=True, chunk_bytes=10**12, timings=timings)
    assert timings["chunks"] == len(plan_chunks(cases, 400_000)) > len(plan_chunks(cases, 10**12))
    assert {k: repr(v) for k, v in diffs.items()} == {k: repr(v) for k, v in slow_diffs.items()}


def test_hosts_handed_in_stay_open_when_the_caller_closes_them(kernels_build, decay_build, one_case_corun):
    """The worker's co-run stores its diffs before its hosts exit (worker/jobs/corun.py): with
    close_hosts=False the hosts it handed in are still running afterwards, and no close is timed."""
    battery, cases, (_, _, slow_diffs) = one_case_corun
    hosts = [KernelHost(build.library_path, device="cpu", case_timeout_s=60) for build in (decay_build, kernels_build)]
    try:
        timings = {}
        _, _, diffs = corun_battery(battery, decay_build.library_path, kernels_build.library_path, device="cpu",
                                    cases=cases[:6], fast=True, hosts=tuple(hosts), timings=timings,
                                    close_hosts=False)
        assert all(host.running() for host in hosts) and "close_s" not in timings
        assert {k: repr(v) for k, v in diffs.items()} == {k: repr(slow_diffs[k]) for k in diffs}
    finally:
        KernelHost.close_together(hosts)
    assert not any(host.running() for host in hosts)


def test_a_spare_that_cannot_take_its_build_falls_back_to_a_host_of_its_own(kernels_build, tmp_path):
    spare = KernelHost.spare(device="cpu", slot_root=tmp_path)
    spare._kill()  # as an out-of-memory kill would
    host = host_reserve.open_host(kernels_build.library_path, device="cpu", case_timeout_s=60, spare=spare)
    assert host is not spare and not host.running() and host.library_path == str(kernels_build.library_path)
    assert host_reserve.open_host(kernels_build.library_path, device="cpu",
                                  case_timeout_s=60).library_path == str(kernels_build.library_path)
    with host:
        assert host.run_many(_cases(2)[1])[0].status == "ok"  # it starts on its first request


def test_a_host_crash_in_a_chunk_falls_back_to_one_case_at_a_time(kernels_build, decay_build, one_case_corun,
                                                                   monkeypatch):
    battery, cases, (_, _, slow_diffs) = one_case_corun
    cases = cases[:4]
    victim = cases[1].case_id
    monkeypatch.setenv(FAULT_ENV, f"abort:{victim}")  # both hosts die on it, in the fast and one-case paths
    commit, baseline, diffs = corun_battery(battery, decay_build.library_path, kernels_build.library_path,
                                            device="cpu", cases=cases, fast=True)
    statuses = {r.case.case_id: r.status for r in commit.cases}
    assert statuses.pop(victim) == "broken" and set(statuses.values()) == {"ok"}
    # The other cases ran one by one after the crash, their parameters in files of their own.
    expected = {k: repr(v) for k, v in slow_diffs.items() if k != victim and k in {c.case_id for c in cases}}
    assert {k: repr(v) for k, v in diffs.items()} == expected and expected


def test_chunks_keep_one_step_count_and_the_byte_bound():
    cases = load_battery("quick").expand()
    bound = 400_000
    chunks = plan_chunks(cases, bound)
    assert sorted(i for chunk in chunks for i in chunk) == list(range(len(cases)))
    for chunk in chunks:
        assert len({cases[i].steps for i in chunk}) == 1
        used = sum(cases[i].steps * cases[i].size * 4 for i in chunk)
        assert used <= bound or len(chunk) == 1
    assert plan_chunks(cases[:3], 1) == [[i] for i in sorted(range(3), key=lambda i: (cases[i].steps, i))]


def test_the_parent_reads_only_a_plain_file_of_the_expected_size(tmp_path):
    # A kernel host runs submitted code and writes the file: a link to one of the worker's files
    # (it can name paths it cannot see) must not be followed, and the size must be exact.
    secret = tmp_path / "worker-token"
    secret.write_bytes(b"s" * 40)
    link = tmp_path / "params-0.f32"
    os.symlink(secret, link)
    with pytest.raises(params_file.ParamsFileError, match="plain file"):
        params_file.open_checked(link, 10)
    real = tmp_path / "params-1.f32"
    np.arange(12, dtype="<f4").tofile(real)
    with pytest.raises(params_file.ParamsFileError, match="48 bytes, not the 40"):
        params_file.open_checked(real, 10)
    assert params_file.open_checked(real, 12).tolist() == list(range(12))


def test_a_host_writes_each_case_into_its_own_region_of_the_file(tmp_path):
    # The host's side of the protocol (params_file.create_for_writing / RegionWriter, pwrite): the
    # file has exactly the cases' size, each case's rows land at its region (whole or a step at a
    # time, as a case run alone writes them), and rows that do not fit are refused.
    cases = [CaseSpec(case_id="a", optimizer="adam", hyper={"lr": 0.1}, seed=0, size=3, steps=2),
             CaseSpec(case_id="b", optimizer="adam", hyper={"lr": 0.1}, seed=1, size=5, steps=3)]
    path = tmp_path / "params.f32"
    fd, writers = params_file.create_for_writing(path, cases)
    try:
        first = np.arange(6, dtype=np.float32).reshape(2, 3)
        second = 100 + np.arange(15, dtype=np.float32).reshape(3, 5)
        writers[1](0, second[:1])
        writers[1](1, second[1:])
        writers[0](0, first)
        with pytest.raises(ValueError, match="do not fit"):
            writers[0](1, first)  # two rows from step 1 would run past the case's 2 steps
        with pytest.raises(ValueError, match="do not fit"):
            writers[1](0, first)  # rows of 3, not 5
    finally:
        os.close(fd)
    stored = params_file.open_checked(path, params_file.total_elements(cases))
    assert stored.tolist() == first.ravel().tolist() + second.ravel().tolist()


def test_vectorised_diffs_are_the_per_step_diffs(monkeypatch):
    # Blocks of steps in threads, NaN where both sides are non-finite, as the per-step loop gives.
    rng = np.random.default_rng(0)
    commit = rng.standard_normal((7, 1000)).astype("<f4")
    baseline = commit.copy()
    baseline[2, 5] += 1e-3
    commit[4, :] = np.inf
    baseline[4, :] = np.inf
    with np.errstate(invalid="ignore"):
        expected = [float(np.max(np.abs(commit[s].astype(np.float64) - baseline[s].astype(np.float64))))
                    for s in range(7)]
    monkeypatch.setattr(params_file, "DIFF_BLOCK_ELEMENTS", 2000)  # two steps a block: several threads
    got = params_file.per_step_max_abs_diffs([(commit, baseline)], threads=3)[0]
    assert repr(got) == repr(expected)
    assert np.isnan(got[4]) and got[2] > 0 and got[0] == 0.0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_kernels_only_waves_write_run_params_bits(kernels, device):
    # In-process (the `kernels` build loaded here): the co-run's host side against run_params,
    # parameters byte for byte and digests, 32/8-bit, every dtype, open/closed/zeroed gradients.
    cases = [c for c in GROUPED.expand() if c.seed == 0][::4]
    for use_graphs in ([False, True] if device == "cuda" else [False]):
        views = [np.full((c.steps, c.size), np.nan, dtype=np.float32) for c in cases]
        fast = run_kernels_only(cases, device, params_out=views, use_graphs=use_graphs)
        for case, result, view in zip(cases, fast, views):
            sink = io.BytesIO()
            slow = run_params(case, torch.device(device), sink)
            assert result.status == "ok" and result.trajectory.digests == slow.trajectory.digests, case.case_id
            assert result.trajectory.ref64_max_abs == [] and view.tobytes() == sink.getvalue(), case.case_id


def test_the_fast_corun_yields_before_running_a_chunk():
    # The worker's co-run raises CorunYielded in between_cases when runs wait: nothing runs after it.
    class Yielded(RuntimeError):
        pass

    calls = []

    def yield_now() -> None:
        calls.append(1)
        raise Yielded

    with pytest.raises(Yielded):
        corun_battery(load_battery("quick"), "/nonexistent/commit.so", "/nonexistent/baseline.so", device="cpu",
                      fast=True, between_cases=yield_now)
    assert calls == [1]
