"""Whole frames back out of RunEvents: what observers that take runs use to see frames.

A :class:`~proxy.core.hooks.RunEvent` is a stretch of one direction's stream that
may begin with the rest of a frame (``lead`` bytes) and end inside one.  A
:class:`RunCutter` per (connection, direction) carries the start of a frame cut at a
run's end into the next run, and uses ``stream_pos`` to notice a run that was
dropped in between (a full queue): the frames the gap cut are lost (counted in
``lost``), never mis-cut, and the frames after the gap are found again from the
next run's ``lead``.  Frames follow Pulsar framing (``[TOTAL_SIZE u32]...``); the
relay checked every one before passing it, so only sizes are read here.
"""

from __future__ import annotations

import struct

_SIZE = struct.Struct(">I")


class RunCutter:
    """One direction of one connection, cut into whole frames; see the module docstring."""

    __slots__ = ("_carry", "_next_pos", "lost")

    def __init__(self) -> None:
        #: the start of a frame that continues in the next run
        self._carry = bytearray()
        #: stream offset the next run starts at if none was dropped (-1: no run seen yet)
        self._next_pos = -1
        #: frames cut by a gap (a dropped run): neither whole nor recorded
        self.lost = 0

    def begin(self, data: bytes | memoryview, lead: int, stream_pos: int) -> tuple[bytes | None, int]:
        """Start on a run: the carried frame if this run completes it, and where whole frames begin in ``data``.

        Walk the whole frames from there (:func:`whole_frames`), then call :meth:`end`.
        """
        follows = stream_pos == self._next_pos or self._next_pos < 0
        carried_until, self._next_pos = self._next_pos, stream_pos + len(data)
        carry, pos = self._carry, 0
        if carry and not follows:
            # the rest of the carried frame was in a dropped run; its end may be this run's lead
            frame_end = carried_until - len(carry) + _SIZE.unpack_from(carry)[0] + 4 if len(carry) >= 4 else -1
            carry.clear()
            self.lost += 1
            if lead and frame_end > stream_pos:
                pos = lead  # the same frame: counted once
        if carry:
            # finish the carried frame with the run's first bytes (the run itself is not copied)
            if len(carry) < 4:
                pos = min(4 - len(carry), len(data))
                carry += data[:pos]
            if len(carry) >= 4:
                take = min(_SIZE.unpack_from(carry)[0] + 4 - len(carry), len(data) - pos)
                carry += data[pos:pos + take]
                pos += take
                if len(carry) == _SIZE.unpack_from(carry)[0] + 4:
                    whole = bytes(carry)
                    carry.clear()
                    return whole, pos
            return None, len(data)  # the run ended inside the carried frame
        if lead and not pos:
            pos = lead  # the rest of a frame whose start was in a dropped run
            if not follows:
                self.lost += 1
        return None, pos

    def end(self, data: bytes | memoryview, pos: int) -> None:
        """The whole frames of ``data`` ended at ``pos``: carry the rest into the next run."""
        if pos < len(data):
            self._carry += data[pos:]


def whole_frames(data: bytes, pos: int) -> tuple[list[tuple[int, int]], int]:
    """(start, end) of each whole frame in ``data`` from ``pos``, and where the first partial one starts."""
    spans: list[tuple[int, int]] = []
    end = len(data)
    unpack = _SIZE.unpack_from
    while end - pos >= 4:
        frame_end = pos + unpack(data, pos)[0] + 4
        if frame_end > end:
            break
        spans.append((pos, frame_end))
        pos = frame_end
    return spans, pos


#: frames of one size in a row worth counting by stride (below, one by one costs less)
_STRIDE_FROM = 8


def count_frame_starts(data: bytes | memoryview, lead: int) -> int:
    """How many frames begin in a run (what dropping it loses, as far as one can tell).

    The proxy counts every frame of each run it drops, on the relay's path, so this must
    cost much less than the frames' walk: where a frame is followed by frames of its own
    size (a producer's messages mostly are), each of the four bytes of the size prefix is
    compared across all of them at once (a strided slice, ``lstrip``), and the walk jumps
    past the frames whose prefixes match.  The count is the same as frame by frame.
    """
    pos, end, count = lead, len(data), 0
    unpack = _SIZE.unpack_from
    while pos < end:
        if end - pos < 4:
            return count + 1
        prefix = data[pos:pos + 4]
        size = unpack(prefix)[0] + 4
        if (end - pos) // size < _STRIDE_FROM:
            count += 1
            pos += size
            continue
        # frames in a row from ``pos`` whose size prefix is this one, byte column by byte column
        same = min(len(column) - len(column.lstrip(prefix[index:index + 1]))
                   for index in range(4) for column in (bytes(data[pos + index:end:size]),))
        count += same
        pos += same * size
    return count


__all__ = ["RunCutter", "count_frame_starts", "whole_frames"]
