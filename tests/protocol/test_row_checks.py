"""A row of frames of one size is spared the parse only where check_command would have passed every frame.

The scanner checks a row of same-size frames at once; their sub-command fields are
parsed, unless the frame before the row is plainly valid (:func:`plainly_valid`): then a
frame whose field agrees with that one's on every bit its :func:`row_mask` keeps (tags,
lengths, bools, varints' continuation bits) is left out of the parse
(``proxy.core.scanner._unplain_fields``).  Held here to :func:`check_command`, the oracle:
rows of plain fields with other values, and rows with one frame damaged anywhere (a tag, a
length, a continuation bit, a varint grown to ten bytes, a bool of 2, a missing required
field), any row length; and the scanner's verdict on the whole row to check_frame's.
"""

from __future__ import annotations

import contextlib
import random
import struct
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from proxy.core import scanner as scanner_module
from proxy.core.scanner import FrameScanner, Piece
from proxy.errors import ProtocolError
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import Frame
from proxy.protocol.validation import SUB_TAGS, check_command, check_frame, plainly_valid

PAYLOAD = b"\x0e\x01\x00\x00\x00\x00\x00\x00\x00\x02\x08\x01xyz"
T = api.BaseCommand
#: per plain type, its fields in order: (tag, kind, required); kind "id" is a MessageIdData
FORMS: dict[int, list[tuple[int, str, bool]]] = {
    T.SEND: [(0x08, "u64", True), (0x10, "u64", True), (0x18, "u32", False), (0x20, "u64", False),
             (0x28, "u64", False), (0x30, "u64", False), (0x38, "bool", False), (0x40, "bool", False)],
    T.SEND_RECEIPT: [(0x08, "u64", True), (0x10, "u64", True), (0x1A, "id", False), (0x20, "u64", False)],
    T.MESSAGE: [(0x08, "u64", True), (0x12, "id", True), (0x18, "u32", False), (0x28, "u64", False)],
    T.FLOW: [(0x08, "u64", True), (0x10, "u32", True)],
}
#: tags a damaged tag byte becomes: the forms' own (a field out of order, twice, a required one gone), others
TAGS = [0x08, 0x09, 0x0A, 0x10, 0x12, 0x18, 0x1A, 0x20, 0x28, 0x30, 0x38, 0x40, 0x48, 0x50, 0x0D]


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out) + bytes([value])


@st.composite
def varint_sizes(draw: st.DrawFn, kind: str) -> int:
    """A value's size in bytes as the plain forms allow it: up to 9 (64-bit) or 4 (32-bit)."""
    return draw(st.sampled_from([1, 1, 2, 3, 9, *range(1, 10)] if kind != "u32" else [1, 2, 3, 4]))


#: a number from ``low`` to ``high``: drawn by hypothesis, or from a seeded Random for a long row
Integers = Callable[[int, int], int]


def _drawn(draw: st.DrawFn) -> Integers:
    return lambda low, high: draw(st.integers(low, high))


def _value_of_size(integer: Integers, size: int) -> bytes:
    low = 0 if size == 1 else 1 << 7 * (size - 1)
    return _varint(integer(low, (1 << 7 * size) - 1))


@st.composite
def plain_layouts(draw: st.DrawFn) -> tuple[int, list[tuple[int, str, int]]]:
    """A plain form's type and its fields: (tag, kind, value size; for an id: ledgerId's size * 16 + entryId's)."""
    type_ = draw(st.sampled_from(sorted(FORMS)))
    layout = []
    for tag, kind, required in FORMS[type_]:
        if required or draw(st.booleans()):
            if kind == "id":
                layout.append((tag, kind, draw(varint_sizes("u64")) * 16 + draw(varint_sizes("u64"))))
            else:
                layout.append((tag, kind, 1 if kind == "bool" else draw(varint_sizes(kind))))
    return type_, layout


def _fill(integer: Integers, type_: int, layout: list[tuple[int, str, int]], bools: list[int] | None = None,
          record: list[int] | None = None) -> bytes:
    """A sub-command field of ``layout`` with values drawn anew (the same sizes: the same frame size);
    its bools ``bools`` if given; the bools it writes added to ``record``."""
    body = b""
    bools = list(bools) if bools is not None else None
    for tag, kind, size in layout:
        if kind == "id":
            inner = b"\x08" + _value_of_size(integer, size // 16) + b"\x10" + _value_of_size(integer, size % 16)
            body += bytes([tag, len(inner)]) + inner
        elif kind == "bool":
            body += bytes([tag, bools.pop(0) if bools else integer(0, 1)])
            if record is not None:
                record.append(body[-1])
        else:
            body += bytes([tag]) + _value_of_size(integer, size)
    return SUB_TAGS[type_] + bytes([len(body)]) + body


def _damage(draw: st.DrawFn, field: bytes) -> bytes:
    """``field`` damaged once, its size kept."""
    how = draw(st.sampled_from(["byte", "tag", "continuation", "longer", "bool 2", "none"]))
    at = draw(st.integers(0, len(field) - 1))
    event(f"damage: {how}")
    if how == "byte":
        return field[:at] + bytes([draw(st.integers(0, 255))]) + field[at + 1:]
    if how == "tag":  # a tag (or anything) turned into another field's tag: out of order, twice, required one gone
        return field[:at] + bytes([draw(st.sampled_from(TAGS))]) + field[at + 1:]
    if how == "continuation":
        return field[:at] + bytes([field[at] ^ 0x80]) + field[at + 1:]
    if how == "longer":  # a varint's last byte continued: ten bytes from a nine-byte one, or eating the next tag
        ends = [index for index in range(3, len(field)) if field[index - 1] >= 0x80 and field[index] < 0x80]
        if ends:
            at = draw(st.sampled_from(ends))
            return field[:at] + bytes([field[at] | 0x80]) + field[at + 1:]
    if how == "bool 2" and field[0] == SUB_TAGS[T.SEND][0]:
        bools = [index for index in range(2, len(field) - 1) if field[index] in (0x38, 0x40)
                 and field[index + 1] <= 1]
        if bools:
            at = draw(st.sampled_from(bools)) + 1
            return field[:at] + bytes([draw(st.integers(2, 255))]) + field[at + 1:]
    return field


def _frame(type_: int, field: bytes) -> bytes:
    command = b"\x08" + bytes([type_]) + field
    payload = PAYLOAD if type_ in (T.SEND, T.MESSAGE) else b""
    return struct.pack(">II", 4 + len(command) + len(payload), len(command)) + command + payload


def _command_verdict(type_: int, field: bytes) -> tuple[str, str]:
    command = b"\x08" + bytes([type_]) + field
    try:
        check_command(command, 0, len(command))
    except ProtocolError as exc:
        return type(exc).__name__, str(exc)
    return "passed", ""


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_frame_left_out_of_the_parse_passes_check_command(data: st.DataObject) -> None:
    """The frame after a plainly valid one, of its size, skips the parse only if check_command passes it."""
    type_, layout = data.draw(plain_layouts())
    bools: list[int] = []
    first = _fill(_drawn(data.draw), type_, layout, record=bools)
    assert plainly_valid(first, 0, len(first)), first.hex()
    other = _damage(data.draw, _fill(_drawn(data.draw), type_, layout))
    row = _frame(type_, first) + _frame(type_, other)
    size = len(row) // 2
    left = scanner_module._unplain_fields(row, size, size, len(first), 1)
    assert left is not None
    verdict = _command_verdict(type_, other)
    if left == b"":
        event("left out of the parse")
        assert verdict == ("passed", ""), (first.hex(), other.hex())
        assert plainly_valid(other, 0, len(other)), (first.hex(), other.hex())
    else:
        event(f"parsed: {verdict[0]}")
        assert left == other
    # the same field of other numbers (no damage; the bools are read, so kept) is always left out: the point
    same_layout = _fill(_drawn(data.draw), type_, layout, bools)
    row = _frame(type_, first) + _frame(type_, same_layout)
    assert scanner_module._unplain_fields(row, size, size, len(first), 1) == b""


def _scan_verdict(data: bytes | memoryview) -> tuple[str, str, int]:
    try:
        out = FrameScanner().feed(data)
    except ProtocolError as exc:
        return type(exc).__name__, str(exc), -1
    return "passed", "", sum(len(piece) for piece in out)  # type: ignore[arg-type]


def _oracle(data: bytes) -> tuple[str, str, int]:
    pos = 0
    try:
        while pos < len(data):
            head = check_frame(data, pos, len(data), 1 << 20)
            assert not isinstance(head, int)
            pos += head.frame_size
    except ProtocolError as exc:
        return type(exc).__name__, str(exc), -1
    return "passed", "", pos


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_row_with_frames_damaged_anywhere_gets_check_frames_verdict(data: st.DataObject) -> None:
    """Rows of one size (long enough to be checked as an array, or not), plain or not in front, some frames
    damaged anywhere: the scanner passes them all or closes with the first bad frame's error, word for word."""
    type_, layout = data.draw(plain_layouts())
    count = data.draw(st.sampled_from([1, 2, 9, 10, 30, 700, 1100]))
    integer = random.Random(data.draw(st.integers(0, 2**32))).randint
    fields = [_fill(integer, type_, layout) for _ in range(count)]
    if data.draw(st.integers(0, 5)) == 0:  # the first not plain: an unknown field (every frame is parsed)
        fields = [field[:-2] + b"\x50" + field[-1:] if len(field) > 4 and field[-2] < 0x80 else field
                  for field in fields]
    for _ in range(data.draw(st.integers(0, 3))):
        at = data.draw(st.integers(0, count - 1))
        fields[at] = _damage(data.draw, fields[at])
    row = b"".join(_frame(type_, field) for field in fields)
    assert _scan_verdict(row) == _oracle(row)
    assert _scan_verdict(memoryview(row)) == _oracle(row)  # (a large read's memoryview: the same compare)


# -- the field taken back, rows cut by a sampler, rows split across reads -----------------------------
def _plain_row(count: int, seed: int, type_: int = T.SEND) -> tuple[list[bytes], bytes]:
    """``count`` frames of one size, plain SENDs (or ``type_``) of other values, and the field of the first."""
    integer = random.Random(seed).randint
    layout = [(0x08, "u64", 2), (0x10, "u64", 3), (0x18, "u32", 1), (0x38, "bool", 1)] if type_ == T.SEND \
        else [(0x08, "u64", 2), (0x10, "u32", 3)]
    fields = [_fill(integer, type_, layout, [0]) for _ in range(count)]
    assert all(plainly_valid(field, 0, len(field)) for field in fields)
    return [_frame(type_, field) for field in fields], fields[0]


def test_only_the_plainly_valid_frames_own_field_is_taken_back() -> None:
    """A row after a plainly valid frame takes that frame's field back from the batch, not whatever field of
    its size was put aside last (the scan puts the frame's aside just before; a bad field of that size left
    last by anything else must still be parsed and fail)."""
    frames, first = _plain_row(300, 1)
    data = b"".join(frames)
    size = len(frames[0])
    bad = first[:-1] + b"\x90"  # the same size; its last varint runs off the field: check_command refuses it
    assert _command_verdict(T.SEND, bad)[0] == "CommandDecodeError"
    scanner = FrameScanner()
    scanner._checks.pending.append(bad)
    assert scanner._row_fields(data, size, size, len(first), 299) == b""  # the row: all plain
    assert scanner._checks.pending == [bad]
    with pytest.raises(ProtocolError) as error:
        scanner._checks.verify()
    assert str(error.value) == _command_verdict(T.SEND, bad)[1]
    # the frame's own field, put aside last as the scan does, is taken back: the row then costs no parse
    scanner._checks.pending.extend([bad, memoryview(data)[10:10 + len(first)]])
    assert scanner._row_fields(memoryview(data), size, size, len(first), 299) == b""
    assert scanner._checks.pending == [bad]


def _fed(scanner: FrameScanner, chunks: list[bytes]) -> tuple[str, str, bytes, list[Frame]]:
    """The scanner's verdict on ``chunks`` fed in turn: error (or "passed"), what it let through, its Frames."""
    passed = bytearray()
    frames: list[Frame] = []

    def take(pieces: list[Piece]) -> None:
        for piece in pieces:
            if isinstance(piece, Frame):
                frames.append(piece)
                passed.extend(piece.raw)
            else:
                passed.extend(piece)

    try:
        for chunk in chunks:
            take(scanner.feed(chunk))
        scanner.close()
    except ProtocolError as exc:
        take(scanner.passed_before_error)
        return type(exc).__name__, str(exc), bytes(passed), frames
    return "passed", "", bytes(passed), frames


def _frame_by_frame(data: bytes) -> tuple[str, str, bytes]:
    """check_frame's verdict, frame by frame, and the frames before the first bad one."""
    verdict, message, end = _oracle(data)
    if end >= 0:
        return verdict, message, data
    pos = 0
    with contextlib.suppress(ProtocolError):
        while True:
            head = check_frame(data, pos, len(data), 1 << 20)
            assert not isinstance(head, int)
            pos += head.frame_size
    return verdict, message, data[:pos]


@pytest.mark.parametrize("type_", [T.SEND, T.FLOW])
@pytest.mark.parametrize("bad_at", [None, 0, 1, 150, 299])
def test_a_row_split_across_two_reads_at_every_offset_gets_check_frames_verdict(type_: int, bad_at: int | None) -> None:
    """A row long enough to be compared (after a frame of another size), cut anywhere into two reads, one frame
    damaged or none: what passes and the error, word for word, are check_frame's frame by frame."""
    frames, _ = _plain_row(300, 2, type_)
    if bad_at is not None:
        payload = PAYLOAD if type_ == T.SEND else b""  # its last value byte continued: it runs off the field
        frames[bad_at] = frames[bad_at][:-1 - len(payload)] + b"\x90" + payload
    other = _frame(T.FLOW, bytes.fromhex("5a0408011064"))  # (not of the row's size)
    data = other + b"".join(frames) + other
    expected = _frame_by_frame(data)
    assert (expected[0] == "passed") == (bad_at is None)
    for cut in range(1, len(data)):
        assert _fed(FrameScanner(), [data[:cut], data[cut:]])[:3] == expected, cut


class _Sampler:
    """A sampler of SENDs whose picks, in turn, are settled or not (``unsettled``) and are ``gaps`` apart."""

    kinds = frozenset({T.SEND})
    passed = "passed"

    def __init__(self, gaps: list[int], unsettled: set[int]) -> None:
        self.gaps = gaps
        self.unsettled = unsettled
        self.picks = 0

    def start(self) -> int:
        return self.gaps[0]

    def _next(self) -> tuple[int, int]:
        self.picks += 1
        return self.picks - 1, self.gaps[self.picks % len(self.gaps)]

    def choose(self) -> tuple[object, int]:
        pick, gap = self._next()
        return f"pick {pick}", gap

    def settle(self) -> tuple[object | None, int]:
        pick, gap = self._next()
        return (f"pick {pick}" if pick in self.unsettled else None), gap

    def settle_row(self, skip: int, count: int) -> tuple[int, object | None, int]:
        at = skip
        while at < count:
            note, gap = self.settle()
            if note is not None:
                return at, note, gap
            at += gap + 1
        return count, None, at - count


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_rows_cut_by_a_sampler_get_check_frames_verdict_and_hand_out_its_picks(data: st.DataObject) -> None:
    """SENDs of one size under a sampler whose picks are settled in the row (``settle_row``, rows of hundreds,
    cut where a pick is not settled) or chosen (rows cut at each pick), some frames damaged, fed in a few
    reads: check_frame's verdict word for word, and the picks handed out are the sampler's, in order."""
    count = data.draw(st.sampled_from([200, 700, 1300]))
    frames, _ = _plain_row(count, data.draw(st.integers(0, 2**32)))
    gaps = data.draw(st.lists(st.sampled_from([0, 1, 5, 127, 128, 129, 200, 600]), min_size=1, max_size=6))
    unsettled = set(data.draw(st.lists(st.integers(0, 12), max_size=4)))
    settle = data.draw(st.booleans())
    # the picks, every gaps-th SEND: those handed out (not settled, or all when chosen) and their notes
    picks, at, pick = [], gaps[0], 0
    while at < count:
        if not settle or pick in unsettled:
            picks.append((at, f"pick {pick}"))
        pick += 1
        at += gaps[pick % len(gaps)] + 1
    for _ in range(data.draw(st.integers(0, 2))):  # anywhere, or a frame handed out (where a row is cut)
        at = data.draw(st.sampled_from([pick for pick, _ in picks]) if picks and data.draw(st.booleans())
                       else st.integers(0, count - 1))
        field = frames[at][10:-len(PAYLOAD)]
        frames[at] = _frame(T.SEND, _damage(data.draw, field))
    stream = b"".join(frames)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=3)))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    scanner = FrameScanner()
    scanner.set_wanted((), sampler=_Sampler(gaps, unsettled), settle=settle)
    verdict, message, passed, handed = _fed(scanner, chunks)
    expected = _frame_by_frame(stream)
    assert (verdict, message, passed) == expected
    size = len(frames[0])
    picks = [(at, note) for at, note in picks if at < len(expected[2]) // size]  # (those before a bad frame)
    assert [(frame.raw, frame.draw) for frame in handed] == [
        (stream[at * size:(at + 1) * size], note) for at, note in picks[:len(handed)]]
    if verdict == "passed":
        assert len(handed) == len(picks)
