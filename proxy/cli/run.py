"""``pulsar-tap run``: run the proxy from ``proxy.yaml`` and/or flags.

Flags override the file.  Prints ``ready: listening on HOST:PORT`` once accepting
(``--ready-file`` also writes ``{"listen": [...], "admin": ...}``), and exits 0 on
SIGINT/SIGTERM after draining (a second signal cuts the drain short), saying on
stderr what it served: the connections, each rule's hits, the frames recorded and
any the recording dropped.  A config
the proxy refuses is one line per error, ``FILE:LINE: KEY: message`` (or
``--flag: message``), and exit status 2; so is a busy --listen or --admin port.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from proxy.wording import counted

if TYPE_CHECKING:
    from proxy.server.stack import ProxyStack

NAME = "run"
#: a server process: numpy's BLAS keeps to one thread (see proxy.native_threads)
ONE_THREAD = True
HELP = "run the proxy"
DESCRIPTION = """\
Run the Pulsar proxy: clients connect to --listen, traffic goes to --upstream.
Settings come from proxy.yaml (-c) and/or flags; flags win.

The upstream is probed at start and then every few seconds: when it does not
answer (nothing listening, or pulsar+ssl:// aimed at a plaintext port) a warning
is logged and the proxy serves anyway; GET /healthz reports "upstream":
"reachable" or "unreachable", and the log says when it comes back.

The admin API (--admin) binds loopback unless told otherwise.  Another address
needs a bearer token (--admin-token-file, admin.token_file) or --insecure-admin
(admin.insecure: true).  Either way it starts with a warning: with no token
anyone who reaches it can change the rules; with one, the admin API is plain
HTTP, so the token is readable by whoever sees the traffic.

examples:
  pulsar-tap run --listen 127.0.0.1:6650 --upstream pulsar://broker:6650
  pulsar-tap run -c proxy.yaml
  pulsar-tap run -c proxy.yaml --lookup proxy-through --ready-file /tmp/ready.json
  pulsar-tap run --upstream pulsar://broker:6650 --rules rules/slow-broker.yaml --record recordings/ \\
      --admin 127.0.0.1:9650
  pulsar-tap run --upstream pulsar://broker:6650 --admin 0.0.0.0:9650 --admin-token-file token.txt
"""
EPILOG = """\
exit status:
  0    stopped by SIGINT/SIGTERM after draining (a second signal cuts the drain short)
  2    bad arguments, a config or rule file it refuses (every error listed), a busy port
"""

#: flag destination -> (config key path, flag as written)
_FLAG_KEYS: dict[str, tuple[tuple[str, ...], str]] = {
    "listen": (("listen",), "--listen"),
    "upstream": (("upstream",), "--upstream"),
    "advertise": (("advertise",), "--advertise"),
    "lookup": (("lookup",), "--lookup"),
    "rules": (("rules",), "--rules"),
    "record": (("record", "dir"), "--record"),
    "admin": (("admin", "listen"), "--admin"),
    "admin_token_file": (("admin", "token_file"), "--admin-token-file"),
    "insecure_admin": (("admin", "insecure"), "--insecure-admin"),
    "tls_cert": (("tls", "cert"), "--tls-cert"),
    "tls_key": (("tls", "key"), "--tls-key"),
    "tls_upstream_ca": (("tls", "upstream_ca"), "--tls-upstream-ca"),
    "max_connections": (("limits", "max_connections"), "--max-connections"),
    "max_frame_bytes": (("limits", "max_frame_bytes"), "--max-frame-bytes"),
    "verify_checksums": (("limits", "verify_checksums"), "--verify-checksums"),
    "keepalive_seconds": (("limits", "keepalive_seconds"), "--keepalive-seconds"),
    "drain_seconds": (("limits", "drain_seconds"), "--drain-seconds"),
    "broker_ports": (("broker_ports",), "--broker-ports"),
    "allow_broker": (("allowed_brokers",), "--allow-broker"),
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--config", metavar="FILE", help="proxy.yaml (keys as in SPEC.md; flags override it)")
    parser.add_argument("--listen", metavar="HOST:PORT", help="where clients connect (default 127.0.0.1:6650)")
    parser.add_argument("--upstream", metavar="URL", help="the cluster's service URL, pulsar:// or pulsar+ssl://")
    parser.add_argument("--advertise", metavar="HOST", help="host written into rewritten lookups")
    parser.add_argument("--lookup", choices=("rewrite", "proxy-through"), help="lookup mode (default rewrite)")
    parser.add_argument("--rules", metavar="FILE", help="rule file")
    parser.add_argument("--record", metavar="DIR", help="record traffic under DIR")
    parser.add_argument("--admin", metavar="HOST:PORT",
                        help="serve the admin API and /metrics (not loopback: needs a token or --insecure-admin)")
    parser.add_argument("--admin-token-file", metavar="FILE", help="bearer token the admin API requires")
    parser.add_argument("--insecure-admin", action="store_true", default=None,
                        help="allow a non-loopback --admin without a token")
    parser.add_argument("--tls-cert", metavar="FILE", help="certificate served to clients (enables TLS)")
    parser.add_argument("--tls-key", metavar="FILE", help="private key of --tls-cert")
    parser.add_argument("--tls-upstream-ca", metavar="FILE", help="CA bundle that verifies the brokers")
    parser.add_argument("--max-connections", type=int, metavar="N",
                        help="client connections served at once; more are closed at accept (default 10000)")
    parser.add_argument("--max-frame-bytes", type=int, metavar="BYTES",
                        help="largest frame before CONNECTED; later the broker's max_message_size + 10 KiB "
                             "(default 5 MiB + 10 KiB)")
    parser.add_argument("--verify-checksums", action="store_true", default=None,
                        help="answer SENDs with a bad CRC32C with SEND_ERROR ChecksumError")
    parser.add_argument("--keepalive-seconds", type=float, metavar="S",
                        help="PING a side silent this long; silent twice as long, it is dead (default 30)")
    parser.add_argument("--drain-seconds", type=float, metavar="S",
                        help="on SIGINT/SIGTERM, how long answers in flight may drain (default 5)")
    parser.add_argument("--broker-ports", metavar="START-END",
                        help="ports for the per-broker listeners of lookup rewriting (default: ephemeral)")
    parser.add_argument("--allow-broker", action="append", metavar="HOST:PORT",
                        help="a broker proxy-through may route to (repeatable)")
    parser.add_argument("--ready-file", metavar="PATH", help="write the listening ports as JSON once ready")
    parser.add_argument("--log-format", choices=("console", "json"), default="console",
                        help="log lines on stderr as readable text or as JSON objects")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                        help="least severe log level shown")


def _document(args: argparse.Namespace) -> tuple[Any, str | None, Path | None, dict[tuple[str, ...], str]]:
    """The config document: the file's (if any) with every given flag written over it."""
    from proxy.config.yaml_lines import LineMap, load_file

    document: Any = LineMap()
    file = base = None
    if args.config:
        document = load_file(args.config)
        if document is None:  # empty, or only comments: what it lacks is reported at its first line
            document = LineMap()
            document.line = 1
        file, base = args.config, Path(args.config).resolve().parent
    from_flags: dict[tuple[str, ...], str] = {}
    if not isinstance(document, dict):
        return document, file, base, from_flags
    for dest, (path, flag) in _FLAG_KEYS.items():
        value = getattr(args, dest)
        if value is None:
            continue
        target = document
        for part in path[:-1]:
            if not isinstance(target.get(part), dict):
                target[part] = LineMap()
            target = target[part]
        target[path[-1]] = value
        from_flags[path] = flag
    return document, file, base, from_flags


def load(args: argparse.Namespace) -> Any:
    """The validated ProxyConfig for these arguments (UsageError / ConfigError(s) otherwise).

    Every error is reported: those about a value a flag gave name the flag
    (``--listen: ...``), the others the file, line and key.
    """
    from proxy.config.proxy_config import parse_config
    from proxy.errors import ConfigError, ConfigErrors, UsageError

    if not args.config and not args.upstream:
        raise UsageError("give -c proxy.yaml or --upstream URL")
    document, file, base, from_flags = _document(args)
    try:
        return parse_config(document, file=file, base_dir=base if file else Path.cwd())
    except ConfigError as exc:
        errors = exc.errors if isinstance(exc, ConfigErrors) else [exc]
        named = [_name_flag(error, from_flags) for error in errors]
        if len(named) == 1 and named[0] is not errors[0]:
            raise UsageError(named[0].message) from None
        ConfigErrors.raise_if_any(named)
        raise


def _name_flag(error: Any, from_flags: dict[tuple[str, ...], str]) -> Any:
    """``error`` as ``--flag: message`` when a flag gave the value it is about."""
    from proxy.errors import ConfigError

    for path, flag in from_flags.items():
        dotted = ".".join(path)
        if error.key is not None and (error.key == dotted or error.key.startswith(dotted + "[")):
            return ConfigError(f"{flag}: {error.message}")
    return error


def write_ready_file(path: str, listen: list[str], admin: str | None) -> None:
    Path(path).write_text(json.dumps({"listen": listen, "admin": admin}) + "\n")


def run(args: argparse.Namespace) -> int:
    import trio

    from proxy.cli.heap import settle_heap
    from proxy.cli.interrupt import on_signals, signal_name
    from proxy.cli.ports import check_can_listen
    from proxy.errors import UsageError

    config = load(args)
    if config.admin is not None:  # checked before the heavy imports: a busy port is said at once
        flag = "--admin" if args.admin else "admin.listen"
        check_can_listen(config.admin.listen.host, config.admin.listen.port, flag)
    from proxy.server.app import ProxyServer
    from proxy.server.stack import load_ruleset, running_proxy
    from proxy.telemetry.logs import configure_logging

    load_ruleset(config)  # a bad rule file is refused before anything listens (exit 2)
    configure_logging(args.log_format, args.log_level)
    import structlog

    log = structlog.get_logger("pulsar_tap.run")
    server = ProxyServer(config)
    try:
        server.bind()
    except OSError as exc:
        raise UsageError(f"cannot listen on {config.listen}: {exc.strerror or exc}") from None

    async def main() -> None:
        stop = trio.Event()

        def on_signal(count: int) -> None:
            if count == 1:
                log.info("signal received: draining", signal=signal_name(1),
                         drain_seconds=config.limits.drain_seconds)
                stop.set()
            else:
                log.info("second signal: closing now", signal=signal_name(count))
                server.cut_drain()

        with on_signals(on_signal):
            async with running_proxy(config, server=server) as stack:
                if args.ready_file:
                    write_ready_file(args.ready_file, [stack.address], stack.admin_address)
                print(f"ready: listening on {stack.address}", flush=True)
                settle_heap()  # (see proxy.cli.heap)
                await stop.wait()
            for line in stop_summary(stack):
                print(line, file=sys.stderr, flush=True)

    trio.run(main)
    return 0


def stop_summary(stack: ProxyStack) -> list[str]:
    """What ``run`` says when it stopped: the connections served, each rule's hits, what was recorded."""
    lines = [f"stopped: {counted(stack.server.accepted_connections, 'connection')} served"]
    hits = stack.engine.hits() if stack.engine is not None else {}
    if hits:
        lines.append("rule hits: " + ", ".join(f"{name} {count}" for name, count in hits.items()))
    stats = stack.recording_stats
    if stats is not None:
        dropped = f", {counted(stats.frames_dropped, 'frame')} dropped (the writer fell behind)" \
            if stats.frames_dropped else ""
        lines.append(f"recorded: {counted(stats.frames_recorded, 'frame')} in {stack.recording_path}{dropped}")
    return lines
