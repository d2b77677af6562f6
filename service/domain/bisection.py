"""Which commit first changed each case: bisection along a first-parent history.

Pure logic: no git, no HTTP, no torch. The caller (service/cli/bisect.py) walks the history, runs
commits (through the service or locally) and feeds their results here.

Commits are indexed 0..n along the first-parent line, 0 the good commit and n the bad one. A case
"differs" at a commit when service.core.verdicts.compare_case of that commit's result against the good
commit's reads changed, broken or nondeterministic (per-step digests: the same comparison the
service's verdicts make). For every case that differs at n, the search keeps an interval
(last_same, first_differing]: the latest commit known to give the good commit's bits and the
earliest known to differ. One test of commit m answers every case whose interval contains m, so
cases that changed together are found together and the total is about log2(n) tests per distinct
change point, not per case.

A commit that cannot answer (its tree does not build, the case is not in its battery) is skipped
for the cases it cannot answer, as `git bisect skip` does: the next midpoint is the nearest untried
commit, and an interval that only skipped commits separate ends as a range, not a single commit.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from service.core.results import CaseComparison, CaseResult, CaseSpec, Trajectory
from service.core.verdicts import compare_case

# Case verdicts against the good commit that count as "this case differs here".
DIFFERING_VERDICTS = frozenset({"changed", "broken", "nondeterministic"})


def compare_with_good(results: Mapping[str, CaseResult], good: Mapping[str, CaseResult],
                      case_ids: Iterable[str]) -> dict[str, CaseComparison | None]:
    """For each case id: its comparison with the good commit's result, or None when this commit
    cannot answer for it (not in its results, or not in the good commit's)."""
    out: dict[str, CaseComparison | None] = {}
    for case_id in case_ids:
        ours, theirs = results.get(case_id), good.get(case_id)
        out[case_id] = None if ours is None or theirs is None else compare_case(ours, theirs)
    return out


def differs(comparison: CaseComparison) -> bool:
    return comparison.verdict in DIFFERING_VERDICTS


def select_cases(case_ids: Iterable[str], pattern: str | None) -> list[str]:
    """`--case PATTERN`: a shell-style glob matched against the whole case id, or, without any of
    `*?[`, a substring of it. None: every case."""
    ids = list(case_ids)
    if not pattern:
        return ids
    if any(char in pattern for char in "*?["):
        return [case_id for case_id in ids if fnmatch.fnmatchcase(case_id, pattern)]
    return [case_id for case_id in ids if pattern in case_id]


def case_results_from_api(trajectories: list[dict]) -> dict[str, CaseResult]:
    """The API's `/runs/{id}/trajectories` items as the engine's CaseResults, keyed by case id
    (NaN and infinities come as strings; pydantic parses them back into floats)."""
    out = {}
    for item in trajectories:
        series = item.get("series") or {}
        trajectory = Trajectory(digests=item.get("digests") or [], **series) if series else None
        out[item["case_id"]] = CaseResult(case=CaseSpec.model_validate(item["case"]), status=item["status"],
                                          message=item.get("error"), trajectory=trajectory)
    return out


@dataclass
class CaseSearch:
    case_id: str
    last_same: int
    first_differing: int
    # The comparison with the good commit at `first_differing` (what changed there).
    comparison: CaseComparison
    # Commits that could not answer for this case.
    skipped: set[int] = field(default_factory=set)
    # Commits tested while this case was open and inside its interval: what locating it cost.
    tests: int = 0

    def untried(self) -> list[int]:
        return [i for i in range(self.last_same + 1, self.first_differing) if i not in self.skipped]

    @property
    def resolved(self) -> bool:
        return not self.untried()


@dataclass(frozen=True)
class Finding:
    """Where one case first differs from the good commit. `first_differing` is exact when
    `last_same == first_differing - 1`; otherwise commits last_same+1 .. first_differing-1 could
    not be tested and the change is somewhere in last_same+1 .. first_differing."""

    case_id: str
    last_same: int
    first_differing: int
    comparison: CaseComparison
    tests: int = 0

    @property
    def exact(self) -> bool:
        return self.first_differing == self.last_same + 1


class Bisection:
    """The per-case searches over commits 0..n (0 good, n bad), given the cases that differ at n."""

    def __init__(self, n: int, differing_at_bad: Mapping[str, CaseComparison]):
        if n < 1:
            raise ValueError(f"bisection needs at least one commit after the good one, got n={n}")
        self.n = n
        self.searches = {case_id: CaseSearch(case_id, 0, n, comparison)
                         for case_id, comparison in differing_at_bad.items()}
        self.tested: set[int] = {0, n}

    def open_searches(self) -> list[CaseSearch]:
        return [search for search in self.searches.values() if not search.resolved]

    def next_commits(self) -> list[int]:
        """The commits to test next: for each distinct open interval, the untried commit nearest
        its middle. Cases that share an interval share the test."""
        chosen: set[int] = set()
        for search in self.open_searches():
            middle = (search.last_same + search.first_differing) / 2
            chosen.add(min(search.untried(), key=lambda i: (abs(i - middle), i)))
        return sorted(chosen)

    def record(self, index: int, comparisons: Mapping[str, CaseComparison | None] | None) -> None:
        """What commit `index` gave: per case its comparison with the good commit (None: it
        cannot answer for that case); `comparisons` None: it cannot answer at all (it does not
        build). Only cases whose interval contains `index` learn from it."""
        if not 0 < index < self.n:
            raise ValueError(f"commit index {index} is not strictly between good (0) and bad ({self.n})")
        self.tested.add(index)
        for search in self.searches.values():
            if not search.last_same < index < search.first_differing:
                continue
            search.tests += 1
            comparison = None if comparisons is None else comparisons.get(search.case_id)
            if comparison is None:
                search.skipped.add(index)
            elif differs(comparison):
                search.first_differing, search.comparison = index, comparison
            else:
                search.last_same = index

    @property
    def done(self) -> bool:
        return not self.open_searches()

    def findings(self) -> list[Finding]:
        """Every case's answer, ordered by the commit where it first differs, then case id."""
        return sorted((Finding(s.case_id, s.last_same, s.first_differing, s.comparison, s.tests)
                       for s in self.searches.values()), key=lambda f: (f.first_differing, f.case_id))


def tree_groups(trees: Sequence[str | None]) -> list[list[int]]:
    """Indices of commits that share a source tree (same tree: the same build, the same bits), so
    one test answers for all of them. A missing tree (None) groups with nothing."""
    groups: dict[str, list[int]] = {}
    singles: list[list[int]] = []
    for index, tree in enumerate(trees):
        if tree is None:
            singles.append([index])
        else:
            groups.setdefault(tree, []).append(index)
    return sorted([*groups.values(), *singles])


def collapse_unchanged(trees: Sequence[str | None]) -> list[int]:
    """The commits that can change a trajectory: index 0 (good) and every commit whose source
    tree differs from its first parent's. The others build exactly what their parent built."""
    return [0] + [i for i in range(1, len(trees)) if trees[i] is None or trees[i] != trees[i - 1]]
