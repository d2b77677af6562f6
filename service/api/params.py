"""Integer parameters bounded at the API, so SQLite and PostgreSQL answer alike.

An id past what the column holds was a PostgreSQL DataError (422 through a handler) but an
OverflowError inside the SQLite driver (500); a negative `limit` became SQL `LIMIT -1`, which
SQLite reads as "no limit", bypassing the row cap. Bounds checked by FastAPI give a 422 that
names the parameter and its range on both backends, before any query.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Path, Query

# Row ids are INTEGER columns: 32-bit on PostgreSQL, so nothing larger can exist.
MAX_ROW_ID = 2**31 - 1
# Offsets and page numbers past this skip every row there could be; the bound keeps
# offset = (page - 1) * page_size inside a signed 64-bit SQL integer on both backends.
MAX_OFFSET = 2**40

RunIdPath = Annotated[int, Path(ge=1, le=MAX_ROW_ID, description="a run id")]
TrainingIdPath = Annotated[int, Path(ge=1, le=MAX_ROW_ID, description="a training-impact job's id")]
RunIdQuery = Annotated[int | None, Query(ge=1, le=MAX_ROW_ID, description="a run id")]
Offset = Annotated[int, Query(ge=0, le=MAX_OFFSET, description="rows to skip")]
Page = Annotated[int, Query(ge=1, le=MAX_OFFSET // 1000, description="page number, from 1")]


def limit_param(default: int, maximum: int):  # noqa: ANN201
    """`limit`: 1..maximum; below 1 or above the cap is a 422 naming the range (it was clamped
    above, and -1 meant "all rows" on SQLite)."""
    return Annotated[int, Query(ge=1, le=maximum,
                                description=f"rows to return, 1 to {maximum} (default {default})")]
