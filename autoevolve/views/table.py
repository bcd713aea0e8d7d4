"""Text tables, one way: aligned columns two spaces apart, each as wide as its widest cell. Every table the commands
and reports print (the 2x2, the candidates and selections, the registry, the loop's rounds) is laid out here."""

from __future__ import annotations

from collections.abc import Collection, Sequence


def text_table(head: Sequence[str] | None, rows: Sequence[Sequence[str]], right: Collection[int] = ()) -> str:
    """The rows (and the head, when given) as aligned text: columns in ``right`` right-aligned, the others left; the
    last column is not padded, so a long note runs on."""
    grid = ([list(head)] if head is not None else []) + [list(r) for r in rows]
    if not grid:
        return ""
    widths = [max(len(r[i]) for r in grid) for i in range(len(grid[0]))]
    last = len(widths) - 1

    def cell(i: int, value: str) -> str:
        if i in right:
            return value.rjust(widths[i])
        return value if i == last else value.ljust(widths[i])

    return "\n".join("  ".join(cell(i, v) for i, v in enumerate(r)).rstrip() for r in grid)
