"""Submissions: CI posting a commit, a contributor asking to verify a patch.

Both store the source (content-addressed), create rows, and return the run ids to dispatch; the
caller commits the transaction and *then* dispatches (a worker must never see a run id whose row
is not committed yet).
"""

from __future__ import annotations

import difflib
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.db.models import ERROR, Commit, Project, Run
from service.core.archives import (
    ArchiveError, extract_archive, pack_directory, root_file_and_names, sha256_hex, summarize_archive,
)
from service.domain.ancestry import check_ancestry
from service.domain.errors import BadInputError, ConflictError, NotFoundError
from service.domain.patch_layout import apply_patch_any_root
from service.domain.patches import PatchLimits
from service.core.project_config import CONFIG_FILE, ProjectConfigError, config_defaults, parse_config
from service.domain.submission_rules import BUILTIN_BATTERIES, check_battery, check_environments
from service.domain.storage import UnknownSourceError, archive_limits, get_archive, store_archive
from service.domain.tree_battery import check_tree_battery
from service.settings import Settings


@dataclass
class Submission:
    runs: list[Run]
    commit: Commit | None
    # Runs created by this call (to dispatch after the commit); empty for a repeated submission.
    new_run_ids: list[int] = field(default_factory=list)
    # verify --patch: which layout of the patch applied (as given, leading folder removed, ...).
    patch_layout: str | None = None
    # Runs that had ended in `error` (optdrift's failure) and were queued again by this submission.
    requeued_run_ids: list[int] = field(default_factory=list)
    # For the uploader: members of the archive extraction leaves out (git metadata), or None.
    archive_note: str | None = None

    @property
    def created(self) -> bool:
        return bool(self.new_run_ids)

    @property
    def to_dispatch(self) -> list[int]:
        return self.new_run_ids + self.requeued_run_ids


@dataclass(frozen=True)
class _Source:
    digest: str
    note: str | None = None  # for the uploader: what extraction leaves out (git metadata)


def _source(
    *, session: Session, settings: Settings, project: Project, archive: bytes | None,
    source_digest: str | None, battery: str | None, kind: str
) -> _Source:
    """The submission's source: an uploaded archive (stored and recorded for `project`) or the
    digest of an earlier upload *by or for this project* (another project's digest: 404, the same
    answer as one never uploaded)."""
    if archive is not None:
        try:
            summarize_archive(archive, archive_limits(settings))
            _check_tree_config(archive, settings=settings, project=project, battery=battery, kind=kind)
            stored = store_archive(session=session, settings=settings, data=archive, project=project)
        except ArchiveError as exc:
            raise BadInputError(f"source archive rejected: {exc}") from exc
        return _Source(digest=stored.digest, note=stored.note)
    if source_digest:
        try:
            _, path = get_archive(session=session, settings=settings, digest=source_digest, project=project)
        except UnknownSourceError as exc:
            raise NotFoundError(str(exc)) from exc
        try:
            _check_tree_config(path.read_bytes(), settings=settings, project=project, battery=battery, kind=kind)
        except ArchiveError as exc:
            raise BadInputError(f"source archive rejected: {exc}") from exc
        return _Source(digest=source_digest)
    raise BadInputError("send the source as an `archive` file or the `source_digest` of an upload")


def _check_tree_config(archive: bytes, *, settings: Settings, project: Project, battery: str | None,
                       kind: str) -> None:
    """The tree's optdrift.toml over the project's registered fields, validated here as the worker
    will (service.core.project_config), and the battery the run will take: a configuration the
    worker would refuse (a build.env outside the build knobs, a path out of the tree) or a battery
    that is neither built in nor a file of the tree (`--battery quik`) is bad input now, not a
    failed run later. So is a battery file past the battery limits of a run of `kind`
    (service/domain/tree_battery.py; the built-in batteries are within them, tests say so)."""
    text, tree_files = root_file_and_names(archive, CONFIG_FILE, archive_limits(settings))
    tree_battery = project.default_battery
    if text is not None:  # without the file the registered fields alone decide, as the worker says
        try:
            tree_battery = parse_config(text, defaults=config_defaults(project), origin=CONFIG_FILE).battery
        except ProjectConfigError as exc:
            raise BadInputError(f"the tree's {exc}") from exc
    # The battery the worker will take (worker.pipeline.prepare): the request's, else the tree's.
    name, origin = (battery, "the request's battery") if battery and battery != project.default_battery \
        else (tree_battery, f"the battery named by the tree's {CONFIG_FILE}" if text else "the project's battery")
    if name in BUILTIN_BATTERIES:
        return
    if name in tree_files:
        check_tree_battery(archive, name=name, origin=origin, limits=settings.battery_limits(kind),
                           archive_limits=archive_limits(settings))
        return
    close = difflib.get_close_matches(name, [*BUILTIN_BATTERIES], n=1)
    raise BadInputError(
        f"{origin} {name[:80]!r} is neither a built-in battery ({', '.join(BUILTIN_BATTERIES)}) nor a file in "
        f"the submitted tree{f'; did you mean {close[0]!r}?' if close else ''}")


def find_commit(*, session: Session, project: Project, ref: str) -> Commit:
    """A commit of the project by sha (or unique sha prefix of 7+) or by release tag."""
    commit = session.scalar(select(Commit).where(Commit.project_id == project.id, Commit.sha == ref))
    if commit is None:
        commit = session.scalar(
            select(Commit).where(Commit.project_id == project.id, Commit.release_tag == ref)
            .order_by(Commit.created_at.desc()).limit(1)
        )
    if commit is None and len(ref) >= 7:
        matches = session.scalars(
            select(Commit).where(Commit.project_id == project.id, Commit.sha.startswith(ref)).limit(2)
        ).all()
        commit = matches[0] if len(matches) == 1 else None
    if commit is None:
        raise NotFoundError(f"project {project.name!r} has no commit or release {ref!r}")
    return commit


def existing_run_for_key(*, session: Session, project: Project, key: str | None) -> Run | None:
    """The run that carries the idempotency key: one per submission (its first environment's)."""
    if not key:
        return None
    return session.scalar(select(Run).where(Run.project_id == project.id, Run.idempotency_key == key))


def runs_of_keyed_submission(*, session: Session, keyed: Run) -> list[Run]:
    """Everything the keyed submission made, for its answer: a commit run's key sits on its first
    environment's run only, so a repeated `submit` (CI re-running a red job) answered with that one
    run, and a change flagged in another environment turned green (issue 44). A commit is submitted
    once per battery: the answer is every environment's run of that commit and battery, queued or
    done, in the order they were made. A verify run is its submission's only run."""
    if keyed.commit_id is None:
        return [keyed]
    return list(session.scalars(select(Run).where(
        Run.commit_id == keyed.commit_id, Run.battery == keyed.battery).order_by(Run.id)))


def _check_source_unchanged(*, session: Session, project: Project, sha: str, digest: str | None) -> None:
    commit = session.scalar(select(Commit).where(Commit.project_id == project.id, Commit.sha == sha))
    if commit is not None and digest is not None and commit.source_digest != digest:
        raise ConflictError(
            f"commit {sha} of {project.name!r} was already submitted with source {commit.source_digest};"
            f" this upload is {digest}. A commit's source cannot change: submit the new source under "
            "its own commit sha."
        )


def submit_commit(
    *,
    session: Session,
    settings: Settings,
    project: Project,
    sha: str,
    parents: list[str],
    archive: bytes | None = None,
    source_digest: str | None = None,
    ref: str | None = None,
    release_tag: str | None = None,
    message: str | None = None,
    battery: str | None = None,
    environments: list[str] | None = None,
    baseline: str | None = None,
    idempotency_key: str | None = None,
    ancestry: list[str] | None = None,
    allow_no_baseline: bool = False,
) -> Submission:
    sha = sha.strip()
    if not sha or len(sha) > 64:
        raise BadInputError(f"commit sha {sha!r} must be 1-64 characters")
    ancestry = check_ancestry(sha=sha, ancestry=ancestry or [])
    # The source conflict comes before the idempotency key: a retried request carries the same
    # bytes, so a key that matches while the source differs is a different commit under a reused
    # sha, and answering "already submitted" would hide it.
    _check_source_unchanged(session=session, project=project, sha=sha,
                            digest=sha256_hex(archive) if archive is not None else source_digest)
    keyed = existing_run_for_key(session=session, project=project, key=idempotency_key)
    if keyed is not None:
        runs = runs_of_keyed_submission(session=session, keyed=keyed)
        _apply_retry_options(commit=keyed.commit, runs=runs, ancestry=ancestry, allow_no_baseline=allow_no_baseline)
        return Submission(runs=runs, commit=keyed.commit, requeued_run_ids=_requeue_errored(session, runs))
    battery = check_battery(battery)
    environments = check_environments(
        project_name=project.name, registered=project.environments, requested=environments,
        max_per_request=settings.max_environments_per_request)
    source = _source(session=session, settings=settings, project=project, archive=archive,
                     source_digest=source_digest, battery=battery, kind="commit")
    digest = source.digest
    base_commit = find_commit(session=session, project=project, ref=baseline) if baseline else None

    commit = session.scalar(select(Commit).where(Commit.project_id == project.id, Commit.sha == sha))
    if commit is None:
        commit = Commit(project_id=project.id, sha=sha, parents=parents, ref=ref, ancestry=ancestry or None,
                        release_tag=release_tag, message=message, source_digest=digest)
        try:
            with session.begin_nested():
                session.add(commit)
        except IntegrityError:  # a concurrent submission of the same sha won the race
            commit = session.scalar(
                select(Commit).where(Commit.project_id == project.id, Commit.sha == sha))
    # Again here: a concurrent submission of the same sha may have won the race above.
    _check_source_unchanged(session=session, project=project, sha=sha, digest=digest)
    if release_tag and commit.release_tag != release_tag:
        commit.release_tag = release_tag
    if ancestry and not commit.ancestry:  # a retry after fetching history: runs without a verdict use it
        commit.ancestry = ancestry

    battery = battery or project.default_battery
    runs: list[Run] = []
    new_ids: list[int] = []
    for environment in environments:
        run = session.scalar(select(Run).where(
            Run.commit_id == commit.id, Run.battery == battery, Run.environment == environment))
        if run is None:
            run = Run(project_id=project.id, kind="commit", commit_id=commit.id,
                      source_digest=digest, battery=battery, environment=environment,
                      base_commit_id=base_commit.id if base_commit else None,
                      allow_no_baseline=allow_no_baseline,
                      idempotency_key=idempotency_key if not new_ids else None)
            try:
                with session.begin_nested():
                    session.add(run)
                new_ids.append(run.id)
            except IntegrityError:
                run = session.scalar(select(Run).where(
                    Run.commit_id == commit.id, Run.battery == battery,
                    Run.environment == environment))
        if allow_no_baseline:  # asked again with it: the first adoption, on a commit already submitted
            run.allow_no_baseline = True
        runs.append(run)
    return Submission(runs=runs, commit=commit, new_run_ids=new_ids,
                      requeued_run_ids=_requeue_errored(session, [r for r in runs if r.id not in new_ids]),
                      archive_note=source.note)


def _apply_retry_options(*, commit: Commit | None, runs: list[Run], ancestry: list[str],
                         allow_no_baseline: bool) -> None:
    """A repeated submission (CI re-running the job) may bring what the first lacked: the history
    fetched since (ancestry, for runs still without a verdict) or allow_no_baseline, added for a
    project's first commit after its no-baseline failed (issue 44)."""
    if commit is not None and ancestry and not commit.ancestry:
        commit.ancestry = ancestry
    if allow_no_baseline:
        for run in runs:
            run.allow_no_baseline = True


def _requeue_errored(session: Session, existing: list[Run]) -> list[int]:
    """Submitting a commit again re-queues its runs that ended in `error` (an optdrift failure,
    never the commit's): CI's retry of a job is how most people will ask."""
    from service.domain import runs as run_lifecycle

    requeued = []
    for run in existing:
        if run.status == ERROR:
            run_lifecycle.retry(session=session, run_id=run.id)
            requeued.append(run.id)
    return requeued


def apply_patch(*, settings: Settings, base_archive: Path, patch: bytes) -> tuple[bytes, str]:
    """The base commit's tree with a unified diff (git format, from the repository root or the
    source folder) applied, packed again, and a sentence saying which layout applied."""
    with tempfile.TemporaryDirectory(prefix="optdrift-verify-") as tmp:
        tree = Path(tmp) / "tree"
        extract_archive(base_archive.read_bytes(), tree, archive_limits(settings))
        patch_file = Path(tmp) / "change.patch"
        patch_file.write_bytes(patch)
        layout = apply_patch_any_root(tree=tree, patch_file=patch_file, limits=PatchLimits(
            max_file_bytes=settings.max_patch_file_bytes,
            max_total_bytes=settings.max_patch_expanded_bytes))
        return pack_directory(tree), layout


def submit_verify(
    *,
    session: Session,
    settings: Settings,
    project: Project,
    base: str,
    archive: bytes | None = None,
    patch: bytes | None = None,
    battery: str | None = None,
    environment: str | None = None,
    idempotency_key: str | None = None,
) -> Submission:
    keyed = existing_run_for_key(session=session, project=project, key=idempotency_key)
    if keyed is not None:
        return Submission(runs=[keyed], commit=None)
    battery = check_battery(battery)
    base_commit = find_commit(session=session, project=project, ref=base)
    if (archive is None) == (patch is None):
        raise BadInputError("send exactly one of `archive` (a source tar.gz) or `patch` (a diff)")
    patch_layout = None
    if patch is not None:
        try:
            _, base_path = get_archive(session=session, settings=settings,
                                       digest=base_commit.source_digest, project=project)
        except UnknownSourceError as exc:
            raise NotFoundError(f"the base commit {base_commit.sha}'s source: {exc}") from exc
        archive, patch_layout = apply_patch(settings=settings, base_archive=base_path, patch=patch)
    source = _source(session=session, settings=settings, project=project, archive=archive,
                     source_digest=None, battery=battery, kind="verify")
    digest = source.digest
    environment = environment or project.environments[0]
    if environment not in project.environments:
        raise BadInputError(
            f"environment {environment[:60]!r} is not registered for project {project.name!r}; "
            f"use one of {', '.join(project.environments)}")
    run = Run(project_id=project.id, kind="verify", commit_id=None, base_commit_id=base_commit.id,
              source_digest=digest, battery=battery or project.default_battery,
              environment=environment, idempotency_key=idempotency_key)
    session.add(run)
    session.flush()
    # A patched tree is packed by the service (no .git in it); a note can only be the upload's.
    return Submission(runs=[run], commit=None, new_run_ids=[run.id], patch_layout=patch_layout,
                      archive_note=source.note)
