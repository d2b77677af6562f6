"""worker/attribution/selection.py: attribution analyses a bounded sample of the changed cases, one
per (optimizer, family, dtype, hyperparameter point) in turn, and says for each case left out which
analysed case stands for it."""

from __future__ import annotations

from service.core.attribution_view import by_case
from service.core.results import CaseSpec
from worker.attribution.selection import group_of, left_out_entries, left_out_entry, sample


def _case(index: int, optimizer: str = "adam", lr: float = 0.1, dtype: str = "float32",
          family: str = "32bit") -> CaseSpec:
    return CaseSpec(case_id=f"{optimizer}-{family}-{dtype}-{lr}-{index}", optimizer=optimizer, param_dtype=dtype,
                    family=family, hyper={"lr": lr}, seed=index, size=8, steps=3)


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


def test_a_group_that_does_not_fit_names_the_nearest_analysed_case_of_its_kind() -> None:
    cases = [_case(i, lr=10.0 ** -i) for i in range(5)] + [_case(5, "lion", lr=1e-9)]  # six groups, room for two
    picked, stands_for = sample(cases, limit=2)
    assert picked == [cases[0], cases[5]]
    assert {stands_for[c.case_id] for c in cases[1:5]} == {cases[0].case_id}
    entries = left_out_entries(cases, stands_for)
    assert "did not fit in it, adam-32bit-float32-1.0-0 is the nearest analysed case" in entries[cases[1].case_id]["note"]
    assert "no case of this optimizer and family fitted" in left_out_entry("")["note"]


def test_every_optimizer_and_family_comes_before_more_hyperparameter_points() -> None:
    # In battery order the 8-bit cases come after every 32-bit hyperparameter point: a change that
    # moves forty 32-bit points must still have its 8-bit cases analysed.
    points = [_case(i, lr=10.0 ** -i) for i in range(40)]
    bf16 = [_case(0, dtype="bfloat16")]
    eight_bit = [_case(0, family="8bit_blockwise"), _case(1, "lion", family="8bit_blockwise")]
    picked, stands_for = sample(points + bf16 + eight_bit, limit=4)
    assert [group_of(c)[:3] for c in picked] == [("adam", "32bit", "float32"), ("adam", "32bit", "bfloat16"),
                                                 ("adam", "8bit_blockwise", "float32"),
                                                 ("lion", "8bit_blockwise", "float32")]
    assert all(stands_for[c.case_id] == points[0].case_id for c in points[1:])


def test_a_left_out_case_reads_as_not_attributed_with_its_stand_in() -> None:
    shown = by_case({"attribution": {"adam-1": left_out_entry("adam-0")}})["adam-1"]
    assert shown.kind == "unknown" and "adam-0 stands for this case's group" in shown.text
