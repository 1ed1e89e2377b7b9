"""The tables the command lines print: a cell too wide for its column folds onto more lines, never ends in '…'.

At 80 columns, or piped (where rich assumes 80), rich's own default cuts a long name, digest or path with an
ellipsis; people compare those by eye and copy them, so every column here folds what does not fit instead.
A cell given as a string is printed as written: a name like `trial [pilot]` is not read as rich markup.
"""

from __future__ import annotations

from typing import Any

from rich.console import OverflowMethod, RenderableType
from rich.markup import escape
from rich.style import StyleType
from rich.table import Table as RichTable

__all__ = ["Table"]


class Table(RichTable):
    """A rich table whose columns fold (wrap within a word) what does not fit, rather than cut it."""

    def add_column(
        self,
        header: RenderableType = "",
        footer: RenderableType = "",
        *,
        overflow: OverflowMethod = "fold",
        **options: Any,
    ) -> None:
        """Add a column that folds by default; `overflow` still chooses otherwise where one is given."""
        super().add_column(header, footer, overflow=overflow, **options)

    def add_row(
        self, *renderables: RenderableType | None, style: StyleType | None = None, end_section: bool = False
    ) -> None:
        """Add a row; its strings are escaped (styled cells come as rich Text)."""
        cells = [escape(cell) if isinstance(cell, str) else cell for cell in renderables]
        super().add_row(*cells, style=style, end_section=end_section)
