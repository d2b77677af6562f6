"""Submissions per second the API sustains on loopback against PostgreSQL (a bounded run).

Starts `optdrift serve --no-worker` on a fresh PostgreSQL database and Redis db 12, then posts
distinct commits (each a small real tar.gz) from N concurrent client threads for a fixed number of
requests, and prints a table: requests, errors, wall time, submissions/s, p50/p95 latency.
No worker runs, so this measures the API path (upload, validate, store, rows, commit, enqueue).
Then the same threads read runs back for --read-seconds (`GET /api/v1/runs/{id}`, what
`optdrift submit --wait` polls, with the verdict when there is one) and print reads/s.

    .venv/bin/python bench/submit_load.py --requests 400 --concurrency 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_api import bench_api  # noqa: E402  (bench/, this script's folder)
from tests.service_fixtures import make_archive  # noqa: E402

REDIS = "redis://127.0.0.1:6379/12"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--read-seconds", type=float, default=10.0)
    args = parser.parse_args()
    run_ids: list[int] = []

    with bench_api(REDIS, "optdrift_bench") as api:
        archives = [make_archive({"ops.cpp": f"// commit {i}\n", "cpu/a.cpp": "int a;\n" * 200})
                    for i in range(args.requests)]
        latencies: list[float] = []
        errors = 0

        def submit(i: int, client: httpx.Client) -> tuple[float, int]:
            started = time.perf_counter()
            response = client.post("/api/v1/projects/bench/commits",
                                   data={"sha": f"{i:040x}", "parents": f"{i - 1:040x}" if i else ""},
                                   files={"archive": ("s.tar.gz", archives[i], "application/gzip")})
            if response.status_code == 201:
                run_ids.extend(run["id"] for run in response.json()["runs"])
            return time.perf_counter() - started, response.status_code

        def read_for(seconds: float, client: httpx.Client, offset: int) -> list[tuple[float, int]]:
            answers, stop = [], time.perf_counter() + seconds
            while (now := time.perf_counter()) < stop:
                response = client.get(f"/api/v1/runs/{run_ids[(offset + len(answers)) % len(run_ids)]}")
                answers.append((time.perf_counter() - now, response.status_code))
            return answers

        clients = [httpx.Client(base_url=api.url, timeout=60, headers=api.headers)
                   for _ in range(args.concurrency)]
        started = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            for latency, status in pool.map(lambda i: submit(i, clients[i % args.concurrency]),
                                            range(args.requests)):
                latencies.append(latency)
                errors += status != 201
        wall = time.perf_counter() - started
        with ThreadPoolExecutor(args.concurrency) as pool:
            reads = [answer for answers in pool.map(lambda k: read_for(args.read_seconds, clients[k], 97 * k),
                                                    range(args.concurrency)) for answer in answers]
    latencies.sort()
    read_latencies = sorted(latency for latency, _ in reads)
    print("| requests | concurrency | errors | wall s | submissions/s | p50 ms | p95 ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {args.requests} | {args.concurrency} | {errors} | {wall:.2f} | {args.requests / wall:.1f} "
          f"| {1000 * statistics.median(latencies):.1f} | {1000 * latencies[int(0.95 * len(latencies)) - 1]:.1f} |")
    print()
    print("| reads | concurrency | errors | seconds | reads/s | p50 ms | p95 ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {len(reads)} | {args.concurrency} | {sum(status != 200 for _, status in reads)} | {args.read_seconds:g} "
          f"| {len(reads) / args.read_seconds:.1f} | {1000 * statistics.median(read_latencies):.1f} "
          f"| {1000 * read_latencies[int(0.95 * len(read_latencies)) - 1]:.1f} |")


if __name__ == "__main__":
    main()
