"""Terminal tables that fit the width they are printed at: names wrap, numbers stay whole.

rich's Table, left to itself, shrinks every column of a table wider than the terminal, numbers
included: at 120 columns a case read `lion.32…` and a distance `1.189e-… → 1.996e-…` (issue 47).
A `FittedTable` decides the columns' widths itself, at the width it is rendered at:

- a *number* column (`kind="number"`: figures, steps, counts) is never wrapped nor cut: it gets the
  width of its longest line, header included (break a long header with "\\n");
- a *name* or *text* column (a case's name, a verdict, a message) folds over lines, never narrower
  than its `min_width`;
- when the columns do not fit, the numbers are first written shorter (`Figure`: 3 significant
  digits, `1.19e-5`, instead of 4, `1.189e-05`), then the columns of least priority are left out
  and the caption names them ("--wide shows every column");
- `wide=True` keeps every column (and the full number format) however narrow the terminal: the
  table is then as wide as it needs and the terminal wraps its lines.

The table is a rich renderable (`console.print(table)`): it fits the width it is given.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

from service.core.wording import compact_number, number

Kind = Literal["name", "number", "text"]
# A table's frame: a border before each column and after the last, and one space of padding on
# each side of a cell (rich's defaults).
PADDING, BORDER = 2, 1


@dataclass(frozen=True)
class Figure:
    """A number cell written two ways: `full` (the project's 4 significant digits) and `short`
    (3, for narrow terminals). Either may hold several lines."""

    full: str
    short: str

    @classmethod
    def of(cls, value: float | int | None, missing: str = "-") -> "Figure":
        return cls(number(value, missing=missing), compact_number(value, missing=missing))

    @classmethod
    def pair(cls, before: float | None, after: float | None, missing: str = "-") -> "Figure":
        """'before → after' (a distance to float64 in the baseline → in the commit)."""
        if before is None and after is None:
            return cls(missing, missing)
        return cls(f"{number(before, missing=missing)} → {number(after, missing=missing)}",
                   f"{compact_number(before, missing=missing)} → {compact_number(after, missing=missing)}")

    @classmethod
    def joined(cls, figures: Iterable["Figure"], separator: str) -> "Figure":
        figures = list(figures)
        return cls(separator.join(f.full for f in figures), separator.join(f.short for f in figures))

    def prefixed(self, prefix: str) -> "Figure":
        return Figure(prefix + self.full, prefix + self.short)


Cell = str | Figure


@dataclass(frozen=True)
class Column:
    header: str  # "\n" where it may break when the column is narrower than it
    kind: Kind = "text"
    # Lower numbers stay longer when the terminal is narrow.
    priority: int = 0
    # A name or text column is never folded narrower than this (nor than its longest header word).
    min_width: int = 8
    justify: Literal["left", "right"] = "left"
    # Whether its cells hold rich markup ("[red]changed[/]"); otherwise they are shown as written
    # (a case's layout part "L[1+257|1031:lr=0.01]" is not a tag).
    markup: bool = False


def _lines(text: str) -> list[str]:
    return text.splitlines() or [""]


def _longest_line(texts: Iterable[str]) -> int:
    return max((len(line) for text in texts for line in _lines(text)), default=0)


@dataclass
class FittedTable:
    title: str
    columns: Sequence[Column]
    wide: bool = False
    caption: str | None = None
    rows: list[list[Cell]] = field(default_factory=list)

    def add_row(self, *cells: Cell) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"{len(cells)} cells for {len(self.columns)} columns")
        self.rows.append(list(cells))

    # --- layout ---------------------------------------------------------------------------------
    def _cell(self, row: list[Cell], index: int, short: bool) -> str:
        cell = row[index]
        return (cell.short if short else cell.full) if isinstance(cell, Figure) else cell

    def _texts(self, index: int, short: bool) -> list[str]:
        """A column's cells as shown (markup taken out)."""
        texts = [self._cell(row, index, short) for row in self.rows]
        return [Text.from_markup(t).plain for t in texts] if self.columns[index].markup else texts

    def _natural(self, index: int, short: bool) -> int:
        """The width a column wants: its longest cell line, and its longest header line."""
        return max(_longest_line(self._texts(index, short)), _longest_line([self.columns[index].header]), 1)

    def _least(self, index: int, short: bool) -> int:
        """The narrowest a column may be: a number's whole width; a name's min_width (or less
        when nothing in it is that long), never below its longest header word."""
        column = self.columns[index]
        natural = self._natural(index, short)
        if column.kind == "number":
            return natural
        header_word = max((len(word) for word in column.header.split()), default=1)
        return max(min(natural, column.min_width), header_word)

    def _choose(self, width: int, short: bool) -> list[int]:
        """The columns that fit `width`, by priority (the first column by priority is always kept)."""
        chosen: list[int] = []
        used = BORDER
        for index in sorted(range(len(self.columns)), key=lambda i: (self.columns[i].priority, i)):
            cost = self._least(index, short) + PADDING + BORDER
            if not chosen or used + cost <= width:
                chosen.append(index)
                used += cost
        return sorted(chosen)

    def layout(self, width: int) -> tuple[list[int], list[int], bool]:
        """(the columns shown, their widths without padding, whether numbers are short) at `width`."""
        every = list(range(len(self.columns)))
        if self.wide:
            chosen, short = every, False
        else:
            chosen, short = self._choose(width, short=False), False
            if len(chosen) < len(every):  # shorter numbers first, before columns go
                chosen_short = self._choose(width, short=True)
                if len(chosen_short) > len(chosen):
                    chosen, short = chosen_short, True
        widths = [self._least(i, short) for i in chosen]
        room = width - BORDER - sum(w + PADDING + BORDER for w in widths)
        wants = [self._natural(i, short) for i in chosen]
        # What is left goes to the folding columns in their priority order (a case's name first),
        # each up to what it wants: the name of a row reads on one line where the terminal allows.
        for position in sorted(range(len(chosen)), key=lambda p: (self.columns[chosen[p]].priority, p)):
            if room <= 0:
                break
            if self.columns[chosen[position]].kind != "number":
                grown = min(room, wants[position] - widths[position])
                widths[position] += grown
                room -= grown
        return chosen, widths, short

    def table_at(self, width: int) -> Table:
        chosen, widths, short = self.layout(width)
        left_out = [self.columns[i].header.replace("\n", " ") for i in range(len(self.columns)) if i not in chosen]
        folded = any(widths[p] < self._natural(i, short) for p, i in enumerate(chosen))
        multi_line = any("\n" in (t or "") for i in chosen for t in self._texts(i, short))
        captions = [self.caption] if self.caption else []
        if left_out:
            captions.append(f"not shown at this width: {', '.join(left_out)} (--wide shows every column)")
        # Rules between rows when a cell takes several lines: each row then reads as one.
        table = Table(title=self.title, caption="\n".join(captions) or None, show_lines=folded or multi_line)
        for position, index in enumerate(chosen):
            column = self.columns[index]
            number_column = column.kind == "number"
            # A header's "\n" is where it may break: on one line where the column is that wide.
            one_line = column.header.replace("\n", " ")
            header = one_line if widths[position] >= len(one_line) else column.header
            table.add_column(header, width=widths[position], no_wrap=number_column,
                             overflow="ellipsis" if number_column else "fold",
                             justify="right" if number_column else column.justify)
        for row in self.rows:
            table.add_row(*(Text.from_markup(self._cell(row, i, short)) if self.columns[i].markup
                            else Text(self._cell(row, i, short)) for i in chosen))
        return table

    def shown_headers(self, width: int) -> list[str]:
        """The headers (one line each) of the columns shown at `width`."""
        return [self.columns[i].header.replace("\n", " ") for i in self.layout(width)[0]]

    def needed_width(self) -> int:
        """The width at which every column shows with its numbers in full."""
        return BORDER + sum(self._least(i, False) + PADDING + BORDER for i in range(len(self.columns)))

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        if self.wide:
            width = max(width, self.needed_width())
            options = options.update_width(width)
        table = self.table_at(width)
        if self.wide:
            yield from console.render(table, options)  # past the terminal's width: printed uncropped
        else:
            yield table


def print_table(console: Console, table: FittedTable | Table | None) -> None:
    """Print a table; a `--wide` one is not cropped at the terminal's width."""
    if table is None:
        return
    console.print(table, crop=not getattr(table, "wide", False))
