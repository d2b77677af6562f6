"""The Action's compare-environments mode on a commit the service was never sent (issue 44).

compare-environments submits nothing: it compares environment B's run of a commit with A's. On
pull_request its commit is github.sha, the merge commit GitHub made, which nothing submits, so
`optdrift compare` used to answer the 404 of that sha with exit 2 and turn every pull request's job
red. Now the Action passes --skip-unknown-commit there: the step exits 0 with a ::notice:: saying
why nothing was compared (verdict output `skipped`). A commit named by the `release` input, or any
other event's commit, must be known: exit 2, saying which commit and what to do.

The steps run as the runner runs them (tests/service/notify/test_action_events.py run_action), with the
real `optdrift` client in place of its stand-in, against a real `optdrift serve --no-worker`
(tests/scenarios/test_wait_detail.py's server).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.scenarios.test_wait_detail import _client, server  # noqa: F401
from tests.service.cli.test_cli_contract import OPTDRIFT
from tests.service.notify import test_action_events as harness

MERGE, BASE, HEAD, HEAD_PARENT = "a1" * 20, "b2" * 20, "c3" * 20, "d4" * 20
# The stand-in `optdrift` of the harness, replaced by the real client.
REAL_CLIENT = f"#!{{python}}\nimport os, sys\nos.execv({str(OPTDRIFT)!r}, [{str(OPTDRIFT)!r}, *sys.argv[1:]])\n"


@pytest.fixture
def action(server: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201, F811
    monkeypatch.setattr(harness, "STANDIN_OPTDRIFT", REAL_CLIENT)
    client = _client(server)
    client.ensure_project("pr-compare", environments=["cpu"])
    client.close()
    token = (server["home"] / "admin-token").read_text().strip()
    workspace = tmp_path / "workspace"
    workspace.mkdir()

    def run(event_name: str, payload: dict, github: dict[str, str], **inputs: str) -> harness.ActionRun:
        given = {"url": server["url"], "project": "pr-compare", "token": token,
                 "compare-environments": "cpu cpu+fma", **inputs}
        return harness.run_action(tmp_path, workspace, event_name=event_name, payload=payload, github=github,
                                  inputs=given)
    return run


def _pull_request() -> dict:
    return harness.payload("pull_request", BASE=BASE, HEAD=HEAD, HEAD_PARENT=HEAD_PARENT, MERGE=MERGE)


def test_a_pull_requests_merge_sha_unknown_to_the_service_passes_with_a_notice(action) -> None:  # noqa: ANN001
    run = action("pull_request", _pull_request(), {"GITHUB_SHA": MERGE, **harness.PR_ENV})
    assert run.code == 0, run.log
    [notice] = [line for line in run.log.splitlines() if line.startswith("::notice title=optdrift::")]
    assert MERGE in notice and "never submitted" in notice and "release input" in notice, notice
    assert f"commit {MERGE} is not known to project pr-compare: it was never submitted" in run.log
    assert run.outputs["verdict"] == "skipped" and run.outputs["exit-code"] == "0", run.outputs
    assert not any(line.startswith("::error") for line in run.log.splitlines())


def test_a_release_the_service_does_not_have_still_fails_on_a_pull_request(action) -> None:  # noqa: ANN001
    run = action("pull_request", _pull_request(), {"GITHUB_SHA": MERGE, **harness.PR_ENV}, release="v9.9")
    assert run.code == 2, run.log
    assert "commit v9.9 is not known to project pr-compare: it was never submitted: submit it first" in run.log
    assert run.outputs["verdict"] == "bad-input" and run.outputs["exit-code"] == "2", run.outputs


def test_an_unknown_commit_on_push_fails_and_says_which_and_what_to_do(action) -> None:  # noqa: ANN001
    event = harness.payload("push", BEFORE=BASE, AFTER=MERGE, AFTER_TREE="e5" * 20, AFTER_MESSAGE="lion: fused")
    run = action("push", event, {"GITHUB_SHA": MERGE, "GITHUB_REF": "refs/heads/main", "GITHUB_REF_NAME": "main"})
    assert run.code == 2, run.log
    assert f"commit {MERGE} is not known to project pr-compare" in run.log and "--commit" in run.log, run.log
