"""What the Python API and ``pulsar-tap rules list|add|rm|reset`` raise, on the project's one hierarchy.

:class:`AdminError` carries the admin API's HTTP status and message; its
subclasses name the cases a caller handles differently: the proxy cannot be
reached, the token is missing or wrong (401), no such rule (404), a rule of that
name exists (409), the rule is invalid (400, with every validation message).
:class:`TapError` is anything else a :class:`~proxy.testing.tap.Tap` could not do
(start, stop, capture).
"""

from __future__ import annotations

from proxy.errors import PulsarTapError


class TapError(PulsarTapError):
    """A tap could not be started, stopped or asked something."""


class AdminError(TapError):
    """The admin API refused a call; ``status`` is the HTTP status (0 when it was not reached)."""

    def __init__(self, message: str, *, status: int = 0, errors: list[str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        #: every validation message of a 400 (one per rule error, ``KEY: message``)
        self.errors = errors or [message]


class AdminUnreachable(AdminError):
    """Nothing answers at the admin URL (refused, timed out, not HTTP)."""


class AdminUnauthorized(AdminError):
    """401: the admin API wants ``Authorization: Bearer TOKEN`` and got none or another."""


class RuleNotFound(AdminError):
    """404: no rule of that name is loaded."""


class RuleConflict(AdminError):
    """409: a rule of that name is already loaded."""


class InvalidRule(AdminError):
    """400: the rule (or rules document) does not validate; ``errors`` lists every problem."""


__all__ = ["AdminError", "AdminUnauthorized", "AdminUnreachable", "InvalidRule", "RuleConflict", "RuleNotFound",
           "TapError"]
