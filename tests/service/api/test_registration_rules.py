"""Registering a project refuses what can never run (issue 44): an unknown default battery or
adapter (API 422 / CLI exit 2 naming the value and the valid choices), and an environment no live
worker serves while workers are live (unless allow_unserved / --allow-unserved: a warning naming the
worker setting that serves it). A run queued for such an environment says so on its API answer and
its page, never that a live worker "has not reported in"; /metrics counts a worker under each build
variant it serves. Worker presence is a real heartbeat row (service.domain.workers.beat)."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from service.cli import app as cli_app
from service.domain import workers
from tests.service_fixtures import make_archive

FMA_HINT = ("no live worker serves environment cpu+fma (the 1 live cpu worker(s) serve the variants clang); "
            "start a worker with OPTDRIFT_WORKER_ENVIRONMENT=cpu and a variant named fma in OPTDRIFT_BUILD_VARIANTS")


def _cpu_worker(session, variants: list[str]) -> None:  # noqa: ANN001
    workers.beat(session=session, name="cpu-worker:1", environment="cpu", detail={"variants": variants})


# ----------------------------------------------------------------------------- battery, adapter
@pytest.mark.parametrize(("battery", "hint"), [("quik", " (did you mean 'quick'?)"), ("fastest", "")])
def test_an_unknown_default_battery_is_refused_naming_the_valid_ones(api, battery: str, hint: str) -> None:
    expected = f"unknown battery '{battery}': use one of ci, quick, standard{hint}, or the path of a battery"
    created = api.post("/api/v1/projects", json={"name": "bat", "default_battery": battery})
    assert created.status_code == 422 and created.json()["detail"].startswith(expected), created.text
    assert api.get("/api/v1/projects/bat").status_code == 404
    assert api.post("/api/v1/projects", json={"name": "bat"}).status_code == 201
    changed = api.patch("/api/v1/projects/bat", json={"default_battery": battery})
    assert changed.status_code == 422 and changed.json()["detail"].startswith(expected)
    assert api.get("/api/v1/projects/bat").json()["default_battery"] == "quick"
    # A built-in name or a battery file of the trees (checked per submission, where the tree is).
    for allowed in ("ci", "batteries/mine.json", "refs_battery.json"):
        assert api.patch("/api/v1/projects/bat", json={"default_battery": allowed}).status_code == 200


def test_an_adapter_that_is_no_module_name_is_refused(api) -> None:
    refused = api.post("/api/v1/projects", json={"name": "ad", "adapter": "bits and bytes"})
    assert refused.status_code == 422
    assert refused.json()["detail"].startswith("unknown adapter 'bits and bytes': use one of bitsandbytes, "
                                               "bundled, lion_pytorch, torchao")
    assert api.post("/api/v1/projects", json={"name": "ad", "adapter": "tinyopt"}).status_code == 201
    assert api.patch("/api/v1/projects/ad", json={"adapter": "../x"}).status_code == 422
    assert api.patch("/api/v1/projects/ad", json={"adapter": "myproject.adapter"}).status_code == 200


def test_builtin_adapter_names_match_the_worker() -> None:
    # A plain import: the suite always has the worker installed, and an import error must fail here.
    from service.domain.registration_rules import BUILTIN_ADAPTERS
    from worker import adapters as worker_adapters

    assert set(BUILTIN_ADAPTERS) == set(worker_adapters.BUILTIN_ADAPTERS)


def test_the_project_command_refuses_a_battery_typo_with_exit_2(live_api, admin_token, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("OPTDRIFT_TOKEN", admin_token)
    result = CliRunner().invoke(cli_app, ["project", "create", "typo", "--battery", "quik", "--url", live_api])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "unknown battery 'quik': use one of ci, quick, standard" in result.output


# ----------------------------------------------------------------------------- environments
def test_an_environment_no_live_worker_serves_is_refused_or_registered_with_a_warning(api, db_session) -> None:  # noqa: ANN001
    # No worker live at all: the service cannot tell what its workers will serve; accepted, warned.
    fresh = api.post("/api/v1/projects", json={"name": "fresh", "environments": ["cpu", "gpu.sm90"]})
    assert fresh.status_code == 201, fresh.text
    assert fresh.json()["warnings"] == [
        "no live worker serves environment cpu; start a worker with OPTDRIFT_WORKER_ENVIRONMENT=cpu "
        "(`OPTDRIFT_WORKER_ENVIRONMENT=cpu optdrift worker`); registered anyway: no worker is live at all, so the "
        "service cannot tell what its workers will serve, and the runs wait until such a worker starts",
        "no live worker serves environment gpu.sm90; start a worker with OPTDRIFT_WORKER_ENVIRONMENT=gpu.sm90 "
        "(`OPTDRIFT_WORKER_ENVIRONMENT=gpu.sm90 optdrift worker`); registered anyway: no worker is live at all, so "
        "the service cannot tell what its workers will serve, and the runs wait until such a worker starts"]

    _cpu_worker(db_session, ["clang"])
    served = api.post("/api/v1/projects", json={"name": "served", "environments": ["cpu", "cpu+clang"]})
    assert served.status_code == 201 and served.json()["warnings"] == []
    refused = api.post("/api/v1/projects", json={"name": "fma", "environments": ["cpu", "cpu+fma"]})
    assert refused.status_code == 422 and refused.json()["detail"].startswith(FMA_HINT), refused.text
    assert "--allow-unserved" in refused.json()["detail"]
    assert api.get("/api/v1/projects/fma").status_code == 404
    changed = api.patch("/api/v1/projects/served", json={"environments": ["cpu", "gpu.sm90"]})
    assert changed.status_code == 422 and "environment gpu.sm90" in changed.json()["detail"]
    assert api.get("/api/v1/projects/served").json()["environments"] == ["cpu", "cpu+clang"]

    allowed = api.post("/api/v1/projects", json={"name": "fma", "environments": ["cpu", "cpu+fma"],
                                                 "allow_unserved": True})
    assert allowed.status_code == 201 and allowed.json()["environments"] == ["cpu", "cpu+fma"]
    [warning] = allowed.json()["warnings"]
    assert warning.startswith(FMA_HINT) and warning.endswith("registered anyway (allow_unserved): its runs wait "
                                                              "until such a worker starts")


def test_the_project_command_refuses_an_unserved_variant_unless_allowed(live_api, admin_token, db_session,
                                                                        monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("OPTDRIFT_TOKEN", admin_token)
    _cpu_worker(db_session, ["clang"])
    runner = CliRunner()
    args = ["project", "create", "clifma", "--environment", "cpu", "--environment", "cpu+fma", "--url", live_api]
    refused = runner.invoke(cli_app, args)
    assert refused.exit_code == 2 and "Traceback" not in refused.output
    assert "no live worker serves environment cpu+fma" in refused.output and "--allow-unserved" in refused.output
    allowed = runner.invoke(cli_app, [*args, "--allow-unserved"])
    assert allowed.exit_code == 0, allowed.output
    assert allowed.stderr.startswith("warning: no live worker serves environment cpu+fma")
    assert "project clifma created: environments cpu, cpu+fma" in allowed.stdout


def test_a_run_no_live_worker_serves_says_so_not_that_a_live_worker_has_not_reported_in(api, db_session) -> None:  # noqa: ANN001
    """`optdrift serve`'s own worker is alive for `cpu` (it beats) and serves no variant; a
    `cpu+fma` run waits for a worker with that variant, and says so on its API answer and page."""
    assert api.post("/api/v1/projects", json={"name": "wait", "environments": ["cpu", "cpu+fma"],
                                              "allow_unserved": True}).status_code == 201
    answer = api.post("/api/v1/projects/wait/commits", data={"sha": "c1"},
                      files={"archive": ("s.tar.gz", make_archive({"ops.cpp": "//\n"}), "application/gzip")})
    assert answer.status_code == 201, answer.text
    cpu_run, fma_run = (run["id"] for run in answer.json()["runs"])
    try:
        workers.embedded_worker_started(environment="cpu", variants=["clang"],
                                        started_at=time.monotonic() - workers.EMBEDDED_WORKER_GRACE_S - 287)
        _cpu_worker(db_session, ["clang"])
        assert api.get(f"/api/v1/runs/{cpu_run}").json()["waiting_for"] is None
        waiting = api.get(f"/api/v1/runs/{fma_run}").json()["waiting_for"]
        assert waiting.startswith(FMA_HINT), waiting
        assert "has not reported in" not in waiting
        page = api.get(f"/runs/{fma_run}").text
        assert 'id="waiting-for">waiting: no live worker serves environment cpu+fma' in page
        # a worker with the variant takes it
        workers.beat(session=db_session, name="fma-worker:1", environment="cpu", detail={"variants": ["fma"]})
        assert api.get(f"/api/v1/runs/{fma_run}").json()["waiting_for"] is None
        assert 'id="waiting-for"' not in api.get(f"/runs/{fma_run}").text
    finally:
        workers.embedded_worker_stopped()


# ----------------------------------------------------------------------------- /metrics
def test_metrics_count_a_live_worker_under_each_variant_it_serves(api, db_session) -> None:  # noqa: ANN001
    assert api.post("/api/v1/projects", json={"name": "met", "environments": ["cpu", "cpu+fma", "cpu+clang"],
                                              "allow_unserved": True}).status_code == 201
    answer = api.post("/api/v1/projects/met/commits", data={"sha": "c1"},
                      files={"archive": ("s.tar.gz", make_archive({"ops.cpp": "//\n"}), "application/gzip")})
    assert answer.status_code == 201, answer.text
    workers.beat(session=db_session, name="w1:1", environment="cpu", detail={"variants": ["fma"]})
    workers.beat(session=db_session, name="w2:2", environment="cpu", detail={"variants": ["fma", "nocontract"]})
    live = {sample.labels["environment"]: sample.value
            for family in text_string_to_metric_families(api.get("/metrics").text)
            for sample in family.samples if sample.name == "optdrift_live_workers"}
    assert live == {"cpu": 2, "cpu+fma": 2, "cpu+nocontract": 1, "cpu+clang": 0}
