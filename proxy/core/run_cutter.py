"""Whole frames back out of RunEvents: what observers that take runs use to see frames.

A :class:`~proxy.core.hooks.RunEvent` is a stretch of one direction's stream that
may begin with the rest of a frame (``lead`` bytes) and end inside one.  A
:class:`RunCutter` per (connection, direction) carries the start of a frame cut at a
run's end into the next run, and uses ``stream_pos`` to notice a run that was
dropped in between (a full queue): the frames the gap cut are lost (counted in
``lost``), never mis-cut, and the frames after the gap are found again from the
next run's ``lead``.  Frames follow Pulsar framing (``[TOTAL_SIZE u32]...``); the
relay checked every one before passing it, so only sizes are read here.

Who counts a frame the gap cut depends on who counted the dropped run.  An observer
whose runs were dropped uncounted (the observer hub's queue) reads ``lost``: every
frame the gap touched.  The recorder counts the frames that begin in each run it
drops (:func:`count_frame_starts`), so it reads ``cut_short`` instead: the frames
whose start this cutter saw and whose end it never did (a gap, or the end of the
stream, :meth:`RunCutter.finish`) — the only ones nobody else counted.
"""

from __future__ import annotations

import struct

from proxy.core.rows import column, leading_same

_SIZE = struct.Struct(">I")


class RunCutter:
    """One direction of one connection, cut into whole frames; see the module docstring."""

    __slots__ = ("_carry", "_next_pos", "cut_short", "lost")

    def __init__(self) -> None:
        #: the start of a frame that continues in the next run
        self._carry = bytearray()
        #: stream offset the next run starts at if none was dropped (-1: no run seen yet)
        self._next_pos = -1
        #: frames cut by a gap (a dropped run): neither whole nor recorded
        self.lost = 0
        #: frames begun in a run seen here whose end was not (in a dropped run, or the stream ended)
        self.cut_short = 0

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
            self.cut_short += 1
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

    def passes_whole(self, lead: int, stream_pos: int, size: int) -> bool:
        """True when a run of ``size`` bytes that the caller found to be whole frames is read as it lies.

        Nothing carried and no ``lead``: the cutter moves past the run, as :meth:`begin` (answering
        ``(None, 0)``) and then :meth:`end` at its end would.  False: nothing changed, take the
        :meth:`begin` way.  (A relay that reads frames as fast as they come hands over runs of one.)
        """
        if lead or self._carry:
            return False
        self._next_pos = stream_pos + size
        return True

    def end(self, data: bytes | memoryview, pos: int) -> None:
        """The whole frames of ``data`` ended at ``pos``: carry the rest into the next run."""
        if pos < len(data):
            self._carry += data[pos:]

    def finish(self) -> int:
        """The stream ended: a frame begun and not finished is given up (in ``cut_short``); 1 if there was one."""
        if not self._carry:
            return 0
        self._carry.clear()
        self.cut_short += 1
        return 1


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


#: frames of one size in a row worth comparing at once (below, one by one costs less)
_STRIDE_FROM = 32
#: after frames of one size came in shorter rows than that, frames walked one by one before trying again
_WALK_FOR = 64
#: a frame's size prefix, as numpy reads it
_PREFIX = ">u4"


def count_frame_starts(data: bytes | memoryview, lead: int) -> int:
    """How many frames begin in a run (what dropping it loses, as far as one can tell).

    The proxy counts every frame of each run it drops, on the relay's path, so this must
    cost much less than the frames' walk: where a frame is followed by one of its own size
    (a producer's messages mostly are), the size prefixes at that stride are read as one
    array and compared at once, and the walk jumps past those that match.  Where sizes
    vary, it walks frame by frame for a while before it tries that again.  The count is
    the same as frame by frame.
    """
    pos, end, count = lead, len(data), 0
    unpack = _SIZE.unpack_from
    while pos < end:
        if end - pos < 4:
            return count + 1
        size = unpack(data, pos)[0] + 4
        if end - pos >= _STRIDE_FROM * size and unpack(data, pos + size)[0] + 4 == size:
            # the size prefixes at this stride that lie whole in data, up to the first that differs
            prefixes = column(data, pos, (end - pos - 4) // size + 1, size, _PREFIX)
            same = leading_same(prefixes != prefixes[0])
            count += same
            pos += same * size
            if same >= _STRIDE_FROM:
                continue
        else:
            count += 1
            pos += size
        for _ in range(_WALK_FOR):  # sizes vary here: the next frames one by one
            if pos >= end:
                return count
            count += 1
            if end - pos < 4:
                return count
            pos += unpack(data, pos)[0] + 4
    return count


__all__ = ["RunCutter", "count_frame_starts", "whole_frames"]
