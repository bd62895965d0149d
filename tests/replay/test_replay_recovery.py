"""Client-side replay of a session in which the proxy closed a producer and refused one creation.

The recording is made the way users make them: the official client produces through a
recording proxy whose rules refuse the first PRODUCER (ServiceNotReady, answered by the
proxy) and ``close`` the producer on one SEND (the proxy swallows that SEND and sends
CLOSE_PRODUCER).  The client retries, re-creates the producer and resends what was pending.
Replayed into a fresh, healthy broker, nothing differs: the requests the proxy handled are
not the broker's to answer, and the re-created producer carries on the sends that follow.
"""

from __future__ import annotations

from pathlib import Path

import pulsar
import trio

from proxy.broker.embedded import BrokerClusterFactory
from proxy.pb import PulsarApi_pb2 as api
from proxy.recording.reader import open_recordings
from proxy.replay.conversation import build_conversations
from proxy.replay.replayer import replay_recording
from proxy.testing.rig import RecordingProxy, rules_hook

TOPIC = "persistent://public/default/replay-recovery"
MESSAGES = 300

RECOVERY_RULES = """\
rules:
  - name: refuse-first-producer
    match: {command: [PRODUCER], times: 1}
    action: {error: {code: ServiceNotReady, message: not ready yet}}
  - name: unload-once
    match: {command: [SEND], after: 100, times: 1}
    action: close
"""


def _record_recovering_session(upstream: str, record_dir: Path) -> Path:
    with RecordingProxy(upstream, record_dir, hook=rules_hook(RECOVERY_RULES)) as proxy:
        client = pulsar.Client(proxy.service_url, operation_timeout_seconds=10)
        try:
            producer = client.create_producer(TOPIC, batching_enabled=False)
            for index in range(MESSAGES):
                producer.send_async(f"message-{index}".encode(), None)
            producer.flush()
            producer.close()
        finally:
            client.close()
    return proxy.recording_path


def test_replay_of_a_closed_and_recreated_producer_differs_nowhere(broker_cluster: BrokerClusterFactory,
                                                                    tmp_path: Path) -> None:
    recorded_broker = broker_cluster()
    recording = _record_recovering_session(recorded_broker.service_url, tmp_path)

    conversations = build_conversations(open_recordings(recording).frames())
    exchanges = [e for conv in conversations.values() for e in conv.exchanges]
    handled = {(e.command, e.outcome) for e in exchanges if e.proxy_handled}
    # the refused creation and the swallowed SEND were the proxy's doing ...
    assert ("PRODUCER", "error:ServiceNotReady") in handled
    assert any(command == "SEND" for command, _ in handled)
    # ... the client's recovery (retry, re-creation) was answered by the broker
    creations = [e for e in exchanges if e.request.type == api.BaseCommand.PRODUCER and not e.proxy_handled]
    assert len(creations) == 2 and all(e.outcome == "ok" for e in creations)

    fresh_broker = broker_cluster()
    result = trio.run(lambda: replay_recording(str(recording), fresh_broker.service_url, speed=0,
                                               receipt_timeout=5))
    assert [d.format() for d in result.diffs] == []
    assert result.proxy_handled == len([e for e in exchanges if e.proxy_handled]) >= 2
    sends = [e for e in exchanges if e.command == "SEND" and not e.proxy_handled]
    assert len(sends) >= MESSAGES
