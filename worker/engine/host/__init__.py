"""Kernel host: a subprocess that loads ONE build and runs cases on request.

Two builds of the same library cannot share a process (one op namespace), and a kernel that
segfaults, hangs or hits a CUDA error must cost one case, not the run. So each build runs in

    python -m worker.engine.host.child --library PATH --device cpu|cuda|auto [--threads N] [--adapter NAME]

(the adapter, worker.adapters, loads PATH and steps the cases; `bundled` by default), in the
sandbox. Two processes, three modules:

    child.py     the host itself, what runs in the box (batch.py its run_many, spare.py what a
                 spare prepares while it waits, faults.py the test-only fault injection)
    client.py    KernelHost, the worker's handle on it
    protocol.py  the JSON lines both speak: the parent writes one request per line on the host's
                 stdin, the host answers on its stdout

    -> {"op": "run", "case": <CaseSpec>, "params_out": "/tmp/x.f32" | null}
    <- {"result": <CaseResult>, "restart": false}
    -> {"op": "params", "case": <CaseSpec>, "params_out": "/tmp/x.f32"}   (a co-run: kernels only,
       the parameters after each step into params_out; the result's trajectory has digests only;
       with "states_out": a file in the scratch, every step's state leaves there too, for
       attribution: worker.engine.states_file)
    -> {"op": "run_many", "cases": [<CaseSpec>, ...]}       (fast mode: worker.engine.fast)
       with "params_out": a file in the scratch: the co-run's kernels-only waves writing every
       step's parameters there (worker.engine.params_file); with "known": {index: [series keys]}
       the reference cache's two passes (worker.engine.kernels_only, worker.engine.reference_cache)
    <- {"index": i, "result": <CaseResult>} per case as its group finishes, then {"done": true},
       or {"stopped": "<error>", "restart": bool} after an error the fast runner could not
       attribute to a case (the parent then runs the unanswered cases one by one)
    -> {"op": "time_kernels", "plan": {...}}   (worker/speed/timing.py: each kernel's step timed)
    <- {"timings": [...], "not_applicable": n, "not_timed": n, "seconds": s, "device": name, "restart": bool}
    -> {"op": "train", "run": <TrainingRunSpec>}  (worker/training/loop.py: a reference model trained
       with the build's optimizer, issue 46)
    <- {"training": <TrainingRunAnswer>, "restart": bool} or {"training_error": "<error>", "restart": bool}
    -> {"op": "exit"}
On start the host answers {"ready": true, "environment": <EnvironmentFingerprint>, "adapter":
<the adapter's describe()>}, or, when the adapter cannot be imported or cannot load the build,
{"ready": false, "error": <the whole message>} and exits. `--adapter-path DIR` (repeatable) puts
DIR first on sys.path, for an adapter module that lives outside the optdrift packages.

The names below are the parent's (the worker imports `KernelHost` from here).
"""

from worker.engine.host.client import STARTS_BEFORE_GIVING_UP, KernelHost, take_params_file
from worker.engine.host.faults import FAULT_ENV
from worker.engine.host.protocol import (
    MAX_ANSWER_BYTES,
    HostProtocolError,
    KernelHostError,
    checked_result,
    known_series_result,
    parse_answer,
    result_line,
)

__all__ = ["FAULT_ENV", "MAX_ANSWER_BYTES", "STARTS_BEFORE_GIVING_UP", "HostProtocolError", "KernelHost",
           "KernelHostError", "checked_result", "known_series_result", "parse_answer", "result_line",
           "take_params_file"]
