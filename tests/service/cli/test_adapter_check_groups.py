"""`optdrift adapter-check` and the group lifecycle (docs/PROJECTS.md "The group lifecycle"): per
family it runs one layout case (one optimizer over 1, 257, 4096 | 1031 elements, the second group
without weight decay) through both engines and says "yes", "missing" (exit 0: not a failure) or
"not run"; it lists each declared unreadable state with what still sees a change in it and from
which step, and fails (exit 1) a group lifecycle that does not reproduce itself or a claim naming
figures the case does not digest."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from service.cli import app
from worker.battery import BatterySpec

OPAQUE = "tests.fixtures.adapters.opaque_steps"
OWNEDOPT = Path(__file__).resolve().parents[2] / "fixtures" / "ownedopt"


@pytest.fixture()
def battery(tmp_path: Path) -> str:
    path = tmp_path / "battery.json"
    path.write_text(BatterySpec.model_validate({"name": "check", "version": 1, "groups": [
        {"optimizers": ["adam"], "sizes": [5], "steps": 3,
         "points": [{"lr": 0.1, "weight_decay": 0.1}, {"lr": 0.01, "beta1": 0.8, "beta2": 0.99}]}]}).model_dump_json())
    return str(path)


def _check(*args: str):  # noqa: ANN202
    return CliRunner().invoke(app, ["adapter-check", *args])


def test_unreadable_state_is_listed_with_what_sees_it_and_from_which_step(battery):
    done = _check("--adapter", OPAQUE, "--library", "installed", "--battery", battery)
    assert done.exit_code == 0, done.output
    assert "group lifecycle (one optimizer over tensors of 1, 257, 4096 | 1031 elements in 2 param groups" in done.output
    assert "  32bit: yes: the adapter's own (OpaqueFamily.open_group / step_group); a run on each engine gives the same digests " \
        "over 3 steps (the fast engine runs a layout case alone through the same group lifecycle" in done.output
    assert "unreadable state 'op step counter': kept by the op for the whole optimizer with no getter" in done.output
    assert "a change in it is seen through parameters from step 1 (declared by the adapter;" in done.output
    assert "a change in it is seen through parameters from step 3 (declared by the adapter;" in done.output


def test_a_family_without_a_group_lifecycle_is_reported_missing_and_is_not_a_failure(battery):
    done = _check("--adapter", "ownedopt_optdrift", "--adapter-path", str(OWNEDOPT),
                  "--library", str(OWNEDOPT / "lib"), "--battery", battery)
    assert done.exit_code == 0, done.output
    assert "both engines agree on all 2 cases" in done.output
    assert "  32bit: missing: the OwnedAdamW adapter has no group lifecycle" in done.output
    assert "(not a failure: this family's layout cases read not_applicable with that reason)" in done.output


WRONG = '''
from tests.fixtures.adapters.opaque_steps import OpaqueFamily, OpaqueStepsAdapter
from worker.adapters.base import UnreadableState


class {family}(OpaqueFamily):
{body}


class Adapter(OpaqueStepsAdapter):
    def load(self, library):
        super().load(library)
        self._families = {{"32bit": {family}(keep_powers_at_same_step=False)}}
'''


def _adapter_module(folder: Path, name: str, family: str, body: str) -> None:
    (folder / f"{name}.py").write_text(WRONG.format(family=family, body=body))


def test_a_claim_naming_figures_nobody_digests_fails(battery, tmp_path):
    _adapter_module(tmp_path, "claims_momentum", "ClaimsMomentum", '''
    def unreadable_state(self, case):
        return (UnreadableState("op step counter", "no getter", seen_through=("t*.momentum_buffer",)),)''')
    done = _check("--adapter", "claims_momentum", "--adapter-path", str(tmp_path), "--library", "installed",
                  "--battery", battery)
    assert done.exit_code == 1, done.output
    assert "'op step counter' is said to be seen through t*.momentum_buffer, which the layout case does not digest" \
        in done.output
    # The same claim over figures the case digests ("t*.exp_avg" matches every tensor's) passes.
    _adapter_module(tmp_path, "claims_exp_avg", "ClaimsExpAvg", '''
    def unreadable_state(self, case):
        return (UnreadableState("op step counter", "no getter", seen_through=("parameters", "t*.exp_avg")),)''')
    done = _check("--adapter", "claims_exp_avg", "--adapter-path", str(tmp_path), "--library", "installed",
                  "--battery", battery)
    assert done.exit_code == 0, done.output


def test_a_group_lifecycle_whose_state_outlives_close_fails(battery, tmp_path):
    """A family that carries something from one layout case's optimizer into the next (here: a count
    of opened groups that scales the lr) gives other digests on the second run: exit 1."""
    _adapter_module(tmp_path, "leaky_groups", "LeakyGroups", '''
    opened = 0

    def open_group(self, case, params, device):
        type(self).opened += 1
        handle = super().open_group(case, params, device)
        for group in handle.optimizer.param_groups:
            group["lr"] *= type(self).opened
        return handle''')
    done = _check("--adapter", "leaky_groups", "--adapter-path", str(tmp_path), "--library", "installed",
                  "--battery", battery)
    assert done.exit_code == 1, done.output
    assert "family 32bit's group lifecycle gives other digests on a second run of layout case" in done.output


def test_bitsandbytes_families_report_their_group_lifecycle(battery):
    pytest.importorskip("bitsandbytes")
    path = Path(battery)
    path.write_text(BatterySpec.model_validate({"name": "check", "version": 1, "groups": [
        {"optimizers": ["adam", "lion"], "families": ["32bit", "8bit_blockwise"], "sizes": [300], "steps": 3,
         "points": [{"lr": 0.1, "weight_decay": 0.1}]}]}).model_dump_json())
    done = _check("--adapter", "bitsandbytes", "--library", "installed", "--battery", battery)
    assert done.exit_code == 0, done.output
    for family in ("32bit", "8bit_blockwise"):
        assert f"  {family}: yes: the adapter's own (BnbOptimizerGroups.open_group / step_group)" in done.output
    assert "unreadable state" not in done.output
