"""Submit-to-verdict latency of the whole service on its embedded default (issue 7, deliverable 4).

Starts, in a fresh OPTDRIFT_HOME (SQLite + kombu's filesystem broker + source store + build
cache, nothing else), `optdrift serve --no-worker` and one worker: `optdrift worker --gpus all`
(one Celery worker per GPU, queue gpu.sm<cc>) with --gpus, else a CPU worker (queue cpu). Then it
acts as CI would: the admin token `serve` wrote creates the project, `optdrift token create
--scope submit` makes CI's token, and every commit goes through the REST API (service.cli.client,
httpx) and is polled until its verdict is there.

Commits, one at a time, each submitted once the worker has finished the one before:

  A         the bundled csrc                                    cold build (empty cache); no baseline
  C         A + a comment-only file outside the kernel sources  same build digest as A: cache hit;
                                                                unchanged
  B-build   the decay-after-update copy (worker/mutations.py),  compiles B's digest (the cost of a
            quick battery, in a project of its own              kernel change); no baseline
  B         the decay-after-update copy, parent A               cache hit (warmed by B-build);
                                                                flagged, changed from step 1

A, C and B run --battery; B-build always runs `quick`: it is there to warm the build cache, so that
B's row is the warm-cache latency of a flagged commit and no standard battery is spent on it. A
comment inside a .cpp/.h would change the build digest (it hashes the source bytes), so C's
comment lives in a NOTES.md beside the kernels; the archive, and so the commit's source digest,
still differs from A's.

Each row's time is the client's wall clock from "submit" (packing the tree included) until it
reads a verdict from GET /runs/{id}; it includes the upload, the database writes, the broker
(the filesystem transport polls its folder about once a second), queueing, fetching the source,
the build (or its cache hit), starting the kernel host, the battery, storing every trajectory and
computing the verdict. The phases beside it come from the run's own timestamps (created, started,
finished, verdict created) and from the client seeing the status turn `running` (polling every
--poll-s, so phases are good to about that). After a flagged verdict the worker goes on to co-run
the baseline for the changed cases (worker/jobs/corun.py); that comes after the verdict, is
reported as "after verdict" (not in the total), and the next commit waits for it so that it never
queues behind it; after the last commit it is waited for only while --deadline-s allows.

    .venv/bin/python bench/e2e_latency.py --battery quick              # CPU
    python3 bench/e2e_latency.py --battery standard --gpus all         # the H200 (bench/gpu/h200_e2e.sh)

The headline figures are B's: a flagged commit's submit-to-verdict on a warm build and its co-run
detail after the verdict. With --deadline-s a commit is skipped when the time left is under 1.2x
what it should take (`expected_s`: a commit expected to hit the build cache is estimated from the
runs that did, or from the others with their build taken out, never from A's cold build). B is
never skipped or left without its co-run detail silently: that prints "HEADLINE NOT MEASURED" with
the reason, in the FAILED lines too, and exits 1 (`headline_problems`).

Exit 0 when A has no baseline, C is unchanged with A's build digest (a cache hit), B-build compiled
and B is changed from step 1 with B-build's digest (a cache hit) and its co-run detail stored; 1
when a check fails, a commit was skipped for time or a headline figure was not measured; 2 when
the service could not be run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import httpx  # noqa: E402

from service.cli.client import FINAL, OptdriftClient  # noqa: E402
from worker.mutations import copy_tree, decay_after_update  # noqa: E402

PROJECT = "e2e"
WARMUP_PROJECT = "e2e-build-warmup"
NOTE_FILE = "NOTES.md"
# Settings and client variables that would take the service off its embedded default or hand it
# another token; removed from the children's environment (build knobs such as
# OPTDRIFT_CUDA_ARCHS and OPTDRIFT_CCACHE stay).
STRIPPED = ("OPTDRIFT_DATABASE_URL", "OPTDRIFT_BROKER_URL", "OPTDRIFT_HOME", "OPTDRIFT_STORE_DIR",
            "OPTDRIFT_BUILD_CACHE", "OPTDRIFT_BUILD_CACHE_DIR", "OPTDRIFT_WORKER_ENVIRONMENT",
            "OPTDRIFT_WORKER_DEVICE", "OPTDRIFT_WORKER_TOKEN", "OPTDRIFT_TOKEN", "OPTDRIFT_TOKEN_FILE",
            "OPTDRIFT_PUBLIC_URL", "OPTDRIFT_URL", "OPTDRIFT_PROTECT_READS", "OPTDRIFT_FAST_ENGINE")
TASK_DONE = re.compile(r"Task optdrift\.execute_run\[[^\]]+\] (succeeded|raised|failed)")


class Interrupted(Exception):
    """SIGTERM or Ctrl-C: stop everything and print what was measured."""


def _interrupted(signum: int, _frame) -> None:  # noqa: ANN001
    raise Interrupted(f"signal {signal.Signals(signum).name}")


class SetupError(RuntimeError):
    """The service or the worker could not be started (exit 2)."""


@dataclass
class Commit:
    sha: str
    parents: list[str]
    tree: Path
    what: str
    expect_outcome: str
    expect_cache_hit: bool
    expect_first_step: int | None = None
    project: str = PROJECT
    battery: str | None = None  # None: --battery
    # A first commit has no baseline, but a verdict of `broken` outranks `no-baseline` when cases
    # go non-finite: the bundled 8-bit fp16 Adam/AdEMAMix at lr = wd = 0.1 with exact zeros do on
    # the standard battery (second moments below the map's smallest code; docs/KERNELS_8BIT.md).
    # Accepted only when every broken case is such a NaN/Inf case, never a crash or an error.
    nonfinite_broken_ok: bool = False
    # The figure this commit is measured for, when it is a headline one (B's): without it measured
    # the benchmark fails, saying so (headline_problems).
    headline: str | None = None


@dataclass
class Measured:
    commit: Commit
    run: dict = field(default_factory=dict)
    total_s: float = float("nan")
    upload_s: float = float("nan")
    seen_running_wall: float | None = None
    first_case_wall: float | None = None
    verdict_wall: float | None = None
    after_verdict_s: float | None = None
    after_verdict_note: str | None = None
    corun_detail_s: float | None = None  # submit -> the changed cases' per-step diffs stored (co-run)
    corun_phases: dict | None = None  # the worker's own account of the co-run (verdict detail)
    battery: str = "-"
    problems: list[str] = field(default_factory=list)
    skipped: str | None = None


# ----------------------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_environment(home: Path, url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in STRIPPED}
    env.update(OPTDRIFT_HOME=str(home), OPTDRIFT_PUBLIC_URL=url, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    return env


def start(argv: list[str], *, env: dict[str, str], log_path: Path) -> subprocess.Popen:
    log = open(log_path, "ab")  # noqa: SIM115  (closed with the process)
    # Own process group: stop() ends it and every child (GPU workers, pool children) together.
    process = subprocess.Popen(argv, env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    process.log_file = log  # type: ignore[attr-defined]
    return process


def stop(process: subprocess.Popen | None, timeout_s: float) -> None:
    """SIGTERM to the process we started (Celery's warm shutdown, which stops its pool children and
    the GPU supervisor's workers; uvicorn's graceful one), then SIGKILL to whatever is left of its
    process group."""
    if process is None:
        return
    try:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone: nothing was left behind
        process.wait()
    finally:
        process.log_file.close()  # type: ignore[attr-defined]


def kill_leftovers(home: Path) -> None:
    """A build cut short leaves ninja and its compilers running: the sandbox gives the build its own
    session, outside the worker's process group. They are ours, and each runs in this run's fresh
    home or names it on its command line; nothing else does. Two passes: ninja may start one more
    compile while the first pass runs."""
    marker, own = str(home), os.getpid()
    for _ in range(2):
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == own:
                continue
            try:
                cwd = os.readlink(entry / "cwd")
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if cwd.startswith(marker) or marker.encode() in cmdline:
                try:
                    os.kill(int(entry.name), signal.SIGKILL)
                    print(f"killed leftover process {entry.name}: {cmdline[:80]!r}")
                except ProcessLookupError:
                    pass
        time.sleep(0.2)


def stop_service(processes: list, home: Path, *, cut_short: bool) -> None:
    """Stop the workers and the API we started (a short warm shutdown when cut short, so the next
    part of a device call gets the GPUs), then, if cut short, whatever still runs from `home`. Only
    `home`: a build cache may be shared with other jobs' builds (the test suite's, on another
    xdist worker), and a leftover of ours runs in or names our home."""
    for process in processes:
        stop(process, 5 if cut_short else 30)
    if cut_short:
        kill_leftovers(home)


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_ready(url: str, process: subprocess.Popen, log_path: Path, timeout_s: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if process.poll() is not None:
            raise SetupError(f"`optdrift serve` exited with {process.returncode}:\n{tail(log_path)}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SetupError(f"the API at {url} was not ready after {timeout_s:g} s:\n{tail(log_path)}")


def ccache_in_use() -> str:
    """What worker.build will compile through (the same lookup; the cache itself starts empty in
    the fresh home's builds/ccache)."""
    from worker.build import ccache_version, find_ccache

    try:
        found = find_ccache()
    except FileNotFoundError as exc:
        return f"misconfigured ({exc})"
    return f"{ccache_version(str(found))} at {found}" if found else "none (every build compiles every file)"


def gpu_environment(gpus: str) -> str:
    """The queue the GPU worker(s) will consume, from nvidia-smi (no CUDA here either)."""
    from worker.gpu_workers import list_gpus, plan_workers

    classes = sorted({plan.environment for plan in plan_workers(list_gpus(), gpus)})
    if len(classes) != 1:
        raise SetupError(f"--gpus {gpus!r} spans environment classes {classes}; pick GPUs of one class")
    return classes[0]


def wait_worker(home: Path, environment: str, worker: subprocess.Popen, log_path: Path,
                timeout_s: float) -> float:
    """Until a worker of `environment` has written its presence row (what the API's waiting_for
    reads), i.e. Celery is consuming the queue."""
    os.environ["OPTDRIFT_HOME"] = str(home)
    for name in STRIPPED:
        if name != "OPTDRIFT_HOME":
            os.environ.pop(name, None)
    from service.db.session import get_sessionmaker
    from service.domain.workers import live_workers
    from service.settings import get_settings

    get_settings.cache_clear()
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if worker.poll() is not None:
            raise SetupError(f"the worker exited with {worker.returncode}:\n{tail(log_path)}")
        with get_sessionmaker()() as session:
            if live_workers(session=session, environment=environment):
                return time.monotonic() - started
        time.sleep(0.25)
    raise SetupError(f"no worker for {environment} after {timeout_s:g} s:\n{tail(log_path)}")


def tasks_finished(log_path: Path) -> int:
    try:
        return len(TASK_DONE.findall(log_path.read_text(errors="replace")))
    except OSError:
        return 0


def wait_idle(log_path: Path, submitted: int, timeout_s: float) -> float | None:
    """Until the worker's log shows `submitted` finished tasks (the task returns after the verdict
    and the baseline co-run); seconds waited, None on timeout."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if tasks_finished(log_path) >= submitted:
            return time.monotonic() - started
        time.sleep(0.2)
    return None


# ----------------------------------------------------------------------------- commits
def make_trees(root: Path) -> dict[str, Path]:
    csrc = REPO_ROOT / "csrc"
    trees = {"A": copy_tree(csrc, root / "A"), "B": decay_after_update(copy_tree(csrc, root / "B"))}
    trees["C"] = copy_tree(trees["A"], root / "C")
    (trees["C"] / NOTE_FILE).write_text(
        "<!-- A comment-only change outside the kernel sources: no trajectory may move, and the "
        "build digest stays the same. -->\n")
    return trees


def parse_time(value: str | None) -> float | None:
    return datetime.fromisoformat(value).timestamp() if value else None


def measure(client: OptdriftClient, commit: Commit, *, battery: str, poll_s: float,
            timeout_s: float) -> Measured:
    result = Measured(commit=commit)
    started = time.monotonic()
    answer = client.submit_commit(project=commit.project, sha=commit.sha, parents=commit.parents,
                                  source_dir=commit.tree, battery=battery, message=commit.what)
    result.upload_s = time.monotonic() - started
    if len(answer["runs"]) != 1:
        raise SetupError(f"{commit.sha}: expected one run, the API made {len(answer['runs'])}")
    run_id = answer["runs"][0]["id"]
    while True:
        run = client.run(run_id)
        if run["status"] == "running" and result.seen_running_wall is None:
            result.seen_running_wall = time.time()
        if run["progress"]["cases_done"] and result.first_case_wall is None:
            result.first_case_wall = time.time()
        if run["status"] in FINAL and (run["verdict"] is not None or run["status"] == "cancelled"):
            break
        if time.monotonic() - started > timeout_s:
            result.problems.append(f"no verdict after {timeout_s:g} s (status {run['status']}, "
                                   f"{run['progress']}, waiting_for {run.get('waiting_for')})")
            result.run = run
            return result
        time.sleep(poll_s)
    result.total_s = time.monotonic() - started
    result.verdict_wall = time.time()
    result.run = run
    verdict = run.get("verdict") or {}
    if verdict.get("changed_cases") and verdict.get("baseline_run_id") is not None:
        # A flagged commit: the co-run's per-step |commit - baseline| follows the verdict
        # (issue 18: flagged commit -> full co-run detail); it records its window when stored.
        # Without a baseline there is no co-run (a first commit's broken cases count as changed
        # too: waiting for its detail cost the H200 run of 2026-12-01 its 300 s per-run limit).
        while time.monotonic() - started < timeout_s:
            verdict = (client.run(run_id).get("verdict") or {})
            if (verdict.get("detail") or {}).get("corun_window"):
                result.corun_detail_s = time.monotonic() - started
                detail = verdict["detail"]
                result.corun_phases = {**(detail.get("corun_phases") or {}),
                                       "corun_seconds": detail.get("corun_seconds"),
                                       **{f"kernels: {k}": v for k, v in (detail.get("corun_kernels") or {}).items()}}
                break
            time.sleep(poll_s)
    return result


def check(measured: Measured) -> None:
    commit, run = measured.commit, measured.run
    verdict = run.get("verdict") or {}
    problems = measured.problems
    if run.get("status") != "done":
        problems.append(f"status {run.get('status')}: {run.get('error')}")
    outcome = verdict.get("outcome")
    if outcome == "broken" and commit.nonfinite_broken_ok:
        broken = [line for line in (verdict.get("summary") or "").splitlines() if line.startswith("broken:")]
        entries = [e for line in broken for e in line[len("broken:"):].split(";") if e.strip()]
        if not entries or not all("NaN/Inf in parameters or states" in e for e in entries):
            problems.append(f"verdict 'broken' by something other than non-finite values: {broken}")
    elif outcome != commit.expect_outcome:
        problems.append(f"verdict {outcome!r}, expected {commit.expect_outcome!r}")
    if commit.expect_first_step is not None and verdict.get("first_divergent_step") != commit.expect_first_step:
        problems.append(f"first changed step {verdict.get('first_divergent_step')}, "
                        f"expected {commit.expect_first_step}")
    if commit.expect_outcome == "changed" and not verdict.get("changed_cases"):
        problems.append("no changed case")
    if bool(run.get("build_cached")) != commit.expect_cache_hit:
        problems.append(f"build cached={run.get('build_cached')}, expected {commit.expect_cache_hit}")


def phases(measured: Measured) -> dict[str, float | None]:
    run = measured.run
    created, started = parse_time(run.get("created_at")), parse_time(run.get("started_at"))
    finished = parse_time(run.get("finished_at"))
    verdict_at = parse_time((run.get("verdict") or {}).get("created_at"))
    running = measured.seen_running_wall

    def span(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else b - a

    return {"upload_s": measured.upload_s, "queued_s": span(created, started),
            "fetch_build_s": span(started, running), "battery_store_s": span(running, finished),
            "to_first_case_s": span(running, measured.first_case_wall),
            "verdict_s": span(finished, verdict_at), "total_s": measured.total_s,
            "after_verdict_s": measured.after_verdict_s, "corun_detail_s": measured.corun_detail_s,
            "corun_phases": measured.corun_phases}


def expected_s(commit: Commit, battery: str, rows: list[Measured]) -> float | None:
    """What `commit` should take, from the rows so far (None: nothing to go by): a run of the same
    battery (the slowest), plus a compile when the commit is expected to build (A's fetch+build).
    A commit expected to hit the build cache is estimated from the same battery's cache hits, else
    from its other runs less their fetch+build: A's total includes its cold build, which once made
    a warm flagged commit look too long for the time left and skipped it."""
    done = [r for r in rows if not r.skipped and r.verdict_wall is not None]
    same_battery = [r.total_s for r in done if r.battery == battery]
    cold_build = [phases(r)["fetch_build_s"] or 0.0 for r in done if not r.run.get("build_cached")]
    if not same_battery and not cold_build:
        return None
    if commit.expect_cache_hit and same_battery:
        warm = [r.total_s for r in done if r.battery == battery and r.run.get("build_cached")]
        return max(warm or [r.total_s - (phases(r)["fetch_build_s"] or 0.0) for r in done if r.battery == battery])
    expected = max(same_battery) if same_battery else 30.0
    if not commit.expect_cache_hit and cold_build and not same_battery:
        expected += max(cold_build)
    elif not commit.expect_cache_hit and cold_build:
        expected = max(expected, max(cold_build) + min(same_battery))
    return expected


def skip_reason(commit: Commit, battery: str, rows: list[Measured], *, left_s: float,
                deadline_s: float) -> str | None:
    """Why `commit` is not submitted with `left_s` of --deadline-s left (None: it is): under 1.2x
    what it should take (expected_s)."""
    expected = expected_s(commit, battery, rows)
    if expected is None or left_s >= 1.2 * expected:
        return None
    return f"{left_s:.0f} s left of --deadline-s {deadline_s:g}, under 1.2x the {expected:.0f} s it should take"


def headline_problems(commits: list[Commit], rows: list[Measured]) -> list[str]:
    """A line for each headline figure not measured, with why: its commit skipped, cut short before
    its verdict, or (a flagged commit) its co-run detail not stored in time. Never silent: each is a
    failure of the benchmark."""
    by_sha = {row.commit.sha: row for row in rows}
    problems = []
    for commit in commits:
        if commit.headline is None:
            continue
        row = by_sha.get(commit.sha)
        if row is None:
            why = "not submitted (a commit before it stopped the run)"
        elif row.skipped:
            why = f"skipped, {row.skipped}"
        elif row.verdict_wall is None:
            why = "no verdict: " + "; ".join(row.problems or ["the run did not finish"])
        elif commit.expect_outcome == "changed" and row.corun_detail_s is None:
            why = "no co-run detail stored within the run's timeout after its verdict"
        else:
            continue
        problems.append(f"HEADLINE NOT MEASURED: {commit.sha} ({commit.headline}): {why}")
    return problems


def fmt(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:.2f}"


def report(rows: list[Measured], *, device: str, cold_reference: Measured | None) -> str:
    head = ("commit", "battery", "verdict", "changed cases", "first step", "build", "total s",
            "upload", "queued", "fetch+build", "battery+store", "(1st case)", "verdict", "after verdict",
            "check")
    table = [head]
    for row in rows:
        if row.skipped:
            table.append((row.commit.sha, "-", "skipped", *["-"] * 11, row.skipped))
            continue
        run, verdict = row.run, row.run.get("verdict") or {}
        build = ("no build" if run.get("build_cached") is None else
                 "cache hit" if run.get("build_cached") else
                 "cold (empty cache)" if row is cold_reference else "compiled (new digest)")
        p = phases(row)
        table.append((row.commit.sha, row.battery, verdict.get("outcome", run.get("status", "-")),
                      str(verdict.get("changed_cases", "-")), str(verdict.get("first_divergent_step") or "-"),
                      build, fmt(p["total_s"]), fmt(p["upload_s"]), fmt(p["queued_s"]), fmt(p["fetch_build_s"]),
                      fmt(p["battery_store_s"]), fmt(p["to_first_case_s"]), fmt(p["verdict_s"]),
                      row.after_verdict_note or fmt(p["after_verdict_s"]),
                      "ok" if not row.problems else "FAIL: " + "; ".join(row.problems)))
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    lines = [f"submit-to-verdict on the embedded default (SQLite + filesystem broker), {device}; seconds"]
    for index, row in enumerate(table):
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        if index == 0:
            lines.append("  ".join("-" * width for width in widths))
    lines += [
        "total s: the client's clock from submit (packing the tree) until GET /runs/{id} returns the "
        "verdict; it includes upload, database, broker, queueing, source fetch, the build or its "
        "cache hit, the kernel host's start, the battery, storing every trajectory and the verdict.",
        "upload: pack + POST (run created and sent to the broker). queued: run created -> claimed by "
        "the worker (the filesystem broker polls about once a second). fetch+build: claimed -> "
        "status `running` as polled (source fetch, build or cache hit, battery expansion). "
        "battery+store: -> run finished (kernel host start, every case, each trajectory stored); "
        "(1st case): the part of it until the first case was stored (kernel host start + first group). "
        "verdict: finished -> verdict stored. after verdict: the worker's co-run of the baseline "
        "for the changed cases (per-step |commit - baseline|), finished before it takes the next "
        "run; not in total s. B-build only warms the build cache for B (quick battery, own project).",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:  # noqa: C901, PLR0915
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--battery", default="quick", help="quick (CPU) or standard (GPU)")
    parser.add_argument("--gpus", nargs="?", const="all", default=None,
                        help="GPU worker(s): `optdrift worker --gpus SPEC` (default all); without it a CPU worker")
    parser.add_argument("--home", type=Path, default=None,
                        help="OPTDRIFT_HOME, must be absent or empty (default: a fresh temporary folder)")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="service.log, worker.log and e2e.json go here (default: the home)")
    parser.add_argument("--port", type=int, default=0, help="API port (default: a free one)")
    parser.add_argument("--poll-s", type=float, default=0.1)
    parser.add_argument("--run-timeout-s", type=float, default=900.0, help="per commit")
    parser.add_argument("--idle-timeout-s", type=float, default=300.0,
                        help="how long to wait for the worker to finish a run's post-verdict work")
    parser.add_argument("--deadline-s", type=float, default=0.0,
                        help="overall budget; a commit is skipped when the time left is under 1.5x "
                             "the slowest run so far (0: no budget)")
    parser.add_argument("--keep-home", action="store_true", help="leave the temporary home behind")
    args = parser.parse_args(argv)
    begun = time.monotonic()
    # `timeout` sends SIGTERM: turn it into an exception so that `finally` stops the service and
    # the worker (their own sessions would outlive us) and the rows so far are printed.
    signal.signal(signal.SIGTERM, _interrupted)

    home = args.home or Path(tempfile.mkdtemp(prefix="optdrift-e2e-"))
    if home.exists() and any(home.iterdir()):
        print(f"--home {home} is not empty: the measurement needs a fresh OPTDRIFT_HOME", file=sys.stderr)
        return 2
    home.mkdir(parents=True, exist_ok=True)
    log_dir = args.log_dir or home
    log_dir.mkdir(parents=True, exist_ok=True)
    service_log, worker_log = log_dir / "service.log", log_dir / "worker.log"
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    env = child_environment(home, url)
    python = sys.executable
    server = worker = None
    rows: list[Measured] = []
    commits: list[Commit] = []  # made once the trees are
    device, setup_error = "-", None
    try:
        environment = gpu_environment(args.gpus) if args.gpus else "cpu"
        device = f"GPU worker(s) --gpus {args.gpus}, queue {environment}" if args.gpus else "CPU worker, queue cpu"
        print(f"OPTDRIFT_HOME={home}  API {url}  {device}  battery {args.battery}  logs in {log_dir}",
              flush=True)
        print(f"compiler cache for builds: {ccache_in_use()}", flush=True)
        server = start([python, "-m", "service.cli", "serve", "--no-worker", "--host", "127.0.0.1",
                        "--port", str(port)], env=env, log_path=service_log)
        ready_s = wait_ready(url, server, service_log, timeout_s=180)
        worker_argv = [python, "-m", "service.cli", "worker", "--loglevel", "INFO"]
        worker_argv += ["--gpus", args.gpus] if args.gpus else []
        worker = start(worker_argv, env=env, log_path=worker_log)

        admin = OptdriftClient(url, token=(home / "admin-token").read_text().strip())
        admin.ensure_project(PROJECT, environments=[environment], default_battery=args.battery)
        admin.ensure_project(WARMUP_PROJECT, environments=[environment], default_battery="quick")
        token = subprocess.run([python, "-m", "service.cli", "token", "create", "--name", "e2e-ci",
                                "--scope", "submit", "--project", PROJECT], env=env, cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=120)
        if token.returncode != 0 or not token.stdout.strip():
            raise SetupError(f"`optdrift token create` failed ({token.returncode}): {token.stderr}")
        # CI's submit token for the measured project; the build warm-up goes in with the admin's.
        clients = {PROJECT: OptdriftClient(url, token=token.stdout.strip().splitlines()[-1]),
                   WARMUP_PROJECT: admin}
        worker_s = wait_worker(home, environment, worker, worker_log, timeout_s=180)
        print(f"API ready in {ready_s:.1f} s; worker consuming {environment} "
              f"{worker_s:.1f} s after the project and token were made", flush=True)

        with tempfile.TemporaryDirectory(prefix="optdrift-e2e-trees-") as tmp:
            trees = make_trees(Path(tmp))
            commits = [
                Commit("A-base", [], trees["A"], "bundled kernels", "no-baseline", False,
                       nonfinite_broken_ok=True),
                Commit("C-comment-only", ["A-base"], trees["C"], "A + a comment-only NOTES.md",
                       "unchanged", True),
                Commit("B-build", [], trees["B"], "warm the build cache with B's digest",
                       "no-baseline", False, project=WARMUP_PROJECT, battery="quick"),
                Commit("B-decay-after-update", ["A-base"], trees["B"],
                       "weight decay after the update (worker/mutations.py)", "changed", True, 1,
                       headline="a flagged commit's warm submit-to-verdict and its co-run detail"),
            ]
            for index, commit in enumerate(commits):
                elapsed = time.monotonic() - begun
                battery = commit.battery or args.battery
                run_timeout = args.run_timeout_s
                if args.deadline_s:
                    left = args.deadline_s - elapsed
                    skipped = skip_reason(commit, battery, rows, left_s=left, deadline_s=args.deadline_s)
                    if skipped is not None:
                        rows.append(Measured(commit=commit, battery=battery, skipped=skipped))
                        print(f"[{elapsed:6.1f}s] {commit.sha}: skipped ({skipped})", flush=True)
                        for line in headline_problems([commit], rows[-1:]):
                            print(f"[{elapsed:6.1f}s] {line}", flush=True)
                        continue
                    run_timeout = max(1.0, min(run_timeout, left))
                print(f"[{elapsed:6.1f}s] submitting {commit.sha} ({commit.what}; battery {battery})",
                      flush=True)
                row = measure(clients[commit.project], commit, battery=battery, poll_s=args.poll_s,
                              timeout_s=run_timeout)
                row.battery = battery
                check(row)
                rows.append(row)
                verdict = row.run.get("verdict") or {}
                print(f"[{time.monotonic() - begun:6.1f}s] {commit.sha}: {verdict.get('outcome')} "
                      f"in {fmt(row.total_s)} s (build cached {row.run.get('build_cached')}); "
                      f"{'ok' if not row.problems else 'FAIL: ' + '; '.join(row.problems)}", flush=True)
                if row.verdict_wall is None:
                    break  # no verdict: the rest would only queue behind it
                # The task goes on after the verdict (the baseline co-run of a flagged run); the next
                # commit must not queue behind it. After the last one, wait only while time allows.
                idle_timeout = args.idle_timeout_s
                if index == len(commits) - 1 and args.deadline_s:
                    idle_timeout = max(0.0, min(idle_timeout, args.deadline_s - (time.monotonic() - begun) - 30))
                submitted = sum(1 for r in rows if not r.skipped)
                idle = wait_idle(worker_log, submitted, idle_timeout)
                row.after_verdict_s = idle
                if row.corun_detail_s is not None:
                    print(f"[{time.monotonic() - begun:6.1f}s] {commit.sha}: co-run detail stored "
                          f"{row.corun_detail_s:.2f} s after submit, "
                          f"{row.corun_detail_s - row.total_s:.2f} s after the verdict", flush=True)
                    if row.corun_phases:  # where the worker says the co-run's time went
                        print("    co-run phases (s): " + ", ".join(
                            f"{name} {value:.2f}" for name, value in row.corun_phases.items()
                            if isinstance(value, (int, float))), flush=True)
                row.after_verdict_note = None if idle is not None else f">{idle_timeout:.0f} (not waited for)"
                print(f"[{time.monotonic() - begun:6.1f}s] {commit.sha}: worker idle "
                      f"{fmt(idle) if idle is not None else row.after_verdict_note} s after the verdict",
                      flush=True)
    except (RuntimeError, ValueError, OSError, httpx.HTTPError, Interrupted, KeyboardInterrupt) as exc:
        # SetupError and the client's ApiError are RuntimeErrors
        setup_error = f"{type(exc).__name__}: {exc}"
    finally:
        # Every verdict is stored by now; a worker still co-running a baseline (or a run cut short by
        # an interruption) gets a short warm shutdown, then its process group is killed.
        interrupted = setup_error is not None and setup_error.startswith(("Interrupted", "KeyboardInterrupt"))
        stop(worker, timeout_s=5.0 if interrupted else 20.0)
        stop(server, timeout_s=5.0 if interrupted else 20.0)
        kill_leftovers(home)
    if setup_error is not None:
        print(f"\ncould not run the service to the end: {setup_error}\nlogs: {service_log}, {worker_log}",
              file=sys.stderr)
        if rows:
            print(report(rows, device=device, cold_reference=rows[0]))
        for line in headline_problems(commits, rows):
            print(line, file=sys.stderr)
        return 2

    text = report(rows, device=device, cold_reference=rows[0] if rows else None)
    print("\n" + text)
    (log_dir / "e2e.json").write_text(json.dumps(
        {"battery": args.battery, "device": device, "home": str(home),
         "rows": [{"commit": r.commit.sha, "project": r.commit.project, "battery": r.battery,
                   "skipped": r.skipped, "problems": r.problems,
                   "phases": None if r.skipped else phases(r),
                   "run": {k: r.run.get(k) for k in ("id", "status", "build_cached", "build_digest",
                                                     "created_at", "started_at", "finished_at",
                                                     "environment", "progress", "error")},
                   "verdict": {k: (r.run.get("verdict") or {}).get(k) for k in
                               ("outcome", "flagged", "changed_cases", "first_divergent_step",
                                "summary", "created_at")}}
                  for r in rows]}, indent=2))
    digests = {r.commit.sha: r.run.get("build_digest") for r in rows if not r.skipped}
    problems = [f"{r.commit.sha}: {p}" for r in rows for p in r.problems]
    problems += [f"{r.commit.sha}: skipped, {r.skipped}" for r in rows if r.skipped]
    for commit, same_as in (("C-comment-only", "A-base"), ("B-decay-after-update", "B-build")):
        if commit in digests and digests[commit] != digests.get(same_as):
            problems.append(f"{commit}'s build digest {digests[commit]} is not {same_as}'s "
                            f"{digests.get(same_as)}")
    if [r.commit.sha for r in rows if not r.skipped] != [c.sha for c in commits]:
        problems.append("not every commit ran")
    problems += headline_problems(commits, rows)
    if not args.keep_home and args.home is None and args.log_dir is not None:
        import shutil

        shutil.rmtree(home, ignore_errors=True)
    if problems:
        print("\nFAILED:\n  " + "\n  ".join(problems))
        return 1
    print("\nall checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
