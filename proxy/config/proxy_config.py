"""``proxy.yaml``: every key SPEC.md fixes, validated, plus the same settings as flags.

Keys (SPEC.md, "Proxy configuration"): ``listen``, ``upstream``, ``advertise``,
``lookup`` (rewrite | proxy-through), ``tls`` {cert, key, upstream_ca}, ``admin``
{listen, token_file}, ``record`` {dir, redact, max_segment_mb, include_payloads},
``tracing`` {exporter, endpoint, protocol, sample}, ``limits`` {max_connections,
max_frame_bytes, verify_checksums, keepalive_seconds, drain_seconds}, ``rules`` (a
file or an inline list), ``broker_ports`` (START-END) and ``allowed_brokers`` (the
proxy-through allow-list).  Sections other parts of pulsar-tap act on (record,
tracing, rules) are validated here for shape and kept for them.  Flags given to
``pulsar-tap run`` override the file.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final, TypeVar

from proxy.config.fields import Section, type_word
from proxy.config.yaml_lines import LineList, load_file
from proxy.errors import ConfigError, ConfigErrors
from proxy.protocol.frame import DEFAULT_MAX_FRAME_BYTES

T = TypeVar("T")

DEFAULT_LISTEN: Final = "127.0.0.1:6650"
DEFAULT_ADMIN_LISTEN: Final = "127.0.0.1:9650"
LOOKUP_MODES: Final = ("rewrite", "proxy-through")
TOP_LEVEL_KEYS: Final = ("listen", "upstream", "advertise", "lookup", "tls", "admin", "record", "tracing",
                         "limits", "rules", "broker_ports", "allowed_brokers")

_HOST_PORT = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9_.\-]+)):(?P<port>\d{1,5})$")
#: a host of digits and dots only must be a whole dotted IPv4 address
_NUMERIC_HOST = re.compile(r"[0-9.]+")
_SERVICE_URL = re.compile(r"^(?P<scheme>pulsar|pulsar\+ssl)://(?P<rest>[^/?#]+)/?$")


@dataclass(frozen=True)
class HostPort:
    """A host and a TCP port (``127.0.0.1:6650``, ``[::1]:6650``)."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> HostPort:
        """Parse HOST:PORT; raises ValueError with a readable reason."""
        match = _HOST_PORT.match(text.strip())
        if match is None:
            raise ValueError(f"{text!r} is not HOST:PORT")
        port = int(match["port"])
        if not 0 <= port <= 65535:
            raise ValueError(f"port {port} is out of range")
        host = match["v6"] or match["host"]
        try:
            if match["v6"]:
                ipaddress.IPv6Address(host)
            elif _NUMERIC_HOST.fullmatch(host):
                # (the resolver would take '1' as 0.0.0.1 and '10.0.0' as 10.0.0.0: a typo dialled elsewhere)
                ipaddress.IPv4Address(host)
        except ValueError:
            raise ValueError(f"{host!r} is not an IP address (a.b.c.d, [v6]) nor a host name") from None
        return cls(host, port)

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        """Only this machine can connect (127.0.0.0/8, ::1, localhost); a name or 0.0.0.0 is not."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


@dataclass(frozen=True)
class ServiceUrl:
    """A Pulsar service URL naming one host: ``pulsar://h:6650`` or ``pulsar+ssl://h:6651``."""

    tls: bool
    address: HostPort

    @classmethod
    def parse(cls, text: str) -> ServiceUrl:
        match = _SERVICE_URL.match(text.strip())
        if match is None:
            raise ValueError(f"{text!r} is not a pulsar:// or pulsar+ssl:// URL")
        tls = match["scheme"] == "pulsar+ssl"
        rest = match["rest"]
        if "," in rest:
            raise ValueError(f"{text!r} names several hosts; give one")
        if not re.search(r":\d+$", rest):
            rest = f"{rest}:{6651 if tls else 6650}"
        return cls(tls, HostPort.parse(rest))

    def __str__(self) -> str:
        return f"{'pulsar+ssl' if self.tls else 'pulsar'}://{self.address}"


@dataclass(frozen=True)
class TlsConfig:
    cert: str | None = None
    key: str | None = None
    upstream_ca: str | None = None

    @property
    def serves_tls(self) -> bool:
        """Clients reach the proxy over TLS (a certificate and key are configured)."""
        return self.cert is not None


@dataclass(frozen=True)
class AdminConfig:
    listen: HostPort
    token_file: str | None = None
    #: serve a non-loopback address with no token (whoever reaches it may change the rules)
    insecure: bool = False


@dataclass(frozen=True)
class RecordConfig:
    dir: str
    redact: bool = True
    max_segment_mb: int = 256
    include_payloads: bool = True


@dataclass(frozen=True)
class TracingConfig:
    exporter: str = "none"
    endpoint: str | None = None
    protocol: str = "http"
    sample: float = 1.0


@dataclass(frozen=True)
class LimitsConfig:
    max_connections: int = 10000
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    verify_checksums: bool = False
    #: a side silent this long gets a PING from the proxy; silent twice as long, it is dead
    keepalive_seconds: float = 30.0
    #: on SIGTERM/SIGINT, how long in-flight frames may drain before connections close
    drain_seconds: float = 5.0


@dataclass(frozen=True)
class ProxyConfig:
    """The validated settings of one ``pulsar-tap run``."""

    upstream: ServiceUrl
    listen: HostPort = field(default_factory=lambda: HostPort.parse(DEFAULT_LISTEN))
    advertise: str | None = None
    lookup: str = "rewrite"
    tls: TlsConfig = field(default_factory=TlsConfig)
    admin: AdminConfig | None = None
    record: RecordConfig | None = None
    tracing: TracingConfig = field(default_factory=TracingConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    #: a rule file path, or an inline list of rules (kept as loaded, with its lines)
    rules: str | LineList | list[Any] | None = None
    broker_ports: tuple[int, int] | None = None
    allowed_brokers: tuple[HostPort, ...] = ()
    #: the file the settings came from (None: flags only); rule errors name it
    file: str | None = None

    @property
    def advertised_host(self) -> str:
        """The host written into rewritten lookups (``advertise``, else the listen host)."""
        if self.advertise:
            return self.advertise
        if self.listen.host in ("0.0.0.0", "::", ""):
            return "127.0.0.1"
        return self.listen.host


def _host_port(section: Section, key: str, default: str | None = None) -> HostPort | None:
    text = section.string(key, default)
    if text is None:
        return None
    try:
        return HostPort.parse(text)
    except ValueError as exc:
        raise section.error(key, str(exc)) from None


def _readable_file(section: Section, key: str, base: Path | None) -> str | None:
    path = section.string(key, None)
    if path is None:
        return None
    resolved = Path(path) if base is None or Path(path).is_absolute() else base / path
    if not resolved.is_file():
        raise section.error(key, f"{path!r} is not a readable file")
    return str(resolved)


def parse_broker_ports(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"\s*(\d{1,5})\s*-\s*(\d{1,5})\s*", text)
    if match is None:
        raise ValueError(f"{text!r} is not START-END")
    start, end = int(match[1]), int(match[2])
    if not 1 <= start <= end <= 65535:
        raise ValueError(f"{text!r} is not a port range with 1 <= START <= END <= 65535")
    return start, end


class _Errors:
    """Collects every ConfigError of a document, so all of them are reported at once."""

    def __init__(self) -> None:
        self.errors: list[ConfigError] = []

    def attempt(self, fn: Callable[[], T], default: T) -> T:
        """``fn()``, or ``default`` once its error is recorded."""
        try:
            return fn()
        except ConfigErrors as exc:
            self.errors.extend(exc.errors)
        except ConfigError as exc:
            self.errors.append(exc)
        return default

    def section(self, parent: Section, key: str, keys: tuple[str, ...]) -> Section | None:
        """The sub-section ``key`` (its unknown keys recorded), or None when absent or not a mapping."""
        sec = self.attempt(lambda: parent.section(key), None)
        if sec is not None:
            self.attempt(lambda: sec.check_keys(keys), None)
        return sec


def parse_config(data: Any, *, file: str | None = None, base_dir: Path | None = None) -> ProxyConfig:
    """Validate a loaded ``proxy.yaml`` document (a mapping) into a ProxyConfig.

    Every error is collected: one raises as a ConfigError, several as ConfigErrors
    (in line order), so a user fixes them all in one go.
    """
    top = Section.of(data, file=file, line=1)
    c = _Errors()
    c.attempt(lambda: top.check_keys(TOP_LEVEL_KEYS), None)

    def upstream_url() -> ServiceUrl:
        text = top.string("upstream")
        try:
            return ServiceUrl.parse(text)
        except ValueError as exc:
            raise top.error("upstream", str(exc)) from None

    upstream = c.attempt(upstream_url, None)
    listen = c.attempt(lambda: _host_port(top, "listen", DEFAULT_LISTEN), None)
    advertise = c.attempt(lambda: top.string("advertise", None), None)
    lookup = c.attempt(lambda: top.choice("lookup", LOOKUP_MODES, "rewrite"), "rewrite")

    tls = TlsConfig()
    if (sec := c.section(top, "tls", ("cert", "key", "upstream_ca"))) is not None:
        tls_section = sec

        def tls_file(key: str) -> str | None:
            return c.attempt(lambda: _readable_file(tls_section, key, base_dir), None)

        tls = TlsConfig(tls_file("cert"), tls_file("key"), tls_file("upstream_ca"))
        if (tls_section.has("cert")) != (tls_section.has("key")):
            c.errors.append(tls_section.error("key" if not tls_section.has("key") else "cert",
                                              "tls.cert and tls.key go together"))

    admin = None
    if (sec := c.section(top, "admin", ("listen", "token_file", "insecure"))) is not None:
        admin_section = sec
        admin_listen = c.attempt(lambda: _host_port(admin_section, "listen", DEFAULT_ADMIN_LISTEN), None)
        token_file = c.attempt(lambda: _readable_file(admin_section, "token_file", base_dir), None)
        insecure = c.attempt(lambda: admin_section.boolean("insecure", False), False)
        if admin_listen is not None:
            admin = AdminConfig(admin_listen, token_file, insecure)
            if not admin_listen.is_loopback and token_file is None and not insecure \
                    and "token_file" not in admin_section.data:
                c.errors.append(admin_section.error(
                    "listen", f"{admin_listen} is reachable from other machines and the admin API has no token: "
                              "set admin.token_file (--admin-token-file), or admin.insecure: true "
                              "(--insecure-admin) to let anyone who reaches it change the rules"))

    record = None
    if (sec := c.section(top, "record", ("dir", "redact", "max_segment_mb", "include_payloads"))) is not None:
        rec = sec
        record = RecordConfig(c.attempt(lambda: rec.string("dir", "recordings/"), "recordings/"),
                              c.attempt(lambda: rec.boolean("redact", True), True),
                              c.attempt(lambda: rec.integer("max_segment_mb", 256, minimum=1), 256),
                              c.attempt(lambda: rec.boolean("include_payloads", True), True))

    tracing = TracingConfig()
    if (sec := c.section(top, "tracing", ("exporter", "endpoint", "protocol", "sample"))) is not None:
        tr = sec
        tracing = TracingConfig(
            c.attempt(lambda: tr.choice("exporter", ("none", "console", "otlp"), "none"), "none"),
            c.attempt(lambda: tr.string("endpoint", None), None),
            c.attempt(lambda: tr.choice("protocol", ("http", "grpc"), "http"), "http"),
            float(c.attempt(lambda: tr.number("sample", 1.0, minimum=0.0, maximum=1.0), 1.0)))
        if tracing.endpoint is not None and not re.match(r"^https?://", tracing.endpoint):
            c.errors.append(tr.error("endpoint", f"{tracing.endpoint!r} is not an http:// or https:// URL"))

    limits = LimitsConfig()
    if (sec := c.section(top, "limits", ("max_connections", "max_frame_bytes", "verify_checksums",
                                          "keepalive_seconds", "drain_seconds"))) is not None:
        lim, d = sec, LimitsConfig()
        limits = LimitsConfig(
            c.attempt(lambda: lim.integer("max_connections", d.max_connections, minimum=1), d.max_connections),
            c.attempt(lambda: lim.integer("max_frame_bytes", d.max_frame_bytes, minimum=1024, maximum=2**31),
                      d.max_frame_bytes),
            c.attempt(lambda: lim.boolean("verify_checksums", False), False),
            float(c.attempt(lambda: lim.number("keepalive_seconds", d.keepalive_seconds, minimum=0.05),
                            d.keepalive_seconds)),
            float(c.attempt(lambda: lim.number("drain_seconds", d.drain_seconds, minimum=0.0), d.drain_seconds)),
        )

    rules = c.attempt(lambda: _rules(top, file, base_dir), None)
    broker_ports = c.attempt(lambda: _broker_ports(top), None)
    no_brokers: tuple[HostPort, ...] = ()
    allowed = c.attempt(lambda: _allowed_brokers(top, file), no_brokers)

    ConfigErrors.raise_if_any(sorted(c.errors, key=lambda error: error.line or 0))
    assert upstream is not None and listen is not None
    return ProxyConfig(upstream=upstream, listen=listen, advertise=advertise, lookup=lookup, tls=tls,
                       admin=admin, record=record, tracing=tracing, limits=limits, rules=rules,
                       broker_ports=broker_ports, allowed_brokers=allowed, file=file)


def _rules(top: Section, file: str | None, base_dir: Path | None) -> str | LineList | list[Any] | None:
    if not top.has("rules"):
        return None
    value = top.raw("rules")
    if isinstance(value, str):
        rules_path = Path(value)
        if base_dir is not None and not rules_path.is_absolute():
            rules_path = base_dir / rules_path
        if not rules_path.is_file():
            raise top.error("rules", f"rule file {value!r} is not a readable file")
        return str(rules_path)
    if isinstance(value, list):
        errors = []
        for index, item in enumerate(value):
            if not isinstance(item, dict):
                line = value.line_of(index) if isinstance(value, LineList) else top.key_line("rules")
                errors.append(ConfigError(f"a rule must be a mapping, not {type_word(item)}", file=file, line=line,
                                          key=f"rules[{index}]"))
        ConfigErrors.raise_if_any(errors)
        return value
    raise top.error("rules", f"must be a rule file path or a list of rules, not {type_word(value)}")


def _broker_ports(top: Section) -> tuple[int, int] | None:
    if not top.has("broker_ports"):
        return None
    try:
        return parse_broker_ports(str(top.raw("broker_ports")))
    except ValueError as exc:
        raise top.error("broker_ports", str(exc)) from None


def _allowed_brokers(top: Section, file: str | None) -> tuple[HostPort, ...]:
    if not top.has("allowed_brokers"):
        return ()
    value = top.raw("allowed_brokers")
    if not isinstance(value, list):
        raise top.error("allowed_brokers", f"must be a list of HOST:PORT, not {type_word(value)}")
    allowed: list[HostPort] = []
    errors: list[ConfigError] = []
    for index, item in enumerate(value):
        try:
            allowed.append(_broker_address(item))
        except ValueError as exc:
            line = value.line_of(index) if isinstance(value, LineList) else top.key_line("allowed_brokers")
            errors.append(ConfigError(str(exc), file=file, line=line, key=f"allowed_brokers[{index}]"))
    ConfigErrors.raise_if_any(errors)
    return tuple(allowed)


def _broker_address(item: Any) -> HostPort:
    """An allow-list entry: ``HOST:PORT`` or a pulsar:// URL."""
    if not isinstance(item, str):
        raise ValueError(f"must be HOST:PORT or a pulsar:// URL, not {type_word(item)}")
    if "://" in item:
        return ServiceUrl.parse(item).address
    return HostPort.parse(item)


def load_config(path: str | Path) -> ProxyConfig:
    """Load and validate a ``proxy.yaml`` file."""
    data = load_file(path)
    return parse_config(data, file=str(path), base_dir=Path(path).resolve().parent)


def with_overrides(config: ProxyConfig, **overrides: Any) -> ProxyConfig:
    """A copy of ``config`` with the given (already validated) fields replaced."""
    return replace(config, **{k: v for k, v in overrides.items() if v is not None})
