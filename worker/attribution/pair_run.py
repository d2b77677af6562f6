"""The changed cases' kernels again, on the commit's and the baseline's builds, keeping the
parameters of every step: what the attribution needs and the co-run does not keep (it reduces them to
one max |commit − baseline| per step and deletes them). numpy only, like worker/engine/corun.py:
the kernels run in kernel hosts (sandboxed), and the torch analysis in a child (worker/attribution/child.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import select
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from service.core.results import CaseSpec
from service.core.verdicts import first_divergent_step
from worker.engine import host_reserve
from worker.engine.host import KernelHost

log = logging.getLogger(__name__)
# Both hosts start together from this thread (KernelHost.start_together): a kernel host dies with the
# thread that started it (the sandbox's parent-death signal), so starting them from worker threads
# would kill them.
# The analysis of one case replays ~30 float64 variants: well under a second at the standard
# battery's sizes; this bounds a whole run's analysis.
ANALYSIS_TIMEOUT_S = 600.0


@contextlib.contextmanager
def pair_hosts(commit_library: str | Path, baseline_library: str | Path, *, device: str = "auto",
               adapter: str = "bundled", case_timeout_s: float = 300.0,
               adapter_paths: tuple[list[Path], list[Path]] = ([], []),
               compile_caches: tuple = (None, None)) -> Iterator[tuple[KernelHost, KernelHost]]:
    """(the commit's, the baseline's) kernel hosts, started together from this thread and closed
    together: one pair serves every recording of an attribution (its cases, then its probes), so
    each torch import and sandbox start is paid once. Arguments as record_parameters'."""
    commit_paths, baseline_paths = adapter_paths
    commit_cache, baseline_cache = compile_caches
    hosts = [host_reserve.open_host(commit_library, device=device, case_timeout_s=case_timeout_s, adapter=adapter,
                                    adapter_paths=list(commit_paths), compile_cache=commit_cache),
             host_reserve.open_host(baseline_library, device=device, case_timeout_s=case_timeout_s, adapter=adapter,
                                    adapter_paths=list(baseline_paths), compile_cache=baseline_cache)]
    try:
        KernelHost.start_together(hosts)
        yield hosts[0], hosts[1]
    finally:
        KernelHost.close_together(hosts)


def record_on(hosts: tuple[KernelHost, KernelHost], cases: list[CaseSpec], workdir: Path, *,
              states: bool = False) -> dict[str, tuple[Path, Path, int | None]]:
    """record_parameters on hosts already started (pair_hosts)."""
    commit_host, baseline_host = hosts
    files: dict[str, tuple[Path, Path, int | None]] = {}
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
    with pair_hosts(commit_library, baseline_library, device=device, adapter=adapter, case_timeout_s=case_timeout_s,
                    adapter_paths=adapter_paths, compile_caches=compile_caches) as hosts:
        return record_on(hosts, cases, workdir, states=states)


def states_path(params_file: Path) -> Path:
    """Where record_parameters(states=True) puts the state leaves recorded beside `params_file`."""
    return params_file.with_name(params_file.name + ".states")


def analyze_in_child(requests: list[dict], *, timeout_s: float = ANALYSIS_TIMEOUT_S) -> dict[str, dict]:
    """worker.attribution.child over `requests` (see there): case id -> attribution. The child
    runs only our own float64 replay on files we wrote, so it needs no sandbox."""
    with AnalysisChild(timeout_s=timeout_s) as child:
        return child.ask(requests)


class AnalysisChild:
    """worker.attribution.child kept open (`--serve`: one JSON line of requests in, one line of
    answers out, per ask): started before the kernels are re-run, its torch import overlaps theirs,
    and the probes' analysis after the cases' reuses it instead of importing torch again.
    `timeout_s` bounds each ask (not the child's life: it waits while the kernels re-run)."""

    def __init__(self, *, timeout_s: float = ANALYSIS_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.stderr = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a chatty child never blocks
        self.process = subprocess.Popen([sys.executable, "-m", "worker.attribution.child", "--serve"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                        text=True)

    def __enter__(self) -> "AnalysisChild":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def ask(self, requests: list[dict]) -> dict[str, dict]:
        try:
            self.process.stdin.write(json.dumps(requests) + "\n")
            self.process.stdin.flush()
        except OSError:
            raise RuntimeError(f"attribution child failed ({self.process.poll()}): {self._stderr_tail()}") from None
        ready, _, _ = select.select([self.process.stdout], [], [], self.timeout_s)
        line = self.process.stdout.readline() if ready else ""
        if not ready:
            self.close()
            raise subprocess.TimeoutExpired(self.process.args, self.timeout_s)
        if not line:
            self.process.wait()
            raise RuntimeError(f"attribution child failed ({self.process.returncode}): {self._stderr_tail()}")
        return json.loads(line)

    def _stderr_tail(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()[-2000:]

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.close()  # end of requests: the child exits
                self.process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        self.stderr.close()
