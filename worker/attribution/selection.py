"""Which changed cases attribution analyses: a bounded sample, one case per kind of case in turn.

Attribution re-runs a changed case's kernels on both builds with every step's parameters kept and
replays the float64 variant references over its whole trajectory: per case it costs more than the
case's battery run did. A change that moves 250 cases of the standard battery (the weight-decay
reorder) would make attribution the larger part of the run, while the 250 answers say the same
few things: cases of one optimizer, family, parameter dtype and hyperparameter point change the
same way. So at most `limit` cases are analysed, picked round-robin over those groups (every group
gets one before any gets two); the rest are listed with the case that stands for their group.
"""

from __future__ import annotations

from service.core.results import CaseSpec

# Enough for one case of every (optimizer, family, dtype) group of the standard battery's changed
# cases and a second hyperparameter point for most; the analysis of one case is a fraction of a
# second on a GPU and about a second on a 2-core CPU.
DEFAULT_LIMIT = 32


def group_of(case: CaseSpec) -> tuple:
    """Cases that change the same way: one optimizer, kernel family, dtype, hyperparameter point."""
    return (case.optimizer, case.family, case.param_dtype, tuple(sorted(case.hyper.items())))


def sample(cases: list[CaseSpec], limit: int = DEFAULT_LIMIT) -> tuple[list[CaseSpec], dict[str, str]]:
    """(the cases to analyse, in battery order; {left-out case id: the analysed case id standing
    for its group}). Round-robin over groups in the order they first appear, so every group is
    represented before any has two; within a group, battery order."""
    groups: dict[tuple, list[CaseSpec]] = {}
    for case in cases:
        groups.setdefault(group_of(case), []).append(case)
    queues = [list(members) for members in groups.values()]
    picked: list[CaseSpec] = []
    while len(picked) < limit and any(queues):
        for queue in queues:
            if queue and len(picked) < limit:
                picked.append(queue.pop(0))
    chosen = {case.case_id for case in picked}
    stands_for: dict[str, str] = {}
    for members in groups.values():
        representative = next((case.case_id for case in members if case.case_id in chosen), None)
        for case in members:
            if case.case_id not in chosen:
                stands_for[case.case_id] = representative or ""
    order = {case.case_id: index for index, case in enumerate(cases)}
    return sorted(picked, key=lambda case: order[case.case_id]), stands_for


def left_out_entry(representative: str) -> dict:
    """What a case that was not analysed reads in the stored attribution (class unknown, a note)."""
    bounded = "only a sample is analysed, one case per optimizer, family, dtype and hyperparameter point in turn"
    note = f"{bounded}; {representative} stands for this case's group" if representative else \
        f"{bounded}, and this case's group did not fit in it"
    return {"class": "unknown", "note": note, "sampled_out": True}
