"""The environment fingerprint: what a bit-exact result is only reproducible within.

Called inside a kernel host (it touches CUDA when the device is a GPU), never in a Celery parent.
"""

from __future__ import annotations

import platform
import re

import torch

from service.core.results import EnvironmentFingerprint
from worker.build.host_cpu import isa_digest


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-")


def resolve_device(device: str) -> torch.device:
    """'auto' -> cuda when a GPU is visible, else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} requested but torch sees no CUDA device; use --device cpu")
    return resolved


def fingerprint(device: torch.device, *, cpu_features: tuple[str, ...] | None = None) -> EnvironmentFingerprint:
    """`cpu_features`: the CPU's ISA features (None: this machine's; tests pass others)."""
    cpu_capability = torch.backends.cpu.get_cpu_capability()
    cpu_isa = isa_digest(cpu_features)
    common = {"torch_version": torch.__version__, "python_version": platform.python_version(),
              "platform": f"{platform.system()}-{platform.machine()}", "cpu_capability": cpu_capability,
              "cpu_isa": cpu_isa}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        capability = f"{props.major}.{props.minor}"
        driver = None
        try:  # the driver version is informative only; results depend on CUDA runtime + device
            driver = str(torch._C._cuda_getDriverVersion())
        except Exception:  # noqa: BLE001 - private API; absence is not an error
            pass
        key = f"cuda-sm{props.major}{props.minor}-{_slug(props.name)}-cuda{torch.version.cuda}-torch{torch.__version__}"
        return EnvironmentFingerprint(device_kind="cuda", device_name=props.name, compute_capability=capability,
                                      driver_version=driver, cuda_version=torch.version.cuda,
                                      class_key=key, **common)
    # CPU results depend on the ISA torch dispatches its vector kernels to (and the kernels' own
    # vectorisation), so the capability is part of the class; and a project built with
    # -march=native compiles for every ISA feature of the CPU, so those are too (cpu_isa: two CPUs
    # with the same torch capability can still build a native library differently).
    key = f"cpu-{platform.machine()}-{cpu_capability}-{cpu_isa}-torch{torch.__version__}"
    return EnvironmentFingerprint(device_kind="cpu", device_name=platform.processor() or platform.machine(),
                                  class_key=key, **common)
