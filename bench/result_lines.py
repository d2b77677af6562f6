"""What writing the kernel host's result lines costs (issue 18): the way the host writes them now
(worker.engine.host.result_line, pydantic's own JSON serialiser) against json.dumps of
model_dump, as it wrote them until round 12, and what the parent's parse costs, for a battery's
answers made up as bench/parent_share.py makes them: full results (a cold run: three metric
series, the non-finite counts and the digests per step) and digests only (a warm kernels-only
pass). Both encodings parse to the same values (tests/worker/engine/test_host_protocol.py).

    python bench/result_lines.py [--battery standard] [--repeat 7]

Prints the median of `--repeat` runs per encoding.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from parent_share import made_up  # noqa: E402

from worker.battery import load_battery  # noqa: E402
from worker.engine.host import checked_result, parse_answer, result_line  # noqa: E402


def _median_s(action, repeat: int) -> float:  # noqa: ANN001
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--battery", default="standard")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    cases = load_battery(args.battery).expand()
    full, digests_only = made_up(cases)
    print(f"{args.battery}: {len(cases)} results; median of {args.repeat} runs (s)")
    print(f"{'answers':<14}{'result_line':>13}{'json.dumps':>13}{'ratio':>8}{'parse':>9}{'MB':>7}")
    for name, results in (("full", full), ("digests only", digests_only)):
        lines = [result_line(r, index=i) for i, r in enumerate(results)]
        new = _median_s(lambda: [result_line(r, index=i) for i, r in enumerate(results)], args.repeat)
        old = _median_s(lambda: [json.dumps({"index": i, "result": r.model_dump(mode="json")}) + "\n"
                                 for i, r in enumerate(results)], args.repeat)
        parse = _median_s(lambda: [checked_result(parse_answer(line.encode()), case)
                                   for case, line in zip(cases, lines)], args.repeat)
        print(f"{name:<14}{new:>13.4f}{old:>13.4f}{old / new:>7.1f}x{parse:>9.4f}{sum(map(len, lines)) / 1e6:>7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
