"""Keepalive, sans-IO: when to PING a peer, when it is dead, and PONG for its PINGs.

Pulsar binary protocol, "Keep Alive": either side may send PING at any time and
the other answers PONG.  Apache Pulsar's ``PulsarHandler`` pings every interval and
closes a connection that sent nothing at all during the interval after its PING.
:class:`Keepalive` is that policy for one peer, shared by the proxy (one per side
of a relayed connection), the embedded broker and the built-in client.  Two
schedules: ``every_interval`` is Pulsar's own (a PING at every tick of a fixed-rate
timer, busy or not; dead when nothing at all came since the previous tick's PING) —
the embedded broker and the built-in client use it, as a peer can tell the
difference; the default pings only a peer silent for a whole interval, for the
proxy, which must not add frames to a busy stream it relays.

- the owner sets :attr:`Keepalive.last_rx_ns` whenever anything arrives from the
  peer (a plain attribute: the relay does it per read, on its fast path);
- :meth:`Keepalive.poll` says what is due: nothing, a PING (from then on counted
  as sent), or the verdict that the peer is dead — silent for an interval after
  the PING;
- :meth:`Keepalive.answer` is the reply a frame from the peer asks for (PONG to a
  PING);
- a relay, where PINGs from the other side pass through too, pairs the peer's
  PONGs with the PINGs in order (:meth:`Keepalive.ping_relayed`,
  :meth:`Keepalive.pong_received`) so that it swallows only the PONGs its own
  PINGs asked for.

Time comes in as ``now_ns`` (a monotonic clock); nothing here does I/O.
"""

from __future__ import annotations

import enum
from collections import deque
from typing import Final

from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.commands import T
from proxy.protocol.frame import encode_command

PING_FRAME: Final = encode_command(api.CommandPing())
PONG_FRAME: Final = encode_command(api.CommandPong())

#: PONGs a peer may owe at once; a peer owing more is dead by the policy long before, so the
#: oldest pairing is forgotten (the deque drops it) rather than let a hostile peer grow the queue.
MAX_OWED_PONGS: Final = 1024


class KeepaliveStep(enum.Enum):
    WAIT = "wait"
    PING = "ping"
    DEAD = "dead"


class Keepalive:
    """One end's keepalive towards one peer; see the module docstring."""

    __slots__ = ("interval_ns", "last_rx_ns", "ping_sent_ns", "every_interval", "next_tick_ns", "_owed")

    def __init__(self, interval_ns: int, now_ns: int, *, every_interval: bool = False) -> None:
        self.interval_ns = interval_ns
        #: Pulsar's schedule: a PING at each tick, not only after a silence
        self.every_interval = every_interval
        #: the fixed-rate timer's next tick (``every_interval``)
        self.next_tick_ns = now_ns + interval_ns
        #: when anything last arrived from the peer (its owner keeps this current)
        self.last_rx_ns = now_ns
        #: when the latest PING went to the peer (None: never)
        self.ping_sent_ns: int | None = None
        # The PONGs the peer owes, oldest first: True answers a PING of ours, False one relayed.
        self._owed: deque[bool] = deque(maxlen=MAX_OWED_PONGS)

    def idle_ns(self, now_ns: int) -> int:
        """How long the peer has been silent."""
        return now_ns - self.last_rx_ns

    def poll(self, now_ns: int) -> KeepaliveStep:
        """What is due at ``now_ns``; PING means the caller sends :data:`PING_FRAME` now."""
        if self.every_interval:
            return self._tick(now_ns)
        sent = self.ping_sent_ns
        if sent is not None and self.last_rx_ns < sent:
            # our PING is out and nothing came back since: the peer has an interval to show life
            return KeepaliveStep.DEAD if now_ns - sent >= self.interval_ns else KeepaliveStep.WAIT
        if now_ns - self.last_rx_ns < self.interval_ns:
            return KeepaliveStep.WAIT
        self.ping_sent_ns = now_ns
        self._owed.append(True)
        return KeepaliveStep.PING

    def _tick(self, now_ns: int) -> KeepaliveStep:
        if now_ns < self.next_tick_ns:
            return KeepaliveStep.WAIT
        if now_ns - self.next_tick_ns >= self.interval_ns:
            # more than a whole tick behind (the owner's clock started elsewhere, or it stalled):
            # start the timer again from now rather than judge the peer on a tick nobody saw
            self.next_tick_ns = now_ns + self.interval_ns
            return KeepaliveStep.WAIT
        self.next_tick_ns += self.interval_ns
        sent = self.ping_sent_ns
        if sent is not None and self.last_rx_ns < sent:
            return KeepaliveStep.DEAD  # nothing at all since the previous tick's PING
        self.ping_sent_ns = now_ns
        self._owed.append(True)
        return KeepaliveStep.PING

    @staticmethod
    def answer(frame_type: int) -> bytes | None:
        """The frame to send back for a frame of ``frame_type`` from the peer: PONG to a PING."""
        return PONG_FRAME if frame_type == T.PING else None

    def ping_relayed(self) -> None:
        """A PING from the other side went to the peer through this end: its PONG is not ours."""
        self._owed.append(False)

    def pong_received(self) -> bool:
        """The peer sent a PONG: True if it answers one of our own PINGs (a relay swallows it)."""
        return self._owed.popleft() if self._owed else False


__all__ = ["MAX_OWED_PONGS", "PING_FRAME", "PONG_FRAME", "Keepalive", "KeepaliveStep"]
