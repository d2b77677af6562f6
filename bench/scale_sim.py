"""Queueing simulation of optdrift's worker pool (docs/SCALE.md): how long a CI submission waits
for a GPU as the number of workers and the submission rate grow.

A discrete-event simulation (seeded, no dependencies) of one environment queue served by W
workers. Commits arrive as a Poisson process; a run costs a build (a cache hit with probability
--cache-hit, else --build-s) plus the battery (--battery-s); a flagged run (probability --flagged)
queues a co-run task (--corun-s) that, like worker/jobs/corun.py, yields to waiting runs: it
starts only when no run is queued and is put back when one arrives between its cases. The defaults
are the H200 figures of docs/PERFORMANCE.md (standard battery submit -> verdict with a warm build
15.8 s; a build after a one-file kernel change 27.5 s, through ccache) and assumptions stated in
docs/SCALE.md (30 % of submissions hit the build cache, 10 % are flagged, a co-run costs 25 s).

    .venv/bin/python bench/scale_sim.py                      # the table in docs/SCALE.md
    .venv/bin/python bench/scale_sim.py --rate 20 --workers 1 2 4 8 --corun-s 100

Prints, per worker count: utilisation, mean and p95 queue wait of runs, and the co-runs' mean
delay from the verdict to their diffs.
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
from dataclasses import dataclass, field


@dataclass(order=True)
class Event:
    time: float
    order: int
    kind: str = field(compare=False)       # "arrive" | "free" | "verdict" (a flagged run's co-run is due)
    worker: int = field(compare=False, default=-1)


@dataclass
class Outcome:
    waits: list[float]
    corun_delays: list[float]
    busy_s: float
    horizon_s: float


def simulate(*, workers: int, rate_per_min: float, hours: float, battery_s: float, build_s: float,
             cache_hit: float, flagged: float, corun_s: float, corun_slice_s: float, seed: int) -> Outcome:
    rng = random.Random(seed)
    horizon = hours * 3600.0
    events: list[Event] = []
    order = 0

    def push(time: float, kind: str, worker: int = -1) -> None:
        nonlocal order
        order += 1
        heapq.heappush(events, Event(time, order, kind, worker))

    clock = rng.expovariate(rate_per_min / 60.0)
    while clock < horizon:
        push(clock, "arrive")
        clock += rng.expovariate(rate_per_min / 60.0)

    queued_runs: list[float] = []                # arrival times
    coruns: list[tuple[float, float]] = []        # (verdict time, seconds of co-run left)
    idle = list(range(workers))
    waits, corun_delays, busy = [], [], 0.0

    holding: dict[int, tuple[float, float]] = {}  # worker -> the co-run it is in the middle of

    def corun_slice(worker: int, now: float, verdict_at: float, left: float) -> float:
        cost = min(corun_slice_s, left)
        if left - cost > 1e-9:
            holding[worker] = (verdict_at, left - cost)
        else:
            corun_delays.append(now + cost - verdict_at)
        return cost

    def start_work(now: float) -> None:
        nonlocal busy
        while idle and (queued_runs or coruns):
            worker = idle.pop()
            if queued_runs:
                arrived = queued_runs.pop(0)
                waits.append(now - arrived)
                cost = battery_s + (0.0 if rng.random() < cache_hit else build_s)
                if rng.random() < flagged:
                    push(now + cost, "verdict")
            else:
                cost = corun_slice(worker, now, *coruns.pop(0))
            busy += cost
            push(now + cost, "free", worker)

    last = 0.0
    while events:
        event = heapq.heappop(events)
        last = event.time
        if event.kind == "arrive":
            queued_runs.append(event.time)
        elif event.kind == "verdict":
            coruns.append((event.time, corun_s))
        elif event.worker in holding:
            # Between two of its cases a co-run yields to waiting runs (it is queued again, first).
            verdict_at, left = holding.pop(event.worker)
            if queued_runs:
                coruns.insert(0, (verdict_at, left))
                idle.append(event.worker)
            else:
                cost = corun_slice(event.worker, event.time, verdict_at, left)
                busy += cost
                push(event.time + cost, "free", event.worker)
        else:
            idle.append(event.worker)
        start_work(event.time)
    return Outcome(waits, corun_delays, busy, max(horizon, last))


def _p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20)[-1] if len(values) >= 20 else max(values, default=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rate", type=float, default=4.0, help="submissions per minute")
    parser.add_argument("--hours", type=float, default=8.0)
    parser.add_argument("--battery-s", type=float, default=15.8)
    parser.add_argument("--build-s", type=float, default=27.5)
    parser.add_argument("--cache-hit", type=float, default=0.3)
    parser.add_argument("--flagged", type=float, default=0.1)
    parser.add_argument("--corun-s", type=float, default=25.0)
    parser.add_argument("--corun-slice-s", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    print(f"rate {args.rate:g}/min, battery {args.battery_s:g} s, build {args.build_s:g} s "
          f"(hit {args.cache_hit:.0%}), flagged {args.flagged:.0%}, co-run {args.corun_s:g} s, {args.hours:g} h")
    print(f"{'workers':>7} {'utilisation':>11} {'runs':>6} {'mean wait s':>11} {'p95 wait s':>10} {'co-run delay s':>14}")
    for count in args.workers:
        out = simulate(workers=count, rate_per_min=args.rate, hours=args.hours, battery_s=args.battery_s,
                       build_s=args.build_s, cache_hit=args.cache_hit, flagged=args.flagged,
                       corun_s=args.corun_s, corun_slice_s=args.corun_slice_s, seed=args.seed)
        utilisation = out.busy_s / (count * out.horizon_s)
        delay = statistics.fmean(out.corun_delays) if out.corun_delays else 0.0
        print(f"{count:>7} {utilisation:>11.0%} {len(out.waits):>6} {statistics.fmean(out.waits):>11.1f} "
              f"{_p95(out.waits):>10.1f} {delay:>14.1f}")


if __name__ == "__main__":
    main()
