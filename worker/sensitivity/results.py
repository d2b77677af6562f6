"""What a sensitivity run finds: per mutant, which cases of the battery flagged it; per class, the
catch rate. Pydantic, so a run is stored as JSON and read back (the recorded runs, the CI test).
No torch here."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

# A case "catches" a mutant when its verdict against the unmutated build is one of these.
CATCHING_VERDICTS = ("changed", "broken", "nondeterministic")

MutantStatus = Literal[
    "caught",          # a defect some case flagged
    "escaped",         # a defect no case flagged
    "flagged",         # a refactor some case flagged: a false positive
    "clean",           # a refactor no case flagged, as it must be
    "not_applicable",  # the patch does not reach the device's build (a cuda/ file on the CPU)
    "build_failed",    # the mutant does not compile: a catalogue error, not a catch
]


class CaseCatch(BaseModel):
    case_id: str
    verdict: str
    first_divergent_step: int | None = None
    cost: int  # elements x steps


class CheapestCatch(BaseModel):
    """The cheapest case of a larger battery that catches an escaped mutant."""

    battery: str
    case_id: str
    cost: int
    verdict: str
    first_divergent_step: int | None = None
    cases_tried: int


class MutantOutcome(BaseModel):
    id: str
    kind: str
    mutant_class: str
    expect: str
    reaches: list[str]
    patch_sha256: str = ""
    status: MutantStatus
    catches: list[CaseCatch] = []
    group_catches: list[int] = []  # per battery group, how many of its cases caught it
    cheapest_catch: CheapestCatch | None = None
    build_s: float = 0.0
    build_cached: bool = False
    run_s: float = 0.0
    error: str | None = None
    # The attribution of a sample of its changed cases (`optdrift sensitivity --attribute N`):
    # what the catalogue says it should call them, and call -> how many of the sample it called so.
    attributed: bool = False  # the attribution ran on it (a resumed run with --attribute redoes the rest)
    attribution_expected: str | None = None
    attribution: dict[str, int] = {}
    # case id -> its call and the attribution's note (why that call), for the cases behind the counts
    attribution_cases: dict[str, dict[str, str | None]] = {}
    attribution_s: float = 0.0
    attribution_error: str | None = None

    def attribution_call(self) -> str | None:
        """The call most of its attributed cases got ("mixed" on a tie at the top; None: none attributed)."""
        ranked = sorted(self.attribution.items(), key=lambda item: -item[1])
        if not ranked:
            return None
        if len(ranked) > 1 and ranked[1][1] == ranked[0][1]:
            return "mixed"
        return ranked[0][0]


class SensitivityReport(BaseModel):
    catalogue: str
    battery: str
    battery_version: int
    battery_digest: str
    device: str
    groups: list[str]  # a short label per battery group
    case_count: int
    mutants: list[MutantOutcome]
    wall_s: float = 0.0

    def judged(self, kind: str) -> list[MutantOutcome]:
        """The mutants of `kind` that ran on this device and built."""
        return [m for m in self.mutants if m.kind == kind and m.status not in ("not_applicable", "build_failed")]

    def catch_rates(self) -> dict[str, tuple[int, int]]:
        """Per defect class: (caught, judged)."""
        rates: dict[str, tuple[int, int]] = {}
        for mutant in self.judged("defect"):
            caught, total = rates.get(mutant.mutant_class, (0, 0))
            rates[mutant.mutant_class] = (caught + (mutant.status == "caught"), total + 1)
        return dict(sorted(rates.items()))

    def catch_rate(self) -> tuple[int, int]:
        defects = self.judged("defect")
        return sum(m.status == "caught" for m in defects), len(defects)

    def escaped(self) -> list[MutantOutcome]:
        return [m for m in self.mutants if m.status == "escaped"]

    def false_positives(self) -> list[MutantOutcome]:
        return [m for m in self.mutants if m.status == "flagged"]

    def attribution_scores(self) -> dict[str, tuple[int, int]]:
        """(named right, attributed) over the defects with a stated expectation, in two groups:
        "variant" (a variant is expected, semantic or precision: the call must be that variant) and
        "rounding-level" (the call must be rounding-level), "quantization" (a change of the quantizer,
        issue 37). A mutant counts once, by its call; a group no defect expects is left out."""
        scores = {"variant": [0, 0], "rounding-level": [0, 0], "quantization": [0, 0]}
        for mutant in self.judged("defect"):
            expected, call = mutant.attribution_expected, mutant.attribution_call()
            if expected in (None, "none") or call is None:
                continue
            group = scores[expected if expected in ("rounding-level", "quantization") else "variant"]
            group[0] += call == expected
            group[1] += 1
        return {name: (right, total) for name, (right, total) in scores.items() if total or name != "quantization"}

    def catching_cases(self) -> dict[str, set[str]]:
        """Mutant id -> the case ids that caught it (defects that ran)."""
        return {m.id: {c.case_id for c in m.catches} for m in self.judged("defect")}
