"""The fused od2 observation: `optdrift_od2::observe_rows` of the harness library
(worker/engine/harness.py, sources in worker/engine/harness_csrc).

Why. The fast engine observes every arena every step: each case's non-finite count and its two
od2 lanes (worker/engine/digest.py). As torch ops that is about twenty int64 kernels per arena,
each reading and writing the arena widened to 8 bytes an element, which makes the observation,
not the kernels under test, most of a warm battery's GPU time. The op reads each element once. Its sums are modulo 2^64 like the torch ops', so the
digests are the same bits either way (tests/worker/engine/test_od2_op.py compares them on every dtype; the fast
engine's identity tests run with it). `OPTDRIFT_OD2_FUSED=0` turns it off (the torch ops then run).
"""

from __future__ import annotations

import torch

from worker.engine import harness

NAMESPACE = "optdrift_od2"
_DISPATCH_KEY = {"cpu": "CPU", "cuda": "CUDA"}


def fused_for(device: torch.device) -> bool:
    """Whether observe_rows runs on `device` in this process (loaded, switched on, built for it)."""
    key = _DISPATCH_KEY.get(torch.device(device).type)
    return (harness.module() is not None and key is not None and harness.switched_on("OPTDRIFT_OD2_FUSED")
            and torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::observe_rows", key))


def observe_rows(data: torch.Tensor, lengths: torch.Tensor, slot: int, case_index: torch.Tensor,
                 counts: torch.Tensor) -> None:
    """counts[0, case_index[r]] += non-finite elements of row r; counts[1 and 2, ...] += od2's two
    lanes of row r's first lengths[r] elements, salted for state slot `slot` (0: the parameter)."""
    torch.ops.optdrift_od2.observe_rows(data, lengths, slot, case_index, counts)
