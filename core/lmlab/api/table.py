"""A small table a plugin reports to the user (API 1.12): printed by the command that ran it, kept as
JSON where its results are written (a filter's in ``summary.json``'s ``data_filters``)."""

import math
from dataclasses import dataclass

Cell = str | int | float | None


@dataclass(frozen=True)
class Table:
    """Rows of JSON values under named columns, with a title and an optional note under it.

    Keep numbers as numbers (a share as 0.92, not "92 %"): the JSON copy is what scripts compare, and
    [lines][lmlab.api.table.Table.lines] formats them for the terminal.
    """

    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[Cell, ...], ...] = ()
    note: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "columns", tuple(self.columns))
        object.__setattr__(self, "rows", tuple(tuple(row) for row in self.rows))
        if not self.title or not self.columns:
            raise ValueError("a Table needs a title and at least one column")
        for i, row in enumerate(self.rows):
            if len(row) != len(self.columns):
                raise ValueError(f"row {i} of table {self.title!r} has {len(row)} cells for {len(self.columns)} columns")
            for cell in row:
                if isinstance(cell, bool) or not isinstance(cell, (str, int, float, type(None))) or (
                        isinstance(cell, float) and not math.isfinite(cell)):
                    raise ValueError(f"row {i} of table {self.title!r} holds {cell!r}; cells are str, int, "
                                     "finite float or None")

    def as_dict(self) -> dict:
        """The table as JSON values: ``{"title", "columns", "rows", "note"}``."""
        return {"title": self.title, "columns": list(self.columns), "rows": [list(r) for r in self.rows],
                "note": self.note}

    @classmethod
    def from_dict(cls, data: dict) -> "Table":
        """The table [as_dict][lmlab.api.table.Table.as_dict] wrote."""
        return cls(data["title"], tuple(data["columns"]), tuple(tuple(r) for r in data["rows"]), data.get("note", ""))

    def lines(self, digits: int = 3) -> list[str]:
        """The table as aligned text: the title, a header, one line per row (numbers right-aligned,
        floats to ``digits`` decimals, None as "–") and the note."""
        def shown(cell: Cell) -> str:
            if cell is None:
                return "–"
            if isinstance(cell, float):
                return f"{cell:,.{digits}f}"
            return f"{cell:,}" if isinstance(cell, int) else cell

        cells = [[shown(c) for c in row] for row in self.rows]
        widths = [max([len(h)] + [len(r[k]) for r in cells]) for k, h in enumerate(self.columns)]
        numeric = [all(isinstance(r[k], (int, float)) or r[k] is None for r in self.rows) and bool(self.rows)
                   for k in range(len(self.columns))]

        def line(values: list[str]) -> str:
            return "  ".join(v.rjust(w) if num else v.ljust(w)
                             for v, w, num in zip(values, widths, numeric)).rstrip()

        out = [self.title, line(list(self.columns)), *(line(r) for r in cells)]
        return out + ([self.note] if self.note else [])
