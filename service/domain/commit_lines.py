"""A project's line of history: the first-parent chain of submitted commits from a tip, which the
overview and the case history follow. Issue 44: a side branch drawn into main's line in submission
order looked like a drop, and pull requests' merge commits, which never land, filled both.

The tip:

* `ref` given: the commit with that sha, else the newest commit submitted under that branch name
  (the Action sends GITHUB_REF_NAME on a push), else a release tag or a unique sha prefix;
* otherwise the default branch's newest commit. No submission names the default branch, so it is
  read from what was submitted: the branch name most commits were submitted under (CI submits
  every push to the default branch; other branches, if at all, fewer), the newest on a tie.
  Pull-request refs never count. With no branch names at all (the CLI without --ref), the newest
  commit that is not a pull request's.

"Newest" is the newest submitted commit that no other of the branch's newest ones descends from:
older commits submitted after the tip (a backfill) do not become the tip.

The line: from the tip, the ancestry each commit was sent with (`git rev-list --first-parent`,
service/domain/ancestry.py; git's word, so a force-pushed-away tip is not on it), else its first
parent (for a push, the branch's previous tip), hopping to the farthest submitted commit each time,
as service/domain/baselines.py walks to a baseline. Commits never submitted are not on it; a line
whose first parent was never submitted (and came without ancestry) ends there.

Pull-request commits: those submitted under refs/pull/N/merge (the Action on `pull_request`:
`pull/N/merge`; GITHUB_REF_NAME there is `N/merge`). GitHub's test merge commit of a pull request
is never an ancestor of the base branch, so it is never on the default line: it is listed under its
pull request instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from service.db.models import Commit, Project
from service.domain.errors import NotFoundError

# Submitted commits a line holds at most (five times the ancestry one submission may send): a
# page over a longer history shows the newest part and says the rest is cut.
MAX_LINE = 1000
PULL_REQUEST_REF = re.compile(r"(?:refs/)?pull/(?P<number>\d{1,10})/(?:merge|head)|(?P<short>\d{1,10})/merge")
BRANCH_PREFIX = "refs/heads/"
# A branch's newest submitted commits among which its tip is looked for (a backfill of older commits
# after the tip submitted more than this many hides it: ask for the tip by sha).
TIP_CANDIDATES = 100


def pull_request_number(ref: str | None) -> int | None:
    """The pull request a ref names (refs/pull/N/merge, pull/N/merge, N/merge), else None."""
    match = PULL_REQUEST_REF.fullmatch(ref or "")
    if match is None:
        return None
    return int(match.group("number") or match.group("short"))


def pull_request_filter():  # noqa: ANN201
    """SQL: the commit was submitted under a pull request's ref (as pull_request_number reads it)."""
    return Commit.ref.regexp_match(r"^((refs/)?pull/[0-9]{1,10}/(merge|head)|[0-9]{1,10}/merge)$")


@dataclass
class Line:
    tip: Commit | None
    branch: str | None          # the branch name the tip was chosen by, None for a sha or no names
    chosen_by: str              # a sentence: which tip, and why
    commits: list[Commit]       # tip first, each one's first-parent predecessor after it
    truncated: bool             # the line went on past MAX_LINE commits

    @property
    def ids(self) -> set[int]:
        return {commit.id for commit in self.commits}


def default_branch(*, session: Session, project: Project) -> str | None:
    """The branch name most commits were submitted under (pull requests' refs aside), newest on a tie."""
    counted = session.execute(
        select(Commit.ref, func.count().label("n"), func.max(Commit.created_at).label("newest"))
        .where(Commit.project_id == project.id, Commit.ref.is_not(None), Commit.ref != "",
               ~pull_request_filter())
        .group_by(Commit.ref).order_by(func.count().desc(), func.max(Commit.created_at).desc()).limit(1)
    ).first()
    return counted.ref if counted is not None else None


def _newest(session: Session, *conditions) -> Commit | None:  # noqa: ANN002
    """The newest of the matching commits that none of the newest TIP_CANDIDATES others descends
    from: the branch's tip even when older commits were submitted after it (a backfill)."""
    candidates = list(session.scalars(select(Commit).where(*conditions)
                                      .order_by(Commit.created_at.desc(), Commit.id.desc()).limit(TIP_CANDIDATES)))
    behind = {sha for commit in candidates for sha in [*_next_shas(commit), *commit.parents[:1]]}
    return next((commit for commit in candidates if commit.sha not in behind), candidates[0] if candidates else None)


def choose_tip(*, session: Session, project: Project, ref: str | None) -> tuple[Commit | None, str | None, str]:
    """(tip, branch, sentence): see the module's docstring."""
    if ref:
        exact = session.scalar(select(Commit).where(Commit.project_id == project.id, Commit.sha == ref))
        if exact is not None:
            return exact, None, f"the first-parent line of {exact.sha}"
        branch = ref.removeprefix(BRANCH_PREFIX)
        tip = _newest(session, Commit.project_id == project.id, Commit.ref.in_({ref, branch}))
        if tip is not None:
            return tip, branch, f"{branch}: the first-parent line of its newest submitted commit {tip.sha}"
        from service.domain.submissions import find_commit  # a release tag or a sha prefix

        try:
            tip = find_commit(session=session, project=project, ref=ref)
        except NotFoundError:
            raise NotFoundError(
                f"ref {ref[:80]!r} is neither a commit, a branch nor a release of project {project.name!r}; "
                "give a submitted commit's sha or a branch name a commit was submitted under "
                "(the overview's ref list)") from None
        return tip, None, f"the first-parent line of {tip.sha} ({ref})"
    branch = default_branch(session=session, project=project)
    if branch is not None:
        tip = _newest(session, Commit.project_id == project.id, Commit.ref == branch)
        return tip, branch, (f"{branch} (the branch most commits were submitted on): the first-parent line of "
                             f"its newest submitted commit {tip.sha}")
    tip = _newest(session, Commit.project_id == project.id,
                  or_(Commit.ref.is_(None), ~pull_request_filter()))
    if tip is None:
        return None, None, "no commit submitted yet"
    return tip, None, f"the first-parent line of the newest submitted commit {tip.sha} (no branch names were sent)"


def _next_shas(commit: Commit) -> list[str]:
    # The ancestry is git's first-parent line; without it, the first parent (on a push, the
    # branch's previous tip, which the previous push submitted).
    if commit.ancestry:
        return list(commit.ancestry)
    return commit.parents[:1] if commit.parents else []


def first_parent_line(*, session: Session, tip: Commit, limit: int = MAX_LINE) -> tuple[list[Commit], bool]:
    """The submitted commits on `tip`'s first-parent line, tip first; True when cut at `limit`.
    Client-sent parents may loop or repeat: each commit is taken once."""
    line, seen, current = [tip], {tip.sha}, tip
    while True:  # each pass adds a commit or returns, so at most `limit` passes
        shas = [sha for sha in _next_shas(current) if sha not in seen]
        if not shas:
            return line, False
        found = {commit.sha: commit for commit in session.scalars(select(Commit).where(
            Commit.project_id == tip.project_id, Commit.sha.in_(shas)))}
        farthest = None
        for sha in shas:
            if sha in found:
                if len(line) == limit:
                    return line, True
                line.append(found[sha])
                seen.add(sha)
                farthest = found[sha]
        if farthest is None:
            return line, False
        current = farthest


def line_of(*, session: Session, project: Project, ref: str | None, limit: int = MAX_LINE) -> Line:
    tip, branch, chosen_by = choose_tip(session=session, project=project, ref=ref)
    if tip is None:
        return Line(tip=None, branch=None, chosen_by=chosen_by, commits=[], truncated=False)
    commits, truncated = first_parent_line(session=session, tip=tip, limit=limit)
    return Line(tip=tip, branch=branch, chosen_by=chosen_by, commits=commits, truncated=truncated)
