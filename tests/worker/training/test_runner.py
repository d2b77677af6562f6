"""A training-impact measurement through two real kernel hosts (worker/training/runner.py): the
bundled kernels against the decay-after-update reorder (PR 2040's defect), and against themselves.

The model set here is small (the MLP, 4 seeds, 30 steps) so the file stays fast; the verdict rules
are tested on synthetic series with known effects in test_stats.py, and the full model sets on the
reorder and the catalogued defects in docs/TRAINING.md (bench/training_impact.py)."""

from __future__ import annotations

import json
import os

import pytest

from service.core.training import ModelSet, TrainingConfig, TrainingRunAnswer
from worker.battery import OPTIMIZER_HYPER_DEFAULTS

SMALL = ModelSet(models=("mlp",), seeds=4, steps=30, max_configs=1)
AGGRESSIVE = TrainingConfig(optimizer="adam", hyper={**OPTIMIZER_HYPER_DEFAULTS["adam"], "lr": 0.1,
                                                      "weight_decay": 0.1})


def _hosts(commit_build, baseline_build):  # noqa: ANN001, ANN202
    from worker.engine.host import KernelHost

    return {"commit": KernelHost(commit_build.library_path, device="cpu", case_timeout_s=120),
            "baseline": KernelHost(baseline_build.library_path, device="cpu", case_timeout_s=120)}


def _measure(hosts: dict, cache=None, progress=None):  # noqa: ANN001, ANN202
    from worker.engine.host import KernelHost
    from worker.training import runner

    try:
        KernelHost.start_together(list(hosts.values()))
        return runner.measure(hosts, [AGGRESSIVE], SMALL, timeout_s=120, cache=cache, on_progress=progress)
    finally:
        KernelHost.close_together(list(hosts.values()))


def test_the_decay_reorder_moves_the_model_and_the_same_build_is_identical(kernels_build, decay_build,
                                                                           tmp_path) -> None:  # noqa: ANN001
    from worker.training.runner import BaselineRuns

    cache = BaselineRuns(tmp_path / "runs", build_digest=kernels_build.digest, environment="cpu-test")
    seen = []
    [changed] = _measure(_hosts(decay_build, kernels_build), cache=cache, progress=lambda d, t: seen.append((d, t)))
    assert changed.first_divergent_step == 1          # the reorder changes every weight-decayed step
    assert changed.floor_first_divergent_step == 1
    assert changed.figures.verdict not in ("identical", "not_judged"), changed.figures
    assert changed.figures.seeds == SMALL.seeds
    assert len(changed.curves.commit) == SMALL.seeds and len(changed.curves.commit[0]) == SMALL.steps
    assert seen[-1] == (3 * SMALL.seeds, 3 * SMALL.seeds) and len(seen) == 3 * SMALL.seeds + 1

    # The baseline's and the floor's runs were cached: the same build against itself trains only
    # the commit's side, and reads identical.
    assert len(list((tmp_path / "runs").glob("*.json"))) == 2 * SMALL.seeds
    seen.clear()
    [same] = _measure(_hosts(kernels_build, kernels_build), cache=cache, progress=lambda d, t: seen.append((d, t)))
    assert seen[0] == (2 * SMALL.seeds, 3 * SMALL.seeds)
    assert same.figures.verdict == "identical" and same.first_divergent_step is None
    assert same.curves.baseline == changed.curves.baseline      # the cached runs are the runs


def test_a_cached_run_the_box_could_not_have_written_is_trained_again(kernels_build, tmp_path) -> None:  # noqa: ANN001
    """The cache is the worker's file, but a damaged or foreign one must cost a re-run, never a
    verdict: it is parsed and checked (lengths, digest text) like a host's answer."""
    from service.core.training import TrainingRunSpec
    from worker.training.runner import MAX_CACHED_RUN_BYTES, BaselineRuns

    cache = BaselineRuns(tmp_path, build_digest="d", environment="e")
    spec = TrainingRunSpec(model="mlp", config=AGGRESSIVE, seed=0, steps=3)
    good = TrainingRunAnswer(losses=[1.0, 0.5, float("nan")], digests=["od2:" + "0" * 32] * 3, seconds=0.1)
    cache.put(spec, good)
    held = cache.get(spec)
    assert held.digests == good.digests and held.losses[:2] == [1.0, 0.5] and held.losses[2] != held.losses[2]
    path = next(tmp_path.glob("*.json"))
    for damaged in ('{"losses": [1.0], "digests": ["x"], "seconds": 0}', "not json",
                    json.dumps({"losses": [1, 2, 3], "digests": ["a" * 100] * 3, "seconds": 0})):
        path.write_text(damaged)
        assert cache.get(spec) is None, damaged
    # Read as box files are: a link to a good answer, a FIFO (which would block a plain open) and an
    # oversized file are refused at once, never followed, waited on or read whole.
    good_copy = tmp_path / "elsewhere.json"
    good_copy.write_text(good.model_dump_json())
    path.unlink()
    path.symlink_to(good_copy)
    assert cache.get(spec) is None
    path.unlink()
    os.mkfifo(path)
    assert cache.get(spec) is None
    path.unlink()
    path.write_bytes(b" " * (MAX_CACHED_RUN_BYTES + 1))
    assert cache.get(spec) is None


def test_a_host_that_answers_garbage_fails_the_measurement_naming_the_run() -> None:
    from service.core.training import TrainingRunSpec
    from worker.training.runner import TrainingFailed, ask_host

    class Liar:
        def __init__(self, answer):  # noqa: ANN001
            self.answer = answer

        def ask(self, request, timeout_s):  # noqa: ANN001, ANN202
            return self.answer

    spec = TrainingRunSpec(model="mlp", config=AGGRESSIVE, seed=1, steps=2)
    for answer, says in [(None, "died or missed"), ({"training_error": "boom"}, "boom"),
                         ({"training": {"losses": [1.0], "digests": ["od2:1"], "seconds": 0}}, "1 losses"),
                         ({"training": {"losses": [1.0, 2.0], "digests": ["od2:1", "od2:2"], "seconds": 0,
                                        "extra": 1}}, "not a training run")]:
        with pytest.raises(TrainingFailed) as raised:
            ask_host(Liar(answer), spec, 5, "mlp · seed 1 · commit")
        assert "mlp · seed 1 · commit" in str(raised.value) and says in str(raised.value), raised.value


def test_the_host_pool_shares_its_hosts_by_the_runs_each_side_waits_for() -> None:
    from worker.training.runner import HostPool

    made = []
    pool = HostPool({"commit": "c0", "baseline": "b0"}, size=8, make=lambda side: made.append(side) or side)
    assert pool.grow({"commit": 16, "baseline": 32}) == ["commit"] * 2 + ["baseline"] * 4
    assert [len(pool.hosts[s]) for s in ("commit", "baseline")] == [3, 5]
    cached = HostPool({"commit": "c0", "baseline": "b0"}, size=8, make=lambda side: side)
    cached.grow({"commit": 16, "baseline": 0})     # the baseline's runs all cached: the commit's side gets them
    assert len(cached.hosts["commit"]) == 8 and len(cached.hosts["baseline"]) == 1
    assert HostPool({"commit": "c0", "baseline": "b0"}).grow({"commit": 5, "baseline": 10}) == []


def test_one_failed_run_stops_every_host_at_its_next_run() -> None:
    """A commit host that fails (a hostile build hanging until the timeout, say) fails the
    measurement; the other hosts do not train the rest of their queues for a verdict nobody gets."""
    import threading

    from worker.training.runner import HostPool, TrainingFailed, train_all

    asked = {"commit": 0, "baseline": 0}
    first_failed = threading.Event()

    class Host:
        def __init__(self, side: str) -> None:
            self.side = side

        def ask(self, request, timeout_s):  # noqa: ANN001, ANN202
            asked[self.side] += 1
            if self.side == "commit":
                first_failed.set()
                return {"training_error": "hangs"}
            first_failed.wait(5)
            steps = request["run"]["steps"]
            return {"training": {"losses": [1.0] * steps, "digests": ["od2:" + "0" * 32] * steps, "seconds": 0}}

    small = ModelSet(models=("mlp",), seeds=8, steps=2, max_configs=1)
    with pytest.raises(TrainingFailed, match="hangs"):
        train_all(HostPool({"commit": Host("commit"), "baseline": Host("baseline")}), [AGGRESSIVE], small,
                  timeout_s=5)
    # The commit host failed its first run; the baseline host finished at most the run it was on.
    assert asked["commit"] == 1 and asked["baseline"] <= 2, asked
