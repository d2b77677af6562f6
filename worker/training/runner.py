"""A training-impact measurement: every run of a model set in kernel hosts of the two builds, and
the verdicts.

Per configuration and model, seeds 0..K-1 are trained three times: with the commit's optimizer
(a commit host), with the baseline's, and with the baseline's from the seed's parameters moved one
ulp (baseline hosts). The hosts work at once, each from its own thread (a host's request blocks on
its pipe, not on the interpreter); a GPU worker runs several per side (HostPool). The baseline's and the floor's runs
depend only on the baseline build, the worker's environment and the spec: they are cached
(BaselineRuns) so a baseline judged against many commits trains once.

Each answer comes from a box and is checked (TrainingRunAnswer: lengths, digest text) before it
counts; a run whose host fails or answers garbage fails the measurement with the run named.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import ValidationError

from service.core.training import (
    ImpactFigures, LossCurves, ModelImpact, ModelSet, TrainingConfig, TrainingRunAnswer, TrainingRunSpec,
)
from service.core.verdicts import first_divergent_step
from worker.sandbox import boxfiles

# Part of every cache key: a change to the models, the data or the loop makes old entries unused.
TRAINING_CODE_VERSION = 1
# A run of MAX_TRAINING_STEPS steps is ~2000 x (a float and a 36-character digest): well under this.
MAX_CACHED_RUN_BYTES = 1 << 20
SIDES = ("commit", "baseline")


class TrainingFailed(RuntimeError):
    """A run could not be trained or its answer is not one (the message names the run)."""


@dataclass(frozen=True)
class RunKey:
    model: str
    config_index: int
    seed: int
    kind: str             # "commit", "baseline" or "floor"


class BaselineRuns:
    """The baseline's (and the floor's) answers by (build digest, environment, spec), as JSON files
    the worker writes (never the box) under `root`; a file that does not parse is trained again."""

    def __init__(self, root: Path, *, build_digest: str, environment: str) -> None:
        self.root, self.build_digest, self.environment = root, build_digest, environment

    def _path(self, spec: TrainingRunSpec) -> Path:
        body = json.dumps([TRAINING_CODE_VERSION, self.build_digest, self.environment,
                           spec.model_dump(mode="json")], sort_keys=True)
        return self.root / f"{hashlib.sha256(body.encode()).hexdigest()}.json"

    def get(self, spec: TrainingRunSpec) -> TrainingRunAnswer | None:
        # No box sees this folder (it is beside the build cache's kinds, never bound into a box), but
        # it is read as box files are (no link followed, no FIFO waited on, bounded): the one reader.
        path = self._path(spec)
        try:
            raw = boxfiles.read_bytes(path.parent, path.name, max_bytes=MAX_CACHED_RUN_BYTES)
            return None if raw is None else TrainingRunAnswer.model_validate_json(raw).check_length(spec.steps)
        except (OSError, ValidationError, ValueError, boxfiles.BoxFileRefused):
            return None

    def put(self, spec: TrainingRunSpec, answer: TrainingRunAnswer) -> None:
        path = self._path(spec)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        temporary.write_text(answer.model_dump_json())
        os.replace(temporary, path)


def plan_runs(configs: list[TrainingConfig], model_set: ModelSet) -> dict[RunKey, TrainingRunSpec]:
    runs = {}
    for index, config in enumerate(configs):
        for model in model_set.models:
            for seed in range(model_set.seeds):
                for kind in ("commit", "baseline", "floor"):
                    runs[RunKey(model, index, seed, kind)] = TrainingRunSpec(
                        model=model, config=config, seed=seed, steps=model_set.steps, perturb_ulp=kind == "floor")
    return runs


def ask_host(host, spec: TrainingRunSpec, timeout_s: float, label: str) -> TrainingRunAnswer:  # noqa: ANN001
    """One run in `host` (a KernelHost), its answer checked."""
    answer = host.ask({"op": "train", "run": spec.model_dump(mode="json")}, timeout_s)
    if answer is None:
        tail = host.stderr_tail() if hasattr(host, "stderr_tail") else ""
        raise TrainingFailed(f"{label}: the kernel host died or missed its {timeout_s:.0f} s"
                             + (f" ({tail})" if tail else ""))
    if "training_error" in answer:
        raise TrainingFailed(f"{label}: {str(answer['training_error'])[:2000]}")
    try:
        return TrainingRunAnswer.model_validate(answer.get("training")).check_length(spec.steps)
    except (ValidationError, ValueError) as error:
        raise TrainingFailed(f"{label}: the kernel host's answer is not a training run ({error})"[:2000]) from None


class HostPool:
    """The kernel hosts a measurement trains in: one per side to begin with (the job's adopted
    pair), and up to `size` in all when `make(side)` can start more. A GPU host spends most of a
    small model's step launching kernels on its CPU core, so several hosts train at once on one
    GPU (the worker's cores, not the GPU, bound the speed); a CPU worker keeps one per side."""

    def __init__(self, first: dict, *, size: int = 2, make: Callable[[str], object] | None = None) -> None:
        self.hosts: dict[str, list] = {side: [host] for side, host in first.items()}
        self.size, self.make = max(size, len(first)), make

    def grow(self, queued: dict[str, int]) -> list:
        """Hosts added so each side has a share of `size` in proportion to its queued runs (at
        least one where runs wait); the new ones, for the caller to start from its own thread."""
        made = []
        total = sum(queued.values())
        if self.make is None or total == 0:
            return made
        for side, count in queued.items():
            want = max(1, round(self.size * count / total)) if count else 0
            while len(self.hosts[side]) < want:
                host = self.make(side)
                self.hosts[side].append(host)
                made.append(host)
        return made

    def all(self) -> list:
        return [host for hosts in self.hosts.values() for host in hosts]


def train_all(hosts: "HostPool | dict", configs: list[TrainingConfig], model_set: ModelSet, *, timeout_s: float,
              cache: BaselineRuns | None = None, on_progress: Callable[[int, int], None] | None = None,
              start: Callable[[list], None] | None = None) -> dict[RunKey, TrainingRunAnswer]:
    """Every run of the model set over `configs` in the pool's hosts (or {"commit": host,
    "baseline": host}), the baseline's and the floor's from `cache` where it holds them; hosts the
    pool adds are started with `start(hosts)` from this thread. `on_progress(done, total)` after
    each run. Each side's runs go to its hosts from one queue, a thread per host."""
    pool = hosts if isinstance(hosts, HostPool) else HostPool(hosts)
    runs = plan_runs(configs, model_set)
    answers: dict[RunKey, TrainingRunAnswer] = {}
    queues: dict[str, list[RunKey]] = {"commit": [], "baseline": []}
    for key, spec in runs.items():
        held = cache.get(spec) if cache is not None and key.kind != "commit" else None
        if held is not None:
            answers[key] = held
        else:
            queues["commit" if key.kind == "commit" else "baseline"].append(key)
    added = pool.grow({side: len(keys) for side, keys in queues.items()})
    if added and start is not None:
        start(added)
    total, lock = len(runs), threading.Lock()
    done = [len(answers)]
    if on_progress:
        on_progress(done[0], total)
    pending = {side: list(keys) for side, keys in queues.items()}
    failed = threading.Event()

    def drive(side: str, host) -> None:  # noqa: ANN001
        while True:
            with lock:
                # One failed run fails the measurement: the other hosts stop at their next run
                # (a hostile build that hangs costs one timeout per host, not one per run).
                if not pending[side] or failed.is_set():
                    return
                key = pending[side].pop(0)
            spec = runs[key]
            label = f"{key.model} · {spec.config.label} · seed {key.seed} · {key.kind}"
            try:
                answer = ask_host(host, spec, timeout_s, label)
            except TrainingFailed:
                failed.set()
                raise
            if cache is not None and key.kind != "commit":
                cache.put(spec, answer)
            with lock:
                answers[key] = answer
                done[0] += 1
                if on_progress:
                    on_progress(done[0], total)

    workers = [(side, host) for side in SIDES for host in pool.hosts[side] if queues[side]]
    with ThreadPoolExecutor(max_workers=max(1, len(workers))) as executor:
        futures = [executor.submit(drive, side, host) for side, host in workers]
        for future in futures:
            future.result()
    return answers


def measure(hosts: "HostPool | dict", configs: list[TrainingConfig], model_set: ModelSet, *, timeout_s: float,
            cache: BaselineRuns | None = None, on_progress: Callable[[int, int], None] | None = None,
            start: Callable[[list], None] | None = None) -> list[ModelImpact]:
    """train_all, then one ModelImpact per model x configuration."""
    answers = train_all(hosts, configs, model_set, timeout_s=timeout_s, cache=cache, on_progress=on_progress,
                        start=start)
    return [impact(model, config, series_of(answers, model, index, model_set.seeds))
            for index, config in enumerate(configs) for model in model_set.models]


@dataclass(frozen=True)
class Series:
    """One model x configuration's runs, reduced to what the verdict reads: every run's losses per
    kind (seeds x steps), the first steps where the parameters differ, the runs' seconds."""

    losses: dict[str, list[list[float]]]
    first_divergent_step: int | None
    floor_first_divergent_step: int | None
    seconds: float


def series_of(answers: dict[RunKey, TrainingRunAnswer], model: str, index: int, seeds: int) -> Series:
    runs = {kind: [answers[RunKey(model, index, seed, kind)] for seed in range(seeds)]
            for kind in ("commit", "baseline", "floor")}
    return Series(losses={kind: [list(a.losses) for a in answered] for kind, answered in runs.items()},
                  first_divergent_step=_first_step(runs["commit"], runs["baseline"]),
                  floor_first_divergent_step=_first_step(runs["floor"], runs["baseline"]),
                  seconds=sum(a.seconds for answered in runs.values() for a in answered))


def impact(model: str, config: TrainingConfig, series: Series) -> ModelImpact:
    """The verdict and figures of one model x configuration (worker/training/stats.py)."""
    from worker.training import stats  # scipy: only where verdicts are made, not where models train

    losses = {kind: np.array(rows, dtype=np.float64) for kind, rows in series.losses.items()}
    figures = stats.judge(losses["commit"], losses["baseline"], losses["floor"]).as_json()
    first = series.first_divergent_step
    if figures["verdict"] == "identical" and first is not None:
        # Equal losses at every step of every seed, yet the parameters differ: the models moved
        # less than any loss can show, which is no more than the floor.
        figures = {**figures, "verdict": "within_floor",
                   "reason": f"the parameters differ from step {first} but no step's loss does"}
    return ModelImpact(model=model, config=config, figures=ImpactFigures.model_validate(figures),
                       first_divergent_step=first, floor_first_divergent_step=series.floor_first_divergent_step,
                       curves=LossCurves(**series.losses), seconds=series.seconds)


def _first_step(ours: list[TrainingRunAnswer], theirs: list[TrainingRunAnswer]) -> int | None:
    """The first step (1-based) where any seed's parameter digests differ; None: never."""
    steps = [first_divergent_step(a.digests, b.digests) for a, b in zip(ours, theirs)]
    found = [step for step in steps if step is not None]
    return min(found) if found else None
