"""Dashboard render latency against the seeded benchmark database (bench/seed_dashboard.py).

    .venv/bin/python bench/seed_dashboard.py            # once: 1000 commits x 500 cases
    .venv/bin/python bench/dashboard_latency.py [--database optdrift_bench] [--requests 60]

Starts `optdrift serve --no-worker` (uvicorn, one process) on loopback against that database and
times full HTTP GETs of each page from this process (sequential requests, after warm-up), then
prints p50 / p95 / max per page. Target: overview and commit pages <= 300 ms p95.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from urllib.parse import quote

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.service_fixtures import free_port, start_process, stop_process, wait_http  # noqa: E402

PG_HOST_URL = "postgresql+psycopg://postgres@127.0.0.1:5432"
TARGET_MS = 300.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database", default="optdrift_bench")
    parser.add_argument("--requests", type=int, default=60, help="timed requests per page")
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="optdrift-latency-") as home:
        env = {"OPTDRIFT_HOME": home, "OPTDRIFT_DATABASE_URL": f"{PG_HOST_URL}/{args.database}",
               "OPTDRIFT_BROKER_URL": "redis://127.0.0.1:6379/14", "OPTDRIFT_MAINTENANCE_INTERVAL_S": "0",
               "OPTDRIFT_PUBLIC_URL": base}
        server = start_process(["serve", "--port", str(port), "--no-worker"], env, Path(home) / "serve.log")
        try:
            wait_http(f"{base}/healthz", timeout_s=90)
            with httpx.Client(base_url=base, timeout=60) as client:
                commits = client.get("/api/v1/projects/bench/commits", params={"limit": 500}).json()
                if not commits["count"]:
                    raise SystemExit(f"database {args.database} has no commits: run bench/seed_dashboard.py first")
                shas = {c["sha"]: c for c in commits["data"]}
                flagged = next(sha for sha, c in shas.items() if c["runs"] and c["runs"][0]["verdict"]
                               and c["runs"][0]["verdict"]["outcome"] == "changed")
                unchanged = next(sha for sha, c in shas.items() if c["runs"] and c["runs"][0]["verdict"]
                                 and c["runs"][0]["verdict"]["outcome"] == "unchanged")
                pages = [
                    ("overview (page 1)", "/projects/bench", True),
                    ("overview verdict=changed", "/projects/bench?verdict=changed", True),
                    ("overview ref=feature/x", "/projects/bench?ref=feature/x", True),
                    ("overview page 15", "/projects/bench?page=15", True),
                    ("commit, 60 changed cases", f"/projects/bench/commits/{flagged}", True),
                    ("commit, unchanged", f"/projects/bench/commits/{unchanged}", True),
                    ("plot series (one case)", None, False),
                    ("release drift (20 releases)", "/projects/bench/releases", False),
                ]
                run_id = shas[flagged]["runs"][0]["id"]
                case_id = next(c["case_id"] for c in shas[flagged]["runs"][0]["verdict"]["detail"]["cases"]
                               if c["verdict"] == "changed")
                rows = []
                for label, path, targeted in pages:
                    if path is None:
                        path = f"/dashboard/api/runs/{run_id}/series?case={quote(case_id, safe='')}"
                    count = args.requests if targeted else max(10, args.requests // 4)
                    timings = []
                    for attempt in range(args.warmup + count):
                        began = time.perf_counter()
                        response = client.get(path)
                        elapsed = (time.perf_counter() - began) * 1000.0
                        if response.status_code != 200:
                            raise SystemExit(f"{path}: HTTP {response.status_code}: {response.text[:300]}")
                        if attempt >= args.warmup:
                            timings.append(elapsed)
                    rows.append((label, count, statistics.median(timings), percentile(timings, 0.95),
                                 max(timings), len(response.content), targeted))
        finally:
            stop_process(server)
    print(f"\ndashboard latency, database {args.database}, {os.cpu_count()} CPUs, sequential GETs over loopback")
    print(f"{'page':32} {'n':>4} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8} {'KiB':>7}  target")
    failed = False
    for label, count, p50, p95, worst, size, targeted in rows:
        verdict = ("ok" if p95 <= TARGET_MS else "OVER") if targeted else "-"
        failed |= targeted and p95 > TARGET_MS
        print(f"{label:32} {count:4d} {p50:8.1f} {p95:8.1f} {worst:8.1f} {size / 1024:7.1f}  {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
