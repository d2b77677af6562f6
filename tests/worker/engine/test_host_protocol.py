"""The kernel host's result lines (worker/engine/host/protocol.py result_line): written by pydantic's own
JSON serialiser, they must parse to exactly what json.dumps of model_dump gave before (the parent
reads both with json.loads), every float bit for bit: the trajectories' series are stored at full
precision and compared with the baseline's."""

from __future__ import annotations

import json
import math
import random
import struct

import pytest

from service.core.results import CaseResult, CaseSpec, RepeatCheck, Trajectory
from worker.engine.host import checked_result, parse_answer, result_line

CASE = CaseSpec(case_id="adam-protocol", optimizer="adam", hyper={"lr": 1e-3, "beta1": 0.9, "skip_zeros": False},
                seed=7, size=4096, steps=3)
# What a float series may hold: signed zeros, NaN, infinities, subnormals, the extremes, values
# whose shortest text is an exponent form (1e-05 in Python, other spellings elsewhere).
SPECIAL = [0.0, -0.0, math.nan, math.inf, -math.inf, 5e-324, -5e-324, 2.2250738585072014e-308,
           1.7976931348623157e308, 1e-5, 0.1, 1e16, 1e22, 123456789012345680.0, 2.0 ** -126]


def _bits(value: float) -> bytes:
    return b"nan" if math.isnan(value) else struct.pack("<d", value)  # NaN's payload is not kept (JSON "NaN")


def _floats(count: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return SPECIAL + [struct.unpack("<d", struct.pack("<Q", rng.getrandbits(64)))[0] for _ in range(count)]


def _parsed(line: str) -> dict:
    assert line.endswith("\n") and line.count("\n") == 1, "one protocol line"
    return parse_answer(line.encode())


@pytest.mark.parametrize("seed", range(4))
def test_a_result_line_carries_every_float_bit_for_bit(seed: int) -> None:
    values = _floats(20_000, seed)
    counts = [0, 1, -1, 2 ** 63 - 1, -(2 ** 63), 12345]
    result = CaseResult(case=CASE, status="ok", duration_s=0.00123,
                        trajectory=Trajectory(ref64_max_abs=values, ref64_max_rel=values[::-1],
                                              same_precision_max_abs=values[1::2], nonfinite_count=counts,
                                              digests=["od2:" + "0f" * 16] * 3))
    answer = _parsed(result_line(result, index=41))
    before = json.loads(json.dumps({"index": 41, "result": result.model_dump(mode="json")}))
    assert answer["index"] == 41 and set(answer) == {"index", "result"}
    got, old = checked_result(answer, CASE).trajectory, CaseResult.model_validate(before["result"]).trajectory
    for series in ("ref64_max_abs", "ref64_max_rel", "same_precision_max_abs"):
        original = getattr(result.trajectory, series)
        assert [_bits(v) for v in getattr(got, series)] == [_bits(v) for v in original], series
        assert [_bits(v) for v in getattr(old, series)] == [_bits(v) for v in original], series
    assert got.nonfinite_count == counts and got.digests == result.trajectory.digests


def test_a_broken_result_with_any_message_and_its_fields() -> None:
    message = 'quote " backslash \\ newline \n line separator \u2028 nul \x00 accent é'
    result = CaseResult(case=CASE, status="broken", message=message,
                        repeat_check=RepeatCheck(runs=2, differing=1, first_divergent_step=3))
    for fields in ({}, {"restart": True}, {"index": 0, "restart": False}):
        answer = _parsed(result_line(result, **fields))
        assert {k: v for k, v in answer.items() if k != "result"} == fields
        assert checked_result(answer, CASE) == result
        assert answer["result"] == json.loads(json.dumps(result.model_dump(mode="json")))


# ----------------------------------------------------------------------------- the other lines, one spelling
def test_requests_are_the_lines_the_host_reads() -> None:
    """The parent's requests, built in worker/engine/host/protocol.py, are the JSON lines the child
    dispatches on (their op and fields), one line each."""
    from worker.engine.host.protocol import (
        EXIT_REQUEST,
        case_request,
        encode_request,
        known_fields,
        load_request,
        run_many_request,
    )

    assert encode_request(EXIT_REQUEST) == b'{"op": "exit"}\n'
    assert case_request(CASE, None, params_only=False) == {"op": "run", "case": CASE.model_dump(mode="json"),
                                                           "params_out": None}
    assert case_request(CASE, "/s/p.f32", params_only=True)["op"] == "params"
    assert case_request(CASE, None, params_only=True)["op"] == "run"  # kernels alone need a file to write
    request = run_many_request([CASE], params_out="/s/w.f32", profile=True)
    request.update(known_fields({0: ["k"]}, by_key=True))
    assert json.loads(encode_request(request)) == {
        "op": "run_many", "cases": [CASE.model_dump(mode="json")], "params_out": "/s/w.f32", "profile": True,
        "known": {"0": ["k"]}, "known_by_key": True}
    assert run_many_request([CASE]) == {"op": "run_many", "cases": [CASE.model_dump(mode="json")]}
    assert load_request("/slot/0/x.so", "bundled", ["/slot/1"]) == {
        "op": "load", "library": "/slot/0/x.so", "adapter": "bundled", "adapter_path": ["/slot/1"]}


def test_the_hosts_lines_parse_back_and_a_foreign_index_is_refused() -> None:
    from worker.engine.host.protocol import (
        HostProtocolError,
        checked_index,
        done_line,
        known_series_line,
        not_ready_line,
        ready_line,
        shown_seconds,
        stopped_line,
    )

    assert parse_answer(ready_line({"device": "cpu"}, {"adapter": "bundled"}, {"import torch": 1.5}).encode()) == {
        "ready": True, "environment": {"device": "cpu"}, "adapter": {"adapter": "bundled"},
        "startup_s": {"import torch": 1.5}}
    assert parse_answer(not_ready_line("no such adapter").encode()) == {"ready": False, "error": "no such adapter"}
    assert parse_answer(stopped_line("RuntimeError: x", restart=True).encode()) == {
        "stopped": "RuntimeError: x", "restart": True}
    assert parse_answer(done_line({}, 3, None).encode()) == {"done": True, "params_s": {}, "inputs_taken": 3,
                                                             "phases": None}
    known = parse_answer(known_series_line(2, "ab" * 16, 0.25).encode())
    assert checked_index(known, [None, None, None]) == 2
    for index in (3, -1, True, "0", 1.0):  # out of range, a bool, not an int
        with pytest.raises(HostProtocolError, match="was not asked for"):
            checked_index({"index": index}, [None, None, None])
    with pytest.raises(HostProtocolError, match="answered already"):
        checked_index({"index": 0}, [object(), None])
    assert checked_index({"done": True}, [None]) is None
    # A host's own clock: bounded, names cut, non-numbers dropped, never trusted beyond showing.
    assert shown_seconds({"x" * 50: 1, "n": "no", "b": 2.5}, limit=2) == {"x" * 40: 1.0}
    assert shown_seconds(["not", "a", "dict"], limit=8) == {}
