"""A larger probe of a changed case whose drift test had too few elements to say anything.

A change within rounding is rounding-level unless its final roundings flip one way
(worker/attribution/drift.py). That sign test needs elements that moved: in a bfloat16 or float16
case of 1031 elements a float32 bias correction (`powf`) moves a few to a few dozen, a one-element
case has its one move, and a sign test over so few cannot tell a drift from rounding at the test's
false-alarm rate (13 of 13 one way, against a shared-factor allowance: p = 4.6e-4, above the 2.5e-4
needed). Such a
call is *underpowered*, not evidence of rounding: the test would miss a drift that sends three moves
in four one way (DRIFT_TO_DETECT). The probe asks the same question with more evidence: the same
case (optimizer, family, dtype, hyperparameters, gradient stream, seed, steps) at PROBE_ELEMENTS
elements, on both builds, analysed the same way. Its call stands for the case where it finds more
than rounding; where it too reads rounding-level, the case stays so, now with evidence; either way
the case's own figures (ulps, first step) are its own and the probe is recorded beside them.

A rounding-level change probed this way reads systematic with the drift test's own false-alarm
rate (1e-3), once per underpowered case. A probe costs one more case on each build, in new kernel
hosts (a torch.compile library compiles the new size).
"""

from __future__ import annotations

import math

from service.core.results import CaseSpec
from service.core.wording import plural
from worker.attribution import drift
from worker.battery import make_case

# Elements of a probe: ~16x the quick battery's n1031 cases, well within a CPU second per step.
PROBE_ELEMENTS = 16384
# The one-way share of moved elements the drift test must be able to see for its "not systematic"
# to count: three in four (at p0 = 1/2 that takes 49 moved elements at the test's rate).
DRIFT_TO_DETECT = 0.75


def underpowered(record: dict) -> bool:
    """A rounding-level call resting on too few moved elements: a drift test in which even a fair
    coin's DRIFT_TO_DETECT share of its moves one way would not have read systematic (fewer than 49
    moved), or whose shared-factor allowance leaves room for that share and its moves are still too
    few to see it. A test with enough moves whose allowance alone explains that share is decided:
    there the change is rounding-level by the test's construction (a float32 FMA case: 13853 moved,
    allowance 16149), and more elements would say the same."""
    if record.get("class") != "rounding-level" or not record.get("drift"):
        return False
    threshold = drift.FALSE_ALARM / drift.TAILS
    for test in record["drift"]:
        moved = int(test.get("moved") or 0)
        one_way = math.ceil(DRIFT_TO_DETECT * moved)
        if not moved or drift.binomial_upper_tail(moved, one_way, 0.5) > threshold:
            return True
        p0 = min(1.0, 0.5 + float(test.get("allowance") or 0.0) / (2 * moved))
        if p0 < DRIFT_TO_DETECT and drift.binomial_upper_tail(moved, one_way, p0) > threshold:
            return True
    return False


def probe_case(case: CaseSpec) -> CaseSpec | None:
    """The case at PROBE_ELEMENTS elements (None: it is that large already)."""
    if case.size >= PROBE_ELEMENTS:
        return None
    return make_case(optimizer=case.optimizer, family=case.family, param_dtype=case.param_dtype,
                     hyper=dict(case.hyper), gradient=case.gradient, seed=case.seed, size=PROBE_ELEMENTS,
                     steps=case.steps)


def combine(record: dict, probe: CaseSpec, probed: dict | None, probe_step: int | None,
            *, missing: str | None = None) -> dict:
    """The case's record with the probe's evidence: the probe's call where it is more than rounding,
    the case's own figures kept; a note either way. `missing`: why the probe has no analysis (it did
    not run on both builds, it did not change)."""
    moved = max((int(t.get("moved") or 0) for t in record.get("drift") or []), default=0)
    few = f"{plural(moved, 'element')} moved, too few for the drift test; the same case at n={probe.size}"
    out = dict(record)
    if missing or probed is None or "error" in probed or probed.get("class") in (None, "unknown"):
        why = missing or (probed or {}).get("error") or "the probe could not be analysed"
        out["probe"] = {"case_id": probe.case_id, "note": why}
        out["note"] = _joined(record.get("note"), f"{few}: {why}")
        return out
    out["probe"] = {"case_id": probe.case_id, "class": probed.get("class"), "variant": probed.get("variant"),
                    "scale": probed.get("scale"), "first_divergent_step": probe_step, "drift": probed.get("drift"),
                    "note": probed.get("note")}
    if probed["class"] == "rounding-level":
        out["note"] = _joined(record.get("note"), f"{few} is rounding-level too")
        return out
    if not moved and not record.get("peak_ulps"):
        # Not one element of this case moved by one ulp at any step: nothing of it shows the
        # probe's change, so the probe's call is beside it, never its own (issue 47: a case with no
        # moved element is never called semantic).
        out["note"] = _joined(record.get("note"), f"{few} reads {_call(probed)}, not this case's call: none of its "
                                                  "own elements moved")
        return out
    for key in ("class", "variant", "label", "kind", "drift_fits", "next_best", "next_best_ratio"):
        if key in probed:
            out[key] = probed[key]
        else:
            out.pop(key, None)
    elements = record.get("replayed_elements")
    out["note"] = (f"within rounding on its {plural(elements, 'element') if elements else 'elements'}; {few} reads "
                   f"{_call(probed)}" + (f": {probed['note']}" if probed.get("note") else ""))
    return out


def _call(probed: dict) -> str:
    return f"{probed['variant']} ({probed['class']})" if probed.get("variant") else probed["class"]



def _joined(first: str | None, second: str) -> str:
    return f"{first}; {second}" if first else second
