"""The changed cases' kernels again, on the commit's and the baseline's builds, keeping the
parameters of every step: what the attribution needs and the co-run does not keep (it reduces them to
one max |commit − baseline| per step and deletes them). numpy only, like worker/engine/corun.py:
the kernels run in kernel hosts (sandboxed), and the torch analysis in a child (worker/attribution/child.py).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

from service.core.results import CaseSpec
from service.core.verdicts import first_divergent_step
from worker.engine.host import KernelHost

log = logging.getLogger(__name__)
# Both hosts start together from this thread (KernelHost.start_together): a kernel host dies with the
# thread that started it (the sandbox's parent-death signal), so starting them from worker threads
# would kill them.
# The analysis of one case replays ~30 float64 variants: well under a second at the standard
# battery's sizes; this bounds a whole run's analysis.
ANALYSIS_TIMEOUT_S = 600.0


def record_parameters(commit_library: str | Path, baseline_library: str | Path, cases: list[CaseSpec],
                      workdir: Path, *, device: str = "auto", adapter: str = "bundled",
                      case_timeout_s: float = 300.0,
                      adapter_paths: tuple[list[Path], list[Path]] = ([], []),
                      compile_caches: tuple = (None, None),
                      states: bool = False) -> dict[str, tuple[Path, Path, int | None]]:
    """case id -> (commit file, baseline file, first divergent step of the re-run's digests):
    float32 parameters after each step, (steps, size). Cases that did not run on both sides
    (broken, not applicable) are left out. `states`: each side's state leaves of every step too,
    beside its parameter file (`states_path`; worker.engine.states_file). `adapter_paths`: (the commit's, the baseline's) folders
    their adapter module is imported from (a tree's adapter_path), as the run's hosts had them.
    `compile_caches`: (the commit's, the baseline's) build compile caches (worker.engine.compile_cache),
    so a torch.compile-based library loads what its run compiled; the caller releases them."""
    files: dict[str, tuple[Path, Path, int | None]] = {}
    commit_paths, baseline_paths = adapter_paths
    commit_cache, baseline_cache = compile_caches
    with (KernelHost(commit_library, device=device, case_timeout_s=case_timeout_s, adapter=adapter,
                     adapter_paths=list(commit_paths), compile_cache=commit_cache) as commit_host,
          KernelHost(baseline_library, device=device, case_timeout_s=case_timeout_s, adapter=adapter,
                     adapter_paths=list(baseline_paths), compile_cache=baseline_cache) as baseline_host):
        KernelHost.start_together([commit_host, baseline_host])
        for index, case in enumerate(cases):
            commit_file, baseline_file = workdir / f"{index}.commit.f32", workdir / f"{index}.baseline.f32"
            commit_host.submit(case, commit_file, params_only=True,
                               states_out=states_path(commit_file) if states else None)
            baseline_host.submit(case, baseline_file, params_only=True,
                                 states_out=states_path(baseline_file) if states else None)
            results = commit_host.collect(), baseline_host.collect()
            if all(r.status == "ok" for r in results) and commit_file.is_file() and baseline_file.is_file():
                step = first_divergent_step(results[0].trajectory.digests, results[1].trajectory.digests)
                files[case.case_id] = (commit_file, baseline_file, step)
            else:
                log.warning("attribution: %s did not run on both builds (%s); not attributed", case.case_id,
                            "; ".join(r.message or r.status for r in results))
    return files


def states_path(params_file: Path) -> Path:
    """Where record_parameters(states=True) puts the state leaves recorded beside `params_file`."""
    return params_file.with_name(params_file.name + ".states")


def analyze_in_child(requests: list[dict], *, timeout_s: float = ANALYSIS_TIMEOUT_S) -> dict[str, dict]:
    """worker.attribution.child over `requests` (see there): case id -> attribution. The child
    runs only our own float64 replay on files we wrote, so it needs no sandbox."""
    completed = subprocess.run([sys.executable, "-m", "worker.attribution.child"], input=json.dumps(requests),
                               capture_output=True, text=True, timeout=timeout_s, check=False)
    if completed.returncode != 0:
        raise RuntimeError(f"attribution child failed ({completed.returncode}): {completed.stderr[-2000:]}")
    return json.loads(completed.stdout)
