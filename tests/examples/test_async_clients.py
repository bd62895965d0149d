"""The same tap from async tests: a Trio test (pytest-trio) with pulsar-tap's own Trio client, and an
asyncio test with the official client's ``pulsar.asyncio`` API.

``async with tap.inject(...)`` and ``async with tap.recording()`` talk to the tap from a worker thread,
so the event loop keeps serving the client meanwhile.
"""

from __future__ import annotations

import asyncio

import pulsar
import pulsar.asyncio

from proxy.client import PulsarClient
from proxy.testing import Tap, delay, unload


async def test_trio_client_sees_the_injected_latency(pulsar_tap: Tap) -> None:
    """Every receipt is held 100 ms: the recording shows each send's latency as the client saw it."""
    async with PulsarClient(pulsar_tap.service_url) as client:
        producer = await client.create_producer("example-trio", batching=False)
        async with pulsar_tap.inject(delay(ms=100).on("SEND_RECEIPT").topic("example-trio")) as slow, \
                pulsar_tap.recording() as rec:
            receipts = [await producer.send_async(f"reading-{i}".encode()) for i in range(20)]
            for receipt in receipts:
                await receipt.wait()
    assert slow.hits == 20
    sends = rec.requests("SEND", topic="example-trio")
    assert [r.outcome for r in sends] == ["ok"] * 20
    assert all(r.latency_ms is not None and r.latency_ms >= 100 for r in sends)


def test_asyncio_client_survives_an_unload() -> None:
    """50 sends in flight when the topic is unloaded under them: the client re-creates its producer and
    resends what was pending."""
    with Tap() as tap:  # a tap of its own (and an embedded broker), outside any fixture
        async def main() -> list[pulsar.MessageId]:
            client = pulsar.asyncio.Client(tap.service_url, operation_timeout_seconds=30)
            try:
                producer = await client.create_producer("example-asyncio", batching_enabled=False)
                async with tap.inject(unload("example-asyncio").on("SEND").after(10)) as unloaded:
                    ids = await asyncio.gather(*(producer.send(f"event-{i}".encode()) for i in range(50)))
                assert unloaded.hits == 1
                return list(ids)
            finally:
                await client.close()

        ids = asyncio.run(main())
    assert len(ids) == 50
