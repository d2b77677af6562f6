"""Drain time of a queue with one worker vs several (issue 19): the same commits, the same warm
builds, one configuration after the other in one call.

Per configuration: a fresh embedded-default home (SQLite, the folder broker), `optdrift serve
--no-worker`, the workers, one base commit to warm the build (not timed), one warm commit alone
(its submit -> verdict is `warm_commit_s`), then N commits with the base's tree under new shas
submitted at once; the drain is first submit -> last verdict.
Afterwards the runs' rows say who took each and how often (every run must be taken once).
Kernel timing is off (OPTDRIFT_SPEED_BUDGET_S=0): it runs after verdicts and is not drain work.

    # the H200 pair (bench/gpu/h200x2_scale.sh): one GPU worker, then one per GPU; at most 20
    # commits, fewer when 20 would not fit in the 490 s given (decided after the first base)
    python3 bench/scale_drain.py --battery standard --commits 20 --budget-s 490 --config gpus=0 --config gpus=all
    # this machine: one CPU worker, then two
    .venv/bin/python bench/scale_drain.py --battery quick --commits 4 --config cpu=1 --config cpu=2
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_latency import (  # noqa: E402
    REPO_ROOT, Interrupted, _interrupted, child_environment, free_port, start, stop_service, wait_ready,
)

sys.path.insert(0, str(REPO_ROOT))
from service.cli.client import OptdriftClient  # noqa: E402


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


def worker_count(config: str) -> int:
    """How many Celery workers a configuration runs (`gpus=`: as many as GPUs it selects)."""
    kind, _, value = config.partition("=")
    if kind == "cpu":
        return int(value)
    from worker.gpu_workers import list_gpus, plan_workers  # nvidia-smi only, no CUDA

    return len(plan_workers(list_gpus(), value))


def commits_that_fit(*, most: int, left_s: float, configs: list[str], per_commit_s: float,
                     setup_s: float) -> int:
    """The most commits (at most `most`) every configuration can drain in `left_s`: configuration i
    drains N commits in about N * per_commit_s / workers_i, and each configuration after the first
    costs setup_s (stop, start, its warm base). Rounded down to a multiple of the largest worker
    count, so that every worker gets as many runs (an odd N on two workers would add half a run);
    at least that count."""
    counts = [worker_count(config) for config in configs]
    per_round = per_commit_s * sum(1 / count for count in counts)
    fit = math.floor((left_s - setup_s * (len(configs) - 1)) / per_round)
    step = max(counts)
    return max(step, min(most, fit) // step * step)


def drain(config: str, *, battery: str, commits_to_drain: Callable[[float], int], build_cache: Path,
          logs: Path) -> dict:
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
        # One warm commit alone: what a commit costs this worker pool when nothing waits.
        submitted = time.monotonic()
        single = client.submit_commit(project="drain", sha="warm", parents=["base"], source_dir=tree,
                                      battery=battery)["runs"][0]["id"]
        client.wait([single], timeout_s=900, poll_s=0.2)
        warm_commit_s = time.monotonic() - submitted
        commits = commits_to_drain(warm_commit_s)  # with --budget-s: decided by the first configuration
        started = time.monotonic()
        ids, parent = [], "warm"
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
        stop_service([*workers, api], home, cut_short=interrupted)
    with sqlite3.connect(home / "optdrift.db") as db:
        rows = db.execute(f"SELECT id, attempt, worker FROM runs WHERE id IN ({','.join(map(str, ids))})").fetchall()
    per_worker: dict[str, int] = {}
    for _, _, worker in rows:
        per_worker[worker] = per_worker.get(worker, 0) + 1
    return {"config": config, "commits": commits, "drain_s": drained, "warm_commit_s": warm_commit_s, "warm_run_verdict": warm["verdict"]["outcome"],
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
    parser.add_argument("--budget-s", type=float, default=0.0,
                        help="seconds this whole command may take: drain the most commits, at most --commits, "
                             "that fit in what is left once the first configuration's base is in (0: --commits)")
    parser.add_argument("--per-commit-s", type=float, default=None,
                        help="with --budget-s: one worker's seconds per commit in a drain (default: the first "
                             "configuration's warm commit, measured, x 1.15 + 0.5 s for the broker's poll)")
    parser.add_argument("--setup-s", type=float, default=40.0,
                        help="with --budget-s: each later configuration's stop, start, warm base and warm commit")
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget_s
    chosen: list[int] = []

    def commits_to_drain(warm_commit_s: float) -> int:
        if not chosen:
            if not args.budget_s:
                chosen.append(args.commits)
            else:
                left = deadline - time.monotonic()
                # A lone commit is one worker's cost per run; in a drain the runs follow each other:
                # a margin over it, and the filesystem broker's poll between runs.
                per_commit = args.per_commit_s or warm_commit_s * 1.15 + 0.5
                chosen.append(commits_that_fit(most=args.commits, left_s=left, configs=args.config,
                                               per_commit_s=per_commit, setup_s=args.setup_s))
                print(json.dumps({"plan": {"commits": chosen[0], "asked": args.commits, "left_s": round(left, 1),
                                           "warm_commit_s": round(warm_commit_s, 2),
                                           "per_commit_s": round(per_commit, 2), "setup_s": args.setup_s}}),
                      flush=True)
        return chosen[0]

    # `timeout` sends SIGTERM: stop this configuration's service and workers (their own sessions
    # would outlive us) and keep the lines already printed.
    signal.signal(signal.SIGTERM, _interrupted)
    results = []
    for index, config in enumerate(args.config):
        try:
            result = drain(config, battery=args.battery, commits_to_drain=commits_to_drain,
                           build_cache=args.build_cache, logs=args.logs / f"{index}-{config.replace('=', '-')}")
        except (Interrupted, KeyboardInterrupt):
            print(json.dumps({"config": config, "commits": chosen[0] if chosen else None, "cut_short": True}),
                  flush=True)
            return 2
        results.append(result)
        print(json.dumps(result), flush=True)
    first = results[0]["drain_s"]
    print("\n| configuration | commits | drain s | vs first | one warm commit s | verdicts | attempts | runs per worker |")
    print("|---|---:|---:|---:|---:|---|---|---|")
    for r in results:
        print(f"| {r['config']} | {r['commits']} | {r['drain_s']:.2f} | {r['drain_s'] / first:.2f} | "
              f"{r['warm_commit_s']:.2f} | {', '.join(r['verdicts'])} | {r['attempts']} | "
              f"{sorted(r['runs_per_worker'].values())} |")
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=1))
    once = all(r["attempts"] == [1] for r in results)
    print(f"\nevery run taken once: {once}")
    return 0 if once else 1


if __name__ == "__main__":
    sys.exit(main())
