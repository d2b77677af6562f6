"""Issue 36 on the GPU: the same commit (the bundled csrc) built three ways on one machine and
compared through the service, as a maintainer about to change a toolchain setting would:

    gpu.sm<cc>          today's build: SASS for the card, nvcc --fmad=false (worker/build/extension.py)
    gpu.sm<cc>+fmad     nvcc --fmad=true: nvcc may contract a*b+c into one FMA (one rounding, not two)
    gpu.sm<cc>+ptx80    TORCH_CUDA_ARCH_LIST=8.0+PTX: no SASS the card can run, so the driver JIT-compiles
                        the compute_80 PTX (a wheel built for Ampere running on Hopper)
    gpu.sm<cc>+fastmath nvcc --use_fast_math: approximate division and square root, flush to zero, FMA

`optdrift serve --no-worker` on its embedded default, `optdrift worker --gpus all` configured with
both variants (OPTDRIFT_BUILD_VARIANTS), one submission to all three environments, then
`GET .../environment-comparison` of each variant against the plain build. Prints one table: verdict,
changed cases, first divergent step, closer/farther from float64, per optimizer x family; for a
variant that changed, the worker's environment attribution (worker/jobs/environment_attribution.py)
once it is done: class and looks-like per optimizer x family, the ulps, one label.

    python3 bench/gpu/env_variants.py --battery quick        # through bench/gpu/h200_env_variants.sh
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "bench")]

from e2e_latency import (  # noqa: E402  (bench/ is not a package)
    child_environment, free_port, gpu_environment, start, stop_service, tail, wait_ready, wait_worker,
)

from service.cli.client import OptdriftClient, pack_directory  # noqa: E402

VARIANTS = {"fmad": {"cuda_cflags": ["--fmad=true"]}, "ptx80": {"cuda_archs": ["8.0+PTX"]},
            "fastmath": {"cuda_cflags": ["--use_fast_math"]}}
ATTRIBUTION_COMING = ("expected", "queued", "running")
PROJECT = "toolchains"
SHA = "c" * 40


def summarize(comparison: dict) -> list[str]:
    """One line per optimizer x family: changed/total, first step (min), direction counts."""
    groups: dict[tuple[str, str], list[dict]] = collections.defaultdict(list)
    for case in comparison["cases"]:
        groups[(case["optimizer"], case["family"])].append(case)
    lines = []
    for (optimizer, family), cases in sorted(groups.items()):
        changed = [c for c in cases if c["verdict"] == "changed"]
        steps = [c["first_divergent_step"] for c in changed if c.get("first_divergent_step") is not None]
        directions = collections.Counter(c.get("direction") or "-" for c in changed)
        lines.append(f"  {optimizer:<10} {family:<15} {len(changed):>3}/{len(cases):<3} changed"
                     f"  first step {min(steps) if steps else '-':>4}"
                     f"  {', '.join(f'{k} {v}' for k, v in sorted(directions.items())) or '-'}")
    return lines


def attribution_lines(client: OptdriftClient, a: str, b: str, timeout_s: float,
                      log_dir: Path | None = None) -> list[str]:
    """Wait for the worker's environment attribution of b against a (worker/jobs/environment_attribution.py)
    and tally its calls: class and looks-like per optimizer x family, the ulps range, one label."""
    deadline = time.monotonic() + timeout_s
    while True:
        answer = client.http.get(f"/api/v1/projects/{PROJECT}/environment-comparison",
                                 params={"commit": SHA, "a": a, "b": b})
        answer.raise_for_status()
        body = answer.json()
        if body["attribution_status"] not in ATTRIBUTION_COMING or time.monotonic() > deadline:
            break
        time.sleep(2)
    if log_dir is not None:  # the whole comparison, every case's attribution with its note
        (log_dir / f"comparison_{b}.json").write_text(json.dumps(body, indent=1))
    lines = [f"  attribution {body['attribution_status']}" + (f" ({body['attribution_note']})"
                                                               if body.get("attribution_note") else "")]
    tally: dict[tuple, list[dict]] = collections.defaultdict(list)
    for case in body["comparison"]["cases"]:
        call = case.get("attribution") or {}
        if case["verdict"] == "changed" and call:
            tally[(case["optimizer"], case["family"], call.get("class"), call.get("looks_like"))].append(case)
    label = None
    for (optimizer, family, klass, looks_like), cases in sorted(tally.items(), key=str):
        ulps = [c["max_ulps"] for c in cases if c.get("max_ulps") is not None]
        span = f"{min(ulps):.3g}-{max(ulps):.3g} ulps" if ulps else "no ulps"
        lines.append(f"    {optimizer:<10} {family:<15} {len(cases):>3} {klass} / {looks_like}  {span}")
        label = label or next((c["attribution"].get("label") for c in cases if c["attribution"].get("label")), None)
    if label:
        lines.append(f"    e.g. {label}")
    for case in body["comparison"]["cases"]:  # what a call beyond rounding rests on
        call = case.get("attribution") or {}
        if case["verdict"] == "changed" and call.get("class") not in (None, "unknown", "rounding-level"):
            lines.append(f"    {case['case_id']}: {call.get('label')}"[:400])
            lines.append(f"      note: {call.get('note') or (call.get('evidence') or {}).get('note') or '-'}"[:600])
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--battery", default="quick")
    parser.add_argument("--gpus", default="all", help="`optdrift worker --gpus SPEC`; 'none': a CPU worker "
                                                      "(a dry run of this script: the CUDA flags reach no build)")
    parser.add_argument("--variants", type=json.loads, default=VARIANTS,
                        help="OPTDRIFT_BUILD_VARIANTS as JSON (default: fmad, ptx80, fastmath); a CPU dry run of the "
                             "attribution path: --gpus none --variants '{\"fma\": {\"cflags\": [\"-mfma\"]}}'")
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument("--timeout-s", type=float, default=420)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="optdrift-env-variants-"))
    log_dir = args.log_dir or home
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = child_environment(home, url)
    env["OPTDRIFT_BUILD_VARIANTS"] = json.dumps(args.variants)
    python = sys.executable
    processes = []
    try:
        environment = "cpu" if args.gpus == "none" else gpu_environment(args.gpus)
        names = [environment, *(f"{environment}+{name}" for name in args.variants)]
        server = start([python, "-m", "service.cli", "serve", "--no-worker", "--port", str(port)], env=env,
                       log_path=log_dir / "service.log")
        processes.append(server)
        wait_ready(url, server, log_dir / "service.log", timeout_s=180)
        gpus = [] if args.gpus == "none" else ["--gpus", args.gpus]
        worker = start([python, "-m", "service.cli", "worker", *gpus, "--loglevel", "INFO"], env=env,
                       log_path=log_dir / "worker.log")
        processes.append(worker)
        client = OptdriftClient(url, token=(home / "admin-token").read_text().strip())
        client.ensure_project(PROJECT, environments=names, default_battery=args.battery)
        wait_worker(home, environment, worker, log_dir / "worker.log", timeout_s=180)
        started = time.monotonic()
        runs = client._check(client.http.post(f"/api/v1/projects/{PROJECT}/commits", data={
            "sha": SHA, "environments": ",".join(names)},
            files={"archive": ("csrc.tar.gz", pack_directory(REPO_ROOT / "csrc"), "application/gzip")}))["runs"]
        finished = client.wait([r["id"] for r in runs], timeout_s=args.timeout_s)
        print(f"{len(runs)} runs ({', '.join(names)}), battery {args.battery}, "
              f"done in {time.monotonic() - started:.0f} s")
        failed = [(r["environment"], r["status"], r.get("error")) for r in finished if r["status"] != "done"]
        if failed:
            print(f"FAILED: {failed}\n{tail(log_dir / 'worker.log')}")
            return 2
        for run in finished:
            detail = client.run(run["id"])
            toolchain = detail.get("toolchain") or {}
            print(f"{run['environment']}: build {detail.get('build_digest', '')[:12]} "
                  f"variant {json.dumps(detail.get('build_variant'))} nvcc {toolchain.get('nvcc_version')!r}")
        for name in names[1:]:
            answer = client.http.get(f"/api/v1/projects/{PROJECT}/environment-comparison",
                                     params={"commit": SHA, "a": environment, "b": name})
            answer.raise_for_status()
            body = answer.json()
            comparison = body["comparison"]
            print(f"\n{name} against {environment}: {comparison['verdict']} {comparison['counts']} "
                  f"(same build: {body['same_build']}; fingerprint differs in: "
                  f"{', '.join(c['field'] for c in body['fingerprint_changes']) or '-'})")
            print("\n".join(summarize(comparison)))
            if comparison["verdict"] == "changed":
                print("\n".join(attribution_lines(client, environment, name, args.timeout_s, log_dir)))
        client.close()
        return 0
    finally:
        stop_service(processes, home, cut_short=False)


if __name__ == "__main__":
    sys.exit(main())
