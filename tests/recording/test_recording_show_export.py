"""`pulsar-tap show` (text, --json, filters, --diagram) and `export --pcap`, on recordings made by the recorder."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import subprocess
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import pytest
from recording_sessions import BASE_NS, TOPIC, record_sessions, session

from proxy.broker.cluster import ClusterConfig
from proxy.broker.embedded import ThreadedCluster
from proxy.cli import main
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import frame_from_bytes
from proxy.recording.export import export_pcap
from proxy.recording.reader import open_recordings
from proxy.recording.show import ShowOptions, show
from proxy.testing.rig import RecordingProxy, official_session

DISSECTOR = Path(__file__).resolve().parents[2] / "recordings" / "pulsar.lua"


@pytest.fixture
async def two_sessions(tmp_path: Path) -> tuple[Path, list]:  # type: ignore[type-arg]
    sessions = [session(conn=1), session(conn=2, start_ns=BASE_NS + 75_000, sends=5)]
    await record_sessions(str(tmp_path / "rec"), sessions)
    return tmp_path / "rec", [f for s in sessions for f in s]


def _json_lines(path: Path, *extra: str, capsys: pytest.CaptureFixture[str]) -> list[dict]:  # type: ignore[type-arg]
    assert main(["show", str(path), "--json", *extra]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


async def test_json_lists_every_frame_with_the_fields_spec_fixes(two_sessions, capsys) -> None:  # type: ignore[no-untyped-def]
    path, sent = two_sessions
    lines = _json_lines(path, capsys=capsys)
    assert len(lines) == len(sent)
    assert Counter(obj["command"] for obj in lines) == Counter(f.command for f in sent)
    assert [obj["ts_ns"] for obj in lines] == sorted(f.ts_ns for f in sent)
    by_ts = {f.ts_ns: f for f in sent}
    for obj in lines:
        frame = by_ts[obj["ts_ns"]]
        assert {"ts_ns", "conn", "direction", "origin", "command", "size", "fields"} <= obj.keys()
        assert (obj["conn"], obj["direction"], obj["origin"], obj["size"]) == \
            (frame.conn, frame.direction, frame.origin, len(frame.raw))
        assert isinstance(obj["conn"], int)
        if obj["command"] in ("SEND", "MESSAGE"):
            section = frame_from_bytes(frame.raw).payload
            assert section is not None
            assert obj["payload_size"] == len(section.payload)
            assert obj["num_messages"] == (10 if obj["command"] == "SEND" else 1)
            assert obj["compression"] == ("LZ4" if obj["command"] == "SEND" else "NONE")
        else:
            assert "num_messages" not in obj
    connect = next(o for o in lines if o["command"] == "CONNECT")
    assert connect["fields"]["client_version"] == "Pulsar-CPP-v3.7"
    assert base64.b64decode(connect["fields"]["auth_data"]).startswith(b"REDACTED")
    lookup = next(o for o in lines if o["command"] == "LOOKUP_RESPONSE" and o["origin"] == "proxy")
    assert lookup["fields"]["brokerServiceUrl"] == "pulsar://127.0.0.1:7001"
    assert lookup["fields"]["response"] == "Connect" and lookup["rules"] == ["rewrite-lookup"]
    subscribe = next(o for o in lines if o["command"] == "SUBSCRIBE")
    assert subscribe["fields"]["subType"] == "Shared" and subscribe["fields"]["request_id"] == 3


async def test_responses_carry_latency_and_id_only_commands_their_topic(two_sessions, capsys) -> None:  # type: ignore[no-untyped-def]
    path, _ = two_sessions
    lines = _json_lines(path, capsys=capsys)
    receipts = [o for o in lines if o["command"] == "SEND_RECEIPT"]
    assert receipts and all(o["latency_us"] == 150.0 and o["request"] == "SEND" for o in receipts)
    assert all(o["topic"] == TOPIC for o in lines if o["command"] in ("SEND", "MESSAGE", "ACK", "FLOW"))


async def test_filters_by_connection_topic_and_command(two_sessions, capsys) -> None:  # type: ignore[no-untyped-def]
    path, sent = two_sessions
    only_conn2 = _json_lines(path, "--conn", "2", capsys=capsys)
    assert len(only_conn2) == sum(1 for f in sent if f.conn == 2)
    sends = _json_lines(path, "--command", "send,SEND_RECEIPT", capsys=capsys)
    assert len(sends) == sum(1 for f in sent if f.command in ("SEND", "SEND_RECEIPT"))
    topical = _json_lines(path, "--topic", "persistent://public/default/ord*", capsys=capsys)
    assert {o["command"] for o in topical} >= {"LOOKUP", "PRODUCER", "SEND", "SEND_RECEIPT", "MESSAGE", "ACK"}
    assert "CONNECT" not in {o["command"] for o in topical}
    assert _json_lines(path, "--topic", "persistent://other/*", capsys=capsys) == []
    assert main(["show", str(path), "--command", "NOT_A_COMMAND"]) == 2
    assert "unknown command type" in capsys.readouterr().err


async def test_text_timeline_is_plain_unless_colour_is_asked(two_sessions) -> None:  # type: ignore[no-untyped-def]
    path, sent = two_sessions
    out, err = io.StringIO(), io.StringIO()
    assert show(str(path), ShowOptions.from_args(), out, err) == 0
    lines = out.getvalue().splitlines()
    assert len(lines) == len(sent) and "\x1b[" not in out.getvalue()
    receipt = next(line for line in lines if "SEND_RECEIPT" in line)
    assert "latency 150 us" in receipt and TOPIC in receipt and "message_id=7:0" in receipt
    assert "C->B" in lines[0] and "CONNECT" in lines[0] and "(auth redacted)" in lines[0]
    assert any("P->C" in line and "rules: rewrite-lookup" in line for line in lines)
    assert f"{len(sent)} frames; 2 connections" in err.getvalue()
    coloured = io.StringIO()
    show(str(path), ShowOptions.from_args(color="always"), coloured, io.StringIO())
    assert "\x1b[" in coloured.getvalue()


class _Collector(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: Counter[str] = Counter()
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags[tag] += 1
        assert not (tag == "script" or any(v and "http" in v and k in ("src", "href") for k, v in attrs))

    def handle_data(self, data: str) -> None:
        self.text.append(data)


async def test_diagram_is_a_self_contained_page_with_client_proxy_broker_lanes(two_sessions, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path, sent = two_sessions
    out = tmp_path / "diagram.html"
    assert main(["show", str(path), "--diagram", str(out), "--conn", "1"]) == 0
    parser = _Collector()
    parser.feed(out.read_text())
    text = " ".join(parser.text)
    assert parser.tags["svg"] == 1 and parser.tags["line"] >= sum(1 for f in sent if f.conn == 1)
    for word in ("client", "proxy", "broker", "Connection 1", "CONNECT", "CONNECTED", "LOOKUP", "PRODUCER",
                 "SEND"):
        assert word in text
    assert "Connection 2" not in text
    assert text.index("CONNECTED") < text.index("LOOKUP_RESPONSE") < text.index("PRODUCER_SUCCESS") \
        < text.index("SEND_RECEIPT")


def _tshark(*args: str) -> str:
    return subprocess.run(["tshark", *args], capture_output=True, text=True, check=True, timeout=60).stdout


@pytest.mark.skipif(shutil.which("tshark") is None,
                    reason="tshark is not installed (bash scripts/setup.sh or apt-get install -y tshark)")
async def test_tshark_reads_the_pcap_as_one_tcp_conversation_per_connection(two_sessions, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path, sent = two_sessions
    out = tmp_path / "out.pcapng"
    summary = export_pcap(str(path), str(out))
    conv = _tshark("-r", str(out), "-q", "-z", "conv,tcp")
    rows = [line.split() for line in conv.splitlines() if "<->" in line]
    assert {(r[0], r[2]) for r in rows} == {("127.0.0.1:50001", "127.0.0.1:6650"),
                                            ("127.0.0.1:50002", "127.0.0.1:6650")}
    # payload bytes per connection and direction are the recorded frame sizes
    fields = _tshark("-r", str(out), "-o", "tcp.check_checksum:TRUE", "-o", "ip.check_checksum:TRUE", "-T", "fields",
                     "-e", "tcp.srcport", "-e", "tcp.len", "-e", "tcp.checksum.status", "-e", "ip.checksum.status",
                     "-e", "frame.time_epoch")
    payload: Counter[int] = Counter()
    packets = 0
    for line in fields.splitlines():
        sport, length, tcp_ok, ip_ok, _ = line.split("\t")
        assert tcp_ok == "1" and ip_ok == "1"  # checksums verified good
        payload[int(sport)] += int(length)
        packets += 1
    for conn in (1, 2):
        assert payload[50000 + conn] == sum(len(f.raw) for f in sent if f.conn == conn and f.direction == "to_broker")
    assert payload[6650] == sum(len(f.raw) for f in sent if f.direction == "to_client")
    assert packets == summary.packets == len(sent) + 2 * 6
    # the conversation table counts every packet written
    total_frames = sum(int(r[9]) for r in rows)  # a <-> b, then frames+bytes for <-, ->, total
    assert total_frames == packets
    first_ts = float(fields.splitlines()[0].split("\t")[4])
    assert abs(first_ts - BASE_NS / 1e9) < 1


async def test_pcap_of_a_recording_without_payloads_keeps_frame_sizes(tmp_path: Path) -> None:
    frames = session()
    await record_sessions(str(tmp_path / "rec"), [frames], include_payloads=False)
    summary = export_pcap(str(tmp_path / "rec"), str(tmp_path / "out.pcapng"))
    assert summary.payload_bytes[1] == (sum(len(f.raw) for f in frames if f.direction == "to_broker"),
                                        sum(len(f.raw) for f in frames if f.direction == "to_client"))
    assert (tmp_path / "out.pcapng").read_bytes()[:4] == bytes.fromhex("0a0d0d0a")


def test_message_fields_keep_proto_names() -> None:
    from proxy.recording.timeline import message_fields

    fields = message_fields(api.CommandLookupTopicResponse(request_id=1, brokerServiceUrl="pulsar://b:6650",
                                                           response=api.CommandLookupTopicResponse.Redirect))
    assert fields == {"request_id": 1, "brokerServiceUrl": "pulsar://b:6650", "response": "Redirect"}


def _official_recording(tmp_path: Path, brokers: int = 2) -> tuple[Path, set[str]]:
    """The official client produces and consumes on a 2-partition topic through a recording proxy."""
    cluster = ThreadedCluster(ClusterConfig(brokers=brokers, auto_partitions=2)).start()
    try:
        with RecordingProxy(cluster.service_url, tmp_path / "rec") as proxy:
            official_session(proxy.service_url, "persistent://public/default/pcap-brokers", "s", 50)
        assert proxy.recorder is not None
        return proxy.recording_path, set(cluster.addresses)
    finally:
        cluster.stop()


def test_recordings_keep_each_connections_broker_in_the_index_and_the_opened_record(tmp_path: Path) -> None:
    recording, brokers = _official_recording(tmp_path)
    [rec] = open_recordings(recording).recordings
    assert rec.index is not None and rec.index.connections
    index_brokers = {f"{c.broker.host}:{c.broker.port}" for c in rec.index.connections if c.HasField("broker")}
    assert len(index_brokers) >= 2 and index_brokers <= brokers  # every partition's owner, and the bootstrap
    assert all(c.HasField("broker") for c in rec.index.connections)
    opened = [r.opened for r in rec.records() if r.HasField("opened")]
    assert {f"{o.broker.host}:{o.broker.port}" for o in opened} == index_brokers


@pytest.mark.skipif(shutil.which("tshark") is None,
                    reason="tshark is not installed (bash scripts/setup.sh or apt-get install -y tshark)")
def test_the_pcap_of_an_official_client_recording_shows_the_real_brokers_and_decodes_as_pulsar(
        tmp_path: Path) -> None:
    recording, brokers = _official_recording(tmp_path)
    out = tmp_path / "official.pcapng"
    assert main(["export", str(recording), "--pcap", str(out)]) == 0
    conv = _tshark("-r", str(out), "-q", "-z", "conv,tcp")
    seen = set(re.findall(r"<-> (127\.0\.0\.1:\d+)", conv)) | set(re.findall(r"^(127\.0\.0\.1:\d+)\s+<->", conv, re.M))
    assert seen & brokers and "198.51.100.1" not in conv
    # the shipped dissector, on the brokers' ports, as FORMAT.md says: every frame decodes
    decode_as = [arg for address in sorted(brokers)
                 for arg in ("-d", f"tcp.port=={address.rsplit(':', 1)[1]},pulsar")]
    text = _tshark("-X", f"lua_script:{DISSECTOR}", "-r", str(out), *decode_as)
    assert "Pulsar: CONNECT" in text and "Pulsar: SEND_RECEIPT" in text and "Pulsar: MESSAGE" in text
    assert "Malformed" not in text, text
    damaged = _tshark("-X", f"lua_script:{DISSECTOR}", "-r", str(_damaged_copy(out, tmp_path)), *decode_as)
    assert "Malformed" in damaged  # and it would say so


def _damaged_copy(pcap: Path, tmp_path: Path) -> Path:
    """The pcap with the checksum magic of every payload section broken (0x0e01 -> 0x0e0f)."""
    data = pcap.read_bytes()
    damaged = tmp_path / "damaged.pcapng"
    damaged.write_bytes(data.replace(b"\x0e\x01", b"\x0e\x0f"))
    return damaged


def test_the_shipped_dissector_names_every_command_the_protocol_defines() -> None:
    table = dict(re.findall(r"\[(\d+)\] = \"([A-Z_]+)\"", DISSECTOR.read_text(encoding="utf-8")))
    assert {int(k): v for k, v in table.items()} == {int(v): n for n, v in api.BaseCommand.Type.items()}
