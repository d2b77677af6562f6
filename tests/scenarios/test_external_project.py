"""Issue 14's acceptance: a second external project through the real API, a real worker and the
real CLI, and through `optdrift check` without a server — the same verdicts and exit codes.

The project is tests/fixtures/capi_project (capiopt): CMake + a plain C ABI (fp32 AdamW and Lion
on the CPU), its own adapter (tests/fixtures/adapters/capiopt.py, registered by the suite as an
operator would; it declares bf16, 8-bit and momentum cases unsupported) and its own battery
(battery.json, named by optdrift.toml).
A session fixture makes it a git repository with this history (patches in its commits/ folder):

    base ── comment ──┬── decay ── fix     decay: AdamW decays after the update (PR 2040)
                      ├── segv              fix: the decay order restored
                      └── nondet            segv: Lion writes through a null workspace pointer
                                            nondet: AdamW centres its gradient on a racy mean

Expected, through `optdrift submit --wait` and `optdrift check` alike:
    base → no-baseline, exit 0, its 4 not-applicable cases listed;  comment → unchanged, exit 0;
    decay → changed from step 1 (exactly the weight-decayed AdamW cases), exit 1;
    segv → broken (exactly the Lion cases, SIGSEGV), exit 3;
    nondet → nondeterministic (the AdamW cases, repeats differ), exit 5;
    fix, queued while the API is down → every source fetch fails: retried with backoff, then run
    status `error` (optdrift's fault, no verdict); submitted again with the API back → changed, exit 1.

One service for the module in the production shape: `optdrift serve --no-worker` on PostgreSQL
and Redis (db 8), and a separate `optdrift worker`.
"""

from __future__ import annotations

from service.core.case_names import case_name

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psycopg
import pytest

from service.core.results import CaseSpec
from tests.service_fixtures import (
    PG_HOST_URL, REPO_ROOT, create_database, drop_database, flush_redis, free_port, start_process,
    stop_process, wait_http,
)
from worker.battery import load_battery

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("ninja") is None,
                       reason="needs cmake and ninja on PATH"),
]

FIXTURE = REPO_ROOT / "tests" / "fixtures" / "capi_project"
PATCHES = FIXTURE / "commits"
ADAPTER = "capiopt"  # registered by tests/conftest.py (OPTDRIFT_EXTRA_ADAPTERS)
PROJECT = "capiopt"
# Its own Redis db: the API tests use 14, the end-to-end tests 13, the hostile corpus 11, the compose
# test 10, the benchmarks 11, 12 and 14 — at the same time, and each flushes its own.
REDIS_URL = f"redis://127.0.0.1:6379/{int(os.environ.get('OPTDRIFT_TEST_EXTERNAL_REDIS_DB', '8'))}"
FINAL = ("done", "failed", "cancelled", "error")
# Attempts of a run that fails in optdrift (not in the commit) before it ends `error`.
MAX_ATTEMPTS = 3
EXIT = {"no-baseline": 0, "unchanged": 0, "changed": 1, "broken": 3, "nondeterministic": 5}


# ----------------------------------------------------------------------------- the git history
@dataclass(frozen=True)
class Commit:
    name: str
    sha: str
    parent: str | None  # the parent's name
    tree: Path          # the commit exported with `git archive`


@dataclass
class History:
    repo: Path
    commits: dict[str, Commit] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Commit:
        return self.commits[name]


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=ci", "-c", "user.email=ci@example.invalid", *args],
                          cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="session")
def history(tmp_path_factory: pytest.TempPathFactory) -> History:
    root = tmp_path_factory.mktemp("capiopt")
    repo = root / "repo"
    shutil.copytree(FIXTURE, repo, ignore=shutil.ignore_patterns("commits", "build"))
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "capiopt: fp32 AdamW and Lion behind a C ABI")
    made = History(repo=repo)

    def record(name: str, parent: str | None) -> None:
        sha = _git(repo, "rev-parse", "HEAD")
        tree = root / "trees" / name
        tree.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", sha], cwd=repo, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        made.commits[name] = Commit(name=name, sha=sha, parent=parent and made.commits[parent].sha, tree=tree)

    def commit_patch(name: str, parent: str, patch: str, message: str, *, reverse: bool = False) -> None:
        _git(repo, "checkout", "-q", made.commits[parent].sha)
        _git(repo, "apply", *(["-R"] if reverse else []), str(PATCHES / patch))
        _git(repo, "commit", "-qam", message)
        _git(repo, "branch", "-f", name)
        record(name, parent)

    record("base", None)
    commit_patch("comment", "base", "0002-comment-only.patch", "AdamW: say why the bias corrections are in double")
    commit_patch("decay", "comment", "0003-decay-after-update.patch", "AdamW: decay after the update")
    commit_patch("fix", "decay", "0003-decay-after-update.patch", "AdamW: decay before the update again",
                 reverse=True)
    commit_patch("segv", "comment", "0004-lion-workspace-segfault.patch", "Lion: interpolation in a workspace")
    commit_patch("nondet", "comment", "0005-unordered-grad-mean.patch", "AdamW: gradient centralization")
    return made


def _parent_name(history: History, name: str) -> str | None:
    sha = history[name].parent
    return next((c.name for c in history.commits.values() if c.sha == sha), None)


# ----------------------------------------------------------------------------- expected cases
def battery_cases() -> list[CaseSpec]:
    return load_battery(str(FIXTURE / "battery.json")).expand()


def runnable(case: CaseSpec) -> bool:
    return case.optimizer in ("adam", "lion") and case.family == "32bit" and case.param_dtype == "float32"


NOT_APPLICABLE = {c.case_id for c in battery_cases() if not runnable(c)}
ADAM = {c.case_id for c in battery_cases() if runnable(c) and c.optimizer == "adam"}
LION = {c.case_id for c in battery_cases() if runnable(c) and c.optimizer == "lion"}
DECAYED_ADAM = {c.case_id for c in battery_cases()
                if runnable(c) and c.optimizer == "adam" and c.hyper["weight_decay"] > 0}


def test_the_battery_covers_what_the_acceptance_needs():
    cases = battery_cases()
    points = {(c.hyper["lr"], c.hyper["weight_decay"]) for c in cases if runnable(c)}
    assert {(0.1, 0.1), (0.001, 0.01), (0.1, 0.0)} <= points
    assert len(NOT_APPLICABLE) == 4 and DECAYED_ADAM and LION
    assert DECAYED_ADAM < ADAM  # the wd = 0 controls must stay unchanged under the decay-order bug


# ----------------------------------------------------------------------------- without the service
@pytest.fixture(scope="module")
def builds(history: History, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """name -> built library, through the `command` build kind (worker/build/project.py)."""
    from service.core.project_config import load_project_config
    from worker.build.project import build_project

    cache = tmp_path_factory.mktemp("capiopt-builds")
    libraries = {}
    for name in ("comment", "decay", "segv", "nondet"):
        tree = history[name].tree
        config = load_project_config(tree)
        assert config.adapter == ADAPTER and config.build.kind == "command" and config.battery == "battery.json"
        result = build_project(tree, config, cache_dir=cache, cuda_archs=[])
        assert result.ok, result.error
        assert Path(result.library_path).name == "libcapiopt.so"
        libraries[name] = result.library_path
    return libraries


def _host_run(library: str, cases: list[CaseSpec]):
    from worker.engine.host import KernelHost

    with KernelHost(library, device="cpu", adapter=ADAPTER, case_timeout_s=120) as host:
        return {r.case.case_id: r for r in host.run_many(cases)}


def test_the_adapter_runs_the_build_and_sets_aside_what_it_cannot(builds):
    results = _host_run(builds["comment"], battery_cases())
    assert {i for i, r in results.items() if r.status == "ok"} == ADAM | LION
    for case_id in NOT_APPLICABLE:
        result = results[case_id]
        assert result.status == "not_applicable", (case_id, result.status, result.message)
        assert result.message.startswith("capiopt has no "), result.message
    # Every case reproduces itself bit for bit on the base kernels.
    again = _host_run(builds["comment"], [r.case for r in results.values() if r.status == "ok"])
    assert all(again[i].trajectory.digests == results[i].trajectory.digests for i in again)


def test_the_decay_order_change_is_found_from_step_1(builds):
    from service.core.verdicts import compare_runs
    from worker.engine.corun import corun_battery

    battery = load_battery(str(FIXTURE / "battery.json"))
    commit_run, baseline_run, diffs = corun_battery(
        battery, builds["decay"], builds["comment"], device="cpu", adapter=ADAPTER,
        cases=[c for c in battery.expand() if runnable(c)])
    comparison = compare_runs(commit_run, baseline_run, diffs)
    assert comparison.verdict == "changed"
    changed = {c.case_id: c for c in comparison.cases if c.verdict == "changed"}
    assert set(changed) == DECAYED_ADAM
    for case in changed.values():
        # (p - s u)(1 - lr wd) vs p (1 - lr wd) - s u differ by s u lr wd from the first step.
        assert case.first_divergent_step == 1 and case.max_abs_diff_per_step[0] > 0.0
        if ".lr=0.1." in case.case_id:
            assert case.direction == "farther"


def test_the_segfaulting_kernel_costs_its_cases_only(builds):
    results = _host_run(builds["segv"], [c for c in battery_cases() if runnable(c)])
    for case_id in LION:
        assert results[case_id].status == "broken" and "SIGSEGV" in results[case_id].message
    assert all(results[i].status == "ok" for i in ADAM)


def test_the_racy_kernel_does_not_reproduce_itself(builds):
    cases = [c for c in battery_cases() if runnable(c)]
    first, second = _host_run(builds["nondet"], cases), _host_run(builds["nondet"], cases)
    differing = {i for i in first if first[i].trajectory.digests != second[i].trajectory.digests}
    assert differing == ADAM  # Lion has no reduction: it reproduces itself


# ----------------------------------------------------------------------------- the service
@dataclass
class Service:
    url: str
    port: int
    tmp: Path
    env: dict[str, str]
    token: str
    database: str
    api: subprocess.Popen | None = None
    worker: subprocess.Popen | None = None
    runs: dict[str, dict] = field(default_factory=dict)   # commit name -> final run (GET /runs/{id})
    exits: dict[str, int] = field(default_factory=dict)   # commit name -> `submit --wait` exit code

    def start_api(self) -> None:
        self.api = start_process(["serve", "--port", str(self.port), "--no-worker"], self.env,
                                 self.tmp / f"api-{time.monotonic_ns()}.log")
        wait_http(f"{self.url}/readyz", timeout_s=90)

    def stop_api(self) -> None:
        stop_process(self.api)
        self.api = None

    def start_worker(self) -> None:
        self.worker = start_process(["worker", "--loglevel", "INFO"], self.env, self.tmp / "worker.log")

    def stop_worker(self) -> None:
        stop_process(self.worker)
        self.worker = None

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.token}"}, timeout=60)

    def commit_run(self, sha: str) -> dict:
        with self.http() as http:
            commit = http.get(f"/api/v1/projects/{PROJECT}/commits/{sha}")
            assert commit.status_code == 200, commit.text
            runs = commit.json()["runs"]
            assert len(runs) == 1, runs
            return http.get(f"/api/v1/runs/{runs[0]['id']}").json()

    def log_tail(self, chars: int = 4000) -> str:
        path = self.tmp / "worker.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def optdrift(*args: str, env: dict[str, str], timeout_s: float = 600) -> subprocess.CompletedProcess:
    """The real CLI, as CI runs it (the console script next to this interpreter)."""
    script = Path(sys.executable).with_name("optdrift")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "service.cli"]
    # Wide, so a table never folds a case id across lines.
    return subprocess.run([*command, *args], check=False, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=timeout_s,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "COLUMNS": "400", **env})


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    tmp = tmp_path_factory.mktemp("capiopt-service")
    database = f"optdrift_capi_{os.getpid()}"
    database_url = create_database(database)
    flush_redis(REDIS_URL)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"OPTDRIFT_HOME": str(tmp / "home"), "OPTDRIFT_DATABASE_URL": database_url,
           "OPTDRIFT_BROKER_URL": REDIS_URL, "OPTDRIFT_PUBLIC_URL": url,
           "OPTDRIFT_BUILD_CACHE_DIR": str(tmp / "build-cache"), "OPTDRIFT_MAINTENANCE_INTERVAL_S": "2",
           "OPTDRIFT_HEARTBEAT_INTERVAL_S": "2", "OPTDRIFT_RETRY_BACKOFF_S": "1",
           "OPTDRIFT_MAX_ATTEMPTS": str(MAX_ATTEMPTS)}
    svc = Service(url=url, port=port, tmp=tmp, env=env, token="", database=database)
    try:
        svc.start_api()
        svc.token = (tmp / "home" / "admin-token").read_text().strip()
        with svc.http() as http:
            answer = http.post("/api/v1/projects", json={"name": PROJECT, "environments": ["cpu"]})
            assert answer.status_code == 201, answer.text
        svc.start_worker()
        yield svc
    finally:
        if svc.worker is not None:
            stop_process(svc.worker)
        if svc.api is not None:
            stop_process(svc.api)
        print(svc.log_tail())
        drop_database(database)
        flush_redis(REDIS_URL)


def submit(service: Service, history: History, name: str, *, wait: bool = True) -> subprocess.CompletedProcess:
    commit = history[name]
    args = ["submit", "--project", PROJECT, "--commit", commit.sha, "--source", str(commit.tree),
            "--message", name, "--url", service.url]
    if commit.parent:
        args += ["--parent", commit.parent]
    else:  # the project's first commit: nothing to compare with, accepted (issue 44: else exit 7)
        args += ["--allow-no-baseline"]
    # A run of this battery takes seconds; minutes mean a lost task, not a slow one.
    answer = optdrift(*args, *(("--wait", "--no-training") if wait else ("--no-wait",)), env={"OPTDRIFT_TOKEN": service.token},
                      timeout_s=240)
    if wait:
        service.exits[name] = answer.returncode
        service.runs[name] = service.commit_run(commit.sha)
    return answer


def _explain(answer: subprocess.CompletedProcess, service: Service) -> str:
    return (f"exit {answer.returncode}\nstdout:\n{answer.stdout[-4000:]}\nstderr:\n{answer.stderr[-3000:]}\n"
            f"worker log:\n{service.log_tail(2500)}")


def _cases(run: dict) -> dict[str, dict]:
    return {c["case_id"]: c for c in (run.get("verdict") or {}).get("detail", {}).get("cases", [])}


def _assert_not_applicable_listed(run: dict, answer: subprocess.CompletedProcess) -> None:
    verdict = run["verdict"]
    assert verdict["counts"]["not_applicable"] == len(NOT_APPLICABLE), verdict["counts"]
    assert verdict["counts"]["broken"] == 0 or verdict["outcome"] == "broken", verdict["counts"]
    listed = {c["case_id"]: c for c in verdict["not_applicable"]}
    assert set(listed) == NOT_APPLICABLE
    assert all(c["reason"] and c["reason"].startswith("capiopt has no ") for c in listed.values()), listed
    assert {i for i, c in _cases(run).items() if c["verdict"] == "not_applicable"} == NOT_APPLICABLE
    for case_id in NOT_APPLICABLE:  # and the CLI lists them, by name (service/core/case_names.py)
        assert case_name(case_id) in answer.stdout, answer.stdout[-3000:]


def test_submit_base_is_no_baseline_with_its_not_applicable_cases(service, history):
    answer = submit(service, history, "base")
    run = service.runs["base"]
    assert run["status"] == "done", _explain(answer, service)
    assert run["verdict"]["outcome"] == "no-baseline"
    _assert_not_applicable_listed(run, answer)
    assert answer.returncode == 0, _explain(answer, service)
    # The run records the battery that ran: the tree's own (optdrift.toml), not the project's default.
    battery = load_battery(str(FIXTURE / "battery.json"))
    assert (run["battery"], run["battery_hash"]) == (battery.name, battery.digest)


def test_submit_comment_only_is_unchanged(service, history):
    answer = submit(service, history, "comment")
    run = service.runs["comment"]
    assert run["status"] == "done", _explain(answer, service)
    verdict = run["verdict"]
    assert verdict["outcome"] == "unchanged" and not verdict["flagged"]
    assert verdict["baseline_run_id"] == service.runs["base"]["id"]
    assert {i for i, c in _cases(run).items() if c["verdict"] == "unchanged"} == ADAM | LION
    _assert_not_applicable_listed(run, answer)
    assert answer.returncode == 0, _explain(answer, service)


def _assert_decay_order_changed(run: dict, baseline_run: dict) -> None:
    verdict = run["verdict"]
    assert verdict["outcome"] == "changed" and verdict["flagged"]
    assert verdict["baseline_run_id"] == baseline_run["id"]
    assert verdict["first_divergent_step"] == 1
    cases = _cases(run)
    assert {i for i, c in cases.items() if c["verdict"] == "changed"} == DECAYED_ADAM
    assert all(cases[i]["first_divergent_step"] == 1 for i in DECAYED_ADAM)
    assert {i for i, c in cases.items() if c["verdict"] == "unchanged"} == (ADAM - DECAYED_ADAM) | LION
    assert verdict["counts"]["not_applicable"] == len(NOT_APPLICABLE)


def test_submit_decay_order_is_changed_from_step_1(service, history):
    answer = submit(service, history, "decay")
    run = service.runs["decay"]
    assert run["status"] == "done", _explain(answer, service)
    _assert_decay_order_changed(run, service.runs["comment"])
    assert answer.returncode == 1, _explain(answer, service)


def test_submit_segfaulting_kernel_is_broken(service, history):
    answer = submit(service, history, "segv")
    run = service.runs["segv"]
    assert run["status"] != "error" and run["fault"] != "optdrift", _explain(answer, service)
    verdict = run["verdict"]
    assert verdict is not None and verdict["outcome"] == "broken", _explain(answer, service)
    cases = _cases(run)
    assert {i for i, c in cases.items() if c["verdict"] == "broken"} == LION
    assert all("SIGSEGV" in cases[i]["message"] for i in LION), [cases[i]["message"] for i in LION]
    assert {i for i, c in cases.items() if c["verdict"] == "unchanged"} == ADAM
    assert {i for i, c in cases.items() if c["verdict"] == "not_applicable"} == NOT_APPLICABLE
    assert answer.returncode == 3, _explain(answer, service)


def test_submit_racy_kernel_is_nondeterministic_not_changed(service, history):
    answer = submit(service, history, "nondet")
    run = service.runs["nondet"]
    assert run["status"] == "done", _explain(answer, service)
    verdict = run["verdict"]
    assert verdict["outcome"] == "nondeterministic", _explain(answer, service)
    cases = _cases(run)
    assert {i for i, c in cases.items() if c["verdict"] == "nondeterministic"} == ADAM
    assert not [i for i, c in cases.items() if c["verdict"] in ("changed", "broken")]
    assert {i for i, c in cases.items() if c["verdict"] == "unchanged"} == LION
    listed = {c["case_id"]: c for c in verdict["nondeterministic"]}
    assert set(listed) == ADAM
    for case in listed.values():
        assert case["runs"] >= 2 and case["differing"] >= 1 and case["first_divergent_step"] >= 1, case
    assert answer.returncode == 5, _explain(answer, service)


def _database_run(service: Service, run_id: int) -> tuple[str, int, str | None]:
    url = f"{PG_HOST_URL}/{service.database}"
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT status, attempt, error FROM runs WHERE id = %s", (run_id,)).fetchone()


def test_api_down_during_the_source_fetch_is_an_error_then_retried(service, history):
    """The fix commit is queued while no worker runs, the API stops, a worker takes the run: every
    source fetch fails. That is optdrift's fault: retried with backoff (OPTDRIFT_MAX_ATTEMPTS
    attempts), then run status `error` — never `failed`, never a verdict on the commit. With the API
    back, submitting the commit again re-queues the errored run, which gets its right verdict."""
    service.stop_worker()
    queued = submit(service, history, "fix", wait=False)
    assert queued.returncode == 0, _explain(queued, service)
    run_id = service.commit_run(history["fix"].sha)["id"]
    service.stop_api()
    try:
        service.start_worker()
        seen: list[tuple[str, int, str | None]] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            state = _database_run(service, run_id)
            if not seen or seen[-1] != state:
                seen.append(state)
            if state[0] in ("error", "done", "failed"):
                break
            time.sleep(0.1)
    finally:
        service.start_api()
    statuses = [status for status, _, _ in seen]
    assert statuses[-1] == "error" and "failed" not in statuses and "done" not in statuses, (seen, service.log_tail())
    # Retried by itself before giving up: every attempt was made, each failed on the fetch.
    assert seen[-1][1] == MAX_ATTEMPTS, seen
    assert [a for s, a, _ in seen if s == "queued" and a > 0], seen  # back in the queue between attempts
    error = seen[-1][2]
    assert "fetch" in error and "not the commit" in error, error
    with service.http() as http:
        run = http.get(f"/api/v1/runs/{run_id}").json()
    assert (run["status"], run["fault"], run["verdict"]) == ("error", "optdrift", None), run

    # The API is back: submitting the same commit again (CI's retry) re-queues the errored run.
    answer = submit(service, history, "fix")
    run = service.runs["fix"]
    assert run["id"] == run_id
    assert run["status"] == "done" and run["fault"] is None, _explain(answer, service)
    _assert_decay_order_changed(run, service.runs["decay"])  # the fix undoes exactly the decay-order change
    assert answer.returncode == 1, _explain(answer, service)


# ----------------------------------------------------------------------------- `optdrift check`
@pytest.mark.parametrize("name,verdict", [
    ("base", "no-baseline"), ("comment", "unchanged"), ("decay", "changed"), ("segv", "broken"),
    ("nondet", "nondeterministic"),
])
def test_check_without_a_server_gives_the_same_verdict(name, verdict, history, service, tmp_path_factory):
    """The same tree and parent, no server: the verdict, the exit code and each case's verdict
    are the service's."""
    parent = _parent_name(history, name)
    home = tmp_path_factory.getbasetemp() / "capiopt-check-home"
    json_out = tmp_path_factory.mktemp(f"check-{name}") / "check.json"
    args = ["check", "--source", str(history[name].tree), "--device", "cpu", "--json-out", str(json_out)]
    if parent:
        args += ["--baseline", str(history[parent].tree)]
    # No server: no database, broker or API address reachable from here.
    answer = optdrift(*args, env={"OPTDRIFT_HOME": str(home), "OPTDRIFT_BUILD_CACHE_DIR": str(home / "builds"),
                                  "OPTDRIFT_DATABASE_URL": "", "OPTDRIFT_BROKER_URL": "",
                                  "OPTDRIFT_URL": "http://127.0.0.1:9", "OPTDRIFT_PUBLIC_URL": ""})
    explain = f"exit {answer.returncode}\nstdout:\n{answer.stdout[-4000:]}\nstderr:\n{answer.stderr[-3000:]}"
    assert json_out.exists(), explain
    comparison = json.loads(json_out.read_text())["comparison"]
    assert comparison["verdict"] == verdict, explain
    assert answer.returncode == EXIT[verdict], explain
    check_cases = {c["case_id"]: c["verdict"] for c in comparison["cases"]}
    assert {i for i, v in check_cases.items() if v == "not_applicable"} == NOT_APPLICABLE
    service_run = service.runs.get(name)
    if service_run is None or service_run.get("verdict") is None:
        pytest.fail(f"the service gave {name} no verdict to compare with (its test failed first)")
    assert service_run["verdict"]["outcome"] == comparison["verdict"]
    assert service.exits[name] == answer.returncode
    assert {i: c["verdict"] for i, c in _cases(service_run).items()} == check_cases


# ----------------------------------------------------------------------------- a real library, same service
def test_a_real_pypi_library_through_the_service(service, tmp_path_factory):
    """Issue 20: lion-pytorch 0.2.5 (tests/scenarios/test_real_library_lion.py, which drives the rest of its
    history through `optdrift check`) on this running service, as a second project: its first
    commit is no-baseline (exit 0) with its not-applicable cases; weight decay moved after the
    update is changed (exit 1), exactly the weight-decayed cases, from step 1; each run stores
    the adapter's describe() with the library's version."""
    from tests.lion_project import make_history
    from tests.scenarios.test_real_library_lion import DECAYED, NOT_APPLICABLE, RUNNABLE

    lion = make_history(tmp_path_factory.mktemp("lion-service"))
    with service.http() as http:
        answer = http.post("/api/v1/projects", json={"name": "lion-pytorch", "environments": ["cpu"]})
        assert answer.status_code == 201, answer.text
    runs = {}
    for name, parent in (("comment", None), ("decay", "comment")):
        args = ["submit", "--project", "lion-pytorch", "--commit", lion[name].sha, "--source", str(lion[name].tree),
                "--message", name, "--url", service.url, "--wait", "--no-training"]
        answer = optdrift(*args, *(["--parent", lion[parent].sha] if parent else ["--allow-no-baseline"]),
                          env={"OPTDRIFT_TOKEN": service.token}, timeout_s=240)
        with service.http() as http:
            commit = http.get(f"/api/v1/projects/lion-pytorch/commits/{lion[name].sha}").json()
            runs[name] = http.get(f"/api/v1/runs/{commit['runs'][0]['id']}").json()
            page = http.get(f"/runs/{runs[name]['id']}").text  # the run page shows the stored describe()
        assert runs[name]["status"] == "done", _explain(answer, service)
        assert answer.returncode == {"comment": 0, "decay": 1}[name], _explain(answer, service)
        # the library by its last part: no worker path on a page (issue 47)
        assert "version: <code>lion-pytorch 0.2.5</code>" in page and "library: <code>…/lion_pytorch</code>" in page
        assert "/build/site/lion_pytorch</code>" not in page  # (the tree's own build command may name build/site)
    first, decay = runs["comment"]["verdict"], runs["decay"]["verdict"]
    assert first["outcome"] == "no-baseline" and first["counts"]["not_applicable"] == len(NOT_APPLICABLE)
    assert decay["outcome"] == "changed" and decay["baseline_run_id"] == runs["comment"]["id"]
    cases = _cases(runs["decay"])
    assert {i for i, c in cases.items() if c["verdict"] == "changed"} == DECAYED
    assert {i for i, c in cases.items() if c["verdict"] == "unchanged"} == RUNNABLE - DECAYED
    assert all(cases[i]["first_divergent_step"] == 1 for i in DECAYED)
