"""The relay's fast path: frame boundaries found without decoding, bytes passed through untouched."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.scanner import _CHECKED_TOGETHER, FrameScanner
from proxy.errors import BadMagic, FrameTooLarge, MalformedFrame, ProtocolError, UnknownCommand
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import Frame, encode_command, encode_payload_command
from proxy.protocol.validation import CommandBatch

T = api.BaseCommand.Type


def send_frame(size: int, seq: int = 0) -> bytes:
    return encode_payload_command(api.CommandSend(producer_id=1, sequence_id=seq),
                                  api.MessageMetadata(producer_name="p", sequence_id=seq, publish_time=1),
                                  b"x" * size)


def lookup_response() -> bytes:
    return encode_command(api.CommandLookupTopicResponse(
        request_id=7, response=api.CommandLookupTopicResponse.Connect, brokerServiceUrl="pulsar://10.0.0.1:6650"))


PING = encode_command(api.CommandPing())
FLOW = encode_command(api.CommandFlow(consumer_id=3, messagePermits=1000))


def collect(scanner: FrameScanner, chunks: list[bytes]) -> tuple[bytes, list[Frame]]:
    """Everything the scanner let through, re-joined, and the wanted frames it handed out."""
    passed = bytearray()
    frames: list[Frame] = []
    for chunk in chunks:
        for piece in scanner.feed(chunk):
            if isinstance(piece, Frame):
                frames.append(piece)
                passed += piece.raw
            else:
                passed += piece
    return bytes(passed), frames


def test_unwanted_frames_pass_through_as_one_slice_of_the_input() -> None:
    data = send_frame(100) * 50 + FLOW + PING
    scanner = FrameScanner()
    pieces = scanner.feed(data)
    assert len(pieces) == 1
    assert bytes(pieces[0]) == data  # type: ignore[arg-type]
    assert scanner.frames_scanned == 52


def test_wanted_frames_come_out_whole_between_pass_through_runs() -> None:
    data = FLOW + lookup_response() + send_frame(10)
    scanner = FrameScanner(wanted={T.LOOKUP_RESPONSE})
    pieces = scanner.feed(data)
    assert [type(p).__name__ for p in pieces] == ["memoryview", "Frame", "memoryview"]
    frame = pieces[1]
    assert isinstance(frame, Frame) and frame.type == T.LOOKUP_RESPONSE
    assert frame.command.lookupTopicResponse.request_id == 7


@pytest.mark.parametrize("want_all", [False, True])
def test_every_split_point_yields_the_same_bytes_and_frames(want_all: bool) -> None:
    data = lookup_response() + send_frame(300) + PING + lookup_response() + FLOW
    for cut in range(1, len(data)):
        scanner = FrameScanner(wanted={T.LOOKUP_RESPONSE}, want_all=want_all)
        passed, frames = collect(scanner, [data[:cut], data[cut:]])
        assert passed == data, cut
        assert len(frames) == (5 if want_all else 2)
        assert scanner.at_frame_boundary


def test_a_large_frame_streams_through_without_being_held() -> None:
    big = send_frame(512 * 1024)
    scanner = FrameScanner()
    passed = bytearray()
    for start in range(0, len(big), 65536):
        for piece in scanner.feed(big[start:start + 65536]):
            assert not isinstance(piece, Frame)
            passed += piece
        assert scanner.buffered < 64  # only a frame head is ever held
    assert passed == big and scanner.at_frame_boundary


@given(st.lists(st.sampled_from(["send", "ping", "flow", "lookup", "big"]), min_size=1, max_size=12),
       st.lists(st.integers(min_value=1, max_value=5000), min_size=1, max_size=30), st.booleans())
@settings(max_examples=150, deadline=None)
def test_any_frames_split_anywhere_reassemble_exactly(kinds: list[str], cuts: list[int], want: bool) -> None:
    makers = {"send": lambda: send_frame(50), "ping": lambda: PING, "flow": lambda: FLOW,
              "lookup": lookup_response, "big": lambda: send_frame(9000)}
    data = b"".join(makers[k]() for k in kinds)
    chunks, pos = [], 0
    for cut in cuts:
        chunks.append(data[pos:pos + cut])
        pos += cut
    chunks.append(data[pos:])
    scanner = FrameScanner(wanted={T.LOOKUP_RESPONSE, T.PING} if want else ())
    passed, frames = collect(scanner, [c for c in chunks if c])
    assert passed == data
    expected = [k for k in kinds if k in ("lookup", "ping")] if want else []
    assert [f.type for f in frames] == [T.LOOKUP_RESPONSE if k == "lookup" else T.PING for k in expected]


def test_a_frame_over_the_limit_is_refused_from_its_header() -> None:
    scanner = FrameScanner(max_frame_bytes=1024)
    with pytest.raises(FrameTooLarge):
        scanner.feed(send_frame(2000)[:10])
    with pytest.raises(FrameTooLarge):  # the scanner stays failed
        scanner.feed(PING)


def test_connected_max_message_size_raises_the_limit() -> None:
    scanner = FrameScanner(max_frame_bytes=1024)
    scanner.set_max_message_size(1 << 20)
    passed, _ = collect(scanner, [send_frame(500_000)])
    assert len(passed) > 500_000


@pytest.mark.parametrize(("data", "error"), [
    (b"\x00\x00\x00\x02\x00\x00\x00\x01xx", MalformedFrame),                     # total size too small
    (b"\x00\x00\x00\x10\x00\x00\x00\x20" + b"\x08\x12" + b"\x00" * 10, MalformedFrame),  # cmd size > total
    (b"\x00\x00\x00\x06\x00\x00\x00\x02\x08\x7f", UnknownCommand),               # no such type
    (PING[:4] + PING[4:] + b"", None),
])
def test_hostile_headers_raise_protocol_errors(data: bytes, error: type[Exception] | None) -> None:
    scanner = FrameScanner()
    if error is None:
        scanner.feed(data)
        return
    with pytest.raises(error):
        scanner.feed(data)


def test_a_send_with_a_bad_magic_number_is_refused() -> None:
    frame = bytearray(send_frame(10))
    cmd_size = int.from_bytes(frame[4:8], "big")
    frame[8 + cmd_size] = 0x77
    with pytest.raises(BadMagic):
        FrameScanner().feed(bytes(frame))


def test_a_command_without_payload_carrying_extra_bytes_is_malformed() -> None:
    body = PING[8:] + b"junk"
    data = (len(body) + 4).to_bytes(4, "big") + (len(PING) - 8).to_bytes(4, "big") + body
    with pytest.raises(MalformedFrame):
        FrameScanner().feed(data)


@pytest.mark.parametrize("wanted", [frozenset(), frozenset({T.FLOW})])
def test_a_command_without_payload_carrying_extra_bytes_is_malformed_in_a_read_of_its_own(
        wanted: frozenset[int]) -> None:
    """Unwanted, such a read is the small-read lane's (one whole frame by its sizes); wanted, the scan's: both
    refuse it."""
    body = FLOW[8:] + b"junk"
    data = (len(body) + 4).to_bytes(4, "big") + (len(FLOW) - 8).to_bytes(4, "big") + body
    with pytest.raises(MalformedFrame):
        FrameScanner(1 << 20, wanted).feed(data)


def test_a_peer_closing_mid_frame_is_reported() -> None:
    scanner = FrameScanner()
    scanner.feed(send_frame(1000)[:500])
    with pytest.raises(MalformedFrame):
        scanner.close()


# -- hostile input (issue #12): the scanner's verdicts are FrameDecoder's --------------------------
def _fuzz_module():  # type: ignore[no-untyped-def]
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "fuzz.py"
    spec = importlib.util.spec_from_file_location("pulsar_tap_fuzz", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fuzz = _fuzz_module()


def test_a_one_byte_payload_section_split_across_writes_is_refused_not_looped_on() -> None:
    """Issue #12, item 1: this 17-byte SEND, split after 12 bytes and followed by any byte, hung the proxy."""
    frame = bytes.fromhex("0000000d0000000808063204080110010e")
    scanner = FrameScanner()
    with fuzz.deadline(5):
        assert scanner.feed(frame[:12]) == []
        with pytest.raises(MalformedFrame, match="truncated payload section"):
            scanner.feed(frame[12:] + b"\x00")


@pytest.mark.parametrize("data", [b"\x00\x00\x00\x00", b"\x00\x00\x00\x03"], ids=["zero", "three"])
def test_a_total_size_too_small_for_a_command_is_refused_from_its_four_bytes(data: bytes) -> None:
    """Issue #12, item 7: nothing more needs to arrive to know the frame is wrong."""
    with pytest.raises(MalformedFrame, match="leaves no room for a command"):
        FrameScanner().feed(data)


@pytest.mark.parametrize("cmd_size", [0, 1])
def test_a_command_size_too_small_for_a_type_is_refused_from_its_eight_bytes(cmd_size: int) -> None:
    data = (16).to_bytes(4, "big") + cmd_size.to_bytes(4, "big")
    with pytest.raises(MalformedFrame, match=f"command of {cmd_size} bytes cannot hold a type"):
        FrameScanner().feed(data)


def _frame(command: bytes, payload_section: bytes = b"") -> bytes:
    return (len(command) + len(payload_section) + 4).to_bytes(4, "big") + len(command).to_bytes(4, "big") \
        + command + payload_section


UNDECODABLE = {
    # issue #12, item 6: a FLOW whose sub-command claims 127 bytes of a 20-byte command
    "flow-overrun": (bytes.fromhex("0000001800000014080b5a7f") + bytes(16), "undecodable command"),
    "flow-missing-permits": (_frame(bytes.fromhex("080b5a020801")), "FLOW lacks required fields: messagePermits"),
    "send-cut-varint": (_frame(bytes.fromhex("0806320208ff"), b"\x0e\x01" + bytes(8)), "undecodable SEND"),
    "type-without-sub-command": (_frame(b"\x08\x0b"), "FLOW lacks its sub-command"),
    "lookup-bad-utf8": (encode_command(api.CommandLookupTopic(topic="persistent://public/default/xyz", request_id=1))
                        .replace(b"xyz", b"x\xff\xfe"), "undecodable LOOKUP"),
}


@pytest.mark.parametrize("name", list(UNDECODABLE))
@pytest.mark.parametrize("want_all", [False, True], ids=["fast-path", "wanted"])
def test_an_undecodable_command_is_refused_on_the_fast_path_too(name: str, want_all: bool) -> None:
    """Nothing of it passes through; the error says what is wrong, as FrameDecoder says it."""
    data, message = UNDECODABLE[name]
    scanner = FrameScanner(want_all=want_all)
    with pytest.raises(ProtocolError, match=message):
        scanner.feed(PING + data)
    assert fuzz.decoder_verdict([PING + data], 1 << 20)[1] == fuzz.scanner_verdict([PING + data], frozenset(),
                                                                                      want_all, 1 << 20)[2]


def test_a_bad_command_is_reported_before_a_bad_header_that_follows_it() -> None:
    """Commands checked together per read are still judged in frame order."""
    data, _ = UNDECODABLE["flow-missing-permits"]
    with pytest.raises(ProtocolError, match="FLOW lacks required fields"):
        FrameScanner().feed(FLOW + data + b"\x00\x00\x00\x00")


@st.composite
def mutated_streams(draw: st.DrawFn) -> tuple[bytes, list[int], int]:
    frames = fuzz.corpus()
    picked = draw(st.lists(st.sampled_from(frames), min_size=1, max_size=4))
    data = bytearray(b"".join(picked))
    for _ in range(draw(st.integers(0, 4))):
        at = draw(st.integers(0, len(data) - 1))
        how = draw(st.sampled_from(["set", "insert", "delete", "truncate"]))
        if how == "set":
            data[at] = draw(st.integers(0, 255))
        elif how == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif how == "delete" and len(data) > 1:
            del data[at]
        elif how == "truncate":
            del data[max(at, 1):]
    cuts = draw(st.lists(st.integers(0, len(data)), max_size=6))
    return bytes(data), cuts, draw(st.integers(0, 7))


def _rss() -> int:
    from pathlib import Path

    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_checking_commands_holds_no_memory_from_one_read_to_the_next() -> None:
    """A protobuf message parsed into again keeps its arena: the batch check must not reuse one.

    (Found by bench/soak.py: the proxy grew ~12 MiB a minute at 2 000 messages/s.)
    """
    data = send_frame(20) * 500
    scanner = FrameScanner()
    for _ in range(50):
        scanner.feed(data)
    before = _rss()
    for _ in range(1500):
        scanner.feed(data)
    assert _rss() - before < 24 * 1024 * 1024, "RSS grew with every read"


# -- rows of frames of one size (checked as one array) ---------------------------------------------
def row_of_sends(count: int, body: int = 300, first_seq: int = 0) -> list[bytes]:
    """SENDs of one size, each its own (sequence ids of one varint byte)."""
    frames = [send_frame(body, first_seq + index) for index in range(count)]
    assert len({len(frame) for frame in frames}) == 1 and len(set(frames)) == count
    return frames


def test_a_row_of_frames_of_one_size_passes_through_whole_and_in_order() -> None:
    """Rows long enough to be checked at once, between other frames, split anywhere: the same bytes."""
    data = b"".join(row_of_sends(60)) + FLOW + lookup_response() + b"".join(row_of_sends(30, 20, 60)) + PING
    for cuts in ([], [5], [len(data) // 3], [1000, 1001, 4000], list(range(0, len(data), 4096))):
        scanner = FrameScanner(wanted={T.LOOKUP_RESPONSE})
        chunks = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        passed, frames = collect(scanner, chunks)
        assert passed == data, cuts
        assert [frame.type for frame in frames] == [T.LOOKUP_RESPONSE]
        assert scanner.frames_scanned == 60 + 2 + 30 + 1


def _spoil(frame: bytes, fault: str) -> bytes:
    """One frame of a row made bad, its size kept (so the row's size prefixes still match)."""
    spoilt = bytearray(frame)
    cmd_end = 8 + int.from_bytes(frame[4:8], "big")
    # sequence_id's tag (after size, cmd size, 08 06 32 LEN, producer_id's 08 01): past the 13 bytes a
    # row's frames are compared by, so the frame stays in its row
    sequence_tag = 14
    assert frame[sequence_tag] == 0x10
    if fault == "type":
        spoilt[9] = T.FLOW  # FLOW's tag is not SEND's: not canonical, and FLOW lacks its sub-command
    elif fault == "magic":
        spoilt[cmd_end + 1] = 0x03
    elif fault == "metadata-size":
        spoilt[cmd_end + 6:cmd_end + 10] = (len(frame) - cmd_end).to_bytes(4, "big")
    elif fault == "undecodable-field":
        spoilt[sequence_tag] = 0x17  # field 2, wire type 7: no such wire type
    elif fault == "missing-required":
        spoilt[sequence_tag] = 0x78  # made field 15's: sequence_id missing
    elif fault == "command-length":
        spoilt[11] -= 1  # the sub-command's length no longer fills the command
    return bytes(spoilt)


@pytest.mark.parametrize("fault", ["type", "magic", "metadata-size", "undecodable-field", "missing-required",
                                   "command-length"])
@pytest.mark.parametrize("at", [1, 2, 9, 25, 39])
def test_a_bad_frame_inside_a_row_of_one_size_is_caught_as_frame_by_frame(fault: str, at: int) -> None:
    """Nothing of the bad frame passes, the error is the decoder's, and it is the same fed frame by frame."""
    data = _caught_as_frame_by_frame(row_of_sends(40), at, fault)
    for flags in (0, 4):
        fuzz.check_frames(data, [], flags)


def _caught_as_frame_by_frame(frames: list[bytes], at: int, fault: str) -> bytes:
    """Spoil frame ``at``: the scanner fed all of them at once raises what it raises fed them one by one."""
    frames[at] = _spoil(frames[at], fault)
    data = b"".join(frames)
    with pytest.raises(ProtocolError) as whole:
        FrameScanner().feed(data)
    one_by_one = FrameScanner()
    for frame in frames[:at]:
        one_by_one.feed(frame)
    with pytest.raises(ProtocolError) as single:
        one_by_one.feed(frames[at])
    assert str(whole.value) == str(single.value)
    return data


@st.composite
def mutated_rows(draw: st.DrawFn) -> tuple[bytes, list[int], int]:
    count = draw(st.integers(2, 50))
    body = draw(st.sampled_from([0, 1, 60, 300, 1000]))
    frames = row_of_sends(count, body, draw(st.integers(0, 127 - count)))
    before = draw(st.sampled_from([b"", PING, FLOW + lookup_response()]))
    data = bytearray(before + b"".join(frames) + draw(st.sampled_from([b"", PING, send_frame(body + 1)])))
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(data) - 1))
        data[at] = draw(st.integers(0, 255))
    cuts = draw(st.lists(st.integers(0, len(data)), max_size=4))
    return bytes(data), cuts, draw(st.integers(0, 7))


@given(st.one_of(mutated_streams(), mutated_rows()))
@settings(max_examples=800, deadline=None)
def test_mutated_client_streams_and_rows_of_one_size_get_the_decoders_verdict(
        stream: tuple[bytes, list[int], int]) -> None:
    data, cuts, flags = stream
    with fuzz.deadline(10):
        fuzz.check_frames(data, cuts, flags)


def test_of_two_bad_frames_in_a_row_of_one_size_the_first_is_reported() -> None:
    """The row's commands are checked in frame order, as frame by frame."""
    frames = row_of_sends(40)
    frames[12] = _spoil(frames[12], "missing-required")
    frames[30] = _spoil(frames[30], "undecodable-field")
    with pytest.raises(ProtocolError, match="SEND lacks required fields"):
        FrameScanner().feed(b"".join(frames))
    frames = row_of_sends(40)
    frames[12] = _spoil(frames[12], "undecodable-field")
    frames[30] = _spoil(frames[30], "missing-required")
    with pytest.raises(ProtocolError, match="undecodable SEND"):
        FrameScanner().feed(b"".join(frames))


# -- long rows: commands checked in batches -----------------------------------------------------------
def long_row(count: int) -> list[bytes]:
    """SENDs of one size, more than a parse takes at once (sequence ids of three varint bytes)."""
    frames = [send_frame(60, (1 << 14) + index) for index in range(count)]
    assert len({len(frame) for frame in frames}) == 1
    return frames


class CountingBatch(CommandBatch):
    """The scanner's command batch, remembering how many bytes of fields each parse took, and how often the
    scan ran (it ends in ``verify``; the small-read lane never calls it)."""

    def __init__(self) -> None:
        super().__init__()
        self.parsed: list[int] = []
        self.scans = 0

    def verify(self) -> None:
        self.scans += 1
        if self.pending:
            self.parsed.append(sum(len(fields) for fields in self.pending))
        super().verify()


@pytest.mark.parametrize("cuts", [[], [70_000], list(range(0, 300_000, 65_536))], ids=["whole", "two", "64k"])
def test_a_read_of_thousands_of_commands_parses_them_in_batches_of_bounded_size(cuts: list[int]) -> None:
    """A parse of a whole read's commands took (and gave back) up to a MiB at the heap's top each read:
    every command is checked, a few hundred at a time."""
    frames = long_row(3000)
    data = PING + b"".join(frames[:1000]) + FLOW + b"".join(frames[1000:])
    field_size = int.from_bytes(frames[0][4:8], "big") - 2
    scanner = FrameScanner()
    batch = scanner._checks = CountingBatch()
    chunks = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    passed, _ = collect(scanner, chunks)
    assert passed == data
    assert max(batch.parsed) <= 2 * _CHECKED_TOGETHER * field_size
    # at most every frame's fields were parsed; a row after a plainly valid frame is vouched for by the row
    # check instead (tests/protocol/test_row_checks.py), so here nearly none are
    assert sum(batch.parsed) <= 3000 * field_size + len(FLOW) + len(PING)


@pytest.mark.parametrize("fault", ["undecodable-field", "missing-required"])
@pytest.mark.parametrize("at", [1, 511, 512, 513, 1024, 1025, 1500, 2999])
def test_a_bad_frame_anywhere_in_a_long_row_is_caught_as_frame_by_frame(fault: str, at: int) -> None:
    """Either side of a batch's end: nothing of the bad frame passes, and the error is the decoder's."""
    _caught_as_frame_by_frame(long_row(3000), at, fault)


@pytest.mark.parametrize(("command_at", "header_at", "expected"), [
    (600, 2500, "SEND lacks required fields"), (2500, 600, "exceeds"), (1100, 1101, "SEND lacks required fields")])
def test_of_a_bad_command_and_a_bad_header_in_a_long_row_the_first_is_reported(
        command_at: int, header_at: int, expected: str) -> None:
    frames = long_row(3000)
    frames[command_at] = _spoil(frames[command_at], "missing-required")
    frames[header_at] = (10 << 20).to_bytes(4, "big") + frames[header_at][4:]
    with pytest.raises(ProtocolError, match=expected):
        FrameScanner(max_frame_bytes=1 << 20).feed(b"".join(frames))


# -- the small-read lane: one whole frame per read decides as the scan does -----------------------
def _frame_per_read(scanner: FrameScanner, reads: list[bytes | memoryview], *, lane: bool = True
                    ) -> tuple[list[tuple[str, bytes]], str | None, int, int]:
    """Each read's pieces (kind, bytes), the error if one was raised, frames scanned, frames still to walk
    (``lane``: fed through ``feed``, the small-read lane open; else through ``_feed``, the scan alone)."""
    pieces: list[tuple[str, bytes]] = []
    error = None
    feed = scanner.feed if lane else scanner._feed
    try:
        for read in reads:
            for piece in feed(read):
                pieces.append(("frame", piece.raw) if isinstance(piece, Frame) else ("bytes", bytes(piece)))
    except ProtocolError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return pieces, error, scanner.frames_scanned, scanner._walk


@st.composite
def one_frame_reads(draw: st.DrawFn) -> tuple[list[bytes], int, bool]:
    """Frames of every type (some damaged), each read alone, as a peer answering one request at a time writes them."""
    frames = draw(st.lists(st.sampled_from([*fuzz.corpus(), send_frame(60, 5), FLOW, PING]), min_size=1, max_size=6))
    reads = []
    for frame in frames:
        data = bytearray(frame)
        if draw(st.integers(0, 3)) == 0:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        reads.append(bytes(data))
    return reads, draw(st.integers(0, 7)), draw(st.booleans())


@given(one_frame_reads())
@settings(max_examples=1500, deadline=None)
def test_a_read_of_one_whole_frame_gets_the_scans_verdict_through_the_small_read_lane(
        case: tuple[list[bytes], int, bool]) -> None:
    """The lane a one-frame read takes (``feed``'s own body) hands out, refuses and counts exactly as the scan of
    the same reads does with the lane closed; as bytes and as a view of a receive buffer alike."""
    reads, flags, as_views = case
    wanted, want_all = fuzz.WANTED_CHOICES[flags & 3], flags & 4 != 0
    fed: list[bytes | memoryview] = [memoryview(bytearray(read)) if as_views else read for read in reads]
    with_lane = FrameScanner(1 << 20, wanted, want_all=want_all)
    scan_only = FrameScanner(1 << 20, wanted, want_all=want_all)
    assert _frame_per_read(with_lane, fed) == _frame_per_read(scan_only, fed, lane=False)


def _lane_takes(read: bytes | memoryview) -> bool:
    """Whether a fresh scanner's feed hands ``read`` out through its small-read lane (the scan is not asked)."""
    scanner = FrameScanner(1 << 20, frozenset({T.PING}))
    watch = scanner._checks = CountingBatch()
    try:
        out = scanner.feed(read)
    except ProtocolError:
        assert watch.scans == 1  # (refused by the scan: these reads are all the lane leaves to it)
        return False
    return watch.scans == 0 and out == [read]


def test_the_small_read_lane_takes_a_lone_frame_nobody_wants_and_leaves_the_rest_to_the_scan() -> None:
    """(So the property test above compares the lane with the scan, not the scan with itself.)"""
    send = send_frame(60, 5)
    assert _lane_takes(send)
    assert not _lane_takes(send + PING)     # more than one frame
    assert not _lane_takes(send[:-1])       # not whole
    assert not _lane_takes(PING)            # wanted: handed out as a Frame by the scan
    assert not _lane_takes(send[:12])       # shorter than a frame's head
    cmd_end = 8 + int.from_bytes(send[4:8], "big")
    cut_section = (cmd_end + 5 - 4).to_bytes(4, "big") + send[4:cmd_end] + send[cmd_end:cmd_end + 5]
    assert not _lane_takes(cut_section)     # a SEND whose payload section is cut short
    assert not _lane_takes(memoryview(send))  # a view (a large read's): the scan's
