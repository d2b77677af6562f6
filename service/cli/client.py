"""HTTP client of the optdrift API, used by `optdrift submit`, `verify` and `demo`.
Needs only httpx and the standard library (the client install has no server packages)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from service.core.archives import pack_directory

FINAL = {"done", "failed", "cancelled", "error"}
# A training-impact job's final statuses (service.core.training.JobStatus): nothing more comes.
TRAINING_FINAL = {"done", "failed", "not_needed"}
# The worker opens a run's training-impact job right after its co-run stores the detail; none this
# long after that means none comes (the worker has it off).
TRAINING_OPENS_WITHIN_S = 30.0
# Final without a verdict: cancelled, or `error` (optdrift failed, not the commit).
FINAL_WITHOUT_VERDICT = {"cancelled", "error"}
# The header a verify answer carries when a patch was sent: which layout of it applied.
PATCH_LAYOUT_HEADER = "Optdrift-Patch-Layout"


@dataclass(frozen=True)
class CorunDetail:
    """How far a finished run's co-run detail has come. The verdict is stored first; the worker
    then co-runs the baseline build on the changed cases (worker/jobs/corun.py), which adds
    each changed case's per-step |commit − baseline| (all cases at once), and then the attribution
    (ulp, kind: worker/attribution) beside the verdict."""

    changed: int          # the run's changed cases
    with_diffs: int       # of them, those whose per-step |commit − baseline| is stored
    attributed: bool      # the attribution is stored (or its failure, recorded as an error)
    # How the co-run ended when it stores no diffs (service.core.verdict_detail.CORUN_FINAL_STATES):
    # "not_reproducible" (a re-run differs from the stored run: the run's nondeterminism finding)
    # or "given_up"; nothing more comes then.
    final_state: str | None = None

    @property
    def complete(self) -> bool:
        return self.final_state is not None or (self.with_diffs >= self.changed and self.attributed)


def corun_detail(run: dict) -> CorunDetail | None:
    """The co-run detail a run's verdict is to receive, or None when none comes: the run has no
    verdict yet, no baseline to co-run, or no changed case (worker/jobs/run.py sends a co-run exactly
    for a done run whose verdict has a baseline and changed cases)."""
    verdict = run.get("verdict") or {}
    if run.get("status") != "done" or verdict.get("baseline_run_id") is None:
        return None
    detail = verdict.get("detail") or {}
    changed = [case for case in detail.get("cases", []) if case.get("verdict") == "changed"]
    final_state = (detail.get("corun") or {}).get("state")
    if not changed and final_state != "not_reproducible":
        return None
    return CorunDetail(changed=len(changed),
                       with_diffs=sum(1 for case in changed if case.get("max_abs_diff_per_step")),
                       attributed="attribution" in detail,
                       final_state=final_state if final_state in ("not_reproducible", "given_up") else None)


def training_expected(run: dict) -> bool:
    """Whether the worker opens a training-impact job for the run on its own: a changed run whose
    co-run reproduced its changed cases (worker/jobs/corun.py record_and_tell), unless the worker
    that co-ran it has it off (it says so in the co-run's detail: `training_impact` "off")."""
    state = corun_detail(run)
    detail = (run.get("verdict") or {}).get("detail") or {}
    return (state is not None and state.final_state is None and state.changed > 0
            and detail.get("training_impact") != "off")


def _complete_verdict(verdict: dict, cases: list[dict], stored_attribution: dict) -> None:
    """Put every case (GET /runs/{id}/cases, stored order) in a verdict whose answer showed a few: its
    detail's cases and attribution, the public attributions, and the lists drawn from the cases, as a
    small run's answer has them."""
    attributions = [case.pop("attribution") for case in cases if case.get("attribution")]
    for case in cases:
        case.pop("attribution", None)
    detail = verdict.setdefault("detail", {})
    detail["cases"] = cases
    if "attribution" in detail:  # stored (maybe as its error): every case's, not the first page's
        detail["attribution"] = {**detail["attribution"], **stored_attribution}
    verdict["attribution"] = attributions
    verdict["cases_shown"] = len(cases)
    verdict["not_applicable"] = [{"case_id": c["case_id"], "optimizer": c["optimizer"], "reason": c.get("message")}
                                 for c in cases if c.get("verdict") == "not_applicable"]
    verdict["nondeterministic"] = [{"case_id": c["case_id"], "optimizer": c["optimizer"],
                                    "nondeterminism": c.get("nondeterminism"), **c["repeat_check"]}
                                   for c in cases if c.get("verdict") == "nondeterministic" and c.get("repeat_check")]
    verdict["direction_disagreements"] = [
        {"case_id": c["case_id"], "optimizer": c["optimizer"], "direction": c["direction"],
         "final_direction": c["final_direction"]}
        for c in cases if c.get("final_direction") and c.get("direction") and c["direction"] != c["final_direction"]]


def token_sources() -> list[tuple[str, "Path | None"]]:
    """Where the client looks for its API token, first match wins. Never a command-line argument:
    those land in shell history and in every `ps` listing."""
    data_home = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    config_home = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    home = Path(os.environ.get("OPTDRIFT_HOME") or Path(data_home) / "optdrift")
    token_file = os.environ.get("OPTDRIFT_TOKEN_FILE")
    return [
        ("environment variable OPTDRIFT_TOKEN", None),
        ("file named by OPTDRIFT_TOKEN_FILE", Path(token_file) if token_file else None),
        ("config file", Path(config_home) / "optdrift" / "token"),
        # the embedded default's own admin token, written by `optdrift serve` on this machine
        ("embedded admin token", home / "admin-token"),
    ]


def resolve_token() -> str | None:
    if os.environ.get("OPTDRIFT_TOKEN"):
        return os.environ["OPTDRIFT_TOKEN"].strip()
    for _label, path in token_sources()[1:]:
        if path is not None and path.is_file():
            try:
                text = path.read_text().strip()
            except OSError:
                continue
            if text:
                return text
    return None


def _detail_text(detail: Any) -> str:  # noqa: ANN401
    """FastAPI's `detail`: a string, or a list of validation errors ({loc, msg}) made one line."""
    if isinstance(detail, list):
        return "; ".join(f"{'.'.join(str(part) for part in item.get('loc', []))}: {item.get('msg')}"
                         if isinstance(item, dict) else str(item) for item in detail)
    return str(detail)


class ApiError(RuntimeError):
    """An HTTP error answer: `status_code` and the server's `detail`."""

    def __init__(self, response: httpx.Response):
        try:
            detail = _detail_text(response.json().get("detail", response.text))
        except (ValueError, AttributeError):
            detail = response.text
        if response.status_code == 401:
            detail = (f"{detail} (the client looks for its token in: "
                      f"{', '.join(label for label, _ in token_sources())})")
        super().__init__(f"{response.request.method} {response.request.url.path} -> "
                         f"{response.status_code}: {detail}")
        self.status_code = response.status_code
        self.detail = detail


class OptdriftClient:
    def __init__(self, base_url: str, *, timeout_s: float = 120.0, token: str | None = None):
        """`token`: for programs; people and CI set OPTDRIFT_TOKEN or a token file (see
        `token_sources`)."""
        self.base_url = base_url.rstrip("/")
        token = token or resolve_token()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.base_url, timeout=timeout_s, headers=headers)

    def close(self) -> None:
        self.http.close()

    def _check(self, response: httpx.Response) -> Any:  # noqa: ANN401
        if response.status_code >= 400:
            raise ApiError(response)
        return response.json()

    def request(self, method: str, path: str, **kwargs: Any) -> Any:  # noqa: ANN401
        """Any API call: its JSON answer (None for 204), or ApiError for a 4xx/5xx."""
        response = self.http.request(method, path, **kwargs)
        return None if response.status_code == 204 else self._check(response)

    def ensure_project(self, name: str, **fields: Any) -> dict:  # noqa: ANN401
        response = self.http.get(f"/api/v1/projects/{name}")
        if response.status_code == 404:
            response = self.http.post("/api/v1/projects", json={"name": name, **fields})
        return self._check(response)

    def submit_commit(self, *, project: str, sha: str, source_dir: Path, parents: list[str] = (),
                      ref: str | None = None, release_tag: str | None = None,
                      message: str | None = None, battery: str | None = None,
                      idempotency_key: str | None = None, ancestry: list[str] = (),
                      allow_no_baseline: bool = False) -> dict:
        archive = pack_directory(Path(source_dir))
        form = {"sha": sha, "parents": " ".join(parents)}
        if ancestry:  # first-parent ancestors, nearest first: the service picks the nearest it has a run of
            form["ancestry"] = " ".join(ancestry)
        if allow_no_baseline:
            form["allow_no_baseline"] = "true"
        for key, value in (("ref", ref), ("release_tag", release_tag), ("message", message),
                           ("battery", battery)):
            if value:
                form[key] = value
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._check(self.http.post(
            f"/api/v1/projects/{project}/commits", data=form, headers=headers,
            files={"archive": ("source.tar.gz", archive, "application/gzip")}))

    def verify(self, *, project: str, base: str, source_dir: Path | None = None,
               patch: Path | None = None, battery: str | None = None) -> dict:
        files = {}
        if source_dir is not None:
            files["archive"] = ("source.tar.gz", pack_directory(Path(source_dir)), "application/gzip")
        if patch is not None:
            files["patch"] = ("change.patch", Path(patch).read_bytes(), "text/x-diff")
        form = {"base": base, **({"battery": battery} if battery else {})}
        response = self.http.post(f"/api/v1/projects/{project}/verify", data=form, files=files)
        run = self._check(response)
        # Not part of the run: how the service read the patch (as given, leading folder removed...).
        run["patch_layout"] = response.headers.get(PATCH_LAYOUT_HEADER)
        return run

    def dashboard_url(self, run_id: int) -> str:
        """The run's HTML page on the dashboard (shareable), not its JSON."""
        return f"{self.base_url}/runs/{run_id}"

    def retry(self, run_id: int) -> dict:
        """Re-queue a run whose status is `error` (409 for any other status)."""
        return self._check(self.http.post(f"/api/v1/runs/{run_id}/retry"))

    def acknowledge(self, run_id: int, *, note: str, by: str | None = None) -> dict:
        """A maintainer (maintain or admin token) marks a run's changed verdict as intended; returns the verdict."""
        body = {"note": note, **({"by": by} if by else {})}
        return self._check(self.http.post(f"/api/v1/runs/{run_id}/acknowledge", json=body))

    def run(self, run_id: int) -> dict:
        """The run, its verdict with every case: the API's answer shows a bounded few
        (verdict.cases_total > cases_shown for a large run), the rest are read page by page here."""
        run = self._check(self.http.get(f"/api/v1/runs/{run_id}"))
        verdict = run.get("verdict")
        if verdict and verdict.get("cases_total", 0) > verdict.get("cases_shown", 0):
            stored_attribution: dict = {}

            def keep_attribution(page: dict) -> None:
                stored_attribution.update(page.get("attribution_detail") or {})
            cases = self.paged(verdict["cases_url"], page_size=500, on_page=keep_attribution)
            _complete_verdict(verdict, cases, stored_attribution)
        return run

    def paged(self, path: str, *, page_size: int, on_page: Callable[[dict], None] | None = None,
              **params: Any) -> list[dict]:  # noqa: ANN401
        """Every item of a paged list answer ({"data", "count"}; limit/offset), page after page;
        `on_page` sees each whole answer (its other fields)."""
        items: list[dict] = []
        while True:
            answer = self._check(self.http.get(path, params={**params, "limit": page_size, "offset": len(items)}))
            if on_page:
                on_page(answer)
            items.extend(answer["data"])
            if not answer["data"] or len(items) >= answer.get("count", 0):
                return items

    def trajectories(self, run_id: int) -> list[dict]:
        """Every stored trajectory of the run (the API answers a page at a time)."""
        return self.paged(f"/api/v1/runs/{run_id}/trajectories", page_size=200)

    def speed(self, run_id: int) -> dict:
        """The run's kernel speed against its baseline (service/api/routes/speed.py)."""
        return self._check(self.http.get(f"/api/v1/runs/{run_id}/speed"))

    def training(self, run_id: int, curves: bool = False) -> dict | None:
        """The run's latest training-impact job (service/api/routes/training.py: the verdict per
        model x configuration and its figures; `curves`: every run's loss at every step too), or
        None when the run has none yet."""
        response = self.http.get(f"/api/v1/runs/{run_id}/training", params={"curves": str(curves).lower()})
        if response.status_code == 404:
            # No job yet, or no such run: the run's own answer tells them apart (its 404 is raised).
            self._check(self.http.get(f"/api/v1/runs/{run_id}"))
            return None
        return self._check(response)

    def training_job(self, job_id: int, curves: bool = False) -> dict:
        """One training-impact job by its id (what `request_training` answered)."""
        return self._check(self.http.get(f"/api/v1/training/{job_id}", params={"curves": str(curves).lower()}))

    def request_training(self, run_id: int, baseline_run_id: int | None = None, model_set: str = "quick") -> dict:
        """Ask for the run's training impact against `baseline_run_id` (default: its verdict's
        baseline) with `model_set` (quick or standard): the job, queued, or as it is when the pair
        has one (a failed one is queued again; not_needed when no trajectory differs)."""
        body = {"baseline_run_id": baseline_run_id, "model_set": model_set}
        return self._check(self.http.post(f"/api/v1/runs/{run_id}/training", json=body))

    def wait_for_training(self, runs: list[dict], *, on_update: Callable[[dict], None] | None = None,
                          poll_s: float = 1.0, timeout_s: float = 900.0,
                          opens_within_s: float | None = None) -> tuple[dict[int, dict | None], list[int]]:
        """Poll the runs the worker measures a training impact for (`training_expected`) until each
        one's job is final, for at most `timeout_s`. A job opens right after the run's co-run stores
        its detail; a run with none `opens_within_s` (TRAINING_OPENS_WITHIN_S) after that has none
        coming (the worker has it off). `on_update` sees {run id: its job, or None while none exists}. Returns the jobs as last
        read and the ids of the runs whose job is still going (the verdict stands without it)."""
        deadline = time.monotonic() + timeout_s
        opens_within_s = TRAINING_OPENS_WITHIN_S if opens_within_s is None else opens_within_s
        waiting = {run["id"]: run for run in runs if training_expected(run)}
        jobs: dict[int, dict | None] = {run_id: None for run_id in waiting}
        opens_by: dict[int, float] = {}
        while True:
            now = time.monotonic()
            for run_id in list(waiting):
                job = jobs[run_id] = self.training(run_id)
                if job is not None:
                    if job["status"] in TRAINING_FINAL:
                        del waiting[run_id]
                    continue
                state = corun_detail(waiting[run_id])
                if state is None or state.final_state is not None:
                    del waiting[run_id]  # the co-run reproduced nothing: no job comes
                elif state.complete:
                    if now > opens_by.setdefault(run_id, now + opens_within_s):
                        del waiting[run_id]  # none came: the worker has it off
                else:  # the co-run is still going: read the run again to see it end
                    waiting[run_id] = self.run(run_id)
            if on_update:
                on_update(dict(jobs))
            if not waiting or time.monotonic() > deadline:
                return jobs, list(waiting)
            time.sleep(poll_s)

    def wait(self, run_ids: list[int], *, on_update: Callable[[list[dict]], None] | None = None,
             poll_s: float = 1.0, timeout_s: float = 3600.0) -> list[dict]:
        """Poll until every run is final: with its verdict, or cancelled / in error without one."""
        deadline = time.monotonic() + timeout_s
        while True:
            current = [self.run(run_id) for run_id in run_ids]
            if on_update:
                on_update(current)
            if all(r["status"] in FINAL and (r["verdict"] is not None or r["status"] in FINAL_WITHOUT_VERDICT)
                   for r in current):
                return current
            if time.monotonic() > deadline:
                raise TimeoutError(f"runs {run_ids} not finished after {timeout_s:g} s")
            time.sleep(poll_s)

    def wait_for_detail(self, runs: list[dict], *, on_update: Callable[[list[dict]], None] | None = None,
                        poll_s: float = 1.0, timeout_s: float = 600.0) -> tuple[list[dict], list[int]]:
        """Poll final runs until each one's co-run detail is complete (`corun_detail`), for at most
        `timeout_s`. Returns the runs as last read and the ids of those whose detail is still
        coming (the verdict stands without it: the detail never changes an outcome)."""
        deadline = time.monotonic() + timeout_s
        current = runs
        while True:
            pending = [run["id"] for run in current
                       if (state := corun_detail(run)) is not None and not state.complete]
            if not pending or time.monotonic() > deadline:
                return current, pending
            time.sleep(poll_s)
            current = [self.run(run["id"]) if run["id"] in pending else run for run in current]
            if on_update:
                on_update(current)
