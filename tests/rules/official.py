"""The official client in the rules tests: clients closed after each test, streams of async sends, read-back."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pulsar
import pytest

LOGGER = pulsar.ConsoleLogger(pulsar.LoggerLevel.Error)


@pytest.fixture
def clients() -> Iterator[list[pulsar.Client]]:
    made: list[pulsar.Client] = []
    yield made
    for client in made:
        client.close()


def official(url: str, made: list[pulsar.Client], timeout_s: int = 30) -> pulsar.Client:
    client = pulsar.Client(url, operation_timeout_seconds=timeout_s, logger=LOGGER)
    made.append(client)
    return client


class AsyncSends:
    """Many ``send_async`` in flight at once; records each receipt's latency and result."""

    def __init__(self, producer: pulsar.Producer) -> None:
        self.producer = producer
        self.latencies: dict[int, float] = {}
        self.results: dict[int, pulsar.Result] = {}
        #: the payloads, in the order they were handed to the client
        self.sent: list[bytes] = []
        self.done = threading.Condition()

    def send(self, count: int, start: int = 0, prefix: str = "m") -> None:
        for index in range(start, start + count):
            sent_at = time.monotonic()

            def receipt(result: pulsar.Result, _: object, index: int = index, sent_at: float = sent_at) -> None:
                with self.done:
                    self.latencies[index] = time.monotonic() - sent_at
                    self.results[index] = result
                    self.done.notify_all()

            payload = f"{prefix}-{index:06d}".encode()
            self.sent.append(payload)
            self.producer.send_async(payload, receipt)

    def wait(self, count: int | None = None, timeout_s: float = 60, *, all_ok: bool = True) -> dict[int, object]:
        """Wait for ``count`` results (default: one per message sent); those not Ok, by index.

        With ``all_ok`` (the default) every send must have succeeded.
        """
        count = len(self.sent) if count is None else count
        with self.done:
            assert self.done.wait_for(lambda: len(self.results) >= count, timeout_s), \
                f"{len(self.results)} of {count} receipts within {timeout_s} s"
            failed = {index: result for index, result in self.results.items() if result != pulsar.Result.Ok}
        assert not (all_ok and failed), f"sends failed: {failed}"
        return failed


def read_back(url: str, topic: str, count: int, made: list[pulsar.Client], *, subscription: str = "read-back",
              settle_ms: int = 500) -> list[bytes]:
    """Every message stored on ``topic`` (read from the start, straight from the broker), in order.

    Reads ``count`` messages, then waits ``settle_ms`` for any extra one (a duplicate would show up).
    """
    consumer = official(url, made).subscribe(topic, subscription, initial_position=pulsar.InitialPosition.Earliest)
    got: list[bytes] = []
    while len(got) < count:
        message = consumer.receive(timeout_millis=10_000)
        got.append(message.data())
        consumer.acknowledge(message)
    try:
        while True:
            got.append(consumer.receive(timeout_millis=settle_ms).data())
    except pulsar.Timeout:
        pass
    return got
