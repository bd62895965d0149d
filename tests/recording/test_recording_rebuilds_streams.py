"""What ``pulsar-tap run --record`` writes rebuilds the streams that passed, with rules firing (i17 audit).

The official client sends asynchronously, batching off and on, through a byte tee in front
of a real ``pulsar-tap run`` process (``proxy-through``, so every client connection passes
the tee) whose rules delay receipts, drop acks and close the producer (a topic unload
mid-stream: the client re-creates it and resends).  After SIGTERM, each connection's
recorded client frames joined are exactly the bytes the client wrote, and the frames the
client read appear among the recorded ones towards it, in order.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pulsar

from proxy.broker.embedded import ThreadedCluster
from proxy.protocol.frame import FrameDecoder
from proxy.recording.reader import Recording, find_recordings

RULES = """
seed: 5
rules:
  - name: slow-receipts
    match: {command: [SEND_RECEIPT], probability: 0.3}
    action: {delay: {ms: 15, jitter_ms: 10}}
  - name: unload
    match: {command: [SEND], after: 150, times: 2}
    action: close
  - name: lose-acks
    match: {command: [ACK], probability: 0.5}
    action: drop
"""


class Tee:
    """A loopback TCP relay that keeps each connection's bytes, keyed by its local port towards the proxy."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.streams: dict[int, tuple[bytearray, bytearray]] = {}
        self._sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.upstream, timeout=10)
            self._sockets += [client, upstream]
            sent, received = bytearray(), bytearray()
            self.streams[upstream.getsockname()[1]] = (sent, received)
            threading.Thread(target=self._pump, args=(client, upstream, sent), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, received), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, target: socket.socket, kept: bytearray) -> None:
        while True:
            try:
                data = source.recv(1 << 20)
            except OSError:
                data = b""
            if not data:
                with contextlib.suppress(OSError):
                    target.shutdown(socket.SHUT_WR)
                return
            kept += data
            try:
                target.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        for sock in self._sockets:
            sock.close()


def test_the_recording_rebuilds_what_passed_while_rules_delay_drop_and_close(
        broker: ThreadedCluster, tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    tee: Tee | None = None
    proxy = subprocess.Popen(
        [sys.executable, "-m", "proxy", "run", "--listen", "127.0.0.1:0", "--upstream", broker.service_url,
         "--lookup", "proxy-through", "--rules", str(rules), "--record", str(tmp_path / "rec"),
         "--drain-seconds", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proxy.stdout is not None
        tee = Tee(proxy.stdout.readline().split()[-1])
        client = pulsar.Client(f"pulsar://{tee.address}", operation_timeout_seconds=30,
                               logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
        consumer = client.subscribe("orders", "audit", initial_position=pulsar.InitialPosition.Earliest)
        failed: list[pulsar.Result] = []
        sent: list[bytes] = []
        for batching in (False, True):
            producer = client.create_producer("orders", batching_enabled=batching, send_timeout_millis=30_000,
                                              max_pending_messages=2000, batching_max_publish_delay_ms=1)
            for i in range(400):
                body = b"%d-%05d " % (batching, i) + bytes(i * 7 % 3000)
                sent.append(body)
                producer.send_async(body, lambda result, _: result == pulsar.Result.Ok or failed.append(result))
            producer.flush()
        got = set()
        while len(got) < len(sent):
            message = consumer.receive(10_000)
            got.add(message.data())
            consumer.acknowledge(message)
        client.close()
        assert not failed and got == set(sent)
        proxy.send_signal(signal.SIGTERM)
        assert proxy.wait(20) == 0
    finally:
        if proxy.poll() is None:
            proxy.kill()
        _, stderr = proxy.communicate()
        if tee is not None:
            tee.close()
    assert "Traceback" not in stderr
    [directory] = find_recordings(tmp_path / "rec")
    recording = Recording(directory)
    assert not recording.report.problems() and recording.frames_dropped == 0
    frames = list(recording.frames())
    checked = 0
    for conn, info in recording.connections.items():
        written, read = tee.streams[info.client.port]
        recorded_from_client = b"".join(f.data for f in frames
                                        if f.conn == conn and f.direction == "to_broker" and f.origin == "client")
        assert recorded_from_client == bytes(written), f"conn {conn}"
        towards_client = iter(f.data for f in frames if f.conn == conn and f.direction == "to_client")
        for frame in FrameDecoder(64 << 20).receive(bytes(read)):
            assert any(recorded == frame.raw for recorded in towards_client), f"conn {conn}: {frame!r} not recorded"
        checked += 1
    assert checked == len(tee.streams) >= 2
    rule_fired = {name for f in frames for name in f.rules}
    assert {"slow-receipts", "unload"} <= rule_fired
