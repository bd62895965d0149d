"""The whole proxy process, assembled: server, rules, recorder, telemetry and admin API.

``pulsar-tap run`` and ``pulsar-tap demo`` both start the proxy through
:func:`running_proxy`, so what the demo shows is what ``run`` does:

- the rules engine (``rules:`` a file, watched and hot-reloaded, or an inline list)
  as the server's frame hook — installed when there are rules or an admin API that
  can add them;
- the recorder (``record:``) as an observer, its directory created per run (only
  the frames ``record`` rules match, while there are such rules);
- telemetry (spans per ``tracing:``, metrics when ``admin`` serves /metrics) as an
  observer, shut down (its last spans flushed) once the server has drained;
- the admin API (``admin:``) on hypercorn, with the connections, metrics and health providers;
- the upstream probe (:mod:`proxy.server.upstream_probe`): a warning when the upstream
  does not answer (the proxy serves anyway), ``/healthz`` says which.

This is the one place the parts are wired together: the server itself
(:class:`~proxy.server.app.ProxyServer`) only serves connections to the hook and the
observers it is given.  Everything runs in one nursery; leaving the ``async with``
shuts the proxy down, drains it, and finishes the recording.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import trio

from proxy.config.proxy_config import ProxyConfig
from proxy.errors import ConfigError, PulsarTapError
from proxy.protocol.session import Direction
from proxy.recording.writer import RecorderStats
from proxy.rules.engine import RulesEngine
from proxy.rules.hook import RulesHook, record_filter
from proxy.rules.loader import load_rules_file, ruleset_from_data
from proxy.rules.model import RuleSet
from proxy.server.app import ProxyServer
from proxy.server.upstream_probe import UpstreamHealth, probe_upstream
from proxy.telemetry import TelemetryPipeline, telemetry_for_proxy

log = structlog.get_logger("pulsar_tap.proxy")


@dataclass
class ProxyStack:
    """A running proxy and its parts."""

    config: ProxyConfig
    server: ProxyServer
    engine: RulesEngine | None
    recording_path: Path | None = None
    admin_address: str | None = None
    upstream_health: UpstreamHealth | None = None
    #: spans and metrics (``tracing:``, /metrics); None when neither is wanted
    telemetry: TelemetryPipeline | None = None
    #: the recording's counters (``record:``; final once the proxy stopped)
    recording_stats: RecorderStats | None = None

    @property
    def address(self) -> str:
        return str(self.server.main_address)


def load_ruleset(config: ProxyConfig) -> RuleSet:
    """The rules ``config`` names (a file or an inline list); none gives an empty set."""
    if config.rules is None:
        return RuleSet()
    if isinstance(config.rules, str):
        return load_rules_file(config.rules)
    return ruleset_from_data(config.rules, config.file)


def _read_token(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror or exc}", file=path, key="admin.token_file") from None
    if not token:
        raise ConfigError("the token file is empty", file=path, key="admin.token_file")
    return token


def connection_rows(server: ProxyServer, telemetry_pipeline: TelemetryPipeline | None,
                    engine: RulesEngine | None = None) -> list[dict[str, Any]]:
    """``GET /connections``: peers, producers, consumers, topics, bytes and permits per connection.

    Outstanding FLOW permits come from telemetry, which sees every frame (the admin API
    always has it, for /metrics): the same count as ``pulsar_tap_outstanding_permits``.
    The relay's own session tracker follows FLOW and MESSAGE only when something on the
    relay path needs them, so it is the fallback.  ``permits`` are what the client
    granted; ``permits_held`` (per consumer and in total) the part of them a FLOW
    throttle still holds back from the broker, so the broker holds the difference.
    """
    rows = []
    telemetry = telemetry_pipeline.telemetry if telemetry_pipeline is not None else None
    for relay in list(server.relays):
        pipeline = relay.pipeline
        info = pipeline.info
        held = engine.permits_held(info.conn_id) if engine is not None else {}
        tracker = pipeline.tracker
        producers: list[dict[str, Any]] = [] if tracker is None else [
            {"producer_id": p.producer_id, "topic": p.topic, "producer_name": p.producer_name}
            for p in tracker.producers.values()]
        counted = telemetry.permits(info.conn_id) if telemetry is not None else None
        exact = counted is not None or pipeline.permits_exact or tracker is None
        consumers: list[dict[str, Any]] = [] if tracker is None else [
            {"consumer_id": c.consumer_id, "topic": c.topic, "subscription": c.subscription,
             "sub_type": c.sub_type, "consumer_name": c.consumer_name,
             "permits": (counted.get(c.consumer_id, 0) if counted is not None else c.permits) if exact else None,
             "permits_held": held.get(c.consumer_id, 0)}
            for c in tracker.consumers.values()]
        rows.append({
            "conn_id": info.conn_id, "client": info.client, "listener": info.listener,
            "broker": info.broker_url or (str(pipeline.broker) if pipeline.broker else None),
            "upstream_local": relay.upstream_local_address,
            "phase": pipeline.session.state.value, "violations": pipeline.session.violations,
            "bytes_to_broker": pipeline.bytes_in[Direction.TO_BROKER],
            "bytes_to_client": pipeline.bytes_in[Direction.TO_CLIENT],
            "producers": producers, "consumers": consumers,
            "topics": sorted({str(p["topic"]) for p in producers} | {str(c["topic"]) for c in consumers}),
            "permits": sum(c["permits"] for c in consumers) if exact else None,
            "permits_held": sum(c["permits_held"] for c in consumers),
        })
    return rows


@contextlib.asynccontextmanager
async def running_proxy(config: ProxyConfig, *, server: ProxyServer | None = None,
                        on_ready: Any = None) -> AsyncIterator[ProxyStack]:
    """Run the proxy described by ``config`` for the duration of the ``async with``."""
    ruleset = load_ruleset(config)
    engine: RulesEngine | None = None
    if ruleset.rules or config.admin is not None:
        engine = RulesEngine(ruleset)
        log.info("rules loaded", rules=len(ruleset.rules), seed=engine.seed,
                 seed_source="file" if engine.seed_from_file else "random")
    token = _read_token(config.admin.token_file) if config.admin is not None else None
    if server is None:
        server = ProxyServer(config, hook=RulesHook(engine) if engine is not None else None)
    elif engine is not None:
        server.hook = RulesHook(engine)
    stack = ProxyStack(config, server, engine, upstream_health=UpstreamHealth(str(config.upstream)))
    async with contextlib.AsyncExitStack() as exits:
        stack.telemetry = telemetry = telemetry_for_proxy(config)
        if telemetry is not None:
            exits.push_async_callback(_shut_down_telemetry, telemetry)
            observers = server.observers
            observers.observers.append(telemetry.observer)
            if telemetry.metrics is not None:
                telemetry.metrics.add_drop_source("observers", lambda: observers.dropped)
        if config.record is not None:
            from proxy.recording.observer import RecordingObserver
            from proxy.recording.writer import RecordConfig
            from proxy.server.recorder import Recorder

            section = config.record
            recorder = await exits.enter_async_context(Recorder(RecordConfig(
                dir=Path(section.dir), redact=section.redact, include_payloads=section.include_payloads,
                max_segment_bytes=section.max_segment_mb * 1024 * 1024)))
            # with ``record`` rules in force, only the frames they match are kept
            keep = record_filter(engine) if engine is not None else None
            server.observers.observers.append(RecordingObserver(recorder, lookup_mode=config.lookup,
                                                                frame_filter=keep))
            stack.recording_path = recorder.path
            stack.recording_stats = recorder.stats
            log.info("recording", path=str(recorder.path))
        services = await exits.enter_async_context(trio.open_nursery())
        async with trio.open_nursery() as proxy_nursery:
            await proxy_nursery.start(server.run)
            assert stack.upstream_health is not None
            answered = trio.Event()
            services.start_soon(probe_upstream, config.upstream, server.upstream_tls_context, stack.upstream_health,
                                answered)
            with trio.move_on_after(1.0):  # a refused or failing upstream is said before "ready"
                await answered.wait()
            if engine is not None and isinstance(config.rules, str):
                from proxy.server.rule_watch import watch_rule_file

                services.start_soon(watch_rule_file, config.rules, engine)
            if config.admin is not None and engine is not None:
                stack.admin_address = await _start_admin(services, stack, engine, token)
            try:
                yield stack
            finally:
                # server.run drains its connections and returns; then the services stop
                server.request_shutdown()
        services.cancel_scope.cancel()


async def _shut_down_telemetry(telemetry: TelemetryPipeline) -> None:
    """Flush the last spans; called once the server returned (its observer task drained the queue)."""
    with trio.CancelScope(shield=True):
        await trio.to_thread.run_sync(telemetry.shutdown, time.time_ns())


async def _start_admin(nursery: trio.Nursery, stack: ProxyStack, engine: RulesEngine, token: str | None) -> str:
    from proxy.admin.app import AdminApp
    from proxy.admin.serve import serve_admin

    config, server, telemetry, health = stack.config, stack.server, stack.telemetry, stack.upstream_health
    assert config.admin is not None and health is not None
    app = AdminApp(engine, token=token, connections=lambda: connection_rows(server, telemetry, engine),
                   metrics=telemetry.admin_metrics if telemetry is not None else None, health=health.to_json)
    try:
        bound = await nursery.start(serve_admin, app, config.admin.listen.host, config.admin.listen.port)
    except OSError as exc:
        raise PulsarTapError(f"cannot serve the admin API on {config.admin.listen}: {exc.strerror or exc}") from None
    address = _host_port(bound[0]) if bound else str(config.admin.listen)
    log.info("admin API listening", address=address)
    if not config.admin.listen.is_loopback:
        if token is None:
            log.warning("admin API reachable from other machines with no token: anyone who reaches it can "
                        "change the rules (admin.insecure)", address=address)
        else:
            log.warning("admin API reachable from other machines over plain HTTP: whoever sees its traffic can "
                        "read and reuse the credential it carries; keep it on a trusted network", address=address)
    return address


def _host_port(bound: str) -> str:
    """hypercorn reports ``http://HOST:PORT``; keep ``HOST:PORT``."""
    return bound.split("://", 1)[-1]
