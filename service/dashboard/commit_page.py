"""Server-side figures for the commit / verify page's headline (issue 34 item 1): read from the
verdict's stored figures (service.core.verdicts.figures_of), never parsed back from its sentence."""

from __future__ import annotations

from service.core.results import ComparisonFigures
from service.core.verdicts import figures_of


def headline_figures(run) -> ComparisonFigures | None:  # noqa: ANN001
    """The comparison's figures, or None before the run has a verdict."""
    if run.verdict is None or not run.verdict.detail:
        return None
    return figures_of(run.verdict.detail)
