"""The standard battery's typical and discriminating cases through bitsandbytes' kernels, sharded
over several processes, and the table docs/BITSANDBYTES.md records.

    python bench/bnb_battery.py run --device cuda --shard 0 --shards 8 --out /tmp/shard0.jsonl [--budget-s 240]
    python bench/bnb_battery.py merge --device cuda --table table.md --json results.json /tmp/shard*.jsonl
    python bench/bnb_battery.py plan --device cuda --shards 8      # what each shard would run

Selection: every standard-battery case at the typical (lr 1e-3, wd 1e-2) or discriminating
(lr 0.1, wd 0.1) point with gnorm_scale 1 and no skip_zeros (722 cases; on CUDA, 48 bf16 32-bit
momentum/rmsprop/adagrad cases are dropped as unsupported: bnb's CUDA library has no such kernel).

Sharding: groups of cases that share a reference configuration (optimizer, family, dtype,
hyperparameters, gradient kind, steps) are dealt to shards, largest estimated cost first, each to
the shard with the least work so far. Each shard runs its cases through its own kernel host,
float32 first, and writes one JSON line per case as results arrive; past --budget-s it sends no
new request, so a shard cut short (or killed) still leaves what it finished. --mode one (the
default) sends one case per request (KernelHost.run, the engine's plain path, as the earlier H200
run used); --mode many sends one KernelHost.run_many request (the engine's fast runner) per dtype,
whose answers may come only when the whole request is done. `merge` counts cases selected, run,
ok, broken and not reached, and tabulates the final max |p - ref64| per optimizer, family, dtype,
point and step count.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

POINTS = {(1e-3, 1e-2): "typical", (0.1, 0.1): "discriminating"}
DTYPE_ORDER = {"float32": 0, "float16": 1, "bfloat16": 2}
FAMILY_ORDER = {"32bit": 0, "8bit_blockwise": 1}


def point_of(case) -> str:  # noqa: ANN001
    return POINTS[(case.hyper["lr"], case.hyper["weight_decay"])]


def select(device_type: str):  # noqa: ANN201
    """(cases bnb runs on this device, [(case, why not)]), in a fixed order."""
    from worker.adapters.bitsandbytes import supported_cases
    from worker.battery import load_battery

    cases = [c for c in load_battery("standard").expand()
             if (c.hyper["lr"], c.hyper["weight_decay"]) in POINTS
             and c.hyper["gnorm_scale"] == 1.0 and not c.hyper.get("skip_zeros", False)]
    cases.sort(key=lambda c: (DTYPE_ORDER[c.param_dtype], FAMILY_ORDER[c.family], c.steps, c.optimizer,
                              point_of(c), c.size, c.case_id))
    return supported_cases(cases, device_type)


def estimated_cost(cases) -> float:  # noqa: ANN001
    """Relative cost of one group: per step, a fixed launch/host overhead per case
    (the kernel is called case by case) and one per group (references, observation), plus the
    elements touched. Calibrated on the CPU (docs/BITSANDBYTES.md); only the ranking matters."""
    steps = cases[0].steps
    elements = sum(c.size for c in cases)
    return steps * (1.0 + 0.25 * len(cases) + elements / 262144)


def group_key(case) -> tuple:  # noqa: ANN001
    """Cases that share one reference optimizer configuration and step count (what the engine's
    fast runner batches); written here so the plan does not depend on the runner's internals."""
    return (case.family, case.optimizer, case.param_dtype, tuple(sorted(case.hyper.items())),
            case.gradient.kind, case.steps)


def plan(cases, shards: int) -> list[list[list[int]]]:  # noqa: ANN001
    """Per shard, its groups (lists of indices into `cases`), in run order."""
    by_key: dict[tuple, list[int]] = defaultdict(list)
    for index, case in enumerate(cases):
        by_key[group_key(case)].append(index)
    load = [0.0] * shards
    assigned: list[list[list[int]]] = [[] for _ in range(shards)]
    for group in sorted(by_key.values(), key=lambda g: (-estimated_cost([cases[i] for i in g]), g[0])):
        target = min(range(shards), key=lambda s: load[s])
        assigned[target].append(group)
        load[target] += estimated_cost([cases[i] for i in group])
    for shard_groups in assigned:  # float32 first, then float16, then bfloat16
        shard_groups.sort(key=lambda g: min(g))
    return assigned


def compact(result) -> dict:  # noqa: ANN001
    """What the table needs from a CaseResult, at full precision (no trajectory digests)."""
    c = result.case
    row = {"case_id": c.case_id, "optimizer": c.optimizer, "family": c.family, "dtype": c.param_dtype,
           "point": point_of(c), "steps": c.steps, "size": c.size, "gradient": c.gradient.kind,
           "seed": c.seed, "status": result.status, "message": (result.message or "").splitlines()[:1],
           "duration_s": result.duration_s}
    if result.status == "ok" and result.trajectory is not None:
        t = result.trajectory
        row.update(ref64_final=t.ref64_max_abs[-1], ref64_rel_final=t.ref64_max_rel[-1],
                   ref64_max_over_steps=max(t.ref64_max_abs), same_final=t.same_precision_max_abs[-1],
                   nonfinite=sum(t.nonfinite_count), ref64_step1=t.ref64_max_abs[0])
    return row


def cmd_run(args: argparse.Namespace) -> int:
    from worker.engine.host import KernelHost

    # `timeout` stops a shard with SIGTERM: leave through the with-blocks, so the kernel host (in
    # its own process group) is closed and killed rather than left running on the GPU.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cases, _ = select(args.device.split(":")[0])
    groups = plan(cases, args.shards)[args.shard]
    mine = sorted(i for group in groups for i in group)  # float32 first, then float16, then bfloat16
    started, done = time.monotonic(), 0
    with open(args.out, "w") as out, KernelHost("installed", device=args.device, adapter="bitsandbytes",
                                                 case_timeout_s=args.case_timeout_s) as host:
        def write(index: int, result) -> None:  # noqa: ANN001 - as results arrive
            out.write(json.dumps(compact(result)) + "\n")
            out.flush()

        if args.mode == "one":  # one case per request: the engine's plain path, the budget checked per case
            for number, index in enumerate(mine):
                if time.monotonic() - started > args.budget_s:
                    print(f"shard {args.shard}: budget of {args.budget_s:.0f} s spent; {len(mine) - number} "
                          f"cases not run (from {cases[index].case_id})", flush=True)
                    break
                write(number, host.run(cases[index]))
                done += 1
                if done % 25 == 0:
                    print(f"shard {args.shard}: {done}/{len(mine)} cases, {time.monotonic() - started:.1f} s",
                          flush=True)
        else:  # one run_many request (the fast runner) per dtype; the budget checked between them
            chunks: dict[str, list[int]] = defaultdict(list)
            for index in mine:
                chunks[cases[index].param_dtype].append(index)
            for dtype in sorted(chunks, key=DTYPE_ORDER.get):
                if time.monotonic() - started > args.budget_s:
                    print(f"shard {args.shard}: budget of {args.budget_s:.0f} s spent; {dtype} and later "
                          f"({len(mine) - done} cases) not run", flush=True)
                    break
                chunk_started = time.monotonic()
                host.run_many([cases[i] for i in chunks[dtype]], on_result=write)
                done += len(chunks[dtype])
                print(f"shard {args.shard}: {len(chunks[dtype])} {dtype} cases in "
                      f"{time.monotonic() - chunk_started:.1f} s", flush=True)
        env = host.environment
    print(f"shard {args.shard}: {done}/{len(mine)} cases in {time.monotonic() - started:.1f} s on "
          f"{env.device_name if env else '?'}", flush=True)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    cases, dropped = select(args.device.split(":")[0])
    shards = plan(cases, args.shards)
    print(f"{len(cases)} cases ({len(dropped)} unsupported), {sum(len(s) for s in shards)} groups")
    for number, groups in enumerate(shards):
        cost = sum(estimated_cost([cases[i] for i in g]) for g in groups)
        print(f"shard {number}: {len(groups)} groups, {sum(len(g) for g in groups)} cases, est. cost {cost:.0f}")
    return 0


def table(rows: list[dict]) -> list[str]:
    """Markdown rows: per optimizer x family x dtype x point x steps, over sizes, gradient kinds, seeds."""
    cells: dict[tuple, dict] = defaultdict(lambda: {"ok": 0, "abs": 0.0, "rel": 0.0, "same": 0.0, "nonfinite": 0})
    for r in rows:
        if r["status"] != "ok":
            continue
        cell = cells[(r["optimizer"], r["family"], r["dtype"], r["point"], r["steps"])]
        cell["ok"] += 1
        cell["abs"] = max(cell["abs"], r["ref64_final"])
        cell["rel"] = max(cell["rel"], r["ref64_rel_final"])
        cell["same"] = max(cell["same"], r["same_final"])
        cell["nonfinite"] += r["nonfinite"] > 0
    lines = ["| optimizer | family | dtype | point | steps | cases | max \\|p − ref64\\| | max rel | "
             "max \\|p − same-precision\\| | cases with non-finite |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    order = lambda k: (FAMILY_ORDER[k[1]], k[0], DTYPE_ORDER[k[2]], k[3], k[4])  # noqa: E731
    for key in sorted(cells, key=order):
        c = cells[key]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {key[4]} | {c['ok']} | {c['abs']:.3e} | "
                     f"{c['rel']:.3e} | {c['same']:.3e} | {c['nonfinite']} |")
    return lines


def cmd_merge(args: argparse.Namespace) -> int:
    cases, dropped = select(args.device.split(":")[0])
    rows: list[dict] = []
    for path in args.shard_files:
        try:
            with open(path) as handle:
                rows += [json.loads(line) for line in handle if line.strip()]
        except FileNotFoundError:
            print(f"missing shard file {path}")
    seen = {r["case_id"] for r in rows}
    missing = [c for c in cases if c.case_id not in seen]
    status = Counter(r["status"] for r in rows)
    by_dtype = Counter((r["dtype"], r["status"]) for r in rows)
    broken_reasons = Counter((r["message"] or [""])[0][:160] for r in rows if r["status"] != "ok")
    unsupported = sorted({f"{c.optimizer} {c.family} {c.param_dtype}" for c, _ in dropped})
    per_dtype = []
    for dtype in DTYPE_ORDER:
        run_here = sum(count for (d, _), count in by_dtype.items() if d == dtype)
        selected = sum(1 for c in cases if c.param_dtype == dtype)
        per_dtype.append(f"{dtype} {by_dtype[(dtype, 'ok')]} ok / {run_here} run / {selected} to run")
    lines = [f"bitsandbytes on {args.device}: {len(cases) + len(dropped)} cases selected from the standard battery "
             f"(typical and discriminating points, gnorm_scale 1, no skip_zeros); {len(dropped)} unsupported on "
             f"this device and not run ({', '.join(unsupported) or '-'}); {len(rows)} of {len(cases)} run: "
             f"{status.get('ok', 0)} ok, {len(rows) - status.get('ok', 0)} broken; {len(missing)} not reached.",
             "", "Per dtype: " + "; ".join(per_dtype), ""]
    for reason, count in broken_reasons.most_common(10):
        lines.append(f"* broken x{count}: {reason}")
    if broken_reasons:
        lines.append("")
    lines += table(rows)
    text = "\n".join(lines)
    print(text)
    if args.table:
        Path(args.table).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run")
    run.add_argument("--device", default="cuda")
    run.add_argument("--shard", type=int, default=0)
    run.add_argument("--shards", type=int, default=1)
    run.add_argument("--out", required=True)
    run.add_argument("--budget-s", type=float, default=240.0, help="start no new group after this many seconds")
    run.add_argument("--case-timeout-s", type=float, default=120.0,
                     help="the kernel host's limit per answer (a case; with --mode many, a batch)")
    run.add_argument("--mode", choices=("one", "many"), default="one",
                     help="one: a request per case (the plain engine path); many: a run_many request per dtype")
    show = sub.add_parser("plan")
    show.add_argument("--device", default="cuda")
    show.add_argument("--shards", type=int, default=8)
    merge = sub.add_parser("merge")
    merge.add_argument("--device", default="cuda")
    merge.add_argument("--table")
    merge.add_argument("--json")
    merge.add_argument("shard_files", nargs="+")
    args = parser.parse_args(argv)
    return {"run": cmd_run, "plan": cmd_plan, "merge": cmd_merge}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
