"""Issue 33 item 4: no git, no tool with repository config, runs in a submitted tree outside the box.

A base archive may carry `.git/config` defining filter, fsmonitor and other commands, and a
`.gitattributes` pointing every file at them. `verify --patch` against that commit used to run
`git apply` in the extracted tree, which read that config and ran the commands as the API's user.
These tests upload such a tree through the real API (real PostgreSQL, the app's own routes) and
check that no command of the tree ever runs, that the patch still applies, and that `.git` never
reaches an extracted tree (the API's or a worker's).
"""

from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

from service.core.archives import ArchiveLimits, extract_archive, pack_directory, sha256_hex
from tests.service_fixtures import make_archive


def _canary_command(canary: Path) -> str:
    # Each command leaves a file named after the hook that ran it, then passes its input through
    # (a clean/smudge filter must, or git would fail and the attack would be visible). Double
    # quotes: in git's config syntax an unquoted `;` starts a comment.
    return f"\"sh -c 'touch {canary}; cat'\""


def _hostile_base(tmp_path: Path) -> tuple[dict[str, bytes | str], Path]:
    """A source tree whose `.git` defines commands for every hook `git apply` could reach."""
    canaries = tmp_path / "canaries"
    canaries.mkdir()
    config = "\n".join([
        "[core]",
        "\trepositoryformatversion = 0",
        "\tbare = false",
        f"\tfsmonitor = {_canary_command(canaries / 'fsmonitor')}",
        f"\thooksPath = {canaries}",
        f"\tpager = {_canary_command(canaries / 'pager')}",
        '[filter "x"]',
        f"\tclean = {_canary_command(canaries / 'clean')}",
        f"\tsmudge = {_canary_command(canaries / 'smudge')}",
        "\trequired = true",
        '[diff "x"]',
        f"\ttextconv = {_canary_command(canaries / 'textconv')}",
        f"\tcommand = {_canary_command(canaries / 'diff')}",
        "",
    ])
    files: dict[str, bytes | str] = {
        "ops.cpp": "int x = 1;\n",
        "cpu/a.cpp": "int a = 1;\n",
        ".gitattributes": "* filter=x diff=x\n",
        # Enough of a repository for git's discovery to take it as one.
        ".git/HEAD": "ref: refs/heads/main\n",
        ".git/config": config,
        ".git/objects/info/packs": "",
        ".git/refs/heads/.keep": "",
        # A nested repository (a vendored submodule's own .git) is dropped the same way.
        "third_party/lib/.git/config": config,
        "third_party/lib/lib.h": "#pragma once\n",
    }
    return files, canaries


def _project(api, name: str = "kern") -> None:  # noqa: ANN001
    response = api.post("/api/v1/projects", json={"name": name})
    assert response.status_code == 201, response.text


def _extracted(api, digest: str, dest: Path) -> Path:  # noqa: ANN001
    response = api.get(f"/api/v1/sources/{digest}")
    assert response.status_code == 200, response.text
    return extract_archive(response.content, dest, ArchiveLimits())


def test_the_filter_attack_runs_nothing_and_the_patch_still_applies(api, tmp_path: Path) -> None:  # noqa: ANN001
    _project(api)
    files, canaries = _hostile_base(tmp_path)
    submitted = api.post("/api/v1/projects/kern/commits", data={"sha": "base1"},
                         files={"archive": ("s.tar.gz", make_archive(files), "application/gzip")})
    assert submitted.status_code == 201, submitted.text

    patch = b"--- a/ops.cpp\n+++ b/ops.cpp\n@@ -1 +1 @@\n-int x = 1;\n+int x = 2;\n"
    response = api.post("/api/v1/projects/kern/verify", data={"base": "base1"},
                        files={"patch": ("p.diff", patch)})
    assert sorted(p.name for p in canaries.iterdir()) == [], "a command from the tree's .git ran"
    assert response.status_code == 201, response.text

    tree = _extracted(api, response.json()["source_digest"], tmp_path / "patched")
    assert (tree / "ops.cpp").read_text() == "int x = 2;\n"
    assert (tree / "cpu" / "a.cpp").read_text() == "int a = 1;\n"
    # The tree's own .gitattributes stays part of its source; only git metadata is left out.
    assert (tree / ".gitattributes").read_text() == "* filter=x diff=x\n"
    assert not (tree / ".git").exists() and not (tree / "third_party" / "lib" / ".git").exists()
    assert (tree / "third_party" / "lib" / "lib.h").exists()
    assert "left out" in submitted.headers.get("Optdrift-Archive-Note", ""), submitted.headers


def test_the_patcher_reads_no_config_even_in_a_tree_that_has_a_git_folder(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """The second layer on its own: a tree on disk *with* `.git` (as if extraction had kept it).
    The patcher's git reads only the service's empty repository: no filter runs, `ident` does not
    expand `$Id$`, `eol=crlf` does not rewrite line ends; the bytes written are the patch's. Nor
    does it read the API process's own git environment or HOME (GIT_CONFIG_*, ~/.gitconfig)."""
    from service.domain.patches import PatchLimits, apply_patch_bounded

    files, canaries = _hostile_base(tmp_path)
    api_home = tmp_path / "api-home"
    api_home.mkdir()
    (api_home / ".gitconfig").write_text(
        f'[filter "x"]\n\tclean = {_canary_command(canaries / "home-clean")}\n')
    monkeypatch.setenv("HOME", str(api_home))
    monkeypatch.setenv("GIT_CONFIG_COUNT", "1")
    monkeypatch.setenv("GIT_CONFIG_KEY_0", "filter.x.smudge")
    monkeypatch.setenv("GIT_CONFIG_VALUE_0", f"sh -c 'touch {canaries / 'env-smudge'}; cat'")
    # Observable even where the attributes would mask a config value: git writes its trace there.
    monkeypatch.setenv("GIT_TRACE", str(canaries / "env-trace"))
    files[".gitattributes"] = "* filter=x diff=x ident eol=crlf\n"
    files["ops.cpp"] = "int x = 1;\n// $Id$\n"
    tree = tmp_path / "tree"
    for name, content in files.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(content) if isinstance(content, str) else (tree / name).write_bytes(content)
    patch_file = tmp_path / "change.patch"
    patch_file.write_bytes(b"--- a/ops.cpp\n+++ b/ops.cpp\n@@ -1,2 +1,2 @@\n-int x = 1;\n+int x = 2;\n"
                           b" // $Id$\n")
    apply_patch_bounded(tree=tree, patch_file=patch_file,
                        limits=PatchLimits(max_file_bytes=1 << 20, max_total_bytes=1 << 20))
    assert sorted(p.name for p in canaries.iterdir()) == [], (
        "git ran a command or wrote a file named by the tree's .git or the API's environment")
    assert (tree / "ops.cpp").read_bytes() == b"int x = 2;\n// $Id$\n"


def test_git_binary_patches_still_apply(api, tmp_path: Path) -> None:  # noqa: ANN001
    """`git diff --binary` output (a literal for a new file, a delta for a changed one) applies as
    before: the isolated git is the same git."""
    _project(api)
    repo = tmp_path / "repo"
    repo.mkdir()
    blob = bytes(range(256)) * 64
    (repo / "ops.cpp").write_text("int x = 1;\n")
    (repo / "table.bin").write_bytes(blob)
    env = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null", "HOME": str(tmp_path),
           "PATH": "/usr/bin:/bin", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}

    def git(*args: str) -> bytes:
        return subprocess.run(["git", "-C", str(repo), *args], env=env, check=True,
                              capture_output=True).stdout

    git("init", "-q")
    git("add", "-A")
    git("commit", "-q", "-m", "base")
    archive = pack_directory(repo)
    assert api.post("/api/v1/projects/kern/commits", data={"sha": "base3"},
                    files={"archive": ("s.tar.gz", archive)}).status_code == 201
    changed = blob[:1000] + b"\x01\x02\x03" + blob[1003:]
    (repo / "table.bin").write_bytes(changed)
    (repo / "new.bin").write_bytes(bytes(range(255, -1, -1)) * 8)
    git("add", "-A")
    patch = git("diff", "--cached", "--binary")
    assert b"GIT binary patch" in patch and b"delta " in patch or b"literal " in patch
    response = api.post("/api/v1/projects/kern/verify", data={"base": "base3"},
                        files={"patch": ("p.diff", patch)})
    assert response.status_code == 201, response.text
    tree = _extracted(api, response.json()["source_digest"], tmp_path / "patched")
    assert (tree / "table.bin").read_bytes() == changed
    assert (tree / "new.bin").read_bytes() == bytes(range(255, -1, -1)) * 8


def test_git_metadata_is_never_extracted_and_the_upload_says_so(api, tmp_path: Path) -> None:  # noqa: ANN001
    """The rule at intake: `.git` (a folder or a gitlink file, at any depth) is accepted in an
    upload but never extracted, by the API or by a worker (both extract with extract_archive);
    the answer's Optdrift-Archive-Note names how many members were left out and why."""
    files, _canaries = _hostile_base(tmp_path)
    files["vendor/.git"] = "gitdir: ../../.git/modules/vendor\n"  # a submodule's gitlink file
    archive = make_archive(files)
    uploaded = api.post("/api/v1/sources", data={"project": "kern"}, files={"archive": ("s.tar.gz", archive)})
    assert uploaded.status_code == 404  # no such project yet
    _project(api)
    uploaded = api.post("/api/v1/sources", data={"project": "kern"}, files={"archive": ("s.tar.gz", archive)})
    assert uploaded.status_code == 200, uploaded.text
    assert uploaded.json()["digest"] == sha256_hex(archive)
    note = uploaded.headers["Optdrift-Archive-Note"]
    assert "6 members" in note and ".git" in note, note
    tree = extract_archive(archive, tmp_path / "worker-side", ArchiveLimits())
    names = sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*"))
    assert names == [".gitattributes", "cpu", "cpu/a.cpp", "ops.cpp", "third_party", "third_party/lib",
                     "third_party/lib/lib.h"], names
    clean = api.post("/api/v1/sources", data={"project": "kern"},
                     files={"archive": ("s.tar.gz", make_archive({"ops.cpp": "1"}))})
    assert clean.status_code == 200 and "Optdrift-Archive-Note" not in clean.headers


def test_the_member_limit_still_counts_git_members() -> None:
    """Dropped members are still read and counted: a `.git` full of files cannot slip a bomb past
    the member or size limits."""
    import pytest

    from service.core.archives import ArchiveError

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for index in range(30):
            info = tarfile.TarInfo(f".git/objects/{index:02d}")
            tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(ArchiveError, match="more than 10 members"):
        extract_archive(buffer.getvalue(), Path("/nonexistent/never-written"), ArchiveLimits(max_members=10))
