"""A project's configuration: how to build a source tree and which adapter drives its kernels.

It is read from `optdrift.toml` at the root of the submitted tree (so a build recipe is versioned
with the code it builds: commit N builds the way commit N says), with the project's registered
fields (POST /api/v1/projects: build_kind, build_command, adapter, default_battery, environments)
as defaults for whatever the file leaves out or when there is no file. docs/PROJECTS.md is the
user's guide.

    [project]
    adapter = "tinyopt"              # bundled | bitsandbytes | tinyopt | any importable module name
    adapter_path = ["tools"]         # folders of the tree the adapter module is imported from
    battery = "battery.json"         # built-in name or a JSON file in the tree
    environments = ["cpu"]
    repeats = 1                      # runs of every case (changed cases: at least 2)
    kernel_speed = true              # time the kernels' speed where the worker does (GPU)
    [build]
    kind = "command"                 # torch-extension | command
    commands = ["cmake -S . -B build -G Ninja", "cmake --build build"]
    timeout_s = 600
    library = "build/libtinyopt.so"  # what the adapter loads: a file or folder in the tree
    env = { CMAKE_BUILD_PARALLEL_LEVEL = "2" }
    source_dir = "csrc"              # torch-extension: the folder to compile ("." by default)
    cflags = ["-march=native"]       # torch-extension: added to the host compiler's flags (-O3)
    cuda_cflags = []                 # torch-extension: added to nvcc's flags
    defines = { USE_AVX2 = "1" }     # torch-extension: -DNAME=value for both compilers

No torch, no worker imports: the service validates configurations too.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from service.core.compiler_flags import check_flags, define_problem

CONFIG_FILE = "optdrift.toml"
BuildKind = Literal["torch-extension", "command"]


class ProjectConfigError(ValueError):
    """The configuration is invalid; the message names the file and the field."""


# build.env: the build knobs a tree may set for its own commands (docs/PROJECTS.md). A name passes
# when it is in BUILD_ENV_NAMES or starts with one of BUILD_ENV_PREFIXES, and is not refused by
# _REFUSED_ENV first. Everything else a process reads from its environment (the loader's LD_*,
# search paths, interpreters' start-up hooks, the compiler cache's settings, proxies, HOME) is the
# worker's: a tree that needs a tool gets it from the registered environment's image.
BUILD_ENV_NAMES = frozenset({
    "MAX_JOBS", "CFLAGS", "CXXFLAGS", "CPPFLAGS", "LDFLAGS", "CUDAFLAGS", "CUDAARCHS",
    "TORCH_CUDA_ARCH_LIST", "MAKEFLAGS", "SOURCE_DATE_EPOCH", "VERBOSE", "FORCE_CUDA", "USE_NINJA",
})
BUILD_ENV_PREFIXES = ("CMAKE_", "NVCC_", "BUILD_")
_ENV_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")
_REFUSED_ENV = re.compile(
    r"^(LD_.*|.*_PRELOAD|.*PATH|PYTHON.*|BASH_ENV|ENV|GCONV_PATH|CCACHE_.*|.*_PROXY|HOME|TMPDIR|"
    r"CMAKE_.*_COMPILER_LAUNCHER|NVCC_CCBIN|CMAKE_TOOLCHAIN_FILE|CMAKE_PROJECT_.*_INCLUDE.*)$",
    re.IGNORECASE)
# Options whose argument may be glued to them (`-isystem/usr/include`); the one-letter ones (-I,
# -L, -B...) are any `-X` prefix.
_GLUED_PATH_OPTIONS = ("-isystem", "-iquote", "-idirafter", "-imacros", "-include", "-isysroot", "--sysroot",
                       "-iprefix", "-specs", "--specs", "-ccbin", "--compiler-bindir", "-odir", "--output-directory")
_VALUE_SEPARATORS = re.compile(r"[\s:;,\"']+")


def _path_candidates(word: str) -> list[str]:
    """The parts of one word of a value that could be a path: the word, what follows `=`, and what
    follows an option glued to its argument."""
    candidates = [word, *word.split("=")[1:]]
    if word.startswith("-"):
        candidates.append(word[2:])
        candidates += [word[len(option):] for option in _GLUED_PATH_OPTIONS if word.startswith(option)]
    return candidates


def _names_outside_path(value: str) -> bool:
    """Whether a value names an absolute or home path, or steps up with `..`, in any of its words."""
    for word in filter(None, _VALUE_SEPARATORS.split(value)):
        for candidate in _path_candidates(word):
            if candidate.startswith(("/", "~", "\\")) or ".." in re.split(r"[/\\]", candidate):
                return True
    return False


def build_env_problem(name: str, value: str) -> str | None:
    """Why `name = value` may not be in build.env (None: it may), in words that say what to do
    (the caller says it is build.env)."""
    knobs = f"build knobs only: {', '.join(sorted(BUILD_ENV_NAMES))} or names starting {', '.join(BUILD_ENV_PREFIXES)}"
    if not _ENV_NAME.match(name):
        return f"{name[:80]!r} is not an upper-case variable name ({knobs})"
    if _REFUSED_ENV.match(name):
        return (f"{name} is the worker's to set, never a tree's (loader, search paths, "
                "interpreters, compiler cache, proxies); tools come from the registered environment's image, "
                f"not from the tree's environment. Allowed: {knobs}")
    if name not in BUILD_ENV_NAMES and not name.startswith(BUILD_ENV_PREFIXES):
        return f"{name} is not an allowed build knob ({knobs})"
    if "\x00" in value or "\n" in value or "\r" in value:
        return f"{name}: the value holds a NUL or a line break"
    if _names_outside_path(value):
        return (f"{name} = {value[:120]!r} names a path outside the tree (absolute, '~' or '..'); "
                "paths in build.env are relative to the tree, which is the build's working folder")
    return None


def _relative_inside(value: str, field: str) -> str:
    path = PurePosixPath(value)
    if path.is_absolute() or ".." in path.parts:
        raise ValueError(f"{field} {value!r} must be a path inside the tree (relative, no '..')")
    return value


class BuildConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: BuildKind = "torch-extension"
    commands: list[str] = Field(default_factory=list)
    timeout_s: float = Field(900.0, gt=0, le=6 * 3600)
    library: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    source_dir: str = "."
    # torch-extension only: added to the recipe's flags, part of the build digest.
    cflags: list[str] = Field(default_factory=list)
    cuda_cflags: list[str] = Field(default_factory=list)
    defines: dict[str, str] = Field(default_factory=dict)

    @field_validator("cflags", "cuda_cflags")
    @classmethod
    def _flags_are_allowed(cls, flags: list[str], info) -> list[str]:  # noqa: ANN001
        # An allow-list of flag shapes (service/core/compiler_flags.py): cflags go to gcc/clang,
        # cuda_cflags to nvcc; the worker checks them again before it builds.
        check_flags(flags, f"build.{info.field_name}", "host" if info.field_name == "cflags" else "nvcc")
        return flags

    @field_validator("env")
    @classmethod
    def _env_is_build_knobs(cls, env: dict[str, str]) -> dict[str, str]:
        problems = [problem for name, value in env.items() if (problem := build_env_problem(name, value))]
        if problems:
            raise ValueError("; ".join(problems))
        return env

    @field_validator("defines")
    @classmethod
    def _defines_are_identifiers(cls, defines: dict[str, str]) -> dict[str, str]:
        # Each becomes -Dname=value on the compilers' command lines, an allowed -D shape.
        for name, value in defines.items():
            if (problem := define_problem(name, value)) is not None:
                raise ValueError(problem)
        return defines

    def define_flags(self) -> list[str]:
        """`defines` as compiler arguments, in a stable (sorted) order."""
        return [f"-D{name}={value}" for name, value in sorted(self.defines.items())]

    @field_validator("commands")
    @classmethod
    def _commands_parse(cls, commands: list[str]) -> list[str]:
        for index, command in enumerate(commands):
            try:
                if not shlex.split(command):
                    raise ValueError(f"build.commands[{index}] is empty")
            except ValueError as error:  # unbalanced quotes
                raise ValueError(f"build.commands[{index}] {command!r}: {error}") from None
        return commands

    @field_validator("library", "source_dir")
    @classmethod
    def _inside(cls, value: str | None, info) -> str | None:  # noqa: ANN001
        return None if value is None else _relative_inside(value, f"build.{info.field_name}")

    @model_validator(mode="after")
    def _command_needs_commands_and_output(self) -> "BuildConfig":
        if self.kind == "command" and not self.commands:
            raise ValueError("build kind 'command' needs build.commands (a list of commands run in the tree)")
        if self.kind == "command" and not self.library:
            raise ValueError("build kind 'command' needs build.library: the built file or folder the adapter "
                             "loads, relative to the tree (e.g. 'build/libfoo.so'), or 'installed'")
        if self.kind == "command" and (self.cflags or self.cuda_cflags or self.defines):
            raise ValueError("build.cflags, build.cuda_cflags and build.defines are for build kind "
                             "'torch-extension'; a 'command' build sets its flags in its own commands "
                             "(e.g. -DCMAKE_CXX_FLAGS=...) or through build.env")
        return self


class ProjectConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    adapter: str = Field("bundled", min_length=1)
    # Folders of the tree the kernel host imports the adapter module from (first on sys.path), for
    # an adapter that lives with the library it drives (docs/PROJECTS.md).
    adapter_path: list[str] = Field(default_factory=list)
    battery: str = Field("quick", min_length=1)
    environments: list[str] = Field(default_factory=lambda: ["cpu"], min_length=1)
    # Runs of every case on a new build (1: once). Cases that differ from their baseline are always
    # run at least twice before a change is reported (worker/pipeline.py): a kernel that does not
    # reproduce itself is `nondeterministic`, not `changed`.
    repeats: int = Field(1, ge=1, le=10)
    # Time the kernels' own speed after the battery where the worker does (worker/speed; GPU
    # workers by default). false: never for this project's runs.
    kernel_speed: bool = True
    build: BuildConfig = BuildConfig()

    @field_validator("adapter")
    @classmethod
    def _adapter_is_a_module_name(cls, adapter: str) -> str:
        if not all(part.isidentifier() for part in adapter.split(".")):
            raise ValueError(f"adapter {adapter!r} must be a built-in adapter or an importable module name "
                             "(identifiers separated by dots, e.g. 'myproject_optdrift' or 'myproject.adapter')")
        return adapter

    @field_validator("adapter_path")
    @classmethod
    def _adapter_path_inside(cls, folders: list[str]) -> list[str]:
        return [_relative_inside(folder, f"adapter_path[{i}]") for i, folder in enumerate(folders)]


def config_defaults(project: Any | None) -> dict[str, Any]:
    """The registered project's fields as configuration defaults (a Project row or any object with
    those attributes). `build_command` holds one command per line."""
    if project is None:
        return {}
    build: dict[str, Any] = {"kind": project.build_kind}
    if getattr(project, "build_command", None):
        build["commands"] = [line.strip() for line in project.build_command.splitlines() if line.strip()]
    return {"adapter": project.adapter, "battery": project.default_battery,
            "environments": list(project.environments), "build": build}


def parse_config(text: str, *, defaults: dict[str, Any] | None = None, origin: str = CONFIG_FILE) -> ProjectConfig:
    """Validate the TOML `text` over `defaults`; every problem is named in one ProjectConfigError."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ProjectConfigError(f"{origin} is not valid TOML: {error}") from None
    unknown = set(data) - {"project", "build"}
    if unknown:
        raise ProjectConfigError(f"{origin}: unknown table(s) {sorted(unknown)}; use [project] and [build]")
    merged = dict(defaults or {})
    merged.update(data.get("project", {}))
    if "build" in data:
        base_build = dict(merged.get("build", {}))
        if data["build"].get("kind", base_build.get("kind")) != base_build.get("kind"):
            base_build = {}  # a different build kind than registered: take nothing from the other one
        merged["build"] = {**base_build, **data["build"]}
    return _validate(merged, origin)


def _validate(data: dict[str, Any], origin: str) -> ProjectConfig:
    try:
        return ProjectConfig.model_validate(data)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg'].removeprefix('Value error, ')}"
                             for e in error.errors())
        raise ProjectConfigError(f"{origin}: {problems}") from None


def load_project_config(tree: Path, project: Any | None = None) -> ProjectConfig:
    """The configuration for the extracted source `tree`: its optdrift.toml over the registered
    `project`'s fields, or those fields alone when the tree has no file."""
    defaults = config_defaults(project)
    path = Path(tree) / CONFIG_FILE
    if path.is_file():
        return parse_config(path.read_text(encoding="utf-8"), defaults=defaults, origin=str(path))
    return _validate(defaults, f"project {getattr(project, 'name', '?')} (no {CONFIG_FILE} in the tree)")
