"""Bounded load test with locust (as a library, headless): CI submissions and dashboard/API reads
against a real `optdrift serve --no-worker` on PostgreSQL (a fresh database) and Redis (db 11), on
loopback. Afterwards every accepted submission is checked in the database: nothing lost.

    .venv/bin/python bench/load_test.py --users 16 --seconds 30

Prints a table per request kind (requests, failures, rps, p50, p95) and the loss check.
"""

from __future__ import annotations

import locust  # noqa: F401  (first: it monkey-patches the standard library for gevent)

import argparse  # noqa: E402
import itertools  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import gevent  # noqa: E402
from locust import FastHttpUser, constant, task  # noqa: E402
from locust.env import Environment  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_api import bench_api  # noqa: E402  (bench/, this script's folder)
from tests.service_fixtures import make_archive  # noqa: E402

REDIS = "redis://127.0.0.1:6379/11"
SHAS = itertools.count()
ACCEPTED: list[str] = []
ARCHIVES = [make_archive({"ops.cpp": f"// commit {i}\n", "cpu/a.cpp": "int a;\n" * 200}) for i in range(64)]


class CiSubmitter(FastHttpUser):
    weight = 1
    wait_time = constant(0)
    token = ""

    @task
    def submit(self) -> None:
        number = next(SHAS)
        sha = f"{number:040x}"
        with self.client.post("/api/v1/projects/bench/commits", name="POST commits",
                              data={"sha": sha},
                              files={"archive": ("s.tar.gz", ARCHIVES[number % len(ARCHIVES)],
                                                 "application/gzip")},
                              headers={"Authorization": f"Bearer {self.token}"},
                              catch_response=True) as response:
            if response.status_code in (200, 201):
                ACCEPTED.append(sha)
                response.success()
            else:
                response.failure(f"{response.status_code}: {response.text[:200]}")


class DashboardReader(FastHttpUser):
    weight = 3
    wait_time = constant(0)

    @task(2)
    def overview(self) -> None:
        self.client.get("/", name="GET / (dashboard)")

    @task(2)
    def project_page(self) -> None:
        self.client.get("/projects/bench", name="GET /projects/bench (dashboard)")

    @task(3)
    def commits(self) -> None:
        self.client.get("/api/v1/projects/bench/commits?limit=50", name="GET commits (API)")

    @task(1)
    def verdicts(self) -> None:
        self.client.get("/api/v1/projects/bench/verdicts", name="GET verdicts (API)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=30)
    args = parser.parse_args()

    with bench_api(REDIS, "optdrift_load") as api:
        CiSubmitter.token = api.admin_token
        environment = Environment(user_classes=[CiSubmitter, DashboardReader], host=api.url)
        runner = environment.create_local_runner()
        runner.start(args.users, spawn_rate=args.users)
        gevent.sleep(args.seconds)
        runner.quit()
        stats = environment.stats
        stored = _stored_shas(api.database_url)

    print(f"\n{args.users} users, {args.seconds:g} s, loopback, PostgreSQL + Redis\n")
    print("| request | requests | failures | req/s | p50 ms | p95 ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for entry in sorted(stats.entries.values(), key=lambda e: e.name):
        print(f"| {entry.name} | {entry.num_requests} | {entry.num_failures} | "
              f"{entry.total_rps:.1f} | {entry.get_response_time_percentile(0.5):.0f} | "
              f"{entry.get_response_time_percentile(0.95):.0f} |")
    total = stats.total
    print(f"| **all** | {total.num_requests} | {total.num_failures} | {total.total_rps:.1f} | "
          f"{total.get_response_time_percentile(0.5):.0f} | {total.get_response_time_percentile(0.95):.0f} |")
    lost = sorted(set(ACCEPTED) - stored)
    print(f"\naccepted submissions: {len(ACCEPTED)}; in the database with a dispatched run: "
          f"{len(set(ACCEPTED) & stored)}; lost: {len(lost)}")
    if lost or total.num_failures:
        sys.exit(1)


def _stored_shas(database_url: str) -> set[str]:
    import psycopg

    with psycopg.connect(database_url.replace("+psycopg", "")) as conn:
        return {row[0] for row in conn.execute(
            "SELECT c.sha FROM commits c JOIN runs r ON r.commit_id = c.id "
            "WHERE r.dispatched_at IS NOT NULL")}


if __name__ == "__main__":
    main()
