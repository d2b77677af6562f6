"""A case named by what it is, for every place a person reads one (tables, legends, history, CLI).

A case id is a readable label plus a content hash (worker.battery.make_case):
``adam.32bit.fp32.lr=0.1.wd=0.1.open.n4097.s0.t20#1928207e``. People read the label, with its
parts apart: ``adam · 32bit · fp32 · lr=0.1 · wd=0.1 · open · n4097 · s0 · t20``; the hash is only
for links and tooltips (two cases never share a label: the label holds every part of the case
that differs from the optimizer's defaults, and the hash is of the same body).
"""

from __future__ import annotations

import re

SEPARATOR = " · "
# A label's parts are joined by "."; a "." inside a number (lr=0.1, wd=0.0, z0.25) sits between two
# digits, every separator has a non-digit before it or a letter after it.
_PART_BREAK = re.compile(r"(?<!\d)\.|\.(?=[A-Za-z\[])")


def case_label(case_id: str) -> str:
    """The case id without its hash."""
    return case_id.split("#", 1)[0]


def case_hash(case_id: str) -> str | None:
    """The case id's content hash, or None for an id without one."""
    _, sep, digest = case_id.partition("#")
    return digest if sep else None


def case_parts(case_id: str) -> list[str]:
    """The label's parts, in order: optimizer, family, dtype, lr, wd, other hyperparameters, the
    gradient stream, the size (or layout), the seed, the steps."""
    return [part for part in _PART_BREAK.split(case_label(case_id)) if part]


def case_name(case_id: str, separator: str = SEPARATOR) -> str:
    """The readable name of a case: its parts joined by `separator`."""
    return separator.join(case_parts(case_id))
