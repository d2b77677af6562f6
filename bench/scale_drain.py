"""Drain time of a queue with one worker vs several (issue 19): the same commits, the same warm
builds, one configuration after the other in one call.

Per configuration: a fresh embedded-default home (SQLite, the folder broker), `optdrift serve
--no-worker`, the workers, one base commit to warm the build (not timed), then N commits with
the base's tree under new shas submitted at once; the drain is first submit -> last verdict.
Afterwards the runs' rows say who took each and how often (every run must be taken once).
Kernel timing is off (OPTDRIFT_SPEED_BUDGET_S=0): it runs after verdicts and is not drain work.

    # the H200 pair (bench/gpu/h200x2_scale.sh): one GPU worker, then one per GPU
    python3 bench/scale_drain.py --battery standard --commits 6 --config gpus=0 --config gpus=all
    # this machine: one CPU worker, then two
    .venv/bin/python bench/scale_drain.py --battery quick --commits 4 --config cpu=1 --config cpu=2
"""

from __future__ import annotations

import argparse
import json
import signal
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_latency import (  # noqa: E402
    REPO_ROOT, Interrupted, _interrupted, child_environment, free_port, kill_leftovers, start, stop, wait_ready,
)

sys.path.insert(0, str(REPO_ROOT))
from service.client import OptdriftClient  # noqa: E402


def start_workers(config: str, env: dict[str, str], logs: Path) -> list:
    """`gpus=SPEC`: one `optdrift worker --gpus SPEC` (its supervisor starts one Celery worker per GPU);
    `cpu=N`: N `optdrift worker --name wI` processes. Each in its own process group (e2e_latency.start)."""
    kind, _, value = config.partition("=")
    command = [sys.executable, "-m", "service.cli", "worker"]
    if kind == "gpus":
        return [start([*command, "--gpus", value], env=env, log_path=logs / "workers.log")]
    if kind == "cpu":
        return [start([*command, "--name", f"w{i}"], env=env, log_path=logs / f"worker{i}.log")
                for i in range(int(value))]
    raise SystemExit(f"--config {config!r}: use gpus=0|all|0,1 or cpu=N")


def drain(config: str, *, battery: str, commits: int, build_cache: Path, logs: Path) -> dict:
    home = Path(tempfile.mkdtemp(prefix="optdrift-drain-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**child_environment(home, url), "OPTDRIFT_BUILD_CACHE_DIR": str(build_cache),
           "OPTDRIFT_SPEED_BUDGET_S": "0", "OPTDRIFT_MAINTENANCE_INTERVAL_S": "2"}
    logs.mkdir(parents=True, exist_ok=True)
    api = start([sys.executable, "-m", "service.cli", "serve", "--port", str(port), "--no-worker"],
                env=env, log_path=logs / "api.log")
    workers, interrupted = [], False
    try:
        wait_ready(url, api, logs / "api.log", 120)
        workers = start_workers(config, env, logs)
        client = OptdriftClient(url, token=(home / "admin-token").read_text().strip())
        client.ensure_project("drain")
        tree = REPO_ROOT / "csrc"
        base = client.submit_commit(project="drain", sha="base", source_dir=tree, battery=battery)["runs"][0]["id"]
        warm = client.wait([base], timeout_s=900)[0]
        started = time.monotonic()
        ids, parent = [], "base"
        for index in range(commits):
            sha = f"c{index}"
            ids.append(client.submit_commit(project="drain", sha=sha, parents=[parent], source_dir=tree,
                                            battery=battery)["runs"][0]["id"])
            parent = sha
        done = client.wait(ids, timeout_s=1800, poll_s=0.2)
        drained = time.monotonic() - started
        client.close()
    except (Interrupted, KeyboardInterrupt):
        interrupted = True
        raise
    finally:
        # Cut short (the device script's `timeout`): a short warm shutdown, so that the next part
        # of the call gets the GPUs, and the base's build if it was still compiling (the sandbox
        # gives it its own session; it works in the build cache).
        for process in [*workers, api]:
            stop(process, 5 if interrupted else 30)
        if interrupted:
            kill_leftovers(build_cache)
    with sqlite3.connect(home / "optdrift.db") as db:
        rows = db.execute(f"SELECT id, attempt, worker FROM runs WHERE id IN ({','.join(map(str, ids))})").fetchall()
    per_worker: dict[str, int] = {}
    for _, _, worker in rows:
        per_worker[worker] = per_worker.get(worker, 0) + 1
    return {"config": config, "commits": commits, "drain_s": drained, "warm_run_verdict": warm["verdict"]["outcome"],
            "verdicts": sorted({run["verdict"]["outcome"] for run in done if run["verdict"]}),
            "attempts": sorted({attempt for _, attempt, _ in rows}), "runs_per_worker": per_worker}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", required=True, help="gpus=0|all or cpu=N (repeat)")
    parser.add_argument("--commits", type=int, default=6)
    parser.add_argument("--battery", default="quick")
    parser.add_argument("--build-cache", type=Path, default=Path(tempfile.gettempdir()) / "optdrift-drain-builds")
    parser.add_argument("--logs", type=Path, default=Path("drain-logs"))
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    # `timeout` sends SIGTERM: stop this configuration's service and workers (their own sessions
    # would outlive us) and keep the lines already printed.
    signal.signal(signal.SIGTERM, _interrupted)
    results = []
    for index, config in enumerate(args.config):
        try:
            result = drain(config, battery=args.battery, commits=args.commits, build_cache=args.build_cache,
                           logs=args.logs / f"{index}-{config.replace('=', '-')}")
        except (Interrupted, KeyboardInterrupt):
            print(json.dumps({"config": config, "commits": args.commits, "cut_short": True}), flush=True)
            return 2
        results.append(result)
        print(json.dumps(result), flush=True)
    first = results[0]["drain_s"]
    print("\n| configuration | commits | drain s | vs first | verdicts | attempts | runs per worker |")
    print("|---|---:|---:|---:|---|---|---|")
    for r in results:
        print(f"| {r['config']} | {r['commits']} | {r['drain_s']:.2f} | {r['drain_s'] / first:.2f} | "
              f"{', '.join(r['verdicts'])} | {r['attempts']} | {sorted(r['runs_per_worker'].values())} |")
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=1))
    once = all(r["attempts"] == [1] for r in results)
    print(f"\nevery run taken once: {once}")
    return 0 if once else 1


if __name__ == "__main__":
    sys.exit(main())
