"""A changed tree through `optdrift check`: where the time went (each phase's seconds and share,
on stdout at the end), each phase said as it starts (stderr), and attribution bounded to a sample
of the changed cases whose left-out cases name the analysed case that stands for them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from service.cli import app
from worker.attribution import selection
from worker.mutations import copy_tree, decay_after_update

pytestmark = pytest.mark.slow


def test_a_changed_check_says_its_phases_and_bounds_attribution(tmp_path: Path, csrc_under_test: Path,
                                                                 build_cache_dir: Path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("OPTDRIFT_BUILD_CACHE", str(build_cache_dir))
    monkeypatch.setattr(selection, "DEFAULT_LIMIT", 4)
    decay = decay_after_update(copy_tree(csrc_under_test, tmp_path / "decay"))
    out = tmp_path / "out.json"
    result = CliRunner().invoke(app, ["check", "--source", str(decay), "--baseline", str(csrc_under_test),
                                      "--battery", "quick", "--device", "cpu", "--json-out", str(out)])
    assert result.exit_code == 1, result.output
    payload = json.loads(out.read_text())
    changed = [c["case_id"] for c in payload["comparison"]["cases"] if c["verdict"] == "changed"]
    assert len(changed) > 4

    # Each phase with its seconds and share of the whole; the shares add up to the whole.
    line = result.output.strip().splitlines()[-1]
    shares = dict((name, int(share)) for name, share in re.findall(r"([a-z -]+) [0-9.]+ s \((\d+)%\)", line))
    named = {name.strip(", ").removeprefix("(").split(": ")[-1] for name in shares}
    assert {"builds", "baseline battery", "commit battery and repeats", "co-run", "attribution"} <= named, line
    assert 95 <= sum(shares.values()) <= 105, line
    assert f"attribution: what kind of change, for 4 of the {len(changed)} changed cases" in result.output
    assert "adapter: bundled; library: " in result.output and "adapter: adapter" not in result.output

    # Four analysed, one per group in turn; every other changed case names its stand-in.
    attribution = payload["attribution"]
    assert set(attribution) == set(changed)
    analysed = {case for case, entry in attribution.items() if not entry.get("sampled_out")}
    assert len(analysed) == 4
    for case, entry in attribution.items():
        if entry.get("sampled_out"):
            stand_in = entry["note"].split("; ")[-1].split(" stands for")[0]
            assert stand_in in analysed or "did not fit" in entry["note"], entry
