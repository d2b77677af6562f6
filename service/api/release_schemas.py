"""The release matrix as the API returns it (GET /api/v1/projects/{project}/releases/matrix) and the
release page renders it: one schema, so the page's figures are the API's.

A cell is the change of one row (optimizer · kernel family · parameter dtype) from the previous
release that ran the same battery in the same environment, in the row's own scale: for float rows
the factor by which the final distance to the float64 reference moved (× its own previous
distance), for quantized (8-bit) rows the move of the states' distance to the quantization-aware
reference in quantization steps. An 8-bit row's distance to float64 is its quantization error by
design, so it never colours a cell; only a change does.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

# How strongly a cell is coloured: 0 neutral (unchanged, first release, no data), 1..5 by the size
# of the change within the row's scale (service/dashboard/release_matrix.py, INTENSITY_STEPS).
Intensity = Literal[0, 1, 2, 3, 4, 5]
CellState = Literal["no-data", "not-buildable", "no-cases", "first", "unchanged", "changed", "broken"]
# A column with a done run ("data"); one without ("no_data", `no_data` says why); one whose tree
# refuses this environment's toolchain ("not_buildable", `reason` is the tree's line): an old release
# that does not support the worker's CUDA, compiler or torch is neither broken nor missing
# (service/core/not_buildable.py).
ColumnStatus = Literal["data", "no_data", "not_buildable"]
Scale = Literal["ratio", "quantization-steps"]


class BatteryChoice(BaseModel):
    environment: str
    battery: str = Field(description="the battery that ran (the tree's, as the worker recorded it)")
    requested: list[str] = Field(description="the battery names the submissions asked for, where they differ")


class ReleaseTraining(BaseModel):
    """The training impact of a release's run (issue 46): its latest job's state and, once done, the
    most severe verdict over its models x configurations (GET /api/v1/runs/{run_id}/training has them all)."""

    status: Literal["queued", "running", "done", "failed", "not_needed"]
    worst_verdict: str | None = Field(description="identical | within_floor | within_noise | beyond_noise | "
                                                  "diverged | not_judged (service.core.training.worst_verdict); "
                                                  "None until the job is done")


class ReleaseColumn(BaseModel):
    tag: str = Field(description="the release tag, whole")
    sha: str
    version: str | None = Field(description="the tag read as a PEP 440 version; None where it does not parse")
    run_id: int | None = Field(description="the done run of the chosen environment and battery; None: no data")
    compared_with: str | None = Field(description="the release this column's changes are measured from: the "
                                                  "nearest earlier release with data")
    build_change: str | None = Field(description="what differs in the build from `compared_with`'s (flags "
                                                 "added / removed, compilers); None: the same, or not recorded")
    no_data: str | None = Field(description="why the column is empty; None where it has data")
    status: ColumnStatus = Field("data", description="data | no_data | not_buildable (the release's tree refuses "
                                                     "this environment's toolchain: not broken, nothing checked)")
    reason: str | None = Field(None, description="not_buildable: the tree's own line refusing the toolchain "
                                                 "(its first line, as the build log has it); None otherwise")
    training: ReleaseTraining | None = Field(None, description="the run's training impact; None: the run has "
                                                               "none (no run, or none measured)")


class CaseLine(BaseModel):
    case_id: str = Field(description="the case's id (its label and content hash)")
    name: str = Field(description="the case named by its parts (service.core.case_names.case_name)")
    finals: list[float | None] = Field(description="per release: the final distance to the float64 reference")


class ReleaseCell(BaseModel):
    release: str
    state: CellState
    cases: int = Field(description="cases of the row run in this release (not applicable ones aside)")
    changed: int = Field(description="cases whose per-step digests differ from `compared_with`'s")
    compared: int = Field(description="cases that ran in both releases (what `changed` counts among)")
    broken: int
    not_applicable: int
    change: float | None = Field(description="the largest change of the row: a factor (scale ratio) or a move "
                                             "in quantization steps; None where nothing changed or it has no "
                                             "finite value")
    change_text: str = Field(description="`change` as the page writes it")
    intensity: Intensity = Field(description="colour strength: 0 neutral, 5 strongest, within the row's scale")
    kind: str | None = Field(description="rounding-level | quantization | semantic | precision | build-flags | "
                                         "broken | repaired (broken in the previous release) | None (not "
                                         "attributed)")
    kind_text: str | None = Field(description="the kind in words: which semantic change, which flags")
    first_divergent_step: int | None = Field(description="1-based: the earliest step any case of the row differs")
    first_step_ulps: float | None = Field(description="the leading case's change at its first divergent step, in "
                                                      "ulps of its parameter (the stored attribution's)")
    case_id: str | None = Field(description="the case the figure is of")
    case_name: str | None
    ulps_at_least: float | None = Field(None, description="over the row's changed cases: at least this many ulps "
                                        "of the parameter dtype (at the float64 reference's magnitude) separate "
                                        "the two releases' parameters at step `ulps_step`; a lower bound made from "
                                        "each run's stored relative error (service/core/ulp_bounds.py), 0 where "
                                        "it cannot tell; None: no changed case has a bound (`ulps_note` says why)")
    ulps_step: int | None = Field(None, description="1-based: the step of `ulps_at_least`")
    ulps_note: str | None = Field(None, description="why a changed case has no ulp bound (float16, references "
                                                    "changed between the runs)")
    distance: float | None = Field(description="the row's largest final distance to the float64 reference")
    distance_text: str
    note: str | None = Field(description="why the cell is empty (a not-buildable release: 'not buildable here: "
                                         "<the tree's line>')")


class ReleaseRow(BaseModel):
    optimizer: str
    family: str
    dtype: str
    label: str = Field(description="optimizer · family · dtype")
    scale: Scale
    scale_text: str = Field(description="the unit of the row's `change`")
    sparkline_of: str = Field(description="what `sparkline` holds")
    sparkline: list[float | None] = Field(description="per release: the row's figure (None: no data)")
    cells: list[ReleaseCell]
    cases: list[CaseLine]


class ReleaseMatrix(BaseModel):
    project: str
    all_releases: list[str] = Field([], description="every release tag of the project, in the matrix's order")
    only: list[str] | None = Field(None, description="the releases kept (the request's `releases`), each "
                                                     "compared with the one before it among them; None: all")
    environment: str | None
    battery: str | None = Field(description="the battery that ran")
    order: Literal["version", "ancestry"] = Field(description="releases ordered by their tags' versions where "
                                                               "every tag parses, else by ancestry")
    order_text: str
    choices: list[BatteryChoice]
    releases: list[ReleaseColumn]
    rows: list[ReleaseRow]

    def row(self, label: str) -> ReleaseRow:
        return next(row for row in self.rows if row.label == label)
