"""A recording holding strings that are not UTF-8 (made before the wire refused them) reads everywhere.

Issue #12, item 2: one client's LOOKUP for ``persistent://public/default/x\\xff\\xfe`` made
``show``, ``show --json`` and ``--diagram`` exit 1 with a TypeError.  Every reader of
recorded frames shows such text escaped and goes on.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from recording_sessions import BASE_NS, SentFrame, record_sessions, session

from proxy.analytics.steps import analyze_in_process
from proxy.cli import main
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import encode_command, encode_payload_command
from proxy.recording.reader import open_recordings
from proxy.replay.conversation import build_conversations

BAD_TOPIC = b"persistent://public/default/x\xff\xfe"
SHOWN_TOPIC = "persistent://public/default/x\\xff\\xfe"


def _with_bad_bytes(raw: bytes, good: bytes, bad: bytes) -> bytes:
    """The frame with ``good`` replaced by ``bad`` of the same length (so no size changes)."""
    assert len(good) == len(bad) and raw.count(good) == 1
    return raw.replace(good, bad)


def bad_text_frames(conn: int) -> list[SentFrame]:
    t = BASE_NS + 10_000_000
    good_topic = b"persistent://public/default/xyz"
    lookup = _with_bad_bytes(encode_command(api.CommandLookupTopic(topic=good_topic.decode(), request_id=90)),
                             good_topic, BAD_TOPIC)
    producer = _with_bad_bytes(encode_command(api.CommandProducer(
        topic=good_topic.decode(), producer_id=9, request_id=91, producer_name="name-ok")), good_topic, BAD_TOPIC)
    message = _with_bad_bytes(encode_payload_command(
        api.CommandSend(producer_id=9, sequence_id=1), api.MessageMetadata(
            producer_name="prod-ok", sequence_id=1, publish_time=1), b"payload"), b"prod-ok", b"prod\xff\xfe!")
    return [SentFrame(conn, "to_broker", "client", t + 1, lookup, "LOOKUP"),
            SentFrame(conn, "to_broker", "client", t + 2, producer, "PRODUCER"),
            SentFrame(conn, "to_broker", "client", t + 3, message, "SEND")]


@pytest.fixture
async def recording(tmp_path: Path) -> Path:
    frames = session(conn=1) + bad_text_frames(1)
    await record_sessions(str(tmp_path / "rec"), [sorted(frames, key=lambda f: f.ts_ns)])
    return tmp_path / "rec"


async def test_show_prints_the_bad_text_escaped(recording: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(recording), "--color", "never"]) == 0
    out = capsys.readouterr().out
    assert SHOWN_TOPIC in out and "Traceback" not in out


async def test_show_json_is_valid_json_with_the_bad_text_escaped(recording: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(recording), "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    lookups = [line for line in lines if line["command"] == "LOOKUP" and line["fields"]["request_id"] == 90]
    assert lookups[0]["fields"]["topic"] == SHOWN_TOPIC
    sends = [line for line in lines if line["command"] == "SEND" and line.get("topic") == SHOWN_TOPIC]
    assert sends, "the SEND of the producer with the bad topic is attributed to it"


async def test_the_diagram_and_the_pcap_are_written(recording: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(recording), "--diagram", str(tmp_path / "d.html")]) == 0
    assert SHOWN_TOPIC.replace("\\", "\\\\") in (tmp_path / "d.html").read_text() \
        or "x\\xff\\xfe" in (tmp_path / "d.html").read_text()
    assert main(["export", str(recording), "--pcap", str(tmp_path / "r.pcapng")]) == 0
    assert (tmp_path / "r.pcapng").stat().st_size > 1000


async def test_replay_and_analyze_read_the_recording(recording: Path, tmp_path: Path) -> None:
    frames = list(open_recordings(str(recording)).frames())
    conversations = build_conversations(frames)
    assert conversations
    result = analyze_in_process([str(recording)], str(tmp_path / "out"))
    assert not result.figures.skipped
    topics = pq.read_table(tmp_path / "out" / "frames").column("topic").to_pylist()
    assert SHOWN_TOPIC in topics
    producers = pq.read_table(tmp_path / "out" / "messages").column("producer_name").to_pylist()
    assert "prod\\xff\\xfe!" in producers
