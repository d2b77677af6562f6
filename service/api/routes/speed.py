"""The kernels' own speed: a run's timings against its baseline's, and one kernel's history.

GET /api/v1/runs/{run_id}/speed                       -> RunSpeedPublic (per kernel, with the verdict)
GET /api/v1/projects/{project}/speed/history?kernel=adam/32bit&param_dtype=float32&size=1048576
                                                      -> KernelSpeedHistoryPublic (oldest first)
GET /api/v1/projects/{project}/speed/kernels           -> every (kernel, dtype, size) timed
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel

from service.api.deps import SessionDep
from service.api.params import RunIdPath, limit_param
from service.domain import kernel_speed, projects, runs

router = APIRouter(tags=["speed"])


class KernelSpeedPublic(BaseModel):
    kernel: str
    param_dtype: str
    size: int
    median_s: float | None
    spread_s: float | None  # interquartile range of the samples, seconds
    samples: int
    bytes_moved: int
    bandwidth_bytes_per_s: float | None
    copy_fraction: float | None  # the kernel's bandwidth / a same-bytes copy's, same run
    error: str | None
    baseline_median_s: float | None
    ratio: float | None  # median(this run) / median(baseline); > 1: slower
    ratio_low: float | None  # bootstrap interval of the ratio (confidence below)
    ratio_high: float | None
    verdict: str  # slower | faster | same | no-baseline | error


class RunSpeedPublic(BaseModel):
    run_id: int
    verdict: str  # slower | faster | same | no-baseline | not-timed
    summary: str
    baseline_run_id: int | None
    threshold: float  # "slower" needs the whole interval above 1 + threshold
    confidence: float
    device: str | None
    note: str | None  # the worker's note: kernels timed, seconds, untimed, or why timing failed
    kernels: list[KernelSpeedPublic]


class KernelSpeedPoint(BaseModel):
    run_id: int
    sha: str | None
    kind: str
    environment: str
    created_at: str
    median_s: float
    spread_s: float | None
    copy_fraction: float | None
    device: str


class KernelSpeedHistoryPublic(BaseModel):
    project: str
    kernel: str
    param_dtype: str
    size: int
    data: list[KernelSpeedPoint]


class TimedKernel(BaseModel):
    kernel: str
    param_dtype: str
    size: int


class TimedKernelsPublic(BaseModel):
    data: list[TimedKernel]


@router.get("/runs/{run_id}/speed", response_model=RunSpeedPublic)
def run_speed(run_id: RunIdPath, session: SessionDep) -> RunSpeedPublic:
    run = runs.get(session=session, run_id=run_id)
    return RunSpeedPublic.model_validate(kernel_speed.run_speed(session=session, run=run).as_dict())


@router.get("/projects/{project}/speed/history", response_model=KernelSpeedHistoryPublic)
def speed_history(project: str, session: SessionDep,
                  kernel: Annotated[str, Query(max_length=100, description="<optimizer>/<family>, e.g. adam/32bit")],
                  param_dtype: Annotated[str, Query(max_length=20)] = "float32",
                  size: Annotated[int, Query(ge=1, le=2**40)] = 1 << 20,
                  environment: Annotated[str | None, Query(max_length=100)] = None,
                  limit: limit_param(200, 2000) = 200) -> KernelSpeedHistoryPublic:
    found = projects.get_by_name(session=session, name=project)
    points = kernel_speed.history(session=session, project_id=found.id, kernel=kernel, param_dtype=param_dtype,
                                  size=size, environment=environment, limit=limit)
    return KernelSpeedHistoryPublic(project=project, kernel=kernel, param_dtype=param_dtype, size=size,
                                    data=[KernelSpeedPoint(**point) for point in points])


@router.get("/projects/{project}/speed/kernels", response_model=TimedKernelsPublic)
def timed_kernels(project: str, session: SessionDep) -> TimedKernelsPublic:
    found = projects.get_by_name(session=session, name=project)
    return TimedKernelsPublic(data=[TimedKernel(kernel=k, param_dtype=d, size=s)
                                    for k, d, s in kernel_speed.kernels_of_project(session=session, project_id=found.id)])
