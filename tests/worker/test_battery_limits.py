"""Bounded batteries (issue 43; service/core/battery_limits.py, worker/battery.py, worker/pipeline.py):
what a battery declares is measured from its axis lengths and its file's bytes, before it is validated
or expanded; past a limit of its run's kind it is refused, naming the battery, the value and the
limit, and nothing is expanded. Within the limits the measured count is exact."""

from __future__ import annotations

import dataclasses
import json
import math
import time
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.core.battery_limits import BatteryLimitError, BatteryLimits, measure_battery
from service.settings import Settings
from worker import pipeline
from worker.battery import BUILTIN_BATTERIES, BatteryError, BatterySpec, battery_from_file
from worker.jobs.workspace import Workspace

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURE_BATTERIES = sorted(REPO_ROOT.glob("tests/fixtures/*/battery.json")) + [
    REPO_ROOT / "worker" / "sensitivity" / "batteries" / "pool.json"]
LIMIT_FIELDS = ("max_cases", "max_steps_per_case", "max_elements_per_case", "max_case_steps",
                "max_case_step_elements")
OPTIMIZERS = ["adam", "ademamix", "lion", "momentum", "rmsprop", "adagrad"]
# Room enough that no generated battery meets them unless a test lowers one.
ROOMY = BatteryLimits(kind="verify", max_battery_bytes=1 << 30, max_cases=10 ** 15, max_steps_per_case=10 ** 9,
                      max_elements_per_case=10 ** 9, max_case_steps=10 ** 18, max_case_step_elements=10 ** 30)


def _figures(spec: BatterySpec) -> dict[str, int]:
    """The figures of a battery, from its expansion (what the limits stand for)."""
    cases = spec.expand()
    return {"max_cases": len(cases), "max_steps_per_case": max(c.steps for c in cases),
            "max_elements_per_case": max(c.size for c in cases),
            "max_case_steps": sum(c.steps for c in cases),
            "max_case_step_elements": sum(c.steps * c.size for c in cases)}


def _load_figures(load) -> dict[str, int]:  # noqa: ANN001
    return {"max_cases": load.cases, "max_steps_per_case": load.max_steps_per_case,
            "max_elements_per_case": load.max_elements_per_case, "max_case_steps": load.case_steps,
            "max_case_step_elements": load.case_step_elements}


@pytest.fixture
def no_expansion(monkeypatch):  # noqa: ANN001, ANN201
    """BatterySpec.expand fails the test if anything calls it."""
    def refuse(self):  # noqa: ANN001, ANN202
        raise AssertionError(f"expand() was called on battery {self.name!r}")
    monkeypatch.setattr(BatterySpec, "expand", refuse)


# ----------------------------------------------------------------------------- the shipped batteries
@pytest.mark.parametrize("kind", ["commit", "verify"])
def test_every_shipped_battery_fits_its_limits_with_room(kind) -> None:  # noqa: ANN001
    """The defaults (service/settings.py) leave room: a commit run has 10x every shipped battery's
    figure at least, a verify run 1.5x (its limits are lower, and `standard` must still verify)."""
    limits = Settings().battery_limits(kind)
    margin = 10 if kind == "commit" else 1.5
    for name, make in BUILTIN_BATTERIES.items():
        spec = make()
        load = measure_battery(spec.model_dump(mode="json"), battery=name, limits=limits)
        for field, value in _load_figures(load).items():
            assert value * margin <= getattr(limits, field), (name, field, value)
    for path in FIXTURE_BATTERIES:
        assert path.stat().st_size * margin <= limits.max_battery_bytes, path
        load = measure_battery(json.loads(path.read_bytes()), battery=path.name, limits=limits)
        for field, value in _load_figures(load).items():
            assert value * margin <= getattr(limits, field), (path, field, value)


def test_verify_limits_are_lower_than_commit_limits() -> None:
    commit, verify = Settings().battery_limits("commit"), Settings().battery_limits("verify")
    for field in (*LIMIT_FIELDS, "max_battery_bytes"):
        assert getattr(verify, field) < getattr(commit, field), field


def test_the_declared_count_bounds_the_expansion_and_counts_duplicates() -> None:
    """The declared count is an upper bound of len(expand()), which is what a limit on work before
    expansion can know: a combination declared twice (a case of two groups) counts twice."""
    spec = BUILTIN_BATTERIES["standard"]()
    load = measure_battery(spec.model_dump(mode="json"), battery="standard", limits=ROOMY)
    assert load.cases == 1213 and len(spec.expand()) == 1213
    twice = {"name": "twice", "version": 1, "groups": [{"optimizers": ["adam"], "sizes": [4], "steps": 2}] * 2}
    assert measure_battery(twice, battery="twice", limits=ROOMY).cases == 2
    assert len(BatterySpec.model_validate(twice).expand()) == 1


# ----------------------------------------------------------------------------- properties
def _group(draw, *, steps: int, max_axis: int) -> dict:  # noqa: ANN001
    """A group with distinct values on every axis (so no two combinations make the same case)."""
    optimizers = draw(st.lists(st.sampled_from(OPTIMIZERS), min_size=1, max_size=min(6, max_axis), unique=True))
    families = draw(st.lists(st.sampled_from(["32bit", "8bit_blockwise"]), min_size=1, max_size=2, unique=True))
    dtypes = draw(st.lists(st.sampled_from(["float32", "float16", "bfloat16"]), min_size=1, max_size=3, unique=True))
    lrs = draw(st.lists(st.sampled_from([1e-4, 1e-3, 1e-2, 0.1, 0.5]), min_size=1, max_size=max_axis, unique=True))
    kinds = draw(st.lists(st.sampled_from(["open", "closed"]), min_size=1, max_size=2, unique=True))
    seeds = draw(st.lists(st.integers(0, 10 ** 6), min_size=1, max_size=max_axis, unique=True))
    sizes = draw(st.lists(st.integers(1, 5000), min_size=1, max_size=max_axis, unique=True))
    group = {"optimizers": optimizers, "families": families, "param_dtypes": dtypes,
             "points": [{"lr": lr} for lr in lrs], "gradients": [{"kind": k} for k in kinds],
             "seeds": seeds, "sizes": sizes, "steps": steps}
    # A group may leave out an axis that has a default (one value): it counts as that one value.
    for axis in draw(st.sets(st.sampled_from(["families", "param_dtypes", "points", "gradients", "seeds"]))):
        del group[axis]
    return group


@st.composite
def small_batteries(draw) -> dict:  # noqa: ANN001
    """Batteries small enough to expand; groups have distinct step counts, so no case repeats."""
    steps = draw(st.lists(st.integers(1, 300), min_size=1, max_size=3, unique=True))
    groups = [_group(draw, steps=s, max_axis=3) for s in steps]
    return {"name": "prop", "version": 1, "groups": groups}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=small_batteries())
def test_within_the_limits_the_measured_figures_are_the_expansions(raw, tmp_path) -> None:  # noqa: ANN001
    """At exactly its own figures a battery is accepted (the limits are inclusive) and the count
    measured without expanding equals len(expand()); every other figure equals the expansion's."""
    path = tmp_path / "b.json"
    path.write_text(json.dumps(raw))
    spec = BatterySpec.model_validate(raw)
    expected = _figures(spec)
    exact = dataclasses.replace(ROOMY, max_battery_bytes=path.stat().st_size, **expected)
    loaded = battery_from_file(path, limits=exact)
    assert loaded.digest == spec.digest
    assert _load_figures(measure_battery(raw, battery="b.json", limits=exact)) == expected


@st.composite
def batteries_and_a_limit_passed(draw) -> tuple[dict, str, int]:  # noqa: ANN001
    """A battery of up to 1e12 declared cases (never expanded), the field of a limit it passes, and
    that limit: its figure minus 1 or a little more (near the limit), or far below."""
    steps = draw(st.lists(st.integers(1, 10 ** 6), min_size=1, max_size=3, unique=True))
    groups = [_group(draw, steps=s, max_axis=60) for s in steps]
    raw = {"name": "big", "version": 1, "groups": groups}
    field = draw(st.sampled_from(LIMIT_FIELDS))
    return raw, field, draw(st.integers(0, 3))


def _declared(raw: dict) -> dict[str, int]:
    """The figures from the definition: each group's product of axis lengths (no expansion)."""
    out = {"max_cases": 0, "max_steps_per_case": 0, "max_elements_per_case": 0, "max_case_steps": 0,
           "max_case_step_elements": 0}
    for g in raw["groups"]:
        count = math.prod(len(g.get(a, [None])) for a in ("optimizers", "families", "param_dtypes", "points",
                                                          "gradients", "seeds", "sizes"))
        out["max_cases"] += count
        out["max_steps_per_case"] = max(out["max_steps_per_case"], g["steps"])
        out["max_elements_per_case"] = max(out["max_elements_per_case"], max(g["sizes"]))
        out["max_case_steps"] += count * g["steps"]
        out["max_case_step_elements"] += count // len(g["sizes"]) * g["steps"] * sum(g["sizes"])
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=batteries_and_a_limit_passed())
def test_past_any_limit_is_refused_before_anything_is_expanded(case, tmp_path, no_expansion) -> None:  # noqa: ANN001
    raw, field, below = case
    value = _declared(raw)[field]
    path = tmp_path / "big.json"
    path.write_text(json.dumps(raw))
    at_limit = dataclasses.replace(ROOMY, **{field: value})
    assert _load_figures(measure_battery(raw, battery="big.json", limits=at_limit))[field] == value
    limit = max(0, value - 1 - below * (value // 4))  # just under, or a quarter, half, 3/4 under
    limits = dataclasses.replace(ROOMY, **{field: limit})
    with pytest.raises(BatteryError) as refused:
        battery_from_file(path, shown_as="batteries/big.json", limits=limits)
    message = str(refused.value)
    assert "'batteries/big.json'" in message and f"at most {limit:,}" in message
    assert limits.setting(field) in message
    # The value named is the battery's (or, when the count stopped at an earlier group, a lower bound
    # that is already past the limit).
    named = int(message.split(" has ")[1].split(" ")[0 if "at least" not in message else 2].replace(",", ""))
    assert limit < named <= value


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(extra=st.integers(1, 4096))
def test_a_file_past_the_byte_limit_is_refused_before_it_is_read(extra, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    path = tmp_path / "b.json"
    path.write_text(json.dumps(BUILTIN_BATTERIES["ci"]().model_dump(mode="json")))
    size = path.stat().st_size
    limits = dataclasses.replace(ROOMY, max_battery_bytes=size)
    assert battery_from_file(path, limits=limits).name == "ci"
    path.write_text(path.read_text() + " " * extra)
    read = []
    with monkeypatch.context() as patched:  # undone before the next example
        patched.setattr(Path, "read_bytes", lambda self: read.append(self) or b"")
        with pytest.raises(BatteryError, match=rf"has {size + extra:,} bytes in its file.*at most {size:,} "
                                               r"\(OPTDRIFT_VERIFY_MAX_BATTERY_BYTES\)"):
            battery_from_file(path, limits=limits)
    assert read == []


# ----------------------------------------------------------------------------- the adversarial files
def _huge_battery_file(path: Path, *, target_bytes: int) -> int:
    """A battery file of about `target_bytes` declaring about 6.5e10 cases; its declared count."""
    group = {"optimizers": OPTIMIZERS, "families": ["32bit", "8bit_blockwise"],
             "param_dtypes": ["float32", "float16", "bfloat16"],
             "points": [{"lr": 10.0 ** -k} for k in range(1, 6)], "gradients": [{"kind": "open"}, {"kind": "closed"}],
             "seeds": list(range(15000)), "sizes": list(range(1, 12041)), "steps": 10}
    raw = {"name": "huge", "version": 1, "groups": [group]}
    body = json.dumps(raw)
    raw["description"] = "x" * (target_bytes - len(body) - 20)
    path.write_text(json.dumps(raw))
    return math.prod(len(group[a]) for a in ("optimizers", "families", "param_dtypes", "points", "gradients",
                                             "seeds", "sizes"))


def test_a_6_5e10_case_battery_is_refused_in_milliseconds_with_bounded_memory(tmp_path, no_expansion) -> None:  # noqa: ANN001
    """The review's 0.96 MiB battery: refused by the count of its axes, in well under a second and a
    few MB (the file's bytes and its parsed JSON; an expansion would need ~6.5e10 cases × ~1 KB)."""
    path = tmp_path / "huge.json"
    declared = _huge_battery_file(path, target_bytes=int(0.96 * 1024 * 1024))
    assert 6.4e10 < declared < 6.6e10 and path.stat().st_size < 1024 * 1024
    limits = Settings().battery_limits("commit")
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(BatteryError, match=rf"has {declared:,} cases; a commit run may have at most 20,000"):
            battery_from_file(path, shown_as="huge.json", limits=limits)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    elapsed = time.perf_counter() - started
    # 8 MB: ~1 MB of file bytes, ~1 MB of decoded text and its parsed ~3,000 small objects, with
    # room for the interpreter's own allocations; tracemalloc slows the parse, hence 1 s.
    assert peak < 8 * 1024 * 1024, peak
    assert elapsed < 1.0, elapsed
    # The count itself, on the parsed JSON: microseconds, not a walk over combinations.
    raw = json.loads(path.read_bytes())
    started = time.perf_counter()
    with pytest.raises(BatteryLimitError):
        measure_battery(raw, battery="huge.json", limits=limits)
    assert time.perf_counter() - started < 0.01


def test_the_reviews_1_kib_battery_of_64800_cases_is_refused_for_both_kinds(tmp_path, no_expansion) -> None:  # noqa: ANN001
    group = {"optimizers": OPTIMIZERS, "families": ["32bit", "8bit_blockwise"],
             "param_dtypes": ["float32", "float16", "bfloat16"], "points": [{"lr": 10.0 ** -k} for k in range(1, 6)],
             "gradients": [{"kind": "open"}, {"kind": "closed"}], "seeds": list(range(6)),
             "sizes": list(range(1, 31)), "steps": 10}
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"name": "dense", "version": 1, "groups": [group]}))
    assert path.stat().st_size < 1024
    for kind in ("commit", "verify"):
        limits = Settings().battery_limits(kind)
        with pytest.raises(BatteryError, match=rf"has 64,800 cases; a {kind} run may have at most "
                                               rf"{limits.max_cases:,}"):
            battery_from_file(path, limits=limits)


# ----------------------------------------------------------------------------- the worker
def _tree_with_battery(tmp_path: Path, raw: dict) -> Path:
    tree = tmp_path / "tree"
    (tree / "batteries").mkdir(parents=True)
    (tree / "batteries" / "mine.json").write_text(json.dumps(raw))
    return tree


def test_the_worker_refuses_a_verify_runs_battery_past_the_verify_limits_before_expanding(tmp_path, no_expansion) -> None:  # noqa: ANN001
    """Workspace.prepare is what worker/jobs/run.py calls with the run's kind; a battery the commit
    limits allow but the verify limits do not is refused for a verify run (BatteryError: the run ends
    failed with that message, worker/jobs/run.py), and taken for a commit run."""
    group = {"optimizers": ["adam"], "seeds": list(range(50)), "sizes": list(range(1, 61)), "steps": 5}
    tree = _tree_with_battery(tmp_path, {"name": "mine", "version": 1, "groups": [group]})
    with Workspace(Settings(home=tmp_path / "home"), prefix="t-") as workspace:
        with pytest.raises(BatteryError, match=r"'batteries/mine.json' has 3,000 cases; a verify run may have at "
                                               r"most 2,000 \(OPTDRIFT_VERIFY_MAX_CASES_PER_RUN\)"):
            workspace.prepare(tree, project=None, battery="batteries/mine.json", kind="verify")
    limits = Settings().battery_limits("commit")
    load = measure_battery(json.loads((tree / "batteries" / "mine.json").read_bytes()), battery="x", limits=limits)
    assert load.cases == 3000


def test_the_worker_checks_every_battery_before_expand_builtins_too(tmp_path, no_expansion) -> None:  # noqa: ANN001
    """The second door: whatever the battery's origin (a built-in name too), pipeline.prepare measures
    it against the run's limits just before expand(); an operator who lowers the verify limit below
    `standard` gets `standard` refused for verify runs, nothing expanded."""
    tree = tmp_path / "tree"
    tree.mkdir()
    strict = Settings(home=tmp_path / "home", verify_max_cases_per_run=100).battery_limits("verify")
    with pytest.raises(BatteryError, match=r"'standard' has at least 432 cases; a verify run may have at most 100 "):
        pipeline.prepare(tree, requested_battery="standard", limits=strict)


def test_without_limits_the_worker_expands_as_before(tmp_path) -> None:  # noqa: ANN001
    """`optdrift check` on its user's own machine passes no limits: the battery is expanded."""
    tree = tmp_path / "tree"
    tree.mkdir()
    job = pipeline.prepare(tree, requested_battery="ci")
    assert len(job.cases) == len(BUILTIN_BATTERIES["ci"]().expand()) == 10


def test_a_layout_counts_as_its_flat_length_before_anything_is_built() -> None:
    # A layout case's work is its flat vector (tensors, alignment and guards): measured from the raw
    # JSON, so 64 tensors of 2**20 elements are refused on max_elements_per_case, not after expansion.
    from service.core.results import ParamLayout, TensorGroupSpec

    big = {"groups": [{"sizes": [1 << 20] * 64}]}
    raw = {"name": "x", "version": 1, "groups": [{"optimizers": ["adam", "lion"], "layouts": [big, big], "steps": 3}]}
    with pytest.raises(BatteryLimitError) as caught:
        measure_battery(raw, battery="x", limits=dataclasses.replace(ROOMY, max_elements_per_case=1 << 24))
    flat = ParamLayout(groups=[TensorGroupSpec(sizes=[1 << 20] * 64, hyper={})]).flat_size
    assert caught.value.field == "max_elements_per_case" and caught.value.value == flat
    load = measure_battery(raw, battery="x", limits=ROOMY)
    assert load.cases == 4 and load.case_step_elements == 4 * 3 * flat
