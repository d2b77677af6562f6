"""worker/pipeline.py: which battery a job runs (the issue-14 bug: the tree's own battery never
ran), and what it records about it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from worker import pipeline
from worker.battery import BUILTIN_BATTERIES, BatteryError

PROJECT = SimpleNamespace(name="p", build_kind="torch-extension", build_command=None, adapter="bundled",
                          default_battery="quick", environments=["cpu"])


def _tree(tmp_path: Path, toml: str | None) -> Path:
    tree = tmp_path / "tree"
    tree.mkdir()
    spec = BUILTIN_BATTERIES["quick"]().model_copy(update={"name": "mine", "version": 7})
    (tree / "my-battery.json").write_text(spec.model_dump_json())
    if toml is not None:
        (tree / "optdrift.toml").write_text(toml)
    return tree


@pytest.mark.parametrize("toml, requested, name, origin", [
    ('[project]\nbattery = "my-battery.json"\n', "quick", "mine", "the tree's optdrift.toml"),
    ('[project]\nbattery = "my-battery.json"\n', None, "mine", "the tree's optdrift.toml"),
    ('[project]\nbattery = "my-battery.json"\n', "standard", "standard", "the submission"),
    (None, "quick", "quick", "the project's default"),
    (None, "my-battery.json", "mine", "the submission"),
])
def test_which_battery_a_job_runs(tmp_path, toml, requested, name, origin) -> None:
    job = pipeline.prepare(_tree(tmp_path, toml), project=PROJECT, requested_battery=requested)
    assert (job.battery.name, job.battery_origin) == (name, origin)
    assert job.record()["battery_digest"] == job.battery.digest and len(job.cases) == len(job.battery.expand())


def test_a_file_outside_the_tree_only_for_check(tmp_path) -> None:
    tree = _tree(tmp_path, None)
    outside = tmp_path / "elsewhere.json"
    outside.write_text((tree / "my-battery.json").read_text())
    with pytest.raises(BatteryError):
        pipeline.prepare(tree, project=PROJECT, requested_battery=str(outside))
    job = pipeline.prepare(tree, requested_battery=str(outside), local_battery_file=True)
    assert job.battery.name == "mine" and job.battery_origin == f"the file {outside}"
