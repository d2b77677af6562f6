"""worker/attribution/selection.py: attribution analyses a bounded sample of the changed cases, one
per (optimizer, family, dtype, hyperparameter point) in turn, and says for each case left out which
analysed case stands for it."""

from __future__ import annotations

from service.core.attribution_view import by_case
from service.core.results import CaseSpec
from worker.attribution.selection import group_of, left_out_entry, sample


def _case(index: int, optimizer: str = "adam", lr: float = 0.1, dtype: str = "float32") -> CaseSpec:
    return CaseSpec(case_id=f"{optimizer}-{dtype}-{lr}-{index}", optimizer=optimizer, param_dtype=dtype,
                    hyper={"lr": lr}, seed=index, size=8, steps=3)


def test_every_group_is_represented_before_any_has_two() -> None:
    cases = [_case(i) for i in range(10)] + [_case(i, "lion") for i in range(5)] + [_case(0, dtype="bfloat16")]
    picked, stands_for = sample(cases, limit=3)
    assert [group_of(c) for c in picked] == [group_of(cases[0]), group_of(cases[10]), group_of(cases[15])]
    assert len(stands_for) == len(cases) - 3
    assert stands_for[cases[1].case_id] == cases[0].case_id and stands_for[cases[11].case_id] == cases[10].case_id


def test_under_the_limit_every_case_is_analysed_in_battery_order() -> None:
    cases = [_case(i, lr=lr) for i, lr in enumerate((0.1, 0.01, 0.1, 0.001))]
    picked, stands_for = sample(cases, limit=32)
    assert picked == cases and stands_for == {}


def test_a_group_that_does_not_fit_is_said_so() -> None:
    cases = [_case(i, lr=10.0 ** -i) for i in range(5)]  # five groups, room for two
    picked, stands_for = sample(cases, limit=2)
    assert picked == cases[:2] and set(stands_for.values()) == {""}
    assert "did not fit" in left_out_entry("")["note"]


def test_a_left_out_case_reads_as_not_attributed_with_its_stand_in() -> None:
    shown = by_case({"attribution": {"adam-1": left_out_entry("adam-0")}})["adam-1"]
    assert shown.kind == "unknown" and "adam-0 stands for this case's group" in shown.text
