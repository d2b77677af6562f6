"""The attribution (worker/attribution) over hand-made kernel mutants on the quick battery, CPU:
per mutant, how many cases changed and what each was called.

    .venv/bin/python bench/attribution_table.py [--cache DIR] [--device cpu|cuda] [--battery quick] [--cases] [MUTANT ...]

Mutants (text substitutions in csrc/optimizer_math.h; each must match, or the script stops):
semantic — decay (weight decay after the update, worker.mutations), eps (eps inside the square
root), bc1 (first-moment bias correction dropped), swap (beta1/beta2 swapped in Adam's moment
updates); rounding-level — ulp (Adam's step size in float32, tests/worker/engine/test_engine_check.py's ONE_ULP),
fma (the parameter update contracted into one fmaf). Builds go through the digest cache.
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import time
from pathlib import Path

from worker.attribution.analysis import analyze_files
from worker.attribution.pair_run import record_parameters
from worker.battery import load_battery
from worker.build import build_extension
from worker.mutations import copy_tree, decay_after_update

ROOT = Path(__file__).resolve().parents[1]
STEP_SIZE = "rule.step_size = static_cast<float>(lr / bias_correction1);"
ADAM_PARAM = "param = param * decay_factor - step_size * (exp_avg / denom);"
DENOM = "const float denom = sqrtf(exp_avg_sq) * inv_sqrt_bias_correction2 + eps;"
ADAM_MOMENTS = ("exp_avg = beta1 * exp_avg + one_minus_beta1 * grad;\n"
                "    exp_avg_sq = beta2 * exp_avg_sq + one_minus_beta2 * (grad * grad);")
SUBSTITUTIONS = {
    "ulp": (STEP_SIZE, "rule.step_size = static_cast<float>(lr) / static_cast<float>(bias_correction1);", 1),
    "fma": (ADAM_PARAM, "param = fmaf(param, decay_factor, -(step_size * (exp_avg / denom)));", 1),
    "eps": (DENOM, "const float denom = sqrtf(exp_avg_sq * inv_sqrt_bias_correction2 * "
                   "inv_sqrt_bias_correction2 + eps);", 2),
    "bc1": (STEP_SIZE, "rule.step_size = static_cast<float>(lr);", 1),
    "swap": (ADAM_MOMENTS, ADAM_MOMENTS.replace("beta1", "BETA_A").replace("beta2", "beta1")
             .replace("BETA_A", "beta2"), 1),
}
EXPECTED = {"decay": "decay_after_update", "eps": "eps_inside_sqrt", "bc1": "bias_correction1_missing",
            "swap": "betas_swapped_in_moments", "ulp": "rounding-level", "fma": "rounding-level"}


def mutant(name: str, dest: Path) -> Path:
    root = copy_tree(ROOT / "csrc", dest / name)
    if name == "decay":
        return decay_after_update(root)
    before, after, count = SUBSTITUTIONS[name]
    path = root / "optimizer_math.h"
    text = path.read_text()
    if text.count(before) != count:
        raise SystemExit(f"{name}: expected {count} of {before!r} in {path}; the kernel source changed")
    path.write_text(text.replace(before, after))
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mutants", nargs="*", default=list(EXPECTED))
    parser.add_argument("--cache", type=Path, default=ROOT / ".optdrift" / "test-build-cache")
    parser.add_argument("--cases", action="store_true", help="print every changed case")
    parser.add_argument("--device", default="cpu", help="where the kernels run (the analysis is CPU float64)")
    parser.add_argument("--battery", default="quick")
    args = parser.parse_args()
    cases = load_battery(args.battery).expand()
    by_id = {c.case_id: c for c in cases}
    baseline = build_extension(ROOT / "csrc", cache_dir=args.cache).library_path
    print("| mutant | changed cases | called | expected | right | seconds (kernels + analysis) |")
    print("|---|---:|---|---|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.mutants:
            library = build_extension(mutant(name, Path(tmp)), cache_dir=args.cache).library_path
            started = time.monotonic()
            files = record_parameters(library, baseline, cases, Path(tmp), device=args.device)
            called = collections.Counter()
            for case_id, (commit_file, baseline_file, step) in files.items():
                if step is None:
                    continue
                found = analyze_files(by_id[case_id], str(commit_file), str(baseline_file), step)
                label = found["variant"] or ("rounding-level" if found["class"] == "rounding-level" else "unexplained")
                called[label] += 1
                if args.cases:
                    print(f"  {name} {case_id} step {step}: {found['first_step_ulps']:.3g} / "
                          f"{found['peak_ulps']:.3g} ulp -> {label}")
            total = sum(called.values())
            text = ", ".join(f"{label} {n}" for label, n in called.most_common())
            print(f"| {name} | {total} | {text} | {EXPECTED[name]} | {called[EXPECTED[name]]}/{total} | "
                  f"{time.monotonic() - started:.1f} |", flush=True)


if __name__ == "__main__":
    main()
