"""Fixtures for the replay tests: embedded brokers, and one recording of the official client made
through a recording proxy (1 000 messages, batching on, LZ4), shared by the acceptance tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from replay_sessions import OfficialRecording

from proxy.broker.cluster import ClusterConfig
from proxy.broker.embedded import ThreadedCluster
from proxy.testing.rig import RecordingProxy, official_session

__all__ = ["OfficialRecording", "official_recording"]

TOPIC = "persistent://public/default/replay-orders"
SUBSCRIPTION = "replay-sub"
MESSAGES = 1000


@pytest.fixture(scope="module")
def official_recording(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OfficialRecording]:
    """The official client subscribes, produces 1 000 messages and consumes them, through the recording proxy."""
    cluster = ThreadedCluster(ClusterConfig(brokers=1)).start()
    try:
        proxy = RecordingProxy(cluster.service_url, tmp_path_factory.mktemp("recordings"))
        with proxy:
            payloads = official_session(proxy.service_url, TOPIC, SUBSCRIPTION, MESSAGES, batching=True,
                                        compression="LZ4")
        assert proxy.recorder is not None
        assert (proxy.frames.mismatches, proxy.frames.gaps) == (0, 0)  # its runs said where frames begin
        yield OfficialRecording(proxy.recording_path, payloads, TOPIC, SUBSCRIPTION, proxy.recorder.stats,
                                dict(proxy.frames.counts))
    finally:
        cluster.stop()
