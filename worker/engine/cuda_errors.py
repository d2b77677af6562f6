"""Whether a kernel's CUDA error cost the process its CUDA context.

CUDA errors come in two kinds. A launch the driver refuses (a grid of zero blocks, too many
threads per block, too much shared memory) or an allocation it cannot satisfy fails that one call
and leaves the context usable: the error is cleared when it is read. An error raised while a kernel
runs (an illegal address, a device-side assert) is sticky: every later call in the process fails
with it, and only a new process gets a working context.

The kernel host restarts only for the second kind. Restarting for the first would cost a host
start (seconds: importing torch, a new context) for every case that tripped it: a mutant that launches
zero blocks on one-element 8-bit cases turned a 10 s battery into minutes
(tests/worker/engine/test_cuda_errors.py, run on the H200).
"""

from __future__ import annotations

import torch


def is_cuda_error(error: BaseException) -> bool:
    """An error that came from the CUDA runtime (torch says "CUDA" in its message, or raises its
    AcceleratorError)."""
    return "CUDA" in str(error) or type(error).__name__ == "AcceleratorError"


def context_usable(device: torch.device) -> bool:
    """True when `device`'s context still runs work: everything queued finishes, and a small
    kernel launched now gives the right answer. A sticky error fails the synchronize or the launch."""
    try:
        torch.cuda.synchronize(device)
        probe = torch.arange(4, dtype=torch.float32, device=device)
        return float(probe.mul(2).sum().item()) == 12.0
    except Exception:  # noqa: BLE001 - any failure here means the context is not to be trusted
        return False


def context_lost(error: BaseException, device: torch.device) -> bool:
    """True when `error`, raised by work on `device`, left the process without a usable CUDA context
    (the kernel host must exit and be started again); False for any other error, on any device."""
    return device.type == "cuda" and is_cuda_error(error) and not context_usable(device)
