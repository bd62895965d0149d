"""What happens to one frame: a :class:`Verdict`, the one decision type from rules engine to relay.

The rules engine returns it (:mod:`proxy.rules.engine`, each action class of
:mod:`proxy.rules.actions` building its own), the relay's sans-IO pipeline carries it
out (``proxy.core.pipeline``); nothing translates it in between.  Frames are
addressed by side (``to_client`` / ``to_broker``), not relative to the sender, so a
rule on either direction reads the same.  Order of effects for one frame:

1. hold the frame ``delay_s`` from its arrival — later frames of the same direction
   wait behind it (none overtakes it) but are not delayed by it beyond its own
   release, so frames in flight are delayed side by side; with a ``lane`` only the
   frames of that lane wait (throttling one producer must not slow another
   producer on the same connection; see ``proxy.core.holding``);
2. write the frame (``replacement`` instead of its bytes when set; nothing when
   ``forward`` is false), in writes of ``slice_bytes`` when that is > 0;
3. write the extra frames ``to_client`` and ``to_broker`` (answers on the broker's
   behalf, a duplicate, close requests): those towards the frame's sender answer it,
   those towards its receiver follow the frame;
4. schedule every :class:`Deferred` frame ``after_s`` from now, independent of the
   frame queue (released FLOW permits);
5. close both sides when ``close`` is ``"close"`` (FIN) or ``"reset"`` (RST).

``record`` asks the recorder to keep this frame when record rules select what is
recorded; ``fired`` names every rule that hit (for metrics and span events),
``marks`` the labels of ``mark`` rules (tags for the trace span of this frame).
No trio, no I/O: a value.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from proxy.core.holding import Poll


@dataclass(frozen=True, slots=True)
class Deferred:
    """A frame the proxy originates later: ``after_s`` seconds from the verdict — ``data``, or, with ``poll``,
    what the poll gives then (see :data:`proxy.core.holding.Poll`; ``data`` is empty)."""

    after_s: float
    to_broker: bool
    data: bytes
    poll: Poll | None = None


@dataclass(frozen=True, slots=True)
class Verdict:
    forward: bool = True
    replacement: bytes | None = None
    to_client: tuple[bytes, ...] = ()
    to_broker: tuple[bytes, ...] = ()
    delay_s: float = 0.0
    lane: Hashable | None = None
    slice_bytes: int = 0
    close: str | None = None
    deferred: tuple[Deferred, ...] = ()
    record: bool = False
    fired: tuple[str, ...] = ()
    marks: tuple[str, ...] = ()

    @property
    def changes_traffic(self) -> bool:
        """False when the frame passes untouched and nothing else is sent."""
        return not (self.forward and self.replacement is None and not self.to_client and not self.to_broker
                    and self.delay_s == 0.0 and self.slice_bytes == 0 and self.close is None
                    and not self.deferred)


#: the frame passes untouched (the relay tests for this very object: ``verdict is FORWARD``)
FORWARD: Final = Verdict()
#: the frame is swallowed
DROP: Final = Verdict(forward=False)
