"""The attribution's analysis child kept open (worker/attribution/pair_run.py AnalysisChild, child.py
--serve): one process answers the cases and then their probes, each ask one line, each case's
failure its own; the one-shot analyze_in_child answers the same."""

from __future__ import annotations

import torch

from worker.attribution import variants
from worker.attribution.pair_run import AnalysisChild, analyze_in_child
from worker.battery import load_battery

CASE = next(c for c in load_battery("quick").expand()
            if c.case_id.startswith("adam.32bit.fp32.lr=0.1.wd=0.1.open.n1.s0.t10#"))


def _request(tmp_path, commit_rule: str) -> dict:  # noqa: ANN001
    paths = variants.replay(CASE, [variants.BY_NAME[commit_rule], variants.CORRECT])
    files = {}
    for side, rule in (("commit", commit_rule), ("baseline", "reference")):
        files[side] = tmp_path / f"{commit_rule}.{side}.f32"
        paths[rule].to(torch.float32).numpy().astype("<f4").tofile(files[side])
    return {"case": CASE.model_dump(mode="json"), "commit_file": str(files["commit"]),
            "baseline_file": str(files["baseline"]), "first_divergent_step": 1, "baseline_ref64": None}


def test_one_child_answers_each_ask_and_each_case_s_failure_is_its_own(tmp_path):  # noqa: ANN001
    decay = _request(tmp_path, "decay_after_update")
    missing = {**decay, "commit_file": str(tmp_path / "nowhere.f32")}
    with AnalysisChild() as child:
        first = child.ask([decay])
        pid = child.process.pid
        second = child.ask([missing])
        assert child.process.pid == pid and child.process.poll() is None  # the same process, still serving
    assert first[CASE.case_id]["variant"] == "decay_after_update", first
    assert "error" in second[CASE.case_id] and "nowhere.f32" in second[CASE.case_id]["error"]
    assert child.process.poll() == 0  # closed: its stdin ended, it exited
    assert analyze_in_child([decay])[CASE.case_id]["variant"] == "decay_after_update"


def test_a_child_that_dies_says_why(tmp_path):  # noqa: ANN001
    child = AnalysisChild()
    child.process.kill()
    child.process.wait()
    try:
        child.ask([_request(tmp_path, "decay_after_update")])
    except RuntimeError as error:
        assert "attribution child failed" in str(error)
    else:
        raise AssertionError("a dead child answered")
    finally:
        child.close()
