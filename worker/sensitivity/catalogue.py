"""The mutation catalogue: realistic defects of the bundled kernels (csrc/) and refactors that must
stay bit-identical, as unified-diff patches with their class and what they should change.

Layout (worker/sensitivity/catalogue/): `catalogue.toml` lists every entry (`id` = "<class>/<name>",
`kind` = "defect" | "refactor", `expect`, and for a defect optionally `attribution`: what the
attribution should call its changed cases, a variant of worker/attribution/variants.py, "rounding-level",
"quantization" (a change of the quantizer: codes, scales, block layout), or "none" where no call models it), and `<class>/<name>.patch` is its patch against csrc/
(paths `a/<file>`, relative to the kernel source root). A patch is applied with GNU patch and no
fuzz (or `git apply` where patch is missing), so a patch that no longer matches the kernels fails loudly instead of landing somewhere else.

Which builds a patch reaches follows from the files it touches: `cpu/` only the CPU build, `cuda/`
only the CUDA build, anything else (optimizer_math.h, quant_map.h, ops.cpp...) both.
"""

from __future__ import annotations

import functools
import hashlib
import re
import shutil
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CATALOGUE = Path(__file__).resolve().parent / "catalogue"
KINDS = ("defect", "refactor")
_ID = re.compile(r"^[a-z0-9_]+/[a-z0-9_]+$")
_TOUCHED = re.compile(r"^\+\+\+ b/(\S+)", re.MULTILINE)


class CatalogueError(ValueError):
    """A catalogue that cannot be used as it is; the message names the entry and the fix."""


@dataclass(frozen=True)
class Mutant:
    id: str  # "<class>/<name>"
    kind: str  # "defect" | "refactor"
    expect: str
    patch_path: Path
    attribution: str | None = None  # the attribution's expected call (module docstring); None: not stated

    @property
    def mutant_class(self) -> str:
        return self.id.split("/", 1)[0]

    @property
    def patch(self) -> str:
        return self.patch_path.read_text()

    @property
    def patch_sha256(self) -> str:
        return hashlib.sha256(self.patch_path.read_bytes()).hexdigest()

    @property
    def touched_files(self) -> list[str]:
        return _TOUCHED.findall(self.patch)

    @property
    def reaches(self) -> frozenset[str]:
        """The builds the patch changes: {"cpu"}, {"cuda"} or both."""
        reached: set[str] = set()
        for path in self.touched_files:
            if path.startswith("cpu/"):
                reached.add("cpu")
            elif path.startswith("cuda/"):
                reached.add("cuda")
            else:
                reached.update(("cpu", "cuda"))
        return frozenset(reached)


def load_catalogue(folder: Path = DEFAULT_CATALOGUE) -> list[Mutant]:
    """Every entry of the catalogue in `folder`, in file order; every problem in one CatalogueError."""
    folder = Path(folder)
    index = folder / "catalogue.toml"
    if not index.is_file():
        raise CatalogueError(f"{folder} has no catalogue.toml; pass the catalogue folder (default {DEFAULT_CATALOGUE})")
    try:
        entries = tomllib.loads(index.read_text()).get("mutant", [])
    except tomllib.TOMLDecodeError as error:
        raise CatalogueError(f"{index} is not valid TOML: {error}") from None
    problems, mutants, seen = [], [], set()
    for number, entry in enumerate(entries, 1):
        where = f"entry {number} ({entry.get('id', 'no id')})"
        mutant_id, kind = entry.get("id", ""), entry.get("kind", "")
        if not _ID.match(mutant_id):
            problems.append(f"{where}: id must be '<class>/<name>' in lower case")
            continue
        if mutant_id in seen:
            problems.append(f"{where}: duplicate id")
        seen.add(mutant_id)
        if kind not in KINDS:
            problems.append(f"{where}: kind must be one of {KINDS}, got {kind!r}")
        if not entry.get("expect"):
            problems.append(f"{where}: say what it should change in `expect`")
        unknown = sorted(set(entry) - {"id", "kind", "expect", "attribution"})
        if unknown:
            problems.append(f"{where}: unknown fields {unknown}")
        attribution = entry.get("attribution")
        if attribution is not None and (kind != "defect" or attribution not in attribution_calls()):
            problems.append(f"{where}: attribution {attribution!r} must be, on a defect, one of "
                            f"{', '.join(sorted(attribution_calls()))}")
        patch_path = folder / f"{mutant_id}.patch"
        if not patch_path.is_file():
            problems.append(f"{where}: its patch {patch_path} is missing")
            continue
        mutants.append(Mutant(id=mutant_id, kind=kind, expect=entry.get("expect", ""), patch_path=patch_path,
                              attribution=attribution))
    for stray in sorted(folder.glob("*/*.patch")):
        if stray.relative_to(folder).with_suffix("").as_posix() not in seen:
            problems.append(f"{stray} is not listed in {index}: add an entry or remove the file")
    if problems:
        raise CatalogueError(f"catalogue {folder} has {len(problems)} problem(s): " + "; ".join(problems))
    return mutants


@functools.cache
def attribution_calls() -> frozenset[str]:
    """What a catalogue entry's `attribution` may say: a variant's name, "rounding-level", "quantization",
    or "none"."""
    from worker.attribution.variants import CATALOGUE  # torch: only when a catalogue states attributions

    return frozenset({variant.name for variant in CATALOGUE} | {"rounding-level", "quantization", "none"})


def select(mutants: list[Mutant], only: list[str] | None) -> list[Mutant]:
    """The mutants named by `only` (each a class, e.g. "eps", or an id, e.g. "eps/adam_inside_sqrt")."""
    if not only:
        return list(mutants)
    known_ids = {m.id for m in mutants}
    known_classes = {m.mutant_class for m in mutants}
    unknown = [name for name in only if name not in known_ids and name not in known_classes]
    if unknown:
        raise CatalogueError(f"--only {', '.join(unknown)}: no such class or mutant id; classes are "
                             f"{', '.join(sorted(known_classes))}")
    return [m for m in mutants if m.id in only or m.mutant_class in only]


def _patch_command(mutant: Mutant, root: Path, dry_run: bool) -> tuple[list[str], Path | None]:
    """GNU patch with no fuzz; where it is not installed (a bare GPU image), `git apply`, which
    never fuzzes, run inside the tree (a folder outside any git work tree)."""
    if shutil.which("patch"):
        command = ["patch", "-p1", "--fuzz=0", "--batch", "--forward", "--no-backup-if-mismatch",
                   "--reject-file=-", "-d", str(root), "-i", str(mutant.patch_path.resolve())]
        return command + (["--dry-run"] if dry_run else []), None
    if shutil.which("git"):
        return ["git", "apply", "-p1", *(["--check"] if dry_run else []), str(mutant.patch_path.resolve())], root
    raise CatalogueError("neither GNU patch nor git is installed; install one (apt-get install patch) to apply "
                         "the catalogue")


def apply_patch(mutant: Mutant, root: Path, *, dry_run: bool = False) -> None:
    """Apply `mutant` to the kernel tree at `root` in place (no fuzz, no backup files)."""
    command, cwd = _patch_command(mutant, Path(root), dry_run)
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise CatalogueError(f"{mutant.id}: {mutant.patch_path} does not apply cleanly to {root}: "
                             f"{(done.stdout + done.stderr).strip()}; the kernels changed: update the patch")


def mutant_tree(mutant: Mutant, source: Path, dest: Path) -> Path:
    """A copy of the kernel tree `source` at `dest` with `mutant` applied."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__", "build"))
    apply_patch(mutant, dest)
    return dest
