"""Build variants of one machine (issue 36): the same commit built by the worker's gcc as it is, with
`-ffp-contract=off` (no change on x86-64 without FMA instructions: identical trajectories) and with
`-mfma` (gcc then contracts `a*b+c` into one rounding: Adam moves from step 1), compared through the
service (`cpu` against `cpu+<variant>`) and the CLI.

Unit parts first (names, flags, queues, a variant the worker does not serve), then the real thing:
`optdrift serve` on its embedded default with its worker configured with the variants."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from service.broker.queueing import consumed_queues
from service.core.environments import BuildVariant, split
from service.settings import Settings
from tests.service_fixtures import REPO_ROOT, free_port, shared_build_cache
from worker.jobs.workspace import VariantNotServed, build_variant

VARIANTS = {"nocontract": {"cflags": ["-ffp-contract=off"]}, "fma": {"cflags": ["-mfma"]}, "clang": {"compiler": "clang++"}}
# Debian's clang (.ci/run installs it): the other compiler of the gcc/clang comparison.
HAS_CLANG = shutil.which("clang++") is not None


def test_a_variant_is_written_after_its_environment() -> None:
    assert split("cpu+clang") == ("cpu", "clang") and split("gpu.sm90") == ("gpu.sm90", None)


@pytest.mark.parametrize("flag", ["-fplugin=/tmp/x.so", "-B/tmp", "@/tmp/flags", "/tmp/x.o", "-include/etc/passwd"])
def test_a_variant_carries_compiler_options_only(flag: str) -> None:
    with pytest.raises(ValueError, match="not a file, plugin or response file"):
        BuildVariant(cflags=(flag,))


@pytest.mark.parametrize("archs", [(), ("sm_90",), ("9.0 -ccbin=/tmp/x",), ("compute_90",), ("9",)])
def test_a_variant_names_architectures_as_the_arch_list_writes_them(archs: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="architecture|at least one"):
        BuildVariant(cuda_archs=archs)
    assert BuildVariant(cuda_archs=("8.0+PTX", "9.0", "9.0a")).cuda_archs == ("8.0+PTX", "9.0", "9.0a")


def test_a_variant_s_architectures_reach_only_a_machine_that_builds_for_cuda(build_cache_dir: Path,
                                                                             monkeypatch) -> None:  # noqa: ANN001
    """On a CPU machine (no archs) the arch variant builds the plain build; where the machine builds
    for CUDA, the variant's architectures replace the machine's. The CUDA build itself runs on the
    H200 (bench/gpu/h200_env_variants.sh): this machine's torch cannot build CUDA extensions."""
    from service.core.project_config import ProjectConfig
    from worker.build import project
    from worker.build.project import build_project

    config = ProjectConfig()
    ptx = BuildVariant(cuda_archs=("8.0+PTX",))
    plain = build_project(REPO_ROOT / "csrc", config, cache_dir=build_cache_dir, cuda_archs=[])
    on_cpu = build_project(REPO_ROOT / "csrc", config, cache_dir=build_cache_dir, cuda_archs=[], variant=ptx)
    assert plain.ok and on_cpu.ok and on_cpu.digest == plain.digest and on_cpu.cuda_archs == []

    asked: list[list[str]] = []
    monkeypatch.setattr(project, "build_extension", lambda *a, cuda_archs, **k: asked.append(cuda_archs))
    build_project(REPO_ROOT / "csrc", config, cuda_archs=["9.0"], variant=ptx)
    build_project(REPO_ROOT / "csrc", config, cuda_archs=["9.0"], variant=BuildVariant(cflags=("-O2",)))
    assert asked == [["8.0+PTX"], ["9.0"]]


def test_the_worker_consumes_its_variants_after_each_kind_of_queue() -> None:
    assert consumed_queues("cpu", ["fma"]) == ["cpu", "cpu--fma", "cpu.verify", "cpu--fma.verify", "cpu.corun",
                                               "cpu--fma.corun"]
    assert consumed_queues("cpu") == ["cpu", "cpu.verify", "cpu.corun"]


def test_a_variant_the_worker_does_not_serve_is_named_with_those_it_does() -> None:
    settings = Settings(build_variants=VARIANTS)
    assert build_variant(settings, "cpu+fma") == BuildVariant(cflags=("-mfma",))
    assert build_variant(settings, "cpu") is None
    with pytest.raises(VariantNotServed, match=r"'icx', which this worker is not configured with .*clang, fma, nocontract"):
        build_variant(settings, "cpu+icx")


def _cli(*args: str, env: dict[str, str], timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "service.cli", *args], capture_output=True, text=True, env=env,
                          cwd=REPO_ROOT, timeout=timeout_s)


@pytest.mark.slow
def test_flags_that_change_nothing_and_flags_that_move_adam_through_the_service(tmp_path: Path) -> None:
    from service.cli.client import OptdriftClient

    home = tmp_path / "home"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPTDRIFT_")}
    env.update({"OPTDRIFT_HOME": str(home), "PYTHONPATH": str(REPO_ROOT), "OPTDRIFT_BUILD_VARIANTS": json.dumps(VARIANTS),
                "OPTDRIFT_BUILD_CACHE_DIR": shared_build_cache(), "OPTDRIFT_MAINTENANCE_INTERVAL_S": "2"})
    server = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--port", str(port)], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        for line in server.stdout:
            if line.startswith("optdrift serving"):
                break
        url = f"http://127.0.0.1:{port}"
        token = (home / "admin-token").read_text().strip()
        client = OptdriftClient(url, token=token)
        client.ensure_project("variants", environments=["cpu", "cpu+nocontract", "cpu+fma"]
                              + (["cpu+clang"] if HAS_CLANG else []), default_battery="quick")
        from service.cli.client import pack_directory

        # Two of the three now; cpu+fma later, as the upgrade check (`compare --run`) asks for it.
        runs = client._check(client.http.post("/api/v1/projects/variants/commits", data={
            "sha": "a" * 40, "environments": "cpu,cpu+nocontract"},
            files={"archive": ("s.tar.gz", pack_directory(REPO_ROOT / "csrc"), "application/gzip")}))["runs"]
        assert sorted(r["environment"] for r in runs) == ["cpu", "cpu+nocontract"]
        finished = client.wait([r["id"] for r in runs], timeout_s=700)
        assert all(r["status"] == "done" for r in finished), [(r["environment"], r["status"], r.get("error"))
                                                               for r in finished]

        def compare(b: str) -> dict:
            answer = client.http.get("/api/v1/projects/variants/environment-comparison",
                                     params={"commit": "a" * 40, "a": "cpu", "b": b})
            assert answer.status_code == 200, answer.text
            return answer.json()

        same = compare("cpu+nocontract")
        # Another flag, so another build, and the same trajectories bit for bit.
        assert same["same_build"] is False and same["comparison"]["verdict"] == "unchanged"

        env["OPTDRIFT_TOKEN"] = token
        upgrade = _cli("compare", "--project", "variants", "--commit", "a" * 40, "--env", "cpu", "--env", "cpu+fma",
                       "--run", "--timeout", "500", "--url", url, env=env, timeout_s=600)
        assert upgrade.returncode == 1, upgrade.stdout + upgrade.stderr
        assert f"running {'a' * 12} in cpu+fma" in upgrade.stderr and "different build digests" in upgrade.stdout
        moved = compare("cpu+fma")
        assert moved["comparison"]["verdict"] == "changed"
        adam = [c for c in moved["comparison"]["cases"] if c["optimizer"] == "adam" and c["family"] == "32bit"
                and c.get("param_dtype", "float32") == "float32"]
        assert adam and all(c["verdict"] == "changed" and c["first_divergent_step"] == 1 for c in adam), adam

        unchanged = _cli("compare", "--project", "variants", "--commit", "a" * 40, "--env", "cpu", "--env",
                         "cpu+nocontract", "--url", url, env=env)
        assert unchanged.returncode == 0, unchanged.stdout + unchanged.stderr
        changed = _cli("compare", "--project", "variants", "--commit", "a" * 40, "--env", "cpu", "--env", "cpu+fma",
                       "--url", url, env=env)
        assert changed.returncode == 1 and "different build digests" in changed.stdout, changed.stdout
        if HAS_CLANG:
            # gcc against clang, the same flags: a different compiler is a different build, and its
            # run records which compiler made it. Whether trajectories move is clang's business;
            # the comparison must answer either way with a verdict, not an error.
            clang = _cli("compare", "--project", "variants", "--commit", "a" * 40, "--env", "cpu", "--env",
                         "cpu+clang", "--run", "--timeout", "500", "--url", url, "--format", "json", env=env,
                         timeout_s=600)
            assert clang.returncode in (0, 1), clang.stdout + clang.stderr
            answer = json.loads(clang.stdout)
            assert answer["same_build"] is False
            # Whether clang moves a trajectory is an observation, not a requirement: said for the
            # record (docs/ENVIRONMENTS.md quotes it; `pytest -s` shows it).
            print(f"gcc against clang: {answer['comparison']['verdict']} {answer['comparison']['counts']}")
            detail = client.run(answer["b"]["run_id"])
            assert "clang" in (detail["toolchain"] or {}).get("cxx_version", ""), detail["toolchain"]
            assert detail["build_variant"] == {"compiler": "clang++", "cflags": [], "cuda_cflags": [], "cuda_archs": None}
            assert detail["fingerprint"]["device_kind"] == "cpu"
        client.close()
    finally:
        server.terminate()
        server.wait(timeout=60)


@pytest.mark.parametrize(("name", "valid"), [("cpu", True), ("gpu.sm90", True), ("cpu+fma", True), ("a-b+c-d", True),
                                             ("a--b", False), ("cpu+a--b", False), ("cpu++a", False), ("+a", False),
                                             ("cpu+fma+x", False)])
def test_environment_names_leave_double_hyphens_to_variant_queues(name: str, valid: bool) -> None:
    from pydantic import TypeAdapter, ValidationError

    from service.api.schemas import EnvironmentName

    try:
        TypeAdapter(EnvironmentName).validate_python(name)
        accepted = True
    except ValidationError:
        accepted = False
    assert accepted is valid
