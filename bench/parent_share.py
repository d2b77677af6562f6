"""The worker's own share of a warm battery (issue 18): what its process does between handing a
kernel host the battery and holding every result, on no device at all.

    python bench/parent_share.py [--battery standard] [--repeat 7]

On the H200 a spare's warm standard battery took 1.46-1.62 s, of which the host's request 1.19-1.39
s; the rest, ~0.2 s, is the parent (docs/perf-log/2026-12-02-round-9.md). That part is plain Python and
SQLite, so it is measured here on answers made up for the battery's cases: every case known to the
reference cache with a 100-step (or 1-step) metric series, the host answering digests only, as a
warm kernels-only pass does. Each line is parsed and checked as KernelHost.run_many does
(worker.engine.host.parse_answer, checked_result) and goes through the real
worker.engine.reference_cache.run_many: the cache lookup, each answer's metrics filled in, the
store that marks the reused series. Only the pipe is left out: the host's lines are replayed.
Prints the median of `--repeat` runs per part.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.core.results import CaseResult, Trajectory  # noqa: E402
from worker.battery import load_battery  # noqa: E402
from worker.engine import reference_cache  # noqa: E402
from worker.engine.host import checked_result, known_series_result, parse_answer  # noqa: E402
from worker.engine.reference_cache import series_key  # noqa: E402


class ReplayHost:
    """KernelHost.run_many's parent side over answer lines made beforehand: known series answered
    by their key alone, as a kernel host answers them (`by_key`), or with every digest (as it did
    until round 13)."""

    def __init__(self, environment, lines: list[bytes], timings: dict, by_key: bool) -> None:  # noqa: ANN001
        self.environment, self.lines, self.timings = environment, lines, timings
        self.answers_known_by_key = by_key

    def run_many(self, cases, on_result=None, *, known=None, on_pause=None, on_request_sent=None,  # noqa: ANN001, ANN201
                 known_result=None):  # noqa: ANN001
        started = time.perf_counter()
        request = {"op": "run_many", "cases": [c.model_dump(mode="json") for c in cases]}
        encoded = time.perf_counter()
        held = known(self.environment)
        looked_up = time.perf_counter()
        request["known"] = {str(index): keys for index, keys in held.items()}
        (json.dumps(request) + "\n").encode()
        sent = time.perf_counter()
        self.timings["request (cases serialised)"] = encoded - started + (sent - looked_up)
        if on_request_sent is not None:  # what the parent does while a real host runs
            on_request_sent()
        self.timings["while the host runs (not on the critical path)"] = time.perf_counter() - sent
        sent = time.perf_counter()
        results = [None] * len(cases)
        for line in self.lines:
            answer = parse_answer(line)
            index = answer["index"]
            results[index] = (known_series_result(answer, index, known_result) if "series" in answer
                              else checked_result(answer, cases[index]))
            if on_result:
                on_result(index, results[index])
        self.timings["cache lookup"] = looked_up - encoded
        self.timings["answers parsed, checked, filled"] = time.perf_counter() - sent
        return results


def made_up(cases, seed: int = 0) -> tuple[list[CaseResult], list[CaseResult]]:  # noqa: ANN001
    """(full results with metrics, the same as a kernels-only pass answers them) for `cases`."""
    rng = random.Random(seed)
    full, digests_only = [], []
    for case in cases:
        digests = [f"od2:{rng.getrandbits(128):032x}" for _ in range(case.steps)]
        metrics = [[rng.random() for _ in range(case.steps)] for _ in range(3)]
        full.append(CaseResult(case=case, status="ok", trajectory=Trajectory(
            ref64_max_abs=metrics[0], ref64_max_rel=metrics[1], same_precision_max_abs=metrics[2],
            nonfinite_count=[0] * case.steps, digests=digests)))
        digests_only.append(CaseResult(case=case, status="ok", trajectory=Trajectory(
            ref64_max_abs=[], ref64_max_rel=[], nonfinite_count=[], digests=digests)))
    return full, digests_only


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--battery", default="standard")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    import torch

    from worker.engine.environment import fingerprint

    cases = load_battery(args.battery).expand()
    environment = fingerprint(torch.device("cpu"))
    full, digests_only = made_up(cases)
    by_digests = [(json.dumps({"index": i, "result": r.model_dump(mode="json")}) + "\n").encode()
                  for i, r in enumerate(digests_only)]
    by_key = [(json.dumps({"index": i, "series": series_key(r.trajectory.digests), "duration_s": 0.001}) + "\n").encode()
              for i, r in enumerate(digests_only)]
    runs: dict[tuple[str, str], list[float]] = {}
    answer_bytes = {}
    with tempfile.TemporaryDirectory(prefix="optdrift-parent-share-") as folder:
        cache = reference_cache.ReferenceCache(Path(folder), writable=True)
        cache.store(environment, full)
        for _ in range(args.repeat):  # the two answer forms interleaved, so both see the same machine
            for form, lines in (("by key", by_key), ("every digest", by_digests)):
                answer_bytes[form] = sum(len(line) for line in lines)
                timings: dict[str, float] = {}
                host = ReplayHost(environment, lines, timings, by_key=form == "by key")
                started = time.perf_counter()
                results = reference_cache.run_many(host, cases, cache, on_result=lambda i, r: None)
                total = time.perf_counter() - started
                assert [repr(r.trajectory) for r in results] == [repr(r.trajectory) for r in full]
                timings["after the answers (new series stored, reused marked)"] = total - sum(timings.values())
                timings["total"] = total
                timings["total less the work done while the host runs"] = \
                    total - timings.get("while the host runs (not on the critical path)", 0.0)
                for name, seconds in timings.items():
                    runs.setdefault((name, form), []).append(seconds)
    print(f"{args.battery}: {len(cases)} cases, {sum(c.steps for c in cases)} case-steps; known series answered "
          f"by key ({answer_bytes['by key']} bytes of answers) and with every digest ({answer_bytes['every digest']} "
          f"bytes, as until round 13); median of {args.repeat} runs, seconds")
    names = list(dict.fromkeys(name for name, _ in runs))
    width = max(len(name) for name in names)
    print(f"{'':<{width}}  {'by key':>8}  {'every digest':>12}")
    for name in names:
        print(f"{name:<{width}}  {statistics.median(runs[(name, 'by key')]):8.4f}  "
              f"{statistics.median(runs[(name, 'every digest')]):12.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
