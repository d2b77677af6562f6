"""The GitHub Action's outputs from `optdrift submit --wait --format json`, or from `optdrift compare
--run --format json` in its environment-comparison mode (action.yml runs them): `verdict`, `run-url`
and `exit-code` as `name=value` lines for $GITHUB_OUTPUT.

Client-side: only the standard library (the Action installs the client, not the server).

    python -m service.notify.action_outputs RESULT.json EXIT_CODE >> "$GITHUB_OUTPUT"
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from service.core import outcomes  # the standard library alone, as this module

# The CLI's exit codes (README "Exit codes") and the word each one means: an outcome's name
# (service/core/outcomes.py), or one of the two codes no outcome gives. 8 (not buildable) has no
# word of its own: the run's status says it.
_BY_EXIT_CODE = {**outcomes.OUTCOME_BY_EXIT_CODE, outcomes.EXIT_USAGE: "bad-input", outcomes.EXIT_OPTDRIFT_ERROR: "error"}


def _run_word(run: dict) -> str:
    verdict = run.get("verdict") or {}
    if run.get("status") == "error":
        return "error"
    if verdict.get("acknowledged"):
        return "acknowledged"
    return verdict.get("outcome") or run.get("status") or "unknown"


def outputs(document: dict | None, exit_code: int) -> dict[str, str]:
    """verdict: the word of the exit code (for 0: the runs' own word, unchanged / no-baseline /
    acknowledged); run-url: the page of the run that decided it (the first run otherwise)."""
    if document and "comparison" in document:  # optdrift compare: environment B's run decides
        word = _BY_EXIT_CODE.get(exit_code) or document["comparison"].get("verdict") or "unknown"
        return {"verdict": word, "run-url": str(document.get("run_url") or ""), "exit-code": str(exit_code)}
    runs = (document or {}).get("runs") or []
    urls = {str(key): value for key, value in ((document or {}).get("dashboard_urls") or {}).items()}
    word = _BY_EXIT_CODE.get(exit_code)
    deciding = next((run for run in runs if word and _run_word(run) == word), runs[0] if runs else None)
    if word is None:
        word = _run_word(deciding) if deciding else "unknown"
    url = urls.get(str(deciding["id"]), "") if deciding else ""
    return {"verdict": word, "run-url": url, "exit-code": str(exit_code)}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m service.notify.action_outputs RESULT.json EXIT_CODE", file=sys.stderr)
        return 2
    path, code = Path(argv[0]), int(argv[1])
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError):
        document = None  # the submit failed before printing its document (exit 2 or 4)
    for name, value in outputs(document, code).items():
        print(f"{name}={value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
