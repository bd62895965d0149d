"""Each shipped rule file (``rules/*.yaml``) keeps the promise written in its comments.

One test per file: the file is loaded unchanged into the whole running proxy stack
(what ``pulsar-tap run --rules FILE`` starts), and the official client drives a stream
of asynchronous sends (and consumers where the promise is about them) through it.
The topic names are the ones the files match on; each test runs on a fresh broker.
"""

from __future__ import annotations

import time
from pathlib import Path

import pulsar
from official import AsyncSends, clients, official
from rules_proxy import StackFactory

from proxy.broker.embedded import ThreadedCluster

__all__ = ["clients"]

RULES = Path(__file__).parents[2] / "rules"


def rule_file(name: str) -> str:
    return (RULES / name).read_text(encoding="utf-8")


# -- slow-broker.yaml --------------------------------------------------------------------------
def test_slow_broker_delays_every_receipt_and_answer_by_200ms_side_by_side_and_nothing_fails(
        broker: ThreadedCluster, rules_proxy: StackFactory, clients: list[pulsar.Client]) -> None:
    """Every SEND_RECEIPT and creation answer ~200 ms (±50) late; send latency grows; nothing fails.

    The delay is each frame's own: ten sends in flight at once all come back ~200 ms late
    (not 200, 400, 600 ...), and a stream of sends is not capped at one per delay.
    """
    stack = rules_proxy(broker.service_url, rule_file("slow-broker.yaml"))
    client = official(stack.service_url, clients)
    started = time.monotonic()
    producer = client.create_producer("persistent://public/default/slow", batching_enabled=False,
                                      send_timeout_millis=30_000)
    # partitioned metadata, lookup and PRODUCER_SUCCESS: three answers, each 200 ms late
    assert time.monotonic() - started >= 0.55
    burst = AsyncSends(producer)
    burst.send(10)
    burst.wait(10)
    latencies = sorted(burst.latencies.values())
    assert all(result == pulsar.Result.Ok for result in burst.results.values())
    assert latencies[0] >= 0.145  # 200 ms - 50 ms of jitter (and a little clock slack)
    # side by side: the last receipt is late by one delay, not by ten (the old behaviour: 2 s)
    assert latencies[-1] - latencies[0] < 0.5, latencies
    stream = AsyncSends(producer)
    started = time.monotonic()
    stream.send(200)
    stream.wait(200)
    elapsed = time.monotonic() - started
    assert all(result == pulsar.Result.Ok for result in stream.results.values())
    # one receipt per 200 ms would take 40 s; in flight side by side it takes about one delay
    assert elapsed < 10, elapsed
    assert min(stream.latencies.values()) >= 0.145
