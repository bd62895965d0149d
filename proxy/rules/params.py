"""Reading one mapping of a rule file, validated, with every error kept: :class:`Section`.

The loader (:mod:`proxy.rules.loader`) reads a rule's name and match with it, and each
action class of :mod:`proxy.rules.actions` reads its own parameters with it.  A
problem becomes a :class:`~proxy.errors.ConfigError` naming the file, the line (from
:mod:`proxy.config.yaml_lines`, when the data came from YAML) and the dotted key
(``rules[2].action.delay.ms``); the :class:`Collector` keeps them all, so one run
reports every error.  A value found wrong raises :class:`Invalid` after its error is
recorded; :meth:`Section.attempt` records and carries on with the other fields.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

from proxy.config import fields
from proxy.config.yaml_lines import LineMap
from proxy.errors import ConfigError

V = TypeVar("V")


class Invalid(Exception):
    """One value is wrong; the collector has already recorded why."""


class Collector:
    def __init__(self, file: str | None) -> None:
        self.file = file
        self.errors: list[ConfigError] = []

    def error(self, line: int | None, key: str, message: str) -> Invalid:
        self.errors.append(ConfigError(message, file=self.file, line=line or None, key=key))
        return Invalid()


def line_of(container: Any, key: Any) -> int | None:
    """The line of ``key`` in a LineMap / LineList (None for plain containers or no line)."""
    return fields.line_of(container, key) or None


def type_word(value: Any) -> str:
    """What a value is, in an error message; rule files call every number a number."""
    word = fields.type_word(value)
    return "a number" if word == "an integer" else word


class Section:
    """A mapping being validated: reads keys, reports errors at their lines."""

    def __init__(self, collector: Collector, data: dict[Any, Any], path: str) -> None:
        self.c = collector
        self.data = data
        self.path = path

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def line(self, name: str) -> int | None:
        return line_of(self.data, name)

    def line_of_self(self) -> int | None:
        return self.data.line if isinstance(self.data, LineMap) and self.data.line else None

    def fail(self, name: str, message: str) -> Invalid:
        return self.c.error(self.line(name), self.key(name), message)

    def check_keys(self, allowed: tuple[str, ...]) -> None:
        for name in self.data:
            if name not in allowed:
                self.c.error(line_of(self.data, name), self.key(str(name)),
                             f"unknown key (expected one of: {', '.join(allowed)})")

    def number(self, name: str, default: float | None, *, low: float, high: float | None = None,
               low_open: bool = False, integer: bool = False) -> float | None:
        if name not in self.data or self.data[name] is None:
            return default
        value = self.data[name]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(name, f"must be a number, not {type_word(value)}")
        if integer and (not isinstance(value, int) and not float(value).is_integer()):
            raise self.fail(name, f"must be a whole number, not {value}")
        too_low = value <= low if low_open else value < low
        if too_low or (high is not None and value > high):
            bound = f"> {low:g}" if low_open else f">= {low:g}"
            if high is not None:
                bound = f"between {low:g} and {high:g}"
            raise self.fail(name, f"must be {bound}, not {value}")
        return int(value) if integer else float(value)

    def text(self, name: str, default: str | None, *, choices: tuple[str, ...] | None = None) -> str | None:
        if name not in self.data or self.data[name] is None:
            return default
        value = self.data[name]
        if not isinstance(value, str):
            raise self.fail(name, f"must be a string, not {type_word(value)}")
        if choices is not None and value not in choices:
            raise self.fail(name, f"must be one of {', '.join(choices)}, not {value!r}")
        return value

    def flag(self, name: str, default: bool) -> bool:
        if name not in self.data or self.data[name] is None:
            return default
        value = self.data[name]
        if not isinstance(value, bool):
            raise self.fail(name, f"must be true or false, not {type_word(value)}")
        return value

    def run(self, fn: Callable[[], None]) -> None:
        """Run one field's check; an invalid field is recorded and the others still checked."""
        with contextlib.suppress(Invalid):
            fn()

    def attempt(self, read: Callable[[], V], fallback: V) -> V:
        """``read()``, or ``fallback`` when it found the value wrong (the error is recorded)."""
        try:
            return read()
        except Invalid:
            return fallback

    def missing(self, name: str, message: str = "is required") -> None:
        """Record that the required key ``name`` is absent (at the mapping's own line)."""
        self.c.error(self.line_of_self(), self.key(name), message)

    def refuse(self, message: str) -> None:
        """Record an error about the mapping as a whole."""
        self.c.error(self.line_of_self(), self.path, message)
