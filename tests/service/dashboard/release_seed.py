"""A project of five releases for the release drift page and its API (issue 47), stored through the
service's own domain functions (trajectories.store_case_result, verdict_store.evaluate) on PostgreSQL.

Releases in version order, submitted out of that order (v1.8.0 back-filled last, v1.10.1 after
v1.11.0), first-parent line v1.8.0 <- v1.9.0 <- v1.10.0 <- v1.10.1 <- v1.11.0:

  v1.8.0   every case as in v1.9.0
  v1.9.0   the start of the line as submitted
  v1.10.0  lion fp32 with weight decay: final distance to float64 ×1700 (REGRESSION), from step 3;
           its verdict's attribution (as the co-run stores it): semantic, decoupled weight decay
  v1.10.1  build flags only (-O3 -g -> -O3 -march=native -fopenmp): every float case moves by a few
           roundings from step 1 (attribution: rounding-level); the 8-bit case does not move
  v1.11.0  the build failed: no data, and the column says why

The 8-bit row (adam · 8bit_blockwise · float32) is bit-identical in every release, its distance to
float64 4.2e+04 (its quantization error, by design). In v1.10.1 lion's wd=0 case's references
changed (another torch.optim): its direction is not judged. Every run asked for the battery "quick"; the
tree's optdrift.toml named "tree-quick", and that is what ran (environment_detail["battery"]).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

from service.core.results import CaseResult, CaseSpec, Trajectory

PROJECT = "drift"
REQUESTED_BATTERY = "quick"
RAN_BATTERY = "tree-quick"
ENVIRONMENT = "cpu"
STEPS = 8
REGRESSION_FACTOR = 1700.0
BUILD_ERROR = "nvcc fatal : Unsupported gpu architecture 'compute_35'"
BUILD_FAILURE = f"build failed: {BUILD_ERROR}"
OLD_FLAGS = ["-O3", "-g"]
NEW_FLAGS = ["-O3", "-march=native", "-fopenmp"]
WORKER_HOME = "/home/optdrift-worker"

LION_WD = "lion.32bit.fp32.lr=0.0001.wd=0.1.open.n4097.s0.t8#5d1c0e7a"
LION = "lion.32bit.fp32.lr=0.0001.wd=0.0.open.n4097.s0.t8#0b9e44f2"
ADAM = "adam.32bit.fp32.lr=0.001.wd=0.01.open.n4097.s0.t8#9a7f3c10"
ADAM_8BIT = "adam.8bit_blockwise.fp32.lr=0.001.wd=0.0.open.n4096.s0.t8#c4e1d2b3"
SPECS = {LION_WD: ("lion", "32bit", 0.1), LION: ("lion", "32bit", 0.0), ADAM: ("adam", "32bit", 0.01),
         ADAM_8BIT: ("adam", "8bit_blockwise", 0.0)}

# tag -> (sha, parent, hours after the first submission): submission order is not version order.
RELEASES = {
    "v1.9.0": ("c190", "c180", 0),
    "v1.10.0": ("c1100", "c190", 1),
    "v1.11.0": ("c1110", "c1101", 2),
    "v1.10.1": ("c1101", "c1100", 3),
    "v1.8.0": ("c180", None, 4),
}
VERSION_ORDER = ["v1.8.0", "v1.9.0", "v1.10.0", "v1.10.1", "v1.11.0"]

# Final distance to float64 per case before any change; the 8-bit case's is its quantization error.
BASE_FINAL = {LION_WD: 1.0e-7, LION: 2.0e-7, ADAM: 3.0e-7, ADAM_8BIT: 4.2e4}
QUANT_STEPS = 0.45            # the 8-bit case's distance to the quantization-aware reference
ROUNDING = 1.0 + 2.4e-5       # v1.10.1's move of every float case's final distance
FLAG_ULPS = 2.0               # ... at its first divergent step, as the attribution says
REGRESSION_FIRST_STEP = 3
REGRESSION_ULPS = 3.1e3
REGRESSION_PEAK_ULPS = 2.0e5
# v1.10.0's co-run: max |commit - baseline| per step, zero before the first divergent step, its peak
# at the last. Drawn in ulps with one unit (the peak's), step 3 would read 1.2 ulp, not the 3.1e+03
# the table says; the plot and the table must say one figure.
REGRESSION_DIFFS = [0.0, 0.0, 1.0e-9, 1.0e-6, 1.0e-5, 4.0e-5, 1.0e-4, 1.7e-4]


def _digests(case_id: str, changes: list[tuple[int, str]]) -> list[str]:
    """Per step, a digest: the case's own, re-seeded by each (from_step, tag) change from that step on."""
    out = []
    for step in range(1, STEPS + 1):
        seed = case_id + "".join(tag for from_step, tag in changes if step >= from_step)
        out.append("od2:" + hashlib.sha256(f"{seed}/{step}".encode()).hexdigest()[:32])
    return out


def case_state(tag: str, case_id: str) -> tuple[float, list[str]]:
    """(final distance to float64, per-step digests) of a case in a release."""
    final, changes = BASE_FINAL[case_id], []
    index = VERSION_ORDER.index(tag)
    if case_id == LION_WD and index >= VERSION_ORDER.index("v1.10.0"):
        final *= REGRESSION_FACTOR
        changes.append((REGRESSION_FIRST_STEP, "decoupled"))
    if case_id != ADAM_8BIT and index >= VERSION_ORDER.index("v1.10.1"):
        final *= ROUNDING
        changes.append((1, "march-native"))
    return final, _digests(case_id, changes)


def _result(tag: str, case_id: str) -> CaseResult:
    optimizer, family, weight_decay = SPECS[case_id]
    final, digests = case_state(tag, case_id)
    series = [final * (step + 1) / STEPS for step in range(STEPS)]
    quantized = family.startswith("8bit")
    spec = CaseSpec(case_id=case_id, optimizer=optimizer, family=family, param_dtype="float32",
                    hyper={"lr": 1e-3, "weight_decay": weight_decay}, seed=0, size=4097, steps=STEPS)
    return CaseResult(case=spec, status="ok", trajectory=Trajectory(
        ref64_max_abs=series, ref64_max_rel=[v * 10 for v in series], nonfinite_count=[0] * STEPS, digests=digests,
        quant_ref_steps=[QUANT_STEPS] * STEPS if quantized else None,
        quant_ref_max_abs=series if quantized else None))


def _attribution(tag: str) -> dict:
    """What the co-run stores in a release's verdict (worker/attribution's dict per changed case)."""
    if tag == "v1.10.0":
        return {LION_WD: {"class": "semantic", "variant": "decoupled_decay", "label": "decoupled weight decay",
                          "first_step_ulps": REGRESSION_ULPS, "peak_ulps": REGRESSION_PEAK_ULPS,
                          "change_vs_baseline_distance": REGRESSION_FACTOR - 1}}
    if tag == "v1.10.1":
        return {case_id: {"class": "rounding-level", "first_step_ulps": FLAG_ULPS, "peak_ulps": 4.0,
                          "change_vs_baseline_distance": ROUNDING - 1}
                for case_id in (LION_WD, LION, ADAM)}
    return {}


@dataclass
class SeededReleases:
    run_ids: dict[str, int] = field(default_factory=dict)      # tag -> run id


def seed(session) -> SeededReleases:  # noqa: ANN001
    from service.db.models import DONE, FAILED, Commit, Project, Run, SourceArchive, Verdict
    from service.domain import trajectories, verdict_store

    start = datetime(2026, 3, 2, 9, 0, tzinfo=timezone.utc)
    project = Project(name=PROJECT, environments=[ENVIRONMENT], created_at=start)
    session.add(project)
    session.flush()
    out = SeededReleases()
    for tag, (sha, parent, hours) in RELEASES.items():
        at = start + timedelta(hours=hours)
        digest = hashlib.sha256(f"{PROJECT}/{sha}".encode()).hexdigest()
        session.add(SourceArchive(digest=digest, size_bytes=1, member_count=1, created_at=at))
        session.flush()
        commit = Commit(project_id=project.id, sha=sha, parents=[parent] if parent else [], ref="main",
                        release_tag=tag, message=f"release {tag}", source_digest=digest, created_at=at)
        session.add(commit)
        session.flush()
        failed = tag == "v1.11.0"
        flags = NEW_FLAGS if VERSION_ORDER.index(tag) >= VERSION_ORDER.index("v1.10.1") else OLD_FLAGS
        # v1.10.1's worker has another torch.optim for lion without weight decay: that case's
        # references changed, so its direction is not judged (the headline counts it apart).
        references = {case_id: "r1" for case_id in SPECS}
        if VERSION_ORDER.index(tag) >= VERSION_ORDER.index("v1.10.1"):
            references[LION] = "r2"
        detail = {"battery": RAN_BATTERY, "reference_digests": references, "battery_origin": "the tree's optdrift.toml", "battery_version": 1,
                  "build_flags": {"cflags": flags, "cuda_cflags": []},
                  "toolchain": {"cxx_version": "g++ (Debian 12.2.0-14) 12.2.0"},
                  # What a worker reports: a dict of references and its own library path, which a page
                  # must show in words and without the path.
                  "fingerprint": {"device_kind": "cpu", "device_name": "x86_64", "torch_version": "2.5.1",
                                  "python_version": "3.11.2", "platform": "Linux", "class_key": "cpu/x86_64",
                                  "references": {"adam": "9f2c1e0a", "lion": "77ab03d4"}},
                  "adapter": {"adapter": "bundled", "library": f"{WORKER_HOME}/.cache/optdrift/builds/{sha}/"
                                                                "optdrift_ops.so"}}
        run = Run(project_id=project.id, commit_id=commit.id, source_digest=digest, battery=REQUESTED_BATTERY,
                  battery_hash="h", environment=ENVIRONMENT, environment_detail=detail,
                  status=FAILED if failed else DONE, attempt=1, worker="w@localhost", created_at=at,
                  dispatched_at=at, started_at=at, heartbeat_at=at, finished_at=at + timedelta(minutes=1),
                  cases_total=None if failed else len(SPECS), cases_done=0 if failed else len(SPECS),
                  build_digest=None if failed else hashlib.sha256(str(flags).encode()).hexdigest(),
                  build_cached=False, error=BUILD_FAILURE if failed else None,
                  build_log=f"[1/2] c++ -c {WORKER_HOME}/src/ops.cpp {' '.join(flags)}\n")
        session.add(run)
        session.flush()
        out.run_ids[tag] = run.id
        if not failed:
            for index, case_id in enumerate(SPECS):
                trajectories.store_case_result(session=session, run_id=run.id, case_index=index,
                                               result=_result(tag, case_id))
        verdict = verdict_store.evaluate(session=session, run=run)
        attribution = _attribution(tag)
        if verdict is not None and attribution:
            # As the co-run adds them (worker/jobs/corun.py): the attribution, and the regression's
            # per-step max |commit - baseline|.
            cases = [dict(case, max_abs_diff_per_step=REGRESSION_DIFFS) if case["case_id"] == LION_WD
                     and tag == "v1.10.0" else case for case in verdict.detail.get("cases", [])]
            session.execute(Verdict.__table__.update().where(Verdict.id == verdict.id)
                            .values(detail={**verdict.detail, "cases": cases, "attribution": attribution}))
        session.flush()
    session.expire_all()
    return out
