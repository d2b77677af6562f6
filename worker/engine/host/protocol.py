"""The JSON lines a kernel host and its parent speak (worker/engine/host/__init__.py has the list).

Both sides build their lines here, so a message has one spelling. The parent's readers
(`parse_answer`, `checked_result`, `known_series_result`) treat every line as untrusted: the host
runs submitted code, and a host that answers something other than a valid answer to what was asked
raises HostProtocolError. Only pydantic and the pure core are imported: the child loads this in the
box, where nothing of `service` but `service.core` is shown.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping

from service.core.results import CaseResult, CaseSpec

# One answer carries one case's per-step arrays: a few MB for the longest battery cases.
MAX_ANSWER_BYTES = 64 * 1024**2
# The parent's first line to a spare that is to go without a build, and to any host at the end.
EXIT_REQUEST = {"op": "exit"}


class KernelHostError(RuntimeError):
    pass


class HostProtocolError(KernelHostError):
    """The host answered something that is not a valid answer to what was asked: it runs submitted
    code, so its answers are checked like any untrusted input."""


# ----------------------------------------------------------------------------- requests (parent -> host)
def encode_request(request: Mapping) -> bytes:
    return (json.dumps(request) + "\n").encode()


def case_request(case: CaseSpec, params_out: str | None, *, params_only: bool, states_out: str | None = None) -> dict:
    """One case: {"op": "run"} (with `params_out`, the parameters after each step written there), or
    {"op": "params"} (a co-run: the kernels alone, digests only) when `params_only` and `params_out`;
    with `states_out` (params only) every step's state leaves as well (worker.engine.states_file)."""
    request = {"op": "params" if params_only and params_out else "run", "case": case.model_dump(mode="json"),
               "params_out": params_out}
    if states_out and params_only and params_out:
        request["states_out"] = states_out
    return request


def run_many_request(cases: list[CaseSpec], *, params_out: str | None = None, profile: bool = False) -> dict:
    """A battery through the host's fast runner: `params_out` a file in the host's scratch (the
    co-run's kernels-only waves); `profile`: the host times its wave phases."""
    request: dict = {"op": "run_many", "cases": [c.model_dump(mode="json") for c in cases]}
    if params_out:
        request["params_out"] = params_out
    if profile:
        request["profile"] = True
    return request


def known_fields(known: Mapping[int, list[str]], *, by_key: bool) -> dict:
    """What a run_many request adds for the reference cache: its known series keys per case index,
    and (`by_key`) that a case whose digests form one of them is answered by its key alone."""
    fields: dict = {"known": {str(index): keys for index, keys in known.items()}}
    if by_key:
        fields["known_by_key"] = True
    return fields


def load_request(library: str, adapter: str, adapter_path: list[str], compile_cache: str | None = None) -> dict:
    """A spare's build: the library and adapter as its slot shows them (and the build's compile
    cache, when it has one: worker.engine.compile_cache)."""
    request = {"op": "load", "library": library, "adapter": adapter, "adapter_path": adapter_path}
    if compile_cache:
        request["compile_cache"] = compile_cache
    return request


# ----------------------------------------------------------------------------- answers (host -> parent)
def _line(fields: Mapping) -> str:
    return json.dumps(fields) + "\n"


def ready_line(environment: dict, adapter: dict[str, str], startup_s: dict[str, float]) -> str:
    return _line({"ready": True, "environment": environment, "adapter": adapter, "startup_s": dict(startup_s)})


def not_ready_line(error: str) -> str:
    return _line({"ready": False, "error": error})


def result_line(result: CaseResult, **fields: object) -> str:
    """The protocol line {**fields, "result": result}. pydantic writes the result's JSON itself,
    several times faster than json.dumps of model_dump, which first builds every value as a Python
    object (bench/result_lines.py compares them); json parses both to the same values, every float bit for bit
    (tests/worker/engine/test_host_protocol.py)."""
    head = json.dumps(fields)[:-1]  # '{"index": 3' of '{"index": 3}', or '{' for no fields
    return f'{head}{", " if fields else ""}"result": {result.model_dump_json()}}}\n'


def known_series_line(index: int, key: str, duration_s: float) -> str:
    """A case whose digests form a known series: its key alone, not its digests (~3.5 KB a
    100-step case), which the parent holds already and would parse, check and hash again
    (bench/parent_share.py)."""
    return _line({"index": index, "series": key, "duration_s": duration_s})


def stopped_line(error: str, *, restart: bool) -> str:
    """run_many stopped on an error it could not attribute to a case."""
    return _line({"stopped": error, "restart": restart})


def done_line(params_s: dict[str, float], inputs_taken: int, phases: dict[str, float] | None) -> str:
    return _line({"done": True, "params_s": params_s, "inputs_taken": inputs_taken, "phases": phases})


def plain_json_line(answer: Mapping) -> str:
    """An answer of another kind (time_kernels), as it is."""
    return _line(answer)


# ----------------------------------------------------------------------------- the parent's checks
def parse_answer(line: bytes) -> dict:
    try:
        answer = json.loads(line)
    except ValueError:
        raise HostProtocolError("the kernel host answered a line that is not JSON") from None
    if not isinstance(answer, dict):
        raise HostProtocolError("the kernel host answered JSON that is not an object")
    return answer


def known_series_result(answer: dict, index: int, known_result: Callable | None) -> CaseResult:
    """The result of a known-series answer {"index", "series", "duration_s"}: what
    `known_result(index, series key, duration)` makes of it (the reference cache's stored
    trajectory). The answer names only a key; which keys may be named for the case is the
    resolver's to check."""
    series, duration = answer.get("series"), answer.get("duration_s", 0.0)
    if known_result is None:
        raise HostProtocolError("the kernel host answered a known series although none was asked for")
    if not isinstance(series, str) or len(series) > 64:
        raise HostProtocolError("the kernel host's known-series answer has no valid series key")
    if isinstance(duration, bool) or not isinstance(duration, (int, float)) or not math.isfinite(duration):
        raise HostProtocolError("the kernel host's known-series answer has no valid duration")
    return known_result(index, series, float(duration))


def checked_result(answer: dict, case: CaseSpec) -> CaseResult:
    """The answer's CaseResult, which must be about `case` (the one asked for)."""
    try:
        result = CaseResult.model_validate(answer["result"])
    except (KeyError, ValueError):
        raise HostProtocolError("the kernel host's answer has no valid result") from None
    if result.case != case:
        raise HostProtocolError(f"the kernel host answered for case {result.case.case_id!r}, "
                                f"not the one asked for ({case.case_id!r})")
    return result


def checked_index(answer: dict, answered: list) -> int | None:
    """The case index a run_many answer names (None: the done or stopped line); it must be one
    asked for (an index into `answered`) and not answered yet (`answered[index] is None`)."""
    index = answer.get("index")
    if index is None:
        return None
    if (isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(answered)
            or answered[index] is not None):
        raise HostProtocolError(f"the kernel host answered for case index {index!r}, "
                                "which was not asked for or was answered already")
    return index


def shown_seconds(value: object, *, limit: int) -> dict[str, float]:
    """A host's self-reported seconds per phase (its own clock: shown, never trusted): at most
    `limit` entries, names cut to 40 characters, non-numbers dropped, anything but a dict empty."""
    if not isinstance(value, dict):
        return {}
    return {str(k)[:40]: float(v) for k, v in list(value.items())[:limit] if isinstance(v, (int, float))}
