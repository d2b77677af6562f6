"""The upgrade from the previous release (docs/RELEASES.md, "Upgrading a deployment"): a database
and a build cache made by 0.1.0's own code are migrated and served by this tree with nothing lost.

0.1.0 is commit 94cce35 (its last commit before 0.2.0's round), read from this repository's history
into a temporary folder. Its code runs in a subprocess with that folder first on PYTHONPATH:

- the database: 0.1.0's migrations, then a project, two tokens, two commits with their source
  archives, their runs (claimed, built, cases stored in a batch, finished and judged by 0.1.0's
  run_store: no-baseline, then changed) and an acknowledgement through 0.1.0's API; then every
  read of 0.1.0's API and every table are recorded (tests/project/previous_release_writer.py).
  This tree's `alembic upgrade head` (0010-0012) follows, and every row and column 0.1.0 wrote
  must read back unchanged, every answer 0.1.0's API gave must come back the same from this tree's
  API (the fields it added aside), with 0.1.0's tokens.
- the build cache: 0.1.0's build_project puts a command build in a cache folder; this tree
  serves it from there (the command recipe did not change), and rebuilds an entry whose recipe
  changed (0.1.0's extension builds: recipe 2 -> 3), leaving the old entry for eviction.

Skipped where 94cce35 is not in the clone (a shallow clone): never passed without it. PostgreSQL
as for the rest of the suite (tests/service_fixtures.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from tests.project import previous_release_writer as writer
from tests.service_fixtures import API_TEST_REDIS, REPO_ROOT, create_database, drop_database, flush_redis

PREVIOUS_RELEASE = "94cce35"  # 0.1.0's last commit (docs/RELEASES.md)
# What 0.2.0 deliberately changed in an answer 0.1.0 gave for the same rows (CHANGELOG.md 0.2.0):
# nothing of these reads. A field that was dropped or changed meaning would be listed here with its
# changelog fragment, and this test would say which.
CHANGED_ON_PURPOSE: dict[str, str] = {}


def _previous_tree(tmp_path: Path) -> Path:
    if not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout: 0.1.0's code is read from the repository's history")
    found = subprocess.run(["git", "-C", str(REPO_ROOT), "cat-file", "-e", f"{PREVIOUS_RELEASE}^{{commit}}"],
                           capture_output=True)
    if found.returncode != 0:
        pytest.skip(f"commit {PREVIOUS_RELEASE} (0.1.0) is not in this clone (shallow?): fetch the full history "
                    "to run the upgrade test")
    tree = tmp_path / "optdrift-0.1.0"
    tree.mkdir()
    listed = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", "--format=tar", PREVIOUS_RELEASE,
                             "service", "worker", "migrations", "pyproject.toml"], capture_output=True, check=True)
    archive = tmp_path / "previous.tar"
    archive.write_bytes(listed.stdout)
    with tarfile.open(archive) as tar:
        tar.extractall(tree, filter="data")
    assert 'version = "0.1.0"' in (tree / "pyproject.toml").read_text()
    return tree


def _run_previous(tree: Path, args: list[str], env: dict[str, str], timeout_s: float = 300) -> subprocess.CompletedProcess:
    """A Python command with 0.1.0's code first on the path (-P: not this tree's script folder)."""
    full_env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-P", *args], cwd=tree, env=full_env, capture_output=True, text=True,
                          timeout=timeout_s)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done


def _table_dump(url: str) -> dict[str, list[dict]]:
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            tables = [row[0] for row in connection.execute(text(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public' ORDER BY 1"))]
            dump = {table: [dict(row._mapping) for row in connection.execute(text(f'SELECT * FROM "{table}" ORDER BY 1'))]
                    for table in tables}
    finally:
        engine.dispose()
    return json.loads(json.dumps(dump, default=str))  # the writer's own encoding, for equal comparison


def lost(old, new, where: str = "") -> list[str]:  # noqa: ANN001
    """What `new` no longer says of `old`: each key of a mapping (recursively) kept with an equal value,
    lists item by item; keys `new` adds are not losses."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [loss for key, value in old.items()
                for loss in ([f"{where}.{key}: gone"] if key not in new else lost(value, new[key], f"{where}.{key}"))]
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [loss for index, (a, b) in enumerate(zip(old, new)) for loss in lost(a, b, f"{where}[{index}]")]
    return [] if old == new else [f"{where}: {old!r} -> {new!r}"]


@pytest.fixture
def upgraded_database(tmp_path: Path):  # noqa: ANN201
    tree = _previous_tree(tmp_path)
    name = f"optdrift_upgrade_{os.getpid()}"
    url = create_database(name)
    home = tmp_path / "home"
    out = tmp_path / "previous.json"
    try:
        _run_previous(tree, [str(Path(writer.__file__)), str(out)],
                      {"OPTDRIFT_DATABASE_URL": url, "OPTDRIFT_HOME": str(home), "OPTDRIFT_BROKER_URL": API_TEST_REDIS,
                       # no maintenance thread (the reaper) in 0.1.0's API process: the rows are the writer's
                       "OPTDRIFT_MAINTENANCE_INTERVAL_S": "0"})
        previous = json.loads(out.read_text())
        # The writer ran 0.1.0's code and migrations, not this tree's.
        assert previous["code"].startswith(str(tree)) and previous["migrations"] == str(tree / "migrations")
        before = _table_dump(url)
        from service.db.migrate import upgrade_to_head

        upgrade_to_head(url)
        yield url, home, previous, before
    finally:
        drop_database(name)


def test_a_database_of_0_1_0_is_migrated_and_served_with_nothing_lost(upgraded_database) -> None:  # noqa: ANN001
    from fastapi.testclient import TestClient
    from sqlalchemy.orm import Session

    from service.api.main import create_app
    from service.db.session import get_session
    from service.settings import Settings, get_settings

    url, home, previous, before = upgraded_database
    assert before == previous["tables"]
    after = _table_dump(url)
    assert after["alembic_version"] != before["alembic_version"], "this tree's migrations ran"
    for table, rows in before.items():
        if table == "alembic_version":
            continue
        assert len(after[table]) == len(rows), table
        losses = [loss for old, new in zip(rows, after[table]) for loss in lost(old, new, table)]
        assert not losses, f"the upgrade changed rows 0.1.0 wrote: {losses}"

    flush_redis(API_TEST_REDIS)
    settings = Settings(home=home, database_url=url, broker_url=API_TEST_REDIS, maintenance_interval_s=0)
    engine = create_engine(url)

    def session():  # noqa: ANN202
        with Session(engine) as own:
            yield own

    app = create_app()
    app.dependency_overrides[get_settings] = lambda: settings
    app.dependency_overrides[get_session] = session
    try:
        with TestClient(app, headers={"Authorization": f"Bearer {previous['admin_token']}"}) as client:
            losses = []
            for path, old in previous["answers"].items():
                answer = client.get(path)
                assert answer.status_code == 200, (path, answer.status_code, answer.text)
                if path.startswith("/api/v1/sources/"):
                    new = answer.content.hex()  # the archive 0.1.0 stored, byte for byte
                else:
                    new = answer.json() if "json" in answer.headers.get("content-type", "") else answer.text
                losses += [loss for loss in lost(old, new, path) if loss.split(":")[0] not in CHANGED_ON_PURPOSE]
            assert not losses, "0.2.0's API no longer answers what 0.1.0's did:\n" + "\n".join(losses)

            # What 0.1.0 stored is what the verdict says (not merely equal answers to an empty store).
            base_run, changed_run = previous["runs"]
            verdict = client.get(f"/api/v1/runs/{changed_run}").json()["verdict"]
            assert (verdict["outcome"], verdict["baseline_run_id"], verdict["acknowledged"],
                    verdict["acknowledgement_note"]) == ("changed", base_run, True, "the reorder was meant")
            cases = client.get(f"/api/v1/runs/{changed_run}/cases").json()
            assert [(case["case_id"], case["verdict"]) for case in cases["data"]] == [
                ("adam-case", "changed"), ("lion-case", "unchanged")]
            trajectory = client.get(f"/api/v1/runs/{changed_run}/trajectories/adam-case").json()
            assert trajectory["digests"][2:] != client.get(
                f"/api/v1/runs/{base_run}/trajectories/adam-case").json()["digests"][2:]
            assert client.get("/healthz").json()["version"] == app.version

            # 0.1.0's project-scoped submit token still submits, and the new commit finds its baseline.
            submit = client.post(
                f"/api/v1/projects/{writer.PROJECT}/commits",
                headers={"Authorization": f"Bearer {previous['submit_token']}"},
                data={"sha": "c" * 40, "parents": writer.CHANGED_SHA, "ref": "main"},
                files={"archive": ("src.tar.gz", writer.archive({"kernel.cpp": "// c\n"}), "application/gzip")})
            assert submit.status_code in (200, 201), submit.text
    finally:
        engine.dispose()
        flush_redis(API_TEST_REDIS)


# Every command build writes something no other build writes: a build served from the cache shows
# the bytes 0.1.0's build wrote, a rebuild would not.
UNIQUE_OUTPUT = ('[build]\nkind="command"\nlibrary="out.txt"\n'
                 'commands=["sh -c \'echo $(date +%s%N)-$$ > out.txt\'"]\n')
PREVIOUS_BUILDS = """
import json, sys
from pathlib import Path
from service.core.project_config import parse_config
from worker.build.extension import build_extension
from worker.build.project import build_project
tree, extension, cache, config = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
command = build_project(tree, parse_config(config), cache_dir=cache, cuda_archs=[], trusted=True)
compiled = build_extension(extension, cache_dir=cache, cuda_archs=[], trusted=True)
print(json.dumps({"command": command.model_dump(mode="json"), "extension": compiled.model_dump(mode="json"),
                  "code": __import__("worker").__file__}))
"""


@pytest.mark.slow
def test_a_build_cache_of_0_1_0_is_served_or_cleanly_rebuilt(tmp_path: Path) -> None:
    import shutil

    from service.core.project_config import parse_config
    from worker.build.cache import MANIFEST, evict, release_builds
    from worker.build.extension import build_extension
    from worker.build.project import build_project

    tree_0_1_0 = _previous_tree(tmp_path)
    cache = tmp_path / "builds"
    tree = tmp_path / "project"
    tree.mkdir()
    (tree / "payload.txt").write_text("a project's tree\n")
    extension = tmp_path / "extension"
    shutil.copytree(REPO_ROOT / "tests" / "fixtures" / "tiny_ext", extension)
    done = _run_previous(tree_0_1_0, ["-c", PREVIOUS_BUILDS, str(tree), str(extension), str(cache), UNIQUE_OUTPUT], {})
    previous = json.loads(done.stdout.strip().splitlines()[-1])
    assert previous["code"].startswith(str(tree_0_1_0))
    old_command, old_extension = previous["command"], previous["extension"]
    assert old_command["ok"] and old_extension["ok"], (old_command["error"], old_extension["error"])
    built_bytes = Path(old_command["library_path"]).read_bytes()
    old_entry = cache / old_extension["digest"]
    assert (old_entry / MANIFEST).is_file()

    release_builds()
    try:
        # The command recipe is unchanged since 0.1.0: its entry is served as it is, not rebuilt.
        command = build_project(tree, parse_config(UNIQUE_OUTPUT), cache_dir=cache, cuda_archs=[], trusted=True)
        assert command.ok and command.cached, command.error
        assert command.digest == old_command["digest"]
        assert Path(command.library_path).read_bytes() == built_bytes

        # The extension recipe changed (the box writes only out/): 0.1.0's entry is not taken, the
        # build is made once more beside it, and the old entry is left whole for eviction.
        compiled = build_extension(extension, cache_dir=cache, cuda_archs=[], trusted=True)
        assert compiled.ok and not compiled.cached, compiled.error
        assert compiled.digest != old_extension["digest"]
        assert Path(compiled.library_path).is_relative_to(cache / compiled.digest)
        assert (old_entry / MANIFEST).is_file() and Path(old_extension["library_path"]).is_file()
        again = build_extension(extension, cache_dir=cache, cuda_archs=[], trusted=True)
        assert again.cached and again.digest == compiled.digest

        # Eviction takes 0.1.0's unused entry and keeps the two in use (this process holds them).
        removed = evict(cache, 1)
        assert old_entry in removed and not old_entry.exists()
        assert Path(command.library_path).is_file() and Path(compiled.library_path).is_file()
    finally:
        release_builds()
