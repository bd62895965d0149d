"""A sans-IO broker test's stand-ins for a connection: a sink that collects what a topic pushes to its consumers
(and ignores the rest), and a clock the test moves (ms) — for tests that drive topics and subscriptions directly."""

from __future__ import annotations

from dataclasses import dataclass, field

from proxy.broker.ledger import Entry
from proxy.broker.subscription import Consumer
from proxy.broker.topic import Producer


@dataclass
class Sink:
    """Collects the messages a topic pushes, as (consumer name, entry id)."""

    messages: list[tuple[str, int]] = field(default_factory=list)

    @property
    def entry_ids(self) -> list[int]:
        return [entry_id for _, entry_id in self.messages]

    def send_message(self, consumer: Consumer, entry: Entry, redelivery_count: int, ack_set: list[int] | None) -> None:
        self.messages.append((consumer.consumer_name, entry.entry_id))

    def send_active_consumer_change(self, consumer: Consumer, is_active: bool) -> None:
        pass

    def send_reached_end_of_topic(self, consumer: Consumer) -> None:
        pass

    def send_close_consumer(self, consumer: Consumer) -> None:
        pass

    def send_close_producer(self, producer: Producer) -> None:
        pass

    def send_producer_ready(self, producer: Producer) -> None:
        pass


class Clock:
    """Milliseconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.ms = 1_000_000

    def __call__(self) -> int:
        return self.ms
