"""Training impact of catalogued kernel changes (issue 46): each change trained on the reference
models against the unchanged bundled kernels, through the job's own host pool and runner
(worker/training/runner.py), and the verdicts as a table.

Scenarios (the bundled csrc changed by a catalogue patch, worker/sensitivity/catalogue):
  comment-only        refactor/comment_ops                  (no code change)
  decay reorder       decay/after_update (PR 2040)          at lr 0.1/wd 0.1 and lr 1e-3/wd 1e-2
  decay reorder (baseline cached)                           the same, its baseline's runs cached
  eps inside sqrt     eps/adam_inside_sqrt
  1-beta2 in m        beta/adam_one_minus_beta2_in_first    (the first moment 100x too small)
  no bias correction  bias_correction/adam_bc1_missing
  reassociated update precision/adam_reassociated_update   (a rounding-level change)

    python bench/training_impact.py --device cpu --model-set quick --scenarios "decay reorder"
    python bench/training_impact.py --device cuda --model-set standard --raw $OUT/training_raw.json
    python bench/training_impact.py --table training_raw.json     # the table again, from the raw runs

Builds run in parallel (every build of a scenario, then the hosts). The baseline's and the floor's
runs are trained once per configuration and reused by every scenario (the job's cache). Per
scenario the wall seconds are those of the measurement alone (hosts started, builds done): what a
job spends training. The raw file holds every run's loss per step and the verdict figures, so the
table can be made again anywhere.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from service.core.training import MODEL_SETS, TrainingConfig  # noqa: E402
from worker.battery import OPTIMIZER_HYPER_DEFAULTS  # noqa: E402

# The verdicts need scipy (worker/training/stats.py); a GPU image without it trains and writes the
# raw runs (--raw), and the table is made from them where scipy is (--table).
JUDGE = importlib.util.find_spec("scipy") is not None
ADAM, ADEMAMIX = OPTIMIZER_HYPER_DEFAULTS["adam"], OPTIMIZER_HYPER_DEFAULTS["ademamix"]
AGGRESSIVE = TrainingConfig(optimizer="adam", hyper={**ADAM, "lr": 0.1, "weight_decay": 0.1})
TYPICAL = TrainingConfig(optimizer="adam", hyper={**ADAM, "lr": 1e-3, "weight_decay": 1e-2})
# The decay reorder changes Adam and AdEMAMix at both points: the four configurations a standard
# job of that commit trains (its max_configs), so its row's seconds are one changed commit's job.
DECAY_CONFIGS = [AGGRESSIVE, TYPICAL,
                 TrainingConfig(optimizer="ademamix", hyper={**ADEMAMIX, "lr": 0.1, "weight_decay": 0.1}),
                 TrainingConfig(optimizer="ademamix", hyper={**ADEMAMIX, "lr": 1e-3, "weight_decay": 1e-2})]
CACHED_DECAY = "decay reorder (baseline cached)"
SCENARIOS = {
    "comment-only": ("refactor/comment_ops", [TYPICAL]),
    "decay reorder": ("decay/after_update", DECAY_CONFIGS),
    # The same commit again with the baseline's and the floor's runs cached by the row above: what a
    # changed commit's job costs once its baseline has been trained (the cache is keyed by the
    # baseline's build, so every later commit on one baseline pays only for its own runs).
    CACHED_DECAY: ("decay/after_update", DECAY_CONFIGS),
    "eps inside sqrt": ("eps/adam_inside_sqrt", [TYPICAL]),
    "1-beta2 in first moment": ("beta/adam_one_minus_beta2_in_first", [TYPICAL]),
    "no bias correction": ("bias_correction/adam_bc1_missing", [TYPICAL]),
    "reassociated update": ("precision/adam_reassociated_update", [TYPICAL]),
}
# The models train through the bundled kernels' multi-tensor op (the 32-bit family's group
# lifecycle), which computes its bias corrections from its running float32 powers in
# csrc/multi_tensor.h, not through the one-tensor rule the catalogue's patch changes: the same
# defect made there too, or the bias-correction scenario would train unchanged kernels.
ALSO_IN_MULTI_OP = {
    "no bias correction": ("multi_tensor.h", "made.step_size = static_cast<float>(lr / bias_correction1);",
                           "made.step_size = static_cast<float>(lr);"),
}


def _build(tree: Path, cache: Path, device: str):  # noqa: ANN202
    from worker.build import build_extension

    result = build_extension(tree, cache_dir=cache, cuda_archs=None if device == "cuda" else [])
    if not result.ok:
        raise SystemExit(f"building {tree} failed: {result.error}")
    return result


def run(args: argparse.Namespace) -> list[dict]:
    from worker.engine.host import KernelHost
    from worker.sensitivity.catalogue import load_catalogue, mutant_tree
    from worker.training import runner

    model_set = MODEL_SETS[args.model_set]
    chosen = [name.strip() for name in args.scenarios.split(",")] if args.scenarios else list(SCENARIOS)
    if CACHED_DECAY in chosen and ("decay reorder" not in chosen
                                   or chosen.index("decay reorder") > chosen.index(CACHED_DECAY)):
        raise SystemExit(f"{CACHED_DECAY!r} measures a warm cache: list 'decay reorder' before it")
    mutants = {m.id: m for m in load_catalogue()}
    work = Path(tempfile.mkdtemp(prefix="training-impact-"))
    cache_dir = Path(args.build_cache) if args.build_cache else work / "builds"
    trees = {"base": REPO / "csrc"}
    for name in chosen:
        trees[name] = mutant_tree(mutants[SCENARIOS[name][0]], REPO / "csrc", work / name.replace(" ", "_"))
        if name in ALSO_IN_MULTI_OP:
            relative, before, after = ALSO_IN_MULTI_OP[name]
            text = (trees[name] / relative).read_text()
            assert text.count(before) == 1, f"{relative} no longer holds {before!r}"
            (trees[name] / relative).write_text(text.replace(before, after))
    began = time.monotonic()
    with ThreadPoolExecutor(max_workers=len(trees)) as pool:
        builds = dict(zip(trees, pool.map(lambda t: _build(t, cache_dir, args.device), trees.values())))
    print(f"builds: {len(builds)} in {time.monotonic() - began:.1f} s", flush=True)
    baseline_cache = runner.BaselineRuns(work / "training-runs", build_digest=builds["base"].digest,
                                         environment=args.device)
    rows = []
    for name in chosen:
        libraries = {"commit": builds[name].library_path, "baseline": builds["base"].library_path}

        def host(side: str) -> KernelHost:
            return KernelHost(libraries[side], device=args.device, case_timeout_s=600)

        pool = runner.HostPool({side: host(side) for side in libraries}, size=args.hosts, make=host)
        try:
            # As the job: the first pair started before, the pool's others when the runs are known.
            KernelHost.start_together(pool.all())
            first = pool.hosts["commit"][0]
            device_name = first.environment.device_name if first.environment else args.device
            started = time.monotonic()
            answers = runner.train_all(pool, SCENARIOS[name][1], model_set, timeout_s=600, cache=baseline_cache,
                                       start=KernelHost.start_together)
            seconds = time.monotonic() - started
        finally:
            KernelHost.close_together(pool.all())
        series = [{"model": model, "config": config.model_dump(mode="json"),
                   "series": asdict(runner.series_of(answers, model, index, model_set.seeds))}
                  for index, config in enumerate(SCENARIOS[name][1]) for model in model_set.models]
        rows.append({"scenario": name, "mutant": SCENARIOS[name][0], "device": device_name, "seconds": seconds,
                     "model_set": args.model_set, "series": series})
        print(f"{name}: {len(answers)} runs in {seconds:.1f} s on {device_name}, {len(pool.all())} hosts", flush=True)
        if JUDGE:
            print(table([rows[-1]]), flush=True)
        if args.raw:  # after each scenario: a call cut short still brings back what it measured
            Path(args.raw).write_text(json.dumps(rows))
    return rows


def _results(row: dict) -> list:
    """The verdicts of a row's series (worker.training.runner.impact: needs scipy)."""
    from worker.training import runner

    return [runner.impact(item["model"], TrainingConfig.model_validate(item["config"]),
                          runner.Series(**item["series"])) for item in row["series"]]


def _percent(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:+.3g}%"


def table(rows: list[dict]) -> str:
    lines = [f"{'scenario':<20} {'configuration':<30} {'model':<12} {'verdict':<13} {'loss shift (95% CI)':<32} "
             f"{'p floor':>8} {'p noise':>8} {'1st step':>8} {'seconds':>8}"]
    for row in rows:
        for result in _results(row):
            f = result.figures
            ci = f"{_percent(f.relative_shift)} ({_percent(f.relative_ci.low)} … {_percent(f.relative_ci.high)})" \
                if f.relative_ci is not None else _percent(f.relative_shift)
            p_floor = "—" if f.p_floor is None else f"{f.p_floor:.3g}"
            p_noise = "—" if f.p_noise is None else f"{f.p_noise:.3g}"
            step = "—" if result.first_divergent_step is None else str(result.first_divergent_step)
            lines.append(f"{row['scenario']:<20} {result.config.label:<30} {result.model:<12} {f.verdict:<13} "
                         f"{ci:<32} {p_floor:>8} {p_noise:>8} {step:>8} {row['seconds']:>8.1f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model-set", default="quick", choices=sorted(MODEL_SETS))
    parser.add_argument("--scenarios", default=None, help=f"comma-separated, of: {', '.join(SCENARIOS)}")
    parser.add_argument("--build-cache", default=None)
    parser.add_argument("--hosts", type=int, default=None, help="kernel hosts in all (default: the worker's, "
                                                                 "2 on the CPU, on CUDA 3/4 of the cores, at most 12)")
    parser.add_argument("--raw", default=None, help="write every run's losses and the figures here (JSON)")
    parser.add_argument("--table", default=None, help="print the table of a raw file and stop")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return 0
    if not args.hosts:  # the worker's own pool on this machine (service/settings.py)
        from service.settings import Settings

        args.hosts = Settings(worker_device=args.device).resolved_training_hosts
    rows = run(args)
    if args.raw:
        Path(args.raw).write_text(json.dumps(rows))
    if JUDGE:
        print("\n" + table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
