"""Issue 7 acceptance: the official client recorded through the proxy, shown, drawn, and replayed both ways."""

from __future__ import annotations

import json
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import pulsar
import pytest
import trio
from replay_sessions import OfficialRecording

from proxy.broker.embedded import BrokerClusterFactory
from proxy.client.connection import ClientConnection, ConnectionConfig
from proxy.client.names import BrokerAddress
from proxy.errors import BrokerError
from proxy.pb import PulsarApi_pb2 as api
from proxy.recording.reader import open_recordings
from proxy.replay.conversation import build_conversations
from proxy.replay.matcher import AnswerBook
from proxy.replay.replayer import replay_recording
from proxy.testing.rig import RecordingProxy, ThreadedReplayServer, official_session, rules_hook

PULSAR_TAP = [sys.executable, "-m", "proxy"]
PRODUCER_ERROR_RULES = """\
rules:
  - name: refuse-producers
    match: {command: [PRODUCER], direction: to_broker}
    action: {error: {code: ServiceNotReady, message: refused by the test}}
"""


def _pulsar_tap(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PULSAR_TAP, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=Path(__file__).resolve().parents[2])


def _read_all(service_url: str, topic: str, subscription: str, count: int, *,
              initial_position: Any = None) -> list[bytes]:
    client = pulsar.Client(service_url, operation_timeout_seconds=10)
    try:
        consumer = client.subscribe(topic, subscription, initial_position=initial_position or
                                    pulsar.InitialPosition.Earliest)
        received = []
        while len(received) < count:
            message = consumer.receive(timeout_millis=10_000)
            received.append(message.data())
            consumer.acknowledge(message)
        consumer.close()
        return received
    finally:
        client.close()


# -- recording and show ------------------------------------------------------------------------

def test_show_lists_every_frame_and_json_counts_match_what_the_proxy_saw(official_recording: OfficialRecording) -> None:
    rec = official_recording
    result = _pulsar_tap("show", str(rec.path), "--json")
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    counts = Counter((obj["direction"], obj["origin"], obj["command"]) for obj in lines)
    assert counts == Counter(rec.sent)  # the proxy's own observer counted the same frames
    assert len(lines) == rec.stats.frames_recorded == sum(rec.sent.values())
    assert rec.stats.frames_dropped == 0
    # 1 000 messages went out in LZ4 batches and came back the same way
    sends = [o for o in lines if o["command"] == "SEND"]
    assert sum(o["num_messages"] for o in sends) == 1000 and {o["compression"] for o in sends} == {"LZ4"}
    assert sum(o["num_messages"] for o in lines if o["command"] == "MESSAGE") == 1000
    assert [o["ts_ns"] for o in lines] == sorted(o["ts_ns"] for o in lines)
    # the readable timeline has one line per frame, then its summary
    plain = _pulsar_tap("show", str(rec.path), "--color", "never")
    assert plain.returncode == 0, plain.stderr
    timeline = [line for line in plain.stdout.splitlines() if " conn " in line]
    assert len(timeline) == len(lines)
    assert Counter(obj["command"] for obj in lines) == Counter(line.split()[5] for line in timeline)


def _png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """Width, height and the unfiltered rows of an 8-bit RGB(A) PNG (what Chromium writes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", b""
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, colour = struct.unpack(">IIBB", header[:10])
    assert depth == 8 and colour in (2, 6)
    bpp = 3 if colour == 2 else 4
    raw, stride, rows, previous = zlib.decompress(idat), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for x in range(stride):
            left = line[x - bpp] if x >= bpp else 0
            up, up_left = previous[x], previous[x - bpp] if x >= bpp else 0
            if kind == 1:
                line[x] = (line[x] + left) & 0xFF
            elif kind == 2:
                line[x] = (line[x] + up) & 0xFF
            elif kind == 3:
                line[x] = (line[x] + (left + up) // 2) & 0xFF
            elif kind == 4:
                p = left + up - up_left
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - up_left)
                line[x] = (line[x] + (left if pa <= pb and pa <= pc else up if pb <= pc else up_left)) & 0xFF
        rows.append(bytes(line))
        previous = line
    return width, height, [bytes(r[i:i + 3]) for r in rows for i in range(0, stride, bpp)]  # type: ignore[misc]


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="chromium is not installed (bash scripts/setup.sh, or apt-get install -y chromium)")
def test_the_sequence_diagram_opens_in_headless_chromium(official_recording: OfficialRecording,
                                                         tmp_path: Path) -> None:
    html = tmp_path / "session.html"
    result = _pulsar_tap("show", str(official_recording.path), "--diagram", str(html))
    assert result.returncode == 0, result.stderr
    text = html.read_text()
    positions = [text.find(name) for name in ("CONNECT ", "CONNECTED", "LOOKUP ", "PRODUCER ", "SEND ")]
    assert -1 not in positions, positions
    assert text.find("PRODUCER ") < text.find("SEND ")
    png = tmp_path / "shot.png"
    chromium = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
         f"--screenshot={png}", "--window-size=1280,1600", html.as_uri()],
        capture_output=True, text=True, timeout=90)
    assert png.exists(), chromium.stderr[-2000:]
    assert png.stat().st_size > 20_000
    width, height, pixels = _png_pixels(png.read_bytes())
    assert (width, height) == (1280, 1600)
    colours = Counter(pixels)
    assert len(colours) > 50  # text, lanes and arrows, not a blank page
    _background, share = colours.most_common(1)[0]
    assert share < 0.97 * len(pixels)
    # arrows are drawn in colour (blue requests, green answers): some strongly coloured pixels exist
    assert sum(n for (r, g, b), n in colours.items() if max(r, g, b) - min(r, g, b) > 80) > 500


# -- client-side replay ------------------------------------------------------------------------

def test_client_side_replay_into_a_fresh_broker_repeats_every_message_and_differs_nowhere(
        official_recording: OfficialRecording, broker_cluster: BrokerClusterFactory) -> None:
    cluster = broker_cluster(brokers=2)
    result = _pulsar_tap("replay", str(official_recording.path), "--upstream", cluster.service_url, "--speed", "0")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == ""
    assert "0 differ" in result.stderr
    received = _read_all(cluster.service_url, official_recording.topic, "after-replay", 1000)
    assert sorted(received) == sorted(official_recording.payloads)


def test_client_side_replay_keeps_keys_and_properties(official_recording: OfficialRecording,
                                                      broker_cluster: BrokerClusterFactory) -> None:
    cluster = broker_cluster()
    result = trio.run(lambda: replay_recording(str(official_recording.path), cluster.service_url, speed=0))
    assert result.diffs == []
    client = pulsar.Client(cluster.service_url, operation_timeout_seconds=10)
    try:
        consumer = client.subscribe(official_recording.topic, "keys", initial_position=pulsar.InitialPosition.Earliest)
        for _ in range(20):
            message = consumer.receive(timeout_millis=10_000)
            index = int(message.properties()["index"])
            assert message.partition_key() == f"key-{index % 7}"
            assert message.data() == official_recording.payloads[index]
    finally:
        client.close()


def test_client_side_replay_names_the_request_an_error_rule_refused(official_recording: OfficialRecording,
                                                                    broker_cluster: BrokerClusterFactory) -> None:
    cluster = broker_cluster()
    with RecordingProxy(cluster.service_url, hook=rules_hook(PRODUCER_ERROR_RULES)) as proxy:
        result = _pulsar_tap("replay", str(official_recording.path), "--upstream", proxy.service_url,
                             "--speed", "0", "--timeout", "3")
    assert result.returncode == 1, result.stderr
    diffs = result.stdout.splitlines()
    assert all(line.startswith("DIFF conn=") for line in diffs)
    producer = [line for line in diffs if " PRODUCER " in line]
    assert len(producer) == 1
    assert producer[0].endswith(f"PRODUCER topic={official_recording.topic} recorded=ok "
                                "replayed=error:ServiceNotReady")
    # the lookups and the subscription were answered as before: they are not differences
    assert not [line for line in diffs if " LOOKUP " in line or " SUBSCRIBE " in line]


def test_client_side_replay_paces_by_speed(broker_cluster: BrokerClusterFactory) -> None:
    """The sample recording spans some milliseconds; at speed 0.05 it takes 20 times as long."""
    sample = Path(__file__).resolve().parents[2] / "recordings" / "sample"
    frames = list(open_recordings(sample).frames())
    span = (frames[-1].ts_ns - frames[0].ts_ns) / 1e9
    cluster = broker_cluster()
    started = time.monotonic()
    result = trio.run(lambda: replay_recording(str(sample), cluster.service_url, speed=0.05))
    elapsed = time.monotonic() - started
    assert result.diffs == []
    assert elapsed >= span / 0.05 * 0.8


# -- broker-side replay ------------------------------------------------------------------------

def _wait_for_ready_file(path: Path, process: subprocess.Popen[str], timeout: float = 20) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().endswith("\n"):
            data: dict[str, Any] = json.loads(path.read_text())
            return data
        if process.poll() is not None:
            raise AssertionError(f"replay --serve exited: {process.communicate()}")
        time.sleep(0.05)
    raise AssertionError("replay --serve did not become ready")


def test_broker_side_replay_serves_a_fresh_official_consumer_and_producer(official_recording: OfficialRecording,
                                                                          tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    process = subprocess.Popen([*PULSAR_TAP, "replay", str(official_recording.path), "--serve", "--listen",
                                "127.0.0.1:0", "--ready-file", str(ready)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        [address] = _wait_for_ready_file(ready, process)["listen"]
        url = f"pulsar://{address}"
        received = _read_all(url, official_recording.topic, official_recording.subscription, 1000)
        assert sorted(received) == sorted(official_recording.payloads)
        client = pulsar.Client(url, operation_timeout_seconds=10)
        try:
            producer = client.create_producer(official_recording.topic, batching_enabled=False)
            receipts = [producer.send(b"replayed %d" % i) for i in range(12)]
            assert len({(m.ledger_id(), m.entry_id()) for m in receipts}) == 12
        finally:
            client.close()
    finally:
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=20)
    assert process.returncode == 0, err
    assert out.startswith(f"ready: listening on {address}\n")


def _book(rec: OfficialRecording) -> AnswerBook:
    return AnswerBook.from_conversations(build_conversations(open_recordings(rec.path).frames()).values())


def test_broker_side_replay_serves_many_clients_at_once(official_recording: OfficialRecording) -> None:
    with ThreadedReplayServer(_book(official_recording)) as server:
        results: list[list[bytes]] = []
        errors: list[BaseException] = []

        def consume() -> None:
            try:
                results.append(_read_all(server.service_url, official_recording.topic,
                                         official_recording.subscription, 1000))
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=consume) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    assert not errors and len(results) == 3
    assert all(sorted(r) == sorted(official_recording.payloads) for r in results)
    assert server.server.stats.connections >= 3  # one connection per client at least


async def test_broker_side_replay_answers_an_unrecorded_request_with_not_in_recording(
        official_recording: OfficialRecording) -> None:
    server = ThreadedReplayServer(_book(official_recording))
    await trio.to_thread.run_sync(server.start)
    try:
        host, port = server.server.address.rsplit(":", 1)
        address = BrokerAddress(host, int(port))
        connection = ClientConnection(address, address, ConnectionConfig(operation_timeout=5))
        with trio.fail_after(15):
            async with trio.open_nursery() as nursery:
                await nursery.start(connection.serve)
                with pytest.raises(BrokerError) as refused:
                    await connection.request(api.CommandSubscribe(
                        topic=official_recording.topic, subscription="never-recorded",
                        subType=api.CommandSubscribe.Exclusive, consumer_id=1, request_id=connection.new_request_id()))
                assert (refused.value.server_error, refused.value.message) == ("UnknownError", "not in recording")
                connection.close()
    finally:
        await trio.to_thread.run_sync(server.stop)


def test_broker_side_replay_forwards_what_it_cannot_answer(official_recording: OfficialRecording,
                                                           broker_cluster: BrokerClusterFactory) -> None:
    cluster = broker_cluster()
    with ThreadedReplayServer(_book(official_recording), unmatched="forward", upstream=cluster.service_url) as server:
        client = pulsar.Client(server.service_url, operation_timeout_seconds=10)
        try:
            producer = client.create_producer("persistent://public/default/not-recorded", batching_enabled=False)
            for i in range(5):
                producer.send(b"live %d" % i)
        finally:
            client.close()
    # the messages reached the real broker
    assert _read_all(cluster.service_url, "persistent://public/default/not-recorded", "check", 5) == [
        b"live %d" % i for i in range(5)]


def test_serve_refuses_bad_input_with_one_line() -> None:
    missing = _pulsar_tap("replay", "/nonexistent/recording", "--serve", "--listen", "127.0.0.1:0")
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "no such file" in missing.stderr
    sample = str(Path(__file__).resolve().parents[2] / "recordings" / "sample")
    forward = _pulsar_tap("replay", sample, "--serve", "--unmatched", "forward", "--listen", "127.0.0.1:0")
    assert forward.returncode == 2 and "--upstream" in forward.stderr
    listen = _pulsar_tap("replay", sample, "--serve", "--listen", "nowhere")
    assert listen.returncode == 2 and "--listen" in listen.stderr
    unreachable = _pulsar_tap("replay", sample, "--upstream", "pulsar://127.0.0.1:1", "--speed", "0")
    assert unreachable.returncode == 2 and "cannot reach the upstream" in unreachable.stderr
    assert "Traceback" not in unreachable.stderr + listen.stderr + forward.stderr + missing.stderr


def test_the_sample_recording_serves_and_replays(broker_cluster: BrokerClusterFactory) -> None:
    sample = Path(__file__).resolve().parents[2] / "recordings" / "sample"
    assert sum(p.stat().st_size for p in sample.iterdir()) < 1 << 20
    book = AnswerBook.from_conversations(build_conversations(open_recordings(sample).frames()).values())
    [(topic, subscription)] = list(book.messages)
    with ThreadedReplayServer(book) as server:
        assert len(_read_all(server.service_url, topic, subscription, 200)) == 200
    cluster = broker_cluster()
    result = _pulsar_tap("replay", str(sample), "--upstream", cluster.service_url, "--speed", "0")
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


def test_serve_stops_cleanly_on_sigint() -> None:
    sample = Path(__file__).resolve().parents[2] / "recordings" / "sample"
    process = subprocess.Popen([*PULSAR_TAP, "replay", str(sample), "--serve", "--listen", "127.0.0.1:0"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("ready: listening on 127.0.0.1:")
    finally:
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=20)
    assert process.returncode == 0, err


def test_a_recording_without_payloads_replays_with_valid_checksums(broker_cluster: BrokerClusterFactory,
                                                                   tmp_path: Path) -> None:
    """With ``include_payloads: false`` the payloads are zero-filled; replay re-checksums them.

    (Unbatched and uncompressed, so that the zeros are still readable messages.)
    """
    source = broker_cluster()
    with RecordingProxy(source.service_url, tmp_path, include_payloads=False) as proxy:
        official_session(proxy.service_url, "persistent://public/default/stripped", "s", 50, batching=False,
                         compression="NONE")
        recording = proxy.recording_path
    target = broker_cluster()
    result = trio.run(lambda: replay_recording(str(recording), target.service_url, speed=0))
    assert result.diffs == []
    received = _read_all(target.service_url, "persistent://public/default/stripped", "check", 50)
    assert len(received) == 50 and all(set(payload) == {0} for payload in received)
