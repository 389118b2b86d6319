"""Reading plan files: YAML (safe, no duplicate keys) or JSON, with line numbers for messages."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

__all__ = ["PlanError", "read_plan_file", "line_of", "dotted"]


class PlanError(ValueError):
    """A plan that cannot be used. `problems` lists every issue found, one per line."""

    def __init__(self, source: str, problems: list[str]):
        self.source, self.problems = source, list(problems)
        count = f"{len(problems)} problem" + ("s" if len(problems) != 1 else "")
        super().__init__(f"{source}: {count}\n" + "\n".join("  " + p.replace("\n", "\n    ") for p in problems))


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses duplicate keys instead of keeping the last silently."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first on line {seen[key]})", key_node.start_mark
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def read_plan_file(path: Path) -> tuple[Any, Any]:
    """Parse a plan file; returns (data, YAML node tree for line numbers or None)."""
    if path.suffix not in (".yaml", ".yml", ".json"):
        raise PlanError(str(path), [f"unknown plan file type {path.suffix!r}: use .yaml, .yml or .json"])
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PlanError(str(path), [f"cannot read the plan file: {exc.strerror or exc}"]) from None
    if path.suffix == ".json":
        return _read_json(path, text), _compose(text)
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader), _compose(text)
    except yaml.YAMLError as exc:
        raise PlanError(str(path), [_yaml_problem(exc)]) from None


def _read_json(path: Path, text: str) -> Any:
    def unique(pairs):
        keys = [k for k, _ in pairs]
        dupes = sorted({k for k in keys if keys.count(k) > 1})
        if dupes:
            raise ValueError(f"duplicate key(s) {dupes}")
        return dict(pairs)

    try:
        return json.loads(text, object_pairs_hook=unique)
    except json.JSONDecodeError as exc:
        raise PlanError(str(path), [f"line {exc.lineno}, column {exc.colno}: malformed JSON: {exc.msg}"]) from None
    except ValueError as exc:
        raise PlanError(str(path), [f"malformed JSON: {exc}"]) from None


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    problem = getattr(exc, "problem", None) or str(exc)
    if isinstance(exc, yaml.constructor.ConstructorError) and "could not determine a constructor" in problem:
        tag = problem.split("tag", 1)[-1].strip(" '").replace("tag:yaml.org,2002:", "!!")
        return (
            f"{where}YAML tag {tag!r} is refused: plans are plain data "
            "(mappings, lists, strings, numbers), never Python objects"
        )
    return f"{where}malformed YAML: {problem}"


def _compose(text: str) -> Any:
    try:
        return yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return None  # JSON that YAML cannot read: no line numbers, nothing else lost


def line_of(node: Any, loc: tuple) -> int | None:
    """Line of the deepest YAML key along `loc`, for error messages."""
    line = None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = next(((k, v) for k, v in node.value if k.value == str(part)), None)
            if match is None:
                break
            line, node = match[0].start_mark.line + 1, match[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


def dotted(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "." in str(part) or "*" in str(part):
            out += f"[{part!r}]"
        else:
            out += ("." if out else "") + str(part)
    return out
