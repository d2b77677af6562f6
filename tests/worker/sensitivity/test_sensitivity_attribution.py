"""`optdrift sensitivity --attribute N`: each caught defect's changed cases (a sample of N) are
attributed (worker/attribution) and the calls scored against the catalogue's `attribution`."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from rich.console import Console

from service.core.results import CaseSpec
from worker.battery import BatterySpec
from worker.sensitivity.catalogue import CatalogueError, load_catalogue
from worker.sensitivity.engine import SensitivityRun, attribution_label, attribution_sample
from worker.sensitivity.report import print_attribution
from worker.sensitivity.results import MutantOutcome, SensitivityReport

BY_ID = {m.id: m for m in load_catalogue()}


def _cases(groups: list[dict]) -> list[CaseSpec]:
    return BatterySpec.model_validate({"name": "sample", "version": 1, "groups": groups}).expand()


def test_the_sample_takes_32bit_cases_first_one_per_optimizer_and_dtype_cheapest_first():
    changed = _cases([
        {"optimizers": ["adam", "lion"], "families": ["32bit", "8bit_blockwise"],
         "param_dtypes": ["float32", "bfloat16"], "sizes": [4097, 257], "steps": 3}])
    sample = attribution_sample(changed, 9)
    assert [c.family for c in sample] == ["32bit"] * 8 + ["8bit_blockwise"]  # every 32-bit case first
    # one of each (optimizer, dtype) before any second one, each the cheapest of its kind first
    kinds = {("adam", "float32"), ("adam", "bfloat16"), ("lion", "float32"), ("lion", "bfloat16")}
    assert {(c.optimizer, c.param_dtype) for c in sample[:4]} == kinds
    assert [c.size for c in sample] == [257] * 4 + [4097] * 4 + [257]
    assert attribution_sample(changed, 100) and len(attribution_sample(changed, 100)) == len(changed)
    assert attribution_sample([], 4) == []


def test_a_record_reads_as_its_call():
    assert attribution_label({"class": "semantic", "variant": "decay_after_update"}) == "decay_after_update"
    assert attribution_label({"class": "rounding-level", "variant": None}) == "rounding-level"
    assert attribution_label({"class": "quantization", "variant": None, "note": "codes moved"}) == "quantization"
    assert attribution_label({"class": "semantic", "variant": None, "label": "unexplained"}) == "unexplained"
    assert attribution_label({"error": "the case did not run on both builds again"}) == "error"


def _outcome(mutant_id: str, expected: str | None, calls: dict[str, int]) -> MutantOutcome:
    return MutantOutcome(id=mutant_id, kind="defect", mutant_class=mutant_id.split("/")[0], expect="x",
                         reaches=["cpu"], status="caught", attributed=True, attribution_expected=expected,
                         attribution=calls)


def test_scores_count_each_mutant_once_by_its_most_common_call():
    report = SensitivityReport(catalogue="x", battery="b", battery_version=1, battery_digest="d", device="cpu",
                               groups=[], case_count=0, mutants=[
                                   _outcome("decay/a", "decay_after_update", {"decay_after_update": 4, "unexplained": 2}),
                                   _outcome("eps/b", "eps_inside_sqrt", {"unexplained": 3, "eps_inside_sqrt": 3}),
                                   _outcome("precision/c", "rounding-level", {"rounding-level": 5}),
                                   _outcome("precision/d", "rounding-level", {"unexplained": 2, "rounding-level": 1}),
                                   _outcome("quant8/e", "none", {"unexplained": 6}),
                                   _outcome("tail/f", None, {"unexplained": 1})])
    assert report.mutants[1].attribution_call() == "mixed"  # a tie at the top names neither
    assert report.attribution_scores() == {"variant": (1, 2), "rounding-level": (1, 2)}
    console = Console(record=True, width=200)
    print_attribution(report, console)
    text = console.export_text()
    assert "decay_after_update 4, unexplained 2" in text
    assert "defects with an expected variant, that variant named: 1 of 2 (50%)" in text
    assert "defects expected rounding-level, called rounding-level: 1 of 2 (50%)" in text


def test_quantization_is_scored_as_its_own_group():
    # Issue 37: a quantizer change is expected "quantization"; called rounding-level it is a miss.
    report = SensitivityReport(catalogue="x", battery="b", battery_version=1, battery_digest="d", device="cpu",
                               groups=[], case_count=0, mutants=[
                                   _outcome("quant8/a", "quantization", {"quantization": 6}),
                                   _outcome("quant8/b", "quantization", {"rounding-level": 4, "quantization": 2}),
                                   _outcome("precision/c", "rounding-level", {"rounding-level": 5})])
    assert report.attribution_scores() == {"variant": (0, 0), "rounding-level": (1, 1), "quantization": (1, 2)}
    console = Console(record=True, width=200)
    print_attribution(report, console)
    assert "defects expected quantization, called quantization: 1 of 2 (50%)" in console.export_text()


def test_an_attribution_the_analysis_cannot_make_is_refused_when_the_catalogue_loads(tmp_path):
    folder = tmp_path / "catalogue"
    (folder / "eps").mkdir(parents=True)
    (folder / "refactor").mkdir()
    shutil.copy(BY_ID["eps/adam_inside_sqrt"].patch_path, folder / "eps" / "a.patch")
    shutil.copy(BY_ID["refactor/comment_ops"].patch_path, folder / "refactor" / "b.patch")
    (folder / "catalogue.toml").write_text(
        '[[mutant]]\nid = "eps/a"\nkind = "defect"\nexpect = "x"\nattribution = "eps_in_the_wrong_place"\n\n'
        '[[mutant]]\nid = "refactor/b"\nkind = "refactor"\nexpect = "bit-identical"\nattribution = "none"\n')
    with pytest.raises(CatalogueError) as raised:
        load_catalogue(folder)
    message = str(raised.value)
    assert "eps_in_the_wrong_place" in message and "refactor/b" in message and "eps_inside_sqrt" in message


def _two_mutant_catalogue(folder: Path) -> Path:
    for mutant_id in ("decay/after_update", "precision/adam_step_size_float"):
        (folder / mutant_id.split("/")[0]).mkdir(parents=True, exist_ok=True)
        shutil.copy(BY_ID[mutant_id].patch_path, folder / f"{mutant_id}.patch")
    (folder / "catalogue.toml").write_text(
        '[[mutant]]\nid = "decay/after_update"\nkind = "defect"\nexpect = "decayed Adam changes"\n'
        'attribution = "decay_after_update"\n\n'
        '[[mutant]]\nid = "precision/adam_step_size_float"\nkind = "defect"\nexpect = "Adam rounds"\n'
        'attribution = "rounding-level"\n')
    return folder


@pytest.mark.slow
def test_sensitivity_names_the_decay_reorder_and_calls_the_float_step_size_rounding_level(tmp_path, build_cache_dir):
    """Real builds, batteries and attribution on the CPU: float32 Adam cases at lr 0.1 / wd 0.1,
    where the decay reorder is thousands of ulps and the float32 step size about two."""
    battery = tmp_path / "adam.json"
    battery.write_text(BatterySpec.model_validate({"name": "adam-f32", "version": 1, "groups": [
        {"optimizers": ["adam"], "sizes": [257, 1031], "steps": 10, "seeds": [0, 1],
         "points": [{"lr": 0.1, "weight_decay": 0.1}]}]}).model_dump_json())
    report = SensitivityRun(battery=str(battery), catalogue=_two_mutant_catalogue(tmp_path / "catalogue"),
                            cache_dir=build_cache_dir, fallback_battery=None, attribute=3,
                            checkpoint=tmp_path / "report.json", progress=lambda line: None).run()
    outcomes = {m.id: m for m in report.mutants}
    decay, step_size = outcomes["decay/after_update"], outcomes["precision/adam_step_size_float"]
    assert decay.status == step_size.status == "caught"
    assert decay.attribution == {"decay_after_update": 3}, decay.attribution
    assert step_size.attribution == {"rounding-level": 3}, step_size.attribution
    assert report.attribution_scores() == {"variant": (1, 1), "rounding-level": (1, 1)}
    # A resumed run that does not attribute keeps the calls; nothing is judged again.
    again = SensitivityRun(battery=str(battery), catalogue=tmp_path / "catalogue", cache_dir=build_cache_dir,
                           fallback_battery=None, checkpoint=tmp_path / "report.json", progress=lambda line: None).run()
    assert again.mutants == report.mutants
