"""A client for a running proxy's admin API (SPEC.md, "Admin API"), on the standard library's HTTP.

:class:`AdminClient` is what users would otherwise write by hand over HTTP: list,
add, remove and replace rules, read hit counts, connections and /metrics.  Every
refusal becomes one :class:`~proxy.testing.errors.AdminError` subclass with a
one-line message (401 :class:`AdminUnauthorized`, 404 :class:`RuleNotFound`, 409
:class:`RuleConflict`, 400 :class:`InvalidRule` with every validation message), and
a proxy that does not answer becomes :class:`AdminUnreachable`.  Rules are given as
:class:`~proxy.testing.faults.Fault` builders or as plain mappings in the rule
language; :meth:`AdminClient.inject` adds one for a ``with`` block.

``url`` is ``http://HOST:PORT`` (``HOST:PORT`` alone is taken as http); the token,
when the proxy has one (``admin.token_file``), is sent as ``Authorization: Bearer``.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import quote, urlsplit

from proxy.testing.errors import (
    AdminError,
    AdminUnauthorized,
    AdminUnreachable,
    InvalidRule,
    RuleConflict,
    RuleNotFound,
)
from proxy.testing.faults import Fault

if TYPE_CHECKING:
    from proxy.testing.injection import Injection

DEFAULT_TIMEOUT: Final = 10.0
_STATUS_ERRORS: Final[dict[int, type[AdminError]]] = {401: AdminUnauthorized, 404: RuleNotFound,
                                                      409: RuleConflict, 400: InvalidRule}

RuleLike = Fault | Mapping[str, Any]

#: no proxies from the environment (http_proxy...): the admin API is reached directly
_OPENER: Final = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(frozen=True, slots=True)
class RuleStatus:
    """A loaded rule as ``GET /rules`` reports it: normalised, defaults filled in, with its hit count."""

    name: str
    match: dict[str, Any]
    action: dict[str, Any]
    hits: int

    @property
    def action_name(self) -> str:
        return next(iter(self.action), "")

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RuleStatus:
        return cls(str(data["name"]), dict(data.get("match") or {}), dict(data.get("action") or {}),
                   int(data.get("hits", 0)))

    def to_rule(self) -> dict[str, Any]:
        return {"name": self.name, "match": self.match, "action": self.action}


def admin_base_url(url: str) -> str:
    """``http://HOST:PORT`` from what users write (``HOST:PORT``, ``http://HOST:PORT/``); ValueError if neither."""
    text = url.strip()
    if "://" not in text:
        text = "http://" + text
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an admin URL (http://HOST:PORT)")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{url!r} has a bad port") from None
    if port is None:
        raise ValueError(f"{url!r} names no port (http://HOST:PORT)")
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"


def read_token_file(path: str | Path) -> str:
    """The bearer token in ``path`` (surrounding whitespace removed); TapError-derived errors name the file."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise AdminError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not token:
        raise AdminError(f"{path}: the token file is empty")
    return token


def rule_data(rule: RuleLike, name: str | None = None) -> dict[str, Any]:
    """A rule for the admin API from a fault builder (validated) or a mapping (sent as it is)."""
    if isinstance(rule, Fault):
        return rule.to_rule(name)
    data = dict(rule)
    if name is not None:
        data["name"] = name
    return data


class AdminClient:
    """Talks to one proxy's admin API; see the module docstring."""

    def __init__(self, url: str, token: str | None = None, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.url = admin_base_url(url)
        self.token = token
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"AdminClient({self.url!r})"

    # -- rules --------------------------------------------------------------------------------------------
    def rules(self) -> list[RuleStatus]:
        """The loaded rules in evaluation order, with their hit counts."""
        return [RuleStatus.from_json(rule) for rule in self._json("GET", "/rules")["rules"]]

    def seed(self) -> int:
        """The seed probabilities are drawn from (the rule file's, or chosen at start)."""
        return int(self._json("GET", "/rules")["seed"])

    def rule(self, name: str) -> RuleStatus:
        """One rule by name; :class:`RuleNotFound` when it is not loaded."""
        for rule in self.rules():
            if rule.name == name:
                return rule
        raise RuleNotFound(f"no rule named {name!r}", status=404)

    def hits(self) -> dict[str, int]:
        """Hits per rule name."""
        return {rule.name: rule.hits for rule in self.rules()}

    def add_rule(self, rule: RuleLike, *, name: str | None = None) -> RuleStatus:
        """Add one rule after the others (``POST /rules``); 409 :class:`RuleConflict` if the name is taken."""
        return RuleStatus.from_json(self._json("POST", "/rules", rule_data(rule, name)))

    def remove_rule(self, name: str) -> None:
        """Remove a rule (``DELETE /rules/NAME``); :class:`RuleNotFound` if there is none."""
        self._request("DELETE", "/rules/" + quote(name, safe=""))

    def replace_rules(self, rules: Sequence[RuleLike] = (), *, seed: int | None = None) -> list[RuleStatus]:
        """Put exactly ``rules`` in force at once (``PUT /rules``); the seed is kept unless given."""
        document: dict[str, Any] = {"rules": [rule_data(rule) for rule in rules]}
        if seed is not None:
            document["seed"] = seed
        return [RuleStatus.from_json(rule) for rule in self._json("PUT", "/rules", document)["rules"]]

    def reset(self) -> None:
        """Remove every rule (the seed is kept)."""
        self.replace_rules([])

    def inject(self, fault: Fault, *, name: str | None = None) -> Injection:
        """``fault`` for the duration of a ``with`` block (or of a decorated function); see ``Injection``."""
        from proxy.testing.injection import Injection

        return Injection(self, fault, name=name)

    # -- the rest ---------------------------------------------------------------------------------------------
    def healthy(self) -> bool:
        """True when the admin API answers ``GET /healthz``."""
        try:
            self._request("GET", "/healthz")
        except AdminError:
            return False
        return True

    def connections(self) -> list[dict[str, Any]]:
        """``GET /connections``: peers, producers, consumers, topics, bytes and permits per connection."""
        connections: list[dict[str, Any]] = self._json("GET", "/connections")["connections"]
        return connections

    def metrics(self) -> str:
        """``GET /metrics`` as Prometheus text."""
        return self._request("GET", "/metrics").decode("utf-8")

    # -- HTTP -------------------------------------------------------------------------------------------------
    def _json(self, method: str, path: str, body: Any = None) -> Any:
        data = self._request(method, path, body)
        try:
            return json.loads(data)
        except ValueError:
            raise AdminError(f"{method} {self.url}{path}: the answer is not JSON") from None

    def _request(self, method: str, path: str, body: Any = None) -> bytes:
        headers = {"Accept": "application/json"}
        payload = None
        if body is not None:
            payload = json.dumps(body).encode("utf-8")
            headers["Content-Type"] = "application/json"
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(self.url + path, data=payload, headers=headers, method=method)
        try:
            with _OPENER.open(request, timeout=self.timeout) as response:
                answer: bytes = response.read()
                return answer
        except urllib.error.HTTPError as exc:
            raise _refusal(exc, method, path) from None
        except (TimeoutError, urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            text = getattr(reason, "strerror", None) or str(reason)
            raise AdminUnreachable(f"cannot reach the admin API at {self.url}: {text}") from None


def _refusal(exc: urllib.error.HTTPError, method: str, path: str) -> AdminError:
    try:
        body = json.loads(exc.read() or b"{}")
    except ValueError:
        body = {}
    message = str(body.get("error") or exc.reason or f"HTTP {exc.code}")
    errors = body.get("errors")
    cls = _STATUS_ERRORS.get(exc.code, AdminError)
    if exc.code not in _STATUS_ERRORS:
        message = f"{method} {path}: HTTP {exc.code}: {message}"
    return cls(message, status=exc.code, errors=[str(e) for e in errors] if isinstance(errors, list) else None)


__all__ = ["AdminClient", "RuleLike", "RuleStatus", "admin_base_url", "read_token_file", "rule_data"]
