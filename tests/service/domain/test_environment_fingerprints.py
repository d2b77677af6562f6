"""What differs between two environments' fingerprints (service/domain/environment_compare.py):
the machine's fields by value, and the references (torch.optim's code, ours) by the optimizers whose
reference digest moved."""

from __future__ import annotations

from service.core.results import EnvironmentFingerprint
from service.domain.environment_compare import fingerprint_changes


def _fingerprint(**changes) -> EnvironmentFingerprint:  # noqa: ANN003
    base = {"device_kind": "cpu", "device_name": "x86_64", "torch_version": "2.13.0", "python_version": "3.11.7",
            "platform": "linux", "class_key": "cpu", "references": {"adam": "a" * 64, "lion": "b" * 64}}
    return EnvironmentFingerprint(**{**base, **changes})


def test_a_moved_reference_is_named_by_its_optimizer_beside_the_machine_fields() -> None:
    a = _fingerprint()
    b = _fingerprint(torch_version="2.14.0", references={"adam": "c" * 64, "lion": "b" * 64})
    changes = {c.field: (c.a, c.b) for c in fingerprint_changes(a, b)}
    assert changes == {"torch_version": ("2.13.0", "2.14.0"), "references": (f"adam {'a' * 12}", f"adam {'c' * 12}")}


def test_references_unknown_on_one_side_say_nothing() -> None:
    assert fingerprint_changes(_fingerprint(), _fingerprint(references=None)) == []
    assert fingerprint_changes(_fingerprint(), _fingerprint()) == []
