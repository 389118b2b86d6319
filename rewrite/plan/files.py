"""Reading plan files: YAML (safe, no duplicate keys) or JSON, with line numbers for messages."""

from __future__ import annotations

import difflib
import json
import reprlib
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from ..errors import RewriteError
from ..schedules import rows_from_csv
from .limits import MAX_PLAN_DEPTH, MAX_PLAN_VALUES, expansion_problem, read_plan_bytes, too_deep, too_many_values
from .wording import plural

__all__ = ["PlanError", "missing_plan_problem", "read_plan_file", "read_table_file", "key_lines", "dotted", "short"]

# Values quoted in messages come from the file and may be any size: show their start only.
_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = _SHORT.maxlong = 80
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = _SHORT.maxfrozenset = 8
_SHORT.maxlevel = 3
_SHOWN = 50  # problems printed in a message; `PlanError.problems` keeps them all
_TOO_DEEP = "the plan nests too deeply to read; a plan nests a few levels (mesh, tensor_parallel, pipeline)"


class PlanError(RewriteError, ValueError):
    """A plan that cannot be used. `problems` lists every issue found, one per line."""

    def __init__(self, source: str, problems: list[str]):
        self.source, self.problems = source, list(problems)
        count = plural(len(problems), "problem")
        shown = ["  " + p.replace("\n", "\n    ") for p in self.problems[:_SHOWN]]
        if len(problems) > _SHOWN:
            shown.append(f"  ... and {len(problems) - _SHOWN:,} more (all in PlanError.problems)")
        super().__init__(f"{source}: {count}\n" + "\n".join(shown))


class _Refused(yaml.MarkedYAMLError):
    """Valid YAML that is no plan (too many values, a list as a key); `problem` is the whole message."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses duplicate keys instead of keeping the last silently, and stops
    composing past MAX_PLAN_VALUES nodes or MAX_PLAN_DEPTH levels, so a huge or deep file
    costs no more than a small one."""

    def __init__(self, stream):
        super().__init__(stream)
        self.composed, self.depth = 0, 0

    def compose_node(self, parent, index):
        self.composed += 1  # aliases too: each use expands to one value or more
        if self.composed > MAX_PLAN_VALUES:
            raise _Refused(problem=too_many_values(self.peek_event().start_mark, "by here the plan holds"))
        if self.depth >= MAX_PLAN_DEPTH and self.check_event(yaml.SequenceStartEvent, yaml.MappingStartEvent):
            raise _Refused(problem=too_deep(self.peek_event().start_mark))
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode):  # `? [a, b]`: a list or mapping as a key
                kind, mark = "list" if isinstance(key_node, yaml.SequenceNode) else "mapping", key_node.start_mark
                raise _Refused(problem=f"line {mark.line + 1}, column {mark.column + 1}: a {kind} used as a key: "
                               "plan keys are strings (quote it if it is text)")
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {short(key)} (first on line {seen[key]})", key_node.start_mark
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def read_plan_file(path: Path) -> tuple[Any, Any]:
    """Parse a plan file; returns (data, YAML node tree for line numbers or None).

    Raises:
        PlanError: not a plan file, or past the `limits` (1 MiB of UTF-8, 10,000 YAML values).
    """
    if path.suffix not in (".yaml", ".yml", ".json"):
        raise PlanError(str(path), [f"unknown plan file type {path.suffix!r}: use .yaml, .yml or .json"])
    try:
        raw = read_plan_bytes(path)
    except FileNotFoundError:
        raise PlanError(str(path), [missing_plan_problem(path)]) from None
    except OSError as exc:
        raise PlanError(str(path), [f"cannot read the plan file {path.absolute()}: {exc.strerror or exc}"]) from None
    except ValueError as exc:
        raise PlanError(str(path), [str(exc)]) from None
    text = _decode(path, raw)
    if path.suffix == ".json":
        return _read_json(path, text), _compose(text)
    return _read_yaml(path, text)


def missing_plan_problem(path: Path) -> str:
    """No file at `path`: where that was looked for, and the plans beside it (else in ./plans), the closest named."""
    folder, plans = None, []
    for folder in (path.parent, Path("plans")):
        plans = sorted(p.name for p in folder.iterdir() if p.suffix in (".yaml", ".yml", ".json")
                       and not p.name.endswith(".schema.json")) if folder.is_dir() else []
        if plans:
            break
    text = f"no plan file at {path.absolute()}"
    close = difflib.get_close_matches(path.name, plans, n=1, cutoff=0.6)
    if close:
        text += f"; did you mean {folder / close[0]}?"
    if plans:
        text += f"{' The' if close else '; the'} plans in {folder}/: {', '.join(plans)}"
    return text


def _decode(path: Path, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        start = raw.rfind(b"\n", 0, exc.start) + 1
        line, column = raw.count(b"\n", 0, exc.start) + 1, len(raw[start : exc.start].decode("utf-8")) + 1
        raise PlanError(str(path), [f"line {line}, column {column}: not UTF-8 text (byte {exc.start:,} is "
                                    f"0x{raw[exc.start]:02x}: {exc.reason}); plans are UTF-8: save the file as UTF-8"]
                        ) from None


def _read_yaml(path: Path, text: str) -> tuple[Any, Any]:
    # Compose first: aliases share nodes there, so the cost of the data is counted before it is built.
    loader = _UniqueKeyLoader(text)
    try:
        node = loader.get_single_node()
        problem = expansion_problem(node)
        data = None if problem or node is None else loader.construct_document(node)
    except yaml.YAMLError as exc:
        problem = _yaml_problem(exc)
    except RecursionError:  # depth is capped above; this is for a caller already deep in the stack
        problem = _TOO_DEEP
    except ValueError as exc:  # e.g. an integer past Python's digit limit
        problem = f"malformed YAML: {_clip(str(exc))}"
    finally:
        loader.dispose()
    if problem:
        raise PlanError(str(path), [problem])
    return data, node


def _read_json(path: Path, text: str) -> Any:
    def unique(pairs):
        dupes = sorted(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
        if dupes:
            raise ValueError(f"duplicate key(s) {short(dupes)}")
        return dict(pairs)

    try:
        return json.loads(text, object_pairs_hook=unique)
    except json.JSONDecodeError as exc:
        raise PlanError(str(path), [f"line {exc.lineno}, column {exc.colno}: malformed JSON: {exc.msg}"]) from None
    except ValueError as exc:
        raise PlanError(str(path), [f"malformed JSON: {_clip(str(exc))}"]) from None
    except RecursionError:
        raise PlanError(str(path), [_TOO_DEEP]) from None


def _yaml_problem(exc: yaml.YAMLError) -> str:
    if isinstance(exc, _Refused):
        return exc.problem
    mark = getattr(exc, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    problem = getattr(exc, "problem", None) or str(exc)
    if isinstance(exc, yaml.constructor.ConstructorError) and "could not determine a constructor" in problem:
        tag = problem.split("tag", 1)[-1].strip(" '").replace("tag:yaml.org,2002:", "!!")
        return (f"{where}YAML tag {short(tag)} is refused: plans are plain data "
                "(mappings, lists, strings, numbers), never Python objects")
    return f"{where}malformed YAML: {_clip(problem)}"


def _compose(text: str) -> Any:
    # Line numbers for JSON messages; libyaml's composer, where installed, is several times faster.
    try:
        return yaml.compose(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except (yaml.YAMLError, RecursionError):
        return None  # JSON that YAML cannot read: no line numbers, nothing else lost


def short(value: Any) -> str:
    """repr(value), cut to a few lines however large the value is."""
    return _SHORT.repr(value)


def _clip(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 20] + " ... " + text[-15:]


def key_lines(node: Any, depth: int = 4) -> dict[tuple, int]:
    """Line of every key (and list item) down to `depth` levels, by location: ('mesh', 'tp') -> 2.

    Kept on a loaded plan, so that binding it to a model can name lines without the YAML tree.
    """
    lines: dict[tuple, int] = {}
    stack = [((), node)]
    while stack:
        loc, current = stack.pop()
        if len(loc) >= depth:
            continue
        if isinstance(current, yaml.MappingNode):
            for key, value in current.value:
                if isinstance(key, yaml.ScalarNode) and (*loc, key.value) not in lines:  # the first of equal keys
                    lines[(*loc, key.value)] = key.start_mark.line + 1
                    stack.append(((*loc, key.value), value))
        elif isinstance(current, yaml.SequenceNode):
            for i, item in enumerate(current.value):
                lines[(*loc, i)] = item.start_mark.line + 1
                stack.append(((*loc, i), item))
    return lines


def dotted(loc: tuple) -> str:
    """`('pipeline', 'cut_points', 0)` -> 'pipeline.cut_points[0]'; a key with dots or `*` in brackets."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "." in str(part) or "*" in str(part) or len(str(part)) > 60:
            out += f"[{short(part)}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def read_table_file(data: dict, base: Path, source: str) -> dict:
    """`data` with a `pipeline.table` naming a CSV file (relative to `base`) replaced by its rows."""
    pipeline = data.get("pipeline")
    if not isinstance(pipeline, dict) or not isinstance(pipeline.get("table"), str):
        return data
    path = base / pipeline["table"]
    try:
        text = read_plan_bytes(path).decode("utf-8")
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        why = getattr(exc, "strerror", None) or exc
        raise PlanError(source, [f"pipeline.table: cannot read the table file {str(path)!r}: {why}"]) from None
    return {**data, "pipeline": {**pipeline, "table": rows_from_csv(text)}}
