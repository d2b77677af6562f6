"""Seed a dashboard database from a real engine run.

The engine builds the bundled kernels and the decay-after-update mutation (digest-cached builds),
co-runs the `quick` battery on both (kernel host subprocesses), and the results are stored through
the service's own domain functions (trajectories.store_case_result, verdict_store.evaluate), so the
verdicts the pages show are the ones the service computes.

Lineage (oldest first; parents are first parents):

  a1-base            release v0.1.0  bundled kernels            -> no-baseline
  b2-decay-after     release v0.2.0  decay after update (bug)   -> changed, farther from float64
  c3-fix-decay       release v0.3.0  the bundled kernels again  -> changed, closer
  d4-docs                            the bundled kernels again  -> unchanged
  e5-broken          (ref feature/broken, off main's line) a tree that does not compile -> broken (run failed)
  g7-flaky                           the bundled kernels; one case not applicable (an adapter's
                                      reason), one case whose repeats differ -> nondeterministic
  h8-error                           optdrift could not fetch the source -> run status error
  f6-running                         a run still in progress (30 of N cases stored)
  verify run                          the buggy tree against a1-base, with the co-run
                                      |commit - baseline| per step that `optdrift check` measures

c3 and d4 store the very results of the a1 build: same source, same build digest, and the engine is
bit-reproducible on one environment (that is what the digests assert), so running it again would
only cost time.
"""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

from service.core.results import RunResult

REPO_ROOT = Path(__file__).resolve().parents[4]
PROJECT = "bundled"
BATTERY = "quick"
RUNNING_CASES_DONE = 30
NOT_APPLICABLE_REASON = "this library has no bfloat16 32-bit kernel for lion"
FETCH_ERROR = "source fetch refused: HTTP 401 from http://api:8000/api/v1/sources (the worker has no token)"
# g7-flaky's nondeterministic case: repeats on the same build (RepeatCheck) that differ.
FLAKY_REPEATS = {"runs": 4, "differing": 1, "first_divergent_step": 2}


def set_aside_cases(result: RunResult) -> tuple[str, str]:
    """The case g7-flaky marks not applicable and the one it makes nondeterministic."""
    ids = [c.case.case_id for c in result.cases]
    return ids[0], ids[1]


@dataclass
class EngineRun:
    base: RunResult
    buggy: RunResult
    diffs: dict[str, list[float]]
    base_log: str
    buggy_log: str
    broken_log: str
    broken_error: str


@dataclass
class Seeded:
    run_ids: dict[str, int] = field(default_factory=dict)     # label -> run id ("verify" too)
    releases: list[tuple[str, str]] = field(default_factory=list)  # (tag, sha)


def _read(path: str | None) -> str:
    return Path(path).read_text(errors="replace") if path and Path(path).exists() else ""


def run_engine(cache_dir: Path) -> EngineRun:
    from worker.battery import load_battery
    from worker.build import build_extension
    from worker.engine.corun import corun_battery
    from worker.mutations import copy_tree, decay_after_update

    spec = load_battery(BATTERY)
    with tempfile.TemporaryDirectory(prefix="optdrift-dash-seed-") as tmp:
        base_tree = REPO_ROOT / "csrc"
        buggy_tree = decay_after_update(copy_tree(base_tree, Path(tmp) / "buggy"))
        broken_tree = copy_tree(base_tree, Path(tmp) / "broken")
        # A real compiler error: an undeclared name in the shared math header.
        math_header = broken_tree / "optimizer_math.h"
        math_header.write_text(math_header.read_text() + "\nstatic_assert(optdrift_missing_symbol, \"\");\n")
        base_build = build_extension(base_tree, cache_dir=cache_dir, cuda_archs=[])
        buggy_build = build_extension(buggy_tree, cache_dir=cache_dir, cuda_archs=[])
        broken_build = build_extension(broken_tree, cache_dir=cache_dir, cuda_archs=[])
    assert base_build.ok and buggy_build.ok, (base_build.error, buggy_build.error)
    assert not broken_build.ok, "the broken tree compiled; the seed needs a real build failure"
    buggy, base, diffs = corun_battery(
        spec, buggy_build.library_path, base_build.library_path, commit_digest=buggy_build.digest,
        baseline_digest=base_build.digest, device="cpu")
    return EngineRun(base=base, buggy=buggy, diffs=diffs, base_log=_read(base_build.log_path),
                     buggy_log=_read(buggy_build.log_path), broken_log=_read(broken_build.log_path),
                     broken_error=broken_build.error or "build failed")


def seed(session, engine: EngineRun) -> Seeded:  # noqa: ANN001
    from service.db.models import DONE, ERROR, FAILED, RUNNING, Commit, Project, Run, SourceArchive, Verdict
    from service.core.results import RepeatCheck
    from service.domain import trajectories, verdict_store
    from service.core.verdicts import compare_runs

    start = datetime(2025, 1, 6, 9, 0, tzinfo=timezone.utc)
    project = Project(name=PROJECT, environments=["cpu"], created_at=start)
    session.add(project)
    session.flush()
    out = Seeded()

    def archive(label: str) -> str:
        digest = hashlib.sha256(label.encode()).hexdigest()
        if session.get(SourceArchive, digest) is None:
            session.add(SourceArchive(digest=digest, size_bytes=1, member_count=1, created_at=start))
            session.flush()
        return digest

    def detail(result: RunResult, ok: bool = True, error: str | None = None) -> dict:
        return {"battery_version": 1, "build_ok": ok, "build_error": error,
                "fingerprint": result.environment.model_dump(mode="json") if result.environment else None}

    def add_run(label: str, *, at: datetime, result: RunResult, status: str, commit: Commit | None,
                log: str, kind: str = "commit", base_commit: Commit | None = None, cases: int | None = None,
                error: str | None = None) -> Run:
        stored = result.cases if cases is None else result.cases[:cases]
        run = Run(project_id=project.id, kind=kind, commit_id=commit.id if commit else None,
                  base_commit_id=base_commit.id if base_commit else None, source_digest=archive(label),
                  battery=BATTERY, battery_hash=result.battery_digest, environment="cpu",
                  environment_detail=detail(result, ok=status != FAILED, error=error), status=status,
                  attempt=1, worker="seed@localhost", created_at=at, dispatched_at=at, started_at=at,
                  heartbeat_at=at + timedelta(seconds=30),
                  finished_at=at + timedelta(seconds=60) if status in (DONE, FAILED, ERROR) else None,
                  cases_total=len(result.cases) if status != FAILED else None, cases_done=len(stored) if status != FAILED else 0,
                  build_digest=result.build_digest, build_cached=False, build_log=log, error=error)
        session.add(run)
        session.flush()
        if status != FAILED:
            for index, case in enumerate(stored):
                trajectories.store_case_result(session=session, run_id=run.id, case_index=index, result=case)
        out.run_ids[label] = run.id
        return run

    commits: dict[str, Commit] = {}
    lineage = [
        ("a1-base", None, "v0.1.0", "main", "bundled kernels, decay before update", engine.base, engine.base_log),
        ("b2-decay-after", "a1-base", "v0.2.0", "main", "apply weight decay after the update (PR-2040 ordering)",
         engine.buggy, engine.buggy_log),
        ("c3-fix-decay", "b2-decay-after", "v0.3.0", "main", "decay before update again (AdamW Algorithm 2)",
         engine.base, engine.base_log),
        ("d4-docs", "c3-fix-decay", None, "main", "docs only", engine.base, engine.base_log),
    ]
    for offset, (sha, parent, tag, ref, message, result, log) in enumerate(lineage):
        at = start + timedelta(hours=offset)
        commit = Commit(project_id=project.id, sha=sha, parents=[parent] if parent else [], ref=ref,
                        release_tag=tag, message=message, source_digest=archive(sha), created_at=at)
        session.add(commit)
        session.flush()
        commits[sha] = commit
        run = add_run(sha, at=at, result=result, status=DONE, commit=commit, log=log)
        verdict_store.evaluate(session=session, run=run)
        if tag:
            out.releases.append((tag, sha))

    at = start + timedelta(hours=len(lineage))
    broken = Commit(project_id=project.id, sha="e5-broken", parents=["d4-docs"], ref="feature/broken",
                    message="a change that does not compile", source_digest=archive("e5-broken"), created_at=at)
    session.add(broken)
    session.flush()
    run = add_run("e5-broken", at=at, result=engine.base, status=FAILED, commit=broken, log=engine.broken_log,
                  error=f"build failed: {engine.broken_error}")
    verdict_store.evaluate(session=session, run=run)

    # Between e5 and f6, so f6 stays the newest row.
    at = start + timedelta(hours=len(lineage), minutes=20)
    flaky = Commit(project_id=project.id, sha="g7-flaky", parents=["d4-docs"], ref="main",
                   message="the same kernels; one case set aside, one that does not reproduce",
                   source_digest=archive("g7-flaky"), created_at=at)
    session.add(flaky)
    session.flush()
    aside_id, flaky_id = set_aside_cases(engine.base)
    cases = []
    for case in engine.base.cases:
        if case.case.case_id == aside_id:
            case = case.model_copy(update={"status": "not_applicable", "message": NOT_APPLICABLE_REASON,
                                           "trajectory": None})
        elif case.case.case_id == flaky_id:
            case = case.model_copy(update={"repeat_check": RepeatCheck(**FLAKY_REPEATS)})
        cases.append(case)
    run = add_run("g7-flaky", at=at, result=engine.base.model_copy(update={"cases": cases}), status=DONE,
                  commit=flaky, log=engine.base_log)
    verdict_store.evaluate(session=session, run=run)

    at = start + timedelta(hours=len(lineage), minutes=40)
    errored = Commit(project_id=project.id, sha="h8-error", parents=["g7-flaky"], ref="main",
                     message="a commit optdrift could not fetch", source_digest=archive("h8-error"), created_at=at)
    session.add(errored)
    session.flush()
    add_run("h8-error", at=at, result=engine.base, status=ERROR, commit=errored, log="", cases=0, error=FETCH_ERROR)

    at = start + timedelta(hours=len(lineage) + 1)
    running = Commit(project_id=project.id, sha="f6-running", parents=["h8-error"], ref="main",
                     message="a run in progress", source_digest=archive("f6-running"), created_at=at)
    session.add(running)
    session.flush()
    add_run("f6-running", at=at, result=engine.base, status=RUNNING, commit=running, log=engine.base_log,
            cases=RUNNING_CASES_DONE)

    # The contributor's verify run: the buggy tree against a1-base, with the per-step
    # |commit - baseline| of the engine's co-run in its verdict (what `optdrift check` reports).
    at = start + timedelta(hours=len(lineage) + 2)
    verify = add_run("verify", at=at, result=engine.buggy, status=DONE, commit=None, kind="verify",
                     base_commit=commits["a1-base"], log=engine.buggy_log)
    comparison = compare_runs(engine.buggy, engine.base, engine.diffs)
    changed = [c for c in comparison.cases if c.verdict in ("changed", "broken")]
    steps = [c.first_divergent_step for c in changed if c.first_divergent_step]
    session.add(Verdict(run_id=verify.id, baseline_run_id=out.run_ids["a1-base"], outcome=comparison.verdict,
                        flagged=comparison.verdict in ("changed", "broken"), changed_cases=len(changed),
                        first_divergent_step=min(steps) if steps else None,
                        detail=comparison.model_dump(mode="json"), created_at=at))
    session.flush()
    return out
