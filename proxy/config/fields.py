"""Typed reading of YAML sections, with errors that name the file, line and dotted key.

A :class:`Section` wraps one mapping of a loaded document (see ``yaml_lines``) and
its dotted path (``tls``, ``rules[2].action``).  Each accessor checks one value's
type and range and returns it, or raises a ConfigError pointing at the key's own
line; :meth:`Section.check_keys` rejects unknown keys.  The proxy config and the
rules engine share these helpers so both report errors the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from proxy.config.yaml_lines import LineList, LineMap
from proxy.errors import ConfigError, ConfigErrors

T = TypeVar("T")

_MISSING: Any = object()


def join_key(path: str, key: str | int) -> str:
    """The dotted path of ``key`` below ``path`` (``a.b``, ``a[3]``)."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def line_of(container: Any, key: Any) -> int | None:
    """The line of ``key`` in a LineMap / LineList, or None for plain containers."""
    if isinstance(container, (LineMap, LineList)):
        return container.line_of(key)
    return None


def type_word(value: Any) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return type(value).__name__


class Section:
    """One mapping of a config document, read key by key."""

    def __init__(self, data: Mapping[Any, Any], *, file: str | None, path: str = "",
                 line: int | None = None) -> None:
        self.data = data
        self.file = file
        self.path = path
        self.line = line if line is not None else (data.line if isinstance(data, LineMap) else None)

    @classmethod
    def of(cls, value: Any, *, file: str | None, path: str = "", line: int | None = None) -> Section:
        """A Section for ``value``, which must be a mapping (an empty document counts as {})."""
        if value is None:
            value = {}
        if not isinstance(value, Mapping):
            raise ConfigError(f"must be a mapping, not {type_word(value)}", file=file, line=line,
                              key=path or None)
        return cls(value, file=file, path=path, line=line)

    # -- errors -------------------------------------------------------------------------
    def key_line(self, key: str) -> int | None:
        found = line_of(self.data, key)
        return found if found is not None else self.line

    def error(self, key: str | None, message: str) -> ConfigError:
        """A ConfigError for ``key`` of this section (None: the section itself)."""
        if key is None:
            return ConfigError(message, file=self.file, line=self.line, key=self.path or None)
        return ConfigError(message, file=self.file, line=self.key_line(key), key=join_key(self.path, key))

    def check_keys(self, allowed: Iterable[str]) -> None:
        """Reject every key that is not in ``allowed`` (ConfigErrors when there are several)."""
        allowed_set = set(allowed)
        known = ", ".join(sorted(allowed_set))
        ConfigErrors.raise_if_any([self.error(str(key), f"unknown key (known keys: {known})")
                                   for key in self.data if key not in allowed_set])

    # -- values -------------------------------------------------------------------------
    def has(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def raw(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    def section(self, key: str) -> Section | None:
        """The mapping under ``key`` as a Section, or None when absent."""
        if not self.has(key):
            return None
        value = self.data[key]
        if not isinstance(value, Mapping):
            raise self.error(key, f"must be a mapping, not {type_word(value)}")
        return Section(value, file=self.file, path=join_key(self.path, key), line=self.key_line(key))

    def string(self, key: str, default: Any = _MISSING) -> Any:
        """A non-empty string; ``default`` when absent (required when no default is given)."""
        if not self.has(key):
            if default is _MISSING:
                raise self.error(key, "is required")
            return default
        value = self.data[key]
        if not isinstance(value, str) or not value.strip():
            raise self.error(key, f"must be a non-empty string, not {type_word(value)}")
        return value

    def boolean(self, key: str, default: bool) -> bool:
        if not self.has(key):
            return default
        value = self.data[key]
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, not {type_word(value)}")
        return value

    def integer(self, key: str, default: Any = _MISSING, *, minimum: int | None = None,
                maximum: int | None = None) -> Any:
        if not self.has(key):
            if default is _MISSING:
                raise self.error(key, "is required")
            return default
        value = self.data[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"must be an integer, not {type_word(value)}")
        return self._ranged(key, value, minimum, maximum)

    def number(self, key: str, default: Any = _MISSING, *, minimum: float | None = None,
               maximum: float | None = None) -> Any:
        if not self.has(key):
            if default is _MISSING:
                raise self.error(key, "is required")
            return default
        value = self.data[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(key, f"must be a number, not {type_word(value)}")
        return self._ranged(key, value, minimum, maximum)

    def choice(self, key: str, choices: Iterable[str], default: Any = _MISSING) -> Any:
        options = list(choices)
        value = self.string(key, default)
        if value is default and not self.has(key):
            return value
        if value not in options:
            raise self.error(key, f"must be one of {', '.join(options)}, not {value!r}")
        return value

    def _ranged(self, key: str, value: T, minimum: float | None, maximum: float | None) -> T:
        if minimum is not None and value < minimum:  # type: ignore[operator]
            raise self.error(key, f"must be at least {minimum}, not {value}")
        if maximum is not None and value > maximum:  # type: ignore[operator]
            raise self.error(key, f"must be at most {maximum}, not {value}")
        return value
