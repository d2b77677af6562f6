"""The training-impact section of the commit and verify pages, and the release drift view's training
marker (issue 46; service/dashboard/training_panel.py), on runs, verdicts and training_impacts rows
stored in PostgreSQL. The jobs' results are ModelImpact JSON built with the pydantic models: curves of
3 paired seeds x 50 steps made from a seeded generator.

Every job state: done (a card per model x configuration: the verdict's words, impact_sentence, the
plotted bands equal to the stored per-seed losses' statistics), queued and running (progress and
phase), failed (the error, escaped), not_needed, none. A hostile error and a hostile reason render
as text."""

from __future__ import annotations

import html
import json
import math
import random
import re
from dataclasses import dataclass, field

import pytest

from service.core.results import CaseResult, CaseSpec, RunResult, Trajectory
from service.core.training import (
    ImpactFigures, Interval, LossCurves, ModelImpact, TrainingConfig, impact_sentence,
)
from service.dashboard import training_panel

PROJECT = "training-page"
SEEDS, STEPS = 3, 50
HOSTILE = "<img src=x onerror=alert(1)>"
HOSTILE_REASON = '<script>alert("reason")</script>'
RUNNING = dict(runs_done=12, runs_total=72, phase="baseline")
# A worker's path in an error is cut to its last part on the page (wording.without_paths).
FAILED_ERROR = f"the kernel host died training {HOSTILE} (log: /home/optdrift-worker/jobs/17/host.log)"

AGGRESSIVE = TrainingConfig(optimizer="adam", hyper={"lr": 0.1, "weight_decay": 0.1})
TYPICAL = TrainingConfig(optimizer="adam", hyper={"lr": 1e-3, "weight_decay": 1e-2})


# ----------------------------------------------------------------------------- synthetic results
def loss_curves(*, seed: int, shift: float, floor_wobble: float) -> LossCurves:
    """SEEDS x STEPS losses: a decaying curve per seed (its own offset and wiggle: the seed spread),
    the commit's moved by `shift` of the loss by the last step, the floor's by noise of `floor_wobble`."""
    draw = random.Random(seed)
    commit, baseline, floor = [], [], []
    for s in range(SEEDS):
        offset, phase = draw.uniform(-0.01, 0.01), draw.uniform(0, math.pi)
        base = [0.45 + offset + 2.0 * math.exp(-t / 12) + 0.005 * math.sin(0.5 * t + phase) for t in range(STEPS)]
        baseline.append(base)
        commit.append([b * (1 + shift * t / (STEPS - 1)) + draw.gauss(0, floor_wobble) for t, b in enumerate(base)])
        floor.append([b + draw.gauss(0, floor_wobble) for b in base])
    return LossCurves(commit=commit, baseline=baseline, floor=floor)


def model_impact(model: str, config: TrainingConfig, verdict: str, *, shift: float, seed: int,
                 reason: str | None = None, first_step: int | None = 1) -> ModelImpact:
    ci = Interval(low=shift - 0.01, high=shift + 0.01)
    figures = ImpactFigures(verdict=verdict, seeds=SEEDS, window=10, baseline_mean=0.47, shift=0.47 * shift,
                            relative_shift=shift, relative_ci=ci, seed_spread=0.01, floor_rms=2e-4,
                            change_rms=abs(shift) * 0.47, reason=reason)
    return ModelImpact(model=model, config=config, figures=figures, first_divergent_step=first_step,
                       floor_first_divergent_step=1, seconds=1.5,
                       curves=loss_curves(seed=seed, shift=shift, floor_wobble=2e-4))


def trained_results() -> list[ModelImpact]:
    return [model_impact("mlp", TYPICAL, "within_floor", shift=2e-5, seed=1, first_step=3),
            model_impact("mlp", AGGRESSIVE, "beyond_noise", shift=0.05, seed=2),
            model_impact("transformer", TYPICAL, "within_floor", shift=-1e-5, seed=3, first_step=2),
            model_impact("transformer", AGGRESSIVE, "within_noise", shift=0.004, seed=4)]


def hostile_results() -> list[ModelImpact]:
    return [model_impact("mlp", AGGRESSIVE, "not_judged", shift=0.0, seed=5, reason=HOSTILE_REASON)]


# ----------------------------------------------------------------------------- rows in PostgreSQL
def _case_result(digests: list[str]) -> RunResult:
    spec = CaseSpec(case_id="adam-wd", optimizer="adam", hyper={"lr": 0.1, "weight_decay": 0.1}, seed=0, size=8,
                    steps=3)
    trajectory = Trajectory(ref64_max_abs=[1.0, 2.0, 3.0], ref64_max_rel=[0.0] * 3, nonfinite_count=[0] * 3,
                            digests=digests)
    return RunResult(battery_name="quick", battery_version=1, battery_digest="q",
                     cases=[CaseResult(case=spec, status="ok", trajectory=trajectory, duration_s=0.1)])


BASE = _case_result(["od2:" + "a" * 32] * 3)
CHANGED = _case_result(["od2:" + "a" * 32, "od2:" + "b" * 32, "od2:" + "c" * 32])

# Commit sha -> its training job (None: no job). Each is a changed child of "base".
JOBS: dict[str, dict | None] = {
    "trained": dict(status="done", results=trained_results()),
    "hostile": dict(status="done", results=hostile_results()),
    "running": dict(status="running", **RUNNING),
    "queued": dict(status="queued", runs_done=0, runs_total=72),
    "failed": dict(status="failed", error=FAILED_ERROR),
    "not-needed": dict(status="not_needed", error="no trajectory differs between the two runs: nothing to train"),
    "no-job": None,
}
RELEASES = {"base": "v1.0.0", "trained": "v1.1.0", "running": "v1.2.0"}


@dataclass
class Seeded:
    run_ids: dict[str, int] = field(default_factory=dict)
    verify_run_id: int | None = None


def _job(db_session, run, baseline, *, status: str, results: list[ModelImpact] | None = None,  # noqa: ANN001
         **fields) -> None:
    from service.db.training_models import TrainingImpactJob

    db_session.add(TrainingImpactJob(
        project_id=run.project_id, run_id=run.id, baseline_run_id=baseline.id, model_set="quick",
        environment=run.environment, status=status, device="cpu (2 cores)" if status == "done" else None,
        results=[r.model_dump(mode="json") for r in results] if results is not None else None, **fields))


def seed(db_session, project_name: str = PROJECT) -> Seeded:  # noqa: ANN001
    """A base commit and one changed child per JOBS entry (each with its run, its verdict against the
    base run and its job), and a verify run against the base with a done job."""
    from service.core.verdicts import compare_runs
    from service.db.models import DONE, Commit, Project, Run, SourceArchive, Verdict
    from service.domain import trajectories

    project = Project(name=project_name, environments=["cpu"])
    db_session.add(project)
    if db_session.get(SourceArchive, "0" * 64) is None:
        db_session.add(SourceArchive(digest="0" * 64, size_bytes=1, member_count=1))
    db_session.flush()
    seeded = Seeded()

    def stored_run(sha: str | None, result: RunResult, **run_fields) -> Run:  # noqa: ANN003
        commit_id = None
        if sha is not None:
            commit = Commit(project_id=project.id, sha=sha, parents=[] if sha == "base" else ["base"],
                            source_digest="0" * 64, release_tag=RELEASES.get(sha), message=f"{sha} commit")
            db_session.add(commit)
            db_session.flush()
            commit_id = commit.id
        run = Run(project_id=project.id, commit_id=commit_id, source_digest="0" * 64, battery="quick",
                  battery_hash="q", environment="cpu", status=DONE, cases_total=1, cases_done=1, **run_fields)
        db_session.add(run)
        db_session.flush()
        trajectories.store_case_result(session=db_session, run_id=run.id, case_index=0, result=result.cases[0])
        return run

    def judged(run: Run, baseline: Run) -> None:
        comparison = compare_runs(CHANGED, BASE)
        db_session.add(Verdict(run_id=run.id, baseline_run_id=baseline.id, outcome=comparison.verdict,
                               flagged=True, changed_cases=1, first_divergent_step=2,
                               detail=comparison.model_dump(mode="json")))

    base = stored_run("base", BASE)
    seeded.run_ids["base"] = base.id
    for sha, job in JOBS.items():
        run = stored_run(sha, CHANGED)
        judged(run, base)
        if job is not None:
            _job(db_session, run, base, **job)
        seeded.run_ids[sha] = run.id
    base_commit_id = base.commit_id
    verify = stored_run(None, CHANGED, kind="verify", base_commit_id=base_commit_id)
    judged(verify, base)
    _job(db_session, verify, base, status="done", results=trained_results()[:2])
    seeded.verify_run_id = verify.id
    db_session.flush()
    return seeded


@pytest.fixture
def seeded(db_session) -> Seeded:  # noqa: ANN001
    return seed(db_session)


def _page(api, path: str) -> str:  # noqa: ANN001
    response = api.get(path)
    assert response.status_code == 200, response.text
    return response.text


def _section(page: str) -> str:
    found = re.search(r'<section class="training" id="training".*?</section>', page, re.S)
    assert found, "no training section"
    return found.group(0)


def _text(fragment: str) -> str:
    """The fragment's text as a reader sees it: tags out, entities decoded, whitespace collapsed."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", fragment)).split())


# ----------------------------------------------------------------------------- the bands
def test_bands_are_the_seed_mean_and_std_and_the_floors_rms() -> None:
    """Per step: the commit's and the baseline's mean over the seeds, the baseline's mean ± one sample
    standard deviation, and ± the RMS over the seeds of (floor − baseline); a NaN (a diverged run)
    is left out of its step, and a step with nothing finite is a gap. Values chosen exact in binary
    where it matters; tolerance 1e-15 relative: one rounding of a sum of three."""
    curves = LossCurves(commit=[[1.0, 5.0], [3.0, float("nan")], [2.0, 7.0]],
                        baseline=[[1.0, float("nan")], [2.0, float("nan")], [3.0, float("nan")]],
                        floor=[[1.5, 1.0], [1.5, 1.0], [3.0, 1.0]])
    bands = training_panel.curve_bands(curves)
    assert bands.steps == [1, 2]
    assert bands.commit_mean == [2.0, 6.0]
    assert bands.baseline_mean == [2.0, None]
    # Baseline [1, 2, 3]: mean 2, sample std 1.
    assert bands.spread_low == [pytest.approx(1.0, rel=1e-15, abs=0), None]
    assert bands.spread_high == [pytest.approx(3.0, rel=1e-15, abs=0), None]
    # floor − baseline = [0.5, −0.5, 0]: RMS sqrt(0.5 / 3).
    rms = math.sqrt(0.5 / 3)
    assert bands.floor_low[0] == pytest.approx(2.0 - rms, rel=1e-15, abs=0)
    assert bands.floor_high[0] == pytest.approx(2.0 + rms, rel=1e-15, abs=0)
    assert bands.floor_low[1] is None and bands.floor_high[1] is None


# ----------------------------------------------------------------------------- a done job
@pytest.mark.parametrize("where", ["commit", "verify"])
def test_a_done_job_shows_each_verdict_its_sentence_and_its_curves(api, seeded, where: str) -> None:  # noqa: ANN001
    path = f"/projects/{PROJECT}/commits/trained" if where == "commit" else f"/runs/{seeded.verify_run_id}"
    results = trained_results() if where == "commit" else trained_results()[:2]
    page = _page(api, path)
    section = _section(page)
    # Under the verdict: after the verdict sentence, before the changed cases' table.
    assert page.index('id="verdict-sentence"') < page.index('id="training"') < page.index('id="changed-cases"')
    cards = re.findall(r'<figure class="panel training-panel".*?</figure>', section, re.S)
    assert len(cards) == len(results)
    worst = _text(re.search(r'<span class="badge[^"]*" id="training-worst".*?</span>', section, re.S).group(0))
    assert worst == "beyond seed noise"
    # And beside the run's verdict, above the fold, a link to the section.
    verdict_line = re.search(r'<p class="verdict-line">.*?</p>', page, re.S).group(0)
    assert _text(re.search(r'<a class="side-note training-link".*?</a>', verdict_line, re.S).group(0)) == \
        "training: beyond seed noise"
    # The most severe card first; each card: its model, configuration label, verdict words and sentence.
    expected = sorted(results, key=lambda r: ["within_floor", "within_noise", "beyond_noise"].index(
        r.figures.verdict), reverse=True)
    words = {"within_floor": "within the one-ulp floor", "within_noise": "within seed noise",
             "beyond_noise": "beyond seed noise"}
    for card, result in zip(cards, expected):
        text = _text(card)
        assert text.startswith(f"{result.model} {result.config.label}"), text
        assert words[result.figures.verdict] in text
        assert impact_sentence(result) in text
    data = json.loads(re.search(r'id="training-data">(.*?)</script>', page, re.S).group(1))
    assert [p["panel"] for p in data] == list(range(1, len(results) + 1))
    for drawn, result in zip(data, expected):
        bands = training_panel.curve_bands(result.curves)
        assert drawn["steps"] == list(range(1, STEPS + 1))
        assert drawn["first_divergent_step"] == result.first_divergent_step
        # The JSON carries the floats as computed (repr round-trips exactly).
        for key in ("commit_mean", "baseline_mean", "spread_low", "spread_high", "floor_low", "floor_high"):
            assert drawn[key] == getattr(bands, key), key


def test_the_key_says_which_bands_are_drawn(api, seeded) -> None:  # noqa: ANN001
    key = _text(re.search(r'<ul class="training-key".*?</ul>', _page(api, f"/projects/{PROJECT}/commits/trained"),
                          re.S).group(0))
    assert "seed spread: baseline mean ± 1 sample std over the seeds" in key
    assert "one-ulp floor: baseline mean ± RMS over the seeds of (floor − baseline)" in key
    assert "first step the parameters differ" in key


# ----------------------------------------------------------------------------- the other states
def test_a_running_job_shows_its_progress_and_phase(api, seeded) -> None:  # noqa: ANN001
    section = _section(_page(api, f"/projects/{PROJECT}/commits/running"))
    assert 'data-poll-training="%d"' % seeded.run_ids["running"] in section
    assert "running: 12/72 training runs done · phase: baseline" in _text(section)
    assert re.search(r'<progress id="training-progress-bar" max="72" value="12">', section)


def test_a_queued_job_says_it_waits(api, seeded) -> None:  # noqa: ANN001
    text = _text(_section(_page(api, f"/projects/{PROJECT}/commits/queued")))
    assert "queued: 0/72 training runs done · waiting for a worker" in text


def test_a_failed_job_shows_its_error_as_text(api, seeded) -> None:  # noqa: ANN001
    page = _page(api, f"/projects/{PROJECT}/commits/failed")
    section = _section(page)
    assert HOSTILE not in page
    assert html.escape(HOSTILE, quote=False) in section
    assert "the kernel host died training " + HOSTILE + " (log: …/host.log)" in _text(section)
    assert "/home/optdrift-worker" not in page


def test_a_hostile_reason_renders_as_text(api, seeded) -> None:  # noqa: ANN001
    page = _page(api, f"/projects/{PROJECT}/commits/hostile")
    assert HOSTILE_REASON not in page
    assert "not judged" in _text(_section(page))
    assert impact_sentence(hostile_results()[0]) in _text(_section(page))


def test_not_needed_says_no_trajectory_differs(api, seeded) -> None:  # noqa: ANN001
    text = _text(_section(_page(api, f"/projects/{PROJECT}/commits/not-needed")))
    assert "Not needed: no trajectory differs between this run and its baseline" in text


def test_no_job_a_note_where_the_run_changed_and_nothing_where_it_did_not(api, seeded) -> None:  # noqa: ANN001
    text = _text(_section(_page(api, f"/projects/{PROJECT}/commits/no-job")))
    assert "runs after the co-run of a changed run" in text
    assert 'id="training"' not in _page(api, f"/projects/{PROJECT}/commits/base")


# ----------------------------------------------------------------------------- release drift
def test_the_release_matrix_carries_each_runs_worst_training_verdict(api, seeded) -> None:  # noqa: ANN001
    response = api.get(f"/api/v1/projects/{PROJECT}/releases/matrix")
    assert response.status_code == 200, response.text
    columns = {column["tag"]: column for column in response.json()["releases"]}
    assert columns["v1.0.0"]["training"] is None
    assert columns["v1.1.0"]["training"] == {"status": "done", "worst_verdict": "beyond_noise"}
    assert columns["v1.2.0"]["training"] == {"status": "running", "worst_verdict": None}
    page = _page(api, f"/projects/{PROJECT}/releases")
    marks = dict(re.findall(r'<a class="training-mark" href="/runs/(\d+)#training"[^>]*>(.*?)</a>', page, re.S))
    assert {int(k): _text(v) for k, v in marks.items()} == {
        seeded.run_ids["trained"]: "training: beyond seed noise", seeded.run_ids["running"]: "training: running"}
