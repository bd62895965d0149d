"""A YAML loader that remembers the line of every mapping key and sequence item.

Configuration errors must point at a line (``FILE:LINE: KEY: message``), so the
loader builds :class:`LineMap` / :class:`LineList` containers — a ``dict`` / ``list``
that also carry the 1-based line of the container, of each key, and of each item.
Only YAML's safe tags are constructed (a ``yaml.SafeLoader`` subclass).  A YAML
syntax error becomes a ConfigError with KEY ``yaml``; an unreadable file one that
callers can report as ``FILE: cannot read: REASON``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, SequenceNode

from proxy.errors import ConfigError


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


class LineLoader(yaml.SafeLoader):
    """SafeLoader building LineMap / LineList and rejecting duplicate keys."""

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
