"""How many kernel hosts a training-impact job trains in (service/settings.py resolved_training_hosts):
the pool size measured fastest on a 16-core H100 worker (12; docs/TRAINING.md, "Time"), two on a
CPU worker (one per side), and what an operator sets wins."""

from __future__ import annotations

import pytest

from service.settings import Settings


@pytest.mark.parametrize(("cores", "hosts"), [(16, 12), (32, 12), (8, 6), (2, 2), (1, 2)])
def test_a_cuda_worker_trains_in_three_quarters_of_its_cores_at_most_12(monkeypatch, cores: int,
                                                                       hosts: int) -> None:  # noqa: ANN001
    monkeypatch.setattr("service.settings.os.cpu_count", lambda: cores)
    assert Settings(worker_device="cuda").resolved_training_hosts == hosts
    assert Settings(worker_device="cpu").resolved_training_hosts == 2
    assert Settings(worker_device="cuda", training_hosts=5).resolved_training_hosts == 5
