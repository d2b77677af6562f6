"""`python -m worker.attribution.child`: the attribution analysis (torch, float64, CPU) in its own
process, so the worker process that calls it never imports torch.

stdin: a JSON list of {"case": CaseSpec, "commit_file", "baseline_file", "first_divergent_step",
"baseline_ref64", and optionally "commit_states", "baseline_states" (worker.engine.states_file)}; stdout: {case_id: attribution} (worker/attribution/analysis.py), or for a case
whose analysis failed, {"error": "..."} so one bad case does not cost the others theirs.
"""

from __future__ import annotations

import json
import math
import sys

from service.core.results import CaseSpec


def json_safe(value):  # noqa: ANN001, ANN201
    """Non-finite floats as the strings service.core.results writes ("NaN", "Infinity"): PostgreSQL's
    JSON rejects bare NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


def main() -> int:
    from worker.attribution.analysis import analyze_files

    answers = {}
    for request in json.loads(sys.stdin.read()):
        case = CaseSpec.model_validate(request["case"])
        try:
            answers[case.case_id] = analyze_files(case, request["commit_file"], request["baseline_file"],
                                                  int(request["first_divergent_step"]),
                                                  request.get("baseline_ref64"),
                                                  states_files=(request.get("commit_states"),
                                                                request.get("baseline_states")))
        except Exception as error:  # noqa: BLE001 - reported per case, never a verdict change
            answers[case.case_id] = {"error": f"{type(error).__name__}: {error}"}
    json.dump(json_safe(answers), sys.stdout, allow_nan=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
