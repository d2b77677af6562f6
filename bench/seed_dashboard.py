"""Seed a PostgreSQL database for the dashboard latency benchmark: COMMITS commits x CASES cases.

    .venv/bin/python bench/seed_dashboard.py [--database optdrift_bench] [--commits 1000] [--cases 500] [--steps 20]

Drops and recreates the database (never the test or production one: the name must start with
"optdrift_bench"), migrates it with alembic, then bulk-loads with COPY: one project, a first-parent
chain of commits on `main` (every 7th on a feature ref, a release every 50), one done run per commit
(the newest two still running), CASES trajectories per run (cases from the `standard` battery, with
per-step float64 series and digests), and a verdict per run whose detail lists every case, as the
service stores it (summaries written by service.core.verdicts.summarize). Every 10th commit changes 60
cases (half farther, half closer), every 97th is broken.
"""

from __future__ import annotations

import argparse
import json
import random
import struct
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.core.results import CaseComparison  # noqa: E402
from service.core.verdicts import summarize  # noqa: E402

PG_HOST_URL = "postgresql://postgres@127.0.0.1:5432"
CHANGED_PER_FLAGGED_COMMIT = 60


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database", default="optdrift_bench")
    parser.add_argument("--commits", type=int, default=1000)
    parser.add_argument("--cases", type=int, default=500)
    parser.add_argument("--steps", type=int, default=20, help="stored steps per trajectory")
    args = parser.parse_args()
    if not args.database.startswith("optdrift_bench"):
        parser.error(f"--database {args.database}: the name must start with optdrift_bench (it is dropped first)")
    return args


def recreate(database: str) -> str:
    with psycopg.connect(f"{PG_HOST_URL}/test", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{database}"')
    from service.db.migrate import upgrade_to_head

    url = f"{PG_HOST_URL.replace('postgresql://', 'postgresql+psycopg://')}/{database}"
    upgrade_to_head(url)
    return url


def case_specs(count: int, steps: int) -> list[dict]:
    from worker.battery import load_battery  # pydantic only: no torch

    cases = load_battery("standard").expand()
    chosen = (cases[::2] + cases[1::2])[:count]
    return [{**case.model_dump(mode="json"), "steps": steps} for case in chosen]


def series_blob(rng: random.Random, steps: int) -> tuple[list, bytes]:
    """ref64_max_abs, ref64_max_rel, same_precision_max_abs (growing), nonfinite_count (zeros)."""
    start = 10 ** rng.uniform(-9, -6)
    growth = 1.0 + rng.uniform(0.0, 0.2)
    ref = [start * growth ** i for i in range(steps)]
    rel = [v * 3.0 for v in ref]
    same = [v * 0.5 for v in ref]
    layout = [{"name": n, "dtype": "float64", "length": steps} for n in ("ref64_max_abs", "ref64_max_rel",
                                                                          "same_precision_max_abs")]
    layout.append({"name": "nonfinite_count", "dtype": "int64", "length": steps})
    data = struct.pack(f"<{3 * steps}d", *ref, *rel, *same) + struct.pack(f"<{steps}q", *([0] * steps))
    return layout, data, ref[-1]


def main() -> int:
    args = parse_args()
    started = time.monotonic()
    url = recreate(args.database)
    dsn = f"{PG_HOST_URL}/{args.database}"
    rng = random.Random(0)
    specs = case_specs(args.cases, args.steps)
    blobs = [series_blob(rng, args.steps) for _ in range(64)]
    digest_sets = ["\n".join(f"{rng.getrandbits(128):032x}" for _ in range(args.steps)) for _ in range(8)]
    t0 = datetime(2024, 1, 1, tzinfo=timezone.utc)
    with psycopg.connect(dsn) as conn:
        project_id = conn.execute(
            "INSERT INTO projects (name, build_kind, adapter, default_battery, environments, created_at) "
            "VALUES ('bench', 'torch-extension', 'bundled', 'standard', '[\"gpu.sm90\"]', %s) RETURNING id",
            (t0,)).fetchone()[0]
        with conn.cursor().copy("COPY source_archives (digest, size_bytes, member_count, created_at) FROM STDIN") as copy:
            for index in range(args.commits):
                copy.write_row((f"{index:064x}", 1000, 10, t0))
        with conn.cursor().copy("COPY commits (id, project_id, sha, parents, ref, release_tag, message, "
                                "source_digest, created_at) FROM STDIN") as copy:
            for index in range(args.commits):
                parents = json.dumps([f"{index - 1:040x}"] if index else [])
                ref = "feature/x" if index % 7 == 3 else "main"
                tag = f"v0.{index // 50}.0" if index % 50 == 0 else None
                copy.write_row((index + 1, project_id, f"{index:040x}", parents, ref, tag,
                                f"commit number {index}", f"{index:064x}", t0 + timedelta(minutes=index)))
        running = {args.commits - 1, args.commits - 2}
        fingerprint = {"fingerprint": {"device_kind": "cuda", "device_name": "NVIDIA H200", "compute_capability": "9.0",
                                       "cpu_capability": None, "driver_version": "560", "cuda_version": "12.6",
                                       "torch_version": "2.13.0", "python_version": "3.11", "platform": "linux",
                                       "class_key": "cuda-sm90"}, "battery_version": 1, "build_ok": True}
        with conn.cursor().copy("COPY runs (id, project_id, kind, commit_id, source_digest, battery, battery_hash, "
                                "environment, environment_detail, status, attempt, worker, cancel_requested, "
                                "created_at, dispatched_at, started_at, heartbeat_at, finished_at, cases_total, "
                                "cases_done, build_digest, build_cached, build_log) FROM STDIN") as copy:
            for index in range(args.commits):
                at = t0 + timedelta(minutes=index)
                is_running = index in running
                copy.write_row((index + 1, project_id, "commit", index + 1, f"{index:064x}", "standard", "b" * 64,
                                "gpu.sm90", json.dumps(fingerprint), "running" if is_running else "done", 1,
                                "gpu-worker-0", False, at, at, at, at, None if is_running else at + timedelta(seconds=90),
                                args.cases, args.cases // 3 if is_running else args.cases, f"{index:064x}", False,
                                "ninja: build log line\n" * 40))
        print(f"projects/commits/runs: {time.monotonic() - started:.1f} s", flush=True)
        with conn.cursor().copy("COPY trajectories (run_id, case_id, case_index, \"case\", status, error, steps, "
                                "series_layout, series_data, digests, extra, created_at) FROM STDIN") as copy:
            case_json = [json.dumps(spec) for spec in specs]
            layouts = [json.dumps(layout) for layout, _d, _f in blobs]
            for index in range(args.commits):
                stored = args.cases // 3 if index in running else args.cases
                at = t0 + timedelta(minutes=index)
                for case_index in range(stored):
                    blob = (index * 7 + case_index) % len(blobs)
                    copy.write_row((index + 1, specs[case_index]["case_id"], case_index, case_json[case_index], "ok",
                                    None, args.steps, layouts[blob], blobs[blob][1],
                                    digest_sets[(index + case_index) % len(digest_sets)], '{"duration_s": 0.1}', at))
                if index % 100 == 99:
                    print(f"  trajectories of {index + 1} runs: {time.monotonic() - started:.1f} s", flush=True)
        with conn.cursor().copy("COPY verdicts (run_id, baseline_run_id, outcome, flagged, changed_cases, "
                                "first_divergent_step, detail, acknowledged, created_at) FROM STDIN") as copy:
            for index in range(args.commits):
                if index in running:
                    continue
                outcome, comparisons = verdict_for(index, specs, rng, blobs)
                changed = [c for c in comparisons if c.verdict in ("changed", "broken")]
                detail = {"verdict": outcome, "summary": summary_text(outcome, comparisons),
                          "battery_digest": "b" * 64, "commit_build_digest": f"{index:064x}",
                          "baseline_build_digest": f"{index - 1:064x}" if index else None,
                          "counts": {v: sum(1 for c in comparisons if c.verdict == v) for v in
                                     {c.verdict for c in comparisons}},
                          "cases": [c.model_dump(mode="json") for c in comparisons]}
                copy.write_row((index + 1, index if index else None, outcome, outcome in ("changed", "broken"),
                                len(changed), 1 if changed else None, json.dumps(detail), False,
                                t0 + timedelta(minutes=index, seconds=95)))
        conn.execute("SELECT setval(pg_get_serial_sequence('commits', 'id'), (SELECT max(id) FROM commits))")
        conn.execute("SELECT setval(pg_get_serial_sequence('runs', 'id'), (SELECT max(id) FROM runs))")
        conn.commit()
        conn.execute("ANALYZE")
    print(f"seeded {args.database}: {args.commits} commits x {args.cases} cases in {time.monotonic() - started:.1f} s")
    print(f"url: {url}")
    return 0


def verdict_for(index: int, specs: list[dict], rng: random.Random, blobs: list) -> tuple[str, list[CaseComparison]]:
    if index == 0:
        return "no-baseline", [CaseComparison(case_id=s["case_id"], optimizer=s["optimizer"], verdict="new",
                                              commit_final_ref64_distance=blobs[i % len(blobs)][2])
                               for i, s in enumerate(specs)]
    flagged = index % 10 == 5
    broken = index % 97 == 50
    out = []
    for i, spec in enumerate(specs):
        if broken and i == 3:
            out.append(CaseComparison(case_id=spec["case_id"], optimizer=spec["optimizer"], verdict="broken",
                                      first_divergent_step=4, message="NaN/Inf in parameters or states from step 4"))
        elif flagged and i < CHANGED_PER_FLAGGED_COMMIT:
            base = blobs[i % len(blobs)][2]
            factor = 1.5 if i % 2 else 0.5
            out.append(CaseComparison(case_id=spec["case_id"], optimizer=spec["optimizer"], verdict="changed",
                                      first_divergent_step=1 + i % 3, commit_final_ref64_distance=base * factor,
                                      baseline_final_ref64_distance=base,
                                      direction="farther" if factor > 1 else "closer"))
        else:
            out.append(CaseComparison(case_id=spec["case_id"], optimizer=spec["optimizer"], verdict="unchanged"))
    outcome = "broken" if broken else ("changed" if flagged else "unchanged")
    return outcome, out


def summary_text(outcome: str, comparisons: list[CaseComparison]) -> str:
    from service.core.results import RunResult

    stub = RunResult(battery_name="standard", battery_version=1, battery_digest="b" * 64)
    return summarize(outcome, comparisons, stub, stub)


if __name__ == "__main__":
    sys.exit(main())
