"""Reference drift told apart (issue 36): torch.optim changes under the same kernels between a commit
and its baseline, and the verdict says "reference changed" for the cases measured against it, with
the kernels' verdict (trajectory against trajectory) as it was.

The stand-in for a torch upgrade is a real change of torch.optim in the worker's kernel hosts: the
second worker starts with a `sitecustomize` on its PYTHONPATH (readable in the box through
OPTDRIFT_SANDBOX_RO_PATHS) that replaces `torch.optim.adam._single_tensor_adam`, which AdamW's step
runs, by one that also scales the parameters by (1 - 2**-12) after each step: the references of
every Adam case move (their float64 distances change), the paper references (Lion) do not, and the
kernels are not touched. Everything else is the real path: `optdrift serve` (API, embedded broker,
worker, box, kernel host, reference cache), `optdrift submit --wait` and the run's API.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.service_fixtures import REPO_ROOT, free_port, shared_build_cache

# Two optimizers: Adam's references are torch.optim's (AdamW), Lion's are written from its paper
# (worker/references/optimizers.py), so only Adam's move with torch.optim.
BATTERY = {"name": "reference-upgrade", "version": 1,
           "description": "Adam (torch.optim reference) and Lion (paper reference), fp32, a few steps",
           "groups": [{"optimizers": ["adam", "lion"], "sizes": [257], "steps": 6, "seeds": [0, 1],
                       "points": [{"lr": 0.01, "weight_decay": 0.1}]}]}

STAND_IN = '''
"""A stand-in torch.optim upgrade: AdamW's single-tensor step, patched when torch.optim.adam loads."""
import importlib.abc
import sys


def _patch(module):
    original = module._single_tensor_adam

    def _single_tensor_adam(params, *args, **kwargs):
        original(params, *args, **kwargs)
        for param in params:
            param.mul_(1 - 2 ** -12)

    module._single_tensor_adam = _single_tensor_adam


class _AfterLoad(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch.optim.adam":
            return None
        sys.meta_path.remove(self)
        try:
            import importlib.util
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterLoad())
'''


def _serve(env: dict[str, str], cwd: Path, port: int) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--port", str(port)], cwd=cwd,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    for line in server.stdout:
        if line.startswith("optdrift serving"):
            return server
    server.wait(timeout=30)
    raise AssertionError(f"optdrift serve did not start (exit {server.returncode})")


def _stop(server: subprocess.Popen) -> None:
    server.terminate()
    server.wait(timeout=60)


def _final_distances(client, run_id: int) -> dict[str, float]:  # noqa: ANN001
    return {row["case_id"]: row["series"]["ref64_max_abs"][-1] for row in client.trajectories(run_id)}


def _submit(sha: str, parents: list[str], tree: Path, url: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    # The project's first commit has nothing to compare with: allowed explicitly (issue 44: else exit 7).
    first = [] if parents else ["--allow-no-baseline"]
    command = [sys.executable, "-m", "service.cli", "submit", "--project", "refs", "--commit", sha, "--source",
               str(tree), "--wait", "--no-training", "--url", url, *(arg for parent in parents for arg in ("--parent", parent)), *first]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=600)


@pytest.mark.slow
def test_a_torch_optim_change_is_reference_changed_and_the_kernels_verdict_stands(tmp_path: Path) -> None:
    from service.cli.client import OptdriftClient

    tree = tmp_path / "tree"
    shutil.copytree(REPO_ROOT / "csrc", tree)
    (tree / "refs_battery.json").write_text(json.dumps(BATTERY))
    stand_in = tmp_path / "stand_in"
    stand_in.mkdir()
    (stand_in / "sitecustomize.py").write_text(STAND_IN)

    home = tmp_path / "home"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPTDRIFT_")}
    env.update({"OPTDRIFT_HOME": str(home), "PYTHONPATH": str(REPO_ROOT),
                "OPTDRIFT_BUILD_CACHE_DIR": shared_build_cache(), "OPTDRIFT_MAINTENANCE_INTERVAL_S": "2"})
    server = _serve(env, tmp_path, port)
    try:
        token = (home / "admin-token").read_text().strip()
        client = OptdriftClient(url, token=token)
        client.ensure_project("refs", environments=["cpu"], default_battery="refs_battery.json")
        env["OPTDRIFT_TOKEN"] = token
        client.close()
        first = _submit("a" * 40, [], tree, url, env)
        assert first.returncode == 0, first.stdout + first.stderr  # no baseline
    finally:
        _stop(server)

    # The same worker machine after "the torch upgrade": torch.optim's AdamW computes otherwise.
    upgraded = {**env, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(stand_in)]),
                "OPTDRIFT_SANDBOX_RO_PATHS": str(stand_in)}
    server = _serve(upgraded, tmp_path, port)
    try:
        second = _submit("b" * 40, ["a" * 40], tree, url, upgraded)
        # The kernels are bit for bit what they were: unchanged, exit 0, whatever torch.optim did.
        assert second.returncode == 0, second.stdout + second.stderr

        client = OptdriftClient(url, token=token)
        run = client.run(int(re.search(r"run\(s\) \[(\d+)\]", second.stdout).group(1)))
        verdict = run["verdict"]
        assert verdict["outcome"] == "unchanged" and "reference changed" in verdict["summary"], verdict
        detail = verdict["detail"]
        cases = {case["case_id"]: case for case in detail["cases"]}
        adam = [c for c in cases.values() if c["optimizer"] == "adam"]
        lion = [c for c in cases.values() if c["optimizer"] == "lion"]
        assert len(adam) == 2 and len(lion) == 2, sorted(cases)
        assert all(c["verdict"] == "unchanged" and c["reference_changed"] for c in adam), adam
        assert all(c["verdict"] == "unchanged" and not c["reference_changed"] for c in lion), lion
        assert verdict["figures"]["reference_changed"] == 2
        # The CLI's report says it too.
        assert f"run {run['id']}: The reference changed for 2 cases" in second.stdout, second.stdout

        # The stand-in really moved the references (and the reference cache did not hand the old
        # distances back): Adam's final distance to float64 differs between the two runs, Lion's not.
        baseline = client.run(verdict["baseline_run_id"])
        before = _final_distances(client, baseline["id"])
        after = _final_distances(client, run["id"])
        assert all(before[c["case_id"]] != after[c["case_id"]] for c in adam), (before, after)
        assert all(before[c["case_id"]] == after[c["case_id"]] for c in lion), (before, after)
        assert run["fingerprint"]["references"]["adam"] != baseline["fingerprint"]["references"]["adam"]
        assert run["fingerprint"]["references"]["lion"] == baseline["fingerprint"]["references"]["lion"]
        client.close()
    finally:
        _stop(server)
