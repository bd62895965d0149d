"""The relay's fast path: find and check frame boundaries without building Frames.

Pulsar framing (``[TOTAL_SIZE u32][CMD_SIZE u32][BaseCommand]...``, see
``proxy.protocol.frame``) lets the proxy find every frame from its 8-byte header.
:class:`FrameScanner` checks each frame exactly as :class:`~proxy.protocol.frame.FrameDecoder`
does (both run :func:`~proxy.protocol.validation.check_frame`: sizes, the command,
the payload section up to its metadata size) and reaches the same verdict for any
input split anywhere, but it passes frames nobody asked to see through as slices of
the received buffer, so a run of unchanged frames leaves as one write, and a large
frame streams through once its head is checked.  Frames whose type is *wanted* (the
proxy's own: CONNECT, LOOKUP_RESPONSE, ...; plus whatever a rule or an observer
needs) are buffered whole and returned as :class:`~proxy.protocol.frame.Frame`
objects.  Memory per direction is bounded by the largest wanted frame (the frame
limit) plus one receive buffer.

The common case costs a few comparisons per frame: a command in canonical form
(``08 TYPE`` then exactly the sub-command field, as every Pulsar client and broker
writes it) with a plain payload section is recognised from the header's bytes, and
its sub-command field is put aside; the fields of one ``feed`` are parsed a few
hundred at a time, in frame order (:class:`~proxy.protocol.validation.CommandBatch`),
all before anything is handed out.  Where such a frame is followed by frames of its size (a producer's
messages mostly are), the row is checked as one numpy array: the same header bytes,
the same payload magic, a metadata size that fits, and their sub-command fields joined
into the batch in one copy; the row ends at the first frame that differs, which is
checked alone.  Anything else goes through :func:`check_frame` itself.

Two refinements let a hook (the rules) see fewer frames:

- a *sampler* (:class:`Sampler`) picks, for some command types, which of their frames
  are handed out, before anything is decoded: the scanner passes the frames it says to
  pass over, and notes on each frame of those types that it hands out (:attr:`Frame.draw`)
  whether the sampler chose it.  With ``settle`` (nobody observes the frames), a pick the
  sampler settles itself (:meth:`Sampler.settle`) is passed through like the others, and a
  row of one size is not cut at such picks (:meth:`Sampler.settle_row`): only a pick it does
  not settle ends the row, with that frame handed out;
- *barrier* types are frames after which what is wanted may grow (a producer registered
  on a topic a rule names): the rest of the bytes of that ``feed`` are handed out as
  Frames, and the wants the user sets after handling the barrier apply from the next
  ``feed``.

It raises the same errors as FrameDecoder (FrameTooLarge, MalformedFrame, BadMagic,
UnknownCommand, CommandDecodeError) and is unusable after.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Iterable
from typing import Final

import numpy

from proxy.core.interest import Sampler
from proxy.core.rows import column, leading_same
from proxy.errors import ProtocolError
from proxy.protocol.commands import PAYLOAD_TYPES, TYPE_NAMES
from proxy.protocol.frame import DEFAULT_MAX_FRAME_BYTES, FRAME_PADDING, Frame
from proxy.protocol.validation import (
    MAGIC_CHECKSUM,
    SUB_TAGS,
    CommandBatch,
    FrameHead,
    check_frame,
    closed_mid_frame,
    frame_size_of,
    plainly_valid,
    row_mask,
)

#: What the scanner hands out: bytes to pass through unchanged, or a whole wanted Frame.
Piece = bytes | memoryview | Frame

#: size prefix, command size, the command's first four bytes, the fifth
_HEAD = struct.Struct(">IIIB")
_HEAD_BYTES: Final = _HEAD.size
#: magic, checksum, metadata size
_SECTION = struct.Struct(">HII")

# Per type, how a frame is treated (bits).
_PAYLOAD: Final = 1       # SEND / MESSAGE: a payload section follows the command
_WANTED: Final = 2        # buffered whole and returned as a Frame
_SAMPLED: Final = 4       # the sampler decides whether it is handed out (unless it is wanted anyway)
_BARRIER: Final = 8       # wanted; after it, the rest of the feed is handed out whole
#: a frame of these kinds needs a second look
_LOOK: Final = _WANTED | _SAMPLED
#: frames of one size a row must hold (after the one checked alone) to be checked as one array
_STRIDE_FROM: Final = 8
#: after a row came out shorter than that, frames checked one by one before trying again
_WALK_FOR: Final = 64
#: canonical commands parsed together by one CommandBatch.verify.  A parse takes some 90 bytes
#: of protobuf arena per command: a whole read's worth (256 KiB of 100 B SENDs, or of 20 B
#: receipts: 2 600 to 13 000 commands) took 0.2-1 MiB at the top of the heap, and freeing it
#: there let glibc trim the heap back on every read whenever its (history-dependent) trim
#: threshold was below that, so the next read faulted every page in again — 40 000 page faults
#: a second, 15 % of the 100 B frames' throughput.  Batches of this many come from and go back
#: to malloc's free lists; at ~1.5 us per parse they add ~3 ns per frame.
_CHECKED_TOGETHER: Final = 512
_SIZE = struct.Struct(">I")
#: numpy types of the fields a row of frames is compared by: the head, the payload's magic, its metadata size
_HEAD_FIELD: Final = numpy.dtype(f"V{_HEAD_BYTES}")
_MAGIC_FIELD: Final = numpy.dtype("V2")
_METADATA_SIZE: Final = numpy.dtype(">u4")
#: rows shorter than this are parsed, not compared: the compare's numpy calls cost some 10 us a row, a parse
#: ~75 ns a field.  Per frame of 1 KiB SENDs, compared over parsed: rows of 63 (64 KiB reads) 1.27x, of 127
#: 1.05x (slower), of 159 to 255 0.8-1.0x; of 100 B SENDs the threshold makes no difference (rows of ~650)
_ROW_CHECK_FROM: Final = 128
#: the type of the words a row's sub-command fields are compared by (see _unplain_fields)
_WORD: Final = numpy.dtype("<u8")


def _u32(data: bytes, at: int) -> int:
    """The big-endian u32 at ``at`` (the small-read lane's fields: compiled, integer arithmetic only)."""
    return data[at] << 24 | data[at + 1] << 16 | data[at + 2] << 8 | data[at + 3]


@functools.lru_cache(maxsize=256)
def _fast_tables(wanted: frozenset[int], want_all: bool, sampled: frozenset[int] = frozenset(),
                 barrier: frozenset[int] = frozenset()) -> tuple[dict[int, int], dict[int, int], list[int]]:
    """How the fast path recognises a canonical command and what it does with it.

    A canonical command opens ``08 TYPE TAG LENGTH`` (as a big-endian u32 ``word``).
    For a one-byte TAG (types up to 15), LENGTH is ``cmd_size - 4``, so ``word -
    cmd_size`` is the same for every such command of a type: the first table maps it
    to the type's kind bits.  For a two-byte TAG, the word is fixed and LENGTH is the
    fifth byte: the second table maps the word.  The third is the kind per type
    (shared by every scanner with these wants).
    """
    by_type = [0] * 256
    short: dict[int, int] = {}
    long: dict[int, int] = {}
    for value in TYPE_NAMES:
        kind = (_PAYLOAD if value in PAYLOAD_TYPES else 0) | (_WANTED if want_all or value in wanted else 0)
        if value in sampled:
            kind |= _SAMPLED
        if value in barrier:
            kind |= _WANTED | _BARRIER
        by_type[value] = kind
        tag = SUB_TAGS[value]
        if len(tag) == 1:
            short[((0x08 << 24) | (value << 16) | (tag[0] << 8)) - 4] = kind
        else:
            long[(0x08 << 24) | (value << 16) | (tag[0] << 8) | tag[1]] = kind
    return short, long, by_type


class FrameScanner:
    """Splits one direction of a connection into pass-through runs and wanted Frames."""

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 wanted: Iterable[int] = (), *, want_all: bool = False) -> None:
        self.max_frame_bytes = max_frame_bytes
        #: a frame whose checks have not all passed yet, or a wanted frame not yet whole
        self._carry = bytearray()
        #: the carried frame, once its checks have passed
        self._head: FrameHead | None = None
        #: bytes the carry must hold before the next check can run
        self._need = 4
        #: bytes of a passed-through frame still to come, and that frame's size
        self._skip = 0
        self._skip_frame = 0
        self._checks = CommandBatch()
        self._error: ProtocolError | None = None
        self._short: dict[int, int] = {}
        self._long: dict[int, int] = {}
        self._classes: list[int] = []
        #: the tables set_wanted chose, and those in force after a barrier frame (until the feed ends)
        self._chosen_tables: tuple[dict[int, int], dict[int, int], list[int]] = ({}, {}, [])
        self._wide_tables = self._chosen_tables
        self._widened = False
        self._sampler: Sampler | None = None
        #: what the sampler is asked about a frame of its kinds nobody else wants: choose, or settle
        self._pick: Callable[[], tuple[object | None, int]] | None = None
        #: whether its picks are settled (then a row of its kinds settles those inside it, unbroken)
        self._settles = False
        #: frames of the sampler's kinds still to pass over before it picks one
        self._sample_skip = 0
        #: whether the carried frame is handed out as a Frame, and the note it carries
        self._carry_wanted = False
        self._carry_note: object = None
        self.wanted: frozenset[int] = frozenset()
        self.want_all = False
        self.barrier: frozenset[int] = frozenset()
        self.frames_scanned = 0
        #: when ``feed`` raised: what it had handed out of that read before the bad frame began,
        #: whole frames that passed every check (and the rest of a frame passing through)
        self.passed_before_error: list[Piece] = []
        #: frames still to check one by one before a row of one size is tried again
        self._walk = 0
        self.set_wanted(wanted, want_all=want_all)

    # -- configuration ---------------------------------------------------------------------
    def set_wanted(self, wanted: Iterable[int], *, want_all: bool = False, sampler: Sampler | None = None,
                   barrier: Iterable[int] = (), settle: bool = False) -> None:
        """Choose which command types come out as Frames (takes effect at the next frame).

        ``sampler`` picks among the frames of its kinds (a new sampler starts counting anew;
        the same one goes on); with ``settle``, a frame it picks that is not wanted otherwise
        is first offered to it to settle alone.  After a frame of a ``barrier`` type, the
        rest of the feed is handed out whole.
        """
        self.wanted = frozenset(wanted)
        self.want_all = want_all
        self.barrier = frozenset(barrier)
        if sampler is not self._sampler:
            self._sampler = sampler
            self._sample_skip = sampler.start() if sampler is not None else 0
        self._pick = None if sampler is None else sampler.settle if settle else sampler.choose
        self._settles = sampler is not None and settle
        sampled = sampler.kinds if sampler is not None else frozenset()
        self._chosen_tables = _fast_tables(self.wanted, want_all, sampled, self.barrier)
        self._wide_tables = _fast_tables(self.wanted, True, sampled, self.barrier) if self.barrier \
            else self._chosen_tables
        if not self._widened:
            self._short, self._long, self._classes = self._chosen_tables

    def set_max_message_size(self, max_message_size: int) -> None:
        """Adopt the broker's ``max_message_size`` from CONNECTED (plus framing room)."""
        self.max_frame_bytes = max_message_size + FRAME_PADDING

    @property
    def at_frame_boundary(self) -> bool:
        """No frame is half passed through or half buffered."""
        return self._skip == 0 and not self._carry

    @property
    def passing_through(self) -> int:
        """Bytes of a passed-through frame still to come: the next ``feed`` hands them out first."""
        return self._skip

    @property
    def buffered(self) -> int:
        return len(self._carry)

    # -- scanning --------------------------------------------------------------------------
    def feed(self, data: bytes | memoryview) -> list[Piece]:
        """Scan received bytes; returns pass-through slices and wanted Frames, in order.

        Slices may reference ``data``: use them before the next call.  On a frame that fails a
        check it raises that check's error (and again on every later call); what it would have
        handed out of ``data`` before that frame is then in :attr:`passed_before_error`.

        Its own body is the small-read lane: a read of exactly one whole frame that nobody wants,
        at a frame boundary, is ``[data]``, as :meth:`_feed` (the scan) hands it out, after the same
        checks (its fast path's) and the same effects; the common small read (a request, a receipt,
        one message) costs a third of the scan's setup this way.  It takes ``bytes`` only (a small
        read's; a large one's memoryview is the scan's) and reads their fields byte by byte: integer
        arithmetic, compiled, where a ``struct`` unpack made a tuple of objects to compare (a 100 B
        SEND's lane 1.4 -> 0.37 us).  (It is this method's body, not a method of its own, because it
        runs twice per round trip: a call level less.)  Any other read goes to the scan, and so does
        this one before the lane changed anything.
        """
        if self._skip or self._carry or self._error is not None or not isinstance(data, bytes):
            return self._feed(data)
        end = len(data)
        if end < _HEAD_BYTES or end > self.max_frame_bytes or _u32(data, 0) + 4 != end:
            return self._feed(data)
        cmd_size, word = _u32(data, 4), _u32(data, 8)
        kind = self._short.get(word - cmd_size, -1) if 3 < cmd_size < 132 else -1
        if kind < 0 and data[12] + 5 == cmd_size and data[12] < 128:
            kind = self._long.get(word, -1)
        cmd_end = 8 + cmd_size
        if kind & _LOOK or cmd_end > end:  # (not found, -1, has every bit)
            return self._feed(data)
        if kind & _PAYLOAD:
            if cmd_end + 10 > end or (data[cmd_end] << 8 | data[cmd_end + 1]) != MAGIC_CHECKSUM \
                    or _u32(data, cmd_end + 6) > end - cmd_end - 10:  # (magic, metadata size)
                return self._feed(data)
        elif cmd_end != end:
            return self._feed(data)
        self.frames_scanned += 1  # (counted before its command is checked, as the scan counts)
        if self._walk:
            self._walk -= 1
        if not plainly_valid(data, 10, cmd_end):
            try:
                self._checks.verify_one(data[10:cmd_end])
            except ProtocolError as exc:
                self._error = exc
                raise exc from None
        return [data]

    def _feed(self, data: bytes | memoryview) -> list[Piece]:
        """:meth:`feed` without its small-read lane: the scan."""
        if self._error is not None:
            raise self._error
        out: list[Piece] = []
        scan_from = scan_out = -1
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
                scan_from, scan_out = pos, len(out)
                self._scan(data, pos, out)
            self._checks.verify()
            if self._widened:  # a barrier frame widened the wants for the rest of this feed only
                self._widened = False
                self._short, self._long, self._classes = self._chosen_tables
        except ProtocolError as exc:
            error = exc
            try:
                self._checks.verify()  # a command put aside before the failing frame fails first
            except ProtocolError as earlier:
                error = earlier
            self._checks.clear()
            self._error = error
            if scan_from >= 0:  # (a carried frame that fails is the read's first: nothing passed before it)
                self.passed_before_error = out[:scan_out] + _up_to_bad_frame(
                    data, scan_from, out[scan_out:], self.max_frame_bytes)
            raise error from None
        return out

    def close(self) -> None:
        """The peer closed: raise MalformedFrame if it stopped in the middle of a frame."""
        if self._error is not None or self.at_frame_boundary:
            return
        if self._carry:
            self._error = closed_mid_frame(len(self._carry), frame_size_of(self._carry, 0, len(self._carry)))
        else:
            self._error = closed_mid_frame(self._skip_frame - self._skip, self._skip_frame)
        raise self._error

    def _complete_carry(self, data: bytes | memoryview, pos: int, out: list[Piece]) -> int:
        """Grow the carried frame until its checks pass (and, if it is wanted, until it is whole)."""
        carry = self._carry
        end = len(data)
        head = self._head
        while head is None:
            take = min(self._need - len(carry), end - pos)
            carry += data[pos:pos + take]
            pos += take
            if len(carry) < self._need:
                return pos
            checked = check_frame(carry, 0, len(carry), self.max_frame_bytes)
            if isinstance(checked, int):
                self._need = checked  # always more than the carry holds: every check makes progress
                continue
            head = self._head = checked
            kind = self._classes[head.type]
            self._carry_wanted = bool(kind & _WANTED)
            if kind & _SAMPLED and self._sampler is not None:
                if self._sample_skip:
                    self._sample_skip -= 1
                    self._carry_note = self._sampler.passed
                elif kind & _WANTED:
                    self._carry_note, self._sample_skip = self._sampler.choose()
                else:
                    assert self._pick is not None
                    self._carry_note, self._sample_skip = self._pick()
                    self._carry_wanted = self._carry_note is not None
        size = head.frame_size
        if self._carry_wanted:
            take = min(size - len(carry), end - pos)
            carry += data[pos:pos + take]
            pos += take
            if len(carry) < size:
                return pos
            frame = Frame(bytes(carry), head.type, head.cmd_size, verified=True)
            frame.draw, self._carry_note = self._carry_note, None
            out.append(frame)
            if self._classes[head.type] & _BARRIER:
                self._widen()
        else:
            out.append(bytes(carry))
            self._skip = size - len(carry)
            self._skip_frame = size
        carry.clear()
        self._head = None
        self._carry_wanted = False
        self._carry_note = None
        self._need = 4
        self.frames_scanned += 1
        return pos

    def _widen(self) -> None:
        """A barrier frame: hand out the rest of this feed whole (the wants may grow once it is handled)."""
        self._widened = True
        self._short, self._long, self._classes = self._wide_tables

    def _scan(self, data: bytes | memoryview, pos: int, out: list[Piece]) -> None:
        end = len(data)
        run_start = pos
        short_kind = self._short.get
        long_kind = self._long.get
        classes = self._classes
        limit = self.max_frame_bytes
        unpack_head = _HEAD.unpack_from
        unpack_section = _SECTION.unpack_from
        checks = self._checks
        put_aside = checks.pending.append
        check_at = _CHECKED_TOGETHER
        sampler = self._sampler
        pick = self._pick
        sample_skip = self._sample_skip
        unpack_size = _SIZE.unpack_from
        walk = self._walk
        settles = self._settles
        scanned = 0
        while pos < end:
            if scanned >= check_at:  # (at most 2 * _CHECKED_TOGETHER commands put aside, see there)
                checks.verify()
                put_aside = checks.pending.append
                check_at = scanned + _CHECKED_TOGETHER
            # The fast path: a canonical command (its sub-command field is parsed with the
            # batch) and a plain payload section, recognised from a few header bytes.
            kind = -1
            if end - pos >= _HEAD_BYTES:
                total, cmd_size, word, fifth = unpack_head(data, pos)
                if 3 < cmd_size < 132:
                    kind = short_kind(word - cmd_size, -1)
                if kind < 0 and fifth + 5 == cmd_size and fifth < 128:
                    kind = long_kind(word, -1)
                if kind >= 0:
                    frame_end = pos + 4 + total
                    cmd_end = pos + 8 + cmd_size
                    if total + 4 > limit or cmd_end > frame_end:
                        kind = -1
                    elif kind & _PAYLOAD:
                        # (read past a frame too short to hold them, they fail the size check)
                        if end - cmd_end < 10:
                            kind = -1
                        else:
                            magic, _, metadata_size = unpack_section(data, cmd_end)
                            if magic != MAGIC_CHECKSUM or metadata_size > frame_end - cmd_end - 10:
                                kind = -1
                    elif frame_end != cmd_end or frame_end > end:
                        kind = -1
                    if kind >= 0:
                        put_aside(data[pos + 10:cmd_end])
            checked = None
            if kind < 0:
                checked = check_frame(data, pos, end, limit)
                if isinstance(checked, int):
                    self._carry += data[pos:]
                    self._need = checked - pos
                    break
                type_, cmd_size = checked.type, checked.cmd_size
                frame_end = pos + checked.frame_size
                kind = classes[type_]
            if kind & _LOOK:
                if sample_skip and not kind & _WANTED:
                    sample_skip -= 1  # a frame of the sampler's kinds it passes over, like any nobody wants
                else:
                    # wanted, or picked by the sampler: handed out whole (unless the sampler settled it)
                    note = None
                    if kind & _SAMPLED:  # (there is a sampler: its kinds are the only ones with this bit)
                        if sample_skip:
                            sample_skip -= 1
                            note = sampler.passed  # type: ignore[union-attr]
                        elif kind & _WANTED:
                            note, sample_skip = sampler.choose()  # type: ignore[union-attr]
                        else:
                            note, sample_skip = pick()  # type: ignore[misc]
                    if kind & _WANTED or note is not None:
                        if checked is None:
                            type_ = (word >> 16) & 0x7F
                        if frame_end > end:
                            # checked, but not whole yet: carried until it is
                            self._head = FrameHead(frame_end - pos, cmd_size, type_, None)
                            self._carry_wanted = True
                            self._carry_note = note
                            self._carry += data[pos:]
                            break
                        if run_start < pos:
                            out.append(memoryview(data)[run_start:pos])
                        frame = Frame(bytes(data[pos:frame_end]), type_, cmd_size, verified=True)
                        frame.draw = note
                        out.append(frame)
                        scanned += 1
                        pos = run_start = frame_end
                        if kind & _BARRIER and not self._widened:
                            self._widen()
                            short_kind, long_kind, classes = self._short.get, self._long.get, self._classes
                        continue
            scanned += 1
            if frame_end > end:
                # Passed through as it arrives: the rest of this frame needs no look.
                self._skip = frame_end - end
                self._skip_frame = frame_end - pos
                pos = end
                break
            size = frame_end - pos
            pos = frame_end
            if walk:
                walk -= 1
            elif checked is None and (not kind & _LOOK or (kind & _LOOK == _SAMPLED and (
                    settles or sample_skip >= _STRIDE_FROM))) \
                    and end - pos >= _STRIDE_FROM * size and unpack_size(data, pos)[0] == total:
                # A producer's frames mostly come in rows of one size: check the row at once (of
                # the sampler's kinds, as many as it passes over before its next pick, unless it
                # settles its picks: then the picks inside the row are settled in order)
                sampled = kind & _SAMPLED
                rows = _same_frames(data, pos, size, cmd_size, kind & _PAYLOAD,
                                    sample_skip if sampled and not settles else -1)
                if rows < _STRIDE_FROM:
                    walk = _WALK_FOR
                if rows and sampled:
                    if sample_skip < rows:
                        at, note, sample_skip = sampler.settle_row(sample_skip, rows)  # type: ignore[union-attr]
                        if note is not None:
                            # a pick it could not settle: the row ends with that frame, handed out
                            put_aside = self._put_aside_row(
                                self._row_fields(data, pos, size, cmd_size - 2, at + 1), cmd_size - 2)
                            pos += at * size
                            if run_start < pos:
                                out.append(memoryview(data)[run_start:pos])
                            frame = Frame(bytes(data[pos:pos + size]), (word >> 16) & 0x7F, cmd_size, verified=True)
                            frame.draw = note
                            out.append(frame)
                            scanned += at + 1
                            pos = run_start = pos + size
                            continue
                    else:
                        sample_skip -= rows
                if rows:
                    put_aside = self._put_aside_row(self._row_fields(data, pos, size, cmd_size - 2, rows),
                                                    cmd_size - 2)
                    scanned += rows
                    pos += rows * size
        self._walk = walk
        self._sample_skip = sample_skip
        self.frames_scanned += scanned
        if run_start < pos:
            out.append(data if run_start == 0 and pos == end else memoryview(data)[run_start:pos])

    def _row_fields(self, data: bytes | memoryview, pos: int, size: int, field_size: int, rows: int) -> bytes:
        """The joined sub-command fields of a row from ``pos`` that need a parse (:func:`_unplain_fields`).

        Rows shorter than ``_ROW_CHECK_FROM`` are all parsed.  When the frame before the row is plainly
        valid, its own field needs no parse either: the last field put aside (that frame's, as the scan
        puts each aside just before it tries a row) is taken back if it holds the same bytes, so that
        only a plainly valid field is ever taken back, whatever was put aside last.
        """
        fields = _unplain_fields(data, pos, size, field_size, rows) if rows >= _ROW_CHECK_FROM else None
        if fields is None:
            return bytes(column(data, pos + 10, rows, size, f"V{field_size}").tobytes())
        pending = self._checks.pending
        start = pos - size + 10
        if pending and pending[-1] == data[start:start + field_size]:
            pending.pop()
        return fields

    def _put_aside_row(self, fields: bytes, field_size: int) -> Callable[[bytes | bytearray | memoryview], None]:
        """Put aside the joined command fields of a row (``field_size`` bytes each) in batches of
        ``_CHECKED_TOGETHER``, parsing each batch but the last now; returns the batch's new ``pending.append``."""
        checks = self._checks
        step = _CHECKED_TOGETHER * field_size
        view = memoryview(fields)
        start = 0
        while len(fields) - start > step:
            checks.pending.append(view[start:start + step])
            checks.verify()
            start += step
        checks.pending.append(view[start:] if start else fields)
        return checks.pending.append


def _up_to_bad_frame(data: bytes | memoryview, start: int, pieces: list[Piece], limit: int) -> list[Piece]:
    """``pieces`` (what a scan of ``data`` from ``start`` handed out, in order) cut, or completed
    with the run it had not handed out yet, where the first frame that fails a check begins.

    The scan checks commands in batches, so when one fails its run may already hold that frame
    and those after it: the frames are walked again one by one, every check each (only ever
    after an error).  Nothing is kept if the walk finds no bad frame (it always should).
    """
    pos, end = start, len(data)
    try:
        while pos < end:
            head = check_frame(data, pos, end, limit)
            if isinstance(head, int):
                return []
            pos += head.frame_size
        return []
    except ProtocolError:
        pass
    keep = pos - start
    kept: list[Piece] = []
    for piece in pieces:
        if not keep:
            break
        if isinstance(piece, Frame):
            size = len(piece.raw)
        else:
            size = len(piece)
            if size > keep:  # (a run of passed-through frames; a Frame is never cut: it ends before)
                piece = memoryview(piece)[:keep]
                size = keep
        kept.append(piece)
        keep -= size
    if keep:  # the run the scan had not handed out yet when it stopped (frames nobody wants)
        kept.append(memoryview(data)[pos - keep:pos])
    return kept


def _same_frames(data: bytes | memoryview, pos: int, size: int, cmd_size: int,
                 payload: int, most: int) -> int:
    """How many whole frames from ``pos`` (``most`` at the most, unless negative) pass the fast path's checks
    as the frame before them did.

    The frame before ``pos`` (``size`` bytes, a canonical command of ``cmd_size``) passed
    them alone.  A frame after it passes them too when its first 13 bytes (sizes, the
    command's type and its field's tag and length) are the same, and, for a payload
    command, its payload section's magic is and its metadata size fits — exactly what
    :meth:`FrameScanner._scan` reads of each frame.  Returns the row's length up to the
    first frame that differs (checked one by one after).
    """
    count = (len(data) - pos) // size
    if 0 <= most < count:
        count = most
    # (the frames' fields as rows of one array, the frame before them first: numpy compares
    # a byte string field of each row at once)
    heads = column(data, pos - size, count + 1, size, _HEAD_FIELD)
    differs = heads[1:] != heads[0]
    cmd_end = 8 + cmd_size
    if payload:
        magics = column(data, pos - size + cmd_end, count + 1, size, _MAGIC_FIELD)
        differs |= magics[1:] != magics[0]
        differs |= column(data, pos + cmd_end + 6, count, size, _METADATA_SIZE) > size - cmd_end - 10
    return leading_same(differs)


def _unplain_fields(data: bytes | memoryview, pos: int, size: int, field_size: int, rows: int) -> bytes | None:
    """The sub-command fields (``field_size`` bytes each), joined, of those of the ``rows`` frames of ``size``
    bytes from ``pos`` that still need a parse, if the frame before them is plainly valid (else None: all do).

    Then a frame whose field agrees with that one's on every bit its :func:`row_mask` keeps (tags,
    lengths, bools, the varints' continuation bits) is plainly valid too, and needs no parse.  The
    row is compared eight bytes at a time, as columns of 64-bit words (the last word ends with the
    field; a word reaching back before the field reads the frame's head, masked out).  Only the
    frames that differ are returned, in order (any error is the first bad frame's all the same:
    the frames left out are valid).
    """
    start = pos - size + 10
    first = bytes(data[start:start + field_size])
    mask = row_mask(first, 0, field_size)
    if mask is None:
        return None
    differs = None
    at = 0
    while at < field_size:
        if at + 8 > field_size:
            at = field_size - 8
        word_mask = int.from_bytes(bytes(-at if at < 0 else 0) + mask[at if at > 0 else 0:at + 8], "little")
        words = column(data, start + at, rows + 1, size, _WORD)
        these = ((words[1:] ^ words[0]) & numpy.uint64(word_mask)) != 0
        differs = these if differs is None else differs | these
        at += 8
    if differs is None or not differs.any():
        return b""
    return bytes(column(data, pos + 10, rows, size, f"V{field_size}")[differs].tobytes())

