"""`kill -9` of one worker mid-run, with another worker of the same queue alive (issue 19): the
run must finish on the other worker exactly once.

On the embedded default (a fresh OPTDRIFT_HOME: SQLite, the folder broker), like
bench/scale_drain.py: `optdrift serve --no-worker`, then the workers (`gpus=all`: one
`optdrift worker --gpus all`, whose supervisor starts one Celery worker per GPU; `cpu=2`: two
`optdrift worker --name wI` processes). Once every worker has written its presence row, a base
commit (not killed; it warms the build) and then the victim commit (the same tree, parent base)
are submitted. When the victim's run is `running` with at least --kill-at-cases cases stored, the
worker holding it is killed with SIGKILL, and the run is followed until its verdict.

Which process is killed. The run's `worker` column is `<hostname>:<native thread id>` of the
thread executing the task (worker/tasks.py). In Celery's prefork pool that is the main thread of
the pool child, so the number is the pool child's pid. From it the bench walks up the parents
(/proc/<pid>/stat) to the process it started: with `cpu=N` that is the `optdrift worker --name wI`
process, which is the Celery main process itself (`optdrift worker` runs Celery in-process); with
`gpus=...` it is the supervisor, and the Celery worker of that GPU is the process just below it on
the way up (its CUDA_VISIBLE_DEVICES, read from /proc/<pid>/environ, names the GPU). That Celery
main process and everything under it (the pool child, the kernel host, a sandbox around it) are
stopped with SIGSTOP, top down until no new process appears, then all sent SIGKILL: the worker
dies as a machine or the OOM killer would take it, with no warm shutdown, no message given back
and no last heartbeat. Killing only the Celery main process takes the rest down too (Celery's
prefork pool sets PR_SET_PDEATHSIG=SIGKILL in its children, celery/concurrency/prefork.py, and the
sandbox runs bwrap --die-with-parent; checked once on this machine by a copy of this bench that
killed the Celery main process alone: re-queued 4.2 s after the kill, finished by the other worker
on attempt 2); killing the whole tree makes the bench depend on neither. The supervisor is left
alone: it restarts the killed GPU's worker after worker.gpu_workers.RESTART_PAUSE_S (5 s) plus its
start, so with `gpus=` the run could be taken by that restarted worker; the recovery below
(re-queued 3-4.5 s after the kill, and the other worker is already polling) is meant to
be quicker, and the result says which worker finished it (a check).

How the run comes back. The filesystem broker deleted the task's message when the killed worker
fetched it (kombu's filesystem transport; with Redis it would sit unacked until
visibility_timeout_s, 6 h by default, and its late delivery is refused by the claim, which only
takes a `queued` run). The API's maintenance loop sees the run's heartbeat older than
OPTDRIFT_STALE_AFTER_S, puts it back to `queued` (attempt stays 1, error says why) and sends it
again in the same pass; a live worker claims it (attempt 2) and runs the battery from the start,
storing each case over the row the first attempt may have written (one row per (run, case)).

Recovery settings, set explicitly for the API and the workers (the environment overrides them):

    OPTDRIFT_HEARTBEAT_INTERVAL_S    1    the running run's heartbeat      (production default 10)
    OPTDRIFT_STALE_AFTER_S           4    heartbeat age that counts dead   (production default 180)
    OPTDRIFT_MAINTENANCE_INTERVAL_S  0.5  the reaper's and dispatcher's pass (production default 15)
    OPTDRIFT_MAX_ATTEMPTS            3    attempts before `failed`          (production default 3)

so here a dead worker's run is re-queued 4-4.5 s after its last heartbeat (3-4.5 s after the
kill); with the production defaults it is 180-195 s after the last heartbeat (170-195 s after the
kill). Kernel timing is off (OPTDRIFT_SPEED_BUDGET_S=0), as in the drain.

Checks (from the SQLite database after everything stopped, as scale_drain.py reads it): the run
is `done` on attempt 2; it has one verdict; it stored each case once (rows = distinct cases =
cases_total) and no (run, case) has two rows anywhere; the base run was taken once; the worker
that finished it is not the killed one (another process, and another `--name` or GPU). Printed: a
JSON line, then a small table; exit 0 when every check holds, 1 when one fails, 2 when the kill
could not be made (the run ended before it was caught, or a setup step failed).

    # this machine: two CPU workers, the quick battery
    .venv/bin/python bench/scale_kill.py --config cpu=2 --battery quick
    # the H200 pair (bench/gpu/h200x2_scale.sh, after the drain): one Celery worker per GPU
    python3 bench/scale_kill.py --config gpus=all --battery standard
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_latency import (  # noqa: E402
    REPO_ROOT, Interrupted, SetupError, _interrupted, child_environment, free_port, start, stop_service,
    wait_ready,
)
from scale_drain import start_workers, worker_count  # noqa: E402

sys.path.insert(0, str(REPO_ROOT))
from service.cli.client import FINAL, OptdriftClient  # noqa: E402

RECOVERY_SETTINGS = {  # name -> the bench's value; production defaults in service/settings.py
    "OPTDRIFT_HEARTBEAT_INTERVAL_S": "1",
    "OPTDRIFT_STALE_AFTER_S": "4",
    "OPTDRIFT_MAINTENANCE_INTERVAL_S": "0.5",
    "OPTDRIFT_MAX_ATTEMPTS": "3",
}


# ----------------------------------------------------------------------------- processes
def parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name in parentheses may hold spaces: the fields after it are plain.
    return int(stat.rsplit(")", 1)[1].split()[1])


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and parent_of(int(entry.name)) == pid:
            found.append(int(entry.name))
    return found


def celery_process_of(pid: int, started: dict[int, str]) -> tuple[int, str]:
    """(the Celery main process that runs `pid`, the worker's label). `started`: the pids this bench
    started -> their label (`w0`, `w1`, or `gpus=all` for a supervisor)."""
    chain = [pid]
    while chain[-1] not in started:
        parent = parent_of(chain[-1])
        if parent is None or parent <= 1:
            raise SetupError(f"process {pid} is not under a worker this bench started (chain {chain})")
        chain.append(parent)
    top = chain[-1]
    if not started[top].startswith("gpus="):
        return top, started[top]
    if len(chain) < 2:
        raise SetupError(f"process {pid} is the GPU supervisor itself, not one of its workers")
    celery = chain[-2]  # the supervisor's child: the Celery worker of one GPU
    environ = Path(f"/proc/{celery}/environ").read_bytes().split(b"\0")
    gpu = next((v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"CUDA_VISIBLE_DEVICES=")), "?")
    return celery, f"gpu{gpu}"


def kill_tree(root: int) -> list[int]:
    """SIGSTOP `root` and its descendants, top down until no new one appears (a stopped parent
    cannot start another), then SIGKILL them all. Returns the pids."""
    frozen: list[int] = []
    pending = [root]
    while pending:
        pid = pending.pop(0)
        if pid in frozen:
            continue
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            continue
        frozen.append(pid)
        pending.extend(children_of(pid))
    for pid in frozen:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return frozen


def pid_of_worker_column(worker: str) -> int:
    host, _, pid = worker.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        raise SetupError(f"the run's worker {worker!r} is not a process of this host ({socket.gethostname()})")
    return int(pid)


def wait_presence(db_path: Path, count: int, processes: list, timeout_s: float) -> float:
    """Until `count` workers have written their presence row (Celery consumes the queue)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if any(p.poll() is not None for p in processes):
            raise SetupError("a worker exited before it was ready; see its log")
        try:
            with sqlite3.connect(db_path) as db:
                if db.execute("SELECT count(*) FROM worker_presence").fetchone()[0] >= count:
                    return time.monotonic() - started
        except sqlite3.OperationalError:
            pass  # the table is made by the API's migration; a locked database answers next time
        time.sleep(0.25)
    raise SetupError(f"fewer than {count} workers ready after {timeout_s:g} s")


# ----------------------------------------------------------------------------- the kill
def kill_mid_run(client: OptdriftClient, run_id: int, started: dict[int, str], *, kill_at_cases: int,
                 timeout_s: float) -> dict:
    """Wait until the run is `running` with `kill_at_cases` cases stored, kill its worker, follow it
    to its verdict (polling the API); the moments are seconds after the kill."""
    deadline = time.monotonic() + timeout_s
    while True:
        run = client.run(run_id)
        if run["status"] == "running" and run["progress"]["cases_done"] >= kill_at_cases:
            break
        if run["status"] in FINAL:
            raise SetupError(f"run {run_id} ended ({run['status']}) before it was caught running; "
                             "use a longer battery or a lower --kill-at-cases")
        if time.monotonic() > deadline:
            raise SetupError(f"run {run_id} not running after {timeout_s:g} s: {run['status']}")
        time.sleep(0.05)
    worker_pid = pid_of_worker_column(run["worker"])
    celery, label = celery_process_of(worker_pid, started)
    killed_at = time.monotonic()
    killed = kill_tree(celery)
    killed_info = {"label": label, "worker": run["worker"], "celery_pid": celery, "pids": killed,
                   "attempt": run["attempt"], "cases_done": run["progress"]["cases_done"],
                   "cases_total": run["progress"]["cases_total"]}
    print(f"killed {label} (Celery process {celery} and {len(killed) - 1} below it) holding run {run_id} "
          f"at {killed_info['cases_done']}/{killed_info['cases_total']} cases", flush=True)

    moments: dict[str, float] = {}
    finisher: dict = {}
    while True:
        run = client.run(run_id)
        now = time.monotonic() - killed_at
        if run["status"] == "queued" and "requeued" not in moments:
            moments["requeued"] = now
            finisher["requeue_error"] = run["error"]
        if run["attempt"] >= 2 and run["worker"] and "claimed" not in moments:
            moments["claimed"] = now
        if run["attempt"] >= 2 and run["status"] == "running" and "running" not in moments:
            moments["running"] = now
        if run["worker"] and run["attempt"] >= 2 and "label" not in finisher:
            # While the finishing process is alive: who is it?
            try:
                finisher["pid"] = pid_of_worker_column(run["worker"])
                finisher["celery_pid"], finisher["label"] = celery_process_of(finisher["pid"], started)
            except (SetupError, OSError) as exc:
                finisher["label"] = f"unknown ({exc})"
        if run["status"] in FINAL and run["verdict"] is not None:
            moments["verdict"] = now
            break
        if run["status"] in FINAL and run["status"] != "done":
            moments["final"] = now
            break
        if time.monotonic() > deadline:
            raise SetupError(f"run {run_id} without a verdict {now:.0f} s after the kill: {run['status']}")
        time.sleep(0.1)
    finisher["worker"] = run["worker"]
    return {"killed": killed_info, "finished_by": finisher, "moments_after_kill_s": moments,
            "api_run": {k: run.get(k) for k in ("status", "attempt", "worker", "error")},
            "verdict": (run["verdict"] or {}).get("outcome")}


def stored(db_path: Path, run_id: int, base_id: int) -> dict:
    with sqlite3.connect(db_path) as db:
        status, attempt, worker, cases_total = db.execute(
            "SELECT status, attempt, worker, cases_total FROM runs WHERE id = ?", (run_id,)).fetchone()
        rows, distinct = db.execute(
            "SELECT count(*), count(DISTINCT case_id) FROM trajectories WHERE run_id = ?", (run_id,)).fetchone()
        verdicts = db.execute("SELECT count(*) FROM verdicts WHERE run_id = ?", (run_id,)).fetchone()[0]
        duplicates = db.execute("SELECT count(*) FROM (SELECT 1 FROM trajectories GROUP BY run_id, case_id "
                                "HAVING count(*) > 1)").fetchone()[0]
        base_attempt = db.execute("SELECT attempt FROM runs WHERE id = ?", (base_id,)).fetchone()[0]
    return {"status": status, "attempt": attempt, "worker": worker, "cases_total": cases_total,
            "trajectory_rows": rows, "distinct_cases": distinct, "verdicts": verdicts,
            "duplicate_rows_in_db": duplicates, "base_attempt": base_attempt}


def checks(result: dict) -> dict[str, bool]:
    db, killed, finisher = result["stored"], result["killed"], result["finished_by"]
    return {
        "done on attempt 2": db["status"] == "done" and db["attempt"] == 2,
        "one verdict": db["verdicts"] == 1,
        "each case stored once": db["trajectory_rows"] == db["distinct_cases"] == db["cases_total"] > 0,
        "no duplicate rows": db["duplicate_rows_in_db"] == 0,
        "base taken once": db["base_attempt"] == 1,
        "finished by another process": finisher.get("pid") not in killed["pids"] and db["worker"] != killed["worker"],
        "finished by the other worker": finisher.get("label", "unknown").split()[0] not in ("unknown", killed["label"]),
    }


# ----------------------------------------------------------------------------- main
def kill_bench(config: str, *, battery: str, build_cache: Path, logs: Path, kill_at_cases: int,
               timeout_s: float) -> dict:
    home = Path(tempfile.mkdtemp(prefix="optdrift-kill-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    recovery = {name: os.environ.get(name, value) for name, value in RECOVERY_SETTINGS.items()}
    env = {**child_environment(home, url), **recovery, "OPTDRIFT_BUILD_CACHE_DIR": str(build_cache),
           "OPTDRIFT_SPEED_BUDGET_S": "0"}
    logs.mkdir(parents=True, exist_ok=True)
    begun = time.monotonic()
    api = start([sys.executable, "-m", "service.cli", "serve", "--port", str(port), "--no-worker"],
                env=env, log_path=logs / "api.log")
    workers: list = []
    failed = False
    try:
        wait_ready(url, api, logs / "api.log", 180)
        workers = start_workers(config, env, logs)
        ready_s = wait_presence(home / "optdrift.db", worker_count(config), workers, 300)
        labels = [config] if config.startswith("gpus=") else [f"w{i}" for i in range(len(workers))]
        started = {process.pid: label for process, label in zip(workers, labels)}
        client = OptdriftClient(url, token=(home / "admin-token").read_text().strip())
        client.ensure_project("kill")
        tree = REPO_ROOT / "csrc"
        base = client.submit_commit(project="kill", sha="base", source_dir=tree, battery=battery)["runs"][0]["id"]
        base_run = client.wait([base], timeout_s=timeout_s, poll_s=0.2)[0]
        victim = client.submit_commit(project="kill", sha="victim", parents=["base"], source_dir=tree,
                                      battery=battery)["runs"][0]["id"]
        result = kill_mid_run(client, victim, started, kill_at_cases=kill_at_cases, timeout_s=timeout_s)
        client.close()
    except BaseException:
        failed = True
        raise
    finally:
        stop_service([*workers, api], home, cut_short=failed)
    result.update(config=config, battery=battery, run_id=victim, workers_ready_s=ready_s,
                  base_verdict=(base_run["verdict"] or {}).get("outcome"),
                  recovery_settings=recovery, stored=stored(home / "optdrift.db", victim, base),
                  bench_s=time.monotonic() - begun)
    result["checks"] = checks(result)
    result["ok"] = all(result["checks"].values())
    return result


def table(result: dict) -> str:
    m, k, f, db = result["moments_after_kill_s"], result["killed"], result["finished_by"], result["stored"]

    def s(key: str) -> str:
        return f"{m[key]:.2f}" if key in m else "-"

    lines = [
        f"kill -9 of one worker mid-run ({result['config']}, battery {result['battery']}; heartbeat "
        f"{result['recovery_settings']['OPTDRIFT_HEARTBEAT_INTERVAL_S']} s, stale after "
        f"{result['recovery_settings']['OPTDRIFT_STALE_AFTER_S']} s, reaper every "
        f"{result['recovery_settings']['OPTDRIFT_MAINTENANCE_INTERVAL_S']} s)",
        "",
        "| killed | at cases | finished by | attempt | verdicts | rows / distinct / total | "
        "kill -> re-queued s | -> claimed s | -> running s | -> verdict s | verdict |",
        "|---|---:|---|---:|---:|---|---:|---:|---:|---:|---|",
        f"| {k['label']} (pid {k['celery_pid']}) | {k['cases_done']}/{k['cases_total']} | "
        f"{f.get('label', '?')} (pid {f.get('celery_pid', '?')}) | {db['attempt']} | {db['verdicts']} | "
        f"{db['trajectory_rows']} / {db['distinct_cases']} / {db['cases_total']} | {s('requeued')} | "
        f"{s('claimed')} | {s('running')} | {s('verdict')} | {result['verdict']} |",
        "",
    ]
    lines += [f"{'ok  ' if passed else 'FAIL'} {name}" for name, passed in result["checks"].items()]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="cpu=2", help="gpus=all|0,1 or cpu=N (N >= 2)")
    parser.add_argument("--battery", default="quick")
    parser.add_argument("--kill-at-cases", type=int, default=1,
                        help="kill once the run is running with this many cases stored")
    parser.add_argument("--build-cache", type=Path, default=Path(tempfile.gettempdir()) / "optdrift-drain-builds",
                        help="shared with scale_drain.py, so that after the drain the build is a cache hit")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="for the base run, and for the victim")
    parser.add_argument("--logs", type=Path, default=Path("kill-logs"))
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _interrupted)
    try:
        result = kill_bench(args.config, battery=args.battery, build_cache=args.build_cache, logs=args.logs,
                            kill_at_cases=args.kill_at_cases, timeout_s=args.timeout_s)
    except (Interrupted, KeyboardInterrupt) as exc:
        print(json.dumps({"config": args.config, "cut_short": str(exc)}), flush=True)
        return 2
    except (RuntimeError, TimeoutError, OSError, httpx.HTTPError) as exc:  # SetupError, the client's ApiError
        print(json.dumps({"config": args.config, "setup_error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 2
    print(json.dumps(result), flush=True)
    print("\n" + table(result))
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
