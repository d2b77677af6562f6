"""The kernel host started ahead of its run (worker.engine.host_reserve, KernelHost.spare):
the same answers as a host started with its build, its build shown in the sandbox through its own
folder, and every failure of the spare a fallback to starting a host as before. Real processes,
the bundled kernels built once for the session (tests/conftest.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from worker import pipeline
from worker.battery import load_battery
from worker.engine import host_reserve
from worker.engine.host import KernelHost, KernelHostError

CASES = load_battery("quick").expand()[:12]


def _answers(results) -> list[str]:  # noqa: ANN001
    return [repr((r.case.case_id, r.status, r.trajectory)) for r in results]


def warm_job(tmp_path: Path, cases: list) -> tuple[pipeline.Job, pipeline.Policy]:  # noqa: ANN001
    """A job on a copy of the bundled kernels' tree with the quick battery's `cases`, and a policy
    that runs it on spare hosts whose slots live under `tmp_path`."""
    tree = tmp_path / "csrc"
    shutil.copytree(Path(__file__).resolve().parents[3] / "csrc", tree)
    job = pipeline.prepare(tree, requested_battery="quick")
    job.cases = cases
    return job, pipeline.Policy(warm_host=True, host_slot_root=tmp_path / "slots")


@pytest.fixture(autouse=True)
def _no_spare_left():
    yield
    host_reserve.discard()


def test_a_spare_host_answers_as_a_host_started_with_its_build(kernels_build, tmp_path: Path) -> None:
    with KernelHost(kernels_build.library_path, device="cpu") as started:
        expected = started.run_many(CASES)
        description = started.adapter_description
    spare = KernelHost.spare(device="cpu", slot_root=tmp_path / "slots")
    slot = spare._slot
    assert slot.parent == tmp_path / "slots" and not any(slot.iterdir())  # nothing of a build yet
    with spare:
        spare.adopt_build(kernels_build.library_path)
        assert "build received" in spare.startup_s  # it imported torch before it knew the build
        assert (slot / "0" / Path(kernels_build.library_path).name).is_file()
        assert _answers(spare.run_many(CASES)) == _answers(expected)
        # It names the build it loaded, not the folder the build was linked into.
        assert spare.adapter_description == description
        assert spare.library_path == str(kernels_build.library_path)
    assert not slot.exists()  # closing removes the linked build


def test_a_spare_that_died_or_serves_another_device_is_not_used(kernels_build, tmp_path: Path) -> None:
    host_reserve.replenish(device="cpu", slot_root=tmp_path, keep=1)
    _, spare = host_reserve._spares[0]
    spare._kill()  # as an out-of-memory kill would
    assert host_reserve.take(kernels_build.library_path, device="cpu", adapter="bundled", adapter_paths=[],
                             case_timeout_s=60, deadline=None) is None
    host_reserve.replenish(device="cpu", slot_root=tmp_path, keep=1)
    _, mismatched = host_reserve._spares[0]
    assert host_reserve.take(kernels_build.library_path, device="cuda", adapter="bundled", adapter_paths=[],
                             case_timeout_s=60, deadline=None) is None
    assert host_reserve._spares == [] and not mismatched.running()  # closed, not left running
    with pytest.raises(KernelHostError, match="not running"):
        KernelHost(kernels_build.library_path, device="cpu").adopt_build(kernels_build.library_path)


def test_the_pipeline_takes_the_spare_and_starts_the_next_one(kernels_build, tmp_path: Path) -> None:
    job, warm = warm_job(tmp_path, CASES)
    built = kernels_build
    plain = pipeline.run(job, built, pipeline.Policy())
    first = pipeline.run(job, built, warm)  # no spare yet: starts its host, leaves KEEP spares behind
    waiting = [host for _, host in host_reserve._spares]
    assert len(waiting) == host_reserve.KEEP == 2
    assert all(host.running() and host.library_path == "" for host in waiting)
    during: list[list] = []  # the spares waiting when the run's first result came

    def on_result(index, result) -> None:  # noqa: ANN001
        if not during:
            during.append([host for _, host in host_reserve._spares])

    second = pipeline.run(job, built, warm, on_result=on_result)  # takes the oldest spare
    assert not waiting[0].running()  # it ran the second run and was closed with it
    # The next spare was started as the run began, not after it: a commit submitted right after
    # this verdict finds its host ready.
    assert during[0][0] is waiting[1] and during[0][1] not in waiting
    assert [host for _, host in host_reserve._spares] == during[0]
    assert _answers(first.results) == _answers(second.results) == _answers(plain.results)
    assert second.environment == plain.environment and second.adapter == plain.adapter


def test_spares_taken_but_not_given_a_build_wait_again(kernels_build, tmp_path: Path) -> None:
    """A co-run takes two spares while it fetches and builds its trees; when it stops before giving
    them their builds (a run came, a tree no longer builds), they wait again for that run. One that
    was given a build is closed: a spare serves one piece of work only."""
    host_reserve.replenish(device="cpu", slot_root=tmp_path)
    taken = host_reserve.spares(2, device="cpu", slot_root=tmp_path)
    assert host_reserve._spares == [] and all(host.running() for host in taken)
    taken[1].adopt_build(kernels_build.library_path)
    host_reserve.put_back(taken, device="cpu")
    assert [host for _, host in host_reserve._spares] == [taken[0]]
    assert not taken[1].running()
    assert host_reserve.take(kernels_build.library_path, device="cpu", adapter="bundled", adapter_paths=[],
                             case_timeout_s=60, deadline=None) is taken[0]
    taken[0].close()


def test_without_bubblewrap_no_spare_waits_beside_a_run(kernels_build, tmp_path: Path, monkeypatch) -> None:
    """Unboxed (the sandbox's fallback), a run's code could signal or trace a process of the same
    user waiting beside it, the host of a later run: one spare is kept, started after the run."""
    monkeypatch.setattr(host_reserve, "start_beside_runs", lambda: False)
    job, warm = warm_job(tmp_path, CASES[:4])
    pipeline.run(job, kernels_build, warm)
    assert len(host_reserve._spares) == host_reserve.spares_kept() == 1
    beside: list[int] = []
    pipeline.run(job, kernels_build, warm, on_result=lambda index, result: beside.append(len(host_reserve._spares)))
    assert beside and set(beside) == {0}  # nothing waited beside the run's code
    assert len(host_reserve._spares) == 1  # the next one, started after it
