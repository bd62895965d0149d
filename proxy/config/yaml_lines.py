"""A YAML loader that remembers the line of every mapping key and sequence item.

Configuration errors must point at a line (``FILE:LINE: KEY: message``), so the
loader builds :class:`LineMap` / :class:`LineList` containers — a ``dict`` / ``list``
that also carry the 1-based line of the container, of each key, and of each item.
Only YAML's safe tags are constructed (a ``yaml.SafeLoader`` subclass).  A YAML
syntax error becomes a ConfigError with KEY ``yaml``; an unreadable file one that
callers can report as ``FILE: cannot read: REASON``.

A document is bounded before anything is built from it: at most :data:`MAX_DEPTH`
levels of nesting and :data:`MAX_VALUES` values once aliases are expanded (a
300-byte "billion laughs" document of nested aliases would otherwise expand to
billions of values in the first error message or rewrite that walks it).
:func:`check_bounds` applies the same limits to data parsed elsewhere (JSON bodies).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

import yaml
from yaml.nodes import MappingNode, Node, SequenceNode

from proxy.errors import ConfigError

#: deepest nesting of mappings and sequences a configuration or rules document may have
MAX_DEPTH: Final = 32
#: most values (scalars, mappings, sequences) a document may hold with its aliases expanded
MAX_VALUES: Final = 100_000


class LineMap(dict[Any, Any]):
    """A mapping from YAML, with ``line`` (of the mapping) and ``key_lines`` (of each key)."""

    line: int = 0
    key_lines: dict[Any, int]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.key_lines = {}

    def line_of(self, key: Any) -> int:
        """The line of ``key``, or of the mapping when the key is absent."""
        return self.key_lines.get(key, self.line)


class LineList(list[Any]):
    """A sequence from YAML, with ``line`` (of the sequence) and ``item_lines``."""

    line: int = 0
    item_lines: list[int]

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.item_lines = []

    def line_of(self, index: int) -> int:
        if 0 <= index < len(self.item_lines):
            return self.item_lines[index]
        return self.line


class CannotRead(ConfigError):
    """The file could not be read at all (missing, a directory, no permission)."""


class DocumentTooLarge(ConfigError):
    """The document nests deeper than MAX_DEPTH or expands past MAX_VALUES."""


class LineLoader(yaml.SafeLoader):
    """SafeLoader building LineMap / LineList, rejecting duplicate keys and unbounded documents."""

    _depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
                raise DocumentTooLarge(f"nested more than {MAX_DEPTH} levels deep", file=self.name,
                                       line=mark.line + 1, key="yaml")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_node(self) -> Node | None:
        node = super().get_single_node()
        if node is not None:
            expanded = _expanded_size(node)
            if expanded > MAX_VALUES:  # counted up to the bound, never expanded
                raise DocumentTooLarge(f"expands to more than {MAX_VALUES:,} values with its aliases",
                                  file=self.name, line=node.start_mark.line + 1, key="yaml")
        return node

    def construct_line_map(self, node: MappingNode) -> LineMap:
        result = LineMap()
        result.line = node.start_mark.line + 1
        self.flatten_mapping(node)
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                raise ConfigError("a mapping key must be a plain value", file=self.name,
                                  line=key_node.start_mark.line + 1, key="yaml") from None
            if key in result:
                raise ConfigError(f"duplicate key {key!r}", file=self.name,
                                  line=key_node.start_mark.line + 1, key=str(key))
            result[key] = self.construct_object(value_node, deep=True)
            result.key_lines[key] = key_node.start_mark.line + 1
        return result

    def construct_line_list(self, node: SequenceNode) -> LineList:
        result = LineList()
        result.line = node.start_mark.line + 1
        for item in node.value:
            result.append(self.construct_object(item, deep=True))
            result.item_lines.append(item.start_mark.line + 1)
        return result


def _expanded_size(root: Node) -> int:
    """Values in the document with every alias expanded, counted without expanding (memo per node)."""
    sizes: dict[int, int] = {}
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes:
            continue
        if isinstance(node, SequenceNode):
            children = list(node.value)
        elif isinstance(node, MappingNode):
            children = [child for pair in node.value for child in pair]
        else:
            sizes[id(node)] = 1
            continue
        if children_done:
            sizes[id(node)] = min(1 + sum(sizes[id(child)] for child in children), MAX_VALUES + 1)
        else:
            stack.append((node, True))
            stack.extend((child, False) for child in children if id(child) not in sizes)
    return sizes[id(root)]


def check_bounds(data: Any, file: str | None = None) -> None:
    """The same bounds for data parsed without this loader (a JSON body): depth and value count."""
    count = 0
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        count += 1
        if depth > MAX_DEPTH:
            raise DocumentTooLarge(f"nested more than {MAX_DEPTH} levels deep", file=file, key="json")
        if count > MAX_VALUES:
            raise DocumentTooLarge(f"holds more than {MAX_VALUES:,} values", file=file, key="json")
        if isinstance(value, dict):
            stack.extend((item, depth + 1) for pair in value.items() for item in pair)
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)


def _construct_map(loader: LineLoader, node: Node) -> LineMap:
    assert isinstance(node, MappingNode)
    return loader.construct_line_map(node)


def _construct_list(loader: LineLoader, node: Node) -> LineList:
    assert isinstance(node, SequenceNode)
    return loader.construct_line_list(node)


LineLoader.add_constructor("tag:yaml.org,2002:map", _construct_map)
LineLoader.add_constructor("tag:yaml.org,2002:seq", _construct_list)


def load_text(text: str, file: str = "<string>") -> Any:
    """Parse YAML text into LineMap / LineList / scalars; syntax errors are ConfigErrors."""
    loader = LineLoader(text)
    loader.name = file
    try:
        return loader.get_single_data()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        problem = exc.problem or exc.context or "invalid YAML"
        raise ConfigError(problem, file=file, line=line, key="yaml") from None
    except yaml.YAMLError as exc:
        raise ConfigError(str(exc), file=file, key="yaml") from None
    except RecursionError:  # a guard behind MAX_DEPTH: whatever nests past Python's stack is refused too
        raise DocumentTooLarge("nested too deeply", file=file, key="yaml") from None
    finally:
        loader.dispose()


def load_file(path: str | Path) -> Any:
    """Read and parse a YAML file; an unreadable file raises :class:`CannotRead`."""
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise CannotRead(f"cannot read: {reason}", file=name) from None
    return load_text(text, name)
