"""Words for messages: the sizes that fit (`tp 1 or 3`), index ranges, plurals, byte counts."""

from __future__ import annotations

import re
from collections.abc import Iterable
from itertools import groupby, islice

__all__ = ["MOST_RANKS", "collapse_repeats", "common_divisors", "either", "first_few", "format_bytes", "index_ranges", "noun_for", "plural"]

MOST_RANKS = 4096  # the largest group size a message lists sizes up to


def common_divisors(*counts: int, most: int = 8) -> list[int]:
    """The smallest `most` sizes that divide every count, e.g. (9, 3) -> [1, 3].

        >>> common_divisors(14, 2), common_divisors(1536)
        ([1, 2], [1, 2, 3, 4, 6, 8, 12, 16])
    """
    counts = tuple(c for c in counts if c >= 1)
    if not counts:
        return [1]
    # No mesh has more than a few thousand ranks on one axis: scan that far, however large the counts.
    return list(islice((d for d in range(1, min(*counts, MOST_RANKS) + 1) if all(c % d == 0 for c in counts)), most))


def either(values: Iterable[object], word: str = "or") -> str:
    """'1, 2 or 4' (or '1' for one value)."""
    items = [str(v) for v in values]
    return ", ".join(items[:-1]) + f" {word} {items[-1]}" if len(items) > 1 else "".join(items)


def index_ranges(indices: Iterable[int], *, min_run: int = 3) -> str:
    """Sorted as numbers, runs of `min_run` or more written as ranges: '0-3, 5, 7, 9-11'.

        >>> index_ranges([9, 10, 5]), index_ranges([9, 10, 5], min_run=2)
        ('5, 9, 10', '5, 9-10')
    """
    parts = []
    for _, pairs in groupby(enumerate(sorted(set(indices))), key=lambda pair: pair[1] - pair[0]):  # one per run
        run = [i for _, i in pairs]
        parts += [f"{run[0]}-{run[-1]}"] if len(run) >= min_run else [str(i) for i in run]
    return ", ".join(parts)


def plural(count: int, noun: str, many: str | None = None) -> str:
    """'1 kv head', '3 kv heads', '2 microbatches'; `many` where the plural is irregular."""
    return f"{count} {noun_for(count, noun, many)}"


def noun_for(count: int, noun: str, many: str | None = None) -> str:
    """The noun alone, in the number `count` asks for: 'rank' for 1, 'ranks' (or 'microbatches') otherwise."""
    return noun if count == 1 else many or noun + ("es" if noun.endswith(("ch", "sh", "s", "x")) else "s")


_INDEX = re.compile(r"(?<=\.)\d+(?=\.)")


def collapse_repeats(problems: list[str]) -> list[str]:
    """One line for problems that differ only in a layer index: 'model.layers.0.mlp: ...' ..
    'model.layers.31.mlp: ...' becomes 'model.layers.*.mlp: ... [* = 0-31]'."""
    groups: dict[str, list[int]] = {}
    for problem in problems:
        match = _INDEX.search(problem)
        key = _INDEX.sub("\0", problem, count=1) if match else problem
        indices = groups.setdefault(key, [])
        if match:
            indices.append(int(match.group(0)))
    out = []
    for key, indices in groups.items():
        if not indices:
            out.append(key)  # the same problem twice: once is enough
        elif len(set(indices)) == 1:
            out.append(key.replace("\0", str(indices[0])))
        else:
            out.append(key.replace("\0", "*") + f" [* = {index_ranges(indices)}]")
    return out


def format_bytes(n: int) -> str:
    """`1536` -> `'1.5 KiB'`."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024


def first_few(items: Iterable[object], shown: int = 3, sep: str = ", ") -> str:
    """The first `shown` items and how many more: 'a, b, c and 2 more' (all of them when that is all)."""
    items = [str(i) for i in items]
    return sep.join(items[:shown]) + (f" and {len(items) - shown} more" if len(items) > shown else "")
