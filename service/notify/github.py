"""The GitHub calls the notifier makes, through githubkit: a check run per run of a commit, and one
comment per pull request, found again by its hidden marker and edited in place.

Every call here is validated in CI against GitHub's OpenAPI description (tests/github_standin.py).
Answers are read as plain JSON, only the fields used (ids, numbers, bodies): githubkit's models
of whole answers are stricter than GitHub's own examples, and a field GitHub adds or drops
elsewhere in an answer must not stop a notification.
"""

from __future__ import annotations

from datetime import datetime, timezone

from githubkit import GitHub

# Pull requests are scanned for our marker this many comments deep (100 a page).
MAX_COMMENT_PAGES = 10


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def create_check_run(gh: GitHub, *, owner: str, repo: str, name: str, head_sha: str,
                     details_url: str, external_id: str, output: dict[str, str],
                     conclusion: str | None = None) -> int:
    """A check run on `head_sha`: in progress, or completed at once when `conclusion` is given
    (a run whose start was never announced)."""
    data: dict = {"name": name, "head_sha": head_sha, "details_url": details_url,
                  "external_id": external_id, "output": output}
    if conclusion is None:
        data.update(status="in_progress", started_at=_now())
    else:
        data.update(status="completed", conclusion=conclusion, completed_at=_now())
    return gh.rest.checks.create(owner, repo, data=data).json()["id"]


def complete_check_run(gh: GitHub, *, owner: str, repo: str, check_run_id: int, conclusion: str,
                       details_url: str, output: dict[str, str]) -> None:
    gh.rest.checks.update(owner, repo, check_run_id, data={
        "status": "completed", "conclusion": conclusion, "completed_at": _now(),
        "details_url": details_url, "output": output})


def pull_requests_at(gh: GitHub, *, owner: str, repo: str, sha: str) -> list[int]:
    """Open pull requests whose head is `sha`: a PR's comment describes its newest commit, so an
    older commit of the same PR, finishing late, does not overwrite it."""
    pulls = gh.rest.repos.list_pull_requests_associated_with_commit(owner, repo, sha, per_page=100)
    return [pull["number"] for pull in pulls.json() if pull["state"] == "open" and pull["head"]["sha"] == sha]


def find_comment(gh: GitHub, *, owner: str, repo: str, number: int, marker: str) -> int | None:
    for page in range(1, MAX_COMMENT_PAGES + 1):
        comments = gh.rest.issues.list_comments(owner, repo, number, per_page=100, page=page).json()
        for comment in comments:
            if marker in (comment.get("body") or ""):
                return comment["id"]
        if len(comments) < 100:
            return None
    return None


def upsert_comment(gh: GitHub, *, owner: str, repo: str, number: int, marker: str, body: str) -> int:
    """Edit our comment on PR `number` (found by `marker`, so a comment someone deleted is simply
    posted again), or post it if there is none yet. Returns its id."""
    found = find_comment(gh, owner=owner, repo=repo, number=number, marker=marker)
    if found is not None:
        gh.rest.issues.update_comment(owner, repo, found, data={"body": body})
        return found
    return gh.rest.issues.create_comment(owner, repo, number, data={"body": body}).json()["id"]
