"""A CUDA error restarts the kernel host only when it cost the process its context
(worker/engine/cuda_errors.py).

The GPU tests run each scenario in a child process: a sticky error would leave this test process
without a usable context for every test after it. They skip without a GPU;
bench/gpu/sensitivity_cuda.sh runs them on the H200 before its catalogue.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from worker.engine.cuda_errors import context_lost, is_cuda_error

ROOT = Path(__file__).resolve().parents[3]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_errors_on_the_cpu_never_ask_for_a_restart():
    """On the CPU there is no context to lose, whatever the message says."""
    error = RuntimeError("CUDA error: an illegal memory access was encountered")
    assert is_cuda_error(error)
    assert not context_lost(error, torch.device("cpu"))


def test_only_runtime_errors_count_as_cuda_errors():
    assert not is_cuda_error(ValueError("lr must be positive"))
    assert is_cuda_error(RuntimeError("CUDA out of memory. Tried to allocate 4.00 TiB"))


def _child(script: str) -> str:
    """Run `script` in a fresh Python with this tree importable; its stdout (it must exit 0)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          env=env, timeout=240, cwd=ROOT)
    assert done.returncode == 0, f"child failed ({done.returncode}):\n{done.stdout}\n{done.stderr[-4000:]}"
    return done.stdout


@needs_cuda
def test_cuda_refused_allocation_keeps_the_context():
    """A request the driver refuses up front fails that call alone: no restart is asked for."""
    out = _child("""
        import torch
        from worker.engine.cuda_errors import context_lost, is_cuda_error
        device = torch.device("cuda")
        try:
            torch.empty(1 << 40, device=device)  # 4 TiB: refused before anything runs
        except Exception as error:
            assert is_cuda_error(error), repr(error)
            print("lost" if context_lost(error, device) else "usable")
        print(float(torch.ones(3, device=device).sum().item()))
    """)
    assert out.split() == ["usable", "3.0"]


@needs_cuda
def test_cuda_device_side_assert_loses_the_context():
    """An error raised while a kernel runs is sticky: the host must restart."""
    out = _child("""
        import torch
        from worker.engine.cuda_errors import context_lost
        device = torch.device("cuda")
        values = torch.zeros(4, device=device)
        try:
            values[torch.tensor([1000], device=device)] = 1.0  # out of bounds: a device-side assert
            torch.cuda.synchronize(device)
        except Exception as error:
            print("lost" if context_lost(error, device) else "usable")
    """)
    assert out.split() == ["lost"]


@needs_cuda
def test_cuda_refused_launch_in_a_wave_breaks_only_its_case():
    """The fast engine's wave goes on past a case whose kernel call CUDA refuses: that case reads
    broken with CUDA's message, the others finish (before, the whole wave stopped and the host
    restarted, once for each such case of the battery)."""
    out = _child("""
        import torch
        from worker.adapters.base import FamilyAdapter
        from worker.battery import BatterySpec
        from worker.engine.fast import run_cases_fast

        class PlainSgd(FamilyAdapter):
            # Plain torch SGD; its one-element cases ask CUDA for 4 TiB, as a kernel launched with
            # zero blocks is refused: before anything runs, the context untouched.
            def open(self, case, param, device):
                return {"case": case, "moment": torch.zeros_like(param)}
            def step(self, handle, param, grad, step):
                if handle["case"].size == 1:
                    torch.empty(1 << 40, device=param.device)
                handle["moment"].copy_(grad)
                param.add_(grad, alpha=-0.01)
            def state_for_digest(self, handle):
                return [handle["moment"]]

        battery = BatterySpec.model_validate({"name": "refused", "version": 1, "groups": [
            {"optimizers": ["adam"], "families": ["32bit"], "param_dtypes": ["float32"],
             "sizes": [1, 257, 4097], "seeds": [0, 1], "steps": 3,
             "gradients": [{"kind": "open"}], "points": [{"lr": 0.01, "weight_decay": 0.0}]}]})
        cases = battery.expand()
        results = run_cases_fast(cases, torch.device("cuda"), families={"32bit": PlainSgd()})
        for case, result in zip(cases, results):
            print(case.size, result.status, "CUDA out of memory" in (result.message or ""))
    """)
    rows = [line.split() for line in out.strip().splitlines()]
    assert sorted(rows) == sorted([["1", "broken", "True"]] * 2 + [["257", "ok", "False"], ["4097", "ok", "False"]] * 2)
