"""Full garbage collections in the parent's share of a warm battery (issue 18; worker/gc_policy.py).

    python bench/gc_pauses.py [--battery standard] [--repeat 12]

The parent's side of a warm run, replayed as bench/parent_share.py does (the host's answers made
up beforehand, each parsed, checked and filled in through the real reference cache), `--repeat`
times in a row in one process, first as before (the collector left alone), then as the worker
runs it now: full collections held off during the run and one made after it, as the worker's
tasks do (gc_policy.collect_after; the hold itself is on KernelHost.run_many, which the replay
stands in for). Prints each way's median and slowest run and how many full collections fell inside
the timed runs.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from parent_share import ReplayHost, made_up  # noqa: E402

from worker import gc_policy  # noqa: E402
from worker.battery import load_battery  # noqa: E402
from worker.engine import reference_cache  # noqa: E402
from worker.engine.host import result_line  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--battery", default="standard")
    parser.add_argument("--repeat", type=int, default=12)
    args = parser.parse_args()
    import torch

    from worker.engine.environment import fingerprint

    cases = load_battery(args.battery).expand()
    environment = fingerprint(torch.device("cpu"))
    full, digests_only = made_up(cases)
    lines = [result_line(r, index=i).encode() for i, r in enumerate(digests_only)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="optdrift-gc-pauses-") as folder:
        cache = reference_cache.ReferenceCache(Path(folder), writable=True)
        cache.store(environment, full)
        for way in ("collector left alone", "held, collected after"):
            gc.collect()
            seconds, inside = [], 0
            for _ in range(args.repeat):
                host = ReplayHost(environment, lines, {})
                before = gc_policy.full_collections()
                started = time.perf_counter()
                if way == "collector left alone":
                    results = reference_cache.run_many(host, cases, cache)
                else:
                    with gc_policy.full_collections_held():
                        results = reference_cache.run_many(host, cases, cache)
                seconds.append(time.perf_counter() - started)
                inside += gc_policy.full_collections() - before
                assert [repr(r.trajectory) for r in results] == [repr(r.trajectory) for r in full]
                del results
                if way != "collector left alone":
                    gc.collect()  # after the run, off its clock (gc_policy.collect_after)
            rows.append((way, statistics.median(seconds), max(seconds), inside))
    print(f"{args.battery}: {len(cases)} cases; the parent's share of a warm run, {args.repeat} runs each way")
    print(f"{'':<24}{'median s':>10}{'slowest s':>11}{'full collections inside':>25}")
    for way, median, slowest, inside in rows:
        print(f"{way:<24}{median:>10.4f}{slowest:>11.4f}{inside:>25}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
