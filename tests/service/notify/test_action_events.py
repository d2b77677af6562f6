"""The GitHub Action (action.yml) files the right commit for each event: its steps run as the runner
runs them, against recorded event payloads (tests/fixtures/action_events, $GITHUB_EVENT_PATH), in a
workspace checked out the way actions/checkout does it from a real repository made here, with a
stand-in `optdrift` on PATH that records the sha, the parents and the tree it was asked to submit.

The rule under test (docs/INTEGRATIONS.md, "Which commit the action submits"): the run is filed under
the checked-out commit, github.sha, with the tree of that commit; its first parent is the commit it
is compared with, one the workflow already submitted: on pull_request the base branch's tip (the
first parent of the merge commit GitHub made), on push the branch's previous tip (`before`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[3]
ACTION = REPO_ROOT / "action.yml"
FIXTURES = REPO_ROOT / "tests" / "fixtures" / "action_events"
NO_COMMIT = "0" * 40
SOURCE = "csrc"

# A fixed identity and no user or system git configuration: the repository is the same on any host.
GIT_ENV = {
    "PATH": os.environ["PATH"], "HOME": "/nonexistent", "LANG": "C.UTF-8",
    "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_AUTHOR_NAME": "Contributor", "GIT_AUTHOR_EMAIL": "contributor@example.org",
    "GIT_COMMITTER_NAME": "Contributor", "GIT_COMMITTER_EMAIL": "contributor@example.org",
    "GIT_AUTHOR_DATE": "2024-05-03T12:00:00Z", "GIT_COMMITTER_DATE": "2024-05-03T12:00:00Z",
}


def git(cwd: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, env=GIT_ENV, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"git {' '.join(args)}: {done.stderr}"
    return done.stdout.strip()


@dataclass
class Origin:
    """The repository on GitHub: main, a pull request's branch, the merge commits GitHub makes."""
    path: Path
    sha: dict[str, str] = field(default_factory=dict)

    def parents(self, name: str) -> list[str]:
        return git(self.path, "show", "-s", "--format=%P", self.sha[name]).split()

    def tree(self, name: str) -> dict[str, str]:
        """The source folder's files at commit `name`: what the action must upload."""
        files = git(self.path, "ls-tree", "-r", "--name-only", self.sha[name], SOURCE).splitlines()
        return {path[len(SOURCE) + 1:]: git(self.path, "show", f"{self.sha[name]}:{path}") + "\n" for path in files}


def _commit(repo: Path, name: str, origin: Origin, files: dict[str, str], message: str) -> None:
    for path, text in files.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    origin.sha[name] = git(repo, "rev-parse", "HEAD")


def _merge(repo: Path, name: str, origin: Origin, into: str, head: str, message: str) -> None:
    git(repo, "checkout", "-q", "--detach", origin.sha[into])
    git(repo, "merge", "-q", "--no-ff", "-m", message, origin.sha[head])
    origin.sha[name] = git(repo, "rev-parse", "HEAD")


@pytest.fixture(scope="module")
def origin(tmp_path_factory: pytest.TempPathFactory) -> Origin:
    """B0 - B1 - B2 - B3 on main; the pull request #7 (adam-decay: H1 - H2) forked from B0 while main
    moved on, so its head's tree lacks main's later changes and its head's parent H1 is on no
    branch that CI submitted. M is GitHub's refs/pull/7/merge (H2 into B1, the base when the event
    fired); MM the merge button's commit on main (H2 into B3); Q a merge queue's commit."""
    repo = tmp_path_factory.mktemp("origin")
    origin = Origin(repo)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "config", "uploadpack.allowAnySHA1InWant", "true")  # actions/checkout fetches by sha
    _commit(repo, "B0", origin, {"csrc/adam.cu": "adam v1\n", "csrc/lion.cu": "lion v1\n",
                                 "README.md": "kernels\n"}, "initial kernels")
    git(repo, "checkout", "-q", "-b", "adam-decay")
    _commit(repo, "H1", origin, {"csrc/adam.cu": "adam v2: decay after the update\n"}, "adam: decay after update")
    _commit(repo, "H2", origin, {"csrc/adam.cu": "adam v2: decay after the update\n// why: see #7\n"},
            "adam: say why")
    git(repo, "checkout", "-q", "main")
    _commit(repo, "B1", origin, {"csrc/lion.cu": "lion v2\n"}, "lion: sign of the interpolation")
    _merge(repo, "M", origin, "B1", "H2", f"Merge {origin.sha['H2']} into {origin.sha['B1']}")
    git(repo, "update-ref", "refs/pull/7/head", origin.sha["H2"])
    git(repo, "update-ref", "refs/pull/7/merge", origin.sha["M"])
    git(repo, "checkout", "-q", "main")
    _commit(repo, "B2", origin, {"csrc/lion.cu": "lion v3\n"}, "lion: fused update")
    _commit(repo, "B3", origin, {"README.md": "kernels, documented\n"}, "docs: the kernels")
    _merge(repo, "Q", origin, "B3", "H2", "Merge pull request #7 from my-org/adam-decay (queued)")
    git(repo, "update-ref", f"refs/heads/gh-readonly-queue/main/pr-7-{origin.sha['H2']}", origin.sha["Q"])
    _merge(repo, "MM", origin, "B3", "H2", "Merge pull request #7 from my-org/adam-decay")
    git(repo, "update-ref", "refs/heads/main", origin.sha["MM"])
    git(repo, "checkout", "-q", "main")
    assert origin.parents("M") == [origin.sha["B1"], origin.sha["H2"]]  # GitHub's: base first, head second
    assert origin.tree("M") != origin.tree("H2") and origin.tree("M")["lion.cu"] == "lion v2\n"
    return origin


def _readme_checkout() -> dict:
    """The README workflow's actions/checkout step: the action's rule depends on what it checks out."""
    readme = (REPO_ROOT / "README.md").read_text()
    [workflow] = re.findall(r"```yaml\n(# \.github/workflows/.*?)```", readme, re.S)[:1]
    [step] = [s for s in yaml.safe_load(workflow)["jobs"]["trajectories"]["steps"]
              if s.get("uses", "").startswith("actions/checkout@")]
    return step.get("with") or {}


def checkout(origin: Origin, workspace: Path, sha: str, local_ref: str, depth: int | None = None) -> None:
    """What actions/checkout@v4 runs for an event: a shallow fetch of exactly that sha (the README
    workflow's fetch-depth, 1 by default), then a forced checkout of it."""
    depth = depth or int(_readme_checkout().get("fetch-depth", 1))
    workspace.mkdir()
    git(workspace, "init", "-q")
    git(workspace, "remote", "add", "origin", f"file://{origin.path}")
    git(workspace, "fetch", "-q", "--no-tags", "--prune", "--no-recurse-submodules", f"--depth={depth}",
        "origin", f"+{sha}:{local_ref}")
    if local_ref.startswith("refs/remotes/origin/"):
        git(workspace, "checkout", "-q", "--force", "-B", local_ref.rsplit("/", 1)[1], local_ref)
    else:
        git(workspace, "checkout", "-q", "--force", local_ref)


# The runner's expression syntax, as far as action.yml uses it: context paths, 'literals' and ||.
EXPRESSION = re.compile(r"\$\{\{\s*(.*?)\s*\}\}")
CONTEXT_PATH = re.compile(r"[A-Za-z_][\w-]*(\.[A-Za-z_][\w-]*)*")


def _evaluate(expression: str, contexts: dict) -> object:
    value: object = None
    for alternative in (part.strip() for part in expression.split("||")):
        if re.fullmatch(r"'[^']*'", alternative):
            value = alternative[1:-1]
        elif CONTEXT_PATH.fullmatch(alternative):
            value = contexts
            for name in alternative.split("."):
                value = value.get(name) if isinstance(value, dict) else None
        else:
            raise AssertionError(f"expression {expression!r}: this test renders context paths, 'literals' and "
                                 "|| only; render the new syntax here the way the runner does")
        if value:
            return value
    return value


CONDITION = re.compile(r"(.+?)\s*(==|!=)\s*('[^']*')")


def condition(text: str | None, contexts: dict) -> bool:
    """A step's `if:` as the runner evaluates it, as far as action.yml uses it: `path == 'literal'`
    and `path != 'literal'` joined by &&; a missing value compares as ''."""
    if text is None:
        return True
    result = True
    for part in (p.strip() for p in str(text).split("&&")):
        match = CONDITION.fullmatch(part)
        assert match, f"if: {text!r}: this test evaluates path ==/!= 'literal' joined by && only; add the syntax here"
        value = _evaluate(match.group(1), contexts)
        equal = ("" if value is None else str(value)) == match.group(3)[1:-1]
        result = result and (equal if match.group(2) == "==" else not equal)
    return result


def render(text: str, contexts: dict) -> str:
    def one(match: re.Match) -> str:
        value = _evaluate(match.group(1), contexts)
        if isinstance(value, bool):
            return "true" if value else "false"
        return "" if value is None else str(value)
    return EXPRESSION.sub(one, str(text))


def read_github_output(path: Path) -> dict[str, str]:
    """$GITHUB_OUTPUT as the runner reads it: `name=value` lines and `name<<DELIMITER` blocks."""
    lines, out = path.read_text().splitlines(), {}
    while lines:
        line = lines.pop(0)
        if "<<" in line and ("=" not in line or line.index("<<") < line.index("=")):
            name, delimiter = line.split("<<", 1)
            value = []
            while lines[0] != delimiter:
                value.append(lines.pop(0))
            lines.pop(0)
            out[name] = "\n".join(value)
        elif line:
            name, value = line.split("=", 1)
            out[name] = value
    return out


STANDIN_OPTDRIFT = """#!{python}
# Stands in for the optdrift client: records what `optdrift submit` was asked to send (its options
# and the files of --source, read as the client would pack them) and answers "changed" (exit 1).
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
source = Path(args[args.index("--source") + 1])
tree = {{str(p.relative_to(source)): p.read_text() for p in sorted(source.rglob("*")) if p.is_file()}}
Path(os.environ["STANDIN_RECORD"]).write_text(json.dumps({{"argv": args, "tree": tree}}))
print(json.dumps({{"exit_code": 1, "dashboard_urls": {{"9": "https://optdrift.example.org/runs/9"}},
                  "runs": [{{"id": 9, "status": "done", "verdict": {{"outcome": "changed", "acknowledged": False}}}}]}}))
sys.exit(1)
"""


@dataclass
class Submitted:
    sha: str
    parents: list[str]
    ref: str | None
    message: str | None
    tree: dict[str, str]


@dataclass
class ActionRun:
    code: int
    log: str
    outputs: dict[str, str]
    submitted: Submitted | None


def _option(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def run_action(tmp_path: Path, workspace: Path, *, event_name: str, payload: dict, github: dict[str, str],
               inputs: dict[str, str] | None = None) -> ActionRun:
    """The composite action's steps in order, as the runner runs them: each `${{ }}` in a step's
    env rendered from the contexts, GITHUB_* set, a fresh $GITHUB_OUTPUT per step whose lines become
    steps.<id>.outputs, the workspace as the working directory, a failing step ending the action.
    actions/setup-python is this interpreter, and the client install is the stand-in `optdrift`."""
    action = yaml.safe_load(ACTION.read_text())
    event_path = tmp_path / "event.json"
    event_path.write_text(json.dumps(payload))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    standin = bin_dir / "optdrift"
    standin.write_text(STANDIN_OPTDRIFT.format(python=sys.executable))
    standin.chmod(0o755)
    record = tmp_path / "submitted.json"
    runner_env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path), "LANG": "C.UTF-8",
        "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
        "PYTHONPATH": str(REPO_ROOT), "STANDIN_RECORD": str(record), "CI": "true", "GITHUB_ACTIONS": "true",
        "GITHUB_EVENT_NAME": event_name, "GITHUB_EVENT_PATH": str(event_path), "GITHUB_WORKSPACE": str(workspace),
        "GITHUB_ACTION_PATH": str(REPO_ROOT), "GITHUB_REPOSITORY": "my-org/my-kernels",
        "RUNNER_TEMP": str(tmp_path), **github,
    }
    github_context = {"event_name": event_name, "event": payload, "sha": github["GITHUB_SHA"],
                      "ref": github["GITHUB_REF"], "ref_name": github["GITHUB_REF_NAME"],
                      "head_ref": github.get("GITHUB_HEAD_REF", ""), "base_ref": github.get("GITHUB_BASE_REF", ""),
                      "repository": "my-org/my-kernels", "workspace": str(workspace), "action_path": str(REPO_ROOT)}
    given = {"url": "https://optdrift.example.org", "project": "my-kernels", "source": SOURCE,
             "token": "odt_submit_token", **(inputs or {})}
    contexts: dict = {"github": github_context, "runner": {"temp": str(tmp_path)}, "steps": {}}
    contexts["inputs"] = {name: given[name] if name in given else render(spec.get("default", ""), contexts)
                          for name, spec in action["inputs"].items()}
    log, code = [], 0
    for index, step in enumerate(action["runs"]["steps"]):
        if "uses" in step:
            assert step["uses"].startswith("actions/setup-python@"), f"unexpected action {step['uses']}"
            continue
        if not condition(step.get("if"), contexts):
            continue  # the runner skips the step, and its outputs stay empty
        if "pip install" in step["run"] and "$GITHUB_ACTION_PATH" in step["run"]:
            continue  # installs the client: the stand-in `optdrift` is on PATH instead
        script = tmp_path / f"step{index}"
        script.write_text(step["run"])
        output = tmp_path / f"output{index}"
        output.write_text("")
        shell = {"bash": ["bash", "--noprofile", "--norc", "-eo", "pipefail", str(script)],
                 "python": ["python", str(script)]}[step["shell"]]
        env = {**runner_env, "GITHUB_OUTPUT": str(output),
               **{name: render(value, contexts) for name, value in (step.get("env") or {}).items()}}
        done = subprocess.run(shell, cwd=workspace, env=env, capture_output=True, text=True, timeout=120)
        log.append(done.stdout + done.stderr)
        if "id" in step:
            contexts["steps"][step["id"]] = {"outputs": read_github_output(output)}
        if done.returncode != 0:
            code = done.returncode
            break
    outputs = {name: render(spec["value"], contexts) for name, spec in action["outputs"].items()}
    submitted = None
    if record.exists():
        sent = json.loads(record.read_text())
        argv = sent["argv"]
        assert argv[0] == "submit" and _option(argv, "--source") == SOURCE
        submitted = Submitted(sha=_option(argv, "--commit"),
                              parents=[argv[i + 1] for i, arg in enumerate(argv) if arg == "--parent"],
                              ref=_option(argv, "--ref"), message=_option(argv, "--message"), tree=sent["tree"])
    return ActionRun(code=code, log="\n".join(log), outputs=outputs, submitted=submitted)


def payload(name: str, **shas: str) -> dict:
    """A recorded payload with its @NAME@ placeholders replaced by this repository's values."""
    text = (FIXTURES / f"{name}.json").read_text()
    for placeholder, value in shas.items():
        text = text.replace(f"@{placeholder}@", value)
    assert "@" not in re.sub(r"[\w.+-]+@[\w.-]+", "", text), f"{name}.json: a placeholder was left unfilled"
    return json.loads(text)


def _push_payload(name: str, origin: Origin, before: str, after: str) -> dict:
    return payload(name, BEFORE=before, AFTER=origin.sha[after],
                   AFTER_TREE=git(origin.path, "rev-parse", f"{origin.sha[after]}^{{tree}}"),
                   AFTER_MESSAGE=git(origin.path, "show", "-s", "--format=%s", origin.sha[after]))


def _assert_submitted(run: ActionRun, origin: Origin, *, commit: str, parents: list[str], ref: str) -> Submitted:
    assert run.submitted is not None, f"optdrift submit was not run:\n{run.log}"
    sent = run.submitted
    assert sent.sha == origin.sha[commit], f"filed under {sent.sha}, not {commit} {origin.sha[commit]}"
    assert sent.tree == origin.tree(commit), "the tree uploaded is not the tree of the commit it is filed under"
    assert sent.parents == [origin.sha[p] for p in parents], \
        f"parents sent {sent.parents}, wanted {parents} {[origin.sha[p] for p in parents]}"
    assert sent.ref == ref
    # The stand-in said "changed": the step fails with that code and the outputs name it.
    assert run.code == 1, run.log
    assert run.outputs["verdict"] == "changed" and run.outputs["exit-code"] == "1"
    assert run.outputs["commit"] == sent.sha and run.outputs["parents"] == " ".join(sent.parents)
    return sent


PR_ENV = {"GITHUB_REF": "refs/pull/7/merge", "GITHUB_REF_NAME": "7/merge",
          "GITHUB_HEAD_REF": "adam-decay", "GITHUB_BASE_REF": "main"}


def _pr_payload(origin: Origin) -> dict:
    return payload("pull_request", BASE=origin.sha["B1"], HEAD=origin.sha["H2"],
                   HEAD_PARENT=origin.sha["H1"], MERGE=origin.sha["M"])


def test_pull_request_files_the_merge_commit_compared_with_the_base(origin: Origin, tmp_path: Path) -> None:
    """The tree that would land, under its own sha, compared with the base branch's tip: not the
    head's sha with the merge's tree, and not without a parent."""
    event = _pr_payload(origin)
    workspace = tmp_path / "workspace"
    checkout(origin, workspace, origin.sha["M"], "refs/remotes/pull/7/merge")
    run = run_action(tmp_path, workspace, event_name="pull_request", payload=event,
                     github={"GITHUB_SHA": origin.sha["M"], **PR_ENV})
    sent = _assert_submitted(run, origin, commit="M", parents=["B1", "H2"], ref="pull/7/merge")
    pull = event["pull_request"]
    assert sent.sha == pull["merge_commit_sha"] and sent.parents == [pull["base"]["sha"], pull["head"]["sha"]]
    assert sent.tree == {"adam.cu": "adam v2: decay after the update\n// why: see #7\n", "lion.cu": "lion v2\n"}
    assert sent.message == "#7 adam: apply weight decay after the update (merged into main)"


def test_push_of_several_commits_is_compared_with_the_previous_tip(origin: Origin, tmp_path: Path) -> None:
    """B2 and B3 pushed at once: B3's git parent B2 was never submitted, so B3 names `before` (B1,
    which the previous push submitted) as its first parent."""
    workspace = tmp_path / "workspace"
    checkout(origin, workspace, origin.sha["B3"], "refs/remotes/origin/main")
    run = run_action(tmp_path, workspace, event_name="push",
                     payload=_push_payload("push", origin, origin.sha["B1"], "B3"),
                     github={"GITHUB_SHA": origin.sha["B3"], "GITHUB_REF": "refs/heads/main", "GITHUB_REF_NAME": "main"})
    sent = _assert_submitted(run, origin, commit="B3", parents=["B1"], ref="main")
    assert sent.message == "docs: the kernels"


def test_push_of_the_merge_buttons_commit_keeps_both_parents(origin: Origin, tmp_path: Path) -> None:
    workspace = tmp_path / "workspace"
    checkout(origin, workspace, origin.sha["MM"], "refs/remotes/origin/main")
    run = run_action(tmp_path, workspace, event_name="push",
                     payload=_push_payload("push", origin, origin.sha["B3"], "MM"),
                     github={"GITHUB_SHA": origin.sha["MM"], "GITHUB_REF": "refs/heads/main", "GITHUB_REF_NAME": "main"})
    _assert_submitted(run, origin, commit="MM", parents=["B3", "H2"], ref="main")


def test_push_of_a_new_branch_uses_the_commits_own_parent(origin: Origin, tmp_path: Path) -> None:
    """`before` is all zeros on a new branch: the commit object's own parent, read from a
    depth-1 clone that does not hold the parent itself."""
    workspace = tmp_path / "workspace"
    checkout(origin, workspace, origin.sha["H2"], "refs/remotes/origin/adam-decay", depth=1)
    assert subprocess.run(["git", "cat-file", "-e", origin.sha["H1"]], cwd=workspace, env=GIT_ENV).returncode != 0
    run = run_action(tmp_path, workspace, event_name="push",
                     payload=_push_payload("push_new_branch", origin, NO_COMMIT, "H2"),
                     github={"GITHUB_SHA": origin.sha["H2"], "GITHUB_REF": "refs/heads/adam-decay",
                             "GITHUB_REF_NAME": "adam-decay"})
    _assert_submitted(run, origin, commit="H2", parents=["H1"], ref="adam-decay")


def test_merge_group_files_the_queued_commit_on_its_queue_parent(origin: Origin, tmp_path: Path) -> None:
    queue_ref = f"gh-readonly-queue/main/pr-7-{origin.sha['H2']}"
    workspace = tmp_path / "workspace"
    checkout(origin, workspace, origin.sha["Q"], f"refs/remotes/origin/{queue_ref.rsplit('/', 1)[1]}")
    event = payload("merge_group", QUEUE_HEAD=origin.sha["Q"], QUEUE_BASE=origin.sha["B3"],
                    HEAD=origin.sha["H2"], QUEUE_HEAD_TREE=git(origin.path, "rev-parse", f"{origin.sha['Q']}^{{tree}}"))
    run = run_action(tmp_path, workspace, event_name="merge_group", payload=event,
                     github={"GITHUB_SHA": origin.sha["Q"], "GITHUB_REF": f"refs/heads/{queue_ref}",
                             "GITHUB_REF_NAME": queue_ref})
    sent = _assert_submitted(run, origin, commit="Q", parents=["B3", "H2"], ref=queue_ref)
    assert sent.parents[0] == event["merge_group"]["base_sha"]


def test_workflow_dispatch_files_the_branch_tip_on_its_parent(origin: Origin, tmp_path: Path) -> None:
    workspace = tmp_path / "workspace"
    checkout(origin, workspace, origin.sha["B3"], "refs/remotes/origin/main")
    run = run_action(tmp_path, workspace, event_name="workflow_dispatch", payload=payload("workflow_dispatch"),
                     github={"GITHUB_SHA": origin.sha["B3"], "GITHUB_REF": "refs/heads/main", "GITHUB_REF_NAME": "main"})
    _assert_submitted(run, origin, commit="B3", parents=["B2"], ref="main")


def _assert_refused(run: ActionRun, *words: str) -> None:
    assert run.code == 2, run.log
    assert run.submitted is None, "optdrift submit ran although the action refused"
    [annotation] = [line for line in run.log.splitlines() if line.startswith("::error title=optdrift::")]
    for word in words:
        assert word in annotation, annotation


def test_a_checkout_of_the_pull_requests_head_is_refused(origin: Origin, tmp_path: Path) -> None:
    """actions/checkout with `ref: head.sha`: filing it would send the head's tree, compared with
    nothing the workflow submitted; the action says what to change instead."""
    workspace = tmp_path / "workspace"
    checkout(origin, workspace, origin.sha["H2"], "refs/remotes/pull/7/head")
    run = run_action(tmp_path, workspace, event_name="pull_request", payload=_pr_payload(origin),
                     github={"GITHUB_SHA": origin.sha["M"], **PR_ENV})
    _assert_refused(run, origin.sha["H2"], origin.sha["M"], "without `ref:`")


def test_a_commit_input_other_than_the_checkout_is_refused(origin: Origin, tmp_path: Path) -> None:
    workspace = tmp_path / "workspace"
    checkout(origin, workspace, origin.sha["M"], "refs/remotes/pull/7/merge")
    run = run_action(tmp_path, workspace, event_name="pull_request", payload=_pr_payload(origin),
                     github={"GITHUB_SHA": origin.sha["M"], **PR_ENV}, inputs={"commit": origin.sha["H2"]})
    _assert_refused(run, "input commit", origin.sha["H2"], "leave `commit` empty")


def test_pull_request_target_is_refused(origin: Origin, tmp_path: Path) -> None:
    """pull_request_target checks out the base branch, not the pull request."""
    workspace = tmp_path / "workspace"
    checkout(origin, workspace, origin.sha["B1"], "refs/remotes/origin/main")
    run = run_action(tmp_path, workspace, event_name="pull_request_target", payload=_pr_payload(origin),
                     github={"GITHUB_SHA": origin.sha["B1"], "GITHUB_REF": "refs/heads/main", "GITHUB_REF_NAME": "main"})
    _assert_refused(run, "pull_request_target", "run this action on pull_request")


def test_the_readme_workflow_checks_out_the_events_commit() -> None:
    """The rule needs the checkout at github.sha: the README's workflow must not pick another ref."""
    assert "ref" not in _readme_checkout()


def test_pull_request_from_a_fork_skips_with_a_notice_and_passes(origin: Origin, tmp_path: Path) -> None:
    """GitHub gives a fork's pull_request run no secrets (the token input is empty): the action
    submits nothing, says where the verdict comes from instead (the service's check run), exits 0."""
    event = payload("pull_request_fork", BASE=origin.sha["B1"], HEAD=origin.sha["H2"],
                    HEAD_PARENT=origin.sha["H1"], MERGE=origin.sha["M"])
    workspace = tmp_path / "workspace"
    checkout(origin, workspace, origin.sha["M"], "refs/remotes/pull/8/merge")
    run = run_action(tmp_path, workspace, event_name="pull_request", payload=event,
                     github={"GITHUB_SHA": origin.sha["M"], **PR_ENV, "GITHUB_REF": "refs/pull/8/merge"},
                     inputs={"token": ""})
    assert run.code == 0, run.log
    assert run.submitted is None, "a fork's run submitted (and would have answered 401)"
    [notice] = [line for line in run.log.splitlines() if line.startswith("::notice title=optdrift::")]
    assert "outside-contributor/my-kernels" in notice and "GitHub App" in notice
    assert "Pull requests from forks" in notice
    assert run.outputs["verdict"] == "skipped" and run.outputs["exit-code"] == "0"
    assert not any(line.startswith("::error") for line in run.log.splitlines())


def test_an_empty_token_on_a_branch_of_the_repository_itself_skips_too(origin: Origin, tmp_path: Path) -> None:
    """A pull_request run of the repository's own branch that gets no secret (Dependabot's runs):
    the same skip, never a 401."""
    workspace = tmp_path / "workspace"
    checkout(origin, workspace, origin.sha["M"], "refs/remotes/pull/7/merge")
    run = run_action(tmp_path, workspace, event_name="pull_request", payload=_pr_payload(origin),
                     github={"GITHUB_SHA": origin.sha["M"], **PR_ENV}, inputs={"token": ""})
    assert run.code == 0 and run.submitted is None, run.log
    assert run.outputs["verdict"] == "skipped"


def test_an_empty_token_on_push_is_refused_not_skipped(origin: Origin, tmp_path: Path) -> None:
    """main's push always has the repository's secrets: an empty token there is a misconfiguration,
    and passing would be a green with nothing checked."""
    workspace = tmp_path / "workspace"
    checkout(origin, workspace, origin.sha["B3"], "refs/remotes/origin/main")
    run = run_action(tmp_path, workspace, event_name="push",
                     payload=_push_payload("push", origin, origin.sha["B1"], "B3"),
                     github={"GITHUB_SHA": origin.sha["B3"], "GITHUB_REF": "refs/heads/main", "GITHUB_REF_NAME": "main"},
                     inputs={"token": ""})
    _assert_refused(run, "`token` input is empty", "push")


def test_a_shallow_checkout_is_deepened_so_the_client_sends_the_first_parent_line(origin: Origin,
                                                                                 tmp_path: Path) -> None:
    """Issue 44: the baseline is the nearest ancestor the service has a run of, so the client sends
    the first-parent line, read with git from the checkout; actions/checkout's depth-1 clone holds
    none of it, and the action deepens it. allow-no-baseline reaches the client only when set."""
    from service.cli.git_history import first_parent_ancestry

    workspace = tmp_path / "workspace"
    checkout(origin, workspace, origin.sha["M"], "refs/remotes/pull/7/merge", depth=1)
    assert first_parent_ancestry(workspace / SOURCE, origin.sha["M"], 200) == []  # depth 1: no history
    run = run_action(tmp_path, workspace, event_name="pull_request", payload=_pr_payload(origin),
                     github={"GITHUB_SHA": origin.sha["M"], **PR_ENV})
    _assert_submitted(run, origin, commit="M", parents=["B1", "H2"], ref="pull/7/merge")
    assert first_parent_ancestry(workspace / SOURCE, origin.sha["M"], 200) == [origin.sha["B1"], origin.sha["B0"]]
    assert "--allow-no-baseline" not in json.loads((tmp_path / "submitted.json").read_text())["argv"]

    first = tmp_path / "first"
    first.mkdir()
    checkout(origin, first / "workspace", origin.sha["B0"], "refs/remotes/origin/main", depth=1)
    run = run_action(first, first / "workspace", event_name="workflow_dispatch", payload={},
                     github={"GITHUB_SHA": origin.sha["B0"], "GITHUB_REF": "refs/heads/main", "GITHUB_REF_NAME": "main"},
                     inputs={"allow-no-baseline": "true"})
    assert "--allow-no-baseline" in json.loads((first / "submitted.json").read_text())["argv"], run.log
    # Issue 46: the step does not wait for the training impact unless asked (the PR comment gains it).
    assert "--no-training" in json.loads((tmp_path / "submitted.json").read_text())["argv"]
    again = tmp_path / "again"
    again.mkdir()
    checkout(origin, again / "workspace", origin.sha["B0"], "refs/remotes/origin/main", depth=1)
    run = run_action(again, again / "workspace", event_name="workflow_dispatch", payload={},
                     github={"GITHUB_SHA": origin.sha["B0"], "GITHUB_REF": "refs/heads/main", "GITHUB_REF_NAME": "main"},
                     inputs={"allow-no-baseline": "true", "wait-for-training": "true"})
    assert "--no-training" not in json.loads((again / "submitted.json").read_text())["argv"], run.log
