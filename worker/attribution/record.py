"""The attribution step of a flagged run: after the baseline co-run (worker/jobs/corun.py), the
changed cases' kernels once more on both builds with every step's parameters kept
(worker/attribution/pair_run.py), and their state leaves, then the analysis in a torch child
(worker/attribution/child.py), which judges the states as well as the parameters.
Its result goes beside the verdict (detail["attribution"], case id -> attribution, stored by the
co-run job, worker/jobs/corun.py) and never changes it: a failure here is logged and recorded as
{"error": ...}, the diffs are stored all the same.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from service.core.results import CaseSpec, RunComparison, RunResult
from worker.attribution import probe, selection
from worker.attribution.pair_run import AnalysisChild, pair_hosts, record_on, states_path

log = logging.getLogger(__name__)


def attribute_changed(comparison: RunComparison, baseline: RunResult, cases: list[CaseSpec],
                      commit_library: str | Path, baseline_library: str | Path, *, device: str = "auto",
                      adapter: str = "bundled", case_timeout_s: float = 300.0,
                      adapter_paths: tuple[list[Path], list[Path]] = ([], []),
                      limit: int | None = None, compile_caches: tuple = (None, None)) -> dict[str, dict]:
    """case id -> attribution for the changed cases of `comparison` among `cases`. `adapter_paths`:
    (the commit's, the baseline's) adapter folders, which must exist until this returns. At most
    `limit` cases (None: selection.DEFAULT_LIMIT) are analysed (worker.attribution.selection); the others are listed with the case
    that stands for their group. `compile_caches`: the two builds' compile caches
    (worker.engine.compile_cache), handed to their hosts."""
    first_steps = {c.case_id: c.first_divergent_step for c in comparison.cases
                   if c.verdict == "changed" and c.first_divergent_step}
    changed = [case for case in cases if case.case_id in first_steps]
    baseline_ref64 = {c.case.case_id: c.trajectory.ref64_max_abs for c in baseline.cases if c.trajectory}
    if not changed:
        return {}
    wanted, stands_for = selection.sample(changed, limit or selection.DEFAULT_LIMIT)
    # One analysis child and one pair of kernel hosts for the cases and then their probes: the
    # child's torch import overlaps the hosts' start, and nothing is started twice.
    with tempfile.TemporaryDirectory(prefix="optdrift-attribution-") as tmp, AnalysisChild() as child, \
            pair_hosts(commit_library, baseline_library, device=device, adapter=adapter,
                       case_timeout_s=case_timeout_s, adapter_paths=adapter_paths,
                       compile_caches=compile_caches) as hosts:
        files = record_on(hosts, wanted, Path(tmp), states=True)
        requests = []
        answers = selection.left_out_entries(changed, stands_for)
        for case in wanted:
            if case.case_id not in files:
                answers[case.case_id] = {"error": "the case did not run on both builds again"}
                continue
            commit_file, baseline_file, rerun_step = files[case.case_id]
            if rerun_step != first_steps[case.case_id]:
                # Kernels are deterministic in one environment: a re-run that diverges elsewhere
                # is not the trajectory the verdict judged, so it explains nothing.
                answers[case.case_id] = {"error": f"the re-run diverged at step {rerun_step}, the verdict's "
                                                  f"trajectories at step {first_steps[case.case_id]}"}
                continue
            requests.append(_analysis_request(case, commit_file, baseline_file, first_steps[case.case_id],
                                              baseline_ref64.get(case.case_id)))
        if requests:
            answers.update(child.ask(requests))
        _probe_underpowered(answers, wanted, Path(tmp), hosts, child)
    return answers


def _analysis_request(case: CaseSpec, commit_file: Path, baseline_file: Path, first_divergent_step: int,
                      baseline_ref64: list[float] | None) -> dict:
    """One case for worker.attribution.child: its two parameter files and the state files beside them."""
    return {"case": case.model_dump(mode="json"), "commit_file": str(commit_file), "baseline_file": str(baseline_file),
            "commit_states": str(states_path(commit_file)), "baseline_states": str(states_path(baseline_file)),
            "first_divergent_step": first_divergent_step, "baseline_ref64": baseline_ref64}


def _probe_underpowered(answers: dict[str, dict], cases: list[CaseSpec], workdir: Path, hosts: tuple,
                        child: AnalysisChild) -> None:
    """Where a rounding-level call had too few moved elements for its drift test, the same case at
    probe.PROBE_ELEMENTS elements on both builds (the attribution's hosts), analysed by its child;
    its evidence joins the case's record (worker/attribution/probe.py)."""
    probes = {case.case_id: probe_case for case in cases
              if probe.underpowered(answers.get(case.case_id) or {}) and (probe_case := probe.probe_case(case))}
    if not probes:
        return
    folder = workdir / "probes"
    folder.mkdir()
    files = record_on(hosts, list(probes.values()), folder, states=True)
    requests = [_analysis_request(spec, *files[spec.case_id], None)
                for spec in probes.values() if spec.case_id in files and files[spec.case_id][2]]
    probed = child.ask(requests) if requests else {}
    for case_id, spec in probes.items():
        step = files[spec.case_id][2] if spec.case_id in files else None
        missing = ("it did not run on both builds" if spec.case_id not in files
                   else "its digests did not differ" if not step else None)
        answers[case_id] = probe.combine(answers[case_id], spec, probed.get(spec.case_id), step, missing=missing)


def attribute_or_note(*args, **kwargs) -> dict:  # noqa: ANN002, ANN003
    """attribute_changed, or {"error": why} when it failed: the verdict's diffs are stored either way."""
    try:
        return attribute_changed(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - attribution never costs a run its verdict or diffs
        log.exception("attribution failed")
        return {"error": f"{type(error).__name__}: {error}"}
