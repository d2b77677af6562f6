"""The bisection search (service/domain/bisection.py) on synthetic histories: no git, no builds.

A synthetic case "differs" at every commit from its change point on (the monotone history bisection
assumes); the tests count the commits the search asks for."""

from __future__ import annotations

import math
import random

import pytest
from rich.console import Console

from service.cli import bisect as cli_bisect
from service.domain.bisection import Bisection, collapse_unchanged, select_cases, tree_groups
from service.cli.git_history import HistoryCommit
from service.core.results import CaseComparison, CaseResult, CaseSpec, Trajectory


def _comparison(case_id: str, changed: bool) -> CaseComparison:
    return CaseComparison(case_id=case_id, optimizer="adam", verdict="changed" if changed else "unchanged",
                          first_divergent_step=1 if changed else None)


def _search(n: int, change_points: dict[str, int], untestable: frozenset[int] = frozenset()) -> tuple[Bisection, list[int]]:
    """Run the search to the end; returns it and every commit it asked for, in order."""
    search = Bisection(n, {case: _comparison(case, True) for case in change_points})
    asked: list[int] = []
    while not search.done:
        batch = search.next_commits()
        assert batch and not set(batch) & set(asked), "each round asks for new commits"
        for index in batch:
            asked.append(index)
            search.record(index, None if index in untestable else
                          {case: _comparison(case, index >= point) for case, point in change_points.items()})
    return search, asked


@pytest.mark.parametrize("n", [2, 3, 7, 8, 31, 32, 33, 1000])
def test_one_change_point_costs_at_most_ceil_log2_n_tests_for_every_position(n: int) -> None:
    # Every position of the short histories; a spread of them (both ends included) of the long one.
    for point in sorted({1, n, *range(1, n + 1, 1 if n <= 64 else 37)}):
        search, asked = _search(n, {"a": point, "b": point})
        assert len(asked) <= math.ceil(math.log2(n)), (n, point, asked)
        assert all(f.tests == len(asked) for f in search.findings())
        assert {f.case_id: f.first_differing for f in search.findings()} == {"a": point, "b": point}
        assert all(f.exact for f in search.findings())


def test_cases_that_changed_at_different_commits_are_each_found_and_share_the_early_tests() -> None:
    rng = random.Random(16)
    n = 40
    for _ in range(200):
        points = {f"case{i}": rng.randint(1, n) for i in range(6)}
        search, asked = _search(n, points)
        assert {f.case_id: f.first_differing for f in search.findings()} == points
        # One log2 search per distinct change point at most; the shared early midpoints make it less.
        assert len(asked) <= len(set(points.values())) * math.ceil(math.log2(n))
        assert all(f.tests <= math.ceil(math.log2(n)) for f in search.findings())


def test_untestable_commits_are_skipped_and_a_range_is_reported_when_only_they_separate() -> None:
    # The change is at 5; 4 does not build: the search tries the others and ends with 3 same, 5
    # differing, and says 4..5 (not exact).
    search, asked = _search(8, {"a": 5}, untestable=frozenset({4}))
    finding = search.findings()[0]
    assert (finding.last_same, finding.first_differing, finding.exact) == (3, 5, False)
    assert 4 in asked and 3 in asked
    # A skipped commit away from the change costs one extra test and keeps the answer exact.
    search, _ = _search(8, {"a": 6}, untestable=frozenset({4}))
    assert (search.findings()[0].first_differing, search.findings()[0].exact) == (6, True)


def test_a_commit_that_cannot_answer_for_one_case_still_answers_for_the_others() -> None:
    search = Bisection(4, {"a": _comparison("a", True), "b": _comparison("b", True)})
    assert search.next_commits() == [2]
    search.record(2, {"a": _comparison("a", True), "b": None})  # b is not in commit 2's battery
    assert search.searches["a"].first_differing == 2 and search.searches["b"].skipped == {2}
    with pytest.raises(ValueError, match="strictly between"):
        search.record(4, {})


def test_collapse_keeps_good_and_the_commits_that_change_the_source_tree() -> None:
    trees = ["t0", "t0", "t1", "t1", "t1", "t2", None, "t2"]
    assert collapse_unchanged(trees) == [0, 2, 5, 6, 7]
    assert tree_groups(["t0", "t1", "t0", None]) == [[0, 2], [1], [3]]


def test_case_selection_by_glob_or_substring() -> None:
    ids = ["adam.32bit.fp32#1", "ademamix.32bit.fp32#2", "lion.32bit.fp32#3"]
    assert select_cases(ids, "adam.*") == ["adam.32bit.fp32#1"]
    assert select_cases(ids, "ad") == ids[:2]
    assert select_cases(ids, None) == ids
    assert select_cases(ids, "sgd*") == []


# ----------------------------------------------------------------------------- the command's search
def _result(case_id: str, digests: list[str]) -> CaseResult:
    spec = CaseSpec(case_id=case_id, optimizer="adam", hyper={"lr": 0.1}, seed=0, size=4, steps=len(digests))
    return CaseResult(case=spec, status="ok", trajectory=Trajectory(
        ref64_max_abs=[1e-6] * len(digests), ref64_max_rel=[1e-6] * len(digests),
        nonfinite_count=[0] * len(digests), digests=digests))


class FakeTester:
    """Stands in for the service or the local pipeline: each tree's results, or None (no build)."""

    def __init__(self, by_tree: dict[str, dict[str, CaseResult] | None]) -> None:
        self.by_tree, self.asked = by_tree, []

    def test(self, commits: list[HistoryCommit]) -> dict[str, cli_bisect.Tested]:
        self.asked += [c.sha for c in commits]
        return {c.sha: cli_bisect.Tested(self.by_tree[c.tree], "fake", new_build=True) for c in commits}


def test_the_search_over_a_history_skips_unchanged_trees_and_reports_a_range_around_an_unbuildable_commit() -> None:
    # Case a changes at c6; c5 does not build, so the answer is "c5..c6". Case b changes at c2.
    trees = ["t0", "t0", "t1", "t2", "t2", "t3", "t4", "t5", "t5"]
    chain = [HistoryCommit(f"c{i}", f"c{i - 1}" if i else None, f"commit {i}", tree) for i, tree in enumerate(trees)]
    before, after = ["od2:1", "od2:2"], ["od2:1", "od2:X"]
    by_tree = {tree: {"a": _result("a", after if index >= 6 else before),
                      "b": _result("b", after if index >= 2 else before),
                      "c": _result("c", before)}
               for index, tree in enumerate(trees)}
    by_tree["t3"] = None
    tester = FakeTester(by_tree)
    report = cli_bisect.bisect_history(chain, tester, case_pattern=None, source="csrc", say=lambda _: None)
    findings = {f["case_id"]: f for f in report.findings}
    assert set(findings) == {"a", "b"}
    assert (findings["b"]["first_changed"], findings["b"]["exact"]) == ("c2", True)
    assert (findings["a"]["range_from"], findings["a"]["first_changed"], findings["a"]["exact"]) == ("c5", "c6", False)
    # c1 has good's tree and c4 c3's: never tested; each tested commit once.
    assert {"c1", "c4"}.isdisjoint(tester.asked) and len(set(tester.asked)) == len(tester.asked)
    assert report.candidates - 1 == 5 and report.cases_compared == 3
    # Narrowed to a case that never changed: an answer with nothing to locate.
    quiet = cli_bisect.bisect_history(chain, FakeTester(by_tree), case_pattern="c", source="csrc", say=lambda _: None)
    assert quiet.findings == [] and "none of the 1 cases differs" in quiet.note
    # The text report: one row per case, the range where commits could not be run, the tally.
    console = Console(record=True, width=200)
    cli_bisect.print_report(console, report)
    text = console.export_text()
    assert "c5..c6 (untestable between)" in text and "c2 'commit 2': first changed 1 case" in text
    assert "8 commits after good, 5 change the source; tested" in text
