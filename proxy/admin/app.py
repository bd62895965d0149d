"""The admin API as a plain ASGI application (no framework: five routes).

Routes (SPEC.md, "Admin API" and "Admin API bodies"):

- ``GET /healthz`` — liveness, never needs the token: ``{"status": "ok"}`` plus what
  the ``health`` provider adds (the proxy: ``upstream`` reachable | unreachable);
- ``GET /rules`` — ``{"seed": N, "rules": [{"name", "match", "action", "hits"}]}``,
  normalised with defaults filled in;
- ``PUT /rules`` — replace every rule with a rules document (200); ``POST /rules``
  — add one rule (201); bodies are JSON or YAML; a bad body is 400 with the
  validation messages, a name already in use 409;
- ``DELETE /rules/{name}`` — 204, or 404 for an unknown name;
- ``GET /connections`` — what the connections provider returns, as JSON (the proxy:
  per connection its peers, producers, consumers, topics and bytes; per consumer
  ``permits``, the outstanding FLOW permits the client granted, and ``permits_held``,
  the part of them a throttle still holds back from the broker);
- ``GET /metrics`` — Prometheus text: ``pulsar_tap_rule_hits_total{rule="NAME"}``
  plus whatever the metrics provider adds (telemetry plugs in there).

Every call but /healthz needs ``Authorization: Bearer TOKEN`` when a token is
configured (401 otherwise).  Changes go through the engine's atomic replace/add/
remove, so the relay sees either the old rules or the new ones.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable
from typing import Any, Final
from urllib.parse import unquote

import structlog
import yaml

from proxy.asgi import Receive, Scope, Send, answered_outside_http
from proxy.config.yaml_lines import DocumentTooLarge, LineList, LineMap, check_bounds, load_text
from proxy.errors import ConfigError
from proxy.rules.engine import RulesEngine
from proxy.rules.loader import RuleFileError, rule_from_data, ruleset_from_data

#: the largest request body accepted (a rules document is small)
MAX_BODY_BYTES: Final = 1024 * 1024
PROMETHEUS_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"

log = structlog.get_logger("pulsar_tap.admin")


class _HttpError(Exception):
    def __init__(self, status: int, message: str, extra: dict[str, Any] | None = None, *,
                 logged: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.extra = extra or {}
        #: worth a warning in the proxy's log (a body built to hurt, not a mistake in a rule)
        self.logged = logged


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class AdminApp:
    """The ASGI callable; ``connections`` and ``metrics`` are callbacks supplied by the proxy."""

    def __init__(self, engine: RulesEngine, *, token: str | None = None,
                 connections: Callable[[], list[dict[str, Any]]] | None = None,
                 metrics: Callable[[], str] | None = None,
                 health: Callable[[], dict[str, Any]] | None = None) -> None:
        self.engine = engine
        self.health = health
        self.token = token
        self.connections = connections or list
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if await answered_outside_http(scope, receive, send):
            return
        try:
            status, headers, body = await self._handle(scope, receive)
        except _HttpError as exc:
            status, headers = exc.status, [(b"content-type", b"application/json")]
            if exc.status == 401:
                headers.append((b"www-authenticate", b'Bearer realm="pulsar-tap"'))
            body = json.dumps({"error": exc.message, **exc.extra}).encode()
            if exc.logged:
                log.warning("admin request refused", method=scope.get("method"), path=scope.get("path"),
                            reason=exc.message[:500])
        except Exception as exc:  # a bug must answer, and say so in the log, not leave an empty 500
            log.exception("admin request failed", method=scope.get("method"), path=scope.get("path"))
            status, headers = 500, [(b"content-type", b"application/json")]
            body = json.dumps({"error": f"internal error: {type(exc).__name__}"}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    # -- routing ------------------------------------------------------------------------------
    async def _handle(self, scope: Scope, receive: Receive) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        method: str = scope["method"]
        path: str = scope["path"].rstrip("/") or "/"
        if path == "/healthz":
            self._allow(method, ("GET", "HEAD"))
            return self._json(200, {"status": "ok", **(self.health() if self.health is not None else {})})
        self._authorize(scope)
        if path == "/rules":
            self._allow(method, ("GET", "PUT", "POST"))
            if method == "GET":
                return self._json(200, self.rules_body())
            document = self._parse(await self._body(receive), scope)
            if method == "PUT":
                try:
                    ruleset = ruleset_from_data(document, self._file_of(document))
                except RuleFileError as exc:
                    raise self._invalid(exc) from None
                self.engine.replace(ruleset)
                return self._json(200, self.rules_body())
            try:
                rule = rule_from_data(document, self._file_of(document))
            except RuleFileError as exc:
                raise self._invalid(exc) from None
            try:
                self.engine.add(rule)
            except ValueError as exc:
                raise _HttpError(409, str(exc)) from None
            return self._json(201, {**rule.to_data(), "hits": 0})
        if path.startswith("/rules/"):
            self._allow(method, ("DELETE",))
            name = unquote(path[len("/rules/"):])
            if not self.engine.remove(name):
                raise _HttpError(404, f"no rule named {name!r}")
            return 204, [], b""
        if path == "/connections":
            self._allow(method, ("GET",))
            return self._json(200, {"connections": self.connections()})
        if path == "/metrics":
            self._allow(method, ("GET",))
            return 200, [(b"content-type", PROMETHEUS_TYPE.encode())], self.metrics_text().encode()
        raise _HttpError(404, f"no such resource {path}")

    # -- bodies ---------------------------------------------------------------------------------
    def rules_body(self) -> dict[str, Any]:
        return {"seed": self.engine.seed,
                "rules": [{**state.rule.to_data(), "hits": state.hits} for state in self.engine.states()]}

    def metrics_text(self) -> str:
        lines = ["# HELP pulsar_tap_rule_hits_total Frames each rule acted on.",
                 "# TYPE pulsar_tap_rule_hits_total counter"]
        lines += [f'pulsar_tap_rule_hits_total{{rule="{_escape_label(state.rule.name)}"}} {state.hits}'
                  for state in self.engine.states()]
        text = "\n".join(lines) + "\n"
        if self.metrics is not None:
            extra = self.metrics()
            text += extra if not extra or extra.endswith("\n") else extra + "\n"
        return text

    @staticmethod
    def _json(status: int, value: Any) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        return status, [(b"content-type", b"application/json")], json.dumps(value).encode()

    @staticmethod
    def _allow(method: str, allowed: tuple[str, ...]) -> None:
        if method not in allowed:
            raise _HttpError(405, f"method {method} not allowed (allowed: {', '.join(allowed)})")

    def _authorize(self, scope: Scope) -> None:
        if self.token is None:
            return
        given = b""
        for name, value in scope.get("headers", []):
            if name.lower() == b"authorization":
                given = value
        expected = b"Bearer " + self.token.encode()
        if not hmac.compare_digest(given, expected):
            raise _HttpError(401, "missing or wrong bearer token")

    @staticmethod
    async def _body(receive: Receive) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _HttpError(400, "client went away")
            chunk: bytes = message.get("body", b"")
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise _HttpError(413, f"body larger than {MAX_BODY_BYTES} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    @staticmethod
    def _parse(body: bytes, scope: Scope) -> Any:
        content_type = ""
        for name, value in scope.get("headers", []):
            if name.lower() == b"content-type":
                content_type = value.decode("latin-1").lower()
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            raise _HttpError(400, "body is not UTF-8") from None
        if not text.strip():
            raise _HttpError(400, "empty body: send a rule (POST) or a rules document (PUT) as JSON or YAML")
        if "json" in content_type:
            try:
                document = json.loads(text)
            except json.JSONDecodeError as exc:
                raise _HttpError(400, f"body: json: {exc}") from None
            except RecursionError:
                raise _HttpError(400, "body: json: nested too deeply", logged=True) from None
            try:
                check_bounds(document, "body")
            except ConfigError as exc:
                raise _HttpError(400, exc.format(), logged=True) from None
            return document
        try:
            return load_text(text, "body")  # YAML is a superset of JSON: either works
        except DocumentTooLarge as exc:
            raise _HttpError(400, exc.format(), logged=True) from None
        except (ConfigError, yaml.YAMLError) as exc:
            raise _HttpError(400, exc.format() if isinstance(exc, ConfigError) else str(exc)) from None

    @staticmethod
    def _file_of(document: Any) -> str | None:
        """YAML bodies have lines, reported as ``body:LINE``; JSON bodies only keys."""
        return "body" if isinstance(document, LineMap | LineList) else None

    @staticmethod
    def _invalid(exc: RuleFileError) -> _HttpError:
        errors = [error.format() for error in exc.errors]
        return _HttpError(400, "; ".join(errors), {"errors": errors})
