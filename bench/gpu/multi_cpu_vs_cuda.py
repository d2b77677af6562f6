"""Diagnostic (issue 45): the bundled multi-tensor op and the one-tensor op, CPU against CUDA, per
optimizer, dtype and alignment: how many parameter elements differ and by how many ulps. Prints a
table; run where a GPU is (bench/gpu/h200_layouts45.sh calls it)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from worker.adapters import bundled_ops
from worker.battery import OPTIMIZER_HYPER_DEFAULTS
from worker.build import build_extension

result = build_extension(Path("csrc"), cache_dir=Path(os.environ.get("OPTDRIFT_BUILD_CACHE_DIR", "/tmp/diag-cache")))
assert result.ok, result.error
bundled_ops.load_build(result.library_path)
SIZES, GROUP_OF = (1, 65536 + 5, 300), [0, 0, 1]
print(f"{'optimizer':10} {'dtype':9} {'offset':6} {'multi: differing':>17} {'one-tensor: differing':>22}")
for optimizer in ("adam", "ademamix", "lion", "momentum", "rmsprop", "adagrad"):
    hyper = {**OPTIMIZER_HYPER_DEFAULTS[optimizer], "lr": 0.05, "weight_decay": 0.1}
    hypers = [hyper, {**hyper, "lr": 0.01, "weight_decay": 0.0}]
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for offset in (0, 1):
            generator = torch.Generator().manual_seed(2)
            storage = [torch.randn(n + 1, generator=generator).to(dtype) for n in SIZES]
            multi, single = [], []
            for device in ("cpu", "cuda"):
                params = [s.to(device, copy=True)[offset:offset + n] for s, n in zip(storage, SIZES)]
                ones = [p.clone() for p in params]
                states = {name: [torch.zeros(p.shape, dtype=torch.float32, device=device) for p in params]
                          for name in bundled_ops.OPTIMIZER_STATES[optimizer]}
                one_states = [{name: torch.zeros(p.shape, dtype=torch.float32, device=device)
                               for name in bundled_ops.OPTIMIZER_STATES[optimizer]} for p in params]
                shared = bundled_ops.new_multi_state(optimizer, len(params), 2)
                grad_generator = torch.Generator().manual_seed(5)
                for step in range(1, 4):
                    grads = [torch.randn(n, generator=grad_generator).to(dtype).to(device) for n in SIZES]
                    bundled_ops.multi_step(optimizer, params, grads, states, shared, GROUP_OF, hypers)
                    for p, g, st, group in zip(ones, grads, one_states, GROUP_OF):
                        bundled_ops.step(optimizer, p, g, st, step=step, hyper=hypers[group])
                multi.append(torch.cat([p.float().cpu() for p in params]))
                single.append(torch.cat([p.float().cpu() for p in ones]))
            differ = lambda pair: int((pair[0] != pair[1]).sum())  # noqa: E731
            print(f"{optimizer:10} {str(dtype)[6:]:9} {offset:6} {differ(multi):17} {differ(single):22}")
