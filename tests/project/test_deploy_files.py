"""Docker cannot run here, so this keeps docker/ and docker-compose.yml honest: every optdrift
command they run exists in the CLI with those options, and every OPTDRIFT_ variable is a setting."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import click
import typer.main
import yaml

from service.cli import app
from service.settings import Settings

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
DOCKERFILES = sorted((REPO_ROOT / "docker").glob("*Dockerfile"))


def _shell_text(command: str | list[str]) -> str:
    """A compose/Dockerfile command as shell text (exec form `sh -c X` -> X)."""
    if isinstance(command, list):
        return command[2] if command[:2] == ["sh", "-c"] else shlex.join(command)
    return command


def _optdrift_invocations() -> list[list[str]]:
    commands = [_shell_text(service["command"]) for service in COMPOSE["services"].values()
                if service.get("command")]
    for dockerfile in DOCKERFILES:
        for match in re.finditer(r"^(?:CMD|ENTRYPOINT)\s+(.*)$", dockerfile.read_text(), re.M):
            text = match.group(1)
            commands.append(_shell_text(json.loads(text)) if text.startswith("[") else text)
    invocations = []
    for command in commands:
        for piece in re.split(r"&&|;|\|\|", command):
            words = shlex.split(piece)
            if words[:1] == ["exec"]:  # `exec optdrift serve`: the shell hands its process over
                words = words[1:]
            if words and words[0] == "optdrift":
                invocations.append(words[1:])
    return invocations


def test_every_compose_and_docker_command_exists_in_the_cli() -> None:
    group = typer.main.get_command(app)
    invocations = _optdrift_invocations()
    assert {tuple(words[:1]) for words in invocations} >= {("migrate",), ("serve",), ("worker",)}
    for words in invocations:
        # make_context parses options without running the command: an unknown command or
        # option raises a UsageError naming it.
        command = group.get_command(click.Context(group), words[0])
        assert command is not None, f"`optdrift {words[0]}` is not a CLI command"
        command.make_context(words[0], list(words[1:]), resilient_parsing=False)


# Read from the environment where a kernel host starts, not settings of the service: the engine
# imports no service settings (issue 35). README.md lists them beside the settings.
ENVIRONMENT_ONLY = {"OPTDRIFT_HARNESS_CACHE"}


def test_every_optdrift_environment_variable_is_a_setting() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    assert all(f"`{name}`" in readme for name in ENVIRONMENT_ONLY)
    names = {f"OPTDRIFT_{field.upper()}" for field in Settings.model_fields} | ENVIRONMENT_ONLY
    seen = set()
    for service in COMPOSE["services"].values():
        for key in (service.get("environment") or {}):
            if key.startswith("OPTDRIFT_"):
                seen.add(key)
                assert key in names, f"{key} in docker-compose.yml is not a setting of service.settings"
    for dockerfile in DOCKERFILES:
        for key in re.findall(r"\b(OPTDRIFT_[A-Z_]+)=", dockerfile.read_text()):
            seen.add(key)
            assert key in names, f"{key} in {dockerfile.name} is not a setting"
    assert "OPTDRIFT_DATABASE_URL" in seen and "OPTDRIFT_BROKER_URL" in seen


def test_compose_reserves_a_gpu_and_the_api_migrates_on_start() -> None:
    services = COMPOSE["services"]
    assert {"postgres", "redis", "api"} <= set(services)
    workers = [s for name, s in services.items() if name.startswith("worker")]
    assert workers and all(
        w["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"] for w in workers)
    assert "optdrift migrate" in " ".join(services["api"]["command"])


def test_the_gpu_worker_image_runs_unprivileged_with_bubblewrap() -> None:
    """Submitted code must not run as root in the worker container (issue 13), and the sandbox
    must exist there, or the worker refuses verify runs."""
    text = (REPO_ROOT / "docker" / "worker-gpu.Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0"), users
    assert re.search(r"apt-get install[^\n]*(\\\n[^\n]*)*\bbubblewrap\b", text)
    worker = COMPOSE["services"]["worker-gpu0"]
    assert "seccomp=unconfined" in worker.get("security_opt", [])
    assert not worker.get("privileged") and not worker.get("cap_add")
