"""Aligned tables and wrapped text for the reports `rewrite show` prints."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from ...plan.wording import format_bytes

__all__ = ["WIDTH", "format_table", "format_bytes", "span", "wrap_list", "wrap_prose"]

WIDTH = 100  # columns that prose and the stage table's module lists wrap at


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]], *, indent: str = "  ") -> str:
    """Left-aligned columns, two spaces apart, with a dashed rule under the header.

    A cell holding newlines continues on the lines below, the other columns left blank.

    Example:
        >>> print(format_table(["a", "bb"], [[1, 2]]))
          a  bb
          -  --
          1  2
    """
    lines = [[str(c) for c in header]]
    for row in rows:
        cells = [str(c).split("\n") for c in row]
        lines += [[c[i] if i < len(c) else "" for c in cells] for i in range(max(len(c) for c in cells))]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    lines.insert(1, ["-" * w for w in widths])
    return "\n".join(indent + "  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def wrap_list(items: Sequence[str], width: int, *, sep: str = ",") -> str:
    """`a, b, c` broken after a comma (`sep`) into lines of at most `width` characters (a longer item stays whole).

    Example:
        >>> wrap_list(["model.embed_tokens", "model.layers.0-7", "model.norm"], 40)
        'model.embed_tokens, model.layers.0-7,\nmodel.norm'
    """
    lines = [""]
    for i, item in enumerate(items):
        piece = item + (sep if i < len(items) - 1 else "")
        if lines[-1] and len(lines[-1]) + 1 + len(piece) > width:
            lines.append(piece)
        else:
            lines[-1] = f"{lines[-1]} {piece}" if lines[-1] else piece
    return "\n".join(lines)


def wrap_prose(text: str, width: int = WIDTH) -> str:
    """Lines of prose longer than `width` wrapped, continuing 2 spaces deeper; table rows (a double space
    between words) are left as they are."""
    out = []
    for line in text.split("\n"):
        body = line.lstrip(" ")
        if len(line) <= width or "  " in body:
            out.append(line)
            continue
        lead = line[: len(line) - len(body)]
        out += textwrap.wrap(body, width, initial_indent=lead, subsequent_indent=lead + "  ",
                             break_long_words=False, break_on_hyphens=False)
    return "\n".join(out)


def span(lo: int, hi: int, word: str = "rank") -> str:
    """`rank 3`, or `ranks 4-7`."""
    return f"{word} {lo}" if lo == hi else f"{word}s {lo}-{hi}"
