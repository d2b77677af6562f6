"""`python -m worker.attribution.child`: the attribution analysis (torch, float64, CPU) in its own
process, so the worker process that calls it never imports torch.

stdin: a JSON list of {"case": CaseSpec, "commit_file", "baseline_file", "first_divergent_step",
"baseline_ref64", and optionally "commit_states", "baseline_states" (worker.engine.states_file)}; stdout: {case_id: attribution} (worker/attribution/analysis.py), or for a case
whose analysis failed, {"error": "..."} so one bad case does not cost the others theirs.
`--serve`: one such list per stdin line, one answer per stdout line, until stdin ends.
"""

from __future__ import annotations

import json
import math
import os
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
    """stdin's JSON list answered on stdout; with --serve, each stdin line (a JSON list) answered by
    one stdout line until stdin ends (worker.attribution.pair_run.AnalysisChild)."""
    if "--serve" in sys.argv[1:]:
        import worker.attribution.analysis  # noqa: F401 - torch's import now, while the caller's kernels run

        for line in sys.stdin:
            if line.strip():
                json.dump(json_safe(answer(json.loads(line))), sys.stdout, allow_nan=False)
                sys.stdout.write("\n")
                sys.stdout.flush()
        # Every answer is written and flushed: skip the interpreter's teardown (torch's takes most
        # of a second here), which the caller would otherwise wait for.
        os._exit(0)
    json.dump(json_safe(answer(json.loads(sys.stdin.read()))), sys.stdout, allow_nan=False)
    return 0


def answer(requests: list[dict]) -> dict[str, dict]:
    """case id -> analysis (or {"error": ...}) of each request."""
    from worker.attribution.analysis import analyze_files

    answers = {}
    for request in requests:
        case = CaseSpec.model_validate(request["case"])
        try:
            answers[case.case_id] = analyze_files(case, request["commit_file"], request["baseline_file"],
                                                  int(request["first_divergent_step"]),
                                                  request.get("baseline_ref64"),
                                                  states_files=(request.get("commit_states"),
                                                                request.get("baseline_states")))
        except Exception as error:  # noqa: BLE001 - reported per case, never a verdict change
            answers[case.case_id] = {"error": f"{type(error).__name__}: {error}"}
    return answers


if __name__ == "__main__":
    sys.exit(main())
