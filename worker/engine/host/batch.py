"""The kernel host's `run_many`: a whole battery in one request (worker.engine.fast and the
kernels-only runs of worker.engine.kernels_only), answered case by case as each group finishes.

Cases the adapter cannot run are answered `not_applicable` first, as the one-case path answers
them; an error the fast runner cannot attribute to a case ends the request with a stopped line,
and the parent runs the unanswered cases one by one.
"""

from __future__ import annotations

import time
from typing import TextIO

from service.core.results import CaseResult, CaseSpec
from worker import gc_policy
from worker.engine.host import faults, spare
from worker.engine.host.protocol import done_line, known_series_line, result_line, stopped_line


class _Answers:
    """Writes the request's answers, timing them into `phases` when the parent asked for a profile."""

    def __init__(self, protocol: TextIO, phases: dict[str, float] | None):
        self.protocol, self.phases = protocol, phases

    def result(self, index: int, result: CaseResult) -> None:
        if self.phases is None:
            self.protocol.write(result_line(result, index=index))
            return
        began = time.perf_counter()
        self.protocol.write(result_line(result, index=index))
        self.phases["answers"] = self.phases.get("answers", 0.0) + time.perf_counter() - began

    def known(self, index: int, key: str, result: CaseResult) -> None:
        began = time.perf_counter()
        self.protocol.write(known_series_line(index, key, result.duration_s))
        if self.phases is not None:
            self.phases["answers"] = self.phases.get("answers", 0.0) + time.perf_counter() - began


def _runnable(cases: list[CaseSpec], device, protocol: TextIO, adapter, answers: _Answers) -> list[int]:  # noqa: ANN001
    """The indices of the cases to run; the others are answered here (not applicable) or, under
    test-only fault injection, crash or lie here."""
    runnable = []
    for index, case in enumerate(cases):
        faults.inject(case)  # test-only: a crash here must fall back to one case at a time
        if faults.lie(case, protocol, index):
            continue
        unsupported = adapter.unsupported(case, device)
        if unsupported:  # as the one-case path answers it
            answers.result(index, CaseResult(case=case, status="not_applicable", message=unsupported))
        else:
            runnable.append(index)
    return runnable


def answer(request: dict, device, protocol: TextIO, adapter, families) -> bool:  # noqa: ANN001
    """Answer one run_many request; False when the host must exit (a CUDA error left the context
    unusable)."""
    import torch

    from worker.engine import step_inputs
    from worker.engine.cuda_errors import context_lost
    from worker.engine.kernels_only import run_request

    parse_started = time.perf_counter()
    cases = [CaseSpec.model_validate(c) for c in request["cases"]]
    phases: dict[str, float] | None = {} if request.get("profile") else None
    answers = _Answers(protocol, phases)
    runnable = _runnable(cases, device, protocol, adapter, answers)
    if phases is not None:
        phases["parse"] = time.perf_counter() - parse_started  # the cases read, before `request` starts
    started, taken_before, full_before = time.perf_counter(), step_inputs.taken(), gc_policy.full_collections()
    ready = spare.take_ready_waves(request, families)
    if phases is not None:
        phases["ready waves join"] = time.perf_counter() - started
    try:
        split = run_request(request, cases, runnable, device, families, answers.result, phases,
                            answers.known if request.get("known_by_key") else None, ready)
    except Exception as error:  # noqa: BLE001 - reported; the parent falls back to one case at a time
        restart = context_lost(error, device)
        protocol.write(stopped_line(f"{type(error).__name__}: {error}", restart=restart))
        return not restart
    finally:
        if ready is not None:
            ready.close()  # what the run did not take
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if phases is not None:
        phases["request"] = time.perf_counter() - started
        phases["full collections"] = gc_policy.full_collections() - full_before  # 0 while held
    protocol.write(done_line(split, step_inputs.taken() - taken_before, phases))
    return True
