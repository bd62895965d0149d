"""Structured logs: structlog, JSON or console, levels, context binding, and secret redaction.

:func:`configure_logging` sets structlog up once for the process: ``fmt`` is
``json`` (one object per line, for log shippers) or ``console`` (aligned, for
people); ``level`` filters by name (debug, info, warning, error, critical).
:func:`writes` tells whether a line at a level would be written, before its fields are gathered.
:func:`connection_context` binds a connection id (and topic, client, broker) to
every log line emitted inside it, through contextvars, so each task of a
connection logs with its identity.

:func:`redact_secrets` is a processor that runs before rendering: values under keys
that name a secret (auth data, tokens, passwords, keys, credentials,
authorization, cookies — at any depth of dicts and lists) become ``[REDACTED]``, and
secrets embedded in free text (``Bearer ...``, ``token=...``, JWTs, basic-auth
URLs) are masked, so no code path can leak them into logs.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any, Final, TextIO

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

from proxy.errors import ConfigError

REDACTED: Final = "[REDACTED]"
FORMATS: Final = ("json", "console")
LEVELS: Final = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
                 "error": logging.ERROR, "critical": logging.CRITICAL}

#: Key names (normalised: lower case, no separators) that hold secrets.
_SECRET_KEY: Final = re.compile(
    r"(auth(data|method)?|authdata|authentication|authorization|token|secret|passw(or)?d|passphrase|"
    r"credential|apikey|privatekey|accesskey|sessionkey|cookie|bearer|signature|jwt|"
    r"originalauth|clientsecret)", re.IGNORECASE)
#: Keys that look secret by the pattern above but are not (they name, not hold, the secret).
_NOT_SECRET: Final = frozenset({"authmethodname", "originalauthmethod", "authmethod", "tokenfile"})
_TEXT_SECRETS: Final = (
    (re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]+"), r"\1 " + REDACTED),
    (re.compile(r"(?i)\b(token|secret|password|passwd|api[_-]?key|auth[_-]?data|authorization)"
                r"(\s*[=:]\s*)(\"[^\"]*\"|'[^']*'|[^\s,;&]+)"), r"\1\2" + REDACTED),
    (re.compile(r"\beyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]*"), REDACTED),
    (re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^/\s:@]+:)[^@\s/]+@"), r"\1" + REDACTED + "@"),
)
_MAX_DEPTH: Final = 8


def is_secret_key(key: object) -> bool:
    if not isinstance(key, str):
        return False
    normalised = re.sub(r"[^a-z0-9]", "", key.lower())
    return normalised not in _NOT_SECRET and _SECRET_KEY.search(normalised) is not None


def redact_text(text: str) -> str:
    for pattern, replacement in _TEXT_SECRETS:
        text = pattern.sub(replacement, text)
    return text


def _redact(value: Any, depth: int = 0) -> Any:
    if depth > _MAX_DEPTH:
        return REDACTED
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return f"<{len(value)} bytes>"
    if isinstance(value, Mapping):
        return {k: REDACTED if is_secret_key(k) else _redact(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_redact(v, depth + 1) for v in value]
    if isinstance(value, int | float | bool) or value is None:
        return value
    return redact_text(repr(value))


def redact_secrets(logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
    """structlog processor: masks secrets in every key and value (see the module docstring)."""
    del logger, method_name
    for key in list(event_dict):
        if is_secret_key(key):
            event_dict[key] = REDACTED
        else:
            event_dict[key] = _redact(event_dict[key])
    return event_dict


def configure_logging(fmt: str = "console", level: str = "info", stream: TextIO | None = None) -> None:
    """Set up structlog for the process (idempotent: a later call replaces the setup)."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown log format {fmt!r}; expected json or console", key="log.format")
    if level.lower() not in LEVELS:
        raise ConfigError(f"unknown log level {level!r}; expected one of {', '.join(LEVELS)}", key="log.level")
    renderer: Processor = (structlog.processors.JSONRenderer(sort_keys=True) if fmt == "json"
                           else structlog.dev.ConsoleRenderer(colors=False))
    processors: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        redact_secrets,
        renderer,
    ]
    wrapper = structlog.make_filtering_bound_logger(LEVELS[level.lower()])
    structlog.configure(
        processors=processors,
        wrapper_class=wrapper,
        logger_factory=structlog.PrintLoggerFactory(stream if stream is not None else sys.stderr),
        cache_logger_on_first_use=False,
    )
    global _configured
    _configured = (wrapper, LEVELS[level.lower()])


#: the wrapper class :func:`configure_logging` installed last, and its level (None: never called)
_configured: tuple[type, int] | None = None


def writes(level: str) -> bool:
    """Whether a line at ``level`` (debug, info, ...) is written under the setup :func:`configure_logging` made.

    A module's logger binds a logger anew at each call, filtered out or not (~4 us): a line that a connection
    logs every time, at a level usually filtered out, asks this first.  True whenever structlog was set up
    otherwise since (a test's own setup filters what it filters).
    """
    if _configured is None:
        return True
    wrapper, least = _configured
    return LEVELS[level] >= least or structlog.get_config()["wrapper_class"] is not wrapper


@contextmanager
def connection_context(conn_id: int, **fields: Any) -> Iterator[None]:
    """Bind ``conn`` (and e.g. ``topic``, ``client``, ``broker``) to log lines emitted inside."""
    bound: MutableMapping[str, Any] = {"conn": conn_id, **{k: v for k, v in fields.items() if v is not None}}
    with structlog.contextvars.bound_contextvars(**bound):
        yield
