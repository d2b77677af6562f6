"""The attribution's classification table on a labelled set of low-bit changes (issue 37).

    .venv/bin/python bench/attribution_lowbit.py [--steps 20] [--no-states] [--catalogue FILE]

Part one: mutants of tests/fixtures/lowbit's pure-PyTorch 8-bit blockwise AdamW (quantized
states as a tensor subclass, read as they are), each run in this process against the unmutated
optimizer on the same cases — 8-bit (sizes that are whole blocks, >= 4096) and, for the
arithmetic mutants, the same optimizer with float32 states (family 32bit):
  block128     block size 256 -> 128                   expected: quantization
  round_down   codes rounded down instead of nearest   expected: quantization
  reorder      sqrt(v / bc2) for sqrt(v) / sqrt(bc2)   expected: rounding-level
  decay_after  weight decay after the update           expected: semantic
Each changed case (a digest of parameter and state leaves differs) is attributed by
worker.attribution.analysis.analyze with the states (and without them, --no-states: what the
service's co-run does today). Part two (--catalogue, a `optdrift sensitivity --attribute` JSON):
each attributed defect of the csrc mutation catalogue, every attributed case's call against
catalogue.toml's expectation ("none" not scored). Prints one table with the totals:
right class, and real changes (anything expected but rounding-level) called rounding-level.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.core.results import GradientStreamSpec  # noqa: E402
from tests.fixtures.lowbit.lowbit_adamw import LowBitAdamW  # noqa: E402
from worker.attribution.analysis import analyze  # noqa: E402
from worker.attribution.states import states_of  # noqa: E402
from worker.battery import OPTIMIZER_HYPER_DEFAULTS, make_case  # noqa: E402
from worker.engine.digest import digest_tensors, plain_tensors  # noqa: E402
from worker.engine.gradients import GradientStream, initial_parameters  # noqa: E402

MUTANTS = {
    "block128": ({"block_size": 128}, "quantization", ("8bit_blockwise",)),
    "round_down": ({"rounding": "down"}, "quantization", ("8bit_blockwise",)),
    "reorder": ({"denominator": "divided"}, "rounding-level", ("8bit_blockwise", "32bit")),
    "decay_after": ({"decay": "after"}, "semantic", ("8bit_blockwise", "32bit")),
}
FP32_STATES = 1 << 62  # min_quantized_size: never quantize (the 32-bit family)


def cases(steps: int) -> list:
    out = []
    for family in ("8bit_blockwise", "32bit"):
        for dtype in ("float32", "bfloat16"):
            for lr, wd in ((1e-3, 0.0), (1e-2, 0.01), (0.1, 0.1)):
                for kind in ("open", "closed"):
                    for size in (4096, 8192):
                        hyper = dict(OPTIMIZER_HYPER_DEFAULTS["adam"], lr=lr, weight_decay=wd)
                        out.append(make_case(optimizer="adam", family=family, param_dtype=dtype, hyper=hyper,
                                             gradient=GradientStreamSpec(kind=kind), seed=1, size=size,
                                             steps=steps))
    return out


def trajectory(case, options: dict):  # noqa: ANN001, ANN201
    """(params (steps, size) float32, state leaves per step, leaf dtypes, digests) of one run."""
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[case.param_dtype]
    param = torch.nn.Parameter(initial_parameters(case.seed, case.size).to(dtype), requires_grad=False)
    h = case.hyper
    options = dict(options)
    if case.family == "32bit":
        options["min_quantized_size"] = FP32_STATES
    optimizer = LowBitAdamW([param], lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                            weight_decay=h["weight_decay"], **options)
    stream = GradientStream(case.gradient, seed=case.seed, size=case.size, device=torch.device("cpu"),
                            grad_dtype=dtype)
    params, leaves, digests = [], [], []
    for step in range(1, case.steps + 1):
        param.grad = stream.kernel_gradient(step, param.data)
        optimizer.step()
        named = plain_tensors(dict(optimizer.state[param]))
        leaves.append(states_of(named))
        digests.append(digest_tensors([param.data, *(t for _, t in named)]))
        params.append(param.data.float().numpy().copy())
    return np.stack(params), leaves, digests


def called(record: dict) -> str:
    return record["class"] if record["class"] != "semantic" or record.get("variant") else "semantic"


def fixture_rows(steps: int, with_states: bool) -> list[tuple[str, str, collections.Counter, int]]:
    rows = []
    baselines = {case.case_id: trajectory(case, {}) for case in cases(steps)}
    for name, (options, expected, families) in MUTANTS.items():
        calls: collections.Counter = collections.Counter()
        for case in cases(steps):
            if case.family not in families:
                continue
            base_params, base_leaves, base_digests = baselines[case.case_id]
            params, leaves, digests = trajectory(case, options)
            first = next((t for t, (a, b) in enumerate(zip(digests, base_digests), start=1) if a != b), None)
            if first is None:
                continue
            record = analyze(case, params, base_params, first,
                             states=(leaves, base_leaves) if with_states else None)
            calls[called(record)] += 1
        rows.append((f"fixture/{name}", expected, calls, calls[expected]))
    return rows


def catalogue_rows(path: Path) -> list[tuple[str, str, collections.Counter, int]]:
    """Each attributed defect of an `optdrift sensitivity --attribute` report by its calls: a
    variant's name counts as its class (semantic or precision, the catalogue's expectation)."""
    report = json.loads(path.read_text())
    rows = []
    for mutant in report["mutants"]:
        expected = mutant.get("attribution_expected")
        if mutant.get("kind") != "defect" or expected in (None, "none") or not mutant.get("attribution"):
            continue
        calls = collections.Counter(mutant["attribution"])
        rows.append((mutant["id"], expected, calls, calls[expected]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-states", action="store_true", help="attribute from the parameters alone")
    parser.add_argument("--catalogue", type=Path, help="an optdrift sensitivity --attribute report (JSON)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    rows = fixture_rows(args.steps, not args.no_states)
    if args.catalogue:
        rows += catalogue_rows(args.catalogue)
    print("| mutant | expected | changed cases | called | right |")
    print("|---|---|---:|---|---:|")
    total = right = real_as_rounding = 0
    for name, expected, calls, good in rows:
        count = sum(calls.values())
        total, right = total + count, right + good
        if expected != "rounding-level":  # a real change: semantic, a variant, or quantization
            real_as_rounding += calls["rounding-level"]
        text = ", ".join(f"{call} {n}" for call, n in calls.most_common())
        print(f"| {name} | {expected} | {count} | {text} | {good}/{count} |")
    print(f"\nright class: {right}/{total} ({right / max(total, 1):.1%}); real changes called rounding-level: "
          f"{real_as_rounding}; {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
