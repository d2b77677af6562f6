"""bench/e2e_latency.py's decisions, without a service: which commit it skips for time (a warm
commit is never estimated from the cold build's time) and that a headline figure not measured is a
failure that says so (issue 48: the flagged commit was skipped on an H100 and its co-run detail
never measured)."""

from __future__ import annotations

import sys
from datetime import datetime, timezone
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "bench"))

import e2e_latency as bench  # noqa: E402  (bench/ is not a package)

T0 = 1_800_000_000.0
HEADLINE = bench.Commit("B-decay-after-update", ["A-base"], Path("B"), "decay", "changed", True, 1,
                        headline="a flagged commit's warm submit-to-verdict and its co-run detail")


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, tz=timezone.utc).isoformat()


def _ran(sha: str, *, total_s: float, build_s: float, cached: bool, battery: str = "standard",
         corun_detail_s: float | None = None) -> bench.Measured:
    """A finished row: claimed at T0, `running` after `build_s` of fetch+build, verdict after total_s."""
    commit = bench.Commit(sha, [], Path(sha), sha, "no-baseline", cached)
    run = {"status": "done", "build_cached": cached, "created_at": _iso(T0), "started_at": _iso(T0),
           "finished_at": _iso(T0 + total_s), "verdict": {"outcome": "no-baseline", "created_at": _iso(T0 + total_s)}}
    return bench.Measured(commit=commit, run=run, total_s=total_s, upload_s=0.1, seen_running_wall=T0 + build_s,
                          verdict_wall=T0 + total_s, battery=battery, corun_detail_s=corun_detail_s)


COLD_A = _ran("A-base", total_s=200.0, build_s=150.0, cached=False)
WARM_C = _ran("C-comment-only", total_s=40.0, build_s=1.0, cached=True)


def test_a_warm_commit_is_estimated_from_the_warm_runs_not_the_cold_build() -> None:
    assert bench.expected_s(HEADLINE, "standard", [COLD_A, WARM_C]) == 40.0
    # No warm run yet: the cold one less its fetch+build.
    assert bench.expected_s(HEADLINE, "standard", [COLD_A]) == 50.0
    # 100 s left fits a 40-s commit (the cold run's 200 s would have skipped it).
    assert bench.skip_reason(HEADLINE, "standard", [COLD_A, WARM_C], left_s=100.0, deadline_s=420.0) is None


def test_a_commit_that_must_build_still_counts_the_build() -> None:
    build = bench.Commit("B-build", [], Path("B"), "warm the cache", "no-baseline", False, battery="standard")
    # The slowest run of its battery, or a build as long as A's plus the fastest battery: the longer.
    assert bench.expected_s(build, "standard", [COLD_A, WARM_C]) == 200.0
    reason = bench.skip_reason(build, "standard", [COLD_A, WARM_C], left_s=100.0, deadline_s=420.0)
    assert reason == "100 s left of --deadline-s 420, under 1.2x the 200 s it should take"


def test_a_skipped_headline_fails_saying_which_figure_and_why() -> None:
    reason = bench.skip_reason(HEADLINE, "standard", [COLD_A, WARM_C], left_s=30.0, deadline_s=420.0)
    assert reason is not None
    skipped = bench.Measured(commit=HEADLINE, battery="standard", skipped=reason)
    (line,) = bench.headline_problems([COLD_A.commit, WARM_C.commit, HEADLINE], [COLD_A, WARM_C, skipped])
    assert line.startswith("HEADLINE NOT MEASURED: B-decay-after-update (a flagged commit's warm submit-to-verdict")
    assert line.endswith(f"skipped, {reason}")
    # A commit without a headline, skipped, is a failure of its own (main's FAILED lines), not this one.
    assert bench.headline_problems([WARM_C.commit], []) == []


def test_a_flagged_headline_without_its_co_run_detail_fails() -> None:
    ran = _ran(HEADLINE.sha, total_s=40.0, build_s=1.0, cached=True)
    ran.commit = HEADLINE
    (line,) = bench.headline_problems([HEADLINE], [COLD_A, ran])
    assert line.endswith("no co-run detail stored within the run's timeout after its verdict")
    ran.corun_detail_s = 47.0
    assert bench.headline_problems([HEADLINE], [COLD_A, ran]) == []
    assert bench.headline_problems([HEADLINE], [COLD_A])[0].endswith(
        "not submitted (a commit before it stopped the run)")
