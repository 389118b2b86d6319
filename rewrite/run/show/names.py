"""Module paths that differ only in a layer index, named once with the index ranges (`rewrite show`'s rows:
`model.layers.0-31.mlp.up_proj`)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from ...plan.wording import index_ranges

__all__ = ["collapse_names", "ranged_name", "split_index"]

_INDEX = re.compile(r"(?:(?<=\.)|^)\d+(?=\.|$)")  # a whole dotted segment that is a number


def split_index(fqn: str) -> tuple[str, int | None]:
    """The path with its first numeric segment (the layer index) replaced by "\\0", and that index (None)."""
    match = _INDEX.search(fqn)
    if match is None:
        return fqn, None
    return fqn[: match.start()] + "\0" + fqn[match.end() :], int(match.group(0))


def ranged_name(template: str, indices: Sequence[int]) -> str:
    """`split_index`'s template with the indices' ranges in place of its "\\0" (braced where not contiguous)."""
    if "\0" not in template:
        return template
    ranges = index_ranges(indices, min_run=2)
    return template.replace("\0", ranges if "," not in ranges else "{" + ranges + "}")


def collapse_names(names: Iterable[str]) -> list[str]:
    """Paths that differ only in one index as one path with the index ranges, in order of first appearance.

    Non-contiguous indices are braced: `model.layers.{0-3, 8-11}.mlp`.

    Example:
        >>> collapse_names(["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm"])
        ['model.embed_tokens', 'model.layers.0-1', 'model.norm']
    """
    groups: dict[str, list[int]] = {}
    for name in names:
        template, index = split_index(name)
        groups.setdefault(template, [])
        if index is not None:
            groups[template].append(index)
    return [ranged_name(template, indices) for template, indices in groups.items()]
