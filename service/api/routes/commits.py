"""A project's commits: CI's submission (POST /projects/{p}/commits: the tree and its parents, one run per
environment), the commit list and one commit, their verdicts, acknowledging a commit's change, releases."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Form, Header, Response, UploadFile, status
from sqlalchemy import func, select
from sqlalchemy.orm import selectinload

from service.api.auth import MaintainDep, SubmitDep
from service.api.deps import SessionDep, SettingsDep
from service.api.params import Offset, limit_param
from service.api.presenters import commit_public, run_public, verdict_public
from service.api.schemas import (
    AcknowledgeRequest, CommitPublic, CommitsPublic, SubmissionPublic, VerdictsPublic,
)
from service.api.uploads import ARCHIVE_NOTE_HEADER, read_limited, split_list
from service.db.models import Commit, Run, Verdict
from service.domain import dispatch, projects, submissions, verdict_store
from service.notify import hooks as notify_hooks

router = APIRouter(prefix="/projects/{project}", tags=["commits"])


@router.post("/commits", response_model=SubmissionPublic,
             responses={200: {"description": "an earlier identical submission"}})
def submit_commit(
    project: str,
    session: SessionDep,
    settings: SettingsDep,
    response: Response,
    _principal: SubmitDep,
    sha: Annotated[str, Form()],
    parents: Annotated[str | None, Form(description="parent shas, first parent first")] = None,
    ref: Annotated[str | None, Form()] = None,
    release_tag: Annotated[str | None, Form()] = None,
    message: Annotated[str | None, Form()] = None,
    battery: Annotated[str | None, Form()] = None,
    environments: Annotated[str | None, Form(description="default: the project's")] = None,
    baseline: Annotated[str | None, Form(description="compare with this sha/release")] = None,
    source_digest: Annotated[str | None, Form(description="sha256 of an uploaded archive")] = None,
    archive: Annotated[UploadFile | None, File(description="the source tree as tar.gz")] = None,
    ancestry: Annotated[str | None, Form(description=(
        "the commit's first-parent ancestors, nearest first (its parent, grandparent, ...), at most 200 "
        "shas separated by spaces or commas: the baseline is the nearest with a finished run"))] = None,
    allow_no_baseline: Annotated[bool, Form(description=(
        "accept a no-baseline verdict (a project's first commit): it passes CI as neutral; without this "
        "it fails CI"))] = False,
    idempotency_key: Annotated[str | None, Header()] = None,
) -> SubmissionPublic:
    project_row = projects.get_by_name(session=session, name=project)
    submission = submissions.submit_commit(
        session=session, settings=settings, project=project_row, sha=sha,
        parents=split_list(parents), archive=read_limited(archive, settings=settings, field="archive"),
        source_digest=source_digest, ref=ref, release_tag=release_tag, message=message,
        battery=battery, environments=split_list(environments) or None, baseline=baseline,
        idempotency_key=idempotency_key, ancestry=split_list(ancestry), allow_no_baseline=allow_no_baseline,
    )
    session.commit()
    # Only now may a worker see the run ids.
    dispatch.dispatch_runs(session=session, settings=settings, run_ids=submission.to_dispatch)
    for run in submission.runs:
        session.refresh(run)
    response.status_code = status.HTTP_201_CREATED if submission.created else status.HTTP_200_OK
    if submission.archive_note:
        response.headers[ARCHIVE_NOTE_HEADER] = submission.archive_note
    return SubmissionPublic(
        created=submission.created,
        commit=commit_public(submission.commit) if submission.commit else None,
        runs=[run_public(run) for run in submission.runs],
    )


@router.get("/commits", response_model=CommitsPublic)
def list_commits(project: str, session: SessionDep, limit: limit_param(50, 500) = 50,
                 offset: Offset = 0) -> CommitsPublic:
    project_row = projects.get_by_name(session=session, name=project)
    query = select(Commit).where(Commit.project_id == project_row.id)
    count = session.scalar(select(func.count()).select_from(query.subquery()))
    # Load the page's runs and their verdicts in two IN queries instead of one query per commit and
    # per run (the N+1 pattern's query count grows with the page and makes the list slow under load).
    rows = session.scalars(
        query.options(selectinload(Commit.runs).selectinload(Run.verdict),
                      selectinload(Commit.runs).joinedload(Run.base_commit))
        .order_by(Commit.created_at.desc(), Commit.id.desc()).limit(limit).offset(offset)
    ).all()
    waiting_cache: dict = {}
    return CommitsPublic(data=[commit_public(row, waiting_cache) for row in rows], count=count or 0)


@router.get("/commits/{sha}", response_model=CommitPublic)
def read_commit(project: str, sha: str, session: SessionDep) -> CommitPublic:
    project_row = projects.get_by_name(session=session, name=project)
    return commit_public(submissions.find_commit(session=session, project=project_row, ref=sha))


@router.get("/commits/{sha}/verdicts", response_model=VerdictsPublic)
def commit_verdicts(project: str, sha: str, session: SessionDep) -> VerdictsPublic:
    """Every verdict the commit has had: one per battery x environment, oldest first."""
    project_row = projects.get_by_name(session=session, name=project)
    commit = submissions.find_commit(session=session, project=project_row, ref=sha)
    rows = session.scalars(
        select(Verdict).join(Run, Verdict.run_id == Run.id).where(Run.commit_id == commit.id)
        .order_by(Verdict.created_at)
    ).all()
    return VerdictsPublic(data=[verdict_public(row) for row in rows])


@router.post("/commits/{sha}/acknowledge", response_model=VerdictsPublic)
def acknowledge_commit(
    project: str, sha: str, body: AcknowledgeRequest, session: SessionDep, _principal: MaintainDep,
    settings: SettingsDep,
) -> VerdictsPublic:
    """Mark the commit's flagged change as intended (the verdicts of its runs that flag; 409 when
    none does: an unchanged or no-baseline run has nothing to acknowledge)."""
    project_row = projects.get_by_name(session=session, name=project)
    commit = submissions.find_commit(session=session, project=project_row, ref=sha)
    verdicts = verdict_store.acknowledge_runs(session=session, runs=list(commit.runs), note=body.note, by=body.by)
    session.commit()
    for verdict in verdicts:  # their check runs turn to success (issue 16)
        notify_hooks.run_changed(verdict.run_id, settings=settings)
    return VerdictsPublic(data=[verdict_public(v) for v in verdicts])


@router.get("/verdicts", response_model=VerdictsPublic)
def project_verdicts(
    project: str, session: SessionDep, flagged: bool | None = None,
    limit: limit_param(100, 1000) = 100, offset: Offset = 0,
) -> VerdictsPublic:
    """The project's commits' verdict history, newest first (`flagged=true`: only those failing CI),
    paged (`count`: in all). CI's feed: commit runs only. A contributor's verify run is no commit of
    the project and fails no CI; its verdict is in its own run (GET /runs/{id})."""
    project_row = projects.get_by_name(session=session, name=project)
    query = (select(Verdict).join(Run, Verdict.run_id == Run.id)
             .where(Run.project_id == project_row.id, Run.kind == "commit"))
    if flagged is not None:
        query = query.where(Verdict.flagged.is_(flagged))
    count = session.scalar(select(func.count()).select_from(query.subquery()))
    rows = session.scalars(query.order_by(Verdict.created_at.desc(), Verdict.id.desc())
                           .limit(limit).offset(offset)).all()
    return VerdictsPublic(data=[verdict_public(row) for row in rows], count=count or 0)


@router.get("/releases", response_model=CommitsPublic)
def list_releases(project: str, session: SessionDep) -> CommitsPublic:
    project_row = projects.get_by_name(session=session, name=project)
    rows = session.scalars(
        select(Commit).where(Commit.project_id == project_row.id, Commit.release_tag.is_not(None))
        .order_by(Commit.created_at.desc())
    ).all()
    return CommitsPublic(data=[commit_public(row) for row in rows], count=len(rows))
