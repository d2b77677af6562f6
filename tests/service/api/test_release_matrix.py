"""GET /api/v1/projects/{project}/releases/matrix (issue 47) on the real API and PostgreSQL, over the
seeded five releases of tests/service/dashboard/release_seed.py: version order whatever the
submission order, each cell the change from the previous release in its row's own scale, its kind,
its first divergent step, neutral where nothing changed (the 8-bit row too), the failed release's
column saying why, and the battery that ran named."""

from __future__ import annotations

import math

from tests.service.dashboard import release_seed as s

URL = f"/api/v1/projects/{s.PROJECT}/releases/matrix"
LION = "lion · 32bit · float32"
ADAM = "adam · 32bit · float32"
EIGHT_BIT = "adam · 8bit_blockwise · float32"


def _matrix(api, db_session, **params) -> dict:  # noqa: ANN001
    s.seed(db_session)
    response = api.get(URL, params=params)
    assert response.status_code == 200, response.text
    return response.json()


def _cells(matrix: dict, label: str) -> dict[str, dict]:
    row = next(row for row in matrix["rows"] if row["label"] == label)
    return {cell["release"]: cell for cell in row["cells"]}


def test_releases_in_version_order_with_the_battery_that_ran(api, db_session) -> None:  # noqa: ANN001
    matrix = _matrix(api, db_session)
    # Submitted v1.9.0, v1.10.0, v1.11.0, v1.10.1, v1.8.0; a string sort would put v1.10 before v1.9.
    assert [column["tag"] for column in matrix["releases"]] == s.VERSION_ORDER
    assert matrix["order"] == "version"
    assert (matrix["environment"], matrix["battery"]) == (s.ENVIRONMENT, s.RAN_BATTERY)
    assert matrix["choices"] == [{"environment": s.ENVIRONMENT, "battery": s.RAN_BATTERY,
                                  "requested": [s.REQUESTED_BATTERY]}]
    # The name a submission asked for finds the battery that ran for it.
    assert api.get(URL, params={"battery": s.REQUESTED_BATTERY}).json()["battery"] == s.RAN_BATTERY
    columns = {column["tag"]: column for column in matrix["releases"]}
    assert columns["v1.9.0"]["compared_with"] == "v1.8.0"
    assert columns["v1.11.0"]["run_id"] is None
    assert columns["v1.11.0"]["no_data"] == f"build failed in {s.ENVIRONMENT}: {s.BUILD_ERROR}"


def test_each_cell_is_the_change_in_its_rows_scale(api, db_session) -> None:  # noqa: ANN001
    matrix = _matrix(api, db_session)
    lion = _cells(matrix, LION)
    regression = lion["v1.10.0"]
    # Tolerance: the factor is a quotient of two stored float64 finals, exact to a few roundings.
    assert math.isclose(regression["change"], s.REGRESSION_FACTOR, rel_tol=1e-12)
    assert regression["change_text"] == "×1.700e+03"
    assert (regression["state"], regression["changed"], regression["compared"]) == ("changed", 1, 2)
    assert regression["first_divergent_step"] == s.REGRESSION_FIRST_STEP
    assert regression["kind"] == "semantic" and regression["kind_text"] == "semantic: decoupled weight decay"
    assert regression["first_step_ulps"] == s.REGRESSION_ULPS
    assert regression["case_id"] == s.LION_WD
    assert regression["case_name"] == "lion · 32bit · fp32 · lr=0.0001 · wd=0.1 · open · n4097 · s0 · t8"
    assert regression["intensity"] == 5

    assert lion["v1.8.0"]["state"] == "first" and lion["v1.8.0"]["intensity"] == 0
    assert lion["v1.9.0"]["state"] == "unchanged" and lion["v1.9.0"]["intensity"] == 0
    assert lion["v1.11.0"]["state"] == "no-data" and lion["v1.11.0"]["note"].startswith("build failed")

    # The flags-only release: every float row moved by a few roundings, labelled with the flags.
    for label in (LION, ADAM):
        flags = _cells(matrix, label)["v1.10.1"]
        assert flags["state"] == "changed" and flags["first_divergent_step"] == 1
        assert flags["kind"] == "rounding-level"
        assert flags["kind_text"] == "rounding-level · build flags changed: + -march=native -fopenmp, - -g"
        assert flags["first_step_ulps"] == s.FLAG_ULPS
        assert flags["intensity"] == 1, flags
        assert math.isclose(flags["change"], s.ROUNDING, rel_tol=1e-12)
    columns = {column["tag"]: column for column in matrix["releases"]}
    assert columns["v1.10.1"]["build_change"] == "build flags changed: + -march=native -fopenmp, - -g"
    assert columns["v1.10.0"]["build_change"] is None

    # The 8-bit row: its distance to float64 is 4.2e+04 (its quantization error), and it never moved.
    eight_bit = next(row for row in matrix["rows"] if row["label"] == EIGHT_BIT)
    assert eight_bit["scale"] == "quantization-steps"
    for cell in eight_bit["cells"]:
        assert cell["intensity"] == 0, cell
        assert cell["state"] in ("first", "unchanged", "no-data"), cell
    assert eight_bit["cells"][1]["distance"] == s.BASE_FINAL[s.ADAM_8BIT]
    assert eight_bit["sparkline"] == [s.QUANT_STEPS] * 4 + [None]

    # The sparkline: the row's largest final distance to float64 per release.
    row = next(row for row in matrix["rows"] if row["label"] == LION)
    expected = [max(s.case_state(tag, case)[0] for case in (s.LION, s.LION_WD)) for tag in s.VERSION_ORDER[:4]]
    assert row["sparkline"] == expected + [None]
    names = [line["name"] for line in row["cases"]]
    assert names == sorted(names) and all("#" not in name for name in names)


def test_an_unknown_project_is_404(api) -> None:  # noqa: ANN001
    response = api.get("/api/v1/projects/nobody/releases/matrix")
    assert response.status_code == 404


def test_tags_read_as_versions_else_releases_follow_ancestry() -> None:
    from datetime import datetime, timedelta, timezone

    from service.dashboard.release_matrix import _Release, order_releases, tag_version

    # A prefix before the first digit is a prefix; semver pre-releases read as PEP 440's.
    assert str(tag_version("ds-0.14.3")) == "0.14.3" and str(tag_version("v1.2.3-rc.1")) == "1.2.3rc1"
    assert tag_version("ds-0.14.10") > tag_version("ds-0.14.3") and tag_version("nightly") is None
    start = datetime(2026, 1, 1, tzinfo=timezone.utc)

    def release(tag: str, sha: str, parents: tuple[str, ...], hours: int, ancestry: tuple[str, ...] = ()) -> _Release:
        return _Release(hash(sha) % 1000, tag, sha, parents, ancestry, start + timedelta(hours=hours))

    # Not every tag parses: back-filled "old" (submitted last) comes first, since the others descend
    # from it (through a commit that is no release, and through a sent ancestry alone).
    ordered, order = order_releases(
        [release("newest", "c", ("b1",), 0), release("middle", "b", (), 1, ancestry=("x", "a")),
         release("old", "a", (), 2)],
        parents_of={"b1": ("b",), "b": ("x",)})
    assert order == "ancestry" and [r.tag for r in ordered] == ["old", "middle", "newest"]
    ordered, order = order_releases([release("v1.10.0", "b", (), 0), release("v1.9.0", "a", (), 1)], {})
    assert order == "version" and [r.tag for r in ordered] == ["v1.9.0", "v1.10.0"]


def test_a_broken_case_and_its_repair_are_changes(api, db_session) -> None:  # noqa: ANN001
    from sqlalchemy import update

    from service.db.models import Trajectory

    seeded = s.seed(db_session)
    # v1.9.0's lion wd=0 case crashed there (as a kernel's crash is stored: status broken, no series).
    db_session.execute(update(Trajectory).where(Trajectory.run_id == seeded.run_ids["v1.9.0"],
                                                Trajectory.case_id == s.LION)
                       .values(status="broken", series_layout=[], series_data=b"", digests=""))
    db_session.flush()
    lion = _cells(api.get(URL).json(), LION)
    assert (lion["v1.9.0"]["state"], lion["v1.9.0"]["broken"], lion["v1.9.0"]["intensity"]) == ("broken", 1, 5)
    repaired = lion["v1.10.0"]
    assert repaired["state"] == "changed" and repaired["changed"] == 2
    # The ×1700 regression still leads the cell; the repair is counted among its kinds.
    assert repaired["change_text"] == "×1.700e+03"
    assert repaired["kind_text"] == "semantic: decoupled weight decay; also repaired (1)"


def _relative_series(tag: str, case_id: str) -> list[float]:
    """The seed's stored relative error to float64 per step (release_seed._result)."""
    final, _digests = s.case_state(tag, case_id)
    return [final * (step + 1) / s.STEPS * 10 for step in range(s.STEPS)]


def _expected_ulps(before: str, after: str, case_id: str) -> tuple[float, int]:
    """The lower bound, worked out from the seed's series by its definition (service/core/ulp_bounds.py):
    the largest |e_a(t) - e_b(t)| / 2**-23 over the steps, and its step."""
    gaps = [abs(a - b) / 2.0 ** -23 for a, b in zip(_relative_series(before, case_id), _relative_series(after, case_id))]
    return max(gaps), gaps.index(max(gaps)) + 1


def test_cells_say_how_many_ulps_apart_two_releases_are_at_least(api, db_session) -> None:  # noqa: ANN001
    lion = _cells(_matrix(api, db_session), LION)
    ulps, step = _expected_ulps("v1.9.0", "v1.10.0", s.LION_WD)
    # Tolerance: the service and this test take the same float64 differences in the same order; 1e-12
    # relative leaves room for nothing but a different formula.
    assert math.isclose(lion["v1.10.0"]["ulps_at_least"], ulps, rel_tol=1e-12) and ulps > 1e4
    assert lion["v1.10.0"]["ulps_step"] == step == s.STEPS
    assert lion["v1.10.0"]["ulps_note"] is None
    # v1.10.1: lion wd=0's references changed (r1 -> r2), so that case has no common float64
    # reference and no bound; the row's figure is its other changed case's, and the note says so.
    flags = lion["v1.10.1"]
    ulps, step = _expected_ulps("v1.10.0", "v1.10.1", s.LION_WD)
    assert math.isclose(flags["ulps_at_least"], ulps, rel_tol=1e-12) and flags["ulps_step"] == step
    assert flags["ulps_note"] == "1 of 2 changed cases: its references changed between the two runs (no common " \
                                 "float64 reference)"
    assert lion["v1.9.0"]["ulps_at_least"] is None  # unchanged: nothing to bound


def test_any_two_releases_compare(api, db_session) -> None:  # noqa: ANN001
    """?releases=A&releases=B keeps those two: B's cell is the change from A, whatever lies between."""
    matrix = _matrix(api, db_session, releases=["v1.10.1", "v1.8.0"])
    assert [column["tag"] for column in matrix["releases"]] == ["v1.8.0", "v1.10.1"]   # the matrix's order
    assert matrix["only"] == ["v1.8.0", "v1.10.1"] and matrix["all_releases"] == s.VERSION_ORDER
    assert matrix["releases"][1]["compared_with"] == "v1.8.0"
    assert matrix["releases"][1]["build_change"] == "build flags changed: + -march=native -fopenmp, - -g"
    adam = _cells(matrix, ADAM)["v1.10.1"]
    ulps, step = _expected_ulps("v1.8.0", "v1.10.1", s.ADAM)
    assert math.isclose(adam["ulps_at_least"], ulps, rel_tol=1e-12) and adam["ulps_step"] == step
    # No verdict judged v1.10.1 against v1.8.0: nothing is attributed, and differing flags are named
    # without being called the cause.
    assert adam["kind"] is None
    assert adam["kind_text"] == "not attributed · build flags changed: + -march=native -fopenmp, - -g"
    lion = _cells(matrix, LION)["v1.10.1"]
    assert math.isclose(lion["change"], s.REGRESSION_FACTOR * s.ROUNDING, rel_tol=1e-12)
    assert lion["kind"] is None and lion["first_divergent_step"] == 1


def test_an_unknown_release_is_named_in_a_422(api, db_session) -> None:  # noqa: ANN001
    s.seed(db_session)
    response = api.get(URL, params={"releases": ["v1.8.0", "v9.9.9"]})
    assert response.status_code == 422
    assert "no release tagged 'v9.9.9' in project 'drift'" in response.json()["detail"]
    assert "v1.10.1" in response.json()["detail"]  # the releases it has, to pick from
    too_many = api.get(URL, params={"releases": [f"t{i}" for i in range(51)]})
    assert too_many.status_code == 422 and "at most 50" in too_many.json()["detail"]
