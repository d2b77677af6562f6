"""Case names (service/core/case_names.py): every case id the batteries make splits back into the
parts make_case joined, and the hash is kept apart."""

from __future__ import annotations

from service.core.case_names import case_hash, case_label, case_name, case_parts
from worker.battery import BUILTIN_BATTERIES


def test_every_builtin_case_splits_into_its_parts_and_rejoins_to_its_label():
    for make in BUILTIN_BATTERIES.values():
        for case in make().expand():
            parts = case_parts(case.case_id)
            assert ".".join(parts) == case_label(case.case_id)
            assert parts[:3] == [case.optimizer, case.family, {"float32": "fp32", "float16": "fp16",
                                                               "bfloat16": "bf16"}[case.param_dtype]]
            assert parts[3] == f"lr={case.hyper['lr']!r}" and parts[4] == f"wd={case.hyper['weight_decay']!r}"
            assert parts[-2:] == [f"s{case.seed}", f"t{case.steps}"]
            assert parts[-3] == (f"n{case.size}" if case.layout is None else parts[-3]) and parts[-3][0] in "nL"
            assert case_hash(case.case_id) == case.case_id.rsplit("#", 1)[1]


def test_a_name_reads_with_separators_and_no_hash():
    name = case_name("adam.32bit.fp32.lr=0.1.wd=0.1.open+z0.25.n4097.s0.t20#1928207e")
    assert name == "adam · 32bit · fp32 · lr=0.1 · wd=0.1 · open+z0.25 · n4097 · s0 · t20"
    assert case_hash("no-hash") is None
