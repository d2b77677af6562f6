"""Builds that depend on the host and on the tree's flags (issue 20):

* a host-dependent build (-march=native in a torch-extension's flags, and every `command` build,
  whose CMake may add it) keys its cache on the host CPU's ISA features: the same tree on a CPU
  with another feature set is a miss, on the same one a hit;
* `[build] cflags / cuda_cflags / defines` reach the compiler and the digest, and are validated;
* `command` builds compile through ccache as CMake's compiler launcher: a second build of a
  changed tree hits for the files that did not change; read-only for an untrusted build.

The CPU feature sets are injected through `cpu_features=` (a parameter only tests pass).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from service.core.project_config import ProjectConfigError, parse_config
from worker.build import build_digest, find_ccache
from worker.build.host_cpu import depends_on_host, isa_digest, isa_features
from worker.build.project import build_project, command_digest

FIXTURES = Path(__file__).resolve().parents[3] / "tests" / "fixtures"
AVX2_HOST = ("avx", "avx2", "fma", "sse4_2")
AVX512_HOST = (*AVX2_HOST, "avx512f", "avx512bw")


def _extension_config(extra: str = "") -> object:
    return parse_config(f'[build]\nkind = "torch-extension"\n{extra}')


# ---------------------------------------------------------------- host ISA in keys and fingerprint
def test_isa_features_keep_instruction_sets_and_drop_other_cpu_flags():
    cpuinfo = "processor : 0\nflags : fpu hypervisor avx2 sse4_2 constant_tsc avx512f fma\n"
    features = isa_features(cpuinfo)
    if features and "hypervisor" not in features:  # x86: only instruction-set extensions count
        assert features == ("avx2", "avx512f", "fma", "sse4_2")
    assert isa_digest(AVX2_HOST) == isa_digest(reversed(AVX2_HOST)) != isa_digest(AVX512_HOST)
    assert depends_on_host(["-O3", "-march=native"]) and depends_on_host(["-mcpu=native"])
    assert not depends_on_host(["-O3", "-march=x86-64-v3"])


def test_native_flags_put_the_host_cpu_in_the_extension_digest(tmp_path: Path):
    source = tmp_path / "src"
    shutil.copytree(FIXTURES / "tiny_ext", source)
    native = ("-O3", "-march=native")
    on_avx2 = build_digest(source, cuda_archs=[], extra_cflags=native, cpu_features=AVX2_HOST)
    assert build_digest(source, cuda_archs=[], extra_cflags=native, cpu_features=AVX2_HOST) == on_avx2
    assert build_digest(source, cuda_archs=[], extra_cflags=native, cpu_features=AVX512_HOST) != on_avx2
    # Portable flags: the CPU does not matter, so the cache is shared across hosts.
    portable = build_digest(source, cuda_archs=[], extra_cflags=("-O3",), cpu_features=AVX2_HOST)
    assert build_digest(source, cuda_archs=[], extra_cflags=("-O3",), cpu_features=AVX512_HOST) == portable


def test_a_command_build_on_another_cpu_is_a_miss_and_on_the_same_a_hit(tmp_path: Path):
    tree = tmp_path / "tree"
    tree.mkdir()
    config = parse_config('[build]\nkind="command"\nlibrary="out.txt"\ncommands=["sh -c \'echo built > out.txt\'"]\n')
    cache = tmp_path / "cache"
    first = build_project(tree, config, cache_dir=cache, cuda_archs=[], cpu_features=AVX2_HOST)
    assert first.ok and not first.cached, first.error
    same = build_project(tree, config, cache_dir=cache, cuda_archs=[], cpu_features=AVX2_HOST)
    assert same.ok and same.cached and same.digest == first.digest
    other = build_project(tree, config, cache_dir=cache, cuda_archs=[], cpu_features=AVX512_HOST)
    assert other.ok and not other.cached and other.digest != first.digest
    assert command_digest(tree, config, [], AVX2_HOST) == first.digest


def test_the_cpu_fingerprint_names_the_isa_features():
    torch = pytest.importorskip("torch")
    from worker.engine.environment import fingerprint

    here = fingerprint(torch.device("cpu"))
    assert here.cpu_isa == isa_digest()
    assert here.cpu_isa in here.class_key
    other = fingerprint(torch.device("cpu"), cpu_features=AVX512_HOST)
    assert other.cpu_isa == isa_digest(AVX512_HOST) and other.class_key != here.class_key


# ---------------------------------------------------------------- flags and defines from optdrift.toml
def test_flags_and_defines_are_validated_with_the_field_named():
    config = _extension_config('cflags = ["-march=native"]\ncuda_cflags = ["-Xptxas=-v"]\n'
                               'defines = { USE_AVX2 = "1", B = "x" }\n')
    assert config.build.define_flags() == ["-DB=x", "-DUSE_AVX2=1"]
    for bad, field in [('cflags = ["-O2\\n-evil"]', "build.cflags"), ('cflags = ["a b"]', "build.cflags"),
                       ('cflags = ["-Dx=\\u0000"]', "build.cflags"), ('cuda_cflags = ["$(x)"]', "build.cuda_cflags"),
                       ('defines = { "1BAD" = "1" }', "not a C identifier"),
                       ('defines = { "A-B" = "1" }', "not a C identifier"),
                       ('defines = { OK = "two words" }', "build.defines.OK")]:
        with pytest.raises(ProjectConfigError, match=field):
            _extension_config(bad + "\n")
    with pytest.raises(ProjectConfigError, match="for build kind 'torch-extension'"):
        parse_config('[build]\nkind="command"\nlibrary="x"\ncommands=["true"]\ndefines={A="1"}\n')


@pytest.mark.slow
def test_a_define_selects_the_code_path_and_is_part_of_the_digest(tmp_path: Path):
    tree = tmp_path / "tree"
    shutil.copytree(FIXTURES / "define_ext", tree)
    cache = tmp_path / "cache"
    selected = {}
    for value in ("1", "2"):
        config = _extension_config(f'defines = {{ OPTDRIFT_TEST_PATH = "{value}" }}\ncflags = ["-O2"]\n')
        built = build_project(tree, config, cache_dir=cache, cuda_archs=[])
        assert built.ok, built.error
        log = Path(built.log_path).read_text()
        assert f"-DOPTDRIFT_TEST_PATH={value}" in log and "-O2" in log
        code = ("import sys, torch; torch.ops.load_library(sys.argv[1]);"
                "print(torch.ops.optdrift_define.selected_path())")
        out = subprocess.run([sys.executable, "-c", code, built.library_path], check=True,
                             capture_output=True, text=True).stdout
        selected[value] = (int(out.strip()), built.digest)
    assert selected["1"][0] == 1 and selected["2"][0] == 2
    assert selected["1"][1] != selected["2"][1]


# ---------------------------------------------------------------- command builds through ccache
@pytest.fixture
def ccache_here(monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("OPTDRIFT_CCACHE", raising=False)
    found = find_ccache()
    if found is None or shutil.which("cmake") is None or shutil.which("ninja") is None:
        pytest.skip("needs ccache, cmake and ninja")
    return found


def _cmake_tree(tmp_path: Path, name: str) -> Path:
    tree = tmp_path / name
    shutil.copytree(FIXTURES / "cmake_project", tree, ignore=shutil.ignore_patterns("commits", "build"))
    return tree


def _cmake_config(tree: Path):  # noqa: ANN202
    return parse_config((tree / "optdrift.toml").read_text())


@pytest.mark.slow
def test_a_changed_cmake_tree_recompiles_only_what_changed_through_ccache(ccache_here: Path, tmp_path: Path):
    cache = tmp_path / "cache"
    first_tree = _cmake_tree(tmp_path, "first")
    first = build_project(first_tree, _cmake_config(first_tree), cache_dir=cache, cuda_archs=[])
    assert first.ok, first.error
    # (CMake's compiler probe, CMakeCXXCompilerABI.cpp, goes through the launcher too)
    assert first.compiler_cache is not None, first.error
    assert {"adamw.cpp", "sgd_momentum.cpp"} <= set(first.compiler_cache.missed_files), first.compiler_cache
    log = Path(first.log_path).read_text()
    assert "as CMake's compiler launcher" in log and "read-write" in log

    second_tree = _cmake_tree(tmp_path, "second")  # another folder, one file changed
    with open(second_tree / "src" / "sgd_momentum.cpp", "a") as source:
        source.write("\nnamespace { [[maybe_unused]] constexpr int changed_for_the_test = 1; }\n")
    second = build_project(second_tree, _cmake_config(second_tree), cache_dir=cache, cuda_archs=[])
    assert second.ok and not second.cached and second.digest != first.digest, second.error
    stats = second.compiler_cache
    assert stats is not None and stats.hits >= 1, stats
    assert "sgd_momentum.cpp" in stats.missed_files and "adamw.cpp" not in stats.missed_files, stats
    assert f"{stats.hits} hit(s)" in Path(second.log_path).read_text()


@pytest.mark.slow
def test_an_untrusted_command_build_reads_the_compiler_cache_and_adds_nothing(ccache_here: Path, tmp_path: Path):
    cache = tmp_path / "cache"
    tree = _cmake_tree(tmp_path, "trusted")
    assert build_project(tree, _cmake_config(tree), cache_dir=cache, cuda_archs=[]).ok
    objects_before = sorted(p.relative_to(cache) for p in (cache / "command" / "ccache").rglob("*") if p.is_file()
                            and "stats" not in p.name and not p.name.endswith(".lock"))

    changed = _cmake_tree(tmp_path, "untrusted")
    with open(changed / "src" / "adamw.cpp", "a") as source:
        source.write("\nnamespace { [[maybe_unused]] constexpr int planted = 2; }\n")
    untrusted = build_project(changed, _cmake_config(changed), cache_dir=cache, cuda_archs=[], trusted=False)
    assert untrusted.ok, untrusted.error
    stats = untrusted.compiler_cache
    assert stats.hits >= 1 and "adamw.cpp" in stats.missed_files and "sgd_momentum.cpp" not in stats.missed_files, stats
    assert "read-only (untrusted build)" in Path(untrusted.log_path).read_text()
    objects_after = sorted(p.relative_to(cache) for p in (cache / "command" / "ccache").rglob("*") if p.is_file()
                           and "stats" not in p.name and not p.name.endswith(".lock"))
    assert objects_after == objects_before
