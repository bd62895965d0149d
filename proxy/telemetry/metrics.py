"""The proxy's metrics, as OpenTelemetry SDK instruments, and their Prometheus exposition.

:class:`ProxyMetrics` owns the instruments (names as ``/metrics`` shows them):

- ``pulsar_tap_request_duration_seconds`` — histogram of request -> response time,
  labelled ``command`` (the request's type name), ``outcome`` (ok | error |
  unanswered) and ``topic`` per the :class:`TopicLabelPolicy`;
- ``pulsar_tap_frames_total`` / ``pulsar_tap_bytes_total`` — frames and bytes per
  ``command``, ``direction`` and ``origin``;
- ``pulsar_tap_messages_total`` — messages in SEND / MESSAGE frames (batches counted
  by their entries), per ``command`` and ``topic``;
- ``pulsar_tap_active_connections``, ``pulsar_tap_producers``, ``pulsar_tap_consumers``,
  ``pulsar_tap_outstanding_permits`` — gauges;
- ``pulsar_tap_rule_hits_total{rule=...}`` — fired rules (SPEC.md fixes this name);
- ``pulsar_tap_dropped_events_total{source=...}`` — events that observers (the
  recorder, telemetry itself, the span exporter's queue: ``source="spans"``) lost to a
  full queue, read from callbacks.

Topic labels have bounded cardinality: the policy keeps at most ``max_topics``
distinct topic values (optionally only those matching glob patterns) and folds the
rest into ``other``.  An in-process reader backs :meth:`ProxyMetrics.prometheus_text`;
other readers (OTLP) can be added.  The latency histogram is aggregated by
:class:`~proxy.telemetry.histogram.PreAggregatedHistogram` (a tenth of the SDK's cost
per request, the same output), so every reader must fold it in
(:class:`~proxy.telemetry.histogram.FoldsHistograms`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.util.types import AttributeValue

from proxy.protocol.session import Direction
from proxy.telemetry import prometheus
from proxy.telemetry.histogram import FoldingInMemoryReader, FoldsHistograms, PreAggregatedHistogram

#: Seconds; from sub-millisecond loopback round trips to slow broker fail-overs.
LATENCY_BUCKETS_S: Final = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                            0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
OTHER_TOPIC: Final = "other"
REQUEST_DURATION: Final = "pulsar_tap_request_duration_seconds"
#: topics :meth:`ProxyMetrics.send_passed` / :meth:`ProxyMetrics.receipt_passed` remember their counters for
#: (past it they start over: a client of ever new topics cannot grow what they remember without bound)
LANE_TOPICS: Final = 4096
#: the directions' label values
_TO_BROKER: Final = Direction.TO_BROKER.value
_TO_CLIENT: Final = Direction.TO_CLIENT.value


@dataclass
class TopicLabelPolicy:
    """Which topics get their own label value.

    ``max_topics`` = 0 removes the topic label altogether; otherwise the first
    ``max_topics`` distinct topics seen (among those matching ``patterns``, when
    given) keep their name and every other topic is labelled ``other``.
    """

    max_topics: int = 100
    patterns: tuple[str, ...] = ()
    _kept: set[str] = field(default_factory=set, repr=False)

    @property
    def enabled(self) -> bool:
        return self.max_topics > 0

    def label(self, topic: str | None) -> str:
        if not topic:
            return ""
        if topic in self._kept:
            return topic
        if len(self._kept) >= self.max_topics:
            return OTHER_TOPIC
        if self.patterns and not any(fnmatch.fnmatchcase(topic, p) for p in self.patterns):
            return OTHER_TOPIC
        self._kept.add(topic)
        return topic


def _request_attributes(key: tuple[str, str, str | None]) -> dict[str, AttributeValue]:
    command, outcome, topic = key
    attributes: dict[str, AttributeValue] = {"command": command, "outcome": outcome}
    if topic is not None:
        attributes["topic"] = topic
    return attributes


class ProxyMetrics:
    """The instruments; see the module docstring.  Methods are cheap and never do I/O.

    Counters and gauges are kept as plain numbers and read by observable
    instruments when a reader collects (an SDK ``add`` per frame would cost more
    than the rest of telemetry); the latency histogram is pre-aggregated per
    request and added to each collection.
    """

    def __init__(self, *, topic_policy: TopicLabelPolicy | None = None,
                 extra_readers: Sequence[MetricReader] = (), resource: Resource | None = None) -> None:
        self.topics = topic_policy or TopicLabelPolicy()
        self.reader = FoldingInMemoryReader()
        readers: list[FoldsHistograms] = [self.reader]
        for reader in extra_readers:
            if not isinstance(reader, FoldsHistograms):
                raise TypeError(f"{type(reader).__name__} does not fold in the latency histogram")
            readers.append(reader)
        # No exemplars: nothing records through the SDK's synchronous path (the histogram is ours).
        self.provider = MeterProvider(metric_readers=readers, exemplar_filter=AlwaysOffExemplarFilter(),
                                      resource=resource or Resource.create({"service.name": "pulsar-tap"}))
        meter = self.provider.get_meter("pulsar-tap")
        self._drop_sources: dict[str, Callable[[], int]] = {}
        #: (command, direction, origin) -> [frames, bytes]
        self._frames: dict[tuple[str, str, str], list[int]] = {}
        #: (command, topic label) -> [messages]
        self._messages: dict[tuple[str, str], list[int]] = {}
        # the lanes' own ways to the counters above (see send_passed / receipt_passed)
        self._send_frames: list[int] | None = None
        self._receipt_frames: list[int] | None = None
        #: topic -> its SEND messages counter (a list of _messages)
        self._send_messages: dict[str | None, list[int]] = {}
        #: topic -> the request histogram's key and attributes of its SENDs answered ok
        self._send_requests: dict[str | None, tuple[tuple[str, str, str | None],
                                                     Callable[[], dict[str, AttributeValue]]]] = {}
        self._rule_hits: dict[str, int] = {}
        self.active_connections = 0
        self.producers = 0
        self.consumers = 0
        self.outstanding_permits = 0
        # Registered for its name, unit and scope; measurements go to the pre-aggregated histogram.
        self.request_duration = PreAggregatedHistogram(meter.create_histogram(
            REQUEST_DURATION, unit="s", description="Time from a request to its response, as the client sees it"),
            LATENCY_BUCKETS_S)
        for reader in readers:
            reader.fold_in(self.request_duration)
        meter.create_observable_counter("pulsar_tap_frames", callbacks=[self._observe_frames],
                                        description="Frames through the proxy")
        meter.create_observable_counter("pulsar_tap_bytes", callbacks=[self._observe_bytes], unit="By",
                                        description="Frame bytes through the proxy")
        meter.create_observable_counter("pulsar_tap_messages", callbacks=[self._observe_messages],
                                        description="Messages in SEND and MESSAGE frames (batch entries counted)")
        for name, description in (("active_connections", "Client connections open through the proxy"),
                                  ("producers", "Producers open"), ("consumers", "Consumers open"),
                                  ("outstanding_permits", "FLOW permits granted and not yet used by MESSAGEs")):
            meter.create_observable_gauge(f"pulsar_tap_{name}", callbacks=[self._gauge(name)],
                                          description=description)
        meter.create_observable_counter("pulsar_tap_rule_hits", callbacks=[self._observe_rule_hits],
                                        description="Times each rule fired")
        meter.create_observable_counter("pulsar_tap_dropped_events", callbacks=[self._observe_drops],
                                        description="Events observers lost to a full queue, per source")

    # -- recording ------------------------------------------------------------------------
    def request(self, command: str, topic: str | None, outcome: str, seconds: float) -> None:
        key = (command, outcome, self.topics.label(topic) if self.topics.enabled else None)
        self.request_duration.record(key, lambda: _request_attributes(key), max(seconds, 0.0))

    def requests(self, command: str, topic: str | None, outcome: str, seconds: list[float]) -> None:
        """:meth:`request` of several requests alike, in order."""
        key = (command, outcome, self.topics.label(topic) if self.topics.enabled else None)
        self.request_duration.record_many(key, lambda: _request_attributes(key), seconds)

    def frame(self, command: str, direction: str, origin: str, size: int, count: int = 1) -> None:
        """``count`` frames of ``size`` bytes in all."""
        counts = self._frame_counter(command, direction, origin)
        counts[0] += count
        counts[1] += size

    def message_count(self, command: str, topic: str | None, count: int) -> None:
        self._message_counter(command, topic)[0] += count

    def _message_counter(self, command: str, topic: str | None) -> list[int]:
        key = (command, self.topics.label(topic) if self.topics.enabled else "")
        counter = self._messages.get(key)
        if counter is None:
            counter = self._messages[key] = [0]
        return counter

    def _frame_counter(self, command: str, direction: str, origin: str) -> list[int]:
        counts = self._frames.get((command, direction, origin))
        if counts is None:
            counts = self._frames[(command, direction, origin)] = [0, 0]
        return counts

    # -- one client SEND, one broker receipt (the telemetry observer's lanes for frames read one at a time) --
    def send_passed(self, topic: str | None, size: int, messages: int) -> None:
        """:meth:`frame` (``SEND``, to the broker, from the client) and :meth:`message_count` of one SEND.

        The same counts, with what the general calls look up each time (the counters'
        keys, the topic's label) looked up once a topic: a client producing as fast as
        it can makes ~40 000 calls a second.
        """
        counts = self._send_frames
        if counts is None:
            counts = self._send_frames = self._frame_counter("SEND", _TO_BROKER, "client")
        counts[0] += 1
        counts[1] += size
        if messages:
            counter = self._send_messages.get(topic)
            if counter is None:
                if len(self._send_messages) >= LANE_TOPICS:
                    self._send_messages.clear()
                counter = self._send_messages[topic] = self._message_counter("SEND", topic)
            counter[0] += messages

    def receipt_passed(self, topic: str | None, size: int, waited_ns: int | None) -> None:
        """:meth:`frame` (``SEND_RECEIPT``, to the client, from the broker) of one receipt and, when its SEND
        was seen ``waited_ns`` before, :meth:`request` (``SEND``, ``ok``) of that long."""
        counts = self._receipt_frames
        if counts is None:
            counts = self._receipt_frames = self._frame_counter("SEND_RECEIPT", _TO_CLIENT, "broker")
        counts[0] += 1
        counts[1] += size
        if waited_ns is not None:
            found = self._send_requests.get(topic)
            if found is None:
                if len(self._send_requests) >= LANE_TOPICS:
                    self._send_requests.clear()
                key = ("SEND", "ok", self.topics.label(topic) if self.topics.enabled else None)
                found = self._send_requests[topic] = (key, lambda: _request_attributes(key))
            self.request_duration.record(found[0], found[1], waited_ns / 1e9 if waited_ns > 0 else 0.0)

    def rules_fired(self, names: Iterable[str]) -> None:
        for name in names:
            self._rule_hits[name] = self._rule_hits.get(name, 0) + 1

    def add_drop_source(self, source: str, dropped: Callable[[], int]) -> None:
        """Report ``dropped()`` as ``pulsar_tap_dropped_events_total{source=...}`` (e.g. the recorder's queue)."""
        self._drop_sources[source] = dropped

    # -- collection callbacks (run on the reader's thread: they copy before iterating) ----
    def _observe_frames(self, options: CallbackOptions) -> Iterable[Observation]:
        del options
        return [Observation(counts[0], {"command": c, "direction": d, "origin": o})
                for (c, d, o), counts in list(self._frames.items())]

    def _observe_bytes(self, options: CallbackOptions) -> Iterable[Observation]:
        del options
        return [Observation(counts[1], {"command": c, "direction": d, "origin": o})
                for (c, d, o), counts in list(self._frames.items())]

    def _observe_messages(self, options: CallbackOptions) -> Iterable[Observation]:
        del options
        return [Observation(count[0], {"command": command, "topic": topic} if self.topics.enabled else
                            {"command": command}) for (command, topic), count in list(self._messages.items())]

    def _observe_rule_hits(self, options: CallbackOptions) -> Iterable[Observation]:
        del options
        return [Observation(hits, {"rule": name}) for name, hits in list(self._rule_hits.items())]

    def _gauge(self, name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            del options
            return [Observation(getattr(self, name))]
        return observe

    def _observe_drops(self, options: CallbackOptions) -> Iterable[Observation]:
        del options
        return [Observation(read(), {"source": source}) for source, read in list(self._drop_sources.items())]

    # -- reading --------------------------------------------------------------------------
    def prometheus_text(self, exclude: Iterable[str] = ()) -> str:
        """Everything collected so far (but the ``exclude`` d families), as Prometheus text."""
        return prometheus.render(self.reader.get_metrics_data(), exclude=exclude)

    def shutdown(self) -> None:
        self.provider.shutdown()
