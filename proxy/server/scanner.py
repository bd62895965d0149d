"""The relay's fast path: find frame boundaries in a byte stream without decoding commands.

Pulsar framing (``[TOTAL_SIZE u32][CMD_SIZE u32][BaseCommand]...``, see
``proxy.protocol.frame``) lets the proxy find every frame from its 8-byte header
and read the command type from the next two bytes (tag 0x08, one-byte varint).
:class:`FrameScanner` does only that for frames nobody asked to see: it validates
the sizes, the type and (for SEND/MESSAGE) the payload magic, and passes the bytes
through as slices of the received buffer, so a run of unchanged frames leaves as
one write, and a large frame streams through without being buffered whole.
Frames whose type is *wanted* (the proxy's own: CONNECT, LOOKUP_RESPONSE, ...;
plus whatever a rule or an observer needs) are buffered whole and returned as
:class:`~proxy.protocol.frame.Frame` objects.  Memory per direction is bounded by
the largest wanted frame (the frame limit) plus one receive buffer.

It raises the same errors as :class:`~proxy.protocol.frame.FrameDecoder`
(FrameTooLarge, MalformedFrame, BadMagic, UnknownCommand) and is unusable after.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterable
from typing import Final

from proxy.errors import BadMagic, FrameTooLarge, MalformedFrame, ProtocolError, UnknownCommand
from proxy.protocol.commands import PAYLOAD_TYPES, TYPE_NAMES, type_name
from proxy.protocol.frame import (
    DEFAULT_MAX_FRAME_BYTES,
    FRAME_PADDING,
    MAGIC_BROKER_ENTRY_METADATA,
    MAGIC_CHECKSUM,
    Frame,
    parse_payload_section,
    peek_type,
)

#: What the scanner hands out: bytes to pass through unchanged, or a whole wanted Frame.
Piece = bytes | memoryview | Frame

_HEADER = struct.Struct(">II")
#: size prefix, command size, and the two bytes holding the command type
_HEAD_BYTES: Final = 10

# Per type byte, how the fast path treats a frame (one list lookup per frame).
_INVALID: Final = 0       # not a type any protocol version defines
_PLAIN: Final = 1         # a command without payload, passed through
_PAYLOAD: Final = 2       # SEND / MESSAGE, passed through after checking the magic
_WANTED: Final = 3        # buffered whole and returned as a Frame
_GOOD_MAGIC: Final = frozenset({MAGIC_CHECKSUM, MAGIC_BROKER_ENTRY_METADATA})


class FrameScanner:
    """Splits one direction of a connection into pass-through runs and wanted Frames."""

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 wanted: Iterable[int] = (), *, want_all: bool = False) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._carry = bytearray()
        self._skip = 0
        self._error: ProtocolError | None = None
        self._classes: list[int] = []
        self.wanted: frozenset[int] = frozenset()
        self.want_all = False
        self.frames_scanned = 0
        self.set_wanted(wanted, want_all=want_all)

    # -- configuration ---------------------------------------------------------------------
    def set_wanted(self, wanted: Iterable[int], *, want_all: bool = False) -> None:
        """Choose which command types come out as Frames (takes effect at the next frame)."""
        self.wanted = frozenset(wanted)
        self.want_all = want_all
        self._classes = _class_table(self.wanted, want_all)

    def set_max_message_size(self, max_message_size: int) -> None:
        """Adopt the broker's ``max_message_size`` from CONNECTED (plus framing room)."""
        self.max_frame_bytes = max_message_size + FRAME_PADDING

    @property
    def at_frame_boundary(self) -> bool:
        """No frame is half passed through or half buffered."""
        return self._skip == 0 and not self._carry

    @property
    def buffered(self) -> int:
        return len(self._carry)

    # -- scanning --------------------------------------------------------------------------
    def feed(self, data: bytes | memoryview) -> list[Piece]:
        """Scan received bytes; returns pass-through slices and wanted Frames, in order.

        Slices may reference ``data``: use them before the next call.
        """
        if self._error is not None:
            raise self._error
        out: list[Piece] = []
        try:
            pos, end = 0, len(data)
            while pos < end and (self._skip or self._carry):
                if self._skip:
                    take = min(self._skip, end - pos)
                    out.append(data if take == end else memoryview(data)[pos:pos + take])
                    self._skip -= take
                    pos += take
                else:
                    pos = self._complete_carry(data, pos, out)
            if pos < end:
                self._scan(data, pos, out)
        except ProtocolError as exc:
            self._error = exc
            raise
        return out

    def close(self) -> None:
        """The peer closed: raise MalformedFrame if it stopped in the middle of a frame."""
        if self._error is None and not self.at_frame_boundary:
            pending = len(self._carry) + self._skip
            self._error = MalformedFrame(f"connection closed mid-frame ({pending} bytes missing or pending)")
            raise self._error

    def _needed(self, head: bytearray) -> int:
        """How many bytes of a carried frame the scanner must hold before deciding about it."""
        if len(head) < _HEAD_BYTES:
            return _HEAD_BYTES
        total: int
        cmd_size: int
        total, cmd_size = _HEADER.unpack_from(head, 0)
        frame_size = total + 4
        if frame_size > self.max_frame_bytes or cmd_size < 2 or cmd_size > total - 4:
            return _HEAD_BYTES  # let _scan raise with the header at hand
        kind = self._classes[head[9]] if head[8] == 0x08 else _WANTED
        if kind == _WANTED:
            return frame_size
        if kind == _PAYLOAD:
            return min(frame_size, 8 + cmd_size + 2)
        return _HEAD_BYTES

    def _complete_carry(self, data: bytes | memoryview, pos: int, out: list[Piece]) -> int:
        carry = self._carry
        end = len(data)
        while True:
            need = self._needed(carry)
            if len(carry) >= need:
                break
            take = min(need - len(carry), end - pos)
            carry += data[pos:pos + take]
            pos += take
            if len(carry) < need:
                return pos
        held = bytes(carry)
        carry.clear()
        self._scan(held, 0, out)
        return pos

    def _scan(self, data: bytes | memoryview, pos: int, out: list[Piece]) -> None:
        end = len(data)
        run_start = pos
        classes = self._classes
        limit = self.max_frame_bytes
        unpack = _HEADER.unpack_from
        scanned = 0
        while end - pos >= _HEAD_BYTES:
            total, cmd_size = unpack(data, pos)
            frame_end = pos + total + 4
            if total + 4 > limit or cmd_size < 2 or cmd_size > total - 4:
                self._bad_header(total, cmd_size)
            # A command that does not open with its type field needs a full decode.
            kind = classes[data[pos + 9]] if data[pos + 8] == 0x08 else _WANTED
            if kind == _PLAIN:
                if total != cmd_size + 4:
                    raise MalformedFrame(f"{type_name(data[pos + 9])} carries {total - 4 - cmd_size} "
                                         "unexpected bytes after its command")
            elif kind == _PAYLOAD:
                magic_at = pos + 8 + cmd_size
                if total == cmd_size + 4:
                    raise MalformedFrame(f"{type_name(data[pos + 9])} has no payload section")
                if end < magic_at + 2:
                    break
                magic = (data[magic_at] << 8) | data[magic_at + 1]
                if magic not in _GOOD_MAGIC:
                    raise BadMagic(f"bad magic {magic:#06x} in payload section (expected 0x0e01)")
            elif kind == _WANTED:
                if frame_end > end:
                    break
                if run_start < pos:
                    out.append(memoryview(data)[run_start:pos])
                out.append(_build_frame(bytes(data[pos:frame_end]), cmd_size))
                scanned += 1
                pos = run_start = frame_end
                continue
            else:
                raise UnknownCommand(data[pos + 9])
            scanned += 1
            if frame_end > end:
                # Passed through as it arrives: the rest of this frame needs no look.
                self._skip = frame_end - end
                pos = end
                break
            pos = frame_end
        self.frames_scanned += scanned
        if run_start < pos:
            out.append(data if run_start == 0 and pos == end else memoryview(data)[run_start:pos])
        if pos < end:
            self._carry += data[pos:]

    def _bad_header(self, total: int, cmd_size: int) -> None:
        if total + 4 > self.max_frame_bytes:
            raise FrameTooLarge(total + 4, self.max_frame_bytes)
        if total < 4:
            raise MalformedFrame(f"total size {total} leaves no room for the command size")
        if cmd_size > total - 4:
            raise MalformedFrame(f"command size {cmd_size} exceeds total size {total}")
        raise MalformedFrame(f"command of {cmd_size} bytes cannot hold a type")


@functools.lru_cache(maxsize=256)
def _class_table(wanted: frozenset[int], want_all: bool) -> list[int]:
    """Per type byte, how the fast path treats a frame (shared by every scanner with these wants)."""
    classes = [_INVALID] * 256
    for value in range(256):
        if value >= 0x80:
            classes[value] = _WANTED  # a multi-byte varint: only a full decode can tell
        elif value in TYPE_NAMES:
            if want_all or value in wanted:
                classes[value] = _WANTED
            else:
                classes[value] = _PAYLOAD if value in PAYLOAD_TYPES else _PLAIN
    return classes


def _build_frame(raw: bytes, cmd_size: int) -> Frame:
    """A Frame for one whole frame's bytes, validated as FrameDecoder validates it."""
    frame_type = peek_type(raw, 8, 8 + cmd_size)
    frame = Frame(raw, frame_type, cmd_size)
    if len(raw) > 8 + cmd_size:
        if frame_type not in PAYLOAD_TYPES:
            raise MalformedFrame(f"{type_name(frame_type)} carries {len(raw) - 8 - cmd_size} "
                                 "unexpected bytes after its command")
        frame._payload = parse_payload_section(raw, 8 + cmd_size)
    elif frame_type in PAYLOAD_TYPES:
        raise MalformedFrame(f"{type_name(frame_type)} has no payload section")
    return frame
