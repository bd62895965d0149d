"""rules/wan-degradation.yaml and rules/wan-lost-snapshots.yaml keep the promises their comments make.

Both clusters replicate to each other through a pulsar-tap proxy per link, each link
loaded with the rule file and recording; the official client produces on A (and a
replicated subscription consumes there), and the recording of link A->B says what
crossed the WAN and when.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pulsar
import trio
from geo_traffic import SUB, TOPIC, consume_then_leave, resume_on_b

from proxy.cli.demo_geo import GeoPair, open_geo_pair, wait_caught_up
from proxy.recording.reader import open_recordings
from proxy.recording.replication import ReplicatedSend, lag_table, replicated_sends

RULES = Path(__file__).resolve().parents[2] / "rules"


def run_traffic(url_a: str, url_b: str, total: int, rate: int, stop_after: int) -> list[int]:
    """Produce on A at ``rate`` while a replicated subscription on A takes ``stop_after`` and leaves.

    Returns what a plain subscription on B received (indexes).
    """
    client_b = pulsar.Client(url_b)
    try:
        on_b = client_b.subscribe(TOPIC, "check", initial_position=pulsar.InitialPosition.Earliest)
        consume_then_leave(url_a, rate, total, stop_after)
        received = []
        while len(received) < total:
            message = on_b.receive(60_000)
            received.append(int(message.data()))
            on_b.acknowledge(message)
        return received
    finally:
        client_b.close()


def link_sends(pair: GeoPair, name: str) -> list[ReplicatedSend]:
    stack = pair.link_ab if name == "A->B" else pair.link_ba
    assert stack is not None and stack.recording_path is not None
    return replicated_sends(open_recordings(stack.recording_path).frames())


async def test_wan_degradation_delays_cuts_and_restores_the_link_without_loss(tmp_path: Path) -> None:
    total, rate = 3600, 400
    with trio.fail_after(300):
        async with open_geo_pair(rules=str(RULES / "wan-degradation.yaml"), record_dir=tmp_path) as pair:
            received = await trio.to_thread.run_sync(run_traffic, pair.url_a, pair.url_b, total, rate, 1000)
            with trio.fail_after(60):
                await wait_caught_up(pair.a, "B")
            assert pair.link_ab is not None and pair.link_ab.engine is not None
            hits = pair.link_ab.engine.hits()
            controller = pair.a.cluster.topics[TOPIC].geo.controller  # type: ignore[union-attr]
            assert controller is not None
            round_trips = list(controller.stats.durations_ms)
    # nothing lost, nothing stored twice (deduplication dropped what was resent), in order
    assert received == list(range(total))
    assert hits == {"link-cut": 1, "link-down": 6, "wan-latency": hits["wan-latency"]}
    sends = link_sends(pair, "A->B")
    # every replicated message stored >= 2 s after it was published on A
    rows = lag_table(sends)
    assert sum(row.messages for row in rows) == total
    assert all(row.p50_ms is not None and row.p50_ms >= 2000 for row in rows)
    # the outage: >= 10 s without a single message stored on B, then the backlog drains
    stored = sorted(send.receipt_ns for send in sends if send.receipt_ns is not None)
    assert max(later - earlier for earlier, later in itertools.pairwise(stored)) >= 10e9
    assert max(row.max_ms or 0 for row in rows) >= 10_000
    # a snapshot needs the request to cross and the answer to come back: >= 2 x 2 s
    assert round_trips and min(round_trips) >= 4000


async def test_losing_every_snapshot_response_leaves_the_subscription_behind(tmp_path: Path) -> None:
    total, rate, consumed = 1500, 500, 750
    with trio.fail_after(240):
        async with open_geo_pair(rules=str(RULES / "wan-lost-snapshots.yaml"), record_dir=tmp_path,
                                 snapshot_period_ms=200) as pair:
            received = await trio.to_thread.run_sync(run_traffic, pair.url_a, pair.url_b, total, rate,
                                                        consumed)
            with trio.fail_after(60):
                await wait_caught_up(pair.a, "B")
            controller = pair.a.cluster.topics[TOPIC].geo.controller  # type: ignore[union-attr]
            assert controller is not None
            started, completed = controller.stats.started, controller.stats.completed
            updates = controller.stats.updates_written
            assert SUB not in pair.b.cluster.topics[TOPIC].subscriptions  # no update ever reached B
            assert pair.link_ba is not None and pair.link_ba.engine is not None
            dropped = pair.link_ba.engine.hits()["lose-snapshot-responses"]
            given_again = [index for index, _ in await trio.to_thread.run_sync(resume_on_b, pair.url_b, total)]
    assert received == list(range(total))  # data from A to B is untouched
    assert started >= 1 and completed == 0 and updates == 0
    assert dropped >= 1
    # the link into A is not stalled: every marker carries sequence id 0, so the receipt of the next
    # one answers the dropped response (as Pulsar's replicator producer pairs them) and B's own
    # snapshot requests keep reaching A
    into_a = link_sends(pair, "B->A")
    requests = [send for send in into_a if send.marker == "REPLICATED_SUBSCRIPTION_SNAPSHOT_REQUEST"]
    assert len(requests) >= 2 and all(send.sequence_id == 0 for send in into_a if send.marker)
    assert sum(send.receipt_ns is not None for send in into_a) >= len(into_a) - 1
    # the consumer failing over starts B's new subscription at its initial position: everything again
    assert given_again[:consumed] == list(range(consumed))
