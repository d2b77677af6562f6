"""`optdrift sensitivity`: every mutant of a catalogue through the production pipeline.

For each mutant: a copy of the kernel tree with its patch applied, built through the digest cache
and ccache (worker.pipeline.build, so only the translation units the patch reaches recompile), the
battery run on it (worker.pipeline.run, with the same repeats a changed case gets in production)
and compared with the unmutated build's run (worker.pipeline.compare). A defect is caught when a
case reads changed, broken or nondeterministic; a refactor is a false positive when any does.

For a defect the battery misses, the cheapest case of a larger battery that catches it (fewest
elements x steps) is searched in rounds of growing cost, stopping at the first round that
catches, so the search costs little when a small case would have done.

With `attribute` > 0, a caught defect's changed cases are attributed (worker/attribution: what kind
of change each is) on a sample of up to that many of them, 32-bit cases first and spread over
optimizers and dtypes, and the calls are counted against the catalogue's `attribution`.

Mutants are built ahead of the one being judged (`build_jobs` builds at once,
worker.sensitivity.build_ahead), so compiles overlap the batteries; the builds themselves are the
ones a sequential run makes, and mutants are judged and reported in the same order.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from service.core.results import CaseSpec, RunResult
from worker import pipeline
from worker.attribution.record import attribute_changed
from worker.build import BuildResult
from worker.battery import BatterySpec, load_battery
from worker.build.cache import default_cache_dir
from worker.sensitivity.build_ahead import BuildAhead
from worker.sensitivity.catalogue import DEFAULT_CATALOGUE, Mutant, load_catalogue, mutant_tree, select
from worker.sensitivity.results import (
    CATCHING_VERDICTS, CaseCatch, CheapestCatch, MutantOutcome, SensitivityReport,
)

BUNDLED_CSRC = Path(__file__).resolve().parents[2] / "csrc"
Progress = Callable[[str], None]


@dataclass
class MutantBuild:
    job: pipeline.Job  # the mutant's job: its patched tree, the run's battery and cases
    built: BuildResult


def case_cost(case: CaseSpec) -> int:
    return case.size * case.steps


def group_label(index: int, battery: BatterySpec) -> str:
    group = battery.groups[index]
    optimizers = "all" if len(group.optimizers) == 6 else "+".join(group.optimizers)
    families = "+".join("8bit" if f == "8bit_blockwise" else f for f in group.families)
    dtypes = "+".join(d.replace("float", "f").replace("bf16", "bf16") for d in group.param_dtypes)
    sizes = "/".join(str(s) for s in group.sizes)
    return f"g{index + 1} {optimizers} {families} {dtypes} n{sizes} t{group.steps}"


def case_groups(battery: BatterySpec) -> dict[str, list[int]]:
    """Case id -> the indices of the battery groups that hold it (a case may be in several)."""
    membership: dict[str, list[int]] = {}
    for index, group in enumerate(battery.groups):
        single = BatterySpec(name=battery.name, version=battery.version, groups=[group])
        for case in single.expand():
            membership.setdefault(case.case_id, []).append(index)
    return membership


@dataclass
class SensitivityRun:
    """One catalogue against one battery on one device."""

    battery: str = "ci"
    device: str = "cpu"
    catalogue: Path = DEFAULT_CATALOGUE
    only: list[str] | None = None
    source: Path = BUNDLED_CSRC
    cache_dir: Path | None = None
    fallback_battery: str | None = "standard"  # None: no search for the cheapest catching case
    case_timeout_s: float = 300.0
    progress: Progress = print
    checkpoint: Path | None = None  # the report so far, rewritten after each mutant; resumed from
    build_jobs: int = 1  # mutant builds running ahead of the one judged (0: each built when judged)
    attribute: int = 0  # changed cases attributed per caught defect (0: no attribution)
    _baseline_digests: dict[str, list[str]] = field(default_factory=dict)

    def policy(self) -> pipeline.Policy:
        cache_root = self.cache_dir or default_cache_dir()
        return pipeline.Policy(device=self.device, cache_dir=self.cache_dir,
                               cuda_archs=[] if self.device == "cpu" else None, case_timeout_s=self.case_timeout_s,
                               # A mutant's unchanged cases take the metrics the unmutated build's run
                               # stored (the same results bit for bit: worker/engine/reference_cache.py).
                               reference_cache=cache_root / "references",
                               # On a GPU the next mutant's kernel host imports torch during this one's
                               # verdict (worker/engine/host_reserve.py); on 2 CPU cores it would only
                               # take a core from the builds ahead.
                               warm_host=self.device != "cpu", host_slot_root=cache_root / "host-slots")

    def run(self) -> SensitivityReport:
        started = time.monotonic()
        mutants = select(load_catalogue(self.catalogue), self.only)
        policy = self.policy()
        with tempfile.TemporaryDirectory(prefix="optdrift-sensitivity-") as work:
            work_dir = Path(work)
            base_tree = work_dir / "baseline"
            shutil.copytree(self.source, base_tree, ignore=shutil.ignore_patterns("__pycache__", "build"))
            job = pipeline.prepare(base_tree, requested_battery=self.battery, local_battery_file=True)
            done = self._resumed(job.battery, mutants)
            if done:
                self.progress(f"resuming {self.checkpoint}: {len(done)} mutant(s) already judged")
            baseline = None  # built and run once, only if a mutant still needs judging
            membership = case_groups(job.battery)
            # Classes interleaved, so an interrupted run has judged some of every class.
            order = _interleaved(mutants)
            to_build = [m for m in order if m.id not in done and self._applicable(m)]
            with BuildAhead(lambda m: self._build_mutant(m, job, policy, work_dir), to_build,
                            self.build_jobs) as builds:
                for number, mutant in enumerate(order, 1):
                    if mutant.id not in done:
                        if self._applicable(mutant) and baseline is None:
                            baseline = self._baseline(job, policy, builds)
                        done[mutant.id] = self._one(mutant, job, baseline, policy, membership, builds)
                        self._report(job, mutants, done, started, write=True)
                    self.progress(f"[{number}/{len(mutants)}] {mutant.id}: {_describe(done[mutant.id])}")
        return self._report(job, mutants, done, started, write=True)

    def _report(self, job: pipeline.Job, mutants: list[Mutant], done: dict[str, MutantOutcome], started: float,
                *, write: bool) -> SensitivityReport:
        report = SensitivityReport(
            catalogue=_shown(self.catalogue), battery=job.battery.name, battery_version=job.battery.version,
            battery_digest=job.battery.digest, device=self.device,
            groups=[group_label(i, job.battery) for i in range(len(job.battery.groups))],
            case_count=len(job.cases), mutants=[done[m.id] for m in mutants if m.id in done],
            wall_s=round(time.monotonic() - started, 1))
        if write and self.checkpoint is not None:
            self.checkpoint.write_text(report.model_dump_json(indent=1) + "\n")
        return report

    def _resumed(self, battery: BatterySpec, mutants: list[Mutant]) -> dict[str, MutantOutcome]:
        """Outcomes a previous run of the same battery on the same device left in the checkpoint, for
        mutants whose patch has not changed since (the expect text and kind must match too)."""
        if self.checkpoint is None or not self.checkpoint.is_file():
            return {}
        previous = SensitivityReport.model_validate_json(self.checkpoint.read_text())
        if previous.battery_digest != battery.digest or previous.device != self.device:
            return {}
        current = {m.id: m for m in mutants}
        return {o.id: o for o in previous.mutants
                if o.id in current and o.kind == current[o.id].kind and o.patch_sha256 == current[o.id].patch_sha256
                # judged again when this run attributes and that one did not
                and not (self.attribute > 0 and o.status == "caught" and not o.attributed)}

    def _baseline(self, job: pipeline.Job, policy: pipeline.Policy, builds: BuildAhead) -> tuple:
        """The unmutated tree's build and battery run (and its digests for the repeats). The mutant
        builds start once the unmutated one is in the compiler cache (each then recompiles only
        what its patch reaches) and overlap the unmutated battery."""
        base_build = pipeline.build(job, policy)
        if not base_build.ok:
            raise RuntimeError(f"the unmutated tree {self.source} does not build:\n{base_build.error}")
        builds.start()
        self.progress(f"baseline {self.source}: built ({'cached' if base_build.cached else f'{base_build.duration_s:.1f} s'}); "
                      f"battery {job.battery.name} v{job.battery.version}, {len(job.cases)} cases")
        base_run = self._run(job, base_build, policy, job.cases)
        self._baseline_digests = {r.case.case_id: r.trajectory.digests for r in base_run.cases
                                  if r.status == "ok" and r.trajectory is not None}
        return base_build, base_run

    def _run(self, job: pipeline.Job, built, policy: pipeline.Policy, cases: list[CaseSpec],  # noqa: ANN001
             baseline_digests: dict[str, list[str]] | None = None) -> RunResult:
        subset = pipeline.Job(source_dir=job.source_dir, config=job.config, battery=job.battery,
                              battery_origin=job.battery_origin, cases=cases)
        ran = pipeline.run(subset, built, policy, cases=cases, baseline_digests=baseline_digests)
        return pipeline.run_result(subset, built, ran)

    def _applicable(self, mutant: Mutant) -> bool:
        return self.device.split(":")[0] in mutant.reaches

    def _build_mutant(self, mutant: Mutant, job: pipeline.Job, policy: pipeline.Policy,
                      work_dir: Path) -> MutantBuild:
        """The patched copy of the tree and its build (runs in a build-ahead thread: no progress
        lines from here, so the log reads in judging order)."""
        tree = mutant_tree(mutant, job.source_dir, work_dir / "mutants" / mutant.id.replace("/", "--"))
        mutant_job = pipeline.Job(source_dir=tree, config=job.config, battery=job.battery,
                                  battery_origin=job.battery_origin, cases=job.cases)
        return MutantBuild(job=mutant_job, built=pipeline.build(mutant_job, policy))

    def _one(self, mutant: Mutant, job: pipeline.Job, baseline: tuple | None, policy: pipeline.Policy,
             membership: dict[str, list[int]], builds: BuildAhead) -> MutantOutcome:
        outcome = MutantOutcome(id=mutant.id, kind=mutant.kind, mutant_class=mutant.mutant_class,
                                expect=mutant.expect, reaches=sorted(mutant.reaches), status="not_applicable",
                                patch_sha256=mutant.patch_sha256,
                                group_catches=[0] * len(job.battery.groups))
        if not self._applicable(mutant) or baseline is None:
            return outcome
        base_build, base_run = baseline
        self.progress(f"  {mutant.id}: patches {', '.join(mutant.touched_files)}; building (or taking the build made ahead)")
        mutant_build = builds.take(mutant)
        try:
            return self._judge(mutant, outcome, mutant_build, job, base_build, base_run, policy, membership)
        finally:
            shutil.rmtree(mutant_build.job.source_dir, ignore_errors=True)

    def _judge(self, mutant: Mutant, outcome: MutantOutcome, mutant_build: MutantBuild, job: pipeline.Job,
               base_build, base_run: RunResult, policy: pipeline.Policy,  # noqa: ANN001
               membership: dict[str, list[int]]) -> MutantOutcome:
        mutant_job, built = mutant_build.job, mutant_build.built
        outcome.build_s, outcome.build_cached = round(built.duration_s, 1), built.cached
        if not built.ok:
            outcome.status, outcome.error = "build_failed", (built.error or "")[-2000:]
            return outcome
        started = time.monotonic()
        commit_run = self._run(mutant_job, built, policy, job.cases, self._baseline_digests)
        outcome.run_s = round(time.monotonic() - started, 1)
        specs = {case.case_id: case for case in job.cases}
        comparison = pipeline.compare(commit_run, base_run)
        for verdict in comparison.cases:
            if verdict.verdict in CATCHING_VERDICTS:
                outcome.catches.append(CaseCatch(case_id=verdict.case_id, verdict=verdict.verdict,
                                                 first_divergent_step=verdict.first_divergent_step,
                                                 cost=case_cost(specs[verdict.case_id])))
                for index in membership.get(verdict.case_id, []):
                    outcome.group_catches[index] += 1
        if mutant.kind == "refactor":
            outcome.status = "flagged" if outcome.catches else "clean"
        else:
            outcome.status = "caught" if outcome.catches else "escaped"
        if outcome.status == "escaped" and self.fallback_battery and self.fallback_battery != job.battery.name:
            outcome.cheapest_catch = self._cheapest_catch(mutant_job, built, base_build, policy)
        if outcome.status == "caught" and self.attribute > 0:
            self._attribute(mutant, outcome, comparison, base_run, specs, built, base_build, job, mutant_job)
        return outcome

    def _attribute(self, mutant: Mutant, outcome: MutantOutcome, comparison, base_run: RunResult,  # noqa: ANN001
                   specs: dict[str, CaseSpec], built, base_build, job: pipeline.Job,  # noqa: ANN001
                   mutant_job: pipeline.Job) -> None:
        """The attribution of a sample of the mutant's changed cases, counted by call."""
        outcome.attributed, outcome.attribution_expected = True, mutant.attribution
        changed = [specs[c.case_id] for c in comparison.cases if c.verdict == "changed" and c.first_divergent_step]
        sample = attribution_sample(changed, self.attribute)
        if not sample:
            return
        started = time.monotonic()
        try:
            records = attribute_changed(comparison, base_run, sample, built.library_path, base_build.library_path,
                                        device=self.device, adapter=job.config.adapter,
                                        case_timeout_s=self.case_timeout_s,
                                        adapter_paths=(mutant_job.adapter_folders, job.adapter_folders))
        except Exception as error:  # noqa: BLE001 - a failed attribution is reported, the catch stands
            outcome.attribution_error = f"{type(error).__name__}: {error}"[:2000]
            records = {}
        outcome.attribution_s = round(time.monotonic() - started, 1)
        calls: dict[str, int] = {}
        for case_id, record in records.items():
            call = attribution_label(record)
            calls[call] = calls.get(call, 0) + 1
            outcome.attribution_cases[case_id] = {"call": call, "note": record.get("note") or record.get("error")}
        outcome.attribution = dict(sorted(calls.items(), key=lambda item: (-item[1], item[0])))

    def _cheapest_catch(self, mutant_job: pipeline.Job, built, base_build,  # noqa: ANN001
                        policy: pipeline.Policy) -> CheapestCatch | None:
        """The cheapest case of the fallback battery that catches the mutant, in rounds of 8, 16, 32...
        cases by increasing cost; the first round with a catch gives its cheapest catching case."""
        larger = load_battery(self.fallback_battery)
        ordered = sorted(larger.expand(), key=lambda c: (case_cost(c), c.case_id))
        job = pipeline.Job(source_dir=mutant_job.source_dir, config=mutant_job.config, battery=larger,
                           battery_origin="the fallback battery", cases=ordered)
        tried, round_size = 0, 8
        while tried < len(ordered):
            chunk = ordered[tried:tried + round_size]
            tried += len(chunk)
            round_size *= 2
            base = self._run(job, base_build, policy, chunk)
            digests = {r.case.case_id: r.trajectory.digests for r in base.cases
                       if r.status == "ok" and r.trajectory is not None}
            commit = self._run(job, built, policy, chunk, digests)
            caught = [c for c in pipeline.compare(commit, base).cases if c.verdict in CATCHING_VERDICTS]
            if caught:
                costs = {case.case_id: case_cost(case) for case in chunk}
                best = min(caught, key=lambda c: (costs[c.case_id], c.case_id))
                return CheapestCatch(battery=larger.name, case_id=best.case_id, cost=costs[best.case_id],
                                     verdict=best.verdict, first_divergent_step=best.first_divergent_step,
                                     cases_tried=tried)
        return None


def attribution_label(record: dict) -> str:
    """One attribution record (worker/attribution/analysis.py) as the call it makes: the variant's
    name, "rounding-level", "quantization", "unexplained", or "error"."""
    if "error" in record:
        return "error"
    if record.get("variant"):
        return str(record["variant"])
    return record["class"] if record.get("class") in ("rounding-level", "quantization") else "unexplained"


def attribution_sample(changed: list[CaseSpec], count: int) -> list[CaseSpec]:
    """Up to `count` of the changed cases to attribute: 32-bit cases before 8-bit ones (the
    variants carry no quantization, so an 8-bit case is named only when it diverges at step 1),
    one per (optimizer, dtype) in turn, the cheapest of each first."""
    sample: list[CaseSpec] = []
    for eight_bit in (False, True):
        by_kind: dict[tuple[str, str], list[CaseSpec]] = {}
        for case in sorted(changed, key=lambda c: (case_cost(c), c.case_id)):
            if (case.family != "32bit") == eight_bit:
                by_kind.setdefault((case.optimizer, case.param_dtype), []).append(case)
        queues = [by_kind[key] for key in sorted(by_kind)]
        while len(sample) < count and any(queues):
            for queue in queues:
                if queue and len(sample) < count:
                    sample.append(queue.pop(0))
    return sample


def _shown(path: Path) -> str:
    """A path inside this checkout relative to it, so recorded reports do not name one machine."""
    resolved = Path(path).resolve()
    root = BUNDLED_CSRC.parent
    return str(resolved.relative_to(root)) if resolved.is_relative_to(root) else str(resolved)


def _interleaved(mutants: list[Mutant]) -> list[Mutant]:
    by_class: dict[str, list[Mutant]] = {}
    for mutant in mutants:
        by_class.setdefault(mutant.mutant_class, []).append(mutant)
    columns = list(by_class.values())
    return [column[row] for row in range(max(map(len, columns), default=0)) for column in columns if row < len(column)]


def _describe(outcome: MutantOutcome) -> str:
    if outcome.status == "not_applicable":
        return f"not applicable (reaches {'+'.join(outcome.reaches)} only)"
    built = "cached build" if outcome.build_cached else f"built in {outcome.build_s:.1f} s"
    if outcome.status == "build_failed":
        return f"BUILD FAILED ({built}): {(outcome.error or '').strip().splitlines()[-1:] or ''}"
    line = f"{outcome.status} by {len(outcome.catches)} case(s) ({built}, battery {outcome.run_s:.1f} s)"
    if outcome.cheapest_catch:
        line += f"; cheapest catch in {outcome.cheapest_catch.battery}: {outcome.cheapest_catch.case_id}"
    return line
