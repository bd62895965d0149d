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

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

from proxy.config.fields import Section, type_word
from proxy.config.yaml_lines import LineList, load_file
from proxy.errors import ConfigError
from proxy.protocol.frame import DEFAULT_MAX_FRAME_BYTES

DEFAULT_LISTEN: Final = "127.0.0.1:6650"
DEFAULT_ADMIN_LISTEN: Final = "127.0.0.1:9650"
LOOKUP_MODES: Final = ("rewrite", "proxy-through")
TOP_LEVEL_KEYS: Final = ("listen", "upstream", "advertise", "lookup", "tls", "admin", "record", "tracing",
                         "limits", "rules", "broker_ports", "allowed_brokers")

_HOST_PORT = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9_.\-]+)):(?P<port>\d{1,5})$")
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
        return cls(match["v6"] or match["host"], port)

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


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


def parse_config(data: Any, *, file: str | None = None, base_dir: Path | None = None) -> ProxyConfig:
    """Validate a loaded ``proxy.yaml`` document (a mapping) into a ProxyConfig."""
    top = Section.of(data, file=file, line=1)
    top.check_keys(TOP_LEVEL_KEYS)

    upstream_text = top.string("upstream")
    try:
        upstream = ServiceUrl.parse(upstream_text)
    except ValueError as exc:
        raise top.error("upstream", str(exc)) from None
    listen = _host_port(top, "listen", DEFAULT_LISTEN)
    assert listen is not None
    advertise = top.string("advertise", None)
    lookup = top.choice("lookup", LOOKUP_MODES, "rewrite")

    tls = TlsConfig()
    if (sec := top.section("tls")) is not None:
        sec.check_keys(("cert", "key", "upstream_ca"))
        tls = TlsConfig(_readable_file(sec, "cert", base_dir), _readable_file(sec, "key", base_dir),
                        _readable_file(sec, "upstream_ca", base_dir))
        if (tls.cert is None) != (tls.key is None):
            raise sec.error("key" if tls.key is None else "cert", "tls.cert and tls.key go together")

    admin = None
    if (sec := top.section("admin")) is not None:
        sec.check_keys(("listen", "token_file"))
        admin_listen = _host_port(sec, "listen", DEFAULT_ADMIN_LISTEN)
        assert admin_listen is not None
        admin = AdminConfig(admin_listen, _readable_file(sec, "token_file", base_dir))

    record = None
    if (sec := top.section("record")) is not None:
        sec.check_keys(("dir", "redact", "max_segment_mb", "include_payloads"))
        record = RecordConfig(sec.string("dir", "recordings/"), sec.boolean("redact", True),
                              sec.integer("max_segment_mb", 256, minimum=1),
                              sec.boolean("include_payloads", True))

    tracing = TracingConfig()
    if (sec := top.section("tracing")) is not None:
        sec.check_keys(("exporter", "endpoint", "protocol", "sample"))
        tracing = TracingConfig(sec.choice("exporter", ("none", "console", "otlp"), "none"),
                                sec.string("endpoint", None), sec.choice("protocol", ("http", "grpc"), "http"),
                                float(sec.number("sample", 1.0, minimum=0.0, maximum=1.0)))
        if tracing.endpoint is not None and not re.match(r"^https?://", tracing.endpoint):
            raise sec.error("endpoint", f"{tracing.endpoint!r} is not an http:// or https:// URL")

    limits = LimitsConfig()
    if (sec := top.section("limits")) is not None:
        sec.check_keys(("max_connections", "max_frame_bytes", "verify_checksums", "keepalive_seconds",
                        "drain_seconds"))
        limits = LimitsConfig(
            sec.integer("max_connections", limits.max_connections, minimum=1),
            sec.integer("max_frame_bytes", limits.max_frame_bytes, minimum=1024, maximum=2**31),
            sec.boolean("verify_checksums", False),
            float(sec.number("keepalive_seconds", limits.keepalive_seconds, minimum=0.05)),
            float(sec.number("drain_seconds", limits.drain_seconds, minimum=0.0)),
        )

    rules: str | LineList | list[Any] | None = None
    if top.has("rules"):
        value = top.raw("rules")
        if isinstance(value, str):
            rules_path = Path(value)
            if base_dir is not None and not rules_path.is_absolute():
                rules_path = base_dir / rules_path
            if not rules_path.is_file():
                raise top.error("rules", f"rule file {value!r} is not a readable file")
            rules = str(rules_path)
        elif isinstance(value, list):
            for index, item in enumerate(value):
                if not isinstance(item, dict):
                    line = value.line_of(index) if isinstance(value, LineList) else top.key_line("rules")
                    raise ConfigError(f"a rule must be a mapping, not {type_word(item)}", file=file, line=line,
                                      key=f"rules[{index}]")
            rules = value
        else:
            raise top.error("rules", f"must be a rule file path or a list of rules, not {type_word(value)}")

    broker_ports = None
    if top.has("broker_ports"):
        try:
            broker_ports = parse_broker_ports(str(top.raw("broker_ports")))
        except ValueError as exc:
            raise top.error("broker_ports", str(exc)) from None

    allowed: list[HostPort] = []
    if top.has("allowed_brokers"):
        value = top.raw("allowed_brokers")
        if not isinstance(value, list):
            raise top.error("allowed_brokers", f"must be a list of HOST:PORT, not {type_word(value)}")
        for index, item in enumerate(value):
            try:
                allowed.append(_broker_address(item))
            except ValueError as exc:
                line = value.line_of(index) if isinstance(value, LineList) else top.key_line("allowed_brokers")
                raise ConfigError(str(exc), file=file, line=line, key=f"allowed_brokers[{index}]") from None

    return ProxyConfig(upstream=upstream, listen=listen, advertise=advertise, lookup=lookup, tls=tls,
                       admin=admin, record=record, tracing=tracing, limits=limits, rules=rules,
                       broker_ports=broker_ports, allowed_brokers=tuple(allowed), file=file)


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
