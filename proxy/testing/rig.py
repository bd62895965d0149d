"""A recording proxy and a replay server on their own threads, for scripts and tests.

Recordings the replay tests and ``recordings/make_sample.py`` use are made the
way users make them: the official client talks to a real pulsar-tap proxy that
records, in front of a broker.  :class:`RecordingProxy` runs a
:class:`~proxy.server.app.ProxyServer` with a
:class:`~proxy.recording.observer.RecordingObserver` (and optionally a rule file's
hook) on a Trio loop in a daemon thread, so blocking clients can be driven from
the caller's thread; :meth:`RecordingProxy.stop` shuts the proxy down and
finishes the recording.  :class:`ThreadedReplayServer` does the same for a
:class:`~proxy.replay.server.ReplayServer`.
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

from proxy.config.proxy_config import HostPort, LimitsConfig, ProxyConfig, ServiceUrl
from proxy.core.hooks import ConnectionEvent, FrameEvent, FrameHook, Origin, RunEvent, origin_of
from proxy.errors import PulsarTapError
from proxy.protocol.commands import type_name
from proxy.protocol.session import Direction
from proxy.recording.observer import RecordingObserver
from proxy.recording.writer import RecordConfig
from proxy.replay.matcher import AnswerBook
from proxy.replay.server import ReplayServer
from proxy.server.app import ProxyServer
from proxy.server.recorder import Recorder
from proxy.server.threaded import LoopThread, serve_until_shutdown


def rules_hook(rules_text: str, seed: int = 1) -> FrameHook:
    """The proxy hook for a rule document given as YAML text."""
    from proxy.rules.engine import RulesEngine
    from proxy.rules.hook import RulesHook
    from proxy.rules.loader import load_rules_text

    return RulesHook(RulesEngine(load_rules_text(rules_text), seed=seed))


class FrameCounter:
    """A proxy observer counting the frames it hears of, by (direction, origin, command).

    It takes passed-through bytes in runs (``on_run``) as the recorder does, so a proxy with
    it and a recorder relays the way ``pulsar-tap run --record`` does, and it frames those
    bytes itself (size prefixes and each command's type), independently of the proxy's own
    framing: a frame is counted where its first byte is, a frame cut across runs once.
    ``mismatches`` counts runs whose ``lead`` (the rest of a frame begun earlier) disagreed
    with what this counter expected; ``gaps`` counts runs whose ``stream_pos`` says bytes
    before them never reached it (the hub drops events when its queue is full).
    """

    #: it reads only the frame header's command type: the relay need not track the session for it
    needs_observation = False
    #: the size prefix, the command's size, and the command's type field: a tag and a varint
    _HEAD = 4 + 4 + 1 + 2

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str, str]] = Counter()
        self.mismatches = 0
        self.gaps = 0
        #: per (connection, direction): the next stream position expected, the bytes still to
        #: skip of the current frame, and the start of a frame whose head is not complete yet
        self._streams: dict[tuple[int, str], tuple[int, int, bytes]] = {}

    def on_frame(self, event: FrameEvent) -> None:
        self.counts[(str(event.direction), str(event.origin), event.frame.type_name)] += 1
        if event.origin is not Origin.PROXY:  # a received frame, whole: the next run says where it goes on
            self._streams.pop((event.connection.conn_id, str(event.direction)), None)

    def on_run(self, event: RunEvent) -> None:
        key = (event.connection.conn_id, str(event.direction))
        position, skip, head = self._streams.get(key, (event.stream_pos, event.lead, b""))
        if position != event.stream_pos:
            self.gaps += 1
            skip, head = event.lead, b""
        elif min(skip, len(event.data)) != event.lead and not head:
            self.mismatches += 1
        data = head + bytes(event.data)
        at, head = (0, b"") if head else (skip, b"")
        while at < len(data):
            remaining = len(data) - at
            length = 4 + int.from_bytes(data[at:at + 4], "big") if remaining >= 4 else self._HEAD
            if remaining < min(self._HEAD, length):
                head = data[at:]
                break
            self._count(event.direction, data[at + 8:at + min(self._HEAD, length)])
            at += length
        self._streams[key] = (event.stream_pos + len(event.data), 0 if head else at - len(data), head)

    def _count(self, direction: Direction, command: bytes) -> None:
        type_value = -1
        if command[:1] == b"\x08":  # field 1 (type), a varint
            type_value = command[1] & 0x7F
            if command[1] & 0x80 and len(command) > 2:
                type_value |= (command[2] & 0x7F) << 7
        self.counts[(str(direction), str(origin_of(direction)), type_name(type_value))] += 1

    def on_connection(self, event: ConnectionEvent) -> None:
        if event.closed:
            self._streams = {key: state for key, state in self._streams.items()
                             if key[0] != event.connection.conn_id}


class RecordingProxy(LoopThread):
    """``pulsar-tap run --record DIR`` in-process: a recording proxy in front of ``upstream``."""

    def __init__(self, upstream: str, record_dir: str | Path | None = None, *, hook: FrameHook | None = None,
                 lookup: str = "rewrite", **record_options: Any) -> None:
        super().__init__("pulsar-tap-recording-proxy")
        self.config = ProxyConfig(upstream=ServiceUrl.parse(upstream), listen=HostPort("127.0.0.1", 0),
                                  lookup=lookup, limits=LimitsConfig(drain_seconds=0.5))
        self.record_dir = None if record_dir is None else Path(record_dir)
        self.record_options = record_options
        self.hook = hook
        self.server: ProxyServer | None = None
        self.recorder: Recorder | None = None
        #: every frame the proxy published to its observers, counted independently of the recorder
        self.frames = FrameCounter()

    @property
    def service_url(self) -> str:
        assert self.server is not None
        return f"pulsar://{self.server.main_address}"

    @property
    def recording_path(self) -> Path:
        """The recording directory this run created."""
        assert self.recorder is not None
        path: Path = self.recorder.path
        return path

    async def serve(self, ready: threading.Event) -> None:
        if self.record_dir is None:
            self.server = ProxyServer(self.config, hook=self.hook)
            await serve_until_shutdown(self.server, ready)
            return
        async with Recorder(RecordConfig(dir=self.record_dir, **self.record_options)) as recorder:
            self.recorder = recorder
            observer = RecordingObserver(recorder, lookup_mode=self.config.lookup)
            self.server = ProxyServer(self.config, hook=self.hook, observers=[observer, self.frames])
            await serve_until_shutdown(self.server, ready)

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.request_shutdown()


class ThreadedReplayServer(LoopThread):
    """``pulsar-tap replay REC --serve`` in-process, on loopback."""

    def __init__(self, book: AnswerBook, **options: Any) -> None:
        super().__init__("pulsar-tap-replay-server")
        self.server = ReplayServer(book, "127.0.0.1", 0, **options)

    @property
    def service_url(self) -> str:
        return f"pulsar://{self.server.address}"

    async def serve(self, ready: threading.Event) -> None:
        await serve_until_shutdown(self.server, ready)

    def shutdown(self) -> None:
        self.server.request_shutdown()


def official_session(service_url: str, topic: str, subscription: str, messages: int, *,
                     batching: bool = True, compression: str = "LZ4", timeout: float = 30.0) -> list[bytes]:
    """The official client subscribes, produces ``messages`` (keys, properties), consumes and acks them all.

    Returns the payloads in the order they were produced.  Needs ``pulsar-client``.
    """
    import pulsar

    payloads = [f"message-{i:05d} ".encode() + bytes(range(32)) for i in range(messages)]
    client = pulsar.Client(service_url, operation_timeout_seconds=int(timeout))
    try:
        consumer = client.subscribe(topic, subscription, consumer_type=pulsar.ConsumerType.Shared,
                                    initial_position=pulsar.InitialPosition.Earliest)
        producer = client.create_producer(
            topic, batching_enabled=batching, batching_max_messages=100, batching_max_publish_delay_ms=5,
            compression_type=getattr(pulsar.CompressionType, compression))
        for i, payload in enumerate(payloads):
            producer.send_async(payload, None, partition_key=f"key-{i % 7}", properties={"index": str(i)})
        producer.flush()
        received: list[bytes] = []
        while len(received) < messages:
            message = consumer.receive(timeout_millis=int(timeout * 1000))
            received.append(message.data())
            consumer.acknowledge(message)
        producer.close()
        consumer.close()
        if sorted(received) != sorted(payloads):
            raise PulsarTapError("the official client did not get back what it produced")
    finally:
        client.close()
    return payloads


__all__ = ["FrameCounter", "RecordingProxy", "ThreadedReplayServer", "official_session", "rules_hook"]
